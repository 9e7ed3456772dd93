"""How each JAX primitive ties its operands' and results' axes together: its sharding rule as data.

`roles(eqn)` gives, per operand and per result, one *role* per array axis: axes of one equation
that share a role are the same factor (Shardy's term), so they get one dim name (the union-find
of `names`) and are split the same way when the op runs; `None` ties an axis to nothing. Both
the naming pass and the emitting pass (`emit`) read this one description.

A primitive missing here is not supported; `mx.replicated_region` runs it whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from meshax.core.errors import GraphError
from meshax.jaxpr.windows import conv_window, pool_window, spatial_role

Role = Any  # a hashable tag (an int, a tuple, a string); None ties nothing
Roles = tuple[list[list[Role]], list[list[Role]]]

ELEMENTWISE = {
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "bitcast_convert_type",
    "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "population_count", "pow", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan",
    "tanh", "threefry2x32", "xor", "sharding_constraint", "reshard", "meshax_mesh_split",
    # tanh's derivative since jax 0.11; the special functions (jax.random.gamma's, beta's); bits
    "one_minus_square", "bessel_i0e", "bessel_i1e", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad",
    "polygamma", "regularized_incomplete_beta", "zeta", "clz",
    # complex numbers (jnp.fft's results)
    "real", "imag", "complex", "conj",
    # total-order comparisons (NaNs ordered; jnp.searchsorted, jnp.digitize, jnp.histogram)
    "eq_to", "le_to", "lt_to",
}  # fmt: skip
#: Linear in each operand: partial sums pass through them unsettled.
LINEAR = {"add", "add_any", "sub", "neg", "copy", "copy_p", "sharding_constraint", "reshard", "meshax_mesh_split"}
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"}
CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
#: Linear algebra on the trailing two axes (a matrix), batched over the axes before them.
_MATRIX_OPS = {
    "cholesky", "qr", "geqrf", "householder_product", "eigh", "eig", "svd", "lu", "triangular_solve", "schur",
    "hessenberg",
}  # fmt: skip
# (random_gamma draws each value from the key split by its position: run whole, as the key ops)
RANDOM = {
    "random_bits", "random_split", "random_fold_in", "random_seed", "random_wrap", "random_unwrap", "random_gamma",
}  # fmt: skip


def rank(atom) -> int:
    return len(getattr(atom.aval, "shape", ()))


def shape(atom) -> tuple[int, ...]:
    return tuple(atom.aval.shape)


def _elementwise(e) -> Roles:
    """Axis i of each operand is the result's axis i, unless it is a size-1 axis broadcast (or the
    operand a scalar)."""
    out = shape(e.outs[0])
    n = len(out)

    def tied(a) -> list[Role]:
        return [i if rank(a) == n and shape(a)[i] == out[i] else None for i in range(rank(a))]

    return [tied(a) for a in e.ins], [list(range(n)) for _ in e.outs]


def _each_its_own(e) -> Roles:
    """Result k is operand k (`optimization_barrier`): their axes are tied pair by pair."""
    tied = [[(k, i) for i in range(rank(a))] for k, a in enumerate(e.ins)]
    return tied, [list(t) for t in tied]


def _dot_general(e) -> Roles:
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    lhs, rhs = e.ins

    def side(atom, contract, batch, tag):
        roles: list[Role] = []
        for i in range(rank(atom)):
            if i in batch:
                roles.append(("b", list(batch).index(i)))
            elif i in contract:
                roles.append(("c", list(contract).index(i)))
            else:
                roles.append((tag, i))
        return roles

    lr, rr = side(lhs, lc, lb, "l"), side(rhs, rc, rb, "r")
    out = [("b", k) for k in range(len(lb))] + [r for r in lr if r[0] == "l"] + [r for r in rr if r[0] == "r"]
    return [lr, rr], [out]


def _reduction(e) -> Roles:
    axes = set(e.params["axes"])
    (x,) = e.ins
    kept = [i for i in range(rank(x)) if i not in axes]
    return [[i if i not in axes else None for i in range(rank(x))]], [kept for _ in e.outs]


def _broadcast_in_dim(e) -> Roles:
    x = e.ins[0]
    out_shape, bd = e.params["shape"], e.params["broadcast_dimensions"]
    xr = [int(bd[i]) if shape(x)[i] == out_shape[bd[i]] else None for i in range(rank(x))]
    return [xr] + [[None] * rank(a) for a in e.ins[1:]], [list(range(len(out_shape)))]


def aligned(a: tuple[int, ...], b: tuple[int, ...]) -> dict[int, int]:
    """Axes i of `a` -> j of `b` of equal size and equal product of the axes before them: a
    row-major reshape maps their stripes onto themselves."""
    prefix_b: dict[tuple[int, int], int] = {}
    p = 1
    for j, n in enumerate(b):
        prefix_b.setdefault((p, n), j)
        p *= n
    out, p = {}, 1
    for i, n in enumerate(a):
        if (p, n) in prefix_b:
            out[i] = prefix_b[(p, n)]
        p *= n
    return out


def reshape_order(e) -> list[int]:
    """The operand's axes in the order a reshape reads them (its `dimensions`: a transpose first)."""
    dims = e.params.get("dimensions") if e.name == "reshape" else None
    return list(dims) if dims is not None else list(range(rank(e.ins[0])))


