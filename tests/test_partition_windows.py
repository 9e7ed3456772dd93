"""mx.partition of convolutions and pooling split in space (GSPMD section 4.3): a jaxpr's
`conv_general_dilated` (forward, and the two forms JAX writes its gradients in) and its pooling
become meshax's windowed ops, so a spatial axis split over a mesh dim stays split and devices
exchange halos. Checked against jax.jit (values and gradients), against the compiled HLO
(counters), and by what is not communicated (no allgather of the split spatial axes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import meshax as mx
from meshax.jaxpr.flatten import Flat
from meshax.jaxpr.windows import conv_window
from tests.test_partition import MESH, assert_counters_equal_hlo, assert_trees_close

WINDOWED = {
    "ConvOperation",
    "ConvInputGradOperation",
    "ConvFilterGradOperation",
    "PoolOperation",
    "PoolGradOperation",
    "PoolTransposeOperation",
}


def normal(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def conv(x, w, strides, padding="SAME", spec=("NHWC", "HWIO", "NHWC"), **kw):
    return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=spec, **kw)


def net(w1, w2, w3, x):
    """SAME, strided and dilated convolutions, max pooling, padded sum pooling, a 1x1 VALID one."""
    y = jax.nn.relu(conv(x, w1, (1, 1)))
    y = conv(y, w2, (2, 2), rhs_dilation=(2, 1))
    y = lax.reduce_window(jnp.tanh(y), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    y = lax.reduce_window(y, 0.0, lax.add, (1, 1, 2, 1), (1, 1, 1, 1), ((0, 0), (0, 0), (0, 1), (0, 0)))
    return jnp.mean(conv(y, w3, (1, 1), "VALID") ** 2)


def nchw(w, x):
    y = conv(x, w, (2, 2), spec=("NCHW", "OIHW", "NCHW"))
    return jnp.sum(jnp.sin(lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")))


def one_d(w, x):
    y = conv(x, w, (1,), spec=("NWC", "WIO", "NWC"), rhs_dilation=(2,))
    return jnp.sum(conv(jnp.tanh(y), w, (3,), ((2, 1),), spec=("NWC", "WIO", "NWC")) ** 2)


def three_d(w, x):
    y = conv(x, w, (1, 2, 1), spec=("NDHWC", "DHWIO", "NDHWC"))
    return jnp.sum(lax.reduce_window(y, jnp.inf, lax.min, (1, 2, 2, 2, 1), (1, 2, 2, 2, 1), "VALID") ** 2)


def transposed(w, x):
    y = lax.conv_transpose(x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jnp.tanh(y))


def transposed_padded(w, x):
    y = lax.conv_transpose(
        x, w, (2, 2), ((1, 2), (0, 1)), rhs_dilation=(1, 2), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return jnp.sum(jnp.tanh(y))


def big_filter(w, x):
    return jnp.sum(conv(x, w, (1, 1), "VALID") ** 2)


NET = (normal(3, 3, 3, 4), normal(3, 3, 4, 8, seed=1) * 0.3, normal(1, 1, 8, 2, seed=2), normal(2, 32, 32, 3, seed=3))
# (function, arguments, in_shardings, the mesh dims that split space and are never allgathered)
CASES = {
    "h over y": (net, NET, (None, None, None, P(None, "y")), {"y"}),
    "batch over x, w over y": (net, NET, (None, None, None, P("x", None, "y")), {"y"}),
    "h over x, w over y": (net, NET, (None, None, None, P(None, "x", "y")), {"x"}),
    "NCHW": (nchw, (normal(8, 3, 3, 3), normal(2, 3, 16, 16, seed=1)), (None, P(None, None, "y")), {"y"}),
    "1-D, uneven": (one_d, (normal(3, 4, 4), normal(2, 30, 4, seed=1)), (None, P(None, "y")), set()),
    "3-D": (three_d, (normal(3, 3, 3, 2, 4), normal(2, 8, 16, 8, 2, seed=1)), (None, P(None, "x", "y")), {"x", "y"}),
    "conv_transpose": (transposed, (normal(3, 3, 4, 2), normal(2, 8, 8, 4, seed=1)), (None, P(None, "y")), {"y"}),
    "conv_transpose, padded and dilated": (
        transposed_padded,
        (normal(3, 2, 4, 2), normal(2, 8, 8, 4, seed=1)),
        (None, P(None, "y")),
        set(),
    ),
    "filter larger than the output": (
        big_filter,
        (normal(7, 7, 2, 3), normal(2, 12, 12, 2, seed=1)),
        (None, P(None, "y")),
        set(),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_spatially_split_values_gradients_and_counters(case):
    fn, args, specs, never_gathered = CASES[case]
    step = jax.value_and_grad(fn, argnums=tuple(range(len(args))))
    g = mx.partition(step, MESH, in_shardings=specs)
    assert_trees_close(g(*args), jax.jit(step)(*args), rtol=3e-4, atol=3e-5)
    program = g.lower(*args)
    assert_counters_equal_hlo(program, *args)
    assert "ConvOperation" in {type(op).__name__ for op in program.graph.operations}
    sites = g.counters.sites()
    assert any(s.kind == "permute" for s in sites)  # halos
    assert not [s for s in sites if s.kind == "allgather" and set(s.mesh_axes) & never_gathered]


def test_the_h_split_stays_split_through_every_convolution_and_pooling():
    """Every windowed op of the network and of its gradient runs with h split (none gathers it),
    and no allgather runs at all: the activations' halos are all that moves, with the filter
    gradients' sums."""
    step = jax.value_and_grad(net, argnums=(0, 1, 2, 3))
    g = mx.partition(step, MESH, in_shardings=(None, None, None, P(None, "y")))
    program = g.lower(*NET)
    windowed = [op for op in program.graph.operations if type(op).__name__ in WINDOWED]
    assert len(windowed) == 13
    for op in windowed:
        full = op.inputs[0] if type(op).__name__ != "ConvInputGradOperation" else op.outputs[0]
        assert program.lowering.layout_of(full).startswith("x[1]:y"), op
    assert {s.kind for s in g.counters.sites()} == {"permute", "allreduce"}


