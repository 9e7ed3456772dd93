"""The search's fast estimate of a rule set's StepCost, read from the ops' sharding rules.

Tracing a step exactly (`Lowering.trace_step`) takes about a second for a large Transformer,
too slow to try hundreds of rule sets. The estimate asks the same code the lowering does, op by
op, without JAX: `sharding_rule.choose` says how each op runs under the rules' layouts, and
`lower.reshard.reshard`, run on shapes instead of arrays (`_Meter`), says which collectives
bring each operand from its producer's layout (and owed sums) to the one the op runs in. FLOPs
are the op's exact FLOPs on one device (one replicated trace) divided by the splits it runs
with. Tensors are laid out by the rules; a dim no rule names that a rename ties to one a rule
splits (`length`, the keys' `memory_length`) takes that split, and carries it on to the dims it
meets in ops (and across a loop's boundary), as far as each tensor leaves its mesh dims free, as
propagation splits them (`_carried`). Ops that exchange halos themselves (a pipeline's shifts,
convolutions, pooling) say what their permutes send (`halo_sends`), and ops that owe more sums
than their rule says (a filter gradient, over split space) say so (`owed`). Linear ops (adds,
negations) carry sums owed on where every op of their signature may (`_state`). What it leaves
out: other splits propagation adds, the order in which propagation carries splits that want
one mesh dim (a shape is laid out one way: where two renames split one dim two ways, as the MoE
layer's group and the keys' memory_length split length, tensors of one shape differ), and sums
carried where other ops of the signature may not or through a rename (the exact trace counts
those), so the search re-scores its best candidates exactly.

The ops inside a loop's body (a pipeline's scan) and a rematerialized layer's (in its forward
op, and again in its gradient's) are costed as often as they run, as the trace counts them; the
loop or layer itself only fetches the tensors it binds to its body.
Ops with the same signature (type, rule, operand and result shapes, linearity: a layer repeated) and
tensors with the same producer and consumers are costed once and counted as often as they occur,
so a rule set costs a few milliseconds whatever the depth.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshax.core.graph import Graph, Operation, Tensor
from meshax.core.shape import Shape
from meshax.layout.plan import weight_shapes
from meshax.layout.propagate import longest_split
from meshax.layout.rules import LayoutRules, TensorLayout, block_sizes, slice_shape, split_factor
from meshax.layout.sharding_rule import choose, rule_of
from meshax.lower.laid_out import LaidOutTensor
from meshax.lower.lowering import Lowering, _needed_ops
from meshax.lower.reshard import reshard
from meshax.ops.cond import CondOperation
from meshax.ops.loops import ScanOperation, WhileOperation, _needed
from meshax.ops.recompute import RecomputeOperation
from meshax.search.cost import Collective, StepCost, affine_counts, family


class _Meter:
    """What `reshard` needs of a LoweringContext, on local shapes: records the collectives."""

    op = None

    def __init__(self, mesh_shape: Shape, itemsize: int):
        self.mesh_shape, self.itemsize = mesh_shape, itemsize
        self.moves: list[tuple[str, tuple[int, ...], int]] = []  # (kind, mesh axes, bytes in)

    @contextlib.contextmanager
    def blame(self, op):
        yield

    def _live(self, axes) -> list[int]:
        return [m for m in axes if self.mesh_shape[m].size > 1]

    def _pad(self, shape, dim, parts) -> list[int]:
        shape = list(shape)
        shape[dim] += -shape[dim] % parts
        return shape

    def _record(self, kind, axes, shape) -> None:
        self.moves.append((kind, tuple(axes), math.prod(shape) * self.itemsize))

    def allreduce(self, xs, axes, op="sum"):
        axes = sorted(self._live(axes))
        if axes:
            self._record("allreduce", axes, xs)
        return xs

    def reduce_scatter(self, xs, axis, dim):
        if not self._live([axis]):
            return xs
        n = self.mesh_shape[axis].size
        xs = self._pad(xs, dim, n)
        self._record("reduce_scatter", [axis], xs)
        xs[dim] //= n
        return xs

    def allgather(self, xs, axis, dim, keep=None):
        if not self._live([axis]):
            return xs
        self._record("allgather", [axis], xs)
        xs = list(xs)
        xs[dim] = min(xs[dim] * self.mesh_shape[axis].size, keep or math.inf)
        return xs

    def alltoall(self, xs, axis, split_dim, concat_dim, keep=None):
        if not self._live([axis]):
            return xs
        n = self.mesh_shape[axis].size
        xs = self._pad(xs, split_dim, n)
        self._record("alltoall", [axis], xs)
        xs[split_dim] //= n
        xs[concat_dim] = min(xs[concat_dim] * n, keep or math.inf)
        return xs

    def allsplit(self, xs, axis, dim):
        n = self.mesh_shape[axis].size
        if n == 1:
            return xs
        xs = self._pad(xs, dim, n)
        xs[dim] //= n
        return xs


def _shape_key(t: Tensor) -> tuple:
    return (tuple((d.name, d.size) for d in t.shape), np.dtype(t.dtype).str)


class Estimator:
    """Fast StepCosts of rule sets for one program (outputs and updates) of a graph on a mesh."""

    def __init__(self, graph: Graph, mesh_shape: Shape, outputs: Sequence[Tensor], updates: Sequence = ()):
        from meshax.backends import SimdMeshImpl

        self.mesh_shape = mesh_shape
        roots = [*(t.operation for t in outputs), *updates]
        ops = [op for op in _needed_ops(graph, roots) if not getattr(op, "is_input", False)]
        replicated = Lowering(graph, {graph.operations[0].mesh: SimdMeshImpl(mesh_shape)})
        flops = replicated.trace_step(list(outputs), list(updates)).flops
        self._reps: dict[tuple, Operation] = {}
        self._flops: dict[tuple, float] = defaultdict(float)  # signature -> FLOPs of its ops on one device
        scopes = _scopes(ops, list(outputs))
        sig_of: dict[Operation, tuple] = {}
        self._runs_of: dict[tuple, int] = defaultdict(int)  # signature -> how many times its ops run
        for body, _, times in scopes:
            for op in body:
                if _bodies(op):  # (a loop or a recomputed layer: its bodies are scopes of their own)
                    continue
                if op not in sig_of:  # (an op recomputed in a gradient's body: its FLOPs are counted once, all)
                    shapes = (tuple(map(_shape_key, op.inputs)), tuple(map(_shape_key, op.outputs)))
                    # (whether it is linear too: an add and a multiply of the same shapes differ in
                    # whether sums owed pass through them, `_state`)
                    linear = bool(getattr(op, "linear", False))
                    sig = sig_of[op] = (type(op).__name__, rule_of(op), *shapes, linear)
                    self._reps.setdefault(sig, op)
                    self._flops[sig] += flops.get(op.name, 0)  # (a loop body's: every iteration's)
                self._runs_of[sig_of[op]] += times
        # tensors, in each scope: (producer signature and output index, or the input's shape,
        # consumers' wants, and whether one op alone reads it: `_state`) -> as often as the scope
        # runs. A loop, branch or recomputed layer fetches the tensors it binds in their own layout
        # (its body reads what it captures, and its results come out in theirs: a source as an
        # input is)
        self._uses: dict[tuple, int] = defaultdict(int)
        self._shapes: dict[tuple, Shape] = {}
        for body, results, times in scopes:
            consumers: dict[Tensor, list[tuple]] = defaultdict(list)
            reading: dict[Tensor, set] = defaultdict(set)  # (the ops reading it; None: the results)
            for op in body:
                inner = _bodies(op)
                for i, t in enumerate(op.inputs):
                    if inner is None or i < inner[0]:
                        consumers[t].append((sig_of[op], i) if inner is None else ("output",))
                        reading[t].add(op)
            for t in results:
                consumers[t].append(("output",))
                reading[t].add(None)
            for t, cs in consumers.items():
                op = t.operation
                source = (sig_of[op], op.outputs.index(t)) if op in sig_of else ("input", _shape_key(t))
                alone = len(reading[t]) == 1
                self._uses[(source, _shape_key(t), tuple(sorted(set(cs), key=repr)), alone)] += times
                self._shapes[_shape_key(t)] = t.shape
        # tensors that stand for one value across a loop's, branch's or recomputed layer's
        # boundary (`propagation_links`: a scan's carries, its slices and their stacks), as
        # (outside shape, inside shape, the dim kept whole): propagation carries splits across
        # them by name, as through an identity (`_carried`)
        self._links: set[tuple] = set()
        for body, _, _ in scopes:
            for op in body:
                for a, b, whole in getattr(op, "propagation_links", list)():
                    self._links.add((_shape_key(a), _shape_key(b), whole))
                    self._shapes.update({_shape_key(a): a.shape, _shape_key(b): b.shape})
        from meshax.plan import _fed, recomputed_bodies, weight_reads  # (memory as the plan counts it)

        forward = _needed_ops(graph, [t.operation for t in outputs])
        parts = ("parameters", "gradients", "optimizer_state", "activations")
        self._memory: dict[str, dict[tuple, int]] = {k: defaultdict(int) for k in parts}
        # memory as `search.memory_of` counts it
        kept = [op for op in forward if not getattr(op, "is_input", False)]
        kept += [op for op in graph.operations if _fed(op)]  # (the batch, and imported arrays)
        for part, op in [
            *(("parameters" if v.trainable else "optimizer_state", v) for v in graph.all_variables),
            *(("gradients", v) for v in (graph.trainable_variables if updates else ())),
            *(("activations", op) for op in kept),
        ]:
            for t in op.outputs:
                self._memory[part][_shape_key(t)] += 1
                self._shapes[_shape_key(t)] = t.shape
        # and the internals of the largest rematerialized layer, loop body or branch, once (they
        # live again while its gradient runs): each distinct body's tensors
        self._recomputed: set[frozenset] = set()
        for op in kept:
            for body in recomputed_bodies(op):
                inside = [t for b in body for t in b.outputs]
                self._shapes.update((_shape_key(t), t.shape) for t in inside)
                self._recomputed.add(frozenset(Counter(map(_shape_key, inside)).items()))
        self._weight_shapes = weight_shapes(graph.operations)
        # weight-shaped tensors the forward ops read, by shape and readers: those read in another
        # layout than their own are gathered copies (`meshax.plan._gathered_weights`)
        self._weight_reads: dict[tuple, int] = defaultdict(int)
        for t, readers in weight_reads(kept, self._weight_shapes).items():
            self._weight_reads[_shape_key(t), frozenset((sig_of[op], i) for op, i in readers)] += 1
        self._memos()

    def _memos(self) -> None:
        """Empty memos, and the tables by index built on first use (`_Tables`)."""
        self._indexed: _Tables | None = None
        self._runs: dict[int, dict] = defaultdict(dict)  # signature number -> {layouts: (Run, splits)}
        self._moves: dict[tuple, list] = {}  # reshards: (shape number, have, owed, want) -> moves
        self._sends: dict[tuple, list] = {}  # halo exchanges: (signature number, layouts) -> permutes
        self._sizes: dict[tuple, int] = {}
        self._interned: dict[tuple, TensorLayout] = {}
        self._last: _State | None = None  # the previous rule set's (`_state`)

    @staticmethod
    def affine(base: Estimator, terms: list[tuple[float, Estimator]]) -> Estimator:
        """An Estimator whose counts are `affine_counts` of others' (the same model at other
        depths, `meshax.search.program.Extrapolated`)."""

        def combine(part) -> dict:
            return {k: round(v) for k, v in affine_counts(part(base), [(w, part(e)) for w, e in terms]).items()}

        out = copy.copy(base)
        everyone = [base, *(e for _, e in terms)]
        out._reps = {k: v for e in reversed(everyone) for k, v in e._reps.items()}
        out._shapes = {k: v for e in everyone for k, v in e._shapes.items()}
        out._flops = affine_counts(base._flops, [(w, e._flops) for w, e in terms])
        out._uses = combine(lambda e: e._uses)
        out._memory = {part: combine(lambda e, part=part: e._memory[part]) for part in base._memory}
        out._runs_of = combine(lambda e: e._runs_of)
        out._recomputed = set().union(*(e._recomputed for e in everyone))
        out._weight_reads = combine(lambda e: e._weight_reads)
        out._memos()
        out._weight_shapes = frozenset().union(*(e._weight_shapes for e in everyone))
        out._links = set().union(*(e._links for e in everyone))
        return out

    def __call__(self, rules: LayoutRules, weight_rules: LayoutRules | None = None) -> StepCost:
        """The estimated StepCost of `rules` (and `weight_rules` for weight-shaped tensors)."""
        mesh, tables = self.mesh_shape, self._tables()
        index = {d.name: i for i, d in enumerate(mesh)}

        def axes_of(rules: LayoutRules) -> dict[str, tuple[int, ...]]:
            return {d: tuple(index[m] for m in rules.mesh_dims_for(d)) for d in rules.tensor_dim_names}

        by_dim = axes_of(rules)
        by_weight_dim = by_dim if weight_rules is None else axes_of(weight_rules)
        weight_shaped = self._weight_shapes - getattr(weight_rules, "exempt", frozenset())
        state = self._state(by_dim, by_weight_dim, weight_shaped)
        lay = state.lay
        flops: dict[str, float] = defaultdict(float)
        for (fam, _, _, _), f in zip(tables.ops, state.flops):
            flops[fam] += f
        moves: dict[tuple, int] = defaultdict(int)
        for (_, _, _, _, count), found in zip(tables.uses, state.moves):
            for move in found:
                moves[move] += count
        for (_, times), sends in zip(tables.halos, state.sends):  # (ops that exchange halos: shifts, convolutions)
            for m, sent in sends:
                if mesh[m].size > 1:
                    moves["permute", (m,), sent] += times
        collectives = [
            Collective(kind, tuple(mesh[m].name for m in axes), nbytes, n) for (kind, axes, nbytes), n in moves.items()
        ]

        def nbytes(groups) -> int:
            return sum(n * self._bytes(k, lay[k]) for k, n in groups)

        memory = {part: nbytes(groups) for part, groups in tables.memory.items()}
        memory["activations"] += max(map(nbytes, tables.recomputed), default=0)
        for k, readers, n in tables.weight_reads:  # (the weights gathered for their readers)
            wants = {state.runs[c].operands[i] for c, i in readers} - {lay[k]}
            memory["activations"] += n * sum(self._bytes(k, want) for want in wants)
        return StepCost(dict(flops), collectives, memory, exact=False)

    def _state(self, by_dim: dict, by_weight_dim: dict, weight_shaped: frozenset) -> _State:
        """The layouts, runs, FLOPs and moves of a rule set, worked out again only where they
        differ from the previous rule set's (a search's next rule set changes a rule or two: an
        eighth of the tensors' layouts, on average, and the ops and uses that touch them)."""
        tables, previous = self._tables(), self._last
        self._last = None  # (until this rule set's state is whole: an interrupted call leaves none)
        changed_dims: set | None = None
        changed_weight_dims: set | None = None
        full = previous is None or previous.weight_shaped != weight_shaped  # (everything is new)
        if previous is None or full:
            last = _State(weight_shaped, len(tables.names), len(tables.ops), len(tables.uses), len(tables.halos))
        else:
            last = previous
            changed_dims = _changed(last.by_dim, by_dim)
            changed_weight_dims = _changed(last.by_weight_dim, by_weight_dim)
        last.by_dim, last.by_weight_dim = by_dim, by_weight_dim
        lay, ruled = last.lay, last.ruled
        for k, ((dims, s), deps) in enumerate(zip(tables.names, tables.deps)):
            weight = s in weight_shaped
            moved = changed_weight_dims if weight else changed_dims
            if moved is None or not moved.isdisjoint(deps):
                ruled[k] = self._layout(by_weight_dim if weight else by_dim, dims)
        carried = self._carried(ruled, by_dim, by_weight_dim, weight_shaped)
        changed = {k for k, new in enumerate(carried) if new is not lay[k]}
        for k in changed:
            lay[k] = carried[k]
        ops = range(len(tables.ops)) if full else sorted({i for k in changed for i in tables.ops_of[k]})
        rerun: set[int] = set()
        for i in ops:
            _, f, operands, results = tables.ops[i]
            run, splits = self._choose(i, tuple(lay[k] for k in operands), tuple(lay[k] for k in results))
            if run is not last.runs[i]:
                last.runs[i] = run
                last.flops[i] = f / splits
                rerun.add(i)
        runs, nothing = last.runs, frozenset[int]()
        uses = {u for k in changed for u in tables.uses_of_shape[k]} | {u for i in rerun for u in tables.uses_of_op[i]}
        # A linear op (an add, say) whose operands all owe the same sums, each read by it alone,
        # sums them as they are and owes them itself: settled once, by its readers (as the
        # lowering does: `LoweringContext.get`), not once per operand. An add of a carried add
        # carries on, one of its own signature too (a chain of adds): each linear op is taken to
        # carry (None: sums not yet known) until an operand says otherwise. An operand owes
        # the sums over the mesh axes its layout there splits no more (`reshard` settles them
        # as it moves it: a reduce-scatter).
        maybe: dict[int, frozenset | None] = {i: None for i, _ in tables.linear}
        progress = True
        while progress:
            progress = False
            for i, feeding in tables.linear:
                if i not in maybe:
                    continue
                owed = set()
                for u in feeding:
                    source, _, _, consumers, _ = tables.uses[u]
                    sums = maybe[source] if source in maybe else runs[source].pending if source >= 0 else nothing
                    if sums is not None:
                        owed |= {sums - runs[i].operands[j].mesh_axes_used for c, j in consumers if c == i}
                if len(owed) > 1 or nothing in owed or not all(tables.alone[u] for u in feeding):
                    del maybe[i]
                    progress = True
                elif owed and maybe[i] != (sums := owed.pop()):
                    maybe[i] = sums
                    progress = True
        carry = {i: owed for i, owed in maybe.items() if owed is not None}
        for i in carry.keys() | last.carry.keys():
            if carry.get(i) != last.carry.get(i):
                uses.update(tables.uses_of_op[i])
        last.carry = carry
        for u in range(len(tables.uses)) if full else sorted(uses):
            source, out, k, consumers, _ = tables.uses[u]
            if source < 0:
                have, pending = lay[k], nothing
            else:
                have, pending = runs[source].results[out], carry.get(source, runs[source].pending)
            keep = tables.alone[u] and consumers[0][0] in carry  # (carried on by its one reader)
            wants = {lay[k] if c < 0 else runs[c].operands[i] for c, i in consumers}
            last.moves[u] = [move for want in wants for move in self._reshard(k, have, pending, want, keep)]
        for h, (i, _) in enumerate(tables.halos):
            if full or i in rerun:
                last.sends[h] = self._halo_sends(i, runs[i])
        self._last = last
        return last

    def _tables(self) -> _Tables:
        if self._indexed is None:
            self._indexed = _Tables(self)
        return self._indexed

    def _layout(self, use: dict[str, tuple[int, ...]], dims: tuple[tuple[str, int], ...]) -> TensorLayout:
        """A tensor's layout by the rules `use` alone (`_carried` adds what propagation carries)."""
        return self._layout_of(tuple(use.get(n, ()) for n, _ in dims))

    def _layout_of(self, axes: tuple[tuple[int, ...], ...]) -> TensorLayout:
        """The one TensorLayout of these per-dim mesh axes (`_intern`)."""
        if axes not in self._interned:
            self._interned[axes] = TensorLayout(axes)
        return self._interned[axes]

    def _carried(self, ruled: list, by_dim: dict, by_weight_dim: dict, weight_shaped: frozenset) -> list:
        """The layouts `ruled` with the splits propagation carries to dims their own rules leave
        open (the weight rules for a weight-shaped tensor, the layout rules for the rest). Such a
        dim takes the split of the dim it shares a factor with in a tensor it meets in an op, as
        far as it leaves the mesh dims free. First through renames (a reshape that keeps its dims
        in place) from the dims their rules split: the queries' length takes the split of the
        keys' memory_length, an MoE layer's batch that of batch_unsplit, as propagation carries a
        split through an identity before any einsum carries one. Then, with weight rules, from
        the tensors of the other kind: a weight's d_ff split reaches the hidden activations, and
        the queries' heads split by the weight rules reaches the attention logits only where the
        queries left it room. Last, the renamed splits go on from where they reached, as far as
        the splits before left room: only where data flows from the rename, as propagation
        carries them (the attention logits of an MoE model take no batch split from its
        batch_unsplit where the queries' d_kv holds the mesh dim)."""
        tables = self._tables()
        plain = by_weight_dim is by_dim  # (one set of rules: a dim is named alike in every tensor)
        own = [by_dim] * len(ruled)
        if not plain:
            own = [by_weight_dim if s in weight_shaped else by_dim for _, s in tables.names]
        carried: dict[int, list] = {}  # (the shapes a split was renamed or carried to: their dims' splits)
        renamed = self._spread(tables.renames, range(len(tables.renames)), ruled, own, carried, carried)
        if not plain:  # (with one set of rules a dim no rule names meets none a rule names but in a rename)
            self._spread(tables.slots, range(len(tables.slots)), ruled, own, carried, {})
        # (only a slot that meets a renamed split may take something new)
        due = {s for d in renamed for s in tables.meeting.get(d, ())}
        self._spread(tables.slots, due, ruled, own, carried, carried)
        return [self._layout_of(tuple(carried[k])) if k in carried else layout for k, layout in enumerate(ruled)]

    def _spread(self, slots: list, due, ruled: list, own: list, carried: dict, passing: dict) -> list[tuple[int, int]]:
        """Carries splits (`_carried`) to the open dims of `slots` from the dims they meet, to a
        fixed point: of the splits carried before, those in `passing` pass on (and those carried
        now). As passes over the slots in order would, but a slot is visited again only once a
        dim it meets took a split (one that took nothing takes nothing while its meets stay as
        they are: the mesh dims its tensor leaves free only shrink), in this pass where it comes
        later, else in the next; at first only those `due`. The splits taken go into `carried`;
        returns the dims that took them."""
        tables, took = self._tables(), []
        meeting = tables.meeting if slots is tables.slots else tables.renamed
        due = set(due)
        while due:
            heap, queued, due = sorted(due), set(due), set()  # (a sorted list is a heap)
            while heap:
                s = heapq.heappop(heap)
                k, i, n, size, meets = slots[s]
                row = carried[k] if k in carried else ruled[k].axes
                if row[i] or n in own[k]:
                    continue
                want, source = max(
                    (((passing[j] if j in passing else ruled[j].axes)[p], tables.names[j][0][p][1]) for j, p in meets),
                    key=lambda w: len(w[0]),
                )  # (a split that does not divide passes to a dim of its size: propagation's `_refine`)
                take = longest_split(want, size, {m for a in row for m in a}, self.mesh_shape, padded=source == size)
                if take:
                    carried.setdefault(k, list(row))[i] = take
                    passing.setdefault(k, list(ruled[k].axes))[i] = take
                    took.append((k, i))
                    for t in meeting.get((k, i), ()):
                        if t <= s:
                            due.add(t)
                        elif t not in queued:
                            queued.add(t)
                            heapq.heappush(heap, t)
        return took

    def _intern(self, layout: TensorLayout) -> TensorLayout:
        """One object per layout (the memos below hash and compare layouts millions of times)."""
        return self._interned.setdefault(layout.axes, layout)

    def _choose(self, i: int, operands: tuple, results: tuple) -> tuple:
        """How the i-th op signature runs with these operand and result layouts, and how many ways
        its work is split (rule sets share most layouts: each is chosen once)."""
        memo = self._runs[i]
        if (operands, results) not in memo:
            op = self._tables().reps[i]
            run = choose(op, list(operands), list(results), self.mesh_shape)
            sizes = {d.name: d.size for t in [*op.inputs, *op.outputs] for d in t.shape}
            counted = op.flops_factors() if hasattr(op, "flops_factors") else run.assign  # (most: all)
            splits = math.prod(self._split(sizes.get(f), a) for f, a in run.assign.items() if f in counted)
            owed = getattr(op, "owed", None)  # (an op whose lowering owes more sums than its rule says)
            run = run._replace(
                operands=list(map(self._intern, run.operands)),
                results=list(map(self._intern, run.results)),
                pending=frozenset(owed(run)) if owed else run.pending,
            )
            memo[operands, results] = run, splits
        return memo[operands, results]

    def _split(self, size: int | None, axes: tuple[int, ...]) -> float:
        """How many ways a dim of `size` split over `axes` divides the work: fewer than the
        devices where the split does not divide (each device's slice is padded)."""
        if size is None:
            return split_factor(axes, self.mesh_shape)
        return size / block_sizes(size, axes, self.mesh_shape)[-1]

    def _reshard(self, k: int, have: TensorLayout, pending, want: TensorLayout, keep: bool = False) -> list:
        memo = (k, have, pending, want, keep)
        if memo not in self._moves:
            key = self._tables().keys[k]
            shape = self._shapes[key]
            meter = _Meter(self.mesh_shape, np.dtype(key[1]).itemsize)
            local = [block_sizes(d.size, a, self.mesh_shape)[-1] for d, a in zip(shape, have.axes)]
            reshard(meter, LaidOutTensor(local, have, pending), want, shape, keep_partial=keep)
            self._moves[memo] = meter.moves
        return self._moves[memo]

    def _halo_sends(self, i: int, run) -> list[tuple[int, int]]:
        memo = (i, tuple(run.operands), tuple(run.results))
        if memo not in self._sends:
            op: Any = self._tables().reps[i]  # (an op with `halo_sends`)
            self._sends[memo] = op.halo_sends([*run.operands, *run.results], self.mesh_shape)
        return self._sends[memo]

    def _bytes(self, k: int, layout: TensorLayout) -> int:
        """Bytes per device of the k-th tensor shape laid out so."""
        if (k, layout) not in self._sizes:
            key = self._tables().keys[k]
            local = slice_shape(self._shapes[key], layout, self.mesh_shape)
            self._sizes[k, layout] = math.prod(local) * np.dtype(key[1]).itemsize
        return self._sizes[k, layout]


