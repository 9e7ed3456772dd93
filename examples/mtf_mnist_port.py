"""The Mesh-TensorFlow README's MNIST example (seed 002), ported by changing its import:
`import meshax as mtf`. The model and layout lines are the README's, as written; what is
replaced is TensorFlow's: the data pipeline (scikit-learn's 8 x 8 digits instead of 28 x 28
MNIST tensors, fed to placeholders instead of imported TensorFlow tensors) and the session
lines (a compiled step called in a loop instead of `tf.Session.run`).

    python examples/mtf_mnist_port.py [--steps 500]        # trains, prints test accuracy
    python examples/mtf_mnist_port.py --export FILE.npz     # initial weights and batches, for
                                                            # scripts/mtf_mnist_reference.py

tests/test_mtf_port.py checks that it trains, and that from the same initial weights and batches
its losses equal Mesh-TensorFlow 0.1.21's (tests/data/mtf-mnist-losses.json).
"""

from __future__ import annotations

import argparse

import numpy as np

import meshax as mtf

BATCH, ROWS, COLS = 100, 8, 8  # data pipeline: the digits are 8 x 8 (MNIST: 28 x 28)


def build():
    """The README's model and layout, lines unchanged but the data's (placeholders, fed below)."""
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    batch_dim = mtf.Dimension("batch", BATCH)
    rows_dim = mtf.Dimension("rows", ROWS)
    cols_dim = mtf.Dimension("cols", COLS)
    hidden_dim = mtf.Dimension("hidden", 1024)
    classes_dim = mtf.Dimension("classes", 10)
    images = mtf.placeholder(mesh, "images", shape=[batch_dim, rows_dim, cols_dim])  # (data pipeline)
    labels = mtf.placeholder(mesh, "labels", [batch_dim], dtype="int32")  # (data pipeline)
    w1 = mtf.get_variable(mesh, "w1", [rows_dim, cols_dim, hidden_dim])
    w2 = mtf.get_variable(mesh, "w2", [hidden_dim, classes_dim])
    # einsum is a generalization of matrix multiplication (see numpy.einsum)
    hidden = mtf.relu(mtf.einsum(images, w1, output_shape=[batch_dim, hidden_dim]))
    logits = mtf.einsum(hidden, w2, output_shape=[batch_dim, classes_dim])
    loss = mtf.reduce_mean(
        mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.one_hot(labels, classes_dim), classes_dim)
    )
    w1_grad, w2_grad = mtf.gradients([loss], [w1, w2])
    update_w1_op = mtf.assign(w1, w1 - w1_grad * 0.001)
    update_w2_op = mtf.assign(w2, w2 - w2_grad * 0.001)

    devices = ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]
    mesh_shape = [("all_processors", 4)]
    layout_rules = [("batch", "all_processors")]
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout_rules, devices)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    # session lines: one compiled step (the loss, and both updates) instead of tf_update_ops
    step = lowering.function(loss, updates=[update_w1_op, update_w2_op])
    predict = lowering.function(mtf.argmax(logits, classes_dim))
    return lowering, (w1, w2), step, predict


def data(steps: int, seed: int = 0):
    """The digits (train and test) at scikit-learn's intensities (0 to 16, as MNIST's are 0 to
    255: the README's learning rate of 0.001 is for raw pixels), and `steps` training batches of
    BATCH, each pass through the training set shuffled anew."""
    from meshax.train.data import load_digits

    x_train, y_train, x_test, y_test = load_digits(seed=seed)  # (scaled to [0, 1])
    x_train, x_test = x_train * 16.0, x_test * 16.0
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(x_train)) for _ in range(steps * BATCH // len(x_train) + 1)])
    batches = [order[i * BATCH : (i + 1) * BATCH] for i in range(steps)]
    return [(x_train[b], y_train[b]) for b in batches], (x_test, y_test)


def initial_weights(lowering, variables) -> list[np.ndarray]:
    """The weights as `get_variable` initialized them (TensorFlow's default, Glorot uniform)."""
    return [lowering.variable_value(v) for v in variables]


def train(steps: int, weights: list[np.ndarray] | None = None, seed: int = 0):
    """Train for `steps` (from `weights` where given); returns (losses, test accuracy)."""
    lowering, variables, step, predict = build()
    if weights is not None:
        for v, w in zip(variables, weights):
            lowering.set_variable_value(v, w)
    batches, (x_test, y_test) = data(steps, seed)
    losses = [float(step({"images": x, "labels": y})) for x, y in batches]
    n = len(x_test) // BATCH * BATCH
    predicted = np.concatenate([np.asarray(predict({"images": x_test[i : i + BATCH]})) for i in range(0, n, BATCH)])
    return losses, float((predicted == y_test[:n]).mean())


def export(path: str, steps: int, seed: int = 0) -> None:
    """Initial weights and `steps` batches, for the reference run in Mesh-TensorFlow."""
    lowering, variables, _, _ = build()
    w1, w2 = initial_weights(lowering, variables)
    batches, _ = data(steps, seed)
    np.savez(path, w1=w1, w2=w2, images=np.stack([x for x, _ in batches]), labels=np.stack([y for _, y in batches]))
    print(f"wrote {path}: weights {w1.shape} {w2.shape}, {steps} batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--export", metavar="FILE.npz", help="write initial weights and batches, and stop")
    args = parser.parse_args()
    mtf.use_cpu_devices(4)
    if args.export:
        export(args.export, args.steps)
        return
    losses, accuracy = train(args.steps)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps; test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