def test_forms_recover_the_forward_window():
    """A strided, dilated, padded convolution's two gradients (JAX writes them as convolutions
    with other params) are read back as the input and the filter gradient of the forward's
    very window."""

    def f(w, x):
        return jnp.sum(conv(x, w, (2, 3), ((1, 2), (0, 1)), rhs_dilation=(1, 2)) ** 2)

    w, x = normal(3, 2, 4, 5), normal(2, 17, 19, 4, seed=1)
    flat = Flat(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(w, x))
    forms = [conv_window(e) for e in flat.eqns if e.name == "conv_general_dilated"]
    assert [f.kind for f in forms] == ["forward", "filter", "input"]
    fwd, fil, inp = (f.window for f in forms)
    assert (fwd.size, fwd.strides, fwd.dilations, fwd.padding) == ((3, 2), (2, 3), (1, 2), ((1, 2), (0, 1)))
    assert (fwd.inputs, fwd.outputs) == ((17, 19), (9, 6))

    def same(form, size, strides, dilations):  # (hi may be less: the padding no window reaches)
        assert (form.size, form.strides, form.dilations) == (size, strides, dilations)
        assert [lo for lo, _ in form.padding] == [lo for lo, _ in fwd.padding]
        assert all(hi <= want for (_, hi), (_, want) in zip(form.padding, fwd.padding))

    for form in (inp, fil):
        same(form, fwd.size, fwd.strides, fwd.dilations)
        assert (form.inputs, form.outputs) == (fwd.inputs, fwd.outputs)

    def g(w, x):  # a transposed convolution (input dilation): the transpose of that same window
        return jnp.sum(lax.conv_transpose(x, w, (2, 3), ((1, 2), (0, 1)), rhs_dilation=(1, 2)) ** 2)

    w, y = normal(3, 2, 4, 5), normal(2, 7, 5, 4, seed=1)
    flat = Flat(jax.make_jaxpr(jax.grad(g, argnums=(0, 1)))(w, y))
    forms = [conv_window(e) for e in flat.eqns if e.name == "conv_general_dilated"]
    assert [f.kind for f in forms] == ["input", "flipped filter", "forward"]
    assert len({f.window for f in forms}) == 1