def _reshape(e) -> Roles:
    x, out = e.ins[0], e.outs[0]
    order = reshape_order(e)
    pairs = aligned(tuple(shape(x)[i] for i in order), shape(out))  # (position in order -> out axis)
    back = {j: p for p, j in pairs.items()}
    xr: list[Role] = [None] * rank(x)
    for p in pairs:
        xr[order[p]] = p
    return [xr], [[back.get(j) for j in range(rank(out))]]


def _squeeze(e) -> Roles:
    (x,) = e.ins
    drop = {d % rank(x) for d in e.params["dimensions"]}
    kept = [i for i in range(rank(x)) if i not in drop]
    return [[i if i not in drop else None for i in range(rank(x))]], [kept]


def _transpose(e) -> Roles:
    perm = list(e.params["permutation"])
    return [[perm.index(i) for i in range(len(perm))]], [list(range(len(perm)))]


def _concatenate(e) -> Roles:
    d = e.params["dimension"]
    n = rank(e.outs[0])
    same = [i if i != d else None for i in range(n)]
    return [list(same) for _ in e.ins], [list(same)]


def _split(e) -> Roles:
    d = e.params["axis"]
    n = rank(e.ins[0])
    same = [i if i != d else None for i in range(n)]
    return [list(same)], [list(same) for _ in e.outs]


def _stack(e) -> Roles:
    """stack (jnp.stack): each operand's axes are the result's but the new one, which is whole."""
    d = e.params["axis"]
    n = rank(e.outs[0])
    kept = [i for i in range(n) if i != d]
    return [list(kept) for _ in e.ins], [[i if i != d else None for i in range(n)]]


def _unstack(e) -> Roles:
    """unstack (stack's gradient): each result's axes are the operand's but the one unstacked."""
    d = e.params["axis"]
    n = rank(e.ins[0])
    kept = [i for i in range(n) if i != d]
    return [[i if i != d else None for i in range(n)]], [list(kept) for _ in e.outs]


def _tile(e) -> Roles:
    """tile (jnp.tile): an axis repeated once passes through; a repeated one is whole."""
    return _keep_where(e, lambda i: e.params["reps"][i] == 1)


def _keep_where(e, keep: Callable[[int], bool]) -> Roles:
    """Operand 0's axes i with keep(i) tied to result axis i; other operands (scalars) to nothing."""
    x, out = e.ins[0], e.outs[0]
    tied = [i if keep(i) else None for i in range(rank(x))]
    return [tied] + [[None] * rank(a) for a in e.ins[1:]], [tied[: rank(out)] for _ in e.outs]


def _pad(e) -> Roles:
    config = e.params["padding_config"]
    return _keep_where(e, lambda i: tuple(config[i]) == (0, 0, 0))


def _slice(e) -> Roles:
    p = e.params
    n = shape(e.ins[0])
    strides = p["strides"] or (1,) * len(n)
    return _keep_where(e, lambda i: p["start_indices"][i] == 0 and p["limit_indices"][i] == n[i] and strides[i] == 1)


def _rev(e) -> Roles:
    return _keep_where(e, lambda i: i not in e.params["dimensions"])


