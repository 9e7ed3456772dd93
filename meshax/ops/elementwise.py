"""Elementwise ops: unary, binary with broadcasting by name, where, cast, stop_gradient.

Lowering is local: each input is fetched in the output's layout (restricted to its own dims),
so no communication happens unless an input was laid out differently. add, subtract, negative
and identity are linear, so they let partial sums (lazy allreduces) flow through.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Operation, Tensor, as_dtype, is_floating
from meshax.core.shape import Dimension, Shape
from meshax.ops._dtypes import gradient_dtype, inexact, kernel_dtype, result_type
from meshax.ops._util import align, also_accepts, as_tensor

# ---- unary ----------------------------------------------------------------------------------
_UNARY = {
    "negative": jnp.negative,
    "abs": jnp.abs,
    "exp": jnp.exp,
    "log": jnp.log,
    "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt,
    "square": jnp.square,
    "reciprocal": jnp.reciprocal,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "softplus": jax.nn.softplus,
    "sign": jnp.sign,
    "logical_not": jnp.logical_not,
    "identity": lambda x: x,
    "erf": jax.scipy.special.erf,
    "stop_gradient": lambda x: x,
}
_LINEAR_UNARY = {"negative", "identity", "stop_gradient"}
# Computed in floating point, as jnp's transcendental functions are: integers and bools promote.
_INEXACT = {"exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "gelu", "softplus", "erf"}


def _promoting(fn):
    def kernel(x):
        return fn(x.astype(inexact(x.dtype)))

    return kernel


_KERNELS = {name: _promoting(fn) if name in _INEXACT else fn for name, fn in _UNARY.items()}


def _unary_grad(fn: str, x: Tensor, y: Tensor, g: Tensor):
    e = globals()
    if fn in ("negative",):
        return -g
    if fn == "identity":
        return g
    if fn == "abs":  # +1 at 0, as jax.grad(jnp.abs)
        return where(greater_equal(x, 0.0), g, -g)
    if fn == "exp":
        return g * y
    if fn == "log":
        return g / x
    if fn == "sqrt":
        return g * 0.5 / y
    if fn == "rsqrt":
        return g * -0.5 * y * y * y
    if fn == "square":
        return g * 2.0 * x
    if fn == "reciprocal":
        return -g * y * y
    if fn == "sin":
        return g * e["cos"](x)
    if fn == "cos":
        return -g * e["sin"](x)
    if fn == "tanh":
        return g * (1.0 - y * y)
    if fn == "sigmoid":
        return g * y * (1.0 - y)
    if fn == "relu":
        # (y > 0 exactly where x > 0: read from the output, which the step keeps anyway (the next
        # matmul's gradient reads it), so the input need not be kept for the gradient)
        return g * cast(greater(y, 0.0), g.dtype)
    if fn == "gelu":
        cdf = 0.5 * (1.0 + e["erf"](x * (1.0 / math.sqrt(2.0))))
        pdf = e["exp"](x * x * -0.5) * (1.0 / math.sqrt(2.0 * math.pi))
        return g * (cdf + x * pdf)
    if fn == "softplus":
        return g * e["sigmoid"](x)
    if fn == "erf":
        return g * e["exp"](-e["square"](x)) * (2.0 / math.sqrt(math.pi))
    return None  # sign, logical_not, stop_gradient: no gradient flows


class UnaryOperation(Operation):
    def __init__(self, x: Tensor, fn: str, name=None):
        super().__init__([x], name=name or fn)
        self.fn = fn
        if fn == "logical_not" and x.dtype != np.bool_:
            raise GraphError(f"logical_not needs a bool tensor, {x.name} is {x.dtype}")
        dtype = kernel_dtype(fn, _KERNELS[fn], x.dtype)
        self.differentiable = fn not in ("sign", "logical_not", "stop_gradient")
        self._add_output(x.shape, dtype)

    @property
    def linear(self) -> bool:
        """Whether sums owed may flow through it (settled after, once)."""
        return self.fn in _LINEAR_UNARY

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        v = ctx.get(x, run.operands[0], allow_partial=self.linear)
        ctx.add_flops(ctx.local_size(out, run.results[0]))
        ctx.set_output(out, ctx.slicewise(_KERNELS[self.fn], v), run.results[0], v.pending)

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None or not self.differentiable:
            return [None]
        return [_unary_grad(self.fn, self.inputs[0], self.outputs[0], g)]


def _unary(fn):
    def op(x: Tensor, name=None) -> Tensor:
        return UnaryOperation(x, fn, name).outputs[0]

    op.__name__ = op.__qualname__ = fn
    op.__doc__ = f"Elementwise {fn}."
    return op


negative = _unary("negative")
abs = _unary("abs")
exp = _unary("exp")
log = _unary("log")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
square = _unary("square")
reciprocal = _unary("reciprocal")
sin = _unary("sin")
cos = _unary("cos")
tanh = _unary("tanh")
sigmoid = _unary("sigmoid")
relu = _unary("relu")
gelu = _unary("gelu")
softplus = _unary("softplus")
sign = _unary("sign")
logical_not = _unary("logical_not")
identity = _unary("identity")
erf = _unary("erf")
stop_gradient = _unary("stop_gradient")


class CastOperation(Operation):
    is_cast = True  # (a program that updates x may read a kept copy instead: `Lowering.function`)

    def __init__(self, x: Tensor, dtype, name=None):
        super().__init__([x], name=name or "cast")
        dtype = as_dtype(dtype)
        self._add_output(x.shape, dtype)
        self.differentiable = is_floating(dtype) and is_floating(x.dtype)

    def lower(self, ctx):
        (x,), (out,) = self.inputs, self.outputs
        run = ctx.layouts(self)
        v = ctx.get(x, run.operands[0])
        ctx.set_output(out, ctx.slicewise(lambda a: a.astype(out.dtype), v), run.results[0])

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None or not self.differentiable:
            return [None]
        return [cast(g, self.inputs[0].dtype)]


def cast(x: Tensor, dtype, name=None) -> Tensor:
    """x converted to `dtype` (x itself if it already has it)."""
    if as_dtype(dtype) == x.dtype:
        return x
    return CastOperation(x, dtype, name).outputs[0]


# ---- binary (and where), broadcasting by dimension name -------------------------------------
_BINARY = {
    "add": jnp.add,
    "subtract": jnp.subtract,
    "multiply": jnp.multiply,
    "divide": jnp.divide,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "pow": jnp.power,
    "equal": jnp.equal,
    "not_equal": jnp.not_equal,
    "less": jnp.less,
    "less_equal": jnp.less_equal,
    "greater": jnp.greater,
    "greater_equal": jnp.greater_equal,
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "floordiv": jnp.floor_divide,
    "mod": jnp.mod,
}
# jnp's function on two real floats of one dtype is one lax primitive: the lowering binds it
# directly (the same program, traced without jnp's dispatch, which a layout search pays hundreds of
# times). Not complex: jnp orders complex numbers (real part, then imaginary), lax.lt refuses them.
_SAME_FLOAT_LAX = {
    "add": jax.lax.add,
    "subtract": jax.lax.sub,
    "multiply": jax.lax.mul,
    "divide": jax.lax.div,
    "maximum": jax.lax.max,
    "minimum": jax.lax.min,
    "pow": jax.lax.pow,
    "equal": jax.lax.eq,
    "not_equal": jax.lax.ne,
    "less": jax.lax.lt,
    "less_equal": jax.lax.le,
    "greater": jax.lax.gt,
    "greater_equal": jax.lax.ge,
}
_COMPARISONS = {"equal", "not_equal", "less", "less_equal", "greater", "greater_equal"}
_STEPS = {"floordiv", "mod"}  # piecewise constant in x: no gradient, as in Mesh-TensorFlow
_LOGICAL = {"logical_and", "logical_or"}


def union_shape(*shapes: Shape) -> Shape:
    """Dims of the first shape in order, then each later shape's new dims in its order."""
    dims: dict[str, Dimension] = {}
    for s in shapes:
        for d in s:
            if d.name in dims and dims[d.name] != d:
                raise GraphError(
                    f"dimension {d.name!r} has size {dims[d.name].size} in one input and {d.size} in another"
                )
            dims.setdefault(d.name, d)
    return Shape(list(dims.values()))


