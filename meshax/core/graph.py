"""The graph IR: `Graph`, `Mesh`, `Tensor` and the `Operation` base class.

A `Graph` keeps operations in creation order, which is a topological order: an op's inputs
exist before it does. Nothing here knows about JAX; lowering lives in `meshax.lower`.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import TYPE_CHECKING

import ml_dtypes  # noqa: F401 (registers bfloat16 and friends as NumPy dtypes; ships with jax)
import numpy as np

from meshax.core.errors import ConfigError, GraphError
from meshax.core.shape import Shape, convert_to_shape

if TYPE_CHECKING:
    from meshax.lower.context import LoweringContext

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The library's machinery; frames in models/, train/, examples and user code are "the user's".
_INTERNAL = tuple(
    os.path.join(_PACKAGE_DIR, p)
    for p in (
        "core",
        "layout",
        "lower",
        "ops",
        "backends",
        "jaxpr",
        "autodiff.py",
        "layers",  # (a package: __init__.py, attention.py, common.py)
        "moe.py",
        "pipeline.py",
        "optimize",  # (a package: base.py, adafactor.py, loss_scale.py, ...)
        "initializers.py",
    )
)


def as_dtype(dtype) -> np.dtype:
    """A NumPy dtype from a string ('float32', 'bfloat16', 'bool'), a type or a dtype."""
    try:
        out = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"unknown dtype {dtype!r}: use e.g. 'float32', 'bfloat16', 'int32', 'bool'") from None
    import jax

    given = f"{dtype!r} ({out})" if isinstance(dtype, str | type) and str(dtype) != str(out) else str(out)
    if not (out == np.bool_ or jax.numpy.issubdtype(out, jax.numpy.number)):  # (JAX refused it from inside)
        raise ConfigError(
            f"dtype {given} is not one JAX computes in (text, objects, ...): use a number or bool dtype, e.g. "
            "'float32', 'bfloat16', 'int32', 'bool'"
        )
    if jax.dtypes.canonicalize_dtype(out) != out:  # (JAX would compute it in 32 bits)
        raise ConfigError(
            f"dtype {given} needs JAX's 64-bit mode (jax_enable_x64), which is off: use a 32-bit dtype "
            "('float32', 'int32'; a NumPy array: .astype(np.float32)) or turn 64-bit mode on"
        )
    return out


def is_floating(dtype) -> bool:
    """True for float dtypes, bfloat16 and the other ml_dtypes floats included."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating) or "float" in dtype.name


def user_source() -> str:
    """'file:line' of the first stack frame outside meshax's machinery: where the user built it."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<"):  # "<string>", "<stdin>": no file to point at
            filename = os.path.abspath(filename)
        if not filename.startswith(_INTERNAL):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


class Graph:
    """A container of operations, in creation (= topological) order."""

    def __init__(self):
        self.operations: list[Operation] = []
        self._names: dict[str, int] = {}
        self.trainable_variables: list = []
        self.all_variables: list = []
        self.memo: dict = {}  # identical computations built once (e.g. two max-reductions of one tensor)
        self.derived: dict = {}  # what later layers work out once per graph (propagation's `_Structure`)
        self.random_ops = 0  # random ops built so far: each gets its own seed
        self.source: str | None = None  # when set, the source line of every op built (a front end's)
        self.logged_scalars: dict = {}  # name -> scalar tensor to log at every training step (`log_scalar`)
        self.loss_scales: dict = {}  # a scaled loss -> its scale: its gradients carry it (`LossScaleOptimizer`)

    def unique_name(self, name: str) -> str:
        """`name`, or `name_1`, `name_2` ... if it was taken: op and tensor names are unique in a graph."""
        n = self._names.get(name, 0)
        self._names[name] = n + 1
        return name if n == 0 else f"{name}_{n}"

    def where(self) -> str:
        """The source line of what is being built now: the front end's (`source`), else the user's."""
        return self.source or user_source()

    def __repr__(self) -> str:
        return f"Graph({len(self.operations)} operations)"


class Mesh:
    """A named mesh in a graph. Its shape and layout are given later, by a mesh implementation."""

    def __init__(self, graph: Graph, name: str):
        if isinstance(name, Graph) and not isinstance(graph, Graph):
            raise GraphError(f"mx.Mesh({graph!r}, {name!r}): the graph comes first: mx.Mesh(graph, {graph!r})")
        if not isinstance(graph, Graph):
            raise GraphError(
                f"mx.Mesh: the graph given is {graph!r} ({type(graph).__name__}), not an mx.Graph: "
                'mx.Mesh(mx.Graph(), "mesh"), one graph for all the meshes of a model'
            )
        if not (isinstance(name, str) and name):
            raise GraphError(f'mx.Mesh: the name {name!r} is not a non-empty string: e.g. mx.Mesh(graph, "mesh")')
        self.graph = graph
        self.name = name

    def __repr__(self) -> str:
        return f"Mesh({self.name!r})"


def check_mesh(mesh, what: str) -> None:
    """`mesh` is an mx.Mesh, else a GraphError saying what was given (`what`: whose mesh it is)."""
    if isinstance(mesh, Mesh):
        return
    jax_mesh = type(mesh).__module__.startswith("jax") and "Mesh" in type(mesh).__name__
    hint = " (a JAX mesh's devices go to the implementation: mx.SimdMeshImpl(...))" if jax_mesh else ""
    raise GraphError(
        f"{what}: the mesh given is {mesh!r} ({type(mesh).__name__}), not an mx.Mesh: make one with "
        f'mx.Mesh(graph, "mesh") and build the model\'s tensors on it{hint}'
    )


def _operator(fn_name: str, reflected: bool = False):
    """A Tensor operator method calling meshax.ops.elementwise.<fn_name> (imported late: ops sit
    above core)."""

    def method(self, other):
        from meshax.ops import elementwise

        fn = getattr(elementwise, fn_name)
        return fn(other, self) if reflected else fn(self, other)

    method.__name__ = f"__{'r' if reflected else ''}{fn_name}__"
    return method


class Tensor:
    """A named-dimension tensor: the output of an operation."""

    def __init__(self, operation: Operation, shape, dtype, index: int, name: str | None = None):
        self.operation = operation
        self.shape: Shape = convert_to_shape(shape)
        self.dtype: np.dtype = as_dtype(dtype)
        self.index = index
        self.name = name or (operation.name if index == 0 else f"{operation.name}:{index}")

    @property
    def mesh(self) -> Mesh:
        """The mesh the tensor lives on (its operation's)."""
        return self.operation.mesh

    @property
    def graph(self) -> Graph:
        """The graph the tensor belongs to."""
        return self.operation.graph

    @property
    def size(self) -> int:
        """The number of elements of the whole (logical) tensor."""
        return self.shape.size

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.shape}, {self.dtype})"

    # Operators build graph operations (see _operator); == and != stay identity, so that
    # tensors can be dict keys.
    __add__, __radd__ = _operator("add"), _operator("add", reflected=True)
    __sub__, __rsub__ = _operator("subtract"), _operator("subtract", reflected=True)
    __mul__, __rmul__ = _operator("multiply"), _operator("multiply", reflected=True)
    __truediv__, __rtruediv__ = _operator("divide"), _operator("divide", reflected=True)
    __pow__, __rpow__ = _operator("pow"), _operator("pow", reflected=True)
    __lt__, __le__ = _operator("less"), _operator("less_equal")
    __gt__, __ge__ = _operator("greater"), _operator("greater_equal")

    def __neg__(self):
        from meshax.ops import elementwise

        return elementwise.negative(self)

    __hash__ = object.__hash__


