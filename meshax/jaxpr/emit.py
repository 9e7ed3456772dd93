"""A flattened jaxpr emitted as meshax ops, one equation at a time.

Before an equation is emitted its operands are renamed where the union-find refused to unite an
axis with its role (`Emitter.operands`), so that by name every operand and result dim of the
equation relates exactly as its roles say. Then: `dot_general` becomes `mx.einsum` (lazy
partial sums), the sums, maxima and minima `mx.reduce_*`, `reshape`/`transpose`/`broadcast_in_dim`
the shape ops, an embedding lookup `mx.gather` and its gradient a one-hot einsum, `iota`
`mx.range`, annotations `mx.mesh_split`; every other primitive is bound on each device's slices
by one `SlicewiseOperation` whose sharding rule comes from the roles (an axis the primitive
cannot work on split, such as the one a cumulative sum runs along, is kept whole).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import meshax.ops as mops
from meshax.core.errors import GraphError, LayoutError, did_you_mean
from meshax.core.graph import Mesh, Tensor
from meshax.core.shape import Dimension, Shape
from meshax.jaxpr import windows
from meshax.jaxpr.flatten import Eqn, Flat, is_var
from meshax.jaxpr.names import Names
from meshax.jaxpr.roles import CUMULATIVE, LINEAR, RANDOM, is_key, reshape_order, roles
from meshax.layout import OPEN, ShardingRule
from meshax.ops.inputs import ConstantOperation
from meshax.ops.shape_ops import ReshapeOperation
from meshax.ops.slicewise import SlicewiseOperation


class Emitter:
    """Builds the meshax graph of a flattened jaxpr on `mesh`; `env` maps variables to tensors."""

    def __init__(self, mesh: Mesh, flat: Flat, names: Names, mesh_dims: list[str], parent: Emitter | None = None):
        self.mesh, self.flat, self.names, self.mesh_dims = mesh, flat, names, mesh_dims
        self.env: dict = {}
        self._counter: list[int] = parent._counter if parent is not None else [0]  # (fresh names unique program-wide)
        self._literals: dict = {}

    # ---- values ------------------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        self._counter[0] += 1
        return f"{base}#{self._counter[0]}"

    def value(self, atom) -> Tensor:
        if is_var(atom):
            if atom not in self.env and atom in self.flat.consts:
                value = np.asarray(self.flat.consts[atom])
                self.env[atom] = mops.import_tensor(self.mesh, value, self.names.shape(atom), name="constant")
            return self.env[atom]
        value = np.asarray(atom.val, dtype=atom.aval.dtype)
        key = (value.tobytes(), value.dtype.str, value.shape)
        if key not in self._literals:
            shape = Shape([Dimension(self.fresh("literal"), n) for n in value.shape])
            self._literals[key] = mops.constant(self.mesh, value if value.ndim else value.item(), shape, value.dtype)
        return self._literals[key]

    def out_shape(self, v) -> Shape:
        """v's shape as named dims; a PRNG key array's with its key data's trailing dims (keys
        are carried as their uint32 data)."""
        if is_var(v):
            shape = self.names.shape(v)
        else:
            shape = Shape([Dimension(self.fresh("dropped"), int(n)) for n in v.aval.shape])
        if is_key(v.aval):
            extra = key_data_shape(v.aval.dtype)
            shape = Shape([*shape.dims, *(Dimension(self.fresh("key"), n) for n in extra)])
        return shape

    def run(self) -> None:
        for e in self.flat.eqns:
            self.emit(e)

    # ---- one equation ---------------------------------------------------------------------------
    def emit(self, e: Eqn) -> None:
        in_roles, out_roles = roles(e)
        outs = [self.out_shape(v) for v in e.outs]
        outer, self.mesh.graph.source = self.mesh.graph.source, e.source  # its ops point at the user's line
        try:
            ins = self.operands(e, in_roles, out_roles, outs)
            handler = None if e.replicated else _HANDLERS.get(e.name)
            if any(is_key(a.aval) for a in (*e.ins, *e.outs)) and handler is not _annotation:
                handler = _random  # any op on key arrays (split, slice, squeeze ...): run whole
            results = (handler or _bind)(self, e, ins, outs, in_roles, out_roles)
        except (GraphError, LayoutError) as err:
            raise type(err)(f"{err} (importing {e.name} at {e.source})") from None
        finally:
            self.mesh.graph.source = outer
        for v, t, want in zip(e.outs, results, outs):
            if is_var(v):
                self.env[v] = conform(t, want)

    def operands(self, e: Eqn, in_roles, out_roles, outs: list[Shape]) -> list[Tensor]:
        """The operands renamed so that axes of one role share a name: the result's where the role
        reaches a result, else the first operand's (a fresh one where that name is taken)."""
        role_name: dict = {}
        for shape, rs in zip(outs, out_roles):
            for d, r in zip(shape, rs):
                if r is not None:
                    role_name.setdefault(r, d.name)
        taken = {d.name for s in outs for d in s}
        ins = [self.value(a) for a in e.ins]
        for t, rs in zip(ins, in_roles):
            for d, r in zip(t.shape, rs):
                if r is not None and r not in role_name:
                    name = d.name if d.name not in taken else self.fresh(d.name)
                    role_name[r] = name
                    taken.add(name)
        used = set(role_name.values())
        renamed = []
        for t, rs in zip(ins, in_roles):
            want, seen = [], set()
            for d, r in zip(t.shape, rs):
                name = role_name[r] if r is not None else d.name
                if r is None and (name in used or name in seen):
                    name = self.fresh(d.name)
                want.append(name)
                seen.add(name)
            want += [d.name for d in t.shape.dims[len(rs) :]]  # (a key's data dims)
            renamed.append(rename(t, want))
        return renamed


