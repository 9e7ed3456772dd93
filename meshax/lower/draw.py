"""Pictures of layouts: which device holds which block of a tensor.

`blocks` is the data both the picture and the tests read: per device (in mesh order, the
device's `pnum`), the half-open range of each tensor dim it holds, padding excluded, and its
padded extent. `draw_layout` draws it for any rank and mesh: the last two tensor dims as a grid
of blocks, labelled with the devices holding each, one small panel per block of the leading
dims; padding of uneven splits hatched. matplotlib, written to PNG or SVG by the file name.
"""

from __future__ import annotations

import os

from meshax.core.errors import ConfigError
from meshax.core.shape import Shape
from meshax.layout.mesh_shape import pnum_to_processor_coordinates
from meshax.layout.rules import TensorLayout, block_sizes, slice_begin, valid_size


def blocks(shape: Shape, layout: TensorLayout, mesh_shape: Shape) -> list[tuple[tuple[int, int], ...]]:
    """Per device (pnum), per tensor dim: the (begin, end) of the values it holds (no padding)."""
    out = []
    for pnum in range(mesh_shape.size):
        coords = pnum_to_processor_coordinates(mesh_shape, pnum)
        begins = slice_begin(shape, layout, mesh_shape, coords)
        out.append(
            tuple((b, b + valid_size(d.size, a, mesh_shape, coords)) for b, d, a in zip(begins, shape, layout.axes))
        )
    return out


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("pictures need matplotlib: pip install 'meshax[plot]' (or matplotlib)") from None
    return plt


def check_picture_path(path: str) -> None:
    if not path.endswith((".png", ".svg")):
        raise ConfigError(f"picture {path!r}: give a .png or .svg file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ConfigError(f"picture {path!r}: its folder does not exist")


def _devices_label(devices: list[int]) -> str:
    if len(devices) > 4 and devices == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    text = ",".join(map(str, devices))
    return text if len(text) <= 14 else f"{len(devices)} devices"


def draw_layout(name: str, shape: Shape, layout: TensorLayout, mesh_shape: Shape, path: str) -> str:
    """Draw which device holds which block of a tensor of `shape` laid out as `layout`; returns `path`."""
    check_picture_path(path)
    plt = pyplot()
    held = blocks(shape, layout, mesh_shape)
    dims = list(shape)
    grid = list(range(max(len(dims) - 2, 0), len(dims)))  # the last two dims drawn as a grid
    lead = len(dims) - len(grid)
    pads = [block_sizes(d.size, a, mesh_shape)[-1] for d, a in zip(dims, layout.axes)]
    owners: dict[tuple, list[int]] = {}  # the block's begins -> the devices holding it
    for pnum, rng in enumerate(held):
        owners.setdefault(tuple(b for b, _ in rng), []).append(pnum)
    every = sorted({k[:lead] for k in owners})
    panels = every[:16]  # (a mesh of hundreds splits the leading dims into more than anyone reads)
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(3.2 * cols, 5.0) + 0.5, 3.0 * rows + 1.0), squeeze=False)
    cmap = plt.get_cmap("tab20")
    colours: dict[tuple, object] = {}
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    ends = [max(max(b + p for b in {k[i] for k in owners}), d.size) for i, (d, p) in enumerate(zip(dims, pads))]
    for ax, panel in zip(axes.flat, panels):
        for key, devs in owners.items():
            if key[:lead] != panel:
                continue
            rng = held[devs[0]]
            # (x, y, valid width, valid height, padded width, padded height) of the block
            x, w, pw = (key[grid[-1]], rng[grid[-1]][1] - key[grid[-1]], pads[grid[-1]]) if grid else (0, 1, 1)
            y, h, ph = (key[grid[0]], rng[grid[0]][1] - key[grid[0]], pads[grid[0]]) if len(grid) == 2 else (0, 1, 1)
            colour = colours.setdefault(tuple(devs), cmap(len(colours) % 20))
            ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", linewidth=0.8))
            if (pw, ph) != (w, h):  # padding of an uneven split: hatched
                ax.add_patch(plt.Rectangle((x, y), pw, ph, hatch="///", fill=False, edgecolor="grey", linewidth=0.5))
            ax.text(x + pw / 2, y + ph / 2, _devices_label(devs), ha="center", va="center", fontsize=7)
        ax.set_xlim(0, ends[grid[-1]] if grid else 1)
        ax.set_ylim(ends[grid[0]] if len(grid) == 2 else 1, 0)
        if grid:
            ax.set_xlabel(f"{dims[grid[-1]].name} ({dims[grid[-1]].size})")
        if len(grid) == 2:
            ax.set_ylabel(f"{dims[grid[0]].name} ({dims[grid[0]].size})")
        else:
            ax.set_yticks([])
        if len(panels) > 1:
            where = (f"{dims[i].name} from {panel[i]}" for i in range(lead) if layout.axes[i])
            ax.set_title(", ".join(where), fontsize=8)
    split = ", ".join(
        f"{d.name} over {'x'.join(mesh_shape[m].name for m in a)}" for d, a in zip(dims, layout.axes) if a
    )
    mesh = " x ".join(f"{d.name}:{d.size}" for d in mesh_shape)
    sizes = ", ".join(f"{d.name}={d.size}" for d in dims)
    more = f" (the first {len(panels)} of {len(every)} blocks of its leading dims)" if len(every) > len(panels) else ""
    fig.suptitle(f"{name} [{sizes}]\non mesh {mesh}: {split or 'replicated'}{more}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
