"""einsum / matmul vs np.einsum (all cases run as one program per impl and layout)."""

import numpy as np
import pytest

import meshax as mx
from tests.conftest import LAYOUTS, B, D, H, assert_close, check_cases, impls_and_layouts, names, new_mesh, rand, run

K = mx.Dimension("k", 4)

# the canonical layouts on both impls, plus (SIMD only) one more layout
layouts = impls_and_layouts(LAYOUTS, simd_extra=["d:rows;h:cols"])

SIZES = {"b": 8, "h": 4, "d": 8, "k": 4}
DIMS = {"b": B, "h": H, "d": D, "k": K}


def _ph(mesh, name, dims):
    return mx.placeholder(mesh, name, [DIMS[c] for c in dims])


# name -> (input dim strings, builder(tensors) -> output, expected output dims)
CASES = {
    "matmul-default": (["bh", "hd"], lambda t: mx.einsum(t[0], t[1]), "bd"),
    "matmul-list-arg": (["bh", "hd"], lambda t: mx.einsum([t[0], t[1]]), "bd"),
    "transposed-out": (["bh", "hd"], lambda t: mx.einsum(t[0], t[1], output_shape=[D, B]), "db"),
    "keep-contracted": (["bh", "hd"], lambda t: mx.einsum(t[0], t[1], output_shape=[B, H, D]), "bhd"),
    "full-contraction": (["bh", "bh"], lambda t: mx.einsum(t[0], t[1]), ""),
    "rowwise-dot": (["bh", "bh"], lambda t: mx.einsum(t[0], t[1], output_shape=[B]), "b"),
    "reduced-dims": (["bh", "bh"], lambda t: mx.einsum(t[0], t[1], reduced_dims=[H]), "b"),
    "reduced-dims-matmul": (["bh", "hd"], lambda t: mx.einsum(t[0], t[1], reduced_dims=[H]), "bd"),
    "single-input": (["bhd"], lambda t: mx.einsum(t[0], output_shape=[D, B]), "db"),
    "single-input-transpose": (["bhd"], lambda t: mx.einsum([t[0]], output_shape=[D, H, B]), "dhb"),
    "three-inputs": (["bh", "hd", "d"], lambda t: mx.einsum(t[0], t[1], t[2]), "b"),
    "three-inputs-out": (["bh", "hd", "d"], lambda t: mx.einsum([t[0], t[1], t[2]], output_shape=[B, D]), "bd"),
    "outer": (["b", "d"], lambda t: mx.einsum(t[0], t[1]), "bd"),
    "outer-out": (["b", "d"], lambda t: mx.einsum(t[0], t[1], output_shape=[D, B]), "db"),
    "batched": (["bhd", "dk"], lambda t: mx.einsum(t[0], t[1], output_shape=[B, H, K]), "bhk"),
    "batched-default": (["bhd", "bdk"], lambda t: mx.einsum(t[0], t[1]), "hk"),
    "matmul": (["bh", "hd"], lambda t: mx.matmul(t[0], t[1]), "bd"),
    "matmul-out": (["bh", "hd"], lambda t: mx.matmul(t[0], t[1], output_shape=[D, B]), "db"),
    "matmul-reduced": (["bhd", "hd"], lambda t: mx.matmul(t[0], t[1], reduced_dims=[H, D]), "b"),
}


def _case(name, seed):
    in_dims, build_fn, out_dims = CASES[name]

    def build(mesh):
        tensors = [_ph(mesh, f"x{i}", dims) for i, dims in enumerate(in_dims)]
        y = build_fn(tensors)
        assert names(y) == list(out_dims)
        values = [rand([SIZES[c] for c in dims], seed=seed + i) for i, dims in enumerate(in_dims)]
        spec = ",".join(in_dims) + "->" + out_dims
        want = np.einsum(spec, *[v.astype(np.float64) for v in values])
        return [(y, want)], dict(zip(tensors, values))

    return build


@layouts
def test_einsum(layout, impl_cls):
    check_cases({name: _case(name, 10 * i) for i, name in enumerate(CASES)}, impl_cls, layout)