class _Rename(ReshapeOperation):
    """A relabel of dims (same sizes, same order): it computes nothing. `LoweringContext.get`
    reads its input instead, resharded as the reader wants, so that a tensor used under several
    names is gathered once, as XLA does, and settling a sum it passes is blamed on the op that
    summed. Its own lowering would move its input for a value no one reads (counted, though
    XLA drops it), so there is none."""

    is_rename = passes_sums = True

    def lower(self, ctx) -> None:
        pass


def rename(t: Tensor, names: list[str]) -> Tensor:
    """t with its dims called `names` (a free relabel: splits follow the dims)."""
    if list(t.shape.dimension_names) == names:
        return t
    key = ("rename", t, tuple(names))  # one op per distinct rename: its reshards are then done once
    if key not in t.graph.memo:
        shape = Shape([Dimension(n, d.size) for n, d in zip(names, t.shape)])
        t.graph.memo[key] = _Rename(t, shape, name="rename").outputs[0]
    return t.graph.memo[key]


def conform(t: Tensor, want: Shape) -> Tensor:
    """t as `want`: the same dims in another order are transposed, other names relabelled."""
    if t.shape == want:
        return t
    if sorted(t.shape.dims) == sorted(want.dims):
        return mops.transpose(t, want)
    if t.shape.to_integer_list == want.to_integer_list:
        return rename(t, want.dimension_names)
    raise GraphError(f"internal error: {t.name} {t.shape} where the jaxpr has {want}; please report it")


# ---- the generic path: a primitive bound on each device's slices -------------------------------
def _rule(ins: list[Tensor], outs: list[Shape], in_roles, out_roles, whole=()) -> ShardingRule:
    def factors(shape, rs):
        return tuple(d.name if r is not None else None for d, r in zip(shape, rs))

    return ShardingRule(
        tuple(factors(t.shape, rs) for t, rs in zip(ins, in_roles)),
        tuple(factors(s, rs) for s, rs in zip(outs, out_roles)),
        frozenset(whole),
    )