def _dynamic_slice(e) -> Roles:
    n = shape(e.ins[0])
    return _keep_where(e, lambda i: e.params["slice_sizes"][i] == n[i])


def _dynamic_update_slice(e) -> Roles:
    x, upd = e.ins[0], e.ins[1]
    tied: list[Role] = list(range(rank(x)))
    u: list[Role] = [i if shape(upd)[i] == shape(x)[i] else None for i in range(rank(upd))]
    indices: list[list[Role]] = [[] for _ in e.ins[2:]]
    return [tied, u, *indices], [tied]


def _all_tied(e) -> Roles:
    n = rank(e.outs[0])
    return [list(range(n)) for _ in e.ins], [list(range(n)) for _ in e.outs]


def _top_k(e) -> Roles:
    n = rank(e.ins[0])
    tied = [*range(n - 1), None]
    return [tied], [list(tied) for _ in e.outs]


def _batched(core: Callable[[Any], int]) -> Callable[[Any], Roles]:
    """An op on the trailing `core(e)` axes of its first operand (an FFT's transformed axes, a
    matrix decomposition's or solve's two), batched over the axes before them: those leading axes
    of every operand and result are tied by position, the rest whole."""

    def rule(e) -> Roles:
        batch = rank(e.ins[0]) - core(e)

        def tied(a) -> list[Role]:
            return [("batch", i) if i < batch else None for i in range(rank(a))]

        return [tied(a) for a in e.ins], [tied(o) for o in e.outs]

    return rule


def _nothing(e) -> Roles:
    return [[None] * rank(a) for a in e.ins], [[None] * rank(o) for o in e.outs]


def gather_roles(e) -> Roles:
    """Gather: the indices' batch axes and the operand's batching axes are the result's batch axes;
    an operand axis sliced whole (slice size = its size) is its result's offset axis; the axes
    indexed into belong to no factor (`emit` looks them up whole, or by `mx.gather`)."""
    operand, indices = e.ins
    dn = e.params["dimension_numbers"]
    sizes = e.params["slice_sizes"]
    out_rank = rank(e.outs[0])
    batch_pos = [i for i in range(out_rank) if i not in dn.offset_dims]  # indices' axes but the last
    offset_operand = [
        i for i in range(rank(operand)) if i not in dn.collapsed_slice_dims and i not in dn.operand_batching_dims
    ]
    out: list[Role] = [None] * out_rank
    idx: list[Role] = [None] * rank(indices)
    for k, pos in enumerate(batch_pos):
        out[pos] = idx[k] = ("i", k)
    op_roles: list[Role] = [None] * rank(operand)
    for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        op_roles[ob] = ("i", ib)
    for pos, i in zip(dn.offset_dims, offset_operand):
        if sizes[i] == shape(operand)[i]:
            op_roles[i] = out[pos] = ("o", i)
    return [op_roles, idx], [out]


def scatter_roles(e) -> Roles:
    """Scatter(-add): the operand and result axes are one; the updates' window axes are the
    operand's (where whole), their scatter axes the indices' batch axes (`emit` keeps the axes
    scattered into whole, or sums one-hot rows for an embedding's gradient)."""
    operand, indices, updates = e.ins[:3]
    dn = e.params["dimension_numbers"]
    n = rank(operand)
    window_operand = [i for i in range(n) if i not in dn.inserted_window_dims and i not in dn.operand_batching_dims]
    scatter_pos = [i for i in range(rank(updates)) if i not in dn.update_window_dims]
    op_roles: list[Role] = [("x", i) for i in range(n)]
    upd: list[Role] = [None] * rank(updates)
    idx: list[Role] = [None] * rank(indices)
    for k, pos in enumerate(scatter_pos):
        upd[pos] = idx[k] = ("i", k)
    for ob, ib in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        op_roles[ob] = ("i", ib)
    for pos, i in zip(dn.update_window_dims, window_operand):
        if shape(updates)[pos] == shape(operand)[i]:
            upd[pos] = op_roles[i]
    return [op_roles, idx, upd], [list(op_roles)]