def gradient_like(g: Tensor, x: Tensor) -> Tensor:
    """g in the dtype of x's gradient: x's own, as in JAX (where an op promoted a bfloat16 x beside
    a float32 operand, the float32 gradient is cast back, as the conversion transposes), or the
    master dtype of a weight's narrower cast (`gradient_dtype`), which keeps a wider g as it is."""
    if is_floating(g.dtype) and g.dtype not in (x.dtype, gradient_dtype(x)):
        return cast(g, x.dtype)
    return g


def _sum_to(g: Tensor, x: Tensor) -> Tensor:
    """Reduce a broadcast gradient back to x's shape (summing the dims x lacks), in the dtype of
    x's gradient (`gradient_like`; summed before it is narrowed)."""
    from meshax.ops.reduce import reduce_sum
    from meshax.ops.shape_ops import transpose

    extra = [d for d in g.shape if d not in x.shape]
    if extra:  # (a bias cast to bfloat16: its gradient sums in float32)
        wide = gradient_dtype(x)
        if is_floating(g.dtype) and wide.itemsize > g.dtype.itemsize:
            g = cast(g, wide)
        g = reduce_sum(g, reduced_dim=extra)
    g = gradient_like(g, x)
    if g.shape != x.shape:
        g = transpose(g, x.shape)
    return g