@layouts
def test_einsum_chain(layout, impl_cls):
    """Two layers: relu(x @ w1) @ w2, with a reduction at the end."""
    _, mesh = new_mesh()
    x = _ph(mesh, "x", "bh")
    w1 = _ph(mesh, "w1", "hd")
    w2 = _ph(mesh, "w2", "dk")
    hidden = mx.relu(mx.einsum(x, w1, output_shape=[B, D]))
    logits = mx.einsum(hidden, w2, output_shape=[B, K])
    loss = mx.reduce_sum(logits * logits)
    xv, w1v, w2v = rand([8, 4], 41), rand([4, 8], 42), rand([8, 4], 43)
    got_logits, got_loss = run([logits, loss], impl_cls, layout=layout, feeds={x: xv, w1: w1v, w2: w2v})
    want = np.maximum(xv.astype(np.float64) @ w1v, 0.0) @ w2v
    assert_close(got_logits, want.astype(np.float32))
    assert_close(got_loss, np.float32((want**2).sum()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "dtypes",
    [
        ("float32", "float32", "float32"),
        ("bfloat16", "bfloat16", "float32"),
        ("bfloat16", "bfloat16", "bfloat16"),
        ("bfloat16", "float32", "float32"),
        ("int32", "int32", "int32"),
    ],
)
def test_the_slice_kernel_is_jnp_einsums_program(dtypes):
    """`contract` builds for one or two operands what jnp.einsum builds (without its per-call
    path search): the same jaxpr, so the same values, for every kind of dim (batch, contracted,
    free on either side, summed on one side only), output order and dtypes (the operands' and
    the output's: mixed precision)."""
    import jax
    import jax.numpy as jnp

    from meshax.ops.einsum import contract

    specs = ["abc,cd->abd", "abc,cd->dba", "ab,ab->", "ab,ab->ba", "abc,bcd->ad", "ab,cd->dcab", "abcd,bd->ac"]
    specs += ["abc,ac->ba", "ab,bc->ca", "abc->ca", "abc->", "ab->ab"]
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    rng = np.random.default_rng(0)
    *dtypes_in, dtype = (jnp.dtype(d) for d in dtypes)
    for spec in specs:
        names = spec.split("->")[0].split(",")
        xs = [(rng.normal(size=[sizes[c] for c in n]) * 3).astype(d) for n, d in zip(names, dtypes_in)]
        want = jax.make_jaxpr(lambda *a, s=spec: jnp.einsum(s, *a, preferred_element_type=dtype))(*xs)
        got = jax.make_jaxpr(lambda *a, s=spec: contract(s, a, dtype))(*xs)
        assert str(got) == str(want), spec
        np.testing.assert_array_equal(
            np.asarray(contract(spec, xs, dtype)), np.asarray(jnp.einsum(spec, *xs, preferred_element_type=dtype))
        )


def test_an_output_dim_of_another_size_or_a_misspelt_name_is_named():
    """output_shape naming an input's dim at another size said the dim 'appears in no input'."""
    _, mesh = new_mesh()
    x, w = _ph(mesh, "x", "bh"), _ph(mesh, "w", "hd")
    with pytest.raises(mx.GraphError, match=r"output_shape has d:9, but the inputs have d:8"):
        mx.einsum(x, w, output_shape=[B, mx.Dimension("d", 9)])
    with pytest.raises(mx.GraphError, match=r"appear in no input .*\(did you mean 'd'\?\)"):
        mx.einsum(x, w, output_shape="b:8;dd:8")


def test_reduced_dims_no_input_has_or_also_in_the_output_are_named():
    """reduced_dims naming a dim no input has (a typo), or one at another size, reduced nothing,
    silently: einsum(x, w, reduced_dims=[hh]) kept h and summed nothing. With output_shape too,
    reduced_dims were not read at all: a dim in both was kept, silently."""
    _, mesh = new_mesh()
    x, w = _ph(mesh, "x", "bh"), _ph(mesh, "w", "hd")
    with pytest.raises(mx.GraphError, match=r"reduced_dims has Dimension\('hh', 4\), but no input has it"):
        mx.einsum(x, w, reduced_dims=[mx.Dimension("hh", H.size)])
    with pytest.raises(mx.GraphError, match=r"Dimension\('h', 3\), but the inputs have Dimension\('h', 4\)"):
        mx.einsum(x, w, reduced_dims=[mx.Dimension("h", 3)])
    with pytest.raises(mx.GraphError, match=r"reduced_dims \[Dimension\('h', .*\)\] are in the output_shape .* too"):
        mx.einsum(x, w, output_shape=[B, H, D], reduced_dims=[H])
    assert mx.einsum(x, w, output_shape=[B, D], reduced_dims=[H]).shape == mx.Shape([B, D])
    assert mx.einsum(x, w, reduced_dims=[H]).shape == mx.Shape([B, D])
