"""The `meshax` command: train a model on any mesh and layout, or plan one without running it.

    meshax train mnist --mesh "rows:2;cols:4" --layout "batch:rows;hidden:cols" --steps 300
    meshax train cnn --mesh "rows:2;cols:4" --layout "h:rows;w:cols" --steps 300
    meshax train lm --model tiny --mesh "all:8" --layout "batch:all" --steps 500
    meshax launch -n 2 --devices-per-process 4 -- meshax train mnist --mesh "rows:2;cols:4"
    meshax plan seq2seq --model paper-ff65536 --mesh "rows:16;cols:32" \\
        --layout "batch:rows;vocab:cols;d_ff:cols;heads:cols" --batch-size 256 --length 256
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gc
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable

DEFAULT_LAYOUTS = {
    "mlp": "batch:rows;hidden:cols",
    "mnist": "batch:rows;hidden:cols",
    "cnn": "h:rows;w:cols",
    "unet": "h:rows;w:cols",
    "lm": "batch:rows;vocab:cols;d_ff:cols;heads:cols",
    "seq2seq": "batch:rows;vocab:cols;d_ff:cols;heads:cols",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line on stderr (exit 2) that names the flag and the value."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind, low: float, high: float, what: str):
    """An argparse type: a `kind` (int or float) in [low, high)."""

    def parse(text: str):
        try:
            value = kind(text)
            ok = math.isfinite(value) and low <= value < high
        except (ValueError, OverflowError):
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in its message
    return parse


_COUNT = _number(int, 1, 2**31, "a whole number from 1 to 2**31 - 1")
_NATURAL = _number(int, 0, 2**31, "a whole number from 0 to 2**31 - 1")
_SEED = _number(int, 0, 2**32, "a whole number from 0 to 2**32 - 1")
_RATE = _number(float, 0.0, math.inf, "a number >= 0")
_LR = _number(float, 0.0, 2.0**128, "a number from 0 to 3.4e38 (the largest float32: steps compute in it)")


def _parser() -> argparse.ArgumentParser:
    from meshax import __version__
    from meshax.models.transformer import GSPMD_SHARDINGS

    p = _Parser(prog="meshax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"meshax {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, helptext in (
        ("train", "train a model"),
        ("plan", "print layouts and costs; run nothing"),
        ("generate", "lm/seq2seq: decode from a checkpoint (sampling or beam search)"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument(
            "task",
            choices=list(DEFAULT_LAYOUTS),
            help="mlp: the paper's two-layer net; mnist: the README's classifier; cnn: a convolutional "
            "digits classifier; unet: a U-Net segmenting synthetic images; "
            "lm: a Transformer language model; seq2seq: a Transformer encoder-decoder",
        )
        s.add_argument("--mesh", default="rows:2;cols:4", help='named mesh dims (default "rows:2;cols:4")')
        s.add_argument(
            "--layout",
            default=None,
            help=f'layout rules tensor_dim:mesh_dim; "" = replicated (default per task: {DEFAULT_LAYOUTS})',
        )
        s.add_argument(
            "--weight-layout",
            default=None,
            metavar="RULES",
            help="layout rules for weight-shaped tensors (weights, their gradients and optimizer state) instead of "
            '--layout, e.g. "d_model:x;heads:y;d_ff:y" (GSPMD\'s 2D sharding); "... except [vocab,d_model]" leaves '
            "the weights of that shape to --layout",
        )
        s.add_argument("--backend", choices=["simd", "placement"], default="simd")
        s.add_argument(
            "--sharding",
            default="",
            choices=["", *GSPMD_SHARDINGS],
            help="lm/seq2seq: annotate the tensors of the GSPMD paper's Table 1 (mesh dims x and y) and "
            "let propagation lay out the rest; the layout rules still apply",
        )
        s.add_argument(
            "--model",
            default=None,
            help="lm/seq2seq: a preset (default tiny; small, paper-ff2048 .. paper-ff65536, gspmd-64b .. gspmd-1t, "
            "gspmd-16b-narrow)",
        )
        s.add_argument(
            "--dtype",
            choices=["float32", "bfloat16", "float16"],
            default=None,
            help="lm/seq2seq: the computation's dtype; bfloat16 and float16 keep float32 master weights, optimizer "
            "state, layer-norm statistics, softmax, logits, loss and weight-gradient sums; float16 trains with "
            "dynamic loss scaling (default float32)",
        )
        s.add_argument(
            "--attention",
            choices=["einsum", "fused"],
            default=None,
            help="lm/seq2seq: einsum (any layout; default) or fused (jax.nn.dot_product_attention per device, "
            "cuDNN on a GPU; the sequence dims stay whole)",
        )
        s.add_argument(
            "--remat",
            action="store_true",
            default=None,
            help="lm/seq2seq: recompute each layer's activations in the backward pass (less memory, more compute)",
        )
        s.add_argument(
            "--pipeline-stages",
            type=_COUNT,
            default=None,
            metavar="S",
            help='lm/seq2seq: pipeline each layer stack in S stages over a dim "stage" (name it in --layout, '
            'e.g. "stage:rows")',
        )
        s.add_argument(
            "--microbatches", type=_COUNT, default=None, metavar="M", help="with --pipeline-stages: microbatches"
        )
        s.add_argument(
            "--circular-repeats",
            type=_COUNT,
            default=None,
            metavar="R",
            help="with --pipeline-stages: the circular schedule, R passes through the stages",
        )
        s.add_argument(
            "--moe-experts",
            type=_COUNT,
            default=None,
            metavar="E",
            help='lm/seq2seq: every other feed-forward block a mixture of E experts (dims "experts", '
            '"expert_hidden"; e.g. --layout "batch:rows;experts:rows")',
        )
        s.add_argument("--batch-size", type=_COUNT, default=None)
        s.add_argument("--length", type=_COUNT, default=None, help="lm/seq2seq: sequence length")
        s.add_argument("--hidden", type=_COUNT, default=None, help="mlp/mnist: hidden units")
        s.add_argument(
            "--data", default=None, help="mnist/cnn: a folder with the four MNIST IDX files (default: digits)"
        )
        s.add_argument("--channels", type=_COUNT, default=None, help="cnn/unet: channels of the first convolution")
        s.add_argument("--image-size", type=_COUNT, default=None, help="unet: pixels per side (default 16)")
        s.add_argument("--spatial-dims", type=int, choices=[2, 3], default=None, help="unet: 2-D images or 3-D volumes")
        s.add_argument(
            "--source", choices=["text", "markov"], default=None, help="lm: bytes of text (default) or a Markov chain"
        )
        s.add_argument("--text", default=None, help="lm: a text file or folder (default: Python's standard library)")
        s.add_argument(
            "--problem", choices=["reverse", "sort"], default=None, help="seq2seq: reverse (default) or sort"
        )
        s.add_argument("--seed", type=_SEED, default=0)
        s.add_argument("--debug", action="store_true", help="show the traceback of an error")
        if name in ("train", "plan"):  # (plan costs the optimizer's collectives and memory too)
            s.add_argument("--optimizer", choices=["adam", "adafactor"], default="adam")
        if name == "train":
            s.add_argument("--steps", type=_NATURAL, default=300)
            s.add_argument("--lr", type=_LR, default=None, help="peak learning rate (adam: 1e-3; adafactor: its own)")
            s.add_argument("--warmup", type=_NATURAL, default=0, help="linear warmup steps, then linear decay to 0")
            s.add_argument("--eval-every", type=_NATURAL, default=100, help="0: only at the end")
            s.add_argument("--metrics", default=None, help="append metrics as JSON lines to this file")
            s.add_argument("--checkpoint-dir", default=None, help="save orbax checkpoints here")
            s.add_argument("--checkpoint-every", type=_NATURAL, default=0)
            s.add_argument("--resume", default=None, metavar="DIR", help="continue from the latest checkpoint in DIR")
            s.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard event files here")
            s.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
            _add_search_flags(
                s,
                "train with the layout rules of least predicted step time (the table is printed first); "
                "--layout and --weight-layout, if given, are shown beside, and trained where faster",
            )
            g = s.add_argument_group(
                "many processes", "join a multi-process job (meshax launch sets these itself; see docs/guides)"
            )
            g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
            g.add_argument("--num-processes", type=_COUNT, default=None, metavar="N")
            g.add_argument("--process-id", type=_NATURAL, default=None, metavar="I", help="0 .. N-1")
            g.add_argument(
                "--distributed",
                action="store_true",
                help="join the job JAX detects from the environment (SLURM, Open MPI, Kubernetes)",
            )
        elif name == "generate":
            s.add_argument("--resume", required=True, metavar="DIR", help="the checkpoint folder `meshax train` wrote")
            s.add_argument(
                "--prompt",
                default=None,
                help="lm: the text to continue (bytes; --source markov: token ids like 3,5,2); "
                "seq2seq: the input token ids (--length of them, e.g. 5,3,9,2,7,4,8,6)",
            )
            s.add_argument("--samples", type=_COUNT, default=1, help="how many continuations (default 1)")
            s.add_argument(
                "--new", type=_COUNT, default=None, metavar="N", help="lm: tokens to generate (default: to --length)"
            )
            s.add_argument(
                "--temperature",
                type=_number(float, 0.0, math.inf, "a temperature >= 0"),
                default=0.0,
                help="0 (default): the most likely token each step; above: sample",
            )
            s.add_argument("--top-k", type=_NATURAL, default=0, help="sample among the K most likely tokens (0: all)")
            s.add_argument("--beam-size", type=_NATURAL, default=0, help="beam search with this many beams (0: none)")
            s.add_argument(
                "--alpha", type=_RATE, default=None, help="beam search's length penalty exponent (default 0.6)"
            )
            s.add_argument(
                "--report",
                action="store_true",
                help="first print the decoding step's layout and what each token costs on the mesh (its collectives)",
            )
        else:
            s.add_argument("--json", action="store_true", help="print the plan (with --search: the search) as JSON")
            s.add_argument(
                "--explain",
                action="store_true",
                help="also list every tensor's layout and where it came from, with warnings",
            )
            g = _add_search_flags(
                s, "search the layout rules of least predicted step time; --layout, if given, is shown beside"
            )
            g.add_argument(
                "--picture",
                default=None,
                metavar="DIR",
                help="draw the (chosen) layout of each parameter shape, and with --search the chart of the layouts "
                "compared, as PNG files in DIR",
            )
    s = sub.add_parser("launch", help="run a command as N processes of one job on this machine")
    s.add_argument("-n", "--num-processes", type=_COUNT, required=True, help="how many processes")
    s.add_argument(
        "--devices-per-process", type=_COUNT, default=None, metavar="K", help="virtual CPU devices per process"
    )
    s.add_argument("--port", type=_number(int, 1, 65536, "a port from 1 to 65535"), default=None)
    s.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- meshax train mnist")
    s.add_argument("--debug", action="store_true", help="show the traceback of an error")
    s = sub.add_parser("calibrate", help="measure this machine's devices for the cost model; write them to a file")
    s.add_argument("--mesh", default="rows:2;cols:4", help='the mesh to measure each dim of (default "rows:2;cols:4")')
    s.add_argument("--out", default="device.json", help="the JSON file to write (default device.json)")
    s.add_argument("--debug", action="store_true", help="show the traceback of an error")
    s = sub.add_parser("plot", help="draw loss and throughput curves of runs to a PNG")
    s.add_argument("metrics", nargs="+", help="JSON-lines files written by meshax train --metrics")
    s.add_argument("--out", default="metrics.png", help="the PNG to write (default metrics.png)")
    s.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return p


def _add_search_flags(s, search_help: str):
    """The layout search's flags (`plan` and `train`), in a group of their own; returns the group."""
    g = s.add_argument_group("layout search", "choose the layout rules (docs/guides/layout-search.md)")
    g.add_argument("--search", action="store_true", help=search_help)
    g.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="per device, e.g. 16GB (powers of 1000) or 16GiB (default: the device's); without --search, plan says "
        "whether its layout fits it",
    )
    g.add_argument("--top", type=_COUNT, default=5, metavar="K", help="how many layouts to list (default 5)")
    g.add_argument(
        "--device",
        default=None,
        help="the device to predict for: a known name (h100, a100, tpu-v3, tpu-v4, tpu-v5e, cpu) or a file "
        "`meshax calibrate` wrote (default: $MESHAX_DEVICE, else cpu); without --search, plan predicts its "
        "layout's step on it",
    )
    g.add_argument(
        "--search-mesh",
        action="store_true",
        help="also choose the mesh: every factorisation of --mesh's device count into 1-3 dims",
    )
    g.add_argument(
        "--search-weights",
        action="store_true",
        help="also give weights, their gradients and optimizer state rules of their own (--weight-layout)",
    )
    g.add_argument("--pin", default="", metavar="RULES", help='rules every candidate keeps, e.g. "batch:rows"')
    g.add_argument(
        "--measure",
        type=_NATURAL,
        default=0,
        metavar="K",
        help="also compile and time the K best layouts (and --layout's) on this machine's devices, and rank "
        "those K by measured step time (settles what the cost model predicts as near ties; lists at least K)",
    )
    return g