@pytest.mark.parametrize("padding", ["VALID", "SAME", ((0, 0), (1, 2), (0, 1), (0, 0))])
def test_average_pooling_and_its_gradient_stay_split(padding):
    """Average pooling's gradient is a pad of the cotangent (interior padding: the strides) read
    by a stride-1 sum: one transposed sum pooling, halos summed back to their owners."""

    def avg(x):
        y = lax.reduce_window(x, 0.0, lax.add, (1, 3, 2, 1), (1, 2, 2, 1), padding) / 6
        return jnp.sum(jnp.sin(y) * jnp.arange(y.shape[1], dtype=y.dtype)[:, None, None])

    x = normal(2, 16, 16, 3, seed=5)
    step = jax.value_and_grad(avg)
    flat = Flat(jax.make_jaxpr(step)(x))
    assert [e.name for e in flat.eqns].count("sum_pool_transpose") == 1
    g = mx.partition(step, MESH, in_shardings=(P(None, "x", "y"),))
    assert_trees_close(g(x), jax.jit(step)(x), rtol=3e-4, atol=3e-5)
    program = g.lower(x)
    assert_counters_equal_hlo(program, x)
    assert "PoolTransposeOperation" in {type(op).__name__ for op in program.graph.operations}


def test_grouped_convolutions_run_whole():
    """Grouped convolutions (and their gradients, which JAX writes with batch groups) keep their
    spatial axes whole, and are right."""

    def grouped(w, x):
        return jnp.sum(conv(x, w, (1, 1), feature_group_count=2) ** 2)

    w, x = normal(3, 3, 2, 4), normal(2, 8, 8, 4, seed=1)
    step = jax.value_and_grad(grouped, argnums=(0, 1))
    flat = Flat(jax.make_jaxpr(step)(w, x))
    assert all(conv_window(e) is None for e in flat.eqns if e.name == "conv_general_dilated")
    g = mx.partition(step, MESH, in_shardings=(None, P(None, "y")))
    assert_trees_close(g(w, x), jax.jit(step)(w, x), rtol=3e-4, atol=3e-5)


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_and_depthwise_convolutions_keep_the_batch_split(groups):
    """A grouped or depthwise convolution (a MobileNet's, a ConvNeXt's) with the batch split
    convolves each device's images, and its filter gradient (batch groups) sums over the devices:
    it gathered every image (the input, and again for the gradients) where jax.jit moves none."""

    def loss(w, x):
        return jnp.mean(jnp.tanh(conv(x, w, (1, 1), feature_group_count=groups)) ** 2)

    w, x = normal(3, 3, 4 // groups, 8), normal(8, 8, 8, 4, seed=1)
    step = jax.value_and_grad(loss, argnums=(0, 1))
    g = mx.partition(step, "data:8", in_shardings=(None, P("data")))
    assert_trees_close(g(w, x), jax.jit(step)(w, x), rtol=3e-4, atol=3e-5)
    program = g.lower(w, x)
    assert_counters_equal_hlo(program)
    assert [(s.kind, s.values) for s in program.counters.sites()] == [("allreduce", 1), ("allreduce", w.size)]


@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("stride", [1, 2])
def test_padded_max_and_min_pooling_read_the_padding_as_the_identity(kind, stride):
    """SAME max pooling (3x3: stride 2 as in a ResNet's stem) on negative values split in space:
    the padding at the image's edges reads as -inf (+inf for min), not as the zeros a halo
    brings from beyond them."""
    op, init = (lax.max, -jnp.inf) if kind == "max" else (lax.min, jnp.inf)

    def pool(x):
        y = lax.reduce_window(x, init, op, (1, 3, 3, 1), (1, stride, stride, 1), "SAME")
        return jnp.sum(y * jnp.arange(y.shape[2], dtype=y.dtype)[:, None])

    x = normal(2, 16, 16, 3, seed=4) + (-4.0 if kind == "max" else 4.0)  # (all one sign: a 0 would win)
    step = jax.value_and_grad(pool)
    g = mx.partition(step, MESH, in_shardings=(P(None, "x", "y"),))
    assert_trees_close(g(x), jax.jit(step)(x), rtol=3e-4, atol=3e-5)
    program = g.lower(x)
    assert {"PoolOperation", "PoolGradOperation"} <= {type(op).__name__ for op in program.graph.operations}
    assert not [s for s in g.counters.sites() if s.kind == "allgather"]
    assert_counters_equal_hlo(program, x)


@pytest.mark.parametrize("space", [False, True])
def test_flax_cnn_trains_like_jax_jit(space):
    """A Flax CNN (Conv, max and average pooling, LayerNorm, Dense; their gradients flip kernels
    with `rev`), one SGD step with the batch split over x, or the images over both mesh dims in
    space: jax.jit's parameters; no windowed op gathers, and in space they exchange halos."""
    nn = pytest.importorskip("flax.linen")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.max_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (2, 2), (2, 2))
            x = nn.avg_pool(nn.relu(nn.Conv(8, (3, 3))(x)), (2, 2), (2, 2))
            return nn.Dense(10)(nn.LayerNorm()(x.reshape(x.shape[0], -1)))

    model, opt = CNN(), optax.sgd(0.1)
    n = 4 if space else 8
    x, y = jax.random.normal(jax.random.key(0), (n, 16, 16, 3)), jnp.arange(n) % 10
    params = model.init(jax.random.key(1), x)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    specs = (P(None, "x", "y"), None) if space else (P("x"), P("x"))
    f = mx.partition(step, MESH, in_shardings=(None, None, *specs))
    args = (params, opt.init(params), x, y)
    assert_trees_close(f(*args), jax.jit(step)(*args), rtol=1e-5, atol=1e-6)
    sites = f.counters.sites()
    assert any(s.kind == "permute" and s.op_type == "ConvOperation" for s in sites) == space
    # no windowed op gathers (average pooling's gradient included: a pad and a sum, fused); the
    # Dense layer takes the flattened features whole
    assert "PoolTransposeOperation" in {type(op).__name__ for op in f.lower(*args).graph.operations}
    assert not [s for s in sites if s.kind == "allgather" and s.op_type in WINDOWED]


