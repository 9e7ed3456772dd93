"""The mesh's shape: named mesh dims, devices in row-major order (last mesh dim fastest)."""

from __future__ import annotations

from meshax.core.errors import ConfigError
from meshax.core.shape import Shape, _parse_pairs, convert_to_shape

# JAX numbers a mesh's devices with 32-bit ints: a mesh of more fails inside it (`std::bad_cast`).
MAX_DEVICES = 2**31 - 1


def convert_to_mesh_shape(x) -> Shape:
    """A mesh shape from a Shape or "rows:2;cols:4": named mesh dims, each of at least one device."""
    given = x
    if isinstance(x, str):
        pairs = _parse_pairs(x, what="mesh", integer_values=True, example="rows:2;cols:4")
        names = [n for n, _ in pairs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(
                f"mesh {x!r} names mesh dim(s) {repeated} twice: give each mesh dim once, e.g. 'rows:2;cols:4'"
            )
        x = pairs
    shape = convert_to_shape(x)
    if shape.rank == 0:
        raise ConfigError(f"the mesh {x!r} has no dims: name at least one, e.g. 'all:8' or 'rows:2;cols:4'")
    for d in shape:
        if d.size < 1:
            raise ConfigError(f"mesh dim {d.name!r} has size {d.size}: every mesh dim needs at least one device")
    if shape.size > MAX_DEVICES:
        raise ConfigError(
            f"the mesh {given!r} has {shape.size} devices; JAX's meshes hold at most 2**31 - 1 ({MAX_DEVICES}): "
            "give smaller mesh dims"
        )
    return shape


def pnum_to_processor_coordinates(mesh_shape: Shape, pnum: int) -> list[int]:
    if not 0 <= pnum < mesh_shape.size:
        raise ConfigError(f"processor number {pnum} is outside the mesh {mesh_shape} of {mesh_shape.size} devices")
    coords = []
    for d in reversed(mesh_shape.dims):
        coords.append(pnum % d.size)
        pnum //= d.size
    return coords[::-1]


def processor_coordinates_to_pnum(mesh_shape: Shape, coords) -> int:
    coords = list(coords)
    if len(coords) != mesh_shape.rank or any(not 0 <= c < d.size for c, d in zip(coords, mesh_shape)):
        raise ConfigError(f"processor coordinates {coords} do not fit the mesh {mesh_shape}")
    pnum = 0
    for c, d in zip(coords, mesh_shape):
        pnum = pnum * d.size + c
    return pnum