# Flags that only some tasks read: giving one to another task is a mistake, not a no-op.
_ONLY_FOR = {
    "source": ("lm",),
    "problem": ("seq2seq",),
    "sharding": ("lm", "seq2seq"),
    "model": ("lm", "seq2seq"),
    "pipeline_stages": ("lm", "seq2seq"),
    "microbatches": ("lm", "seq2seq"),
    "circular_repeats": ("lm", "seq2seq"),
    "moe_experts": ("lm", "seq2seq"),
    "dtype": ("lm", "seq2seq"),
    "attention": ("lm", "seq2seq"),
    "remat": ("lm", "seq2seq"),
    "length": ("lm", "seq2seq"),
    "hidden": ("mlp", "mnist"),
    "data": ("mnist", "cnn"),
    "channels": ("cnn", "unet"),
    "image_size": ("unet",),
    "spatial_dims": ("unet",),
    "text": ("lm",),
}


# Flags that name a path, and what each names (for the message when one is given as "").
_PATHS = {
    "metrics": "the file to append JSON lines to",
    "checkpoint_dir": "the folder to save checkpoints in",
    "resume": "the checkpoint folder to resume from",
    "tensorboard": "the folder for TensorBoard event files",
    "picture": "the folder to draw the pictures in",
    "data": "the folder with the four MNIST IDX files",
    "text": "a text file or folder",
    "out": "the file to write",
}


