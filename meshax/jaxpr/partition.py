"""`mx.partition`: a plain single-device JAX function partitioned from a few annotations.

The function is traced with `jax.make_jaxpr` (its backward pass and optimizer included, when it
is a training step), its calls inlined (`flatten`), its axes named by a union-find (`names`), and
its equations emitted as meshax ops (`emit`) on one mesh. Then it is the usual meshax graph:
`in_shardings`, `out_shardings`, `with_sharding_constraint` and `mx.mesh_split` are GSPMD
annotations, propagation completes them, and the lowering runs one SPMD program with exactly
the collectives the cost report lists. Arguments and results are ordinary jax.Arrays.
"""

from __future__ import annotations

import fnmatch
import inspect
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshax.backends import SimdMeshImpl
from meshax.core.errors import ConfigError, LayoutError
from meshax.core.graph import Graph, Mesh, Tensor, user_source
from meshax.jaxpr.emit import Emitter, annotate
from meshax.jaxpr.flatten import Flat, is_library_file
from meshax.jaxpr.names import Names
from meshax.jaxpr.roles import is_key
from meshax.lower import Counters, Lowering
from meshax.lower.padding import padded_dims
from meshax.ops.inputs import placeholder


def _is_spec(x) -> bool:
    return x is None or isinstance(x, PartitionSpec | NamedSharding)


def _spec(x):
    """A PartitionSpec (or None) as given, or a NamedSharding's, which jax.jit also takes: its mesh
    axes are read as this mesh's dims of the same names."""
    return x.spec if isinstance(x, NamedSharding) else x


