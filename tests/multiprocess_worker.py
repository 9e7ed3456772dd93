"""One process of a multi-process job for tests/test_multiprocess.py, started by `meshax launch`.

    python tests/multiprocess_worker.py OUT_DIR [RESTORE_DIR]

joins the job (the launcher's environment), then, on the mesh of every process's devices:
collectives of each kind against NumPy, a few training steps of each CASE, a checkpoint written by
all processes, and (with RESTORE_DIR) a checkpoint written elsewhere restored here. Process 0
writes what it saw to OUT_DIR/result.json and the restored variables to OUT_DIR/restored.npz.
"""

import json
import os
import sys

import jax
import numpy as np

import meshax as mx
from meshax.train import loop
from meshax.train.checkpoint import restore_checkpoint

LM = {"source": "markov", "batch_size": 8, "length": 16}  # the tiny Transformer
# (task, task options, mesh, layout): the paper's data-, model- and 2-D-parallel layouts
CASES = {
    "mnist-data": ("mnist", {"hidden": 64}, "all:8", "batch:all"),
    "mnist-model": ("mnist", {"hidden": 64}, "all:8", "hidden:all"),
    "mnist-2d": ("mnist", {"hidden": 64}, "rows:2;cols:4", "batch:rows;hidden:cols"),
    "lm-data": ("lm", LM, "all:8", "batch:all"),
    "lm-model": ("lm", LM, "all:8", "vocab:all;d_ff:all;heads:all"),
    "lm-2d": ("lm", LM, "rows:2;cols:4", "batch:rows;vocab:cols;d_ff:cols;heads:cols"),
}
STEPS = 4
CHECKPOINT_CASE = "mnist-2d"


def make_task(case):
    from meshax.train.tasks import TASKS

    name, options, _, _ = CASES[case]
    return TASKS[name](**options)


def run_case(case, steps=STEPS, checkpoint_dir=None):
    """Losses of `steps` training steps of CASE, and the final evaluation."""
    _, _, mesh, layout = CASES[case]
    result = loop.train(make_task(case), mesh, layout, steps=steps, checkpoint_dir=checkpoint_dir)
    return {"losses": result.losses, "eval": result.evals[-1][1]}


def collectives():
    """Each collective kind on the mesh "all:8" (so every one crosses the processes): the largest
    difference from NumPy and how many of that kind the program has."""
    b, h, d = mx.Dimension("b", 8), mx.Dimension("h", 16), mx.Dimension("d", 8)
    rng = np.random.default_rng(0)
    xv, wv = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)
    cases = {
        "allreduce": ("b:all", lambda x, w: mx.reduce_sum(x, reduced_dim=b), xv.sum(0)),
        "reduce_scatter": (
            "h:all",
            lambda x, w: mx.shard(mx.einsum(x, w, output_shape=[b, d]), "d:all"),
            xv.astype(np.float64) @ wv,
        ),
        "allgather": ("b:all", lambda x, w: mx.shard(x, ""), xv),
        "alltoall": ("b:all", lambda x, w: mx.shard(x, "h:all"), xv),
        "permute": ("b:all", lambda x, w: mx.shift(x, 1, b, wrap=True), np.roll(xv, 1, axis=0)),
    }
    out = {}
    for kind, (layout, build, want) in cases.items():
        graph = mx.Graph()
        mesh = mx.Mesh(graph, "mesh")
        x, w = mx.placeholder(mesh, "x", [b, h]), mx.placeholder(mesh, "w", [h, d])
        y = build(x, w)
        lowering = mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:8", layout)})
        fn = lowering.function(y)
        got = fn({x: xv, w: wv})
        out[kind] = {"error": float(np.abs(got - want).max()), "count": fn.counters[kind].count}
    return out


def _written(out_dir, case):
    return os.path.join(out_dir, "written") if case == CHECKPOINT_CASE else None


def main(out_dir, restore_dir=None):
    result = {
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "collectives": collectives(),
        # (the checkpoint case writes the checkpoint as it runs: by all processes)
        "cases": {case: run_case(case, checkpoint_dir=_written(out_dir, case)) for case in CASES},
    }
    restored = {}
    if restore_dir:
        task = make_task(CHECKPOINT_CASE)
        _, _, mesh, layout = CASES[CHECKPOINT_CASE]
        program = loop.build(task, mesh, layout)
        result["restored_step"] = restore_checkpoint(restore_dir, program.lowering)["step"]
        restored = {v.name: program.lowering.variable_value(v) for v in program.lowering.graph.all_variables}
    if jax.process_index() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
        np.savez(os.path.join(out_dir, "restored.npz"), **{k.replace("/", "."): v for k, v in restored.items()})


if __name__ == "__main__":
    mx.initialize_distributed()  # before anything starts JAX's backend (the launcher's environment)
    main(*sys.argv[1:])