def _check_no_empty_paths(args) -> None:
    """A path given as "" (`--checkpoint-dir "$DIR"` with DIR unset) is refused: taken for the
    flag left out, a run would save no checkpoint, or start afresh instead of resuming."""
    from meshax.core.errors import ConfigError

    for flag, what in _PATHS.items():
        if getattr(args, flag, None) == "":
            raise ConfigError(f"--{flag.replace('_', '-')} '' is empty (an unset shell variable?): give {what}")


def _check(args) -> None:
    """Flags that contradict each other or point at nothing: a ConfigError naming them."""
    from meshax.core.errors import ConfigError

    if args.model == "":  # (`--model "$MODEL"` with MODEL unset: it trained the default preset, tiny)
        from meshax.models.transformer import PRESETS

        raise ConfigError(f"--model '' is empty (an unset shell variable?): give a preset ({', '.join(PRESETS)})")
    for flag, tasks in _ONLY_FOR.items():
        if getattr(args, flag) not in (None, "") and args.task not in tasks:
            raise ConfigError(f"--{flag.replace('_', '-')} applies to {' and '.join(tasks)}, not to {args.task}")
    if args.text and args.source == "markov":
        raise ConfigError("--text gives the text for --source text, but --source is markov")
    for flag in ("microbatches", "circular_repeats"):
        if getattr(args, flag) is not None and args.pipeline_stages is None:
            raise ConfigError(f"--{flag.replace('_', '-')} needs --pipeline-stages S")
    if args.data and not os.path.isdir(args.data):
        raise ConfigError(f"--data {args.data!r} is not a folder: give the folder with the four MNIST IDX files")
    if args.command in ("plan", "train") and not args.search:
        predicted = args.command == "plan"  # (a plan predicts its step on --device, against --memory-budget)
        given = [
            flag
            for flag, value in (
                ("--memory-budget", args.memory_budget and not predicted),
                ("--device", args.device and not predicted),
                ("--search-mesh", args.search_mesh),
                ("--search-weights", args.search_weights),
                ("--pin", args.pin),
                ("--top", args.top != 5),
                ("--measure", args.measure),
            )
            if value
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} applies to a layout search: add --search")
    if args.command == "generate":
        _check_generate(args)
    if args.command != "train":
        return
    _check_paths(args)
    if args.search and args.sharding:
        raise ConfigError(
            f"--search chooses the layout rules to train with, and --sharding {args.sharding} annotates the layout "
            "yourself: give one of them (meshax plan --search --sharding compares the two)"
        )
    if args.warmup > args.steps:
        raise ConfigError(f"--warmup {args.warmup} is longer than --steps {args.steps}")
    if args.warmup and args.optimizer == "adafactor" and args.lr is None:
        raise ConfigError(
            f"--warmup {args.warmup} shapes --lr's schedule; Adafactor without --lr has its own "
            "(min(0.01, 1/sqrt(step + 1)), scaled by each weight's size): give --lr, or drop --warmup"
        )
    if args.checkpoint_every and not (args.checkpoint_dir or args.resume):
        raise ConfigError(f"--checkpoint-every {args.checkpoint_every} needs --checkpoint-dir DIR (or --resume DIR)")
    if args.resume and args.checkpoint_dir and os.path.abspath(args.resume) != os.path.abspath(args.checkpoint_dir):
        raise ConfigError(
            f"--resume {args.resume!r} and --checkpoint-dir {args.checkpoint_dir!r} differ: a resumed run "
            "keeps saving where it resumed from; give one of them"
        )
    from meshax.train.checkpoint import checkpoint_info, foreign_message, foreign_step_folders, latest_step

    for flag, folder in (("--resume", args.resume), ("--checkpoint-dir", args.checkpoint_dir)):
        foreign = foreign_step_folders(folder) if folder else []
        if foreign:
            raise ConfigError(f"{flag} {folder!r}: {foreign_message(foreign)}")
    if args.resume:
        last = latest_step(args.resume)
        _check_whole_steps("--resume", args.resume, last)
        if last is None:
            raise ConfigError(f"--resume {args.resume!r}: no checkpoint there (start with --checkpoint-dir)")
        if args.steps <= last:
            raise ConfigError(f"--resume {args.resume!r} is at step {last}: give --steps beyond it")
        _check_checkpoint_task(args, checkpoint_info(args.resume))  # (before --search spends its time)
    elif args.checkpoint_dir:
        last = latest_step(args.checkpoint_dir)
        _check_whole_steps("--checkpoint-dir", args.checkpoint_dir, None)
        if last is not None:
            raise ConfigError(
                f"--checkpoint-dir {args.checkpoint_dir!r} already holds the checkpoint of step {last}: "
                "continue it with --resume, or give an empty folder"
            )


def _check_generate(args) -> None:
    from meshax.core.errors import ConfigError
    from meshax.train.checkpoint import checkpoint_info, latest_step

    if args.task not in ("lm", "seq2seq"):
        raise ConfigError(f"generate decodes the Transformers (lm, seq2seq), not {args.task}")
    _check_outside_step_folders("--resume", args.resume)
    _check_whole_steps("--resume", args.resume, latest_step(args.resume))
    if latest_step(args.resume) is None:
        raise ConfigError(f"--resume {args.resume!r}: no checkpoint there (train one with --checkpoint-dir)")
    _check_checkpoint_task(args, checkpoint_info(args.resume))
    if args.task == "lm" and not args.prompt:
        raise ConfigError("generate lm needs --prompt: the text to continue")
    if args.batch_size is not None:
        raise ConfigError(
            f"--batch-size {args.batch_size} is training's; generate decodes --samples sequences (times --beam-size)"
        )
    if args.task == "seq2seq" and args.new is not None:
        raise ConfigError("--new applies to lm; a seq2seq output has --length tokens")
    if args.alpha is not None and not args.beam_size:
        raise ConfigError("--alpha is beam search's length penalty: give --beam-size too")
    if args.beam_size and args.temperature:
        raise ConfigError("--beam-size searches for the most likely output; it takes no --temperature")
    if args.beam_size and args.top_k:
        raise ConfigError("--beam-size searches for the most likely output; it takes no --top-k")
    if args.beam_size and args.samples > 1:
        raise ConfigError(
            f"--beam-size gives the most likely output; --samples {args.samples} would repeat it: drop --samples "
            "(or sample with --temperature instead of --beam-size)"
        )
    if args.top_k and not args.temperature:
        raise ConfigError(
            f"--top-k {args.top_k} samples among the {args.top_k} most likely tokens, but --temperature 0 "
            "(the default) takes the most likely one: add --temperature, e.g. 0.8"
        )
    if args.samples > 1 and not args.temperature:
        raise ConfigError(
            f"--samples {args.samples} at --temperature 0 (the default: the most likely token each step) "
            f"gives {args.samples} identical outputs: add --temperature, e.g. 0.8"
        )


