"""A differential fuzzer: random meshax programs, laid out at random, against jax.numpy.

A `Program` is drawn choice by choice from a `Draws` (hypothesis's, in `test_fuzz.py`, so a
failing case shrinks): a random mesh; a few named dims shared by all tensors (as in real
models); placeholders, variables and constants; then a chain of ops from every public op
family, each recorded twice: as the meshax op and as a jax.numpy function of its inputs' values
(the reference, on one device, dims in the tensor's order). The loss sums some results against
fixed random weights, and its gradients with respect to the float placeholders are built with
`mx.gradients` and checked against `jax.grad` of the reference. Layout rules are drawn last,
over every dim name of the graph (one tensor dim over several mesh dims included), beside the
`mx.shard` annotations drawn while building. Random ops are checked against their definition
(each value keyed by its global position), so they too must not depend on the layout.

Mixed precision: bfloat16 placeholders, float32 variables read through bfloat16 casts (their
gradients taken too, summed in float32), bfloat16 ops of most families. A value computed from a
bfloat16 one is rounded differently by each layout (sums in other orders), so it is compared
within its rounding: the reference is run again with every bfloat16 computed in float32, and the
distance between the two references bounds the error bfloat16 makes (`_close`). Ops whose result
jumps where their input crosses a point (comparisons, casts to integers, argmax, abs's and
relu's gradients) never read such a value. A program that updates variables runs twice, the
second step from the first's new values, and half of them keep their bfloat16 weight copies
between the steps (`Lowering.function(cast_copies=True)`, on by default only on GPUs).

To add an op family: write a method `_op_<family>` that appends steps with `self._emit`, and
add it to `FAMILIES`; the coverage counter in `Program.families` reports it.
"""

from __future__ import annotations

import collections
import string

import jax
import jax.numpy as jnp
import numpy as np

import meshax as mx
from meshax.layout.propagate import Propagation

MESHES = ["all:1", "all:2", "all:4", "all:8", "rows:2;cols:4", "rows:4;cols:2", "rows:2;cols:2", "x:2;y:2;z:2"]
MESHES += ["all:3", "all:6", "rows:3;cols:2"]  # (a 3-way split pads every size in SIZES but 3)
SIZES = [1, 2, 3, 4, 5, 7, 8]  # 3, 5 and 7 split unevenly (padded) over most mesh dims
MAX_RANK = 4
FLOATS = ("float32", "bfloat16")
NARROW = ("bfloat16", "float16")  # rounded: compared within their rounding (`_close`)
KINKS = {"abs", "relu", "sign"}  # their gradients (sign: its value) jump at 0: no rounded input
UNARY = [
    "negative",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "square",
    "reciprocal",
    "sin",
    "cos",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "softplus",
    "sign",
    "identity",
    "erf",
    "stop_gradient",
]
POSITIVE_ONLY = {"log", "sqrt", "rsqrt", "reciprocal"}
REF_UNARY = {
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
    "gelu": lambda a: jax.nn.gelu(a, False),
    "softplus": jax.nn.softplus,
    "sign": jnp.sign,
    "identity": lambda a: a,
    "erf": jax.scipy.special.erf,
    "stop_gradient": jax.lax.stop_gradient,
}
ARITH = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "pow"]
COMPARE = ["equal", "not_equal", "less", "less_equal", "greater", "greater_equal"]
REF_BINARY = {
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
}
REF_REDUCE = {
    "sum": jnp.sum,
    "mean": jnp.mean,
    "max": jnp.max,
    "min": jnp.min,
    "logsumexp": jax.scipy.special.logsumexp,
    "any": jnp.any,
    "all": jnp.all,
}


_WIDE = [False]  # the reference computed with float32 in place of bfloat16 (`Program.reference`)


def ref_dtype(dtype):
    """The dtype the reference casts to: float32 for bfloat16 (float16) in the wide reference."""
    return np.dtype("float32") if _WIDE[0] and str(np.dtype(dtype)) in NARROW else np.dtype(dtype)


def rounded_sum(a, axes):
    """jnp.sum over `axes`; a bfloat16 sum added up one term at a time in bfloat16, each partial
    sum rounded: meshax rounds a sum over devices at each device's partial sum (in bfloat16, as a
    device's allreduce does), which can be far larger than the result (cancellation). The narrow
    reference's sums so round at least as often as meshax's, and its distance from the wide
    reference covers their roundings (`_close`)."""
    if a.dtype != jnp.bfloat16:
        return jnp.sum(a, axis=axes)
    axes = tuple(sorted(ax % a.ndim for ax in axes))
    moved = jnp.moveaxis(a, axes, tuple(range(len(axes))))
    terms = moved.reshape((-1, *moved.shape[len(axes) :]))
    return jax.lax.scan(lambda acc, t: (acc + t, None), jnp.zeros(terms.shape[1:], a.dtype), terms)[0]


def rounded_cumsum(a, axis):
    """jnp.cumsum, bfloat16 partial sums rounded one term at a time (`rounded_sum`)."""
    if a.dtype != jnp.bfloat16:
        return jnp.cumsum(a, axis=axis)
    _, sums = jax.lax.scan(
        lambda acc, t: (acc + t,) * 2, jnp.zeros_like(jnp.moveaxis(a, axis, 0)[0]), jnp.moveaxis(a, axis, 0)
    )
    return jnp.moveaxis(sums, 0, axis)


def rounded_einsum(spec, *xs):
    """jnp.einsum; a bfloat16 one as its products, summed by `rounded_sum`."""
    ins, out = spec.split("->")
    summed = "".join(c for c in dict.fromkeys(ins.replace(",", "")) if c not in out)
    if not summed or any(x.dtype != jnp.bfloat16 for x in xs):
        return jnp.einsum(spec, *xs)
    products = jnp.einsum(f"{ins}->{out}{summed}", *xs)
    return rounded_sum(products, tuple(range(len(out), len(out) + len(summed))))


