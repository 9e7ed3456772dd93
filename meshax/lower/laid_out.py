"""A tensor as the devices hold it: its slices, their layout, and any sum still owed."""

from __future__ import annotations

import dataclasses

from meshax.layout import TensorLayout


@dataclasses.dataclass(frozen=True)
class LaidOutTensor:
    """`slices`: one array per program instance (one for SIMD, one per device for placement).

    `pending`: mesh axes over which the slices are partial sums still to be added up (lazy
    allreduce): the true value is the sum of the slices across those axes.
    """

    slices: list
    layout: TensorLayout
    pending: frozenset[int] = frozenset()
