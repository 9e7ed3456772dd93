"""`meshax generate`: text from a trained language model's checkpoint."""

from __future__ import annotations

import os

from meshax.cli.common import layout_table


def run_generate(args, task, console) -> int:
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
        ids = token_ids(args.prompt or "", task.config.vocab_size)
        if len(ids) != task.length:
            raise ConfigError(f"--prompt has {len(ids)} tokens; the model reads --length {task.length}")
        inputs, prompt = np.tile(np.asarray(ids, np.int32), (args.samples, 1)), None
    else:
        # (the bytes given: os.fsencode keeps a command line's bytes that are not UTF-8, which Python
        # holds as surrogates, and str.encode refuses)
        ids = list(os.fsencode(args.prompt)) if text else token_ids(args.prompt, task.config.vocab_size)
        if len(ids) >= task.length:
            raise ConfigError(f"--prompt has {len(ids)} tokens; leave room within --length {task.length}")
        room = task.length - len(ids) + 1  # (the last new token needs no place in the caches)
        if args.new is not None and args.new > room:  # (a longer --length decodes: "train with one" misled)
            learned = task.config.positions == "learned"
            longest = f" (at most the model's max_length {task.config.max_length}: its positions are learned)" * learned
            raise ConfigError(
                f"--new {args.new} after a prompt of {len(ids)} tokens passes --length {task.length}: "
                f"give --new {room} or less, or a longer --length{longest}"
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
        console.print(layout_table(decoder.lowering))
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
        shown = printable(bytes([*ids, *map(int, row)]).decode(errors="replace")) if text else ",".join(map(str, row))
        score = f"  (score {scores[i]:.4f})" if scores is not None else ""
        console.print(f"{shown}{score}", markup=False, highlight=False)
    return 0


def printable(text: str) -> str:
    """Generated text as it can be shown: control characters other than newline and tab as
    escapes (`\\x1b`), so a model's bytes cannot drive the terminal or put NULs in a log."""
    import unicodedata

    return "".join(f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text)


def token_ids(text: str, vocab_size: int) -> list[int]:
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