def _generate(args, task, console) -> int:
    """Decode from the checkpoint in --resume and print each output."""
    import numpy as np

    from meshax.core.errors import ConfigError
    from meshax.train.decode import Decoder

    beams = args.beam_size or 1
    batch = args.samples * beams
    text = args.task == "lm" and task.source == "text"
    if args.top_k > task.config.vocab_size:  # (the decoder's own message names top_k, not the flag)
        raise ConfigError(
            f"--top-k {args.top_k}: the model has {task.config.vocab_size} tokens; give 1 to "
            f"{task.config.vocab_size} (or 0: all of them)"
        )
    if args.task == "seq2seq":
        ids = _token_ids(args.prompt or "", task.config.vocab_size)
        if len(ids) != task.length:
            raise ConfigError(f"--prompt has {len(ids)} tokens; the model reads --length {task.length}")
        inputs, prompt = np.tile(np.asarray(ids, np.int32), (args.samples, 1)), None
    else:
        # (the bytes given: os.fsencode keeps a command line's bytes that are not UTF-8, which Python
        # holds as surrogates, and str.encode refuses)
        ids = list(os.fsencode(args.prompt)) if text else _token_ids(args.prompt, task.config.vocab_size)
        if len(ids) >= task.length:
            raise ConfigError(f"--prompt has {len(ids)} tokens; leave room within --length {task.length}")
        room = task.length - len(ids) + 1  # (the last new token needs no place in the caches)
        if args.new is not None and args.new > room:
            raise ConfigError(
                f"--new {args.new} after a prompt of {len(ids)} tokens passes --length {task.length}: "
                f"give --new {room} or less (or train with a longer --length)"
            )
        inputs, prompt = None, np.tile(np.asarray(ids, np.int32), (args.samples, 1))
    decoder = Decoder(
        task.config,
        args.mesh,
        args.layout,
        batch=batch,
        length=task.length,
        input_length=task.length if args.task == "seq2seq" else None,
        backend=args.backend,
        weight_layout=args.weight_layout,
    )
    decoder.load(args.resume)
    if args.report:  # (the step each token runs: a stage-split pipeline's weights moving, say)
        console.print(_layout_table(decoder.lowering))
        print(decoder.lowering.report(decoder.step_fn.counters, width=console.width), end="", flush=True)
    steps = args.new if args.new is not None else None
    if args.beam_size:
        tokens, scores = decoder.beam_search(
            inputs=inputs, prompt=prompt, beam_size=beams, steps=steps, alpha=0.6 if args.alpha is None else args.alpha
        )
    else:
        tokens = decoder.sample(prompt, inputs, steps, args.temperature, args.top_k, args.seed)
        scores = None
    for i, row in enumerate(tokens):
        # text: the prompt's bytes and the new ones decoded together (a character may span both)
        shown = _printable(bytes([*ids, *map(int, row)]).decode(errors="replace")) if text else ",".join(map(str, row))
        score = f"  (score {scores[i]:.4f})" if scores is not None else ""
        console.print(f"{shown}{score}", markup=False, highlight=False)
    return 0


def _printable(text: str) -> str:
    """Generated text as it can be shown: control characters other than newline and tab as
    escapes (`\\x1b`), so a model's bytes cannot drive the terminal or put NULs in a log."""
    import unicodedata

    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def _token_ids(text: str, vocab_size: int) -> list[int]:
    """--prompt's token ids, each in the vocabulary (an id past int32 would otherwise end in
    numpy's OverflowError, a traceback)."""
    from meshax.core.errors import ConfigError

    try:
        ids = [int(t) for t in text.replace(" ", "").split(",")]  # (an empty entry, "1,,2", too)
    except ValueError:
        raise ConfigError(f"--prompt {text!r}: give token ids separated by commas, like 5,3,9,2") from None
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise ConfigError(f"--prompt token {outside[0]} is not in the vocabulary 0..{vocab_size - 1}")
    return ids


def _check_paths(args) -> None:
    """Every path train writes to can be written, before anything runs."""
    from meshax.core.errors import ConfigError

    for flag, path in (
        ("--checkpoint-dir", args.checkpoint_dir),
        ("--resume", args.resume),
        ("--tensorboard", args.tensorboard),
    ):
        _check_outside_step_folders(flag, path)  # (first: the probes below would write inside one)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{flag} {path!r} is a file, not a folder")
        if path and flag != "--resume":
            _check_can_create(flag, path)
            _check_can_make_folder(flag, path)
    if args.tensorboard:
        _check_installed("tensorboardX", "--tensorboard needs tensorboardX: pip install 'meshax[tensorboard]'")
    if args.metrics:
        for flag, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard)):
            if folder and os.path.abspath(folder) == os.path.abspath(args.metrics):  # (neither made yet)
                raise ConfigError(
                    f"--metrics {args.metrics!r} is the folder {flag} names: give the metrics file a path of its own"
                )
        _check_outside_step_folders("--metrics", args.metrics)
        _check_file_to_write("--metrics", args.metrics, "a file to append JSON lines to")


def _check_installed(module: str, message: str) -> None:
    """`module` can be imported, else a ConfigError saying how to install it (before the run, not
    at the first use of it, after the compile and the cost report)."""
    import importlib.util

    from meshax.core.errors import ConfigError

    try:
        found = importlib.util.find_spec(module) is not None
    except ValueError:  # (a module set to None in sys.modules: taken as missing)
        found = False
    if not found:
        raise ConfigError(f"{message} (or {module})")


def _check_whole_steps(flag: str, folder: str, last: int | None) -> None:
    """No step folder in `folder` newer than `last` (its latest whole checkpoint; None: any) is a
    checkpoint cut short: resuming passed over it for an older step, and a run that came to save
    its step failed there, its steps lost."""
    from meshax.core.errors import ConfigError
    from meshax.train.checkpoint import damaged_steps

    damaged = damaged_steps(folder, after=last)
    if not damaged:
        return
    if flag == "--checkpoint-dir":
        fix = "move it away, or give an empty folder"
    else:
        fix = (
            f"move it away to go on from step {last}"
            if last is not None
            else "there is no older whole checkpoint there"
        )
    raise ConfigError(f"{flag} {folder!r}: the step folder {damaged[-1]} is no whole checkpoint: {fix}")


def _check_outside_step_folders(flag: str, path: str | None) -> None:
    """`path` is no checkpoint's step folder, nor inside one (which goes when newer steps replace it)."""
    from meshax.core.errors import ConfigError
    from meshax.train.checkpoint import step_folder_around

    found = step_folder_around(path) if path else None
    if path is None or found is None:
        return
    folder, step = found
    where = "the" if os.path.abspath(path) == os.path.join(folder, str(step)) else "inside the"
    folder = folder if os.path.isabs(path) else os.path.relpath(folder)  # (as the user wrote it)
    said = f"{flag} {path!r} is {where} folder of step {step} of the checkpoints in {folder!r}"
    if flag == "--resume":
        raise ConfigError(f"{said}: give --resume {folder!r} (a run resumes from its latest step)")
    raise ConfigError(f"{said}, which goes when newer steps replace it: give a path outside it")


def _check_file_to_write(flag: str, path: str, what: str) -> None:
    """`path` names a file (`what` says which) in a folder that exists, and can be written (a new
    one: a file of a name of its own is made there and removed, as `_check_can_make_folder` does)."""
    from meshax.core.errors import ConfigError

    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a folder: give {what}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path!r}: its folder does not exist")
    _check_can_create(flag, path)
    if not os.path.exists(path):
        try:
            handle, probe = tempfile.mkstemp(prefix=".meshax-check-", dir=folder)
            os.close(handle)
            os.remove(probe)
        except OSError as err:
            raise ConfigError(
                f"{flag} {path!r} cannot be created: {err.strerror}; give a file in a folder you can write to"
            ) from None