class ElementwiseOperation(Operation):
    """An n-ary elementwise op whose output has the union of its inputs' dims."""

    def __init__(self, inputs: list[Tensor], fn: str, fn_impl, dtype, linear: bool, name=None):
        super().__init__(inputs, name=name or fn)
        self.fn = fn
        same_real = len({t.dtype for t in inputs}) == 1 and jnp.issubdtype(inputs[0].dtype, jnp.floating)
        self._impl = _SAME_FLOAT_LAX[fn] if same_real and fn in _SAME_FLOAT_LAX else fn_impl
        self.linear = linear
        self._add_output(union_shape(*[t.shape for t in inputs]), dtype)

    def lower(self, ctx):
        out = self.outputs[0]
        run = ctx.layouts(self)
        (layout,) = run.results
        vals = [ctx.get(t, lay, allow_partial=self.linear) for t, lay in zip(self.inputs, run.operands)]
        pending = {v.pending for v in vals}
        if len(pending) > 1:  # sums owed over different axes cannot be combined before settling
            vals = [ctx.get(t, lay) for t, lay in zip(self.inputs, run.operands)]
        shapes = [t.shape for t in self.inputs]
        ctx.add_flops(ctx.local_size(out, layout))
        ctx.set_output(
            out,
            ctx.slicewise(lambda *xs: self._impl(*[align(a, s, out.shape) for a, s in zip(xs, shapes)]), *vals),
            layout,
            vals[0].pending,
        )

    def gradient(self, grad_outputs):
        (g,) = grad_outputs
        if g is None or self.fn in _COMPARISONS | _LOGICAL | _STEPS:
            return [None] * len(self.inputs)
        if self.fn == "where":
            c, x, y = self.inputs
            zero = 0.0
            return [None, _sum_to(where(c, g, zero), x), _sum_to(where(c, zero, g), y)]
        x, y = self.inputs
        z = self.outputs[0]
        f = self.fn
        if f == "add":
            gx, gy = g, g
        elif f == "subtract":
            gx, gy = g, -g
        elif f == "multiply":
            gx, gy = g * y, g * x
        elif f == "divide":
            yp = _promoted(y, z)
            gx, gy = g / y, -g * x / (yp * yp)
        elif f in ("maximum", "minimum"):  # ties share the gradient equally, as in jax.grad
            wins = greater(x, y) if f == "maximum" else less(x, y)
            mask = cast(wins, g.dtype) + cast(equal(x, y), g.dtype) * 0.5
            gx, gy = g * mask, g * (1.0 - mask)
        elif f == "pow":
            xp, yp = _promoted(x, z), _promoted(y, z)
            gx = g * yp * pow(xp, yp - 1.0)
            gy = g * z * log(where(greater(xp, 0.0), xp, 1.0))
        else:  # pragma: no cover
            raise NotImplementedError(f)
        return [_sum_to(gx, x), _sum_to(gy, y)]


def _promoted(t: Tensor, z: Tensor) -> Tensor:
    """Operand t as the op computed with it: in its float result z's dtype (JAX promotes a bfloat16
    operand beside a float32 one first), so that what its gradient computes from t alone (pow's
    y - 1 and log x, divide's y * y) is not rounded to t's narrower dtype."""
    return cast(t, z.dtype) if is_floating(z.dtype) else t


def _binary_dtype(fn, x: Tensor, y: Tensor):
    if fn in _LOGICAL and (x.dtype != np.bool_ or y.dtype != np.bool_):
        raise GraphError(f"{fn} needs bool tensors, got {x.dtype} and {y.dtype}")
    return kernel_dtype(fn, _BINARY[fn], x.dtype, y.dtype)


def to_output_shape(y: Tensor, output_shape) -> Tensor:
    """y with its dims in `output_shape`'s order, broadcast over the dims it lacks (Mesh-TensorFlow's
    `output_shape` argument of elementwise ops); y itself when none is given."""
    if output_shape is None:
        return y
    from meshax.ops.shape_ops import broadcast

    return broadcast(y, output_shape)