def _localize(e: Eqn, local: list[tuple], slices) -> dict:
    """The equation's params with the sizes it names made this device's (for tied axes), and
    without the sharding of its result that tracing under the mesh may have recorded (a
    `broadcast_in_dim` of `jnp.linalg.cholesky`'s): a slice lives on one device, where that mesh's
    axes are manual, and JAX refuses an Auto sharding there."""
    p = dict(e.params)
    for k in ("sharding", "out_sharding"):
        if p.get(k) is not None:
            p[k] = None
    out = local[0] if local else ()
    name = e.name
    if name == "broadcast_in_dim" or name == "iota":
        p["shape"] = tuple(out)
    elif name == "slice":
        n = slices[0].shape
        p["limit_indices"] = tuple(
            n[i] if (s, lim) == (0, e.ins[0].aval.shape[i]) else lim
            for i, (s, lim) in enumerate(zip(p["start_indices"], p["limit_indices"]))
        )
    elif name == "dynamic_slice" or name == "gather":
        full = e.ins[0].aval.shape
        p["slice_sizes"] = tuple(slices[0].shape[i] if s == full[i] else s for i, s in enumerate(p["slice_sizes"]))
    return p


def _bind(em: Emitter, e: Eqn, ins, outs, in_roles, out_roles, whole=()) -> list[Tensor]:
    """e's primitive on each device's slices, with the sharding rule its roles give."""
    whole = set(whole)
    if e.name in CUMULATIVE:
        whole.add(outs[0][e.params["axis"]].name)
    elif e.name == "sort":
        whole.add(outs[0][e.params["dimension"]].name)
    elif e.name == "dynamic_update_slice":
        upd = e.ins[1].aval.shape
        whole |= {d.name for i, d in enumerate(ins[0].shape) if upd[i] != d.size}
    rule = _rule(ins, outs, in_roles, out_roles, whole)
    tied_zero = _tied_index_operands(e)
    prim = e.primitive

    def fn(local, *xs):
        xs = list(xs)
        for k in tied_zero:
            xs[k] = np.zeros((), xs[k].dtype)
        out = prim.bind(*xs, **_localize(e, local, xs))
        return tuple(out) if prim.multiple_results else (out,)

    op = SlicewiseOperation(
        ins,
        fn,
        outs,
        [np.uint32 if is_key(v.aval) else v.aval.dtype for v in e.outs],
        rule=rule,
        linear=e.name in LINEAR,
        flops=_flops(e),
        name=e.name,
        mesh=em.mesh,  # (an equation with no operands: an iota in a replicated region)
    )
    return op.outputs


_MOVES = {
    "broadcast_in_dim", "iota", "slice", "pad", "concatenate", "split", "copy", "copy_p", "dynamic_slice",
    "dynamic_update_slice", "gather", "squeeze", "reshape", "transpose", "sort", "optimization_barrier",
}  # fmt: skip


def _flops(e: Eqn) -> int:
    """FLOPs per result value, for the cost report: a convolution's multiply-adds over its
    window and input features, a pooling window's size, one for other arithmetic, none for
    ops that only move values."""
    if e.name == "conv_general_dilated":
        rhs = e.ins[1].aval.shape
        spec = e.params["dimension_numbers"].rhs_spec  # (out features, in features, spatial ...)
        return 2 * int(np.prod([rhs[i] for i in spec[1:]]))
    if e.name.startswith(("reduce_window", "select_and_")):
        return int(np.prod(e.params["window_dimensions"]))
    return 0 if e.name in _MOVES else 1


def _tied_index_operands(e: Eqn) -> list[int]:
    """Operands that are start indices of an axis a dynamic slice or update keeps whole-sized:
    on a split axis each device's slice starts at its own 0 (JAX clamps such starts to 0 too)."""
    if e.name == "dynamic_slice":
        full, sizes = e.ins[0].aval.shape, e.params["slice_sizes"]
        return [1 + i for i in range(len(full)) if sizes[i] == full[i]]
    if e.name == "dynamic_update_slice":
        full, upd = e.ins[0].aval.shape, e.ins[1].aval.shape
        return [2 + i for i in range(len(full)) if upd[i] == full[i]]
    return []


# ---- PRNG keys: carried as their uint32 data; every op on keys runs whole on every device -----------
def key_data_shape(dtype) -> tuple[int, ...]:
    """The trailing shape of one key's data (2 for threefry)."""
    return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype)).shape)