def _key_text(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _aval_key(x) -> tuple:
    """What a traced program depends on of an argument leaf: its shape and dtype."""
    if isinstance(x, jax.Array | np.ndarray):
        return (x.shape, x.dtype)
    return (np.shape(x), str(jax.numpy.result_type(x)))


def _argument_key(x) -> tuple:
    """`_aval_key` of an argument leaf; a ConfigError where it is no array (text, an object):
    it said "static arguments must be hashable", of a value that was neither static nor unhashable;
    or where it is a tracer (the function called under a JAX transformation)."""
    if isinstance(x, jax.core.Tracer):  # (an AttributeError on its .sharding when the program ran)
        raise ConfigError(
            "mx.partition: the partitioned function was called with a traced value (inside jax.jit, jax.grad, "
            "jax.vmap or another transformation): it runs its own compiled program on arrays; apply the "
            "transformation inside instead, e.g. mx.partition(jax.grad(fn), ...)"
        )
    try:
        if isinstance(x, str | bytes):
            raise TypeError
        return _aval_key(x)
    except TypeError:
        raise ConfigError(
            f"mx.partition: an argument is {x!r} ({type(x).__name__}), not an array or a number: pass arrays, "
            "or name the argument in static_argnums / static_argnames"
        ) from None


def _user_line(error: BaseException) -> str:
    """'file:line' of the innermost frame of an exception's traceback outside JAX and meshax."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not is_library_file(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "<unknown>"


def _mesh_text(impl) -> str:
    return ";".join(f"{d.name}:{d.size}" for d in impl.shape)


class Partitioned:
    """A partitioned function: call it like the original (jax.Arrays in and out, sharded as
    asked). Traced once per argument signature (shapes, dtypes, static arguments), as `jax.jit`
    is; `lower(*args)` gives the program (counters, report, explain, layouts) without running."""

    def __init__(
        self,
        fn: Callable,
        mesh,
        in_shardings=None,
        out_shardings=None,
        layout=None,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        devices: Sequence | None = None,
        reduce_scatter_as: str = "reduce_scatter",
    ):
        if not callable(fn):
            raise ConfigError(f"mx.partition needs a function, got {fn!r}")
        self.fn = fn
        self.impl = SimdMeshImpl(mesh, layout, devices, reduce_scatter_as=reduce_scatter_as)
        self.in_shardings, self.out_shardings = in_shardings, out_shardings
        self.static_argnums = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)
        self.static_argnames = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
        self.donate_argnums = {donate_argnums} if isinstance(donate_argnums, int) else set(donate_argnums)
        self._where = user_source()  # the mx.partition call: where argument annotations come from
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._params = [p.name for p in params if p.kind in positional]
        self._varargs = next((p.name for p in params if p.kind == inspect.Parameter.VAR_POSITIONAL), None)
        self.static_argnums = self._from_the_end("static_argnums", self.static_argnums)
        self.donate_argnums = self._from_the_end("donate_argnums", self.donate_argnums)
        both = sorted(self.static_argnums & self.donate_argnums)
        if both:  # (the donation was passed over silently; jax.jit refuses it)
            raise ConfigError(
                f"argument {both[0]} is in static_argnums and in donate_argnums: a static argument is no array on "
                "the devices, so there is nothing to donate; give it in one of them"
            )
        self._check_argnames(params)
        self._programs: dict = {}
        self._last: PartitionedProgram | None = None

    def _check_argnames(self, params: list[inspect.Parameter]) -> None:
        """A ConfigError for static_argnames the function has no parameter of, as jax.jit
        refuses them: a misspelt name was accepted silently and its argument traced (a shape
        made from it failed inside the user's function)."""
        if not params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
            return
        named = {p.name for p in params if p.kind != inspect.Parameter.VAR_POSITIONAL}
        unknown = sorted(self.static_argnames - named)
        if unknown:
            raise ConfigError(
                f"static_argnames {unknown} name no parameter of {getattr(self.fn, '__name__', 'the function')}; "
                f"its parameters are: {', '.join(p.name for p in params)}"
            )

    def _from_the_end(self, what: str, argnums: set[int]) -> set[int]:
        """`argnums` with negative positions counted from the end of the function's positional
        parameters, as jax.jit counts them (they were compared with the arguments' positions as
        they were, so matched none: static_argnums=-1 traced the last argument)."""
        if all(i >= 0 for i in argnums):
            return argnums
        if self._varargs is not None or not self._params:
            raise ConfigError(
                f"{what} {sorted(argnums)}: a position from the end needs a function of a fixed number of "
                f"positional parameters; {getattr(self.fn, '__name__', 'this one')} has not: count from 0"
            )
        n = len(self._params)
        counted = {i + n if i < 0 else i for i in argnums}
        if any(i < 0 for i in counted):
            raise ConfigError(f"{what} {sorted(argnums)} name argument {min(argnums)}, but the function takes {n}")
        return counted

    def _split(self, args: tuple, kwargs: dict):
        for what, argnums in (("static_argnums", self.static_argnums), ("donate_argnums", self.donate_argnums)):
            beyond = sorted(i for i in argnums if not 0 <= i < len(args))
            if beyond:  # (a donation beyond them was left out silently, where jax.jit refuses it)
                raise ConfigError(
                    f"{what} {sorted(argnums)} name argument {beyond[0]}, but the call gives "
                    f"{len(args)} positional arguments"
                )
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        static = (
            tuple((i, a) for i, a in enumerate(args) if i in self.static_argnums),
            tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)),
        )
        return dynamic, dyn_kwargs, static

    def lower(self, *args, **kwargs) -> PartitionedProgram:
        """The program for these arguments (traced and compiled on first use; cached)."""
        return self._lookup(args, kwargs)[0]

    def _lookup(self, args: tuple, kwargs: dict) -> tuple[PartitionedProgram, list]:
        """The program for these arguments, and their leaves (flattened once per call)."""
        dynamic, dyn_kwargs, static = self._split(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((dynamic, dyn_kwargs))
        signature = (tree, tuple(_argument_key(x) for x in leaves), static)
        try:
            hash(signature)
        except TypeError as e:
            raise ConfigError(f"mx.partition: static arguments must be hashable ({e})") from None
        if signature not in self._programs:
            self._programs[signature] = PartitionedProgram(self, args, kwargs)
        self._last = self._programs[signature]
        return self._last, leaves

    def __call__(self, *args, **kwargs):
        program, leaves = self._lookup(args, kwargs)
        return program.run_leaves(leaves)

    def _program(self) -> PartitionedProgram:
        if self._last is None:
            raise ConfigError("the partitioned function has not been called or lowered yet: call it, or .lower(*args)")
        return self._last

    @property
    def counters(self) -> Counters:
        """The last program's collectives and FLOPs per step (see `PartitionedProgram`)."""
        return self._program().counters

    def report(self, width: int = 132) -> str:
        """The last program's cost report."""
        return self._program().report(width)

    def explain(self, threshold: int = 1 << 20) -> str:
        """The last program's dim names and layouts, and where each came from."""
        return self._program().explain(threshold)

    def place(self, *args, **kwargs):
        """`args` laid out on the devices as the program for them takes them (see
        `PartitionedProgram.place`): place a training loop's first state once."""
        return self.lower(*args, **kwargs).place(*args, **kwargs)

    def layout_of(self, what) -> str:
        """The last program's layout of an argument (by path, e.g. "params/w1") or a dim name."""
        return self._program().layout_of(what)


class PartitionedProgram:
    """One traced signature of a partitioned function: the meshax graph, its lowering and the
    compiled SPMD program."""

    def __init__(self, owner: Partitioned, args: tuple, kwargs: dict):
        self.owner = owner
        impl = owner.impl
        dynamic, dyn_kwargs, static = owner._split(args, kwargs)
        static_args = dict(static[0])
        static_kwargs = dict(static[1])

        def pure(dyn_args, dyn_kw):
            it = iter(dyn_args)
            full = [static_args[i] if i in static_args else next(it) for i in range(len(args))]
            out = owner.fn(*full, **dyn_kw, **static_kwargs)
            for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:  # (JAX named `pure`, this function)
                if not isinstance(leaf, jax.Array | np.ndarray | np.generic | int | float | complex):
                    where = jax.tree_util.keystr(path) or "its result"
                    raise ConfigError(
                        f"mx.partition: {getattr(owner.fn, '__name__', 'the function')} returns {leaf!r} "
                        f"({type(leaf).__name__}) at {where}: a partitioned function returns arrays (a pytree of them)"
                    )
            return out

        path_leaves, self._in_tree = jax.tree_util.tree_flatten_with_path((dynamic, dyn_kwargs))
        self.paths = [self._path(p) for p, _ in path_leaves]
        leaves = [x for _, x in path_leaves]
        with _mesh_context(impl.jax_mesh):
            try:
                closed, out_shape = jax.make_jaxpr(pure, return_shape=True)(dynamic, dyn_kwargs)
            except ValueError as e:  # JAX's own check of a sharding annotation: say where it is
                if "mesh" not in str(e) and "shard" not in str(e).lower():
                    raise
                hint = ""
                if "Auto" in str(e) or "Explicit" in str(e):  # (explicit sharding mode's annotations)
                    hint = (
                        "; mx.partition traces on a mesh of Auto axes (GSPMD's annotations): write "
                        "jax.sharding.reshard(x, spec) as jax.lax.with_sharding_constraint(x, spec) or "
                        "mx.mesh_split, and give a NamedSharding a mesh made with "
                        "axis_types=(jax.sharding.AxisType.Auto, ...), or its PartitionSpec alone"
                    )
                raise LayoutError(
                    f"a sharding annotation at {_user_line(e)} does not fit mesh {_mesh_text(owner.impl)}: {e}{hint}"
                ) from None
        self._out_tree = jax.tree_util.tree_structure(out_shape)
        self._n_out = len(closed.jaxpr.outvars)
        self._outvars = list(closed.jaxpr.outvars)
        self._invars = list(closed.jaxpr.invars)
        flat = Flat(closed, platform=impl.platform)
        arg_paths = {v: p for v, p in zip(closed.jaxpr.invars, self.paths)}
        self.names = Names(flat, arg_paths)
        self.graph = Graph()
        mesh = Mesh(self.graph, "mesh")
        emitter = Emitter(mesh, flat, self.names, list(impl.axis_names))
        self.placeholders: list[Tensor] = []
        self._keys: list[Any] = []  # per leaf: the PRNG key impl of a key argument, else None
        specs = self._in_specs(dynamic, dyn_kwargs)
        self.graph.source = owner._where  # the arguments' and results' annotations: the partition call
        for v, path, leaf, spec in zip(closed.jaxpr.invars, self.paths, leaves, specs):
            key = jax.random.key_impl(leaf) if is_key(v.aval) else None
            shape = emitter.out_shape(v)
            dtype = np.uint32 if key is not None else v.aval.dtype
            t = placeholder(mesh, path, shape, dtype)
            self.placeholders.append(t)
            self._keys.append(key)
            emitter.env[v] = (
                t
                if spec is None
                else annotate(
                    t,
                    spec,
                    (),
                    0,
                    list(impl.axis_names),
                    f"in_shardings[{path!r}] (mx.partition at {owner._where})",
                    rank=v.aval.ndim,
                )
            )
        self.graph.source = None
        emitter.run()
        self.graph.source = owner._where
        out_specs = self._out_specs()
        self.outputs: list[Tensor] = []
        for i, atom in enumerate(flat.outvars):
            t = emitter.value(atom)
            if out_specs[i] is not None:
                t = annotate(
                    t,
                    out_specs[i],
                    (),
                    0,
                    list(impl.axis_names),
                    f"out_shardings[{i}] (mx.partition at {owner._where})",
                    rank=atom.aval.ndim,
                )
            self.outputs.append(t)
        self.graph.source = None
        self.lowering = Lowering(self.graph, {mesh: impl})
        if self._gather_padded_results(impl):
            self.lowering = Lowering(self.graph, {mesh: impl})
        donated = {i for i, (p, _) in enumerate(path_leaves) if self._argnum(p) in owner.donate_argnums}
        self._donated = sorted(donated)
        self._function = self.lowering.function(self.outputs, donate=[self.placeholders[i] for i in sorted(donated)])
        self.counters = self._function.counters

    def _gather_padded_results(self, impl) -> bool:
        """Results the plan splits unevenly gathered in the program; whether any were.

        A jax.Array's shards must divide its dims, so a result whose planned layout pads a dim
        comes back replicated along it (`MeshImpl.global_sharding`). Left to the call, that
        allgather ran in a program of its own after the step, which the counters, the report and
        `compiled_text` never saw (a [64, 1001] gradient split 4 ways: 16,064 values a device,
        counted 0). An annotation with the layout the result comes back in puts it in the step."""
        plan, names = self.lowering.plan, list(impl.axis_names)
        changed = False
        self.graph.source = self.owner._where  # (as the out_shardings' annotations: the partition call)
        for i, t in enumerate(self.outputs):
            layout = plan[t]
            padded = padded_dims(t.shape, layout, impl.shape)
            if not padded:
                continue
            spec = [None if j in padded else tuple(names[m] for m in a) for j, a in enumerate(layout.axes)]
            where = f"result {i} of mx.partition at {self.owner._where}, replicated along its uneven split"
            self.outputs[i] = annotate(t, PartitionSpec(*spec), (), 0, names, where)
            changed = True
        self.graph.source = None
        return changed

    # ---- arguments ----------------------------------------------------------------------------
    def _argnum(self, path) -> int | None:
        """The positional index (in the original call) of the argument a leaf path starts in."""
        if path[0].idx != 0:  # (dynamic args, kwargs): a keyword argument
            return None
        k = int(path[1].idx)
        positions = [i for i in range(k + len(self.owner.static_argnums) + 1) if i not in self.owner.static_argnums]
        return positions[k]

    def _path(self, path) -> str:
        """A leaf's path: the parameter's name (or position), then the keys inside it, '/'-joined."""
        rest = [_key_text(k) for k in path[2:]]
        if path[0].idx == 0:
            i = self._argnum(path)
            params, varargs = self.owner._params, self.owner._varargs
            if i is None:
                head = "arg"
            elif i < len(params):
                head = params[i]
            else:
                head = f"{varargs}/{i - len(params)}" if varargs else f"arg{i}"
        else:
            head = _key_text(path[1])
        return "/".join([head, *rest])

    def _in_specs(self, dynamic: tuple, dyn_kwargs: dict) -> list:
        """Per argument leaf: its PartitionSpec annotation or None (left to propagation)."""
        return [_spec(s) for s in self._given_in_specs(dynamic)]

    def _given_in_specs(self, dynamic: tuple) -> list:
        given = self.owner.in_shardings
        n = len(self.paths)
        if given is None:
            return [None] * n
        if isinstance(given, PartitionSpec | NamedSharding):
            return [given] * n
        if isinstance(given, Mapping) and all(isinstance(k, str) for k in given):
            out: list = [None] * n
            used = set()
            for pattern, spec in given.items():
                hits = [i for i, p in enumerate(self.paths) if fnmatch.fnmatchcase(p, pattern)]
                if not hits:
                    raise ConfigError(
                        f"in_shardings names {pattern!r}, which matches no argument; the arguments are: "
                        + ", ".join(self.paths)
                    )
                for i in hits:
                    out[i] = spec
                used.add(pattern)
            return out
        if not isinstance(given, tuple | list) or len(given) != len(dynamic):
            raise ConfigError(
                f"in_shardings must have one entry per positional (non-static) argument ({len(dynamic)}), "
                f"a single PartitionSpec, or a dict of argument paths; got {given!r}"
            )
        out = []
        for k, (prefix, arg) in enumerate(zip(given, dynamic)):
            try:
                specs = jax.tree_util.tree_map(
                    lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)), prefix, arg, is_leaf=_is_spec
                )
            except (ValueError, TypeError) as e:
                raise ConfigError(
                    f"in_shardings[{k}] does not match argument {k}'s structure: {e}; give a PartitionSpec "
                    "(or None) per leaf, or one for a whole subtree"
                ) from None
            out.extend(
                s for group in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, list)) for s in group
            )
        return out + [None] * (n - len(out))

    def _out_specs(self) -> list:
        given = self.owner.out_shardings
        n = self._n_out
        if given is None:
            return [None] * n
        if isinstance(given, PartitionSpec | NamedSharding):
            return [_spec(given)] * n
        try:
            specs = jax.tree_util.tree_map(
                lambda s, sub: [s] * len(jax.tree_util.tree_leaves(sub)),
                given,
                jax.tree_util.tree_unflatten(self._out_tree, [0] * n),
                is_leaf=_is_spec,
            )
        except (ValueError, TypeError) as e:
            raise ConfigError(f"out_shardings does not match the function's output structure: {e}") from None
        return [
            _spec(s) for group in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, list)) for s in group
        ]

    # ---- running ------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        dynamic, dyn_kwargs, _ = self.owner._split(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten((dynamic, dyn_kwargs))
        if tree != self._in_tree:
            raise ConfigError(
                f"arguments of another structure than the program was traced for: {tree} vs {self._in_tree}"
            )
        for path, leaf, v in zip(self.paths, leaves, self._invars):
            if np.shape(leaf) != v.aval.shape:  # (a TypeError from JAX's executable, or a ValueError)
                raise ConfigError(
                    f"argument {path!r} has shape {list(np.shape(leaf))}, but this program was traced for "
                    f"{list(v.aval.shape)}: call the partitioned function itself, which traces one per shape"
                )
        return self.run_leaves(leaves)

    def run_leaves(self, leaves: list):
        """Run on the dynamic arguments' leaves, in the order the program was traced with."""
        self._check_donations(leaves)
        feeds = {
            t: jax.random.key_data(leaf) if key is not None else leaf
            for t, key, leaf in zip(self.placeholders, self._keys, leaves)
        }
        outs = self._function.call_global(feeds)
        outs = [
            jax.random.wrap_key_data(o, impl=v.aval.dtype._impl) if is_key(v.aval) else o
            for o, v in zip(outs, self._outvars)
        ]
        return jax.tree_util.tree_unflatten(self._out_tree, outs)

    def _check_donations(self, leaves: list) -> None:
        """A ConfigError where a donated array is also passed as another argument leaf: its buffer
        would be given up while read, and XLA on a mesh of several devices crashed the process
        (a segmentation fault, under jax.jit too) where one device refuses it."""
        for i in self._donated:
            if not isinstance(leaves[i], jax.Array):
                continue
            j = next((j for j, leaf in enumerate(leaves) if j != i and leaf is leaves[i]), None)
            if j is not None:
                raise ConfigError(
                    f"mx.partition: argument {self.paths[i]!r} is donated (donate_argnums) and the same array is "
                    f"passed as {self.paths[j]!r}: a buffer can be given up only where nothing else reads it; "
                    "pass a copy (jnp.copy(x)) for one of them, or do not donate it"
                )

    def place(self, *args, **kwargs):
        """The arguments laid out on the devices as the program takes them (each leaf with its
        layout's NamedSharding): place a training loop's first state once, and every later call
        takes it as it is, nothing moved. Static arguments come back as they are."""
        dynamic, dyn_kwargs, _ = self.owner._split(args, kwargs)
        leaves = jax.tree_util.tree_leaves((dynamic, dyn_kwargs))
        impl = self.owner.impl
        placed = iter(
            jax.device_put(leaf, impl.global_sharding(t.shape, self.lowering.plan[t])) if key is None else leaf
            for t, key, leaf in zip(self.placeholders, self._keys, leaves)
        )
        dynamic, dyn_kwargs = jax.tree_util.tree_unflatten(self._in_tree, list(placed))
        it = iter(dynamic)
        full = tuple(a if i in self.owner.static_argnums else next(it) for i, a in enumerate(args))
        return full, {**kwargs, **dyn_kwargs}

    def compiled_text(self) -> str:
        """The compiled SPMD program (HLO) for this program's argument shapes."""
        return self._function.compiled_text()

    def peak_memory_bytes(self) -> int:
        """What the compiled program needs on one device at its peak, by XLA's memory analysis."""
        return self._function.peak_memory_bytes()

    # ---- what it costs and why ------------------------------------------------------------------
    def report(self, width: int = 132) -> str:
        """The cost report of one call: every collective with the equation's source line."""
        return self.lowering.report(self.counters, width)

    def explain(self, threshold: int = 1 << 20) -> str:
        """The dim names (each with its size, where it first appears and the array axes it names),
        then every tensor's layout and where it came from."""
        lines = ["dimension names (write layout rules against these):"]
        for d in self.names.dims.values():
            where = "an argument's axis" if d.source == "argument" else f"first at {d.source}"
            lines.append(f"  {d.name}  size {d.size}  ({where}): {'; '.join(d.axes)}")
        return "\n".join(lines) + "\n\n" + self.lowering.explain(threshold)

    def layout_of(self, what) -> str:
        """The layout of an argument (its path, e.g. "params/w1"), an output (its index), or a
        meshax Tensor of the graph, as rules ("params/w1[1]:y"; "" when replicated)."""
        if isinstance(what, Tensor):
            return self.lowering.layout_of(what)
        if isinstance(what, int):
            if not -len(self.outputs) <= what < len(self.outputs):  # (an IndexError from the list)
                raise ConfigError(f"no output {what}: the function returns {len(self.outputs)} arrays (leaves)")
            return self.lowering.layout_of(self.outputs[what])
        if what in self.paths:
            return self.lowering.layout_of(self.placeholders[self.paths.index(what)])
        raise ConfigError(f"no argument {what!r}; the arguments are: {', '.join(self.paths)}")


