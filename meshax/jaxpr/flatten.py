"""A jaxpr flattened into one list of equations: calls (`jit`, `custom_jvp_call`, ...) inlined.

Each equation keeps its primitive, params, operands (a `Var` or a `Literal`), results and the
user's source line. Inlining maps an inner jaxpr's variables onto the outer atoms, so the
flattened program has one variable per value however deeply the user's code nested its calls.
Equations no result depends on are dropped (`_live`; a scan's stacked results no one reads
too), and a sum pooling's transpose, a `pad` and a `reduce_window_sum`, becomes one equation
(`_fuse_sum_pool_transposes`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import warnings
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from meshax.core.errors import DebugCallbackWarning
from meshax.jaxpr.windows import pool_window

# Call-like primitives whose body is inlined, and the param holding it.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_vmap_call": "call",  # (jax.custom_batching.custom_vmap, not mapped: its function, as it runs)
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
}

#: Primitives that are the identity on their one operand, read through: `name` is
#: `checkpoint_name`'s tag, which only a `jax.checkpoint` policy reads, when JAX differentiates.
_IDENTITIES = {"name"}

#: Host callbacks with nothing but their effect (`jax.debug.print`, `jax.debug.callback`): left
#: out, with a warning, as nothing the function returns depends on them.
_DEBUG_CALLBACKS = {"debug_callback", "debug_print"}

#: The name scope `mx.replicated_region` puts its equations in (and JAX keeps on their gradients).
REPLICATED_SCOPE = "meshax_replicated_region"


@dataclasses.dataclass
class Eqn:
    """One equation of the flattened program."""

    primitive: Any
    ins: list  # Var or Literal
    outs: list  # Var (DropVar included)
    params: dict
    source: str  # "file:line" of the user's code
    replicated: bool  # inside mx.replicated_region: run whole on each device
    body: Flat | None = None  # a loop's body (scan, while), flattened
    cond: Flat | None = None  # a while loop's condition, flattened
    branches: list[Flat] | None = None  # a cond's branches, flattened
    effects: bool = False  # (kept where its results are not read)
    recomputed: bool = False  # inside a `jax.checkpoint`: its repeat of an earlier equation is merged

    @property
    def name(self) -> str:
        return self.primitive.name


_MESHAX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_JAX = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) for m in (jax, jaxlib))


def is_library_file(name: str) -> bool:
    """A file of JAX's or of meshax's: not where the user wrote what meshax reports."""
    return not name.startswith("<") and os.path.abspath(name).startswith(
        (_MESHAX + os.sep, *(j + os.sep for j in _JAX))
    )


def source_of(source_info) -> str:
    """'file:line' of the innermost frame of the user's code (not JAX's, not meshax's) that made
    an equation ('<unknown>' if none)."""
    if not source_info.traceback:
        return "<unknown>"
    for frame in source_info_util.user_frames(source_info.traceback):
        name = frame.file_name
        if not is_library_file(name):
            return f"{name if name.startswith('<') else os.path.relpath(name)}:{frame.start_line}"
    return "<unknown>"


def is_var(atom) -> bool:
    return isinstance(atom, jcore.Var) and not isinstance(atom, jcore.DropVar)


class Flat:
    """The flattened program: `eqns`, `invars`, `outvars` (resolved atoms), `consts` (var -> value).
    `platform`: that of the devices it will run on ("cpu", "gpu", "tpu"; default: JAX's default
    backend's), which decides a platform-dependent branch and whether a checkpoint's
    recomputation is kept apart, as XLA for those devices decides."""

    def __init__(
        self, closed: jcore.ClosedJaxpr, replicated: bool = False, source: str = "<unknown>", platform: str = ""
    ):
        self.platform = platform or jax.default_backend()
        self.eqns: list[Eqn] = []
        self.consts: dict = dict(zip(closed.jaxpr.constvars, closed.consts))
        self._defined: set = set()
        self.invars = list(closed.jaxpr.invars)
        env: dict = {}
        self._walk(closed.jaxpr, env, replicated, source)
        self.eqns, self.outvars = _merge_repeats(self.eqns, [_read(env, v) for v in closed.jaxpr.outvars])
        self.eqns = _fuse_sum_pool_transposes(_live(self.eqns, self.outvars), self.outvars)

    def _walk(self, jaxpr, env: dict, replicated: bool, outer: str, recomputed: bool = False) -> None:
        """Append jaxpr's equations; `env` maps its variables to the atoms that stand for them
        (an inlined call's to its caller's operands and to its own equations' results); `outer`
        is the calling equation's source line, for inner equations whose own trace (a cached
        jit's) has no frame of the user's."""
        for e in jaxpr.eqns:
            scope = REPLICATED_SCOPE in str(e.source_info.name_stack)
            source = source_of(e.source_info)
            source = outer if source == "<unknown>" else source
            if e.primitive.name in _DEBUG_CALLBACKS:
                warnings.warn(
                    f"mx.partition leaves out {e.primitive.name} (jax.debug.print or jax.debug.callback, at "
                    f"{source}): it does not run in the partitioned program; to see the value, return it from "
                    "the function, or run the function under jax.jit",
                    DebugCallbackWarning,
                    stacklevel=2,
                )
                continue
            # (an annotation in a replicated region, whose values are whole on each device: the
            # identity; bound on each device's slices, with_sharding_constraint failed inside JAX)
            annotation_in_region = (replicated or scope) and e.primitive.name in _ANNOTATIONS
            if e.primitive.name in _IDENTITIES or _moves_between_memories(e) or annotation_in_region:
                for v, a in zip(e.outvars, e.invars):
                    if is_var(v):
                        env[v] = _read(env, a)
                continue
            inner = self._body(e)
            if inner is not None:
                body, consts, operands = inner
                for v, c in zip(body.constvars, consts):
                    self.consts[v] = c
                checkpoint = e.primitive.name in _CHECKPOINTS
                kept = checkpoint and e.params.get("prevent_cse", True) and _keeps_recomputation(self.platform)
                operands = [_read(env, a) for a in operands]
                if kept:  # its operands pass a barrier, as jax.jit lowers it: nothing merges across
                    operands = self._barrier(operands, source, replicated or scope)
                inner_env = dict(zip(body.invars, operands))
                inside = recomputed or (checkpoint and not kept)
                self._walk(body, inner_env, replicated or scope, source, inside)
                for v, a in zip(e.outvars, body.outvars):
                    if is_var(v):
                        env[v] = _read(inner_env, a)
                continue
            ins = [_read(env, a) for a in e.invars]
            outs = [self._define(v, env) for v in e.outvars]
            eqn = Eqn(e.primitive, ins, outs, dict(e.params), source, replicated or scope, effects=bool(e.effects))
            eqn.recomputed = recomputed
            if e.primitive.name == "scan":  # a loop stays a loop (mx.scan), its body flattened too
                eqn.body = self._inner(e.params["jaxpr"], replicated or scope, source)
            elif e.primitive.name == "while":  # likewise (mx.while_loop), its condition too
                eqn.body = self._inner(e.params["body_jaxpr"], replicated or scope, source)
                eqn.cond = self._inner(e.params["cond_jaxpr"], replicated or scope, source)
            elif e.primitive.name == "cond":  # a branch stays a branch (mx.switch), each flattened
                eqn.branches = [self._inner(b, replicated or scope, source) for b in e.params["branches"]]
            self.eqns.append(eqn)

    def _inner(self, closed: jcore.ClosedJaxpr, replicated: bool, source: str) -> Flat:
        """A loop's body or condition, or a branch, flattened for the same devices."""
        return Flat(closed, replicated, source, self.platform)

    def _barrier(self, atoms: list, source: str, replicated: bool) -> list:
        """`atoms` with each variable passed through one `optimization_barrier` equation."""
        held = [a for a in atoms if is_var(a)]
        if not held:
            return atoms
        outs = [copy.copy(v) for v in held]
        self._defined.update(outs)
        self.eqns.append(Eqn(jax.lax.optimization_barrier_p, held, outs, {}, source, replicated))
        passed = dict(zip(held, outs))
        return [passed.get(a, a) if is_var(a) else a for a in atoms]

    def _define(self, v, env: dict):
        """v as the result of the equation being added: a copy where v is defined already (a
        jaxpr that two calls share, as `jnp.where`'s, is inlined twice; each call's results
        are values of their own)."""
        if is_var(v):
            if v in self._defined:
                env[v] = v = copy.copy(v)
            self._defined.add(v)
        return v

    def _body(self, e):
        """(inner jaxpr, its consts, the operands it is called with) of a call-like equation, or
        of a cond that chooses its branch by platform (`lax.platform_dependent`, as in
        `jnp.diagonal`): the branch of the platform meshax runs on. Else None."""
        key = _CALLS.get(e.primitive.name)
        body = e.params.get(key) if key is not None else None
        operands = e.invars
        if e.primitive.name == "custom_linear_solve":  # (jnp.linalg.solve, inv): its solve, as it runs
            n = e.params["const_lengths"]
            body, skip = e.params["jaxprs"].solve, n.matvec + n.vecmat
            operands = [*e.invars[skip : skip + n.solve], *e.invars[sum(n) :]]
        if e.primitive.name == "cond" and e.params.get("branches_platforms") is not None:
            body, operands = (
                e.params["branches"][_platform_branch(e.params["branches_platforms"], self.platform)],
                e.invars[1:],
            )
        if isinstance(body, jcore.ClosedJaxpr):
            return body.jaxpr, body.consts, operands
        if isinstance(body, jcore.Jaxpr):
            return body, [], operands
        return None


def _moves_between_memories(e) -> bool:
    """A `device_put` to a memory space only (a checkpoint policy's offload to the host and back,
    `save_and_offload_only_these_names`): the identity on its values; mx.partition keeps them in
    device memory. (One to a sharding is not: `roles` says to annotate instead.)"""
    if e.primitive.name != "device_put":
        return False
    return all(d is None or type(d).__name__ == "MemorySpace" for d in e.params.get("devices", ()))


@functools.cache
def _platform_branch(platforms: tuple, platform: str) -> int:
    """The branch a cond whose branches are for `platforms` (per branch, platform names, or None:
    the default) takes on a device of `platform`: asked of `lax.platform_dependent` itself, run
    there (its names are the compilers', "cuda" or "rocm" for a "gpu"), on a device of this
    process (in a job of many, another's device runs nothing here, and its answer is not read)."""
    per_platform = {p: functools.partial(int, i) for i, ps in enumerate(platforms) if ps for p in ps}
    default = next((functools.partial(int, i) for i, ps in enumerate(platforms) if ps is None), None)
    there = jax.sharding.SingleDeviceSharding(jax.local_devices(backend=platform)[0])
    return int(jax.jit(lambda: jax.lax.platform_dependent(default=default, **per_platform), out_shardings=there)())


def _merge_repeats(eqns: list[Eqn], outvars: list) -> tuple[list[Eqn], list]:
    """The equations with each repeat of an earlier one (the same primitive and params on the
    same operands) inside a `jax.checkpoint` dropped and its results read from the earlier
    one's, as XLA's CSE does: a checkpoint's recomputed forward is the forward, and would
    otherwise gather what the forward gathered a second time (run and counted; XLA runs it
    once). Only there: merging the repeats of a whole program (JAX's gradients repeat many small
    equations) slowed section 9's Transformer step by 10% on the CPU. Never merged: loops,
    branches, equations with effects, a repeat whose result is annotated (two computations the
    user lays out two ways stay two), and constants (each device fills one in whatever layout
    its reader wants, where a merged one would be moved to its other readers; but two
    equations of equal constants are repeats)."""
    annotated = {a for e in eqns if e.name in _ANNOTATIONS for a in e.ins if is_var(a)}
    constant: dict = {}  # a constant's variable -> its key: equal constants are equal operands
    seen: dict = {}
    same: dict = {}
    kept = []
    for e in eqns:
        if any(is_var(a) and a in same for a in e.ins):
            e = dataclasses.replace(e, ins=[same.get(a, a) if is_var(a) else a for a in e.ins])
        key = _repeat_key(e, constant)
        if key is not None and not any(is_var(a) for a in e.ins):
            constant[e.outs[0]] = key
            key = None
        if key is not None and key in seen and e.recomputed and not any(v in annotated for v in e.outs):
            for v, w in zip(e.outs, seen[key].outs):
                if is_var(v):
                    same[v] = w
            continue
        if key is not None:
            seen.setdefault(key, e)
        kept.append(e)
    return kept, [same.get(v, v) if is_var(v) else v for v in outvars]


def _repeat_key(e: Eqn, constant: dict):
    """What makes two equations repeats of each other (operands that are equal constants are
    equal), or None where they never are (a loop, a branch, effects, params that cannot be
    compared)."""
    if e.effects or e.body is not None or e.branches is not None or not all(is_var(v) for v in e.outs):
        return None

    def atom(a):
        if is_var(a):
            return constant.get(a, a)
        value = np.asarray(a.val)
        return ("literal", value.dtype.str, value.shape, value.tobytes())

    try:
        key = (e.name, e.replicated, tuple(atom(a) for a in e.ins), tuple(sorted(e.params.items())))
        hash(key)
    except TypeError:  # (an array among the params)
        return None
    return key


#: Calls whose bodies are recomputed in the gradient (`_merge_repeats`).
_CHECKPOINTS = {"checkpoint", "remat", "remat2"}


def _keeps_recomputation(platform: str) -> bool:
    """Whether XLA for `platform`'s devices keeps a `jax.checkpoint`'s recomputation apart from the
    forward. XLA's GPU compiler removes the optimization barriers `jax.jit` puts before it only
    after scheduling: the recomputation stays, and so does the memory it saves. XLA's CPU
    compiler removes them before its last merge of equal instructions, which merges what the
    recomputation repeats (its collectives among them) into the forward. `flatten` does as XLA
    will on those devices: a barrier and the recomputation (not the CPU), or the repeats merged
    (the CPU), so that the counters count what the compiled program runs."""
    return platform != "cpu"


#: Annotations: kept where their value is not read, for the splits they propagate to others.
_ANNOTATIONS = {"sharding_constraint", "reshard", "meshax_mesh_split"}


def _live(eqns: list[Eqn], outvars: list) -> list[Eqn]:
    """The equations a result depends on, annotations, and those with effects: JAX leaves values
    no one reads (the zeros of a relu's gradient), which would be built, counted and warned
    about here, though XLA drops them."""
    live = {v for v in outvars if is_var(v)}
    kept = []
    for e in reversed(eqns):
        if e.effects or e.name in _ANNOTATIONS or any(v in live for v in e.outs):
            if e.name == "scan":
                e = _without_unread_ys(e, live)
            kept.append(e)
            live.update(a for a in e.ins if is_var(a))
    return kept[::-1]


def _without_unread_ys(e: Eqn, live: set) -> Eqn:
    """A scan without the stacked results no one reads, and its body without what computed only
    them (a collective there would run and be counted each iteration; XLA drops it)."""
    ncar = e.params["num_carry"]
    keep = [j for j, v in enumerate(e.outs) if j < ncar or v in live]
    if len(keep) == len(e.outs) or e.body is None:
        return e
    body = copy.copy(e.body)
    body.outvars = [e.body.outvars[j] for j in keep]
    body.eqns = _live(body.eqns, body.outvars)
    return dataclasses.replace(e, outs=[e.outs[j] for j in keep], body=body)


class _Fused:
    """The stand-in primitive of equations fused here (emitted by a handler, never bound)."""

    multiple_results = False

    def __init__(self, name: str):
        self.name = name


SUM_POOL_TRANSPOSE = _Fused("sum_pool_transpose")


def _fuse_sum_pool_transposes(eqns: list[Eqn], outvars: list) -> list[Eqn]:
    """JAX writes a sum (or average) pooling's gradient as a `pad` of the cotangent (its interior
    padding the strides) read only by a stride-1 `reduce_window_sum`: the pair becomes one
    `sum_pool_transpose` equation of the cotangent, params the pad's and the sum's, which
    `windows` emits as one windowed op (the pad alone would gather its axes)."""
    readers: dict = {}
    for e in eqns:
        for a in e.ins:
            if is_var(a):
                readers[a] = readers.get(a, 0) + 1
    for v in outvars:
        if is_var(v):
            readers[v] = readers.get(v, 0) + 2  # (a result: never fused away)
    pads = {e.outs[0]: e for e in eqns if e.name == "pad" and not e.replicated and is_var(e.outs[0])}
    fused, out = set(), []
    for e in eqns:
        pad = pads.get(e.ins[0]) if e.name == "reduce_window_sum" and not e.replicated else None
        if pad is not None and readers.get(pad.outs[0]) == 1 and not is_var(pad.ins[1]) and not pad.ins[1].val:
            params = {"padding_config": pad.params["padding_config"], **e.params}
            pair = dataclasses.replace(e, primitive=SUM_POOL_TRANSPOSE, ins=[pad.ins[0]], params=params)
            if pool_window(pair) is not None:  # (else the two run as they are)
                fused.add(id(pad))
                e = pair
        out.append(e)
    return [e for e in out if id(e) not in fused]


def _read(env: dict, atom):
    """The atom that stands for `atom` in `env` (itself where none does)."""
    return env.get(atom, atom) if is_var(atom) else atom