class Operation:
    """Base class of all operations.

    A subclass keeps three things together: shape inference and validation (in `__init__`),
    `lower(ctx)` (this device's output slices from its input slices, through the mesh
    implementation) and `gradient(grad_outputs)` (the gradient as new graph operations).
    """

    #: Whether gradients flow through this op (placeholders and integer ops say no).
    differentiable = True
    #: What a library layer (mx.pipeline, mx.layers.moe) built this op for, for `meshax plan`.
    info: dict | None = None
    #: Built inside a loop's body (`meshax.ops.loops`): lowered by its loop, not by the program.
    in_loop = False
    #: Dims of the outputs that layouts never split (internal size-1 pieces, see slicing._whole).
    replicated_dims: frozenset[str] | set[str] = frozenset()
    #: Set by the gradient pass before it calls `gradient`: which inputs an x reaches (the rest
    #: need no gradient; a loop leaves them out of its backward loop). None: all of them.
    wanted: list[bool] | None = None
    name: str

    def __init__(self, inputs: list[Tensor], mesh: Mesh | None = None, name: str | None = None):
        if mesh is not None and not isinstance(mesh, Mesh):  # (the message made only where it is said)
            check_mesh(mesh, f"{type(self).__name__} {name!r}" if name else type(self).__name__)
        inputs = list(inputs)
        for t in inputs:
            if not isinstance(t, Tensor):
                raise GraphError(f"{type(self).__name__}: input {t!r} is not a meshax Tensor")
        if mesh is None:
            if not inputs:
                raise GraphError(f"{type(self).__name__} needs a mesh or at least one input")
            mesh = inputs[0].mesh
        for t in inputs:
            if t.mesh.graph is not mesh.graph:
                raise GraphError(
                    f"{type(self).__name__}: input {t.name} belongs to another mx.Graph than this op's mesh "
                    f"{mesh.name!r}; build all tensors of one model in one graph"
                )
            if t.mesh is not mesh:
                raise GraphError(
                    f"{type(self).__name__}: input {t.name} is on mesh {t.mesh.name!r}, not {mesh.name!r}; "
                    "move it with an explicit mesh-to-mesh op"
                )
        self.mesh = mesh
        self.graph = mesh.graph
        self.inputs = inputs
        self.outputs: list[Tensor] = []
        self.name = self.graph.unique_name(name or type(self).__name__.removesuffix("Operation").lower())
        self.source = self.graph.where()
        self.grad_of: Operation | None = None  # set on ops built by another op's gradient
        self.graph.operations.append(self)

    def _add_output(self, shape, dtype, name: str | None = None) -> Tensor:
        t = Tensor(self, shape, dtype, len(self.outputs), name)
        self.outputs.append(t)
        return t

    @property
    def outputs_tensor(self) -> Tensor:
        """The first output (Mesh-TensorFlow's `op.outputs[0]` shorthand)."""
        return self.outputs[0]

    def lower(self, ctx: LoweringContext) -> None:
        """Compute this device's output slices and hand them to `ctx.set_output`."""
        raise NotImplementedError(f"{type(self).__name__} has no lowering")

    def gradient(self, grad_outputs: list[Tensor | None]) -> list[Tensor | None]:
        """Gradients with respect to each input, built as new graph operations."""
        raise NotImplementedError(
            f"{type(self).__name__} ({self.name}, created at {self.source}) has no gradient; "
            "wrap the path in mx.stop_gradient if no gradient is needed through it"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
