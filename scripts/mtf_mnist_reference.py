"""Run the Mesh-TensorFlow README's MNIST example (seed 002) in Mesh-TensorFlow 0.1.21 itself, from
given initial weights and batches, and write its losses: the fixture that
tests/test_mtf_port.py compares meshax's port (examples/mtf_mnist_port.py) with. Run once,
outside the test suite, in an environment with TensorFlow (not meshax's):

    python examples/mtf_mnist_port.py --export /tmp/mtf_inputs.npz        # (meshax's environment)
    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install tensorflow-cpu==2.12.1 \\
        tensorflow-estimator==2.12.0 mesh-tensorflow==0.1.21
    /tmp/tf/bin/python scripts/mtf_mnist_reference.py /tmp/mtf_inputs.npz tests/data/mtf-mnist-losses.json

The model lines are the README's, but for `mtf.einsum([a, b], ...)` (the README's
`mtf.einsum(a, b, ...)` is not valid in 0.1.21, whose einsum takes a list) and the image size
(8 x 8 digits).
"""

import json
import sys

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

tf.disable_v2_behavior()


def main(inputs: str, out: str) -> None:
    data = np.load(inputs)
    steps, batch, rows, cols = data["images"].shape
    tf_images = tf.placeholder(tf.float32, [batch, rows, cols])
    tf_labels = tf.placeholder(tf.int32, [batch])

    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "my_mesh")
    batch_dim = mtf.Dimension("batch", batch)
    rows_dim = mtf.Dimension("rows", rows)
    cols_dim = mtf.Dimension("cols", cols)
    hidden_dim = mtf.Dimension("hidden", data["w1"].shape[-1])
    classes_dim = mtf.Dimension("classes", 10)
    images = mtf.import_tf_tensor(mesh, tf_images, shape=[batch_dim, rows_dim, cols_dim])
    labels = mtf.import_tf_tensor(mesh, tf_labels, [batch_dim])
    w1 = mtf.get_variable(mesh, "w1", [rows_dim, cols_dim, hidden_dim])
    w2 = mtf.get_variable(mesh, "w2", [hidden_dim, classes_dim])
    hidden = mtf.relu(mtf.einsum([images, w1], output_shape=[batch_dim, hidden_dim]))
    logits = mtf.einsum([hidden, w2], output_shape=[batch_dim, classes_dim])
    loss = mtf.reduce_mean(
        mtf.layers.softmax_cross_entropy_with_logits(logits, mtf.one_hot(labels, classes_dim), classes_dim)
    )
    w1_grad, w2_grad = mtf.gradients([loss], [w1, w2])
    update_w1_op = mtf.assign(w1, w1 - w1_grad * 0.001)
    update_w2_op = mtf.assign(w2, w2 - w2_grad * 0.001)

    devices = ["cpu:0"] * 4
    mesh_shape = [("all_processors", 4)]
    layout_rules = [("batch", "all_processors")]
    mesh_impl = mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout_rules, devices)
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    tf_update_ops = [lowering.lowered_operation(update_w1_op), lowering.lowered_operation(update_w2_op)]
    tf_loss = lowering.export_to_tf_tensor(loss)

    masters = {v.op.name: v for v in tf.global_variables()}
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        masters["w1"].load(data["w1"], sess)
        masters["w2"].load(data["w2"], sess)
        sess.run(lowering.copy_masters_to_slices())
        losses = []
        for i in range(steps):
            feed = {tf_images: data["images"][i], tf_labels: data["labels"][i]}
            value, _ = sess.run([tf_loss, tf_update_ops], feed)
            losses.append(float(value))
    with open(out, "w") as f:
        json.dump(
            {
                "mesh_tensorflow": "0.1.21",
                "tensorflow": tf.__version__,
                # (the initial weights' sums: the test checks it starts from the same ones)
                "initial_weight_sums": [
                    float(data["w1"].sum(dtype=np.float64)),
                    float(data["w2"].sum(dtype=np.float64)),
                ],
                "losses": losses,
            },
            f,
        )
        f.write("\n")
    print(f"{out}: {steps} losses, {losses[0]:.6f} .. {losses[-1]:.6f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