class _State:
    """What `Estimator._state` keeps of the last rule set: by tensor shape its layout, by op
    signature its run and FLOPs, by tensor use the moves it needs, by halo op its permutes."""

    def __init__(self, weight_shaped: frozenset, shapes: int, ops: int, uses: int, halos: int):
        self.weight_shaped = weight_shaped
        self.by_dim: dict = {}
        self.by_weight_dim: dict = {}
        self.lay: list = [None] * shapes
        self.ruled: list = [None] * shapes  # (by their own rules, before `Estimator._carried`)
        self.runs: list = [None] * ops
        self.flops: list[float] = [0.0] * ops
        self.moves: list[list] = [[] for _ in range(uses)]
        self.sends: list[list] = [[] for _ in range(halos)]
        self.carry: dict[int, frozenset] = {}  # linear op signature -> the sums it carries on


def _changed(before: dict, after: dict) -> set:
    """The keys whose values differ (a key missing from one side counts as differing)."""
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


class _Tables:
    """An Estimator's signatures, tensor uses and memory by index, for its inner loop: tensor
    shapes (dim names and sizes, dtype) are numbered, and op signatures too."""

    def __init__(self, e: Estimator):
        self.keys = list(dict.fromkeys([*e._shapes, *(k for sig in e._flops for k in (*sig[2], *sig[3]))]))
        number = {key: k for k, key in enumerate(self.keys)}
        self.names = [(key[0], frozenset(n for n, _ in key[0])) for key in self.keys]  # (dims, their names)
        sigs = list(e._flops)
        self.reps = [e._reps[sig] for sig in sigs]
        ordinal = {sig: i for i, sig in enumerate(sigs)}
        self.ops = [
            (family(sig[0]), f, [number[k] for k in sig[2]], [number[k] for k in sig[3]]) for sig, f in e._flops.items()
        ]
        self.uses = [
            (
                -1 if source[0] == "input" else ordinal[source[0]],
                -1 if source[0] == "input" else source[1],
                number[key],
                [(-1, -1) if c[0] == "output" else (ordinal[c[0]], c[1]) for c in consumers],
                count,
            )
            for (source, key, consumers, _), count in e._uses.items()
        ]
        self.alone = [alone for *_, alone in e._uses]  # (each use: whether one op alone reads it)
        self.memory = {part: [(number[k], n) for k, n in groups.items()] for part, groups in e._memory.items()}
        self.recomputed = [[(number[k], n) for k, n in group] for group in e._recomputed]
        self.weight_reads = [
            (number[key], [(ordinal[sig], i) for sig, i in readers], n) for (key, readers), n in e._weight_reads.items()
        ]
        # ops that exchange halos themselves (`halo_sends`: a pipeline's shifts, convolutions, pooling)
        self.halos = [
            (i, e._runs_of[sig]) for i, (sig, op) in enumerate(zip(sigs, self.reps)) if hasattr(op, "halo_sends")
        ]
        # each dim of each shape (k, its index, its name and size) with the dims it shares a factor
        # with in an op (`Estimator._carried`; a factor kept whole carries nothing), and those of
        # them renamed (another name: a rename's other side)
        meets: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
        for sig, (_, _, operands, results) in zip(sigs, self.ops):
            rule = sig[1]
            where: dict[str, set[tuple[int, int]]] = defaultdict(set)
            for k, factors in zip([*operands, *results], [*rule.operands, *rule.results]):
                for i, f in enumerate(factors):
                    if f is not None and f not in rule.whole:
                        where[f].add((k, i))
            for dims in where.values():
                for k, i in dims:
                    meets[k, i].update((j, p) for j, p in dims if j != k)
        for a, b, whole in e._links:  # (by name: one value on both sides of a loop's boundary)
            ka, kb = number[a], number[b]
            inside = {n: p for p, (n, _) in enumerate(self.names[kb][0])}
            for i, (n, _) in enumerate(self.names[ka][0]):
                if n in inside and n != whole and ka != kb:
                    meets[ka, i].add((kb, inside[n]))
                    meets[kb, inside[n]].add((ka, i))
        self.slots = [(k, i, *self.names[k][0][i], sorted(js)) for (k, i), js in sorted(meets.items()) if js]
        self.renames = [
            (k, i, n, size, renamed)
            for k, i, n, size, js in self.slots
            if (renamed := [(j, p) for j, p in js if self.names[j][0][p][0] != n])
        ]
        # each dim (k, its index) -> the slots (and renames) that meet it, by index (`_spread`)
        self.meeting: dict[tuple[int, int], list[int]] = defaultdict(list)
        self.renamed: dict[tuple[int, int], list[int]] = defaultdict(list)
        for found, slots in ((self.meeting, self.slots), (self.renamed, self.renames)):
            for s, (*_, js) in enumerate(slots):
                for d in js:
                    found[d].append(s)
        # what depends on what, for `Estimator._state`: a shape's layout by its own rules on its
        # dims' rules; an op's run on its tensors' layouts; a use's moves on its tensor's layout
        # and on the runs of its producer and consumers (`_carried` works every carried split out
        # again)
        self.deps = [names for _, names in self.names]
        self.ops_of: list[list[int]] = [[] for _ in self.keys]
        for i, (_, _, operands, results) in enumerate(self.ops):
            for k in dict.fromkeys([*operands, *results]):
                self.ops_of[k].append(i)
        self.uses_of_shape: list[list[int]] = [[] for _ in self.keys]
        self.uses_of_op: list[list[int]] = [[] for _ in self.ops]
        feeding: list[list[int]] = [[] for _ in self.ops]
        for u, (source, _, k, consumers, _) in enumerate(self.uses):
            self.uses_of_shape[k].append(u)
            for i in dict.fromkeys([source, *(c for c, _ in consumers)]):
                if i >= 0:
                    self.uses_of_op[i].append(u)
            for c in dict.fromkeys(c for c, _ in consumers):
                if c >= 0:
                    feeding[c].append(u)
        # linear ops (adds, negations: they may carry sums owed) and the uses that feed each
        self.linear = [(i, feeding[i]) for i, rep in enumerate(self.reps) if getattr(rep, "linear", False)]