def test_flax_unet_split_in_space_trains_like_jax_jit():
    """A Flax U-Net (Conv, max pooling down, ConvTranspose up, skip connections concatenated on
    the channels; GSPMD section 4.3's model), images split over both mesh dims in space, one Adam
    step: jax.jit's parameters, counters equal to the HLO, and nothing allgathered: every
    convolution, pooling and transposed convolution, and each of their gradients, exchanges halos."""
    nn = pytest.importorskip("flax.linen")

    class UNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            c1 = nn.relu(nn.Conv(4, (3, 3))(x))
            c2 = nn.relu(nn.Conv(8, (3, 3))(nn.max_pool(c1, (2, 2), (2, 2))))
            b = nn.relu(nn.Conv(8, (3, 3))(nn.max_pool(c2, (2, 2), (2, 2))))
            c3 = nn.relu(nn.Conv(8, (3, 3))(jnp.concatenate([nn.ConvTranspose(8, (2, 2), (2, 2))(b), c2], -1)))
            c4 = nn.relu(nn.Conv(4, (3, 3))(jnp.concatenate([nn.ConvTranspose(4, (2, 2), (2, 2))(c3), c1], -1)))
            return nn.Conv(2, (1, 1))(c4)

    model, opt = UNet(), optax.adam(1e-2)
    x, y = normal(2, 32, 32, 3), normal(2, 32, 32, 2, seed=1)
    params = model.init(jax.random.key(2), x)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    f = mx.partition(step, MESH, in_shardings=(None, None, P(None, "x", "y"), P(None, "x", "y")))
    args = (params, opt.init(params), x, y)
    assert_trees_close(f(*args), jax.jit(step)(*args), rtol=1e-5, atol=1e-6)
    assert_counters_equal_hlo(f.lower(*args), *args)
    kinds = {s.kind for s in f.counters.sites()}
    assert kinds == {"permute", "allreduce"}  # (halos; the filter gradients' sums)


