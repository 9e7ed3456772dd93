"""The Mesh-TensorFlow README's MNIST example, ported by its import (examples/mtf_mnist_port.py):
it trains, and from the same initial weights and batches its losses equal those Mesh-TensorFlow
0.1.21 itself computed (tests/data/mtf-mnist-losses.json, written by
scripts/mtf_mnist_reference.py)."""

import importlib.util
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mtf_mnist_port", ROOT / "examples" / "mtf_mnist_port.py")
port = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(port)
REFERENCE = json.loads((ROOT / "tests" / "data" / "mtf-mnist-losses.json").read_text())


def test_the_port_computes_mesh_tensorflows_losses():
    lowering, variables, _, _ = port.build()
    weights = port.initial_weights(lowering, variables)  # (the ones exported for the reference run)
    np.testing.assert_allclose([w.sum(dtype=np.float64) for w in weights], REFERENCE["initial_weight_sums"], rtol=1e-6)
    want = np.asarray(REFERENCE["losses"])
    losses, _ = port.train(len(want), weights)
    assert losses[0] == np.float32(want[0])  # the first step: the same computation, bit for bit
    # later steps: float32 rounding in other orders of summation, carried on by training
    np.testing.assert_allclose(losses, want, rtol=1e-4)


def test_the_port_trains_to_95_percent_on_the_digits():
    losses, accuracy = port.train(400)  # (0.970 after 400 steps; 0.973 after the example's 500)
    assert losses[-1] < 0.5 * losses[0]
    assert accuracy >= 0.95, accuracy