def _check_can_make_folder(flag: str, path: str) -> None:
    """A folder that does not exist yet can be made in its nearest existing folder: a folder of a
    name of its own is made there and removed (some folders refuse what their permissions allow,
    /proc's, found otherwise only when the run saves; the processes of one job check at once)."""
    from meshax.core.errors import ConfigError

    where = os.path.abspath(path)
    if os.path.exists(where):
        return
    while not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".meshax-check-", dir=where))
    except OSError as err:
        raise ConfigError(
            f"{flag} {path!r} cannot be created: {err.strerror}; give a folder you can write to"
        ) from None


def _check_can_create(flag: str, path: str) -> None:
    """`path` exists or can be made (as a folder or file) in its nearest existing folder."""
    from meshax.core.errors import ConfigError

    target = os.path.abspath(path)
    if not os.path.exists(target):
        target = os.path.dirname(target)
        while not os.path.exists(target):
            target = os.path.dirname(target)
        if not os.path.isdir(target):
            raise ConfigError(f"{flag} {path!r} cannot be created: {target!r} is a file; give a path under a folder")
    if not os.access(target, os.W_OK):
        raise ConfigError(f"{flag} {path!r}: {target!r} is not writable; give a folder you can write to")


def _task(args):
    from meshax.train import CnnTask, LmTask, MlpTask, MnistTask, Seq2SeqTask, UNetTask
    from meshax.train.tasks import model_config

    batch = {"batch_size": args.batch_size} if args.batch_size is not None else {}
    length = {"length": args.length} if args.length is not None else {}
    overrides = {
        field: getattr(args, flag)
        for field, flag in (
            ("pipeline_stages", "pipeline_stages"),
            ("microbatches", "microbatches"),
            ("circular_repeats", "circular_repeats"),
            ("moe_experts", "moe_experts"),
            ("dtype", "dtype"),
            ("attention", "attention"),
            ("remat", "remat"),
        )
        if getattr(args, flag) is not None
    }
    model = model_config(args.model or "tiny", **overrides) if overrides else (args.model or "tiny")
    if args.task == "mlp":
        return MlpTask(hidden=args.hidden or 128, seed=args.seed, **batch)
    if args.task == "mnist":
        return MnistTask(hidden=args.hidden or 1024, data_dir=args.data, seed=args.seed, **batch)
    if args.task == "cnn":
        return CnnTask(channels=args.channels or 16, data_dir=args.data, seed=args.seed, **batch)
    if args.task == "unet":
        return UNetTask(
            channels=args.channels or 8,
            image_size=args.image_size or 16,
            spatial_dims=args.spatial_dims or 2,
            seed=args.seed,
            **batch,
        )
    if args.task == "lm":
        return LmTask(
            model=model,
            source=args.source or "text",
            text_path=args.text,
            seed=args.seed,
            sharding=args.sharding,
            **batch,
            **length,
        )
    return Seq2SeqTask(
        model=model, problem=args.problem or "reverse", seed=args.seed, sharding=args.sharding, **batch, **length
    )


def _optimizer(args):
    from meshax import optimize

    steps = getattr(args, "steps", 1000)
    lr, warmup = getattr(args, "lr", None), getattr(args, "warmup", 0)
    if getattr(args, "optimizer", "adam") == "adafactor":  # no --lr: Adafactor's own schedule
        return optimize.AdafactorOptimizer(
            None if lr is None else optimize.linear_decay(lr, warmup, steps) if warmup else lr
        )
    lr = 1e-3 if lr is None else lr
    return optimize.AdamWeightDecayOptimizer(optimize.linear_decay(lr, warmup, steps) if warmup else lr)


def _layout_table(lowering):
    from rich.table import Table

    impl = lowering.impl
    table = Table(title="parameters and their layouts", title_justify="left")
    for col in ("variable", "shape", "split", "slice per device"):
        table.add_column(col)
    for var in lowering.graph.trainable_variables:
        t = var.value
        layout = lowering.plan[t]
        split = (
            ", ".join(
                f"{d.name} over {'x'.join(impl.shape[m].name for m in a)}" for d, a in zip(t.shape, layout.axes) if a
            )
            or "replicated"
        )
        table.add_row(
            var.name, " ".join(f"{d.name}:{d.size}" for d in t.shape), split, str(impl.slice_shape(t.shape, layout))
        )
    return table


def _tune_gc() -> None:
    """Python's garbage collector, for a process that traces JAX programs: what is imported by now
    is set aside for good (gc.freeze), and collections come less often. Tracing makes many
    short-lived objects, and each full collection walks every live one: the README's paper-scale
    search spent 2.3 s of its 12.6 s collecting before, 0.4 s of 9.1-9.8 s after."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def main(argv=None) -> int:
    """Run the command line; returns the exit status (2: bad input, said in one line on stderr).
    Run as the command (no `argv`: `sys.argv`), the process's garbage collector is tuned first
    (`_tune_gc`); called with `argv` from Python, the caller's process is left as it is."""
    from meshax.core.errors import LayoutWarning

    if argv is None:
        _tune_gc()
    parser = _parser()
    args = parser.parse_args(_join_dash_values(parser, sys.argv[1:] if argv is None else list(argv)))
    try:
        return _run(args)
    except BrokenPipeError:  # the reader of the output went away (`meshax plan lm | head`): quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (Python's recipe: no error at exit)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line saying what is kept, not a traceback into JAX
        if args.debug:
            raise
        print(f"meshax: interrupted{_kept(args)}", file=sys.stderr)
        return _exit_code_of_a_job(130)
    except MemoryError as e:  # this machine's memory, not the devices' (a host array of the sizes given)
        if args.debug:
            raise
        print(f"meshax: error: {_HOST_OUT_OF_MEMORY} ({e}) (--debug shows where)", file=sys.stderr)
        return _exit_code_of_a_job(2)
    except (ValueError, RuntimeError, OSError, LayoutWarning) as e:  # MeshaxError is a ValueError
        if args.debug:
            raise
        message = " ".join(str(e).split())
        if "RESOURCE_EXHAUSTED" in message:  # (XLA's out of memory: say what the user can change)
            message = message.rstrip(".") + _OUT_OF_MEMORY
        print(f"meshax: error: {message} (--debug shows where)", file=sys.stderr)
        return _exit_code_of_a_job(2)


def _exit_code_of_a_job(code: int) -> int:
    """`code`; in a multi-process job the process ends with it at once instead: not in JAX's
    shutdown barrier, waiting for processes that may wait for this one."""
    if "jax" in sys.modules:
        from meshax.runtime import exit_at_once, in_a_job

        if in_a_job():
            exit_at_once(code)
    return code


def _kept(args) -> str:
    """What an interrupted `meshax train` keeps: its latest checkpoint, and how to go on from it."""
    folder = getattr(args, "resume", None) or getattr(args, "checkpoint_dir", None)
    if args.command != "train" or not folder:
        return ""
    from meshax.train.checkpoint import latest_step

    last = latest_step(folder)
    if last is None:
        return f"; no checkpoint was saved in {folder!r} yet"
    return f"; the latest checkpoint in {folder!r} is of step {last}: continue with --resume {folder}"