def _random(em, e, ins, outs, in_roles, out_roles):
    if e.name in ("random_wrap", "random_unwrap"):  # the data is the key: a relabel
        return [ins[0]]
    prim = e.primitive

    def fn(local, *xs):
        args = [
            jax.random.wrap_key_data(x, impl=a.aval.dtype._impl) if is_key(a.aval) else x for x, a in zip(xs, e.ins)
        ]
        out = prim.bind(*args, **e.params)
        out = out if prim.multiple_results else [out]
        return tuple(jax.random.key_data(o) if is_key(v.aval) else o for o, v in zip(out, e.outs))

    rule = _rule(ins, outs, [[None] * t.shape.rank for t in ins], [[None] * o.rank for o in outs])
    dtypes = [np.uint32 if is_key(v.aval) else v.aval.dtype for v in e.outs]
    return SlicewiseOperation(ins, fn, outs, dtypes, rule=rule, name=e.name).outputs


# ---- loops ---------------------------------------------------------------------------------------
def _sub(em: Emitter, flat: Flat, values: list[Tensor]) -> Emitter:
    """A loop's body or condition emitted with its variables bound to `values`."""
    sub = Emitter(em.mesh, flat, em.names, em.mesh_dims, parent=em)
    for v, t in zip(flat.invars, values):
        sub.env[v] = conform(t, sub.out_shape(v))
    sub.run()
    return sub


def _scan(em, e, ins, outs, in_roles, out_roles):
    """jax.lax.scan as mx.scan: one loop in the SPMD program, its body emitted from the body's jaxpr."""
    p = e.params
    nc, ncar = p["num_consts"], p["num_carry"]
    consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
    body = e.body
    assert body is not None
    stacked = [t.shape for t in xs] + list(outs[ncar:])  # (their first dims are the scanned one)
    dim = stacked[0][0] if stacked else Dimension(em.fresh("scan"), p["length"])

    def step(carry, x):
        sub = _sub(em, body, [*consts, *carry, *x])
        new = [conform(sub.value(a), c.shape) for a, c in zip(body.outvars[:ncar], carry)]
        return new, [sub.value(a) for a in body.outvars[ncar:]]

    final, ys = mops.scan(step, init, xs, dim=dim, reverse=p["reverse"], name="scan")
    return [*final, *ys]


def _while(em, e, ins, outs, in_roles, out_roles):
    """jax.lax.while_loop as mx.while_loop: one loop in the SPMD program, its condition and body
    emitted from their jaxprs (the condition's scalar is the same on every device)."""
    cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
    cond_consts, body_consts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    cond, body = e.cond, e.body
    assert cond is not None and body is not None

    def cond_fn(*carry):
        return _sub(em, cond, [*cond_consts, *carry]).value(cond.outvars[0])

    def body_fn(*carry):
        b = _sub(em, body, [*body_consts, *carry])
        return [conform(b.value(a), c.shape) for a, c in zip(body.outvars, carry)]

    return mops.while_loop(cond_fn, body_fn, init, name="while")


def _cond(em, e, ins, outs, in_roles, out_roles):
    """jax.lax.cond and jax.lax.switch as mx.switch: one conditional in the SPMD program, each
    branch emitted from its jaxpr (JAX has already clamped the index; it is a scalar every device
    holds whole, so all take the same branch)."""
    assert e.branches is not None

    def branch(flat: Flat) -> Callable:
        def fn(*operands):
            sub = _sub(em, flat, list(operands))
            return [conform(sub.value(a), want) for a, want in zip(flat.outvars, outs)]

        return fn

    return mops.switch(ins[0], [branch(b) for b in e.branches], ins[1:], name="cond")


# ---- primitives that map onto meshax ops ---------------------------------------------------------
def _empty(em, e, ins, outs, in_roles, out_roles):
    """empty (JAX's stand-in for a value never read, as in a cond's gradient): zeros."""
    return [mops.zeros(em.mesh, outs[0], e.outs[0].aval.dtype)]


def _dot_general(em, e, ins, outs, in_roles, out_roles):
    want = np.dtype(e.outs[0].aval.dtype)
    ins = [mops.cast(t, want) if t.dtype != want else t for t in ins]
    return [mops.einsum(ins, output_shape=outs[0], name="dot_general")]


