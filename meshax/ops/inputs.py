"""Where values enter the graph: placeholders, imported arrays, constants, ranges."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from meshax.core.errors import GraphError
from meshax.core.graph import Mesh, Operation, Tensor, as_dtype
from meshax.core.shape import Dimension, convert_to_shape
from meshax.layout import slice_shape
from meshax.ops._util import also_accepts


class PlaceholderOperation(Operation):
    """A tensor fed when the lowered function is called."""

    is_input = True
    is_placeholder = True

    def __init__(self, mesh: Mesh, name: str, shape, dtype="float32"):
        if not (isinstance(name, str) and name):  # ('' was said to exist already; 5 could not be fed by name)
            raise GraphError(f"placeholder: the name must be a non-empty string (feeds name it), got {name!r}")
        super().__init__([], mesh=mesh, name=name)
        if self.name != name:
            raise GraphError(f"a placeholder named {name!r} already exists in this graph; names identify feeds")
        self._add_output(convert_to_shape(shape), dtype, name=name)

    def gradient(self, grad_outputs):
        return []


class ImportTensorOperation(Operation):
    """A NumPy array baked into the graph; it is sliced onto the devices when the program runs."""

    is_input = True

    def __init__(self, mesh: Mesh, array, shape, name=None):
        super().__init__([], mesh=mesh, name=name or "import_tensor")
        shape = convert_to_shape(shape)
        array = np.asarray(array)
        if list(array.shape) != shape.to_integer_list:
            raise GraphError(f"import_tensor: array of shape {list(array.shape)} does not match {shape}")
        self.value = array
        self._add_output(shape, array.dtype)

    def gradient(self, grad_outputs):
        return []


class ImportLaidOutTensorOperation(ImportTensorOperation):
    """A tensor from its slices as a mesh holds them (a `LaidOutTensor`: one array per device, in
    the mesh's device order, laid out by `layout`): put together when the program first runs
    (the mesh is known then), then laid out as the plan says, as `import_tensor`'s array is."""

    def __init__(self, mesh: Mesh, laid_out_tensor, shape, name=None):
        Operation.__init__(self, [], mesh=mesh, name=name or "import_laid_out_tensor")
        self.layout = laid_out_tensor.layout
        self.slices = slices = [np.asarray(s) for s in laid_out_tensor.slices]
        if not slices:
            raise GraphError("import_laid_out_tensor: the LaidOutTensor has no slices")
        if len(laid_out_tensor.layout.axes) != convert_to_shape(shape).rank:
            raise GraphError(
                f"import_laid_out_tensor: its layout {laid_out_tensor.layout} is not for a tensor of {shape}"
            )
        self._add_output(convert_to_shape(shape), slices[0].dtype)

    def value_on(self, impl) -> np.ndarray:
        from meshax.layout.rules import slice_begin, valid_size

        shape, mesh_shape, layout, slices = self.outputs[0].shape, impl.shape, self.layout, self.slices
        if len(slices) != impl.size:
            raise GraphError(
                f"import_laid_out_tensor {self.name}: {len(slices)} slices, but the mesh {mesh_shape} has "
                f"{impl.size} devices: give one slice per device, in the mesh's device order"
            )
        bad_axes = sorted({a for axes in layout.axes for a in axes if not 0 <= a < mesh_shape.rank})
        if bad_axes:  # (was an IndexError from inside)
            raise GraphError(
                f"import_laid_out_tensor {self.name}: its layout {layout} names mesh axes {bad_axes}, but the mesh "
                f"{mesh_shape} has {mesh_shape.rank}"
            )
        local = slice_shape(shape, layout, mesh_shape)
        full = np.zeros(shape.to_integer_list, slices[0].dtype)
        for pnum, piece in enumerate(slices):
            coords = [int(c) for c in np.unravel_index(pnum, mesh_shape.to_integer_list)]
            begin = slice_begin(shape, layout, mesh_shape, coords)
            sizes = [valid_size(d.size, axes, mesh_shape, coords) for d, axes in zip(shape, layout.axes)]
            if piece.ndim != len(sizes) or any(not n <= m <= k for n, m, k in zip(sizes, piece.shape, local)):
                # (a smaller one was broadcast into the tensor, a larger one cut, silently)
                raise GraphError(
                    f"import_laid_out_tensor {self.name}: slice {pnum} has shape {list(piece.shape)}, but device "
                    f"{pnum} of the mesh {mesh_shape} holds {sizes} of {shape} laid out as {layout}"
                    + (f" (padded to {list(local)})" if list(sizes) != list(local) else "")
                )
            full[tuple(slice(b, b + n) for b, n in zip(begin, sizes))] = piece[tuple(slice(0, n) for n in sizes)]
        return full


class ConstantOperation(Operation):
    """A tensor filled with one scalar."""

    def __init__(self, mesh: Mesh, value, shape, dtype, name=None):
        super().__init__([], mesh=mesh, name=name or "constant")
        self.value = value
        self._add_output(convert_to_shape(shape), dtype)

    def lower(self, ctx):
        out = self.outputs[0]
        ctx.set_output(out, self.fill(ctx, ctx.layout(out)))

    def fill(self, ctx, layout) -> list:
        """Its slices in `layout`, each device filling its own: a reader that wants it laid out
        otherwise than planned gets it so with nothing moved (`LoweringContext.get`)."""
        out = self.outputs[0]
        local = slice_shape(out.shape, layout, ctx.mesh_shape)
        return ctx.slicewise(lambda: jax.lax.full(local, self.value, out.dtype))

    def gradient(self, grad_outputs):
        return []


class RangeOperation(Operation):
    """0, 1, ..., dim.size - 1 along `dim`; each device makes only its own stripe."""

    def __init__(self, mesh: Mesh, dim: Dimension, dtype, name=None):
        super().__init__([], mesh=mesh, name=name or "range")
        self._add_output([dim], dtype)

    def lower(self, ctx):
        out = self.outputs[0]
        ctx.set_output(out, self.fill(ctx, ctx.layout(out)))

    def fill(self, ctx, layout) -> list:
        """Its slices in `layout`, each device making its own stripe (as `ConstantOperation.fill`)."""
        out = self.outputs[0]
        (n,) = slice_shape(out.shape, layout, ctx.mesh_shape)
        (begin,) = ctx.slice_begins(out.shape, layout)
        return ctx.slicewise(lambda b: (jnp.arange(n) + b).astype(out.dtype), begin)

    def gradient(self, grad_outputs):
        return []


def placeholder(mesh: Mesh, name: str, shape, dtype="float32") -> Tensor:
    """A tensor fed when the program runs: `fn({name: array})`, the whole (logical) array."""
    return PlaceholderOperation(mesh, name, shape, dtype).outputs[0]


def import_tensor(mesh: Mesh, array, shape, name=None) -> Tensor:
    """A constant tensor holding `array` (a host array of `shape`'s sizes), split as its layout says."""
    return ImportTensorOperation(mesh, array, shape, name).outputs[0]


def import_laid_out_tensor(mesh: Mesh, laid_out_tensor, shape, name=None) -> Tensor:
    """A tensor from the slices each device holds: `laid_out_tensor` is a `mx.LaidOutTensor`
    whose `slices` are one array per device of the mesh (in its device order) and `layout` their
    `mx.TensorLayout` (which mesh axes split each dim). The slices are put together when the
    program first runs, and the tensor is then laid out as the plan says."""
    return ImportLaidOutTensorOperation(mesh, laid_out_tensor, shape, name).outputs[0]


def import_fully_replicated(mesh: Mesh, tf_tensor, shape, name=None) -> Tensor:
    """Mesh-TensorFlow's import of a whole host tensor (`tf_tensor`: a NumPy or JAX array here):
    `import_tensor`, which gives each device its slice of it as the layout says."""
    return import_tensor(mesh, tf_tensor, shape, name)


def constant(mesh: Mesh, value, shape=(), dtype="float32", name=None) -> Tensor:
    """A tensor of `shape` filled with the scalar `value`, or an imported array if it is one."""
    shape = convert_to_shape(shape)
    if np.ndim(value) > 0:
        return import_tensor(mesh, np.asarray(value, dtype=as_dtype(dtype)), shape, name)
    if not (isinstance(value, numbers.Number) or hasattr(value, "dtype")):
        raise GraphError(f"constant: the value must be a number or an array, got {type(value).__name__} {value!r}")
    want = np.dtype(as_dtype(dtype))
    if want.kind in "iu" and isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_):
        low, high = np.iinfo(want).min, np.iinfo(want).max
        if not low <= int(value) <= high:  # (it wrapped around: 2**40 as int32 was 0, -1 as uint8 255)
            raise GraphError(
                f"constant: {value} is outside {want}'s {low}..{high}: give a value that fits, or a wider dtype "
                "(a Python int beside an int32 tensor is an int32)"
            )
    return ConstantOperation(mesh, value, shape, dtype, name).outputs[0]


def zeros(mesh: Mesh, shape, dtype="float32") -> Tensor:
    """A tensor of zeros."""
    return constant(mesh, 0, shape, dtype, name="zeros")


def ones(mesh: Mesh, shape, dtype="float32") -> Tensor:
    """A tensor of ones."""
    return constant(mesh, 1, shape, dtype, name="ones")


@also_accepts(x="t")
def zeros_like(t: Tensor) -> Tensor:
    """Zeros with t's shape and dtype."""
    return zeros(t.mesh, t.shape, t.dtype)


@also_accepts(x="t")
def ones_like(t: Tensor) -> Tensor:
    """Ones with t's shape and dtype."""
    return ones(t.mesh, t.shape, t.dtype)


def range(mesh: Mesh, dim: Dimension, dtype="int32", name=None) -> Tensor:
    """The 1-D tensor 0, 1, ..., dim.size - 1 over `dim` (each device makes its own slice)."""
    return RangeOperation(mesh, dim, dtype, name).outputs[0]