def _bodies(
    op: Operation, read: set | None = None
) -> tuple[int, list[tuple[list[Operation], list[Tensor], int]]] | None:
    """A loop's or recomputed layer's inputs bound to its body's variables (how many: the rest its
    body reads as they are), and its bodies: (ops, the tensors read from them at the end, how many
    times they run each time it does). A scan's body runs once per iteration, a recomputed layer's
    (`recompute_grad`) once, a while loop's cond and body once and each branch of a cond once
    (as the exact trace counts them). Where `read` (what the op's scope reads) is given, a
    recomputed layer's body is only what computes the results read, as its lowering runs it.
    None for any other op."""
    if isinstance(op, ScanOperation):
        return len(op.init) + len(op.xs), [(op.body, [*op.carry_results, *op.y_results], op.dim.size)]
    if isinstance(op, WhileOperation):
        return len(op.init), [(op.cond_ops, [op.cond_result], 1), (op.body_ops, op.results, 1)]
    if isinstance(op, RecomputeOperation):
        if read is None:
            return len(op.bound), [(op.body, op.results, 1)]
        needed = [r for r, t in zip(op.results, op.outputs) if t in read]
        return len(op.bound), [(_needed(op.body, needed), needed, 1)]
    if isinstance(op, CondOperation):
        return 1 + len(op.operands), [(ops, results, 1) for _, results, ops in op.branches]
    return None


def _scopes(ops: list[Operation], outputs: list[Tensor]) -> list[tuple[list[Operation], list[Tensor], int]]:
    """(ops, the tensors read from them at the end, how many times they run) of the program and
    of every body run inside it (`_bodies`), recursively."""
    scopes = [(ops, outputs, 1)]
    for body, wanted, times in scopes:  # (the list grows as bodies are found)
        read = {t for op in body for t in op.inputs} | set(wanted)
        for op in body:
            inner = _bodies(op, read)
            scopes += [(b, results, times * n) for b, results, n in (inner[1] if inner else [])]
    return scopes