def _reduce(kind: str) -> Callable:
    """A reduction as meshax's, in the jaxpr's dtype: a bool max or min is an any or an all, and
    a narrow integer's sum (which meshax widens, as jnp.sum does) wraps back to it, as XLA's."""
    fns = {"sum": mops.reduce_sum, "max": mops.reduce_max, "min": mops.reduce_min}
    on_bools = {"max": mops.reduce_any, "min": mops.reduce_all}

    def handler(em, e, ins, outs, in_roles, out_roles):
        fn = on_bools[kind] if ins[0].dtype == np.bool_ and kind in on_bools else fns[kind]
        out = fn(ins[0], output_shape=outs[0], name=e.name)
        want = np.dtype(e.outs[0].aval.dtype)
        return [out if out.dtype == want else mops.cast(out, want)]

    return handler


def _reduce_bools(em, e, ins, outs, in_roles, out_roles):
    """`reduce_or` / `reduce_and` (`jnp.any`, `jnp.all`) of bools as meshax's any and all: a
    split reduced axis is one allreduce of the results (it was gathered whole first); of
    integers (a bitwise or, and) bound on each device's slices, the reduced axes whole."""
    if ins[0].dtype != np.bool_:
        return _bind(em, e, ins, outs, in_roles, out_roles)
    fn = mops.reduce_any if e.name == "reduce_or" else mops.reduce_all
    return [fn(ins[0], output_shape=outs[0], name=e.name)]


def _argminmax(em, e, ins, outs, in_roles, out_roles):
    """`argmax` / `argmin` as the first position of the max (min): a max and a min over the axis,
    so a split axis is two allreduces of the results (it was gathered whole first: a vocabulary
    split over a mesh dim, gathered to sample from). The first NaN wins, as in JAX: its
    position counts below every other (less n), whatever the max made of it."""
    (x,), (axis,) = ins, e.params["axes"]
    d, dtype = x.shape[axis], e.params["index_dtype"]
    if x.dtype == np.bool_:
        x = mops.cast(x, np.int32)
    best = (mops.reduce_max if e.name == "argmax" else mops.reduce_min)(x, output_shape=outs[0], name=e.name)
    at, n = mops.range(em.mesh, d, dtype), mops.constant(em.mesh, d.size, [], dtype)
    pos = mops.where(mops.equal(x, best), at, n, output_shape=x.shape)
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # (jnp: bfloat16 is inexact, not to NumPy)
        return [mops.reduce_min(pos, output_shape=outs[0], name=e.name)]
    pos = mops.where(mops.not_equal(x, x), at - n, pos, output_shape=x.shape)
    first = mops.reduce_min(pos, output_shape=outs[0], name=e.name)
    return [mops.where(mops.less(first, mops.constant(em.mesh, 0, [], dtype)), first + n, first)]


def _reshape(em, e, ins, outs, in_roles, out_roles):
    x = ins[0]
    order = reshape_order(e)
    if order != sorted(order):  # (lax.reshape's `dimensions`: the operand transposed first)
        x = mops.transpose(x, Shape([x.shape.dims[i] for i in order]), name=e.name)
    return [mops.reshape(x, outs[0], name=e.name)]


def _transpose(em, e, ins, outs, in_roles, out_roles):
    return [mops.transpose(ins[0], outs[0], name="transpose")]


def _broadcast_in_dim(em, e, ins, outs, in_roles, out_roles):
    if not is_var(e.ins[0]) and not e.ins[0].aval.shape:  # a scalar literal: each device fills its slice
        return [mops.constant(em.mesh, np.asarray(e.ins[0].val).item(), outs[0], e.outs[0].aval.dtype)]
    x = ins[0]
    kept = [d for d, r in zip(x.shape, in_roles[0]) if r is not None]
    if len(kept) != x.shape.rank:
        x = mops.reshape(x, Shape(kept), name="broadcast_in_dim")
    return [mops.broadcast(x, outs[0], name="broadcast_in_dim")]


def _iota(em, e, ins, outs, in_roles, out_roles):
    d = outs[0][e.params["dimension"]]
    return [mops.broadcast(mops.range(em.mesh, d, e.params["dtype"]), outs[0], name="iota")]


def _concatenate(em, e, ins, outs, in_roles, out_roles):
    k = e.params["dimension"]
    name = outs[0][k].name
    xs = [rename(t, [name if i == k else d.name for i, d in enumerate(t.shape)]) for t in ins]
    return [mops.concat(xs, name, name="concatenate")]


