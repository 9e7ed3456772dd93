"""The one interface ops and the lowering talk to: `MeshImpl`.

A mesh implementation knows the mesh's shape and layout rules, gives each tensor its layout and
slice geometry, and provides the primitive collectives on *slice lists*: a slice list holds one
array per program instance (one for the SIMD backend, whose single program runs on every device;
one per device for the placement backend). Ops never import a backend.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh as JaxMesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshax.core.errors import ConfigError, GraphError, LayoutError, did_you_mean
from meshax.core.shape import Shape, convert_to_shape
from meshax.initializers import Constant
from meshax.layout import (
    LayoutRules,
    TensorLayout,
    convert_to_layout_rules,
    convert_to_mesh_shape,
    convert_to_weight_rules,
    pnum_to_processor_coordinates,
    processor_coordinates_to_pnum,
    slice_begin,
    slice_shape,
    tensor_layout,
)
from meshax.layout.rules import padded_shape
from meshax.lower.padding import logical_rows, pad, padded_dims, unpad

REDUCE_SCATTER_AS = ("reduce_scatter", "allreduce")

# XLA options meshax compiles a backend's programs with, by the devices' platform (JAX's name:
# "gpu" for NVIDIA's and AMD's), under the backend's own `compiler_options` and under XLA_FLAGS.
# On GPUs, every matmul through cuBLAS, not through XLA's Triton gemm fusions: on one H100
# (jax 0.11.2) benchmark section 6's 350M step took 88.2 ms with it, and 91.9 and 92.7 ms
# without (`python -m benchmarks.gpu_options`); measured on no other GPU.
# And no dot merging (XLA merges two matmuls that share an operand, the K and V projections, into
# one over concatenated weights, whose concatenates and slices moved 2.6 ms of the 1.3B step): the
# step 1.7%, 1.6% and 1.5% faster at 125M, 350M and 1.3B on the same H100.
# `compiler_options={"xla_gpu_enable_triton_gemm": True}`, or `--xla_gpu_enable_triton_gemm=true`
# in XLA_FLAGS, gives XLA's default back (its dot merging's: `xla_gpu_dot_merger_threshold_mb: 32`).
PLATFORM_COMPILER_OPTIONS: dict[str, dict[str, object]] = {
    "gpu": {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
}


def _set_by_xla_flags() -> set[str]:
    """The option names XLA_FLAGS sets: `--name=value` or `--name`, in the variable or, where it
    does not start with '-', in the file it names (as XLA reads it)."""
    flags = os.environ.get("XLA_FLAGS", "").strip()
    if flags and not flags.startswith("-") and os.path.isfile(flags):
        with open(flags) as f:
            flags = f.read()
    return {f.lstrip("-").split("=", 1)[0] for f in flags.split() if f.startswith("-")}


def compiler_options_for(platform: str, options: Mapping[str, object] | None) -> dict | None:
    """The XLA options a backend's programs for `platform`'s devices are compiled with: meshax's
    own for the platform (PLATFORM_COMPILER_OPTIONS) except those XLA_FLAGS sets (a program's
    options would override XLA_FLAGS), each overridden by `options`; None for none."""
    own = PLATFORM_COMPILER_OPTIONS.get(platform, {})
    if own:
        in_flags = _set_by_xla_flags()
        own = {k: v for k, v in own.items() if k not in in_flags}
    return {**own, **(options or {})} or None


def jit_for_platform(fn: Callable, compiler_options: Mapping[str, object] | None = None, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs)` compiled with meshax's own XLA options for the platform of
    JAX's first device, `compiler_options` over them, as a backend compiles its programs: for
    programs outside a backend (`meshax calibrate`'s, and the benchmarks' plain-JAX baselines,
    which then differ from meshax's programs in what they compute, not in XLA's options)."""
    options = compiler_options_for(jax.devices()[0].platform, compiler_options)
    return jax.jit(fn, compiler_options=options, **jit_kwargs)


def _made(init: Callable, key, shape: Shape, dtype):
    # made at the logical shape, so the numbers do not depend on the layout
    dims = tuple(shape.to_integer_list)
    value = init(key, dims, dtype)
    if tuple(jnp.shape(value)) != dims:
        raise ConfigError(f"its initializer {init!r} made an array of shape {jnp.shape(value)}, not {dims}")
    return jnp.asarray(value, dtype)