def test_integer_convolutions_run_as_forward_convolutions():
    """An integer convolution whose kernel outgrows its output, or with input dilation, ran
    through a gradient form's linear_transpose and crashed (float0, helper-12); it is a forward
    convolution (or whole) and equals jax.jit's exactly."""
    x = jnp.arange(72, dtype=jnp.int32).reshape(2, 12, 3) % 7
    w = jnp.arange(84, dtype=jnp.int32).reshape(7, 3, 4) % 5
    spec = ("NWC", "WIO", "NWC")
    for fn in (
        lambda x, w: lax.conv_general_dilated(x, w, (1,), "VALID", dimension_numbers=spec),
        lambda x, w: lax.conv_general_dilated(x, w, (1,), ((1, 1),), lhs_dilation=(2,), dimension_numbers=spec),
    ):
        got = mx.partition(fn, MESH, in_shardings=(P(None, "y"), None))(x, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(x, w)))


def test_a_halo_hop_past_the_mesh_edge_is_no_permute():
    """A halo wider than several slices takes several hops; one as far as the mesh dim is long
    reaches no device (XLA runs none), so it is neither run nor counted (helper-12: 4 permutes
    counted where the HLO has 2), nor estimated."""

    def loss(w, x):
        return jnp.sum(jnp.sin(conv(x, w, (1,), spec=("NWC", "WIO", "NWC"))))

    w, x = normal(11, 2, 2), normal(2, 8, 2, seed=1)
    step = jax.value_and_grad(loss, argnums=(0, 1))
    g = mx.partition(step, MESH, in_shardings=(None, P(None, "x")))
    assert_trees_close(g(w, x), jax.jit(step)(w, x), rtol=3e-4, atol=3e-5)
    program = g.lower(w, x)
    assert_counters_equal_hlo(program, w, x)
    assert program.counters["permute"].count == 2


def test_a_patchify_convolution_is_a_forward_convolution():
    """A patchify convolution (kernel = stride, as a ViT's: the kernel outgrows its output) is
    read as a forward convolution: the filter is the smaller window. Read as a filter gradient it
    tied the kernel's spatial axes to the image's and gathered three tensors (helper-12); each
    device holds whole patches, so it moves nothing but the filter gradient's sum."""

    def loss(w, x):
        return jnp.sum(jnp.tanh(conv(x, w, (16, 16), "VALID")))

    w, x = normal(16, 16, 3, 8) / 16, normal(2, 64, 64, 3, seed=1)
    step = jax.value_and_grad(loss, argnums=(0, 1))
    g = mx.partition(step, MESH, in_shardings=(None, P(None, "y")))
    assert_trees_close(g(w, x), jax.jit(step)(w, x), rtol=3e-4, atol=3e-5)
    flat = Flat(jax.make_jaxpr(step)(w, x))
    assert [conv_window(e).kind for e in flat.eqns if e.name == "conv_general_dilated"] == [
        "forward",
        "filter",
        "input",
    ]
    assert {s.kind for s in g.counters.sites()} == {"allreduce"}