def _windowed(make: Callable) -> Callable:
    """A convolution or pooling as a meshax windowed op (`windows`), or where it has no such
    form, bound on each device's slices with its spatial axes whole."""

    def handler(em, e, ins, outs, in_roles, out_roles):
        made = make(e, ins, outs)
        if made is not None:
            return made
        spatial = {d.name for t, rs in zip(ins, in_roles) for d, r in zip(t.shape, rs) if windows.is_spatial(r)}
        return _bind(em, e, ins, outs, in_roles, out_roles, whole=spatial)

    return handler


def _is_lookup(e: Eqn) -> bool:
    """gather as `table[ids]` / `jnp.take(table, ids, axis=k)`: whole rows of one axis; or with
    batching axes, `jnp.take_along_axis` (a cross-entropy's label logits): each index's row in
    its own slice of them."""
    operand, indices = e.ins
    dn = e.params["dimension_numbers"]
    n, shape = operand.aval.ndim, operand.aval.shape
    if len(dn.collapsed_slice_dims) != 1 or tuple(dn.start_index_map) != tuple(dn.collapsed_slice_dims):
        return False
    (k,) = dn.collapsed_slice_dims
    batching = set(dn.operand_batching_dims)
    if any(
        operand.aval.shape[o] != indices.aval.shape[i]
        for o, i in zip(dn.operand_batching_dims, dn.start_indices_batching_dims)
    ):
        return False
    sizes = e.params["slice_sizes"]
    if any(sizes[i] != (1 if i == k or i in batching else shape[i]) for i in range(n)) or indices.aval.shape[-1:] != (
        1,
    ):
        return False
    batch = indices.aval.ndim - 1
    return tuple(dn.offset_dims) == tuple(range(batch, batch + n - 1 - len(batching)))


def _mode(e: Eqn) -> str:
    """A gather's or scatter's out-of-bounds mode: "CLIP", "FILL_OR_DROP" or "PROMISE_IN_BOUNDS"."""
    mode = e.params.get("mode")
    return getattr(mode, "name", str(mode))


def _fill_value(e: Eqn):
    """What a gather in "fill" mode gives for an index out of bounds: its fill_value, or JAX's
    default for the dtype (NaN, the lowest signed or highest unsigned integer, True)."""
    dtype = np.dtype(e.outs[0].aval.dtype)
    if e.params.get("fill_value") is not None:
        return e.params["fill_value"]
    if np.issubdtype(dtype, np.inexact):
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).min if np.issubdtype(dtype, np.signedinteger) else np.iinfo(dtype).max


def _in_bounds(ids: Tensor, n: int) -> Tensor:
    return mops.logical_and(mops.greater_equal(ids, 0), mops.less(ids, n))


def _gather(em, e, ins, outs, in_roles, out_roles):
    """A lookup (`_is_lookup`) as `mx.gather`, with JAX's meaning of an index out of bounds:
    clamped, or in "fill" mode the fill value; other gathers bound on each device's slices."""
    if not _is_lookup(e):
        return _bind(em, e, ins, outs, in_roles, out_roles)
    table, indices = ins
    (k,) = e.params["dimension_numbers"].collapsed_slice_dims
    n = table.shape[k].size
    ids = mops.reshape(indices, Shape(indices.shape.dims[:-1]), name="gather")
    if _mode(e) != "FILL_OR_DROP":
        ids = mops.minimum(mops.maximum(ids, 0), n - 1)
    batched = bool(e.params["dimension_numbers"].operand_batching_dims)
    rows = mops.gather(table, ids, table.shape[k], name="gather", batched=batched)
    if _mode(e) == "FILL_OR_DROP":
        rows = mops.where(_in_bounds(ids, n), rows, _fill_value(e), output_shape=rows.shape, name="gather")
    return [rows]