def reduce_ref(kind, a, axes):
    """The reference of reduce_<kind> over `axes` (sums of bfloat16: `rounded_sum`)."""
    if kind == "sum" and a.dtype == jnp.bfloat16:
        return rounded_sum(a, axes)
    if kind == "mean" and a.dtype == jnp.bfloat16:
        return rounded_sum(a, axes) / int(np.prod([a.shape[ax] for ax in axes]))
    return REF_REDUCE[kind](a, axis=axes)


class Draws:
    """Choices from `draw_int(lo, hi)` (inclusive): hypothesis's, or a seeded RNG's."""

    def __init__(self, draw_int):
        self.int = draw_int

    def pick(self, seq):
        seq = list(seq)
        return seq[self.int(0, len(seq) - 1)]

    def coin(self, percent: int = 50) -> bool:
        return self.int(0, 99) < percent

    def subset(self, seq, at_least=0):
        seq = list(seq)
        chosen = [x for x in seq if self.coin()]
        while len(chosen) < at_least:
            chosen.append(next(x for x in seq if x not in chosen))
        return chosen

    def order(self, seq):
        seq, out = list(seq), []
        while seq:
            out.append(seq.pop(self.int(0, len(seq) - 1)))
        return out


def names(t) -> list[str]:
    return list(t.shape.dimension_names)


def to_names(a, have: list[str], want: list[str]):
    """`a` (dims `have`) transposed to the order of `want`, with size-1 axes for dims it lacks."""
    present = [n for n in want if n in have]
    a = jnp.transpose(a, [have.index(n) for n in present]) if have else a
    shape, k = [], 0
    for n in want:
        if n in have:
            shape.append(a.shape[k])
            k += 1
        else:
            shape.append(1)
    return jnp.reshape(a, shape)


def compatible(*shapes) -> bool:
    sizes = {}
    for s in shapes:
        for d in s:
            if sizes.setdefault(d.name, d.size) != d.size:
                return False
    return True


def kin(t, x) -> bool:
    """Whether t may join x in a concat or stack: one dtype, or two floats (promoted)."""
    return t.dtype == x.dtype or (str(t.dtype) in FLOATS and str(x.dtype) in FLOATS)


def union_names(*tensors) -> list[str]:
    out = []
    for t in tensors:
        out += [n for n in names(t) if n not in out]
    return out