def conv_roles(e) -> Roles:
    """conv_general_dilated: batch and output features pass through, input features are
    contracted; spatial axes are windowed as its form says (`windows`: input and result, or input
    and cotangent for a filter gradient), else whole. With feature groups (a grouped or depthwise
    convolution) the batch still passes through, the features stay whole; with batch groups (such
    a convolution's filter gradient) the input features are still contracted, the rest whole."""
    dn = e.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs = e.ins
    lr: list[Role] = [None] * rank(lhs)
    rr: list[Role] = [None] * rank(rhs)
    out: list[Role] = [None] * rank(e.outs[0])
    features, batches = e.params["feature_group_count"], e.params["batch_group_count"]
    if batches == 1:
        lr[lhs_spec[0]] = out[out_spec[0]] = "n"
    if features == 1 and batches == 1:
        rr[rhs_spec[0]] = out[out_spec[1]] = "o"
    if features == 1:
        lr[lhs_spec[1]] = rr[rhs_spec[1]] = "i"
    form = conv_window(e)
    if form is not None:
        filter_gradient = form.kind in ("filter", "flipped filter")  # (input and cotangent windowed alike)
        other = rr if filter_gradient else out
        for j, (i, o) in enumerate(zip(lhs_spec[2:], (rhs_spec if filter_gradient else out_spec)[2:])):
            lr[i] = other[o] = spatial_role(j)
    return [lr, rr], [out]


def _scan(e) -> Roles:
    """scan: consts and carries pass through; the scanned axis (xs' and ys' first) is one role;
    an x's other axes are tied to its body variable's, a y's to its body result's (`names`)."""
    nc, ncar = e.params["num_consts"], e.params["num_carry"]
    ins: list[list[Role]] = []
    for i, a in enumerate(e.ins):
        if i < nc:
            ins.append([("const", i, k) for k in range(rank(a))])
        elif i < nc + ncar:
            ins.append([("carry", i - nc, k) for k in range(rank(a))])
        else:
            ins.append(["T"] + [None] * (rank(a) - 1))
    outs: list[list[Role]] = [
        [("carry", j, k) for k in range(rank(v))] if j < ncar else ["T"] + [None] * (rank(v) - 1)
        for j, v in enumerate(e.outs)
    ]
    return ins, outs


def _while(e) -> Roles:
    """while: the condition's and the body's consts, and the carries, pass through."""
    cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
    ins: list[list[Role]] = []
    for i, a in enumerate(e.ins):
        what = ("cond const", i) if i < cn else ("body const", i - cn) if i < cn + bn else ("carry", i - cn - bn)
        ins.append([(*what, k) for k in range(rank(a))])
    return ins, [[("carry", j, k) for k in range(rank(v))] for j, v in enumerate(e.outs)]


def loop_ties(e) -> list[tuple]:
    """Per sub-program of a loop (a scan's body; a while's body and condition) or of a cond (each
    branch): (the sub-program, the (outer atom, outer axis, inner atom, inner axis) pairs the
    equation ties across its boundary)."""
    if e.name == "cond":
        return [(b, _same_axes(e.ins[1:], b.invars) + _same_axes(e.outs, b.outvars)) for b in e.branches]
    if e.name == "while":
        cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
        carries = e.ins[cn + bn :]
        body, cond = e.body, e.cond
        body_ties = _same_axes(e.ins[cn:], body.invars) + _same_axes(e.outs, body.outvars)
        body_ties += _same_axes(body.invars[bn:], body.outvars)  # a carry's new value is its variable
        return [(body, body_ties), (cond, _same_axes([*e.ins[:cn], *carries], cond.invars))]
    nc, ncar = e.params["num_consts"], e.params["num_carry"]
    body = e.body
    ties = []
    for i, (a, v) in enumerate(zip(e.ins, body.invars)):
        shift = 1 if i >= nc + ncar else 0  # an x's axis k + 1 is its body variable's axis k
        ties += [(a, k + shift, v, k) for k in range(rank(v))]
    for j, (v, r) in enumerate(zip(e.outs, body.outvars)):
        shift = 0 if j < ncar else 1
        ties += [(v, k + shift, r, k) for k in range(rank(r))]
    ties += _same_axes(body.invars[nc : nc + ncar], body.outvars[:ncar])  # a carry's new value is its variable
    return [(body, ties)]


def _same_axes(outer: list, inner: list) -> list[tuple]:
    return [(a, k, v, k) for a, v in zip(outer, inner) for k in range(rank(v))]