def _is_lookup_gradient(e: Eqn) -> bool:
    """scatter-add of whole rows of one axis: an embedding lookup's gradient."""
    operand, indices, updates = e.ins[:3]
    dn = e.params["dimension_numbers"]
    if dn.operand_batching_dims or len(dn.inserted_window_dims) != 1:
        return False
    if tuple(dn.scatter_dims_to_operand_dims) != tuple(dn.inserted_window_dims) or indices.aval.shape[-1:] != (1,):
        return False
    (k,) = dn.inserted_window_dims
    batch = indices.aval.ndim - 1
    rest = [n for i, n in enumerate(operand.aval.shape) if i != k]
    return (
        tuple(dn.update_window_dims) == tuple(range(batch, batch + len(rest)))
        and list(updates.aval.shape[batch:]) == rest
    )


def _scatter_add(em, e, ins, outs, in_roles, out_roles):
    """An embedding's gradient (`_is_lookup_gradient`) as one-hot rows summed; another
    scatter-add bound on each device's slices, into zeros: where its updates are split (their
    scatter axes), each device's result is a partial sum, and the operand is added once, after.
    An index out of bounds is clamped in "clip" mode, else its update dropped, as in JAX."""
    operand, indices, updates = ins[:3]
    if not _is_lookup_gradient(e):
        whole = _scattered(e, ins)
        if _is_zeros(em, e.ins[0]):
            return _bind(em, e, ins, outs, in_roles, out_roles, whole=whole)
        zeros = mops.zeros(em.mesh, operand.shape, operand.dtype)
        (summed,) = _bind(em, e, [zeros, indices, updates], outs, in_roles, out_roles, whole=whole)
        return [mops.add(operand, summed, name="scatter-add")]
    (k,) = e.params["dimension_numbers"].inserted_window_dims
    ids = mops.reshape(indices, Shape(indices.shape.dims[:-1]), name="scatter-add")
    if _mode(e) == "CLIP":
        ids = mops.minimum(mops.maximum(ids, 0), operand.shape[k].size - 1)
    hot = mops.one_hot(ids, operand.shape[k], dtype=updates.dtype)
    rows = mops.einsum([hot, updates], output_shape=operand.shape, name="scatter-add")
    if _is_zeros(em, e.ins[0]):
        return [rows]
    return [mops.add(operand, rows, name="scatter-add")]


def _is_zeros(em: Emitter, atom) -> bool:
    """Whether an operand is known to be all zeros (a literal, or a constant of zeros)."""
    if not is_var(atom):
        return not np.any(np.asarray(atom.val))
    t = em.env.get(atom)
    return t is not None and isinstance(t.operation, ConstantOperation) and t.operation.value == 0


def _scattered(e: Eqn, ins) -> set[str]:
    """The operand axes a scatter writes into by index: whole on each device."""
    dn = e.params["dimension_numbers"]
    return {ins[0].shape[i].name for i in (*dn.scatter_dims_to_operand_dims, *dn.inserted_window_dims)}


def _scatter(em, e, ins, outs, in_roles, out_roles):
    """A scatter that overwrites, or combines by subtracting, multiplying, taking the min or max
    (`x.at[i].multiply/min/max`, `jax.ops.segment_max`): its index axes stay whole too (no
    partial sums to settle), its window axes split as the operand's."""
    windows = e.params["dimension_numbers"].update_window_dims
    indexed = {d.name for i, d in enumerate(ins[2].shape) if i not in windows}
    whole = _scattered(e, ins) | {d.name for d in ins[1].shape} | indexed
    return _bind(em, e, ins, outs, in_roles, out_roles, whole=whole)


def _annotation(em, e, ins, outs, in_roles, out_roles):
    x = ins[0]
    if e.name in ("sharding_constraint", "reshard"):
        sharding = next((v for v in e.params.values() if hasattr(v, "spec") and hasattr(v, "mesh")), None)
        if sharding is None:  # (a StopIteration from next())
            given = e.params.get("sharding")
            raise LayoutError(
                f"{e.name} at {e.source} gives {given}: mx.partition reads a PartitionSpec "
                "or a NamedSharding (its mesh dims by name); write jax.lax.with_sharding_constraint(x, "
                "PartitionSpec(...)) or mx.mesh_split"
            )
        if not sharding.mesh.axis_names:  # a reshard on no mesh: an identity
            return [x]
        if e.name == "reshard" and getattr(sharding.mesh, "are_all_axes_auto", False):
            # JAX inserts these itself (`jnp.where` reshards its operand to its own type's sharding,
            # P(None, None) on an Auto mesh) and lowers them to nothing where every axis is Auto: a
            # type's sharding on Auto axes says nothing of the layout (a user's `reshard` needs
            # Explicit axes, refused while tracing)
            return [x]
        spec = sharding.spec
        unconstrained = e.params.get("unconstrained_dims", frozenset())
        priority = 0
    else:
        spec, unconstrained, priority = e.params["spec"], frozenset(), e.params["priority"]
    return [annotate(x, spec, unconstrained, priority, em.mesh_dims, e.source)]


