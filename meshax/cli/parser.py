"""The `meshax` command's flags: its parser, the number types it checks values with, and the
layout search's flags that `plan` and `train` share.
"""

from __future__ import annotations

import argparse
import math
import re

DEFAULT_LAYOUTS = {
    "mlp": "batch:rows;hidden:cols",
    "mnist": "batch:rows;hidden:cols",
    "cnn": "h:rows;w:cols",
    "unet": "h:rows;w:cols",
    "lm": "batch:rows;vocab:cols;d_ff:cols;heads:cols",
    "seq2seq": "batch:rows;vocab:cols;d_ff:cols;heads:cols",
}


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line on stderr (exit 2) that names the flag and the value."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number_type(kind, low: float, high: float, what: str):
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


COUNT = number_type(int, 1, 2**31, "a whole number from 1 to 2**31 - 1")


NATURAL = number_type(int, 0, 2**31, "a whole number from 0 to 2**31 - 1")


SEED = number_type(int, 0, 2**32, "a whole number from 0 to 2**32 - 1")


RATE = number_type(float, 0.0, math.inf, "a number >= 0")


LR = number_type(float, 0.0, 2.0**128, "a number from 0 to 3.4e38 (the largest float32: steps compute in it)")


def build_parser() -> argparse.ArgumentParser:
    from meshax import __version__, cli  # (cli: the command's description is the package's docstring)
    from meshax.models.transformer import GSPMD_SHARDINGS

    p = Parser(prog="meshax", description=cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"meshax {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
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
            type=COUNT,
            default=None,
            metavar="S",
            help='lm/seq2seq: pipeline each layer stack in S stages over a dim "stage" (name it in --layout, '
            'e.g. "stage:rows")',
        )
        s.add_argument(
            "--microbatches", type=COUNT, default=None, metavar="M", help="with --pipeline-stages: microbatches"
        )
        s.add_argument(
            "--circular-repeats",
            type=COUNT,
            default=None,
            metavar="R",
            help="with --pipeline-stages: the circular schedule, R passes through the stages",
        )
        s.add_argument(
            "--moe-experts",
            type=COUNT,
            default=None,
            metavar="E",
            help='lm/seq2seq: every other feed-forward block a mixture of E experts (dims "experts", '
            '"expert_hidden"; e.g. --layout "batch:rows;experts:rows")',
        )
        s.add_argument("--batch-size", type=COUNT, default=None)
        s.add_argument("--length", type=COUNT, default=None, help="lm/seq2seq: sequence length")
        s.add_argument("--hidden", type=COUNT, default=None, help="mlp/mnist: hidden units")
        s.add_argument(
            "--data", default=None, help="mnist/cnn: a folder with the four MNIST IDX files (default: digits)"
        )
        s.add_argument("--channels", type=COUNT, default=None, help="cnn/unet: channels of the first convolution")
        s.add_argument("--image-size", type=COUNT, default=None, help="unet: pixels per side (default 16)")
        s.add_argument("--spatial-dims", type=int, choices=[2, 3], default=None, help="unet: 2-D images or 3-D volumes")
        s.add_argument(
            "--source", choices=["text", "markov"], default=None, help="lm: bytes of text (default) or a Markov chain"
        )
        s.add_argument("--text", default=None, help="lm: a text file or folder (default: Python's standard library)")
        s.add_argument(
            "--problem", choices=["reverse", "sort"], default=None, help="seq2seq: reverse (default) or sort"
        )
        s.add_argument("--seed", type=SEED, default=0)
        s.add_argument("--debug", action="store_true", help="show the traceback of an error")
        if name in ("train", "plan"):  # (plan costs the optimizer's collectives and memory too)
            s.add_argument("--optimizer", choices=["adam", "adafactor"], default="adam")
        if name == "train":
            s.add_argument("--steps", type=NATURAL, default=300)
            s.add_argument("--lr", type=LR, default=None, help="peak learning rate (adam: 1e-3; adafactor: its own)")
            s.add_argument("--warmup", type=NATURAL, default=0, help="linear warmup steps, then linear decay to 0")
            s.add_argument("--eval-every", type=NATURAL, default=100, help="0: only at the end")
            s.add_argument("--metrics", default=None, help="append metrics as JSON lines to this file")
            s.add_argument("--checkpoint-dir", default=None, help="save orbax checkpoints here")
            s.add_argument("--checkpoint-every", type=NATURAL, default=0)
            s.add_argument("--resume", default=None, metavar="DIR", help="continue from the latest checkpoint in DIR")
            s.add_argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard event files here")
            s.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
            add_search_flags(
                s,
                "train with the layout rules of least predicted step time (the table is printed first); "
                "--layout and --weight-layout, if given, are shown beside, and trained where faster",
            )
            g = s.add_argument_group(
                "many processes", "join a multi-process job (meshax launch sets these itself; see docs/guides)"
            )
            g.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="process 0's address")
            g.add_argument("--num-processes", type=COUNT, default=None, metavar="N")
            g.add_argument("--process-id", type=NATURAL, default=None, metavar="I", help="0 .. N-1")
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
            s.add_argument("--samples", type=COUNT, default=1, help="how many continuations (default 1)")
            s.add_argument(
                "--new", type=COUNT, default=None, metavar="N", help="lm: tokens to generate (default: to --length)"
            )
            s.add_argument(
                "--temperature",
                type=number_type(float, 0.0, math.inf, "a temperature >= 0"),
                default=0.0,
                help="0 (default): the most likely token each step; above: sample",
            )
            s.add_argument("--top-k", type=NATURAL, default=0, help="sample among the K most likely tokens (0: all)")
            s.add_argument("--beam-size", type=NATURAL, default=0, help="beam search with this many beams (0: none)")
            s.add_argument(
                "--alpha", type=RATE, default=None, help="beam search's length penalty exponent (default 0.6)"
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
            g = add_search_flags(
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
    s.add_argument("-n", "--num-processes", type=COUNT, required=True, help="how many processes")
    s.add_argument(
        "--devices-per-process", type=COUNT, default=None, metavar="K", help="virtual CPU devices per process"
    )
    s.add_argument("--port", type=number_type(int, 1, 65536, "a port from 1 to 65535"), default=None)
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


def add_search_flags(s, search_help: str):
    """The layout search's flags (`plan` and `train`), in a group of their own; returns the group."""
    g = s.add_argument_group("layout search", "choose the layout rules (docs/guides/layout-search.md)")
    g.add_argument("--search", action="store_true", help=search_help)
    g.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="per device, e.g. 16GB (powers of 1000) or 16GiB (default: the device's); plan without --search "
        "says whether its layout fits it",
    )
    g.add_argument("--top", type=COUNT, default=5, metavar="K", help="how many layouts to list (default 5)")
    g.add_argument(
        "--device",
        default=None,
        help="the device to predict for: a known name (h100, a100, tpu-v3, tpu-v4, tpu-v5e, cpu) or a file "
        "`meshax calibrate` wrote (default: $MESHAX_DEVICE, else cpu); plan without --search predicts its "
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
        type=NATURAL,
        default=0,
        metavar="K",
        help="also compile and time the K best layouts (and --layout's) on this machine's devices, and rank "
        "those K by measured step time (settles what the cost model predicts as near ties; lists at least K)",
    )
    return g


def join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
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