def _window(e) -> Roles:
    """reduce_window: axes the window does not span (size 1, stride 1, no padding) pass through;
    those it spans are windowed where `windows` maps the pooling onto a meshax op, else whole."""
    p = e.params
    dims, strides, pads = p["window_dimensions"], p["window_strides"], p["padding"]
    base, wdil = p.get("base_dilation"), p.get("window_dilation")

    def keep(i):
        plain = dims[i] == 1 and strides[i] == 1 and tuple(pads[i]) == (0, 0)
        return plain and (base is None or base[i] == 1) and (wdil is None or wdil[i] == 1)

    n = rank(e.ins[0])
    windowed = pool_window(e)
    spanned = windowed.axes if windowed is not None else ()
    tied: list[Role] = [spatial_role(i) if i in spanned else i if keep(i) else None for i in range(n)]
    return [tied if rank(a) == n else [None] * rank(a) for a in e.ins], [list(tied) for _ in e.outs]


RULES: dict[str, Callable] = {
    **dict.fromkeys(ELEMENTWISE, _elementwise),
    **dict.fromkeys(REDUCTIONS | {"argmax", "argmin"}, _reduction),
    **dict.fromkeys(CUMULATIVE | {"sort"}, _all_tied),
    **dict.fromkeys(RANDOM | {"iota", "empty", "empty2"}, _nothing),  # (empty: zeros of the shape)
    "dot_general": _dot_general,
    "optimization_barrier": _each_its_own,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "expand_dims": _reshape,
    "transpose": _transpose,
    "concatenate": _concatenate,
    "split": _split,
    "stack": _stack,
    "unstack": _unstack,
    "tile": _tile,
    "rev": _rev,
    "pad": _pad,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "top_k": _top_k,
    "gather": gather_roles,
    "scatter-add": scatter_roles,
    "scatter_add": scatter_roles,
    "scatter": scatter_roles,
    **dict.fromkeys(("scatter-sub", "scatter-mul", "scatter-min", "scatter-max"), scatter_roles),
    "conv_general_dilated": conv_roles,
    "fft": _batched(lambda e: len(e.params["fft_lengths"])),
    **dict.fromkeys(_MATRIX_OPS, _batched(lambda e: 2)),
    **dict.fromkeys(("tridiagonal_solve", "lu_pivots_to_permutation"), _batched(lambda e: 1)),
    "reduce_window_sum": _window,
    "reduce_window_max": _window,
    "reduce_window_min": _window,
    "reduce_window": _window,
    "select_and_scatter_add": _window,
    "scan": _scan,
    "while": _while,
    "cond": _nothing,  # (its operands and results are tied to its branches': `loop_ties`)
    "select_and_gather_add": _window,
    "sum_pool_transpose": _window,  # (a pad and a reduce_window_sum: `flatten`)
}


def roles(e) -> Roles:
    """The roles of an equation's axes (see the module); in a replicated region, none are tied.
    A primitive with no rule outside a replicated region is a GraphError saying what to do."""
    if e.name in ("shard_map", "xla_pmap"):  # (in a replicated region: a KeyError binding it on slices)
        raise GraphError(
            f"mx.partition does not support jax.shard_map (or jax.pmap) inside the function (at {e.source}): "
            "mx.partition partitions the whole function itself; write the mapped code for the whole arrays "
            "and lay it out with jax.lax.with_sharding_constraint or mx.mesh_split, or call the mapped "
            "function outside the partitioned one"
        )
    if e.replicated:
        return _nothing(e)
    if e.name == "device_put":
        raise GraphError(
            f"mx.partition does not support jax.device_put inside the function (at {e.source}): to lay "
            "a value out, write jax.lax.with_sharding_constraint(x, PartitionSpec(...)) or mx.mesh_split"
        )
    if e.name not in RULES:
        raise GraphError(
            f"mx.partition does not support the JAX primitive {e.name!r} (at {e.source}): wrap the code "
            "that uses it in mx.replicated_region(fn) to run it whole on each device, or write it with "
            "supported primitives"
        )
    return RULES[e.name](e)


def is_key(aval) -> bool:
    """A typed PRNG key array (its values are stored as uint32 key data)."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and not isinstance(dtype, np.dtype)