def annotate(
    x: Tensor, spec, unconstrained, priority: int, mesh_dims: list[str], where: str, rank: int | None = None
) -> Tensor:
    """x annotated with a PartitionSpec-like `spec` (None: replicated, a name or tuple of names:
    split, `PartitionSpec.UNCONSTRAINED` or an unconstrained dim: open; missing trailing entries
    replicated, as JAX reads a spec). `rank`: the array's, where x has more axes (a PRNG key
    array's, carried as its key data: the key data's own axes take no entry)."""
    if isinstance(spec, str):  # (read letter by letter: "yx" split over y and x, "rows" had 4 entries)
        raise LayoutError(
            f"sharding annotation {spec!r} at {where} is text: give a PartitionSpec (PartitionSpec({spec!r}) "
            f"splits the first axis over mesh dim {spec!r}), a NamedSharding, or None"
        )
    entries = list(spec)
    rank = x.shape.rank if rank is None else rank
    if len(entries) > rank:
        raise LayoutError(
            f"sharding annotation {spec} at {where} has {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} for "
            f"an array of rank {rank} (shape {x.shape.to_integer_list[:rank]}); give at most one entry per axis"
        )
    mapping: list = []
    for i in range(x.shape.rank):
        entry = entries[i] if i < len(entries) else None
        if i in unconstrained or entry is PartitionSpec.UNCONSTRAINED or entry is OPEN:
            mapping.append(OPEN)
            continue
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        if not (isinstance(names, tuple | list) and all(isinstance(m, str) for m in names)):
            raise LayoutError(
                f"sharding annotation {spec} at {where}: entry {i} is {entry!r}; give a mesh dim name, a "
                "tuple of names, None (replicated) or mx.OPEN"
            )
        names = tuple(names)
        for m in names:
            if m not in mesh_dims:
                raise LayoutError(
                    f"sharding annotation {spec} at {where} names mesh dim {m!r}, but the mesh has only "
                    f"{mesh_dims}{did_you_mean(m, mesh_dims)}"
                )
        mapping.append(names)
    seen = x.graph.memo.get(("annotation", x))
    if seen is not None and (seen.annotation, seen.priority) != (tuple(mapping), priority):
        # In JAX each constraint (or out_shardings entry) is a value of its own: one array laid out
        # two ways, as jax.jit allows. A meshax tensor takes one annotation, so annotate a copy.
        x = mops.identity(x)
    return mops.mesh_split(x, mapping, priority=priority)


_HANDLERS: dict[str, Callable] = {
    "dot_general": _dot_general,
    "reduce_sum": _reduce("sum"),
    "reduce_max": _reduce("max"),
    "reduce_min": _reduce("min"),
    "reduce_or": _reduce_bools,
    "argmax": _argminmax,
    "argmin": _argminmax,
    "reduce_and": _reduce_bools,
    "reshape": _reshape,
    "squeeze": _reshape,
    "expand_dims": _reshape,
    "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim,
    "iota": _iota,
    "concatenate": _concatenate,
    "gather": _gather,
    "scatter-add": _scatter_add,
    "scatter_add": _scatter_add,
    "scatter": _scatter,
    **dict.fromkeys(("scatter-sub", "scatter-mul", "scatter-min", "scatter-max"), _scatter),
    "sharding_constraint": _annotation,
    "reshard": _annotation,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "conv_general_dilated": _windowed(windows.conv),
    **dict.fromkeys(windows.POOLS, _windowed(windows.pool)),
    "empty": _empty,
    "empty2": _empty,
    **dict.fromkeys(RANDOM, _random),
    "meshax_mesh_split": _annotation,
}