_HOST_OUT_OF_MEMORY = (
    "this machine's memory cannot hold what the sizes given ask for: give smaller ones (--batch-size, --length, "
    "--hidden, --image-size, --channels)"
)
_OUT_OF_MEMORY = (
    ": the step does not fit in the devices' memory. `meshax plan` with the same flags shows its memory "
    "per device; lower --batch-size or --length, split more of the model over the mesh (--layout), or "
    "recompute activations in the backward pass (--remat, lm and seq2seq)"
)


def _join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--memory-budget -5GB` as `--memory-budget=-5GB`: argparse takes a value that starts with
    a dash and is no number for an option, and says only "expected one argument"; joined, the
    value reaches meshax's own check, which names what is wrong with it. Only after meshax's own
    options that take one value, and not in `launch`, whose arguments are another command's."""
    if argv[:1] == ["launch"]:
        return argv
    takes_value: set[str] = set()
    parsers = [parser]
    while parsers:
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.nargs is None:  # one value (flags have nargs 0)
                takes_value.update(o for o in action.option_strings if o.startswith("--"))
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in takes_value and re.match(r"-\.?\d", arg):
            out[-1] += "=" + arg
        else:
            out.append(arg)
    return out


def _console(quiet: bool = False):
    """Rich output on stdout; when stdout is a file or a pipe, as wide as the text (no cut names).
    `quiet`: print nothing (the processes of a multi-process run other than process 0)."""
    from rich.console import Console

    return Console(quiet=quiet) if sys.stdout.isatty() else Console(width=1000, no_color=True, quiet=quiet)


def _run(args) -> int:
    import warnings

    _check_no_empty_paths(args)
    if args.command not in ("train", "launch") and _another_launched_process():
        return 0  # one process of `meshax launch` does the one-process commands; the rest exit
    if args.command == "plot":
        return _plot(args)
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "launch":
        from meshax.launch import launch

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return launch(cmd, args.num_processes, args.devices_per_process, args.port)
    from meshax.core.errors import ConfigError, LayoutError, LayoutWarning
    from meshax.layout import convert_to_layout_rules, convert_to_mesh_shape, convert_to_weight_rules
    from meshax.lower.mesh_impl import check_mesh_dims
    from meshax.train.loop import build

    mesh_shape = convert_to_mesh_shape(args.mesh)
    if args.layout is None:  # the task's default rules; with a GSPMD sharding, the annotations alone
        args.layout = "" if args.sharding else DEFAULT_LAYOUTS[args.task]
        try:
            check_mesh_dims(convert_to_layout_rules(args.layout), mesh_shape)
        except LayoutError as e:
            if getattr(args, "search", False):  # nothing to compare the search's choice with
                args.layout = ""
                args.no_baseline = True
            else:
                raise ConfigError(
                    f"no --layout given, so {args.task}'s default layout {args.layout!r} applies: {e}; "
                    'give --layout ("" for none)'
                ) from None
    convert_to_layout_rules(args.layout)
    if args.weight_layout is not None:
        check_mesh_dims(convert_to_weight_rules(args.weight_layout), mesh_shape)
    missing = [m for m in ("x", "y") if args.sharding and m not in mesh_shape.dimension_names]
    if missing:
        raise ConfigError(
            f"--sharding {args.sharding} annotates over the GSPMD paper's mesh dims x and y, and the mesh "
            f'{args.mesh!r} has no {" or ".join(missing)}: give e.g. --mesh "x:2;y:4"'
        )
    _quiet_dependencies()
    if args.command == "train":  # before anything starts JAX (checking --resume reads with Orbax)
        _start_devices(args, mesh_shape.size)
    if args.command == "generate" or (args.command == "plan" and args.measure):  # (plan --measure runs steps)
        from meshax.runtime import use_cpu_devices

        use_cpu_devices(mesh_shape.size)
    _check(args)
    if args.command == "train":
        from meshax.runtime import is_main_process

        console = _console(quiet=not is_main_process())  # one process speaks for all
        if not is_main_process():  # (and its warnings: each process warned the same; LayoutWarning: an error below)
            warnings.simplefilter("ignore")
    else:
        console = _console()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayoutWarning)  # a rule that splits nothing is a typo here
        task = _task(args)
        if args.command == "plan":
            return _plan(args, task, console)
        if args.command == "generate":
            return _generate(args, task, console)
        if args.search:
            _train_searched(args, task, console)
        program = build(
            task, args.mesh, args.layout, args.backend, _optimizer(args), args.seed, weight_layout=args.weight_layout
        )
    resumed = _check_resume(args, task, program) if args.resume else None
    console.print(_layout_table(program.lowering))
    if not console.quiet:
        print(program.lowering.report(program.train_fn.counters, width=console.width), end="", flush=True)
    return _train(args, task, program, console, resumed)


def _check_resume(args, task, program) -> str:
    """Before the run: the checkpoint in --resume holds this model (else a ConfigError). Returns
    the line saying where the run resumes, with a note if the batches differ from the first
    run's (its --batch-size, --seed, --length, data ...)."""
    from meshax.train.checkpoint import check_restorable, checkpoint_info

    info = checkpoint_info(args.resume)  # (its task checked before: `_check`)
    check_restorable(args.resume, program.lowering, info["step"])
    line = f"resuming from step {info['step']} of {args.resume}"
    saved, now = info.get("data", {}), task.data_settings()
    changed = [k for k in saved if k in now and saved[k] != now[k]]
    if not changed:
        return line
    flags = {"text_path": "text", "data_dir": "data", "eval_batches_count": "eval batches"}

    def settings(values: dict) -> str:
        return ", ".join(f"{flags.get(k, k).replace('_', '-')} {values[k]}" for k in changed)

    return (
        f"{line}\nnote: it was trained with {settings(saved)}; this run has {settings(now)}: from step "
        f"{info['step']} on it trains on other batches than the first run would have"
    )


def _check_checkpoint_task(args, info: dict) -> None:
    """The checkpoint in --resume (its `checkpoint_info`) is of this task and, for lm, of this
    --source, which sets the vocabulary: else a ConfigError saying which to give (not the
    variables that differ, which is all that restoring it could say)."""
    from meshax.core.errors import ConfigError

    saved = info.get("task", args.task)
    if saved != args.task:
        if args.command == "train":
            how = f"resume it with `meshax train {saved} ...`"
        elif saved in ("lm", "seq2seq"):
            how = f"decode it with `meshax generate {saved} ...`"
        else:
            how = "generate decodes the Transformers (lm, seq2seq)"
        raise ConfigError(f"--resume {args.resume!r} holds a checkpoint of the task {saved}, not {args.task}: {how}")
    source = info.get("data", {}).get("source")
    if args.task == "lm" and source and source != (args.source or "text"):
        raise ConfigError(
            f"--resume {args.resume!r} holds a model of --source {source}, whose vocabulary differs from "
            f"--source {args.source or 'text'}'s: give --source {source}"
        )


def _another_launched_process() -> bool:
    """Whether this process is one of a job's processes (`meshax launch` sets their environment)
    other than process 0."""
    from meshax.runtime import ENV_PROCESS_ID, env_int

    return bool(env_int(ENV_PROCESS_ID))


def _start_devices(args, mesh_size: int) -> None:
    """Virtual CPU devices for the mesh; in a multi-process job, join it first (this process's
    share of the devices) and check that the mesh spans every process's devices."""
    import jax

    from meshax.core.errors import ConfigError
    from meshax.runtime import (
        ENV_NUM_PROCESSES,
        ENV_PROCESS_ID,
        distributed_requested,
        env_int,
        exit_at_once_on_interrupt,
        initialize_distributed,
        use_cpu_devices,
    )

    if not (args.distributed or distributed_requested(args.coordinator, args.num_processes, args.process_id)):
        use_cpu_devices(mesh_size)
        return
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes, "--process-id": args.process_id}
    if any(v is not None for v in given.values()) and None in given.values():
        missing = [flag for flag, v in given.items() if v is None]
        raise ConfigError(
            f"{' and '.join(missing)} missing: give --coordinator, --num-processes and --process-id together "
            "(or none of them, with --distributed, to take the job from the cluster's environment)"
        )
    n = args.num_processes or env_int(ENV_NUM_PROCESSES)
    if n and mesh_size % n:
        raise ConfigError(f"--mesh {args.mesh!r} has {mesh_size} devices, which {n} processes cannot share evenly")
    per_process = env_int("JAX_NUM_CPU_DEVICES") or (mesh_size // n if n else 1)
    if not args.debug:  # (--debug: the KeyboardInterrupt's traceback) the id known so far: process 0's says it
        process_id = args.process_id if args.process_id is not None else env_int(ENV_PROCESS_ID)
        exit_at_once_on_interrupt(lambda: f"meshax: interrupted{_kept(args)}", first=process_id in (0, None))
    initialize_distributed(args.coordinator, args.num_processes, args.process_id, per_process)
    if jax.device_count() != mesh_size:
        raise ConfigError(
            f"--mesh {args.mesh!r} has {mesh_size} devices, but the {jax.process_count()} processes of this job "
            f"have {jax.device_count()} ({jax.local_device_count()} each): the mesh must span them all"
        )
    if not args.debug:  # (and now that it is known, only process 0 says it)
        exit_at_once_on_interrupt(lambda: f"meshax: interrupted{_kept(args)}")


def _plot(args) -> int:
    from meshax.core.errors import ConfigError
    from meshax.train.metrics import plot_metrics

    if not args.out.endswith(".png"):
        raise ConfigError(f"--out {args.out!r}: give a .png file")
    _check_file_to_write("--out", args.out, "the .png file to write")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("meshax plot needs matplotlib: pip install 'meshax[plot]' (or matplotlib)") from None
    print(plot_metrics(args.metrics, args.out))
    return 0


def _quiet_dependencies() -> None:
    """Keep out what dependencies log that means nothing to a user (absl's notes from Orbax)."""
    try:
        from absl import logging as absl_logging
    except ImportError:  # pragma: no cover
        return
    absl_logging.set_verbosity(absl_logging.ERROR)


def _calibrate(args) -> int:
    from meshax.layout import convert_to_mesh_shape
    from meshax.runtime import use_cpu_devices
    from meshax.search import calibrate

    _check_file_to_write("--out", args.out, "a file to write the device's JSON to")
    if os.path.isfile(args.out) and os.path.getsize(args.out):  # (replaced: only a device file of its own)
        from meshax.core.errors import ConfigError
        from meshax.search import load_device

        try:
            load_device(args.out)
        except ConfigError:
            raise ConfigError(
                f"--out {args.out!r} is a file that is no device file `meshax calibrate` wrote, and calibrate "
                "would write over it: give a new path (or move the file away)"
            ) from None
    use_cpu_devices(convert_to_mesh_shape(args.mesh).size)
    device = calibrate(args.mesh)
    with open(args.out, "w") as f:
        json.dump(device.to_json(), f, indent=1)
    links = ", ".join(f"{m}: {x.latency_s * 1e6:.1f} us + B / {x.bandwidth / 1e9:.2f} GB/s" for m, x in device.links)
    print(
        f"{device.name}: matmul {device.matmul_flops / 1e9:.1f} GFLOP/s, elementwise "
        f"{device.vector_flops / 1e9:.2f} GFLOP/s per device; links {links}; wrote {args.out} "
        "(use it with meshax plan --search --device FILE)"
    )
    return 0


def _search(args, task) -> int:
    """`meshax plan --search`: the table, and with --picture the comparison and the chosen layouts drawn."""
    from meshax.search.draw import draw_comparison

    result, searched = _searched(args, task)
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.format(), end="\n" if args.json else "")
    if args.picture:
        os.makedirs(args.picture, exist_ok=True)
        from meshax.train.loop import build

        said = sys.stderr if args.json else sys.stdout  # (stdout is the JSON's alone)
        print(f"wrote {draw_comparison(result, os.path.join(args.picture, 'search.png'))}", file=said)
        best = result.best
        chosen = build(
            searched,
            best.mesh,
            best.layout,
            args.backend,
            _optimizer(args),
            compile=False,
            weight_layout=best.weight_layout,
        )
        _draw_parameters(chosen[0], args.picture, said)
    return 0


def _train_searched(args, task, console) -> None:
    """`meshax train --search`: the search's table printed, and its best mesh, rules and weight
    rules put in `args` to train with; or yours (--layout, --weight-layout) where the table has it
    faster, within the budget and keeping --pin (weight rules of your own, say, which the search
    did not try). Every process searches (the same, by the cost model); timed (--measure), each
    process's times differ, and process 0's choice is taken."""
    import jax

    from meshax.layout import convert_to_layout_rules

    result, _ = _searched(args, task, say=not console.quiet)
    if not console.quiet:
        print(result.format(), end="", flush=True)
    best, mine = result.best, result.baseline
    pinned, yours = convert_to_layout_rules(args.pin), convert_to_layout_rules(mine.layout if mine else "")
    keeps = all(yours.mesh_dims_for(d) == pinned.mesh_dims_for(d) for d in pinned.tensor_dim_names)
    if mine is not None and keeps and mine.memory_bytes <= result.memory_budget:  # (over it, shown, not run)
        said, key = ("measured", lambda c: c.measured_s) if result.measured else ("predicted", lambda c: c.step_s)
        if key(mine) < key(best):
            best = mine
            console.print(f"training yours, {said} faster than the search's best", markup=False, highlight=False)
    if args.measure and jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        same_order = sorted([*result.ranked, *([mine] if mine else [])], key=lambda c: (c.mesh, c.name))
        i = int(multihost_utils.broadcast_one_to_all(np.int32(same_order.index(best))))
        best = same_order[i]
    args.mesh, args.layout, args.weight_layout = best.mesh, best.layout, best.weight_layout


def _searched(args, task, say: bool = True):
    """The layout search the flags ask for (timed with --measure), and the task it searched."""
    from meshax.layout import convert_to_mesh_shape
    from meshax.search import SearchResult, evaluate, search_layout
    from meshax.search.program import model_of
    from meshax.search.search import search_mesh_and_layout

    # Costed once, at small depths where the model is deep: the search's candidates and the
    # layout given beside them (or the task's default, where it fits the mesh), annotations and all
    searched = dataclasses.replace(task, sharding="") if getattr(task, "sharding", "") else task
    optimizer = _optimizer(args)  # (the search costs its steps; the result keeps it, and --measure runs them)
    model = model_of(searched, optimizer=optimizer)
    baseline = None
    if not getattr(args, "no_baseline", False):
        label = None
        if args.sharding:  # the annotations are the user's layout: name them
            label = f"{args.layout} + annotations {args.sharding}" if args.layout else f"annotations {args.sharding}"
        yours = model if searched is task else model_of(task, optimizer=optimizer)
        baseline = evaluate(
            yours, mesh=args.mesh, layout=args.layout, weight_layout=args.weight_layout, device=args.device, label=label
        )
    search: Callable[..., SearchResult] = search_mesh_and_layout if args.search_mesh else search_layout
    where = convert_to_mesh_shape(args.mesh).size if args.search_mesh else args.mesh  # (every mesh of that many)
    result = search(
        model,
        where,
        layout=args.pin,
        memory_budget=args.memory_budget,
        device=args.device,
        top=max(args.top, args.measure),  # (--measure 8 lists the 8 it measures)
        baseline=baseline,
        search_weights=args.search_weights,
    )
    if args.measure:
        from meshax.search import measure_layouts

        if say:
            k = min(args.measure, len(result.ranked))
            print(f"measuring the {k} best layout{'s' if k > 1 else ''} ...", file=sys.stderr, flush=True)
        annotated = None if searched is task else task  # (what runs the layout given beside: its annotations)
        result = measure_layouts(result, k=args.measure, yours=annotated, backend=args.backend)
    return result, searched


def _draw_parameters(lowering, folder: str, said=None) -> None:
    """One picture per parameter shape (the first variable of each), in `folder`; each file
    written is said on `said` (default stdout)."""
    seen = set()
    for var in lowering.graph.trainable_variables:
        t = var.value
        if tuple(t.shape.dimension_names) in seen:
            continue
        seen.add(tuple(t.shape.dimension_names))
        print(f"wrote {lowering.draw(t, os.path.join(folder, var.name.replace('/', '.') + '.png'))}", file=said)


def _plan(args, task, console) -> int:
    from meshax.core.errors import ConfigError
    from meshax.plan import format_summary, summarize
    from meshax.train.loop import build

    if args.picture:
        _check_installed("matplotlib", "--picture needs matplotlib: pip install 'meshax[plot]'")
    if args.picture and not os.path.isdir(args.picture):
        if os.path.exists(args.picture):
            raise ConfigError(f"--picture {args.picture!r} is a file: give a folder to write the pictures to")
        _check_can_create("--picture", args.picture)
        _check_can_make_folder("--picture", args.picture)  # (made when the pictures are drawn: none if it fails first)
    if args.search:
        return _search(args, task)
    lowering, outputs, updates = build(
        task,
        args.mesh,
        args.layout,
        args.backend,
        _optimizer(args),
        args.seed,
        compile=False,
        weight_layout=args.weight_layout,
    )
    counters = lowering.trace_step(outputs, updates)
    summary = summarize(lowering, counters, outputs)
    prediction = _prediction(args, lowering, outputs, updates) if args.device or args.memory_budget else None
    if args.picture:
        os.makedirs(args.picture, exist_ok=True)
        _draw_parameters(lowering, args.picture, sys.stderr if args.json else None)  # (stdout: the JSON's alone)
    if args.json:
        explained = {"explain": lowering.explain()} if args.explain else {}
        predicted = {"prediction": prediction} if prediction else {}
        print(json.dumps({**summary.as_dict(), **predicted, **explained}, indent=1))
        return 0
    console.print(_layout_table(lowering))
    print(lowering.report(counters, width=console.width), end="")
    print(format_summary(summary), end="", flush=True)
    if prediction:
        print("\n" + _format_prediction(prediction, args), end="", flush=True)
    if args.explain:
        print("\n" + lowering.explain(), end="", flush=True)
    return 0


def _prediction(args, lowering, outputs, updates) -> dict:
    """The plan's step as the layout search costs it (`search.evaluate`): its predicted time on
    --device, in ms by part, and its memory per device against --memory-budget (default: the
    device's memory)."""
    from meshax.search import evaluate, load_device
    from meshax.search.result import parse_bytes

    device = load_device(args.device)
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else device.memory_bytes
    if budget is None or budget <= 0:
        from meshax.core.errors import ConfigError

        raise ConfigError(f"--memory-budget {args.memory_budget!r}: give a positive size, like 16GB")
    c = evaluate(lowering, outputs, updates, device=device)
    return {
        "device": device.name,
        "step_ms": c.step_s * 1e3,
        "compute_ms": c.compute_s * 1e3,
        "communication_ms": {k: v * 1e3 for k, v in c.comm_s.items() if v},
        "memory_bytes": c.memory_bytes,
        "memory_budget_bytes": budget,
        "fits": c.memory_bytes <= budget,
    }


def _format_prediction(p: dict, args) -> str:
    from meshax.lower.report import _human

    parts = ", ".join([f"compute {p['compute_ms']:.3f}", *(f"{k} {v:.3f}" for k, v in p["communication_ms"].items())])
    memory = f"memory / device {_human(p['memory_bytes'])}B of {_human(p['memory_budget_bytes'])}B"
    if p["fits"]:
        verdict = "fits"
    else:
        over = _human(p["memory_bytes"] - p["memory_budget_bytes"])
        remat = " --remat (each layer recomputed in the backward pass)," if args.task in ("lm", "seq2seq") else ""
        remat = "" if getattr(args, "remat", False) else remat
        verdict = f"does not fit, {over}B over: try{remat} a layout that splits more, or --search"
    return f"predicted on {p['device']}: step {p['step_ms']:.3f} ms ({parts} ms)\n{memory}: {verdict}\n"


def _train(args, task, program, console, resumed: str | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from meshax.train.loop import Preempted, train

    checkpoint_dir = args.resume or args.checkpoint_dir
    if resumed:
        console.print(resumed, markup=False, highlight=False)
    with Progress(  # on stderr, and only on a terminal: logs get the eval lines, not a bar
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=args.no_progress or console.quiet or not sys.stderr.isatty(),
    ) as progress:
        bar = progress.add_task("train", total=args.steps, status="")

        recent: collections.deque[float] = collections.deque(maxlen=10)

        def on_step(step, loss, seconds):
            recent.append(seconds)  # the last 10 steps' mean: queued steps' times vary one by one
            seconds = sum(recent) / len(recent)
            speed = f"  {task.tokens_per_batch / seconds:,.0f} tokens/s" if task.tokens_per_batch else ""
            progress.update(bar, completed=step + 1, status=f"loss {loss:.4f}  {seconds * 1e3:.1f} ms/step{speed}")

        def on_eval(step, metrics):
            console.print(f"eval after step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

        run = functools.partial(
            train,
            task,
            steps=args.steps,
            seed=args.seed,
            eval_every=args.eval_every,
            on_step=on_step,
            on_eval=on_eval,
            program=program,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            resume=bool(args.resume),
            metrics_path=args.metrics,
            tensorboard_dir=args.tensorboard,
        )
        try:
            run()
        except Preempted as e:  # every process stops at the same step, the checkpoint saved
            console.print(f"meshax: {e}")
            from meshax.launch import PREEMPTED

            return PREEMPTED
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
