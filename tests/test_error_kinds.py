"""Bad input raises a meshax error of its kind (`mx.ConfigError`, `mx.GraphError`, both
`mx.MeshaxError`s and ValueErrors): these raised plain ValueErrors, which `except
mx.MeshaxError` let through."""

import numpy as np
import pytest

import meshax as mx
from meshax.launch import launch
from meshax.models.transformer import Transformer, TransformerConfig
from meshax.train import LmTask, MlpTask
from meshax.train.checkpoint import save_checkpoint


def _lowering():
    graph = mx.Graph()
    mesh = mx.Mesh(graph, "m")
    w = mx.get_variable(mesh, "w", "d:4")
    return mx.Lowering(graph, {mesh: mx.SimdMeshImpl("all:4", "")}), w


def _variable_of_another_shape():
    lowering, w = _lowering()
    lowering.set_variable_value(w, np.ones(3))


def _assigned_twice():
    lowering, w = _lowering()
    lowering.function([], updates=[mx.assign(w, w * 2.0), mx.assign(w, w + 1.0)])


def _long_sequence():
    config = TransformerConfig(positions="learned", max_length=8)
    mesh = mx.Mesh(mx.Graph(), "m")
    tokens = mx.placeholder(mesh, "t", "batch:2;length:16", dtype="int32")
    Transformer(config, mesh).language_model(tokens)


CASES = {
    "resume without a folder": (
        mx.ConfigError,
        lambda: mx.train.train(MlpTask(hidden=16), "all:8", "", 1, resume=True),
    ),
    "a checkpoint's keep": (mx.ConfigError, lambda tmp: save_checkpoint(tmp, _lowering()[0], 0, keep=0)),
    "launch -n 0": (mx.ConfigError, lambda: launch(["true"], 0)),
    "a variable's value of another shape": (mx.GraphError, _variable_of_another_shape),
    "a variable assigned twice": (mx.GraphError, _assigned_twice),
    "global_norm of nothing": (mx.GraphError, lambda: mx.optimize.global_norm([])),
    "an unknown text source": (mx.ConfigError, lambda: LmTask(source="poems")),
    "a sequence longer than max_length": (mx.GraphError, _long_sequence),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_a_meshax_error(case, tmp_path):
    kind, make = CASES[case]
    with pytest.raises(kind):
        make(tmp_path) if make.__code__.co_argcount else make()