class Program:
    """One random program, its feeds, and its jax.numpy reference."""

    def __init__(self, draws: Draws, length: int):
        self.r = r = draws
        self.graph = mx.Graph()
        self.mesh = mx.Mesh(self.graph, "mesh")
        self.mesh_shape = r.pick(MESHES)
        self.mesh_dims = [(p.split(":")[0], int(p.split(":")[1])) for p in self.mesh_shape.split(";")]
        self.dims = [mx.Dimension(n, r.pick(SIZES)) for n in "abcde"[: r.int(2, 5)]]
        self.rng = np.random.default_rng(r.int(0, 2**16))
        self.steps: list[tuple] = []  # (output tensors, reference fn, input tensors)
        self.feeds: dict = {}
        self.variables: list = []
        self.updates: list = []
        self.pool: list = []
        self.approx: set = set()  # values computed from bfloat16 ones: rounded, layout by layout
        self.families = collections.Counter()
        self._fresh = 0
        for _ in range(r.int(1, 3)):
            self._placeholder("float32")
        if r.coin(40):
            self._placeholder("int32")
        if r.coin(25):
            self._placeholder("bool")
        if r.coin(20):
            self._placeholder("bfloat16")
        for _ in range(length):
            family = r.pick(FAMILIES)
            if getattr(self, "_op_" + family)() is not False:
                self.families[family] += 1
        self._finish()

    # ---- building blocks ----------------------------------------------------------------------
    def fresh(self, size: int) -> mx.Dimension:
        self._fresh += 1
        return mx.Dimension(f"n{self._fresh}", size)

    def _emit(self, outs, fn, ins, pool=True):
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        if any(t in self.approx for t in ins) or any(str(t.dtype) in NARROW for t in outs):
            self.approx.update(outs)
        self.steps.append((tuple(outs), fn, tuple(ins)))
        if pool:
            self.pool.extend(outs)
        return outs[0]

    def _shape(self, rank_lo=0, rank_hi=3):
        return [d for d in self.r.order(self.dims)][: self.r.int(rank_lo, min(rank_hi, len(self.dims)))]

    def _placeholder(self, dtype):
        shape = self._shape(1, 3)
        t = mx.placeholder(self.mesh, f"p{len(self.feeds)}", shape, dtype)
        size = [d.size for d in shape]
        if dtype in FLOATS:
            value = self.rng.uniform(-1, 1, size).astype(dtype)
        elif dtype == "int32":
            value = self.rng.integers(0, 8, size).astype(np.int32)
        else:
            value = self.rng.uniform(size=size) < 0.5
        self.feeds[t] = value
        self._emit(t, None, ())

    def _take(self, dtypes=("float32",), where=lambda t: True, exact=False):
        """A tensor of the pool, recent ones likelier; None if none fits. `exact`: none computed
        from a bfloat16 value (for an op whose result jumps: a rounding would change it)."""
        fits = [t for t in self.pool if str(t.dtype) in dtypes and where(t) and not (exact and t in self.approx)]
        if not fits:
            return None
        return fits[-1 - min(self.r.int(0, 6), len(fits) - 1)]

    def _partner(self, x, dtypes=("float32",), exact=False):
        """A tensor that broadcasts with x (by name) within the rank limit, or None."""
        return self._take(
            dtypes, lambda t: compatible(x.shape, t.shape) and len(union_names(x, t)) <= MAX_RANK, exact=exact
        )

    def _positive(self, x, at_least=0.5):
        """x made positive: |x| + at_least, or x * x + at_least for a rounded x (smooth: |x|'s
        gradient flips its sign where a rounding moves x across 0)."""
        if x in self.approx:
            return self._emit(mx.square(x) + at_least, lambda a: jnp.square(a) + at_least, [x], pool=False)
        return self._emit(mx.abs(x) + at_least, lambda a: jnp.abs(a) + at_least, [x], pool=False)

    def _legal_layout(self, shape) -> str:
        """A random layout for one tensor (an `mx.shard` annotation): legal by construction."""
        rules, parts = [], {}
        for mname, msize in self.r.order(self.mesh_dims):
            options = list(shape)  # any split, even or not
            if options and self.r.coin(60):
                d = self.r.pick(options)
                parts[d.name] = parts.get(d.name, 1) * msize
                rules.append(f"{d.name}:{mname}")
        return ";".join(rules)

    # ---- op families: each emits meshax ops and their references ------------------------------
    def _op_unary(self):
        x = self._take(("float32", "int32", "bfloat16"))
        if x is None:
            return False
        fn = self.r.pick(UNARY)
        if fn in KINKS and x in self.approx:
            return False
        if str(x.dtype) == "int32" and fn in ("gelu", "sigmoid", "softplus", "erf", "tanh", "exp", "sqrt"):
            if fn in ("exp", "sqrt"):  # keep exp finite (float32 overflows past 88) and sqrt real
                x = self._emit(mx.minimum(mx.abs(x), 4), lambda a: jnp.minimum(jnp.abs(a), 4), [x], pool=False)
            y = getattr(mx, fn)(x)
            return self._emit(y, lambda a: REF_UNARY[fn](a.astype(jnp.float32)), [x])
        if fn in POSITIVE_ONLY and str(x.dtype) in FLOATS:
            x = self._positive(x)
        elif fn in POSITIVE_ONLY:
            return False
        self._emit(getattr(mx, fn)(x), REF_UNARY[fn], [x])

    def _binary(self, fn, x, y):
        if isinstance(y, mx.Tensor):
            out_names = union_names(x, y)
            nx, ny = names(x), names(y)
            ref = lambda a, b: REF_BINARY[fn](to_names(a, nx, out_names), to_names(b, ny, out_names))  # noqa: E731
            return self._emit(getattr(mx, fn)(x, y), ref, [x, y])
        return self._emit(getattr(mx, fn)(x, y), lambda a: REF_BINARY[fn](a, y), [x])

    def _op_arith(self):
        x = self._take(("float32", "int32", "bfloat16"))
        if x is None:
            return False
        fn = self.r.pick(ARITH)
        floating = str(x.dtype) in FLOATS
        y = self._partner(x, FLOATS if floating else (str(x.dtype),)) if self.r.coin(70) else None
        if fn in ("maximum", "minimum") and (x in self.approx or y in self.approx):
            return False  # (which input the gradient goes to flips where a rounding breaks a near tie)
        if y is None:
            y = self.r.pick([0.5, 2.0, -1.5, 3]) if floating else self.r.pick([1, 2, 0.5])
        if fn == "divide" and isinstance(y, mx.Tensor):
            y = self._positive(y, 1)
        if fn == "pow":
            if not floating:
                return False
            x = self._positive(x)
        self._binary(fn, x, y)

    def _op_compare(self):
        x = self._take(("float32", "int32"), exact=True)
        if x is None:
            return False
        y = self._partner(x, (str(x.dtype),), exact=True) if self.r.coin(60) else self.r.pick([0.0, 0.25, 1, 3])
        self._binary(self.r.pick(COMPARE), x, y if y is not None else 0)

    def _op_logical(self):
        x = self._take(("bool",))
        if x is None:
            return False
        if self.r.coin(30):
            return self._emit(mx.logical_not(x), jnp.logical_not, [x])
        y = self._partner(x, ("bool",)) or x
        self._binary(self.r.pick(["logical_and", "logical_or"]), x, y)

    def _op_where(self):
        c = self._take(("bool",))
        if c is None:
            return False
        x = self._partner(c, ("float32", "int32", "bfloat16"))
        if x is None:
            return False
        y = self._partner(x, (str(x.dtype),)) if self.r.coin(50) else None
        ins = [c, x] + ([y] if y is not None and compatible(c.shape, x.shape, y.shape) else [])
        out_names = union_names(*ins)
        nc, nx = names(c), names(x)
        if len(ins) == 3:
            ny = names(y)

            def ref(a, b, e):
                return jnp.where(to_names(a, nc, out_names), to_names(b, nx, out_names), to_names(e, ny, out_names))

            return self._emit(mx.where(c, x, y), ref, ins)
        self._emit(
            mx.where(c, x, 0.5),
            lambda a, b: jnp.where(to_names(a, nc, out_names), to_names(b, nx, out_names), 0.5),
            ins,
        )

    def _op_cast(self):
        if self.r.coin(20):  # a bfloat16 weight of a float32 master (mixed precision), or a float16 one
            v = self.r.pick(self.variables) if self.variables and self.r.coin() else self._variable(self._shape(1, 2))
            narrow = self.r.pick(["bfloat16", "bfloat16", "float16"])
            c = self._emit(mx.cast(v, narrow), lambda a: a.astype(ref_dtype(narrow)), [v], pool=narrow == "bfloat16")
            if narrow == "float16":  # read back in float32: its gradient goes through two casts
                self._emit(mx.cast(c, "float32"), lambda a: a.astype(jnp.float32), [c])
            return None
        x = self._take(("float32", "int32", "bool", "bfloat16"))
        if x is None:
            return False
        targets = {"float32": ["int32", "bfloat16"], "int32": ["float32", "bfloat16"], "bfloat16": ["float32"]}
        dtype = self.r.pick(targets.get(str(x.dtype), ["float32", "int32"]))
        if dtype == "int32" and x in self.approx:
            return False  # (a rounding would move a value across an integer)
        src = x
        if dtype == "int32" and str(x.dtype) == "float32":  # casts truncate: make integer-ish values
            src = self._emit(x * 4.0, lambda a: a * 4.0, [x], pool=False)
        self._emit(mx.cast(src, dtype), lambda a: a.astype(ref_dtype(dtype)), [src])

    def _op_einsum(self):
        x = self._take(("float32", "int32", "bfloat16"))
        if x is None:
            return False
        y = self._partner(x, FLOATS if str(x.dtype) in FLOATS else (str(x.dtype),))
        ins = [x] if y is None or self.r.coin(15) else [x, y]
        every = union_names(*ins)
        sizes = {d.name: d for t in ins for d in t.shape}
        out = self.r.order(self.r.subset(every))
        letters = {n: string.ascii_letters[i] for i, n in enumerate(every)}
        spec = ",".join("".join(letters[n] for n in names(t)) for t in ins) + "->" + "".join(letters[n] for n in out)
        if all(str(t.dtype) == "bfloat16" for t in ins) and self.r.coin(30):  # summed into float32 (logits)
            y_ = mx.einsum(ins, output_shape=[sizes[n] for n in out], dtype="float32")
            return self._emit(y_, lambda *a: jnp.einsum(spec, *a, preferred_element_type=jnp.float32), ins)
        fn = mx.matmul if len(ins) == 2 and self.r.coin(20) else None
        y_ = (
            fn(*ins, output_shape=[sizes[n] for n in out])
            if fn
            else mx.einsum(ins, output_shape=[sizes[n] for n in out])
        )
        self._emit(y_, lambda *a: rounded_einsum(spec, *a), ins)

    def _op_reduce(self):
        kind = self.r.pick(list(REF_REDUCE))
        dtypes = ("bool", "float32", "int32") if kind in ("any", "all", "sum", "mean") else ("float32", "int32")
        x = self._take((*dtypes, "bfloat16"), lambda t: t.shape.rank > 0, exact=kind in ("max", "min", "any", "all"))
        if x is None:
            return False
        reduced = self.r.subset(x.shape, at_least=1)
        fn = getattr(mx, f"reduce_{kind}")
        nx = names(x)
        axes = tuple(nx.index(d.name) for d in reduced)
        if self.r.coin(40):  # output_shape, in a random order
            keep = self.r.order([d for d in x.shape if d not in reduced])
            kn = [d.name for d in keep]
            ref = lambda a: to_names(reduce_ref(kind, a, axes), [n for n in nx if n in kn], kn)  # noqa: E731
            return self._emit(fn(x, output_shape=keep), ref, [x])
        self._emit(fn(x, reduced_dim=reduced), lambda a: reduce_ref(kind, a, axes), [x])

    def _op_softmax(self):
        x = self._take(FLOATS, lambda t: t.shape.rank > 0)
        if x is None:
            return False
        d = self.r.pick(x.shape)
        axis = x.shape.index(d)
        kind = self.r.pick(["softmax", "log_softmax", "argmax", "top_k", "cumsum"])
        if kind in ("argmax", "top_k") and x in self.approx:
            return False  # (a rounding breaks near ties the other way)
        if kind == "softmax":
            return self._emit(mx.softmax(x, d), lambda a: jax.nn.softmax(a, axis=axis), [x])
        if kind == "log_softmax":
            return self._emit(mx.log_softmax(x, d), lambda a: jax.nn.log_softmax(a, axis=axis), [x])
        if kind == "argmax":
            return self._emit(mx.argmax(x, d), lambda a: jnp.argmax(a, axis=axis).astype(jnp.int32), [x])
        if kind == "cumsum":
            excl = self.r.coin()
            return self._emit(
                mx.cumsum(x, d, exclusive=excl), lambda a: rounded_cumsum(a, axis) - (a if excl else 0), [x]
            )
        k = self.r.int(1, d.size)

        def ref(a):
            v, i = jax.lax.top_k(jnp.moveaxis(a, axis, -1), k)
            return jnp.moveaxis(v, -1, axis), jnp.moveaxis(i, -1, axis).astype(jnp.int32)

        self._emit(mx.top_k(x, d, k), ref, [x])

    def _op_reshape(self):
        x = self._take(("float32", "int32", "bool", "bfloat16"), lambda t: t.shape.rank > 0)
        if x is None:
            return False
        dims = list(x.shape)
        how = self.r.pick(["merge", "split", "rename", "transpose", "broadcast"])
        if how == "merge" and len(dims) >= 2:
            i = self.r.int(0, len(dims) - 2)
            new = [*dims[:i], self.fresh(dims[i].size * dims[i + 1].size), *dims[i + 2 :]]
        elif how == "split" and any(d.size >= 4 and d.size % 2 == 0 for d in dims):
            i = self.r.pick([k for k, d in enumerate(dims) if d.size >= 4 and d.size % 2 == 0])
            if len(dims) >= MAX_RANK:
                return False
            new = [*dims[:i], self.fresh(2), self.fresh(dims[i].size // 2), *dims[i + 1 :]]
        elif how == "rename":  # to a fresh name, or to a name other tensors use for another dim
            d = self.r.pick(dims)
            other = [e.name for e in self.dims if e.size == d.size and e.name not in names(x)]
            new_name = other[0] if other and self.r.coin() else self.fresh(d.size).name
            return self._emit(mx.rename_dimension(x, d.name, new_name), lambda a: a, [x])
        elif how == "transpose":
            perm = self.r.order(range(len(dims)))
            return self._emit(mx.transpose(x, [dims[p] for p in perm]), lambda a: jnp.transpose(a, perm), [x])
        else:
            extra = [d for d in self.dims if d.name not in names(x) and compatible(x.shape, [d])]
            if not extra or len(dims) >= MAX_RANK:
                return False
            new_shape = list(dims)
            new_shape.insert(self.r.int(0, len(dims)), self.r.pick(extra))
            nx, nn = names(x), [d.name for d in new_shape]
            sizes = [d.size for d in new_shape]
            return self._emit(mx.broadcast(x, new_shape), lambda a: jnp.broadcast_to(to_names(a, nx, nn), sizes), [x])
        new_sizes = [d.size for d in new]
        self._emit(mx.reshape(x, new), lambda a: jnp.reshape(a, new_sizes), [x])

    def _op_slicing(self):
        x = self._take(("float32", "int32", "bool", "bfloat16"), lambda t: t.shape.rank > 0)
        if x is None:
            return False
        d = self.r.pick(x.shape)
        axis = x.shape.index(d)
        n = d.size
        how = self.r.pick(["slice", "pad", "concat", "split", "stack", "unstack", "shift"])
        if how == "slice":
            b = self.r.int(0, n - 1)
            s = self.r.int(1, n - b)
            return self._emit(mx.slice(x, b, s, d.name), lambda a: jax.lax.slice_in_dim(a, b, b + s, axis=axis), [x])
        if how == "pad":
            lo, hi = self.r.int(0, 3), self.r.int(0, 3)
            widths = [(0, 0)] * x.shape.rank
            widths[axis] = (lo, hi)
            return self._emit(mx.pad(x, [lo, hi], d.name), lambda a: jnp.pad(a, widths), [x])
        if how == "concat":

            def frame(t):  # the shape with the concatenated dim's size left out
                return [e.name if e.name == d.name else e for e in t.shape]

            others = [t for t in self.pool if kin(t, x) and frame(t) == frame(x)]
            ys = [x, self.r.pick(others)] + ([x] if self.r.coin(30) else [])
            return self._emit(mx.concat(ys, d.name), lambda *a: jnp.concatenate(a, axis=axis), ys)
        if how == "split":
            if n < 2:
                return False
            k = self.r.pick([p for p in (2, n) if n % p == 0])
            pieces = mx.split(x, d, k)
            return self._emit(tuple(pieces), lambda a: tuple(jnp.split(a, k, axis=axis)), [x])
        if how == "stack":
            if x.shape.rank >= MAX_RANK:
                return False
            same = [t for t in self.pool if t.shape == x.shape and kin(t, x)]
            ys = [x, self.r.pick(same)]
            pos = self.r.int(0, x.shape.rank)
            return self._emit(mx.stack(ys, self.fresh(2).name, pos), lambda *a: jnp.stack(a, axis=pos), ys)
        if how == "unstack":
            if n > 4:
                return False
            return self._emit(
                tuple(mx.unstack(x, d)), lambda a: tuple(jnp.moveaxis(a, axis, 0)[i] for i in range(n)), [x]
            )
        offset = self.r.int(-n, n)
        wrap = self.r.coin()

        def ref(a):
            if wrap:
                return jnp.roll(a, offset, axis=axis)
            moved = jnp.roll(a, offset, axis=axis)
            pos = jnp.arange(n) - offset
            keep = (pos >= 0) & (pos < n)
            return jnp.where(to_names(keep, [d.name], names(x)), moved, jnp.zeros((), a.dtype))

        self._emit(mx.shift(x, offset, d, wrap), ref, [x])

    def _op_gather(self):
        table = self._take(("float32", "int32", "bool", "bfloat16"), lambda t: t.shape.rank > 0)
        if table is None:
            return False
        d = self.r.pick(table.shape)
        rest = [e.name for e in table.shape if e != d]
        ids = self._take(("int32",), lambda t: not set(names(t)) & set(rest) and len(names(t)) + len(rest) <= MAX_RANK)
        if ids is None or self.r.coin(30):  # indices over the table's own dim name: the paper's naming
            ids = mx.placeholder(self.mesh, f"p{len(self.feeds)}", [d], "int32")
            self.feeds[ids] = self.rng.integers(-1, d.size + 1, [d.size]).astype(np.int32)
            self._emit(ids, None, (), pool=False)
        axis, n, k = table.shape.index(d), d.size, ids.shape.rank

        def ref(w, i):
            got = jnp.take(w, jnp.clip(i, 0, n - 1), axis=axis)
            got = jnp.moveaxis(got, list(range(axis, axis + k)), list(range(k)))
            inside = ((i >= 0) & (i < n)).reshape(i.shape + (1,) * (got.ndim - k))
            return jnp.where(inside, got, jnp.zeros((), got.dtype))

        self._emit(mx.gather(table, ids, d), ref, [table, ids])

    def _op_one_hot(self):
        ids = self._take(("int32",), lambda t: t.shape.rank < MAX_RANK)
        if ids is None:
            return False
        d = self.r.pick([e for e in self.dims if e.name not in names(ids)] or [self.fresh(4)])
        self._emit(mx.one_hot(ids, d, dtype="float32"), lambda i: jax.nn.one_hot(i, d.size, dtype=jnp.float32), [ids])

    def _op_random(self):
        shape = self._shape(1, 3)
        seed = self.r.int(0, 1000)
        if self.r.coin(40):
            x = self._take(FLOATS, lambda t: t.shape.rank > 0)
            if x is not None:
                noise = self.r.subset(x.shape, at_least=1)
                nx, nn = names(x), [e.name for e in noise]
                keep = _random_reference("uniform", seed, [e.size for e in noise], 0.0, 1.0) >= 0.5
                return self._emit(
                    mx.dropout(x, 0.5, noise_shape=noise, seed=seed),
                    lambda a: a * to_names(keep, nn, nx).astype(a.dtype) * 2.0,
                    [x],
                )
        kind = self.r.pick(["uniform", "normal"])
        fn = mx.random_uniform if kind == "uniform" else mx.random_normal
        value = _random_reference(kind, seed, [d.size for d in shape], -1.0, 2.0)
        self._emit(fn(self.mesh, shape, -1.0, 2.0, seed=seed), lambda: value, [])

    def _op_input(self):
        how = self.r.pick(["constant", "range", "ones", "zeros", "import", "variable"])
        shape = self._shape(1, 2)
        if how == "range":
            d = self.r.pick(self.dims)
            return self._emit(mx.range(self.mesh, d, "int32"), lambda: jnp.arange(d.size, dtype=jnp.int32), [])
        sizes = [d.size for d in shape]
        if how in ("constant", "ones", "zeros"):
            v = {"constant": 0.75, "ones": 1.0, "zeros": 0.0}[how]
            t = mx.constant(self.mesh, v, shape) if how == "constant" else getattr(mx, how)(self.mesh, shape)
            return self._emit(t, lambda: jnp.full(sizes, v, jnp.float32), [])
        if how == "import":
            value = self.rng.uniform(-1, 1, sizes).astype(np.float32)
            return self._emit(mx.import_tensor(self.mesh, value, shape), lambda: jnp.asarray(value), [])
        self._variable(shape)

    def _variable(self, shape) -> mx.Tensor:
        v = mx.get_variable(self.mesh, f"v{len(self.variables)}", shape, initializer=mx.initializers.normal())
        self.variables.append(v)
        return self._emit(v, None, ())

    def _unannotated(self):
        """A tensor with no annotation yet (a tensor takes one)."""
        return self._take(("float32", "int32", "bool", "bfloat16"), lambda t: ("annotation", t) not in self.graph.memo)

    def _op_shard(self):
        x = self._unannotated()
        if x is None:
            return False
        self._emit(mx.shard(x, self._legal_layout(x.shape)), lambda a: a, [x])

    def _op_mesh_split(self):
        """A GSPMD annotation: per dim mesh dims (a name or a tuple), None, or OPEN."""
        x = self._unannotated()
        if x is None:
            return False
        split = collections.defaultdict(list)
        for pair in filter(None, self._legal_layout(x.shape).split(";")):
            d, m = pair.split(":")
            split[d].append(m)
        mapping = []
        for d in x.shape:
            ms = split.get(d.name)
            if ms:
                mapping.append(ms[0] if len(ms) == 1 and self.r.coin() else tuple(ms))
            else:
                mapping.append(mx.OPEN if self.r.coin() else None)
        self._emit(mx.mesh_split(x, mapping), lambda a: a, [x])

    def _op_cond(self):
        """mx.cond or mx.switch on an integer sum (exact whatever the layout, so the branch taken
        is the reference's), over a float operand; a branch may read a tensor from outside."""
        x = self._take(("float32",))
        p = self._take(("int32", "bool"))
        if x is None or p is None:
            return False
        nx = names(x)
        y = self._take(("float32",), lambda t: t is not x and set(names(t)) <= set(nx) and compatible(x.shape, t.shape))
        ny = names(y) if y is not None else []
        fns = [self.r.pick(["tanh", "sin", "square", "identity", "sigmoid"]) for _ in range(self.r.int(2, 3))]
        scale = [2.0, -1.0, 0.5]
        summed = mx.reduce_sum(mx.cast(p, "int32") if str(p.dtype) == "bool" else p)
        k = self.r.pick([0, 3, 10])

        def branch(j):
            def fn(h):
                out = getattr(mx, fns[j])(h) * scale[j]
                return out + y if j == 0 and y is not None else out

            def ref(h, b):
                out = REF_UNARY[fns[j]](h) * scale[j]
                return out + to_names(b, ny, nx) if j == 0 and y is not None else out

            return fn, ref

        made = [branch(j) for j in range(len(fns))]
        ins = [x, p] + ([y] if y is not None else [])
        if len(fns) == 2:
            out = mx.cond(mx.greater(summed, k), made[0][0], made[1][0], [x])

            def ref(a, q, b=None):
                return jax.lax.cond(jnp.sum(q.astype(jnp.int32)) > k, made[0][1], made[1][1], a, b)

            return self._emit(out, ref, ins)
        out = mx.switch(summed - k, [f for f, _ in made], [x])

        def ref_switch(a, q, b=None):
            return jax.lax.switch(jnp.sum(q.astype(jnp.int32)) - k, [r for _, r in made], a, b)

        self._emit(out, ref_switch, ins)

    # ---- the end: updates, a loss, its gradients ----------------------------------------------
    def _finish(self):
        for v in self.variables:
            src = self._take(
                ("float32",), lambda t, v=v: set(names(v)) <= set(names(t)) and compatible(v.shape, t.shape)
            )
            value = mx.einsum([src], output_shape=v.shape) if src is not None else v * 2.0
            kind = self.r.pick(["assign", "assign_add", "assign_sub"])
            self.updates.append((v, kind, src, getattr(mx, kind)(v, value)))
        floats = [
            t
            for t in self.pool
            if str(t.dtype) in FLOATS and t.operation.differentiable and not getattr(t.operation, "is_input", False)
        ]
        self.loss_terms = []
        for t in floats[-3:]:
            w = self.rng.uniform(-1, 1, t.shape.to_integer_list).astype(np.float32)
            self.loss_terms.append((t, w))
        self.loss = None
        for t, w in self.loss_terms:
            term = mx.reduce_sum(t * mx.import_tensor(self.mesh, w, t.shape))
            self.loss = term if self.loss is None else self.loss + term
        self.wrt = [t for t in self.feeds if str(t.dtype) in FLOATS] + self.variables  # (float32 masters)
        self.grads = []  # None where no path connects: the gradient is zero
        if self.loss is not None and self.wrt:
            try:
                self.grads = mx.gradients(self.loss, self.wrt)
            except mx.GraphError as e:  # no path to any of them: refused (nothing would train)
                if "no gradient flows" not in str(e):
                    raise
                self.grads = [None] * len(self.wrt)
        self.cast_copies = bool(self.updates) and self.r.coin()  # (the copies of the weights it updates)

    def rules(self) -> str:
        """Layout rules over every dim name in the graph: each mesh dim splits at most one name
        (whether or not it divides the sizes the name has: uneven splits are padded)."""
        sizes = collections.defaultdict(set)
        for op in self.graph.operations:
            for t in op.outputs:
                for d in t.shape:
                    sizes[d.name].add(d.size)
        parts, rules = {}, []
        for mname, msize in self.r.order(self.mesh_dims):
            options = sorted(sizes)
            if options and self.r.coin(75):
                n = self.r.pick(options)
                parts[n] = parts.get(n, 1) * msize
                rules.append(f"{n}:{mname}")
        return ";".join(rules)

    def outputs(self) -> list:
        return [t for outs, fn, _ in self.steps if fn is not None for t in outs]

    def reference(self, initial: dict, wide: bool = False) -> tuple[dict, list, dict]:
        """(value of each tensor, gradients wrt self.wrt, new variable values) by jax.numpy;
        `wide`: every bfloat16 value computed in float32 instead."""
        _WIDE[0] = wide
        try:
            return self._reference(initial)
        finally:
            _WIDE[0] = False

    def _reference(self, initial: dict) -> tuple[dict, list, dict]:
        feeds = {t: jnp.asarray(v, ref_dtype(v.dtype)) for t, v in self.feeds.items()}

        def forward(wrt_values):
            env = dict(initial)
            env.update(feeds)
            env.update(zip(self.wrt, wrt_values))
            for outs, fn, ins in self.steps:
                if fn is None:
                    continue
                got = fn(*[env[t] for t in ins])
                # meshax's tensors are strongly typed: an int32 + 0.5 is a float32, where JAX's is
                # weakly typed (and would be a bfloat16 beside one)
                strong = (jax.lax.convert_element_type(a, a.dtype) for a in (got if isinstance(got, tuple) else (got,)))
                env.update(zip(outs, strong))
            loss = sum((jnp.sum(env[t] * w) for t, w in self.loss_terms), jnp.float32(0))
            return loss, [env[t] for t in order]

        order = [t for outs, _, _ in self.steps for t in outs] + list(initial)
        wrt_values = [feeds[t] if t in feeds else initial[t] for t in self.wrt]
        (_, values), grads = jax.value_and_grad(forward, has_aux=True)(wrt_values)
        env = dict(zip(order, values))
        new_vars = {}
        for v, kind, src, _ in self.updates:
            if src is not None:
                ns, nv = names(src), names(v)
                summed = jnp.sum(env[src], axis=tuple(i for i, n in enumerate(ns) if n not in nv))
                value = to_names(summed, [n for n in ns if n in nv], nv)
            else:
                value = env[v] * 2.0
            new = {"assign": value, "assign_add": env[v] + value, "assign_sub": env[v] - value}[kind]
            new_vars[v] = new.astype(v.dtype)
        return env, grads, new_vars


def _random_reference(kind, seed, shape, a, b):
    """The documented definition of meshax's random ops: value i is drawn from a key folded from
    (the op's seed, the run's seed 0, i), i the element's global row-major index."""
    key = jax.random.fold_in(jax.random.key(seed), jnp.uint32(0))
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(int(np.prod(shape)), dtype=jnp.uint32))
    if kind == "uniform":
        x = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * (b - a) + a
    else:
        x = jax.vmap(lambda k: jax.random.normal(k, (), jnp.float32))(keys) * b + a
    return x.reshape(shape)


FAMILIES = [
    "unary",
    "arith",
    "arith",
    "compare",
    "logical",
    "where",
    "cast",
    "einsum",
    "einsum",
    "reduce",
    "reduce",
    "softmax",
    "reshape",
    "slicing",
    "gather",
    "one_hot",
    "random",
    "input",
    "shard",
    "mesh_split",
    "mesh_split",
    "cond",
]


def check(program: Program, impl_cls, rules: str) -> None:
    """Lower and run the program with `rules` on `impl_cls`; compare with the reference. A
    program that updates variables runs a second step, from the new values the first wrote."""
    lowering = mx.Lowering(program.graph, {program.mesh: impl_cls(program.mesh_shape, rules)})
    outputs = program.outputs()
    grads = [g for g in program.grads if g is not None]
    updates = [u for *_, u in program.updates]
    fn = lowering.function(outputs + grads, updates=updates, cast_copies=program.cast_copies)
    for step in range(2 if updates else 1):
        initial = {v: jnp.asarray(lowering.variable_value(v)) for v in program.variables}
        got = fn({t: v for t, v in program.feeds.items()})
        _check_step(program, lowering, initial, outputs, got, "" if step == 0 else f" (step {step + 1})")
    check_annotations(lowering)


def _check_step(program: Program, lowering, initial: dict, outputs: list, got: list, when: str) -> None:
    env, want_grads, new_vars = program.reference(initial)
    # the wide reference (float32 for bfloat16): how far bfloat16's roundings move each value
    wide_env, wide_grads, wide_vars = program.reference(initial, wide=True) if program.approx else (None, None, {})
    for t, g in zip(outputs, got):
        _close(f"{t.name} {t.shape}{when}", g, env[t], t.dtype, wide_env[t] if t in program.approx else None)
    if all(np.all(np.isfinite(np.asarray(env[t], np.float32))) for t, _ in program.loss_terms):
        rounded = any(t in program.approx for t, _ in program.loss_terms)  # (the backward computes in bfloat16)
        got_grads = iter(got[len(outputs) :])
        for k, (t, g, want) in enumerate(zip(program.wrt, program.grads, want_grads)):
            value = next(got_grads) if g is not None else np.zeros(t.shape.to_integer_list, t.dtype)
            _close(f"gradient wrt {t.name} {t.shape}{when}", value, want, t.dtype, wide_grads[k] if rounded else None)
    sources = {v: src for v, _, src, _ in program.updates}
    for v, want in new_vars.items():
        wide = wide_vars[v] if sources[v] in program.approx else None
        _close(f"updated variable {v.name}{when}", lowering.variable_value(v), want, v.dtype, wide)


class FullSweeps(Propagation):
    """Propagation without its worklist: every sweep visits every op, in both directions. The
    worklist must give the same plan, origins included (it visits only the ops that could change)."""

    def _sweep(self, level: int) -> bool:
        self._due = self._every_op()
        return super()._sweep(level)


def same_as_full_sweeps(plan) -> None:
    prop = plan.propagation
    full = FullSweeps(prop.operations, plan.rules, plan.mesh_shape, plan.weights)
    for t, axes in prop.axes.items():
        assert (axes, prop.origin[t]) == (full.axes[t], full.origin[t]), f"{t.name}: the worklist's plan differs"


def check_annotations(lowering) -> None:
    """Propagation kept every annotation, gave the plan that full sweeps give, and reached a fixed
    point (one more full sweep changes nothing)."""
    same_as_full_sweeps(lowering.plan)
    prop = lowering.plan.propagation
    for op in lowering.graph.operations:
        if getattr(op, "annotation", None) is None:
            continue
        (t,) = op.outputs
        for d, entry, got in zip(t.shape, op.annotation, lowering.plan[t].axes):
            if entry is not mx.OPEN:
                assert [lowering.impl.shape[m].name for m in got] == list(entry), f"annotation {op.name} on {d.name}"
    assert not prop.sweep(), "propagation had not reached a fixed point"


BF16_RTOL = 2.0**-7  # two bfloat16 roundings of the value itself (8 significant bits)
DRIFT = 4  # times the distance between the references: each layout rounds in its own order
ROUNDOFF = 2.0**-6  # four bfloat16 unit roundoffs (2**-8) at the value's scale: see `_close`


def _close(what, got, want, dtype, wide=None):
    """got against the reference `want`. `wide`, for a value computed from bfloat16 ones: the
    reference computed in float32 instead. Where the two differ, got may be as far from want as
    a few times want is from wide (its roundings fall elsewhere), plus a few bfloat16 roundoffs
    at the value's scale (where a difference cancels, the roundings meshax makes and the
    reference does not, of each device's share of a sum, can move it further than the
    reference's own: seed 7004's softmax gradient over a dim split in two was 0.0027 off the
    float32 one at scale 1, the reference 0.0005); where they agree, no bfloat16 rounding moved
    the value, and none may in meshax. A bfloat16 value may be two of its own roundings further."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == dtype, f"{what}: produced {got.dtype}, declared {dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    if got.dtype == np.bool_ or np.issubdtype(got.dtype, np.integer):
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=what)
        return
    assert want.dtype == got.dtype, f"{what}: produced {got.dtype}, the reference (jax.numpy) {want.dtype}"
    got, want = got.astype(np.float32), want.astype(np.float32)
    finite = np.abs(want[np.isfinite(want)])
    scale = max(1.0, float(finite.max())) if finite.size else 1.0
    atol, rtol = 1e-4 * scale, 1e-3
    if wide is not None:
        drift = np.abs(want - np.asarray(wide, np.float32))
        drift = drift[np.isfinite(drift)]
        if drift.size and drift.max() > 0:  # (none: the reference rounds nothing, nor may meshax)
            atol += DRIFT * float(drift.max()) + ROUNDOFF * scale
    if dtype == jnp.bfloat16:
        rtol = BF16_RTOL
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def describe(program: Program, rules: str) -> str:
    """The program as text, for a failure report."""
    copies = ", cast_copies" if program.cast_copies else ""
    lines = [f"mesh {program.mesh_shape!r}, rules {rules!r}{copies}"]
    for op in program.graph.operations:
        ins = ", ".join(t.name for t in op.inputs)
        extra = f" annotation={list(op.annotation)}" if getattr(op, "annotation", None) is not None else ""
        outs = ", ".join(f"{t.name}{t.shape}:{t.dtype}" for t in op.outputs)
        lines.append(f"  {outs} = {type(op).__name__}({ins}){extra}  [{op.source.rsplit('/', 1)[-1]}]")
    return "\n".join(lines)