@functools.lru_cache(maxsize=1024)
def _initializer_program(init: Callable, shape: Shape, dtype, layout: TensorLayout, mesh_shape: Shape, sharding):
    return jax.jit(lambda key: pad(_made(init, key, shape, dtype), shape, layout, mesh_shape), out_shardings=sharding)


@functools.lru_cache(maxsize=1024)
def _whole_initializer_program(init: Callable, shape: Shape, dtype):
    return jax.jit(lambda key: _made(init, key, shape, dtype))


_MADE_WHOLE = 1 << 20  # a variable of at most this many values is made whole and then laid out


@functools.lru_cache(maxsize=1024)
def _padding_program(convert: Callable, shape: Shape, layout: TensorLayout, mesh_shape: Shape, sharding):
    return jax.jit(lambda a: convert(a, shape, layout, mesh_shape), out_shardings=sharding)


def check_mesh_dims(rules: LayoutRules, shape: Shape) -> None:
    """A LayoutError (with the closest name) for a rule that names a mesh dim the mesh lacks."""
    names = shape.dimension_names
    for tensor_dim, mesh_dim in rules:
        if mesh_dim not in names:
            raise LayoutError(
                f"layout rule {tensor_dim}:{mesh_dim} names mesh dim {mesh_dim!r}, but the mesh "
                f"{';'.join(f'{d.name}:{d.size}' for d in shape)!r} has only {names}" + did_you_mean(mesh_dim, names)
            )


def _checked_compiler_options(options: Mapping[str, object] | None) -> dict | None:
    """The options, refused now (a trivial program compiled with them) where XLA does not know
    one or its value: not at a program's first run."""
    if not options:
        return None
    try:
        options = dict(options)
    except (TypeError, ValueError):
        raise ConfigError(
            f"compiler_options {options!r} ({type(options).__name__}): give a dict of XLA's options and their "
            'values, e.g. {"xla_backend_optimization_level": 3}'
        ) from None
    try:
        jax.jit(lambda: jnp.zeros(()), compiler_options=dict(options)).trace().lower().compile()
    except (jax.errors.JaxRuntimeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"compiler_options {dict(options)!r}: XLA refuses them ({str(e).strip().splitlines()[-1]}); "
            "name XLA's options as XLA_FLAGS does, without '--', each with a value of its type (a bool, int or string)"
        ) from None
    return dict(options)


class Runner(Protocol):
    """A compiled program (`MeshImpl.compile`)."""

    def __call__(self, args: list, seed: int) -> list: ...

    def compiled(self):
        """The program as the backend compiled it (a `jax.stages.Compiled` for SIMD): its HLO
        (`.as_text()`) for checking what runs, its `.memory_analysis()` per device."""
        ...


def _check_devices(devices: list) -> None:
    """Refuse, when the mesh is made, devices that JAX would refuse from deep inside at the first
    program: something that is no JAX device, or one device in two places of the mesh."""
    for d in devices:
        if not isinstance(d, jax.Device):
            raise ConfigError(
                f"devices: {d!r} ({type(d).__name__}) is not a JAX device: give entries of jax.devices() in pnum "
                "order (or TensorFlow device names, 'gpu:0', ..., for all of them, which stand for JAX's first devices)"
            )
    repeated = sorted({str(d) for d in devices if devices.count(d) > 1})
    if repeated:
        raise ConfigError(
            f"devices: {', '.join(repeated)} given more than once: each place of the mesh needs a device of its own "
            f"(e.g. jax.devices()[:{len(devices)}])"
        )


