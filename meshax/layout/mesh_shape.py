"""The mesh's shape: named mesh dims, devices in row-major order (last mesh dim fastest)."""

from __future__ import annotations

from meshax.core.shape import Shape, convert_to_shape


def convert_to_mesh_shape(x) -> Shape:
    shape = convert_to_shape(x)
    for d in shape:
        if d.size < 1:
            raise ValueError(f"mesh dim {d.name!r} has size {d.size}; every mesh dim needs at least one device")
    return shape


def pnum_to_processor_coordinates(mesh_shape: Shape, pnum: int) -> list[int]:
    if not 0 <= pnum < mesh_shape.size:
        raise ValueError(f"processor number {pnum} is outside the mesh {mesh_shape} of {mesh_shape.size} devices")
    coords = []
    for d in reversed(mesh_shape.dims):
        coords.append(pnum % d.size)
        pnum //= d.size
    return coords[::-1]


def processor_coordinates_to_pnum(mesh_shape: Shape, coords) -> int:
    coords = list(coords)
    if len(coords) != mesh_shape.rank or any(not 0 <= c < d.size for c, d in zip(coords, mesh_shape)):
        raise ValueError(f"processor coordinates {coords} do not fit the mesh {mesh_shape}")
    pnum = 0
    for c, d in zip(coords, mesh_shape):
        pnum = pnum * d.size + c
    return pnum
