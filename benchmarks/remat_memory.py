"""What `jax.checkpoint` saves under `mx.partition` and under `jax.jit`: `python -m benchmarks.remat_memory`.

A stack of dense tanh layers, each in `jax.checkpoint` or not, its loss's gradient compiled on
one device by `jax.jit` and by `mx.partition`; the peak memory of each of the four programs by
XLA's memory analysis, and the checkpointed program's over the plain one's. Where XLA
keeps a checkpoint's recomputation apart from the forward (a GPU), both front ends should save
about the same; where it merges the recomputation into the forward (the CPU), neither saves
anything (`meshax.jaxpr.flatten._keeps_recomputation`). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os


def loss_fn(layers: int, checkpoint: bool):
    """The loss of `layers` tanh layers of one [width, width] weight each (each layer in a
    `jax.checkpoint` when `checkpoint`)."""
    import jax
    import jax.numpy as jnp

    def layer(x, w):
        return jnp.tanh(x @ w)

    block = jax.checkpoint(layer) if checkpoint else layer

    def loss(ws, x):
        for i in range(layers):
            x = block(x, ws[i])
        return jnp.sum(x * x)

    return loss


def peak_bytes(front_end: str, layers: int, width: int, batch: int, checkpoint: bool) -> int:
    """What the gradient of `loss_fn` needs at its peak on one device by XLA's memory analysis
    (arguments, outputs and temporaries), compiled by `front_end` ("jax.jit" or "mx.partition")."""
    import jax
    import jax.numpy as jnp

    import meshax as mx

    grad = jax.grad(loss_fn(layers, checkpoint))
    ws = jnp.zeros((layers, width, width), jnp.float32)
    x = jnp.zeros((batch, width), jnp.float32)
    if front_end == "mx.partition":
        return mx.partition(grad, "all:1", devices=jax.devices()[:1]).lower(ws, x).peak_memory_bytes()
    m = jax.jit(grad).lower(ws, x).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def run(layers: int = 8, width: int = 1024, batch: int = 4096) -> list[dict]:
    records = []
    for front_end in ("jax.jit", "mx.partition"):
        plain, kept = (peak_bytes(front_end, layers, width, batch, c) for c in (False, True))
        records.append(
            {"front_end": front_end, "plain_bytes": plain, "checkpointed_bytes": kept, "ratio": kept / plain}
        )
    return records


def main(argv=None) -> list[dict]:
    import jax

    p = argparse.ArgumentParser(prog="python -m benchmarks.remat_memory", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--out", default="benchmarks/out/remat_memory.json", help="the JSON written")
    args = p.parse_args(argv)
    device = jax.devices()[0].device_kind
    print(f"{device}, jax {jax.__version__}, {args.layers} layers of {args.width}, batch {args.batch}")
    records = run(args.layers, args.width, args.batch)
    for r in records:
        mb = 1 << 20
        print(
            f"  {r['front_end']:13s} peak {r['plain_bytes'] / mb:9.1f} MB plain, "
            f"{r['checkpointed_bytes'] / mb:9.1f} MB checkpointed: x{r['ratio']:.3f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": device, "backend": jax.default_backend(), "records": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main()