class _mesh_context:
    """`jax.set_mesh(mesh)` while tracing, so `with_sharding_constraint(x, PartitionSpec(...))`
    inside the function knows the mesh."""

    def __init__(self, mesh):
        self._cm = jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)

    def __enter__(self):
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def partition(
    fn: Callable,
    mesh,
    in_shardings=None,
    out_shardings=None,
    *,
    layout=None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    devices: Sequence | None = None,
    reduce_scatter_as: str = "reduce_scatter",
) -> Partitioned:
    """`fn`, a plain single-device JAX function, partitioned over `mesh` ("x:2;y:4").

    `in_shardings`: per positional argument a PartitionSpec (or None: left to propagation) or a
    pytree prefix of them, as `jax.jit` takes; or one PartitionSpec for every argument; or a dict
    of argument paths (glob patterns allowed) to PartitionSpecs: `{"params/w1": P(None, "y")}`.
    A NamedSharding stands for its PartitionSpec, its mesh axes read as `mesh`'s dims of the same
    names. `out_shardings` likewise for the results. `layout`: layout rules against the dim names
    `explain()` lists ("x[0]:x"). Inside `fn`, `jax.lax.with_sharding_constraint(x, P(...))` and
    `mx.mesh_split(x, [...], priority=p)` annotate intermediate values. `static_argnums`,
    `static_argnames` and `donate_argnums` are `jax.jit`'s. `reduce_scatter_as="allreduce"` runs
    each reduce-scatter as an all-reduce and a local slice (faster on CPU; `MeshImpl`)."""
    return Partitioned(
        fn,
        mesh,
        in_shardings,
        out_shardings,
        layout,
        static_argnums,
        static_argnames,
        donate_argnums,
        devices,
        reduce_scatter_as,
    )