class MeshImpl:
    """Base class of `SimdMeshImpl` and `PlacementMeshImpl`."""

    def __init__(
        self,
        shape,
        layout=None,
        devices: Sequence | None = None,
        weight_layout=None,
        *,
        reduce_scatter_as: str = "reduce_scatter",
        compiler_options: Mapping[str, object] | None = None,
    ):
        """`layout`: the layout rules; `weight_layout`: rules for weight-shaped tensors (weights,
        their gradients and optimizer slots) instead of `layout` (default: `layout` for all).
        `devices`: JAX devices in pnum order (default: the first of `jax.devices()`); TensorFlow
        device names, as Mesh-TensorFlow takes them ("gpu:0", ...), stand for that default.
        `reduce_scatter_as`: "reduce_scatter" (the papers' collective) or "allreduce": each
        reduce-scatter run as an all-reduce and a local slice, as XLA's own partitioner does on
        CPU, where its reduce-scatter is about 2x slower than an all-reduce of the same input;
        the counters then record the all-reduces that run.
        `compiler_options`: XLA options for every program this backend compiles, as `jax.jit`
        takes them (`{"xla_backend_optimization_level": 3}`, say): per program, where `XLA_FLAGS`
        sets them for the whole process. They override meshax's own for the platform
        (`PLATFORM_COMPILER_OPTIONS`); `program_compiler_options` is what programs get."""
        if reduce_scatter_as not in REDUCE_SCATTER_AS:
            raise ConfigError(
                f"reduce_scatter_as={reduce_scatter_as!r} is not one of {', '.join(map(repr, REDUCE_SCATTER_AS))}"
            )
        self.reduce_scatter_as = reduce_scatter_as
        self.compiler_options = _checked_compiler_options(compiler_options)
        self.shape: Shape = convert_to_mesh_shape(shape)
        self.layout_rules = convert_to_layout_rules(layout)
        check_mesh_dims(self.layout_rules, self.shape)
        self.weight_rules = None if weight_layout is None else convert_to_weight_rules(weight_layout)
        if self.weight_rules is not None:
            check_mesh_dims(self.weight_rules, self.shape)
        if isinstance(devices, np.ndarray):  # (a device mesh, as jax.sharding.Mesh takes: its devices in pnum order)
            devices = devices.ravel()
        self._devices = list(devices) if devices is not None else None
        if self._devices is not None and len(self._devices) != self.size:
            raise ConfigError(f"mesh {self.shape} needs {self.size} devices, but {len(self._devices)} were given")
        if self._devices is not None and all(isinstance(d, str) for d in self._devices):
            self._devices = None  # TensorFlow device names ("gpu:0", as Mesh-TensorFlow takes): JAX's first devices
        if self._devices is not None:
            _check_devices(self._devices)

    @functools.cached_property
    def program_compiler_options(self) -> dict | None:
        """The XLA options every program of this backend is compiled with: meshax's own for the
        devices' platform, overridden by `compiler_options` (worked out once: the placement
        backend asks for every op's kernel)."""
        return compiler_options_for(self.platform, self.compiler_options)

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices ("cpu", "gpu", "tpu"), which need not be JAX's default
        backend's (a mesh of CPU devices in a process whose default is a GPU)."""
        return self.devices[0].platform

    # ---- geometry -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of devices (processors) in the mesh."""
        return self.shape.size

    @property
    def ndims(self) -> int:
        """The number of mesh dims."""
        return self.shape.rank

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh dims' names, in order."""
        return tuple(self.shape.dimension_names)

    @property
    def devices(self) -> list:
        """The devices, in pnum order; the first `size` of `jax.devices()` unless given."""
        if self._devices is None:
            available = jax.devices()
            if len(available) < self.size:
                platform = available[0].platform
                fix = (
                    f"set JAX_NUM_CPU_DEVICES={self.size} (or call meshax.use_cpu_devices(n) before JAX starts)"
                    if platform == "cpu"
                    else f'give a mesh of at most {len(available)} (e.g. --mesh "all:{len(available)}"), or run '
                    f"on the CPU's virtual devices: JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES={self.size}"
                )
                raise ConfigError(
                    f"mesh {self.shape} needs {self.size} devices but JAX sees {len(available)} {platform} "
                    f"device(s): {fix}"
                )
            if jax.process_count() > 1 and len(available) != self.size:
                raise RuntimeError(
                    f"mesh {self.shape} has {self.size} devices, but this {jax.process_count()}-process job has "
                    f"{len(available)}: in a multi-process run the mesh spans every device (give a mesh of "
                    f"{len(available)}, or start {self.size // max(1, jax.local_device_count())} processes)"
                )
            self._devices = available[: self.size]
        return self._devices

    _jax_mesh = None

    @property
    def jax_mesh(self) -> JaxMesh:
        """The devices as a `jax.sharding.Mesh` with the mesh's dim names."""
        if self._jax_mesh is None:
            devices = np.array(self.devices, dtype=object).reshape(self.shape.to_integer_list)
            self._jax_mesh = JaxMesh(devices, self.axis_names)
        return self._jax_mesh

    def partition_spec(self, layout: TensorLayout) -> P:
        """The layout as JAX's PartitionSpec. Mesh dims of size 1 split nothing and are left out
        (newer JAX refuses a spec that names them for an input it sees as replicated)."""
        spec = []
        for axes in layout.axes:
            names = [self.axis_names[m] for m in axes if self.shape[m].size > 1]
            spec.append(None if not names else names[0] if len(names) == 1 else tuple(names))
        return P(*spec)

    def named_sharding(self, layout: TensorLayout) -> NamedSharding:
        """The `jax.sharding.NamedSharding` of a tensor laid out as `layout` on this mesh."""
        return NamedSharding(self.jax_mesh, self.partition_spec(layout))

    def global_layout(self, shape: Shape, layout: TensorLayout) -> TensorLayout:
        """The layout of a tensor's logical global array (`to_global`): `layout`, except that
        dims whose split does not divide are replicated (a jax.Array's shards divide it)."""
        padded = padded_dims(shape, layout, self.shape)
        return TensorLayout(() if i in padded else a for i, a in enumerate(layout.axes))

    def global_sharding(self, shape: Shape, layout: TensorLayout) -> NamedSharding:
        """The sharding of a tensor's logical global array: that of its `global_layout`."""
        return self.named_sharding(self.global_layout(shape, layout))

    def padded_shape(self, spec: tuple) -> tuple[int, ...]:
        """The shape of the padded global array a tensor's slices tile (its shape, if even)."""
        shape, _, layout = spec
        return tuple(padded_shape(shape, layout, self.shape))

    def _pad(self, array, spec: tuple):
        """A logical array (NumPy or JAX) padded as the layout in `spec` needs."""
        shape, _, layout = spec
        return pad(array, shape, layout, self.shape)

    def _unpad(self, array, spec: tuple):
        """`_pad`'s inverse."""
        shape, _, layout = spec
        return unpad(array, shape, layout, self.shape)

    def _pad_global(self, array: jax.Array, spec: tuple) -> jax.Array:
        """A logical global jax.Array padded and laid out on the devices as `spec` says."""
        shape, _, layout = spec
        if not padded_dims(shape, layout, self.shape):
            return array
        return _padding_program(pad, shape, layout, self.shape, self.named_sharding(layout))(array)

    def _unpad_global(self, array: jax.Array, spec: tuple) -> jax.Array:
        """`_pad_global`'s inverse, with the `global_sharding`."""
        shape, _, layout = spec
        if not padded_dims(shape, layout, self.shape):
            return array
        return _padding_program(unpad, shape, layout, self.shape, self.global_sharding(shape, layout))(array)

    # ---- many processes: each feeds only the rows its devices hold ----------------------------
    def feed_rows(self, spec: tuple) -> tuple[int, int]:
        """The logical rows [lo, hi) of dim 0 of a tensor that this process's devices hold (every
        row in a single-process run; a superset where a process's rows are not contiguous)."""
        shape, _, layout = spec
        rows = logical_rows(shape, layout, self.shape)
        held = self.named_sharding(layout).addressable_devices_indices_map(self.padded_shape(spec))
        mine = np.concatenate([rows[index[0]] if index else rows for index in held.values()])
        mine = mine[mine >= 0]
        return (int(mine.min()), int(mine.max()) + 1) if mine.size else (0, 0)

    def put_rows(self, part: np.ndarray, lo: int, spec: tuple):
        """The backend value of a tensor from rows lo .. lo + len(part) of its logical dim 0: each
        process passes the rows its devices hold (`feed_rows`), no process the whole array."""
        shape, dtype, layout = spec
        rows = logical_rows(shape, layout, self.shape)
        rest = TensorLayout(((), *layout.axes[1:]))  # dim 0's padding comes from `rows`
        local = pad(np.asarray(part), shape, rest, self.shape)

        def block(index):
            want = rows[index[0]]
            out = np.zeros((len(want), *local.shape[1:]), dtype)
            ok = want >= 0
            if ok.any() and (want[ok].min() < lo or want[ok].max() >= lo + len(part)):
                raise GraphError(
                    f"{shape}: this process fed rows {lo}..{lo + len(part) - 1} of dim {shape[0].name}, but its "
                    f"devices hold rows {want[ok].min()}..{want[ok].max()}; feed the rows feed_rows() gives"
                )
            out[ok] = local[want[ok] - lo]
            return out[(slice(None), *index[1:])]

        sharding = self.named_sharding(layout)
        return self.from_padded(jax.make_array_from_callback(self.padded_shape(spec), sharding, block), spec)

    def tensor_layout(self, x, name: str | None = None) -> TensorLayout:
        """The layout the rules give a tensor (or a shape); raises LayoutError if illegal."""
        shape = x.shape if hasattr(x, "operation") else convert_to_shape(x)
        name = name or getattr(x, "name", None)
        return tensor_layout(shape, self.layout_rules, self.shape, name)

    def slice_shape(self, x, layout: TensorLayout | None = None) -> list[int]:
        """The shape of one device's slice of `x` (a Tensor, or a shape with `layout`)."""
        shape = x.shape if hasattr(x, "operation") else convert_to_shape(x)
        return slice_shape(shape, layout or self.tensor_layout(x), self.shape)

    def slice_begin(self, x, pnum: int, layout: TensorLayout | None = None) -> list[int]:
        """The global index where device `pnum`'s slice of `x` begins, per dim."""
        shape = x.shape if hasattr(x, "operation") else convert_to_shape(x)
        coords = self.pnum_to_processor_coordinates(pnum)
        return slice_begin(shape, layout or self.tensor_layout(x), self.shape, coords)

    def pnum_to_processor_coordinates(self, pnum: int) -> list[int]:
        """A device number's coordinates on the mesh (row-major: the last mesh dim fastest)."""
        return pnum_to_processor_coordinates(self.shape, pnum)

    def processor_coordinates_to_pnum(self, coords) -> int:
        """The device number at mesh coordinates `coords`."""
        return processor_coordinates_to_pnum(self.shape, coords)

    # ---- primitives on slice lists, provided by each backend ----------------------------------
    def slicewise(self, fn: Callable, *args):
        """Apply fn to each program instance's slices. Non-list args are passed as they are."""
        raise NotImplementedError

    def pcoord(self, axis: int) -> list:
        """Each program instance's coordinate along mesh axis `axis`, as an int32 scalar."""
        raise NotImplementedError

    def allreduce(self, xs: list, axes: Sequence[int], op: str) -> list:
        """Each slice replaced by the `op` ("sum", "max", "min") of the slices across mesh `axes`."""
        raise NotImplementedError

    def allgather(self, xs: list, axis: int, dim: int) -> list:
        """The slices along mesh `axis` concatenated along tensor dim `dim`."""
        raise NotImplementedError

    def alltoall(self, xs: list, axis: int, split_dim: int, concat_dim: int) -> list:
        """Each slice split along `split_dim` into as many parts as mesh `axis` has, the parts
        exchanged, and concatenated along `concat_dim`."""
        raise NotImplementedError

    def reduce_scatter(self, xs: list, axis: int, dim: int) -> list:
        """The sum across mesh `axis`, each device keeping its stripe of tensor dim `dim`."""
        raise NotImplementedError

    def shift(self, xs: list, axis: int, offset: int, wrap: bool) -> list:
        """Instance at coordinate c receives the slice of c - offset (zeros where none, unless wrap)."""
        raise NotImplementedError

    def scan(self, step: Callable, carry: list[list], xs: list[list], length: int, reverse: bool):
        """`carry, ys = step(carry, x)` for each of `length` leading slices x of `xs` (in reverse
        order if asked); returns the final carry and the ys stacked on a new leading axis.
        Carries and xs are lists of slice lists."""
        raise NotImplementedError

    def while_loop(self, cond: Callable, body: Callable, carry: list[list]) -> list[list]:
        """`carry = body(carry)` while `cond(carry)` (a slice list of one bool scalar, the same
        on every instance) holds; returns the final carry (a list of slice lists)."""
        raise NotImplementedError

    def switch(self, index: list, branches: list[Callable[[], list[list]]]) -> list[list]:
        """`branches[index]()`: `index` is a slice list of one int32 scalar in range, the same on
        every instance; each branch returns its results (a list of slice lists) in one layout."""
        raise NotImplementedError

    # ---- values: a "value" is the backend's form of a whole tensor ---------------------------
    def initialize(self, init: Callable, key, spec: tuple):
        """A variable's first value: `init(key, shape, dtype)` under jit with the layout's sharding
        as output, so each device makes only its slice, and the numbers do not depend on the
        layout (JAX's partitionable threefry). One compile per (init, shape, dtype, layout); a
        variable of at most `_MADE_WHOLE` values is made whole and then split, by one compile per
        (init, shape, dtype) that every layout and mesh shares."""
        shape, dtype, layout = spec
        if shape.size <= _MADE_WHOLE and jax.process_count() == 1:
            # small: made whole on one device and then laid out, by one program whatever the layout
            # and mesh (the same numbers: they do not depend on the layout); a constant (biases, the
            # optimizer's slots) by numpy, compiling nothing
            if isinstance(init, Constant):
                init.check(shape.to_integer_list, dtype)
                whole = np.full(shape.to_integer_list, init.value, np.dtype(dtype))
            else:
                whole = _whole_initializer_program(init, shape, np.dtype(dtype))(key)
            return self.from_global(jax.device_put(whole, self.global_sharding(shape, layout)), spec)
        make = _initializer_program(init, shape, np.dtype(dtype), layout, self.shape, self.named_sharding(layout))
        return self.from_padded(make(key), spec)

    def from_global(self, array: jax.Array, spec: tuple):
        """The backend value of a logical global jax.Array, laid out as spec says."""
        return self.from_padded(self._pad_global(array, spec), spec)

    def to_global(self, value, spec: tuple) -> jax.Array:
        """The logical global jax.Array (with the `global_sharding`) of a backend value."""
        return self._unpad_global(self.to_padded(value, spec), spec)

    def from_padded(self, array: jax.Array, spec: tuple):
        """The backend value of a padded global jax.Array with the layout's NamedSharding."""
        raise NotImplementedError

    def to_padded(self, value, spec: tuple) -> jax.Array:
        """The padded global jax.Array (with the layout's NamedSharding) of a backend value."""
        raise NotImplementedError

    def put(self, array: np.ndarray, spec: tuple):
        """The backend value of a full host array, split onto the devices."""
        raise NotImplementedError

    def fetch(self, value, spec: tuple) -> np.ndarray:
        """The full NumPy array of a backend value."""
        raise NotImplementedError

    # ---- execution, provided by each backend -------------------------------------------------
    # Whether `compile` traces `body` once, before it returns, and runs only that trace (SIMD):
    # the collectives the body records then are the program's. Where not (placement: the body
    # runs on every call), the program's counters come from a `trace` of their own.
    compile_traces_once = False
    # Whether a runner's call returns once the program is queued on the devices (SIMD), so that a
    # training loop can prepare the next step meanwhile; not where the call runs the program
    # (placement: op by op, from Python).
    dispatch_is_asynchronous = False

    def compile(self, body: Callable, in_specs: list, out_specs: list, donate: Sequence[int] = ()) -> Runner:
        """A runner: `runner(values, seed) -> values`, running `body` on the slices.

        `body(list of input slice lists, seed slices) -> list of output slice lists`; specs are
        (Shape, dtype, TensorLayout) triples; inputs are host arrays or backend values; inputs
        listed in `donate` may be consumed."""
        raise NotImplementedError

    def trace(self, body: Callable, in_specs: list):
        """Trace `body` abstractly (no devices, no data): fills the counters, returns the jaxpr."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({';'.join(f'{d.name}:{d.size}' for d in self.shape)!r}, {str(self.layout_rules)!r})"
        )
