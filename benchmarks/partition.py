"""Section 9: `mx.partition` against `jax.jit`: the same plain JAX function, the same annotations,
the same mesh.

The functions are `benchmarks.plain_jax`'s training steps (jax.numpy, jax.grad, optax Adam)
on "x:2;y:4": the MLP and the Transformer under GSPMD Table 1's 2D finalized sharding (the
Table 1 weights given as `in_shardings` by argument path, the activations as
`with_sharding_constraint` inside), and a CNN whose images alone are annotated, split in space
(height over x, width over y: halo exchanges, GSPMD section 4.3). meshax
traces, propagates and lowers them itself; `jax.jit` hands the same function and annotations to
XLA's partitioner (the weights placed with those shardings, everything else as the arrays come,
replicated). Both sides run the same step from the same inputs; the first outputs must agree
before anything is timed.

Reported per model: the step-time ratio meshax / XLA (interleaved medians; target <= 1.0), and
the collective bytes each device puts in per step, read from each compiled HLO (target: meshax
<= XLA). On CPU meshax runs its reduce-scatters as all-reduce + slice (`reduce_scatter_as`), as
XLA's partitioner does there; the papers' reduce-scatters are timed beside it, without a target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshax as mx
from benchmarks import plain_jax as pj
from benchmarks.records import collectives_ratio, record, step_ratio
from benchmarks.timing import interleaved
from meshax.lower.mesh_impl import jit_for_platform

MESH = "x:2;y:4"
SHARDING = "finalized"
QUICK = {"lm": pj.Config(), "mlp": (32, 16, 32, 64), "cnn": (4, 32, 8), "steps": 6, "warmup": 2}
FULL = {
    "lm": pj.Config(vocab=512, d_model=128, d_ff=512, heads=8, d_kv=16, layers=2, batch=16, length=64),
    "mlp": (64, 32, 256, 1024),
    "cnn": (8, 128, 16),  # batch, image height = width, channels
    "steps": 30,
    "warmup": 3,
}


def _cases(p: dict) -> list[tuple]:
    """(name, step, args, in_shardings by path) per model."""
    opt = optax.adam(1e-3)
    c = p["lm"]
    lm_params = pj.transformer_params(jax.random.key(0), c)
    ids = jax.random.randint(jax.random.key(1), (c.batch, c.length), 0, c.vocab)
    lm = pj.train_step(pj.transformer_loss, opt, sharding=SHARDING)
    b, s, m, h = p["mlp"]
    mlp_params = pj.mlp_params(jax.random.key(2), m, h)
    x = jax.random.normal(jax.random.key(3), (b, s, m))
    mlp = pj.train_step(pj.mlp_loss, opt, sharding=SHARDING)
    n, side, ch = p["cnn"]
    cnn_params = pj.cnn_params(jax.random.key(4), ch)
    images = jax.random.normal(jax.random.key(5), (n, side, side, 3))
    targets = jax.random.normal(jax.random.key(6), (n, side // 4, side // 4, 2 * ch))
    cnn = pj.train_step(pj.cnn_loss, opt, sharding="spatial")
    return [
        (f"MLP B={b} S={s} M={m} H={h}", mlp, (mlp_params, opt.init(mlp_params), x, x), pj.MLP_WEIGHTS),
        (
            f"CNN {n}x{side}x{side}x3, C={ch}, images split in space (h:x, w:y)",
            cnn,
            (cnn_params, opt.init(cnn_params), images, targets),
            {},
        ),
        (
            f"Transformer M={c.d_model} H={c.d_ff} N={c.heads} L={c.layers} B={c.batch} S={c.length}",
            lm,
            (lm_params, opt.init(lm_params), ids, jnp.roll(ids, -1, axis=1)),
            pj.TRANSFORMER_WEIGHTS,
        ),
    ]


def _xla(step, args: tuple, by_path: dict, mesh):
    """jax.jit of `step` under `mesh`, its Table 1 weights placed with their annotations."""
    import fnmatch

    def place(path, leaf):
        name = "params/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        for pattern, spec in by_path.items():
            if fnmatch.fnmatchcase(name, pattern):
                return jax.device_put(leaf, NamedSharding(mesh, spec))
        return jax.device_put(leaf, NamedSharding(mesh, P()))

    params = jax.tree_util.tree_map_with_path(place, args[0])
    rest = jax.tree_util.tree_map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), args[1:])
    return jit_for_platform(step), (params, *rest)


def _block(tree):
    return jax.block_until_ready(tree)


def _reduce_scatter_as() -> str:
    """How meshax runs its reduce-scatters here: on CPU as all-reduce + slice, as XLA's own
    partitioner does there (XLA:CPU's reduce-scatter takes about twice an all-reduce's time)."""
    return "allreduce" if jax.default_backend() == "cpu" else "reduce_scatter"


def run(quick: bool) -> list[dict]:
    p = QUICK if quick else FULL
    how = _reduce_scatter_as()
    out: list[dict] = []
    for name, step, args, by_path in _cases(p):
        f = mx.partition(step, MESH, in_shardings=by_path, reduce_scatter_as=how)
        program = f.lower(*args)
        args = program.place(*args)[0]  # (laid out once, as a training loop's state would be)
        jitted, xla_args = _xla(step, args, by_path, program.owner.impl.jax_mesh)
        timings = [(f, 1.0)]
        if how != "reduce_scatter":  # the papers' reduce-scatters as well, reported without a target
            native = mx.partition(step, MESH, in_shardings=by_path)
            native.lower(*args)  # (traced outside the mesh context, as `f` was)
            timings.append((native, None))
        cfg = {
            "mesh": MESH,
            "layout": f"(annotations) Table 1 {SHARDING}" if by_path else "(annotations) images P(None, 'x', 'y')",
            "program": f"{name}, Adam",
            "reduce_scatter_as": how,
        }
        with jax.set_mesh(program.owner.impl.jax_mesh):
            got, want = _block(f(*args)), _block(jitted(*xla_args))
            agree = all(
                np.allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
                for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
            )
            first = {"loss meshax": float(got[-1]), "loss xla": float(want[-1]), "agree": agree}
            if not agree:
                out.append(record(9, "step time meshax / XLA", cfg, None, "", status="not timed: outputs differ"))
                continue
            for fn, target in timings:
                t = interleaved(
                    lambda fn=fn, a=args: _block(fn(*a)),
                    lambda j=jitted, a=xla_args: _block(j(*a)),
                    p["steps"],
                    p["warmup"],
                )
                out.append(
                    step_ratio(
                        9,
                        "step time meshax / XLA, same function and annotations",
                        {**cfg, "reduce_scatter_as": fn.impl.reduce_scatter_as},
                        t,
                        "jax.jit",
                        target=target,
                        first_outputs=first,
                    )
                )
            text_xla = jitted.lower(*xla_args).compile().as_text()
        out.append(collectives_ratio(9, cfg, program.compiled_text(), text_xla, name, itemsize=4))  # (f32)
    return out