def _binary(fn):
    def op(x1, x2, output_shape=None, name=None) -> Tensor:
        if not isinstance(x1, Tensor) and not isinstance(x2, Tensor):
            raise GraphError(f"{fn} needs at least one meshax Tensor, got {x1!r} and {x2!r}")
        t = x1 if isinstance(x1, Tensor) else x2
        x1 = as_tensor(x1, t.mesh, t.dtype)
        x2 = as_tensor(x2, t.mesh, t.dtype)
        y = ElementwiseOperation(
            [x1, x2], fn, _BINARY[fn], _binary_dtype(fn, x1, x2), linear=fn in ("add", "subtract"), name=name
        ).outputs[0]
        return to_output_shape(y, output_shape)

    op.__name__ = op.__qualname__ = fn
    op.__doc__ = (
        f"Elementwise {fn} with broadcasting by dimension name; the output has the union of dims "
        "(in `output_shape`'s order, and broadcast to it, where given)."
    )
    return also_accepts(x="x1", y="x2")(op)


add = _binary("add")
subtract = _binary("subtract")
multiply = _binary("multiply")
divide = _binary("divide")
maximum = _binary("maximum")
minimum = _binary("minimum")
_pow = _binary("pow")


@also_accepts(x1="x", x2="y")
def pow(x, y, output_shape=None, name=None) -> Tensor:
    """x ** y elementwise, broadcast by dimension name (Mesh-TensorFlow names its arguments x, y
    here, and x1, x2 in the other binary ops: both work)."""
    return _pow(x, y, output_shape, name)


equal = _binary("equal")
not_equal = _binary("not_equal")
less = _binary("less")
less_equal = _binary("less_equal")
greater = _binary("greater")
greater_equal = _binary("greater_equal")
logical_and = _binary("logical_and")
logical_or = _binary("logical_or")
floordiv = _binary("floordiv")
mod = _binary("mod")
sub = subtract  # (Mesh-TensorFlow's name)


@also_accepts(x="if_true", y="if_false")
def where(condition: Tensor, if_true, if_false, output_shape=None, name=None) -> Tensor:
    """`if_true` where condition holds, else `if_false`; broadcast by dimension name (to
    `output_shape`, where given)."""
    x, y = if_true, if_false
    if not isinstance(condition, Tensor) or condition.dtype != np.bool_:
        raise GraphError("where: condition must be a bool meshax Tensor (build one with mx.less, mx.equal, ...)")
    if isinstance(x, Tensor) or isinstance(y, Tensor):
        like = x.dtype if isinstance(x, Tensor) else y.dtype
    else:
        like = result_type(x, y)
    x = as_tensor(x, condition.mesh, like)
    y = as_tensor(y, condition.mesh, like)
    out = ElementwiseOperation(
        [condition, x, y],
        "where",
        jnp.where,
        kernel_dtype("where", jnp.where, condition.dtype, x.dtype, y.dtype),
        linear=False,
        name=name,
    ).outputs[0]
    return to_output_shape(out, output_shape)


# ---- Mesh-TensorFlow's activations and casts, composed of the ops above (so their gradients) --
def swish(x: Tensor) -> Tensor:
    """x * sigmoid(x)."""
    return x * sigmoid(x)


def squared_relu(x: Tensor) -> Tensor:
    """relu(x) squared."""
    return square(relu(x))


def leaky_relu(x: Tensor, alpha: float = 0.2, name=None) -> Tensor:
    """x where x > 0, else alpha * x."""
    return where(greater(x, 0.0), x, x * alpha, name=name)


def elu(x: Tensor) -> Tensor:
    """x where x > 0, else exp(x) - 1 (exp of min(x, 0): no overflow on the branch not taken)."""
    return where(greater(x, 0.0), x, exp(minimum(x, 0.0)) - 1.0)


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772, 1.0507009873554805


def selu(x: Tensor) -> Tensor:
    """scale * (x where x > 0, else alpha * (exp(x) - 1)), with tf.nn.selu's constants."""
    return where(greater(x, 0.0), x, (exp(minimum(x, 0.0)) - 1.0) * _SELU_ALPHA) * _SELU_SCALE


def to_float(x: Tensor, name=None) -> Tensor:
    """x as float32."""
    return cast(x, "float32", name)


def widened(x: Tensor) -> Tensor:
    """x in float32 where it is a narrower float (bfloat16, float16), else x: statistics (squares,
    means, norms) of 16-bit values are taken in float32, where float16's squares neither underflow
    (1e-4 squared is 0) nor overflow (300 squared is inf)."""
    return cast(x, "float32") if is_floating(x.dtype) and x.dtype.itemsize < 4 else x


def to_bfloat16(x: Tensor, name=None) -> Tensor:
    """x as bfloat16."""
    return cast(x, "bfloat16", name)


def to_int32(x: Tensor, name=None) -> Tensor:
    """x as int32."""
    return cast(x, "int32", name)


def add_n(xs) -> Tensor:
    """The sum of a list of tensors, broadcast by dimension name."""
    xs = list(xs)
    if not xs:
        raise GraphError("add_n needs at least one tensor")
    total = xs[0]
    for t in xs[1:]:
        total = add(total, t)
    return total
