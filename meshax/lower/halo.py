"""Halo exchange: each device's slice of a split dim, extended by its neighbours' edge values.

GSPMD's windowed-op primitive (section 4.3): with a dim split over mesh axis `axis` in blocks of
`b`, device c gets the `left` values before its slice (from devices c-1, c-2, ... : several
hops when the halo is wider than a slice) and the `right` values after it, as one collective
permute per hop and side, each sending only the values its receiver needs. Where no neighbour
exists (the ends of a dim that does not wrap) the halo is zeros. `halo_transpose` is its
adjoint, for gradients: the halo parts go back to their owners and are added there.

The slices must hold zeros (or what the op treats as outside the dim) in their padding: the
padding of an uneven split lies at the end of the dim, where the values beyond it belong.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _pieces(width: int, block: int) -> list[int]:
    """How many values hop h (1, 2, ...) carries, for a halo `width` wide over blocks of `block`."""
    out = []
    while width > 0:
        out.append(min(width, block))
        width -= block
    return out


def halo_sends(local, dim: int, left: int, right: int, parts: int, wrap: bool = False) -> list[tuple[int, ...]]:
    """The local shape of what each of `halo`'s permutes sends (one per hop and side), for slices
    of shape `local` over `parts` devices: what the search's estimate counts without running
    it. A hop as far as `parts` or farther reaches no device unless the dim wraps: none."""
    return [
        tuple(w if i == dim else n for i, n in enumerate(local))
        for side in (left, right)
        for hop, w in enumerate(_pieces(side, local[dim]), start=1)
        if wrap or hop < parts
    ]


def _shift_parts(block: int, offset: int, parts: int, wrap: bool) -> list[tuple[int, int, int]]:
    """(hop, start, width) of the two pieces a slice of a dim shifted by `offset` is made of: the
    `width` values from `start` of the slice of device c - hop (hop 0: its own). A shift by a
    slice or more needs only the one or two slices it lands on, not the halo of every hop
    between: those hops would be sent and not read. A hop past the ends of a dim that does not
    wrap (zeros) is kept, as a piece no permute makes."""
    q, r = divmod(abs(offset), block)
    # offset > 0: the last r values of device c - q - 1, then the first block - r of c - q;
    # offset < 0: the values from r of device c + q, then the first r of c + q + 1
    pieces = [(q + 1, block - r, r), (q, 0, block - r)] if offset > 0 else [(-q, r, block - r), (-q - 1, 0, r)]
    return [(hop % parts if wrap else hop, start, w) for hop, start, w in pieces if w]


def shifted(ctx, xs: list, axis: int, dim: int, offset: int, wrap: bool = False) -> list:
    """Slices of `dim` (split over mesh `axis`, zeros in their padding) shifted by `offset`
    values: out[i] = x[i - offset], zeros shifted in unless `wrap` (`_shift_parts`)."""
    pieces = [
        ctx.shift(_take(xs, ctx, dim, start, w), axis, hop, wrap) if hop else _take(xs, ctx, dim, start, w)
        for hop, start, w in _shift_parts(xs[0].shape[dim], offset, ctx.mesh_shape[axis].size, wrap)
    ]
    return _cat(ctx, pieces, dim)


def shift_sends(local, dim: int, offset: int, parts: int, wrap: bool = False) -> list[tuple[int, ...]]:
    """The local shape of what each of `shifted`'s permutes sends (`halo_sends` for a shift)."""
    return [
        tuple(w if i == dim else n for i, n in enumerate(local))
        for hop, _, w in _shift_parts(local[dim], offset, parts, wrap)
        if hop and (wrap or abs(hop) < parts)
    ]


def _take(xs, ctx, dim: int, start: int, size: int) -> list:
    return ctx.slicewise(lambda a: jax.lax.slice_in_dim(a, start, start + size, axis=dim), xs)


def _cat(ctx, parts: list, dim: int) -> list:
    return ctx.slicewise(lambda *a: jnp.concatenate(a, axis=dim), *parts) if len(parts) > 1 else parts[0]


def halo(ctx, xs: list, axis: int, dim: int, left: int, right: int, wrap: bool = False) -> list:
    """Slices along `dim` extended to [left halo, own slice, right halo] (see the module)."""
    block = xs[0].shape[dim]
    before: list[list] = []
    after: list[list] = []
    for h, w in enumerate(_pieces(left, block), start=1):  # the last w values of device c - h
        before.insert(0, ctx.shift(_take(xs, ctx, dim, block - w, w), axis, h, wrap))
    for h, w in enumerate(_pieces(right, block), start=1):  # the first w values of device c + h
        after.append(ctx.shift(_take(xs, ctx, dim, 0, w), axis, -h, wrap))
    return _cat(ctx, [*before, xs, *after], dim)


def halo_transpose(ctx, ext: list, axis: int, dim: int, left: int, right: int, wrap: bool = False) -> list:
    """`halo`'s adjoint: a gradient over extended slices summed back onto the owners' slices."""
    block = ext[0].shape[dim] - left - right
    own = _take(ext, ctx, dim, left, block)
    offset = left
    for h, w in enumerate(_pieces(left, block), start=1):  # came from device c - h's last w values
        offset -= w
        back = ctx.shift(_take(ext, ctx, dim, offset, w), axis, -h, wrap)
        own = _add_at(ctx, own, back, dim, block - w)
    offset = left + block
    for h, w in enumerate(_pieces(right, block), start=1):  # came from device c + h's first w values
        back = ctx.shift(_take(ext, ctx, dim, offset, w), axis, h, wrap)
        own = _add_at(ctx, own, back, dim, 0)
        offset += w
    return own


def _add_at(ctx, xs: list, part: list, dim: int, start: int) -> list:
    def add(a, p):
        widths = [(0, 0)] * a.ndim
        widths[dim] = (start, a.shape[dim] - start - p.shape[dim])
        return a + jnp.pad(p, widths)

    return ctx.slicewise(add, xs, part)
