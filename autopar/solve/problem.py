"""The planning problem: every graph node with its strategy menu and costs, every edge with
its resharding costs, identical layers folded into one set of choices.

Built once per (graph, mesh) from the graph walk (graph.py), the layer sharing
(layers.py) and the menus (menus.py); solved for the best plan and for the hand-written
layouts (the same problem with menus restricted; reduce.py folds it for the ILP).
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost import kernels as K
from autopar.cost import prices as C
from autopar import placements as P
from autopar.cost.layout_prices import LayoutPrices, menu
from autopar.mesh import Mesh
from autopar.cost.redistribution import plan_redistribute
from autopar.ops import Strategy, op_arg
from autopar.ops.attention_rule import ATTENTION_OPS
from autopar.ops.attention_rule import private_holdings
from autopar.ops.experts_rule import kept_tokens_factor
from autopar.ops.grid_rule import is_grid, is_split_norm
from autopar.ops.rules import ELEMENTWISE
from autopar.trace.export import Traced
from autopar.ops.rules import VIEWS
from autopar.solve.graph import Choice, EdgeKey, PNode, add_gradient_sums, build_nodes
from autopar.solve.layers import share_layers
from autopar.solve.partitioned import partitioned_holdings
from autopar.solve.menus import build_menus, zero_layout
from autopar.cost.saved import SCALAR, Saved, is_alias, saved_by

# ops Inductor fuses with their fusible neighbours into one kernel: pointwise ops, and the
# reductions of norms and softmax, which take pointwise prologues and epilogues
FUSIBLE = ELEMENTWISE | {"aten.layer_norm", "aten.rms_norm", "aten.softmax", "aten._softmax", "aten.log_softmax",
                         "aten._log_softmax"}

UNUSABLE = float("inf")  # a choice pair the runtime cannot run as planned: the ILP never picks it


class Pricing(NamedTuple):
    """What a problem is priced for beyond the model and mesh: moe_imbalance, the busiest
    expert rank's load over the mean (a number, or {ways: factor} measured; None: uniformly
    random routing, C.routing_imbalance), the backend the plan runs under ("inductor":
    chains of memory-bound ops priced as fused, see Problem._fusion), and the micro-steps
    that accumulate gradients for each optimizer step (`cm.no_sync()` around all but the
    last): what runs once per step, the optimizer step, ZeRO-1/2's gathers after it and
    the bucketed gradient reductions (grad_sync's all-reduces and ZeRO-2 reduce-scatters),
    is priced at 1/accumulation of its seconds per micro-step, and a ZeRO-2 parameter keeps
    its whole local gradient between micro-steps (Problem.once).  tp_overlap: whether the
    runtime runs tensor-parallel collectives beside their GEMMs (runtime/linear_grads.py;
    False: priced whole, as a runtime without that overlap runs them)."""

    moe_imbalance: float | dict | None = None
    backend: str = "eager"
    accumulation: int = 1
    tp_overlap: bool = True


class Problem:
    def __init__(self, traced: Traced, mesh: Mesh, precision=None, grouped_gathers: bool = True,
                 pricing: Pricing | None = None):
        """precision: an autopar.MixedPrecision (the graph is then traced from the model cast
        to its param_dtype, see autopar.cost.precision.cast_for_trace), or None.  grouped_gathers:
        whether the runtime gathers ZeRO-3 weights in buckets (`grouped_pair`): it does for
        a whole model, not (yet) inside pipeline stages.  pricing: see Pricing."""
        self.traced = traced
        self.mesh = mesh
        self.precision = precision
        pricing = pricing or Pricing()
        self.moe_imbalance, self.backend = pricing.moe_imbalance, pricing.backend
        self.pipelined = False   # a pipeline stage's problem (pipeline_costs.stage_problem)
        self.accumulation = pricing.accumulation
        # TP collectives beside their GEMMs: where the plan asks for them and the device overlaps
        self.tp_overlap = pricing.tp_overlap
        self.folds_tp = pricing.tp_overlap and mesh.device.asynchronous
        self.once = 1.0 / pricing.accumulation   # a once-per-step cost's share of one micro-step
        self._gather_copies: dict = {}   # (ZeRO layout code, layout code) -> _step_copies' bytes per byte
        self.grouped_gathers = grouped_gathers
        self.prices = LayoutPrices(mesh)   # each pair of layouts priced once for every edge
        self.nodes, self.by_fx = build_nodes(traced)
        self.readers, self.gradsum_of = add_gradient_sums(self.nodes)
        shared = share_layers(self.nodes, self.readers, self.gradsum_of)
        self.layer_groups, self.tie, self.block = shared.layer_groups, shared.tie, shared.block
        self.fallback_ops, self.warnings = build_menus(self.nodes, self.readers, mesh)
        self.fusion = self._fusion()
        self._find_saved()
        self._build_costs()

    # --- what the backend fuses ------------------------------------------------------------------
    def _fusion(self) -> dict:
        """Under backend "inductor": op index -> (operands its fused chain produced, whether its
        output stays inside the chain, whether it heads the chain).  Inductor runs a chain of
        FUSIBLE ops (linked directly or through views) as one kernel: it reads the chain's
        inputs once, writes only what leaves the chain (to any other op or the graph's
        output), and launches once, for its head; its backward likewise.  Under "eager" every
        op reads, writes and launches on its own (empty)."""
        if self.backend != "inductor":
            return {}
        nodes = self.nodes

        def fusible(pn) -> bool:
            return pn.kind == "op" and pn.op in FUSIBLE

        def producer(src: int):
            pn = nodes[src]
            while pn.kind == "op" and pn.op in VIEWS and pn.inputs:
                pn = nodes[pn.inputs[0][0]]
            return pn

        def leaves(index: int, out: int) -> bool:
            for reader, _ in self.readers.get((index, out), ()):
                r = nodes[reader]
                if r.kind == "op" and r.op in VIEWS:
                    if any(leaves(reader, o) for o in range(len(r.out_shapes))):
                        return True
                elif not fusible(r):
                    return True
            return False

        chains = {}
        for pn in nodes:
            if fusible(pn):
                fused_in = frozenset(k for k, (src, _) in enumerate(pn.inputs) if fusible(producer(src)))
                kept = not any(leaves(pn.index, o) for o in range(len(pn.out_shapes)))
                chains[pn.index] = (fused_in, kept, not fused_in)
        return chains

    def launches(self, pn: PNode) -> bool:
        """Whether op pn launches a kernel the host issues: always under eager; under inductor
        a view is compiled away and a fused op rides its chain head's kernel."""
        if self.backend == "eager":
            return True
        return pn.op not in VIEWS and self.fusion.get(pn.index, ((), False, True))[2]

    # --- what ops keep for backward -------------------------------------------------------------
    def _find_saved(self):
        """holdings[n]: (key, kind, index, global bytes) of every tensor op n keeps for
        backward (problem/saved.py); key names the storage (None: its own), and savers[key]
        counts its holders, so a storage several ops keep is charged once."""
        gpu = not self.mesh.device.name.lower().startswith("cpu")
        self.holdings: dict[int, list] = {}
        self.derived: dict = {}      # see remembered (the overlapped copies share it)
        self.savers: dict = {}
        for pn in self.nodes:
            if pn.kind != "op" or not pn.requires_grad or pn.op in VIEWS:
                continue
            items = saved_by(pn.node, [self.nodes[src].requires_grad for src, _ in pn.inputs], gpu)
            if items is None:  # cannot run on meta: its activation operands, as read
                items = [Saved("in", k) for k in range(len(pn.inputs))]
            held = []
            for it in items:
                if it.kind == "in":
                    if it.index >= len(pn.inputs):
                        continue
                    key = self.storage_root(*pn.inputs[it.index])
                    if self.nodes[key[0]].kind != "op":
                        # a parameter, buffer or input: not an activation, unless the plan
                        # reads it through a move whose copy is then kept (kept_bytes)
                        held.append((None, "leaf", it.index, 0.0))
                        continue
                    root = self.nodes[key[0]]
                    held.append((key, "in", it.index, math.prod(root.out_shapes[key[1]]) *
                                 root.out_dtypes[key[1]].itemsize))
                elif it.kind == "out":
                    if it.index >= len(pn.out_shapes):
                        continue
                    held.append(((pn.index, it.index), "out", it.index,
                                 math.prod(pn.out_shapes[it.index]) * pn.out_dtypes[it.index].itemsize))
                else:
                    held.append((None, "new", it.index, it.nbytes))
            if pn.op == "aten.cross_entropy_loss" and op_arg(pn.node, 3, "reduction", 1) == 1:
                # split by rows or classes, the runtime's mean divides by the count of the
                # targets it counts (passes/local_ops.local_cross_entropy), which it keeps
                held.append((None, "count", 0, 8.0))
            self.holdings[pn.index] = held
        # what a step keeps when nothing is recomputed: what the derivatives read under eager;
        # under Inductor, less what the compiled graphs' partitioner runs again (partitioned.py)
        self.kept_holdings = partitioned_holdings(self) if self.backend == "inductor" else self.holdings
        for held in self.kept_holdings.values():
            for key, *_ in held:
                if key is not None:
                    self.savers[key] = self.savers.get(key, 0) + 1

    def storage_root(self, src: int, out: int) -> tuple:
        """(node, output) whose storage tensor src[out] lives in: views followed back."""
        while True:
            pn = self.nodes[src]
            if pn.kind != "op" or not pn.inputs or not is_alias(pn.node):
                return src, out
            src, out = pn.inputs[0]

    def held_bytes(self, pn: PNode, s: Strategy, item) -> float:
        """Local bytes of one holding of op pn under strategy s (its whole storage's share
        in the layout pn reads or makes it)."""
        mesh = self.mesh
        _, kind, index, nbytes = item
        if kind == "leaf":
            return 0.0
        if kind.startswith("own "):   # kept by an op run whole when it communicates inside
            if not s.comm:            # (recompute.ModeCosts, selective)
                return 0.0
            kind = kind[4:]
        if kind == "in":
            src, o = pn.inputs[index]
            shape = self.nodes[src].out_shapes[o]
            local = nbytes * P.local_numel(shape, s.inputs[index], mesh.shape) / max(1, math.prod(shape))
            if pn.op == "autopar.experts" and index == 0:   # (x: the routed rows under expert parallelism)
                return local * kept_tokens_factor(s, self.nodes[pn.inputs[1][0]].out_shapes[pn.inputs[1][1]][-1])
            return local
        if kind == "count":   # (a local cross entropy's count, _find_saved)
            split = any(not isinstance(p, Replicate) for lay in (*s.inputs, *s.outputs) for p in lay)
            return nbytes if split else 0.0
        if kind == "new" and index == SCALAR:
            return nbytes
        if kind in ("out", "result"):   # (result: the op's output as it returns it)
            shape = pn.out_shapes[index]
            return nbytes * P.local_numel(shape, s.outputs[index], mesh.shape) / max(1, math.prod(shape))
        # a new tensor: split as the op's largest operand is
        shapes = [(self.nodes[src].out_shapes[o], p) for (src, o), p in zip(pn.inputs, s.inputs)]
        shapes += list(zip(pn.out_shapes, s.outputs))
        shape, p = max(shapes, key=lambda sp: math.prod(sp[0]) if sp[0] else 1)
        return nbytes * P.local_numel(shape, p, mesh.shape) / max(1, math.prod(shape) if shape else 1)

    def remembered(self, kind: str, key, make):
        """make(), computed once per problem and (kind, key): what planning derives from a
        problem and asks for again (a recompute assignment's costs, an edge's collectives)."""
        table = self.derived.setdefault(kind, {})
        if key not in table:
            table[key] = make()
        return table[key]

    def held_array(self, pn: PNode, item) -> np.ndarray:
        """held_bytes of one holding under each of pn's representative's strategies, kept
        per (representative, holding's kind, index and bytes): identical layers hold alike."""
        return self.remembered("held", (pn.rep, *item[1:]), lambda: np.array(
            [self.held_bytes(pn, s, item) for s in self.nodes[pn.rep].strategies]))

    def step_memory(self, choice: dict) -> float:
        """The optimizer step's temporaries under a solved choice (cost.prices.step_temporary_total)."""
        return C.step_temporary_total((self.choices[pn.rep][choice[pn.index]].step_memory for pn in self.nodes
                                       if pn.kind == "param"), self.precision is not None,
                                      self._foreach_step)

    @property
    def _foreach_step(self) -> bool:
        """Whether the optimizer step runs torch's multi-tensor kernels, whose temporaries
        span the parameters stepped together: on a GPU, unless the backend "inductor" runs
        the fused kernel (runtime/optimizer.fused_options)."""
        return self.mesh.device.asynchronous and self.backend != "inductor"

    def saved_entries(self) -> list:
        """(node index, holding) of everything the ops keep when nothing is recomputed."""
        return [(n, item) for n, held in self.kept_holdings.items() for item in held]

    def kept_bytes(self, choice: dict, entries) -> float:
        """The activation bytes per device a solved choice keeps, storage by storage as the
        plan lays them out (the ILP's per-node shares are its linear estimate): a tensor
        read in its producer's layout is the producer's storage (aliases followed), read
        through a move it is the move's new tensor of the reader's local size (a slice of
        the leading dim alone stays a view of its source; a slice of a collective's buffer
        is copied out by the runtime), and a storage several ops keep counts once."""
        storages: dict = {}
        total = 0.0
        for n, item in entries:
            pn = self.nodes[n]
            s = self.nodes[pn.rep].strategies[choice[n]]
            key, kind, index, _ = item
            if kind.startswith("own ") and not s.comm:
                continue
            base = kind.removeprefix("own ")
            if s.comm and base in ("in", "out") and self._private(pn, s, base, index):
                # an op that communicates inside (Ulysses, the causal ring, expert all-to-alls)
                # keeps what its inner kernel read and made: buffers of its own
                storages[("own", n, base, index)] = self.held_bytes(pn, s, item)
                continue
            if base == "out":
                key = (n, index)
            kind = base
            if kind in ("in", "leaf"):
                src, o = pn.inputs[index]
                found = self._storage_as_read(src, o, tuple(s.inputs[index]), choice, (n, index))
                if found is not None:
                    storages[found[0]] = found[1]
            elif key is None:
                total += self.held_bytes(pn, s, item)
            else:
                storages[key] = self.held_bytes(pn, s, item)
        return total + sum(storages.values())

    def _private(self, pn: PNode, s: Strategy, kind: str, index: int) -> bool:
        """Whether op pn, communicating inside under s, keeps ("in"/"out", index) in a
        buffer of its own (ops/attention_rule.private_holdings)."""
        if is_grid(s) or is_split_norm(s):
            return False   # (they keep their operands' local blocks, as given)
        causal = pn.op == "autopar.window_attention" or bool(op_arg(pn.node, 5, "is_causal", False))
        own = private_holdings(s, causal)
        return own is None or (kind, index) in own

    def _storage_as_read(self, src: int, out: int, layout: tuple, choice: dict, reader: tuple):
        """(storage key, local bytes) of tensor src[out] as a reader gets it in `layout`;
        None for a parameter, buffer or input's own storage."""
        a = self.nodes[src]
        if a.kind not in ("op", "param", "input"):
            return None
        made = tuple(self.nodes[a.rep].strategies[choice[src]].outputs[out])
        shape, item = a.out_shapes[out], a.out_dtypes[out].itemsize
        steps = plan_redistribute(made, layout, self.mesh.shape) if made != layout else ()
        if any(st.kind != "chunk" or st.dim != 0 for st in steps):   # (a slice of dim 0 is a view)
            moves = [st for st in steps if st.is_collective]
            if a.kind == "param" and moves and all(st.kind == "all_gather" for st in moves):
                return None   # a gathered weight is dropped after forward and gathered again
            return ("moved", src, out, layout), P.local_numel(shape, layout, self.mesh.shape) * item
        if a.kind != "op":
            return None
        if a.inputs and is_alias(a.node):
            up, o = a.inputs[0]
            sa = self.nodes[a.rep].strategies[choice[src]]
            return self._storage_as_read(up, o, tuple(sa.inputs[0]), choice, (src, 0))
        return (src, out), P.local_numel(shape, made, self.mesh.shape) * item

    # --- costs ------------------------------------------------------------------------------
    def _build_costs(self):
        self.choices: dict[int, list[Choice]] = {}
        for pn in self.nodes:
            if pn.rep != pn.index:
                continue
            work = (C.measure_flops(pn.node, [self.nodes[src].requires_grad for src, _ in pn.inputs])
                    if pn.kind == "op" else C.OpWork(0.0, 0.0))
            self.choices[pn.index] = [self._choice(pn, s, work) for s in pn.strategies]
        self.edges: list[EdgeKey] = []   # every concrete edge
        for pn in self.nodes:
            for k, (src, out) in enumerate(pn.inputs):
                self.edges.append(EdgeKey("data", src, pn.index, out, k))
                gs = self.gradsum_of.get((src, out))
                if gs is not None:
                    self.edges.append(EdgeKey("grad_in", pn.index, gs, out, k))
        for (src, out), gs in self.gradsum_of.items():
            self.edges.append(EdgeKey("grad_out", gs, src, out, 0))
        self.edge_classes: dict[EdgeKey, int] = {}
        for e in self.edges:
            key = self.rep_edge(e)
            self.edge_classes[key] = self.edge_classes.get(key, 0) + 1
        self.counts: dict[int, int] = {}
        for pn in self.nodes:
            self.counts[pn.rep] = self.counts.get(pn.rep, 0) + 1
        self.edge_forward: dict[EdgeKey, np.ndarray] = {}   # data edges: the forward moves alone
        self.edge_bucketed: dict[EdgeKey, np.ndarray] = {}  # parameter gradients: their bucketed reductions
        self.edge_gathers: dict[EdgeKey, np.ndarray] = {}   # weights read: their forward all-gathers
        self.edge_linear_slack: dict[EdgeKey, np.ndarray] = {}   # more that linears' weight gradients may hide
        self.edge_copies: dict[EdgeKey, np.ndarray] = {}   # bucketed moves: their flat buffers' copies (_copies)
        self.edge_copies_once: dict[EdgeKey, np.ndarray] = {}   # those of them run once per step (gradient buckets)
        self.edge_costs = {key: self._edge_matrix(key) for key in self.edge_classes}

    def overlapped(self, hidden: float, prefetched: float = 0.0, linear_most: bool = False) -> "Problem":
        """This problem with each parameter gradient's bucketed reduction priced at
        (1 - hidden) of its seconds and each weight's forward gathers at (1 - prefetched):
        a linear stand-in for the overlap of gradient buckets with backward
        (solution.hidden_gradient_seconds) and of prefetched gathers with forward
        (solution.hidden_prefetch_seconds), the shares being what a plan hides.
        linear_most: a tensor several linears read has its input gradient's collective
        priced as hidden by the most their weight gradients could (for a bound).  The copy
        shares everything but its edge costs."""
        out = copy.copy(self)
        out.edge_costs = {k: m - hidden * self.edge_bucketed.get(k, 0.0) - prefetched * self.edge_gathers.get(k, 0.0)
                          - (self.edge_linear_slack.get(k, 0.0) if linear_most else 0.0)
                          for k, m in self.edge_costs.items()}
        return out

    def rep_edge(self, e: EdgeKey) -> EdgeKey:
        return e._replace(a=self.nodes[e.a].rep, b=self.nodes[e.b].rep)

    def _choice(self, pn: PNode, s: Strategy, work: C.OpWork) -> Choice:
        mesh = self.mesh
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        comm = [0.0] * mesh.ndim
        if pn.kind == "param":
            return self._param_choice(pn, s)
        if pn.kind != "op":
            return Choice(0.0, tuple(comm), mem)
        read = [P.local_numel(self.nodes[src].out_shapes[o], p, mesh.shape) * self.nodes[src].out_dtypes[o].itemsize
                for (src, o), p in zip(pn.inputs, s.inputs)]
        in_bytes = sum(read)
        out_bytes = sum(P.local_numel(shape, p, mesh.shape) * d.itemsize
                        for shape, d, p in zip(pn.out_shapes, pn.out_dtypes, s.outputs))
        dtype = pn.out_dtypes[0] if pn.out_dtypes else torch.float32
        forward = 0.0
        fused_in, kept, _ = self.fusion.get(pn.index, ((), False, True))
        moved = sum(b for k, b in enumerate(read) if k not in fused_in) + (0.0 if kept else out_bytes)
        head = self.launches(pn)
        if pn.op in VIEWS:
            compute = 0.0
        else:
            compute = forward = self._op_seconds(pn, s, work.fwd_flops / s.factor, moved, dtype, launches=head)
            if pn.requires_grad:
                compute += self._op_seconds(pn, s, work.bwd_flops / s.factor, 2 * moved, dtype, backward=True,
                                            launches=head)
        # kept for backward (see _find_saved): a storage several ops keep is stored once, so
        # each holder carries its share
        mem["activations"] = sum(self.held_bytes(pn, s, it) / (self.savers[it[0]] if it[0] is not None else 1)
                                 for it in self.kept_holdings.get(pn.index, ()))
        for kind, axis, nbytes, _ in self.internal_collectives(pn, s):   # a named strategy's own
            comm[axis] += C.collective_time(kind, nbytes, axis, mesh)
        if pn.op == "autopar.experts":  # experts split: the step waits for the busiest rank
            uneven = self.routing_factor(pn, s)
            compute, forward = compute * uneven, forward * uneven
            comm = [t * uneven for t in comm]
        # working memory: while the op runs backward, the gradients of its outputs, of its
        # inputs and of the tensors it makes and keeps (a composite's inner results, such as
        # a cross entropy's log-probabilities) are live beside what was saved; a view
        # allocates nothing; a fused cross-entropy kernel (KernelEfficiency.cross_entropy)
        # writes the logits' gradient alone
        inner = 0.0 if self._fused_loss(pn) else sum(
            self.held_bytes(pn, s, it) for it in self.holdings.get(pn.index, ()) if it[1] == "new")
        work = 0.0 if pn.op in VIEWS else in_bytes + out_bytes + inner
        return Choice(compute, tuple(comm), mem, forward_s=forward + sum(comm) / 2, work=work)

    def _fused_loss(self, pn: PNode) -> bool:
        """Whether `pn` is a cross entropy the device's kernels run fused."""
        kernels = self.mesh.device.kernels
        return pn.op == "aten.cross_entropy_loss" and kernels is not None and kernels.cross_entropy == "fused"

    def internal_collectives(self, pn: PNode, s: Strategy) -> list:
        """(kind, axis, bytes, phase) of each collective a named strategy runs inside the op
        (ring and Ulysses attention, expert parallelism, the vocabulary-parallel loss): its
        per-row entries (kind, axis, elements per row[, phase]) on the rows this rank holds."""
        if not s.comm:
            return []
        first = self.nodes[pn.inputs[0][0]]
        rows_shape = first.out_shapes[pn.inputs[0][1]][:1]
        item = first.out_dtypes[pn.inputs[0][1]].itemsize
        rows = P.local_numel(rows_shape, [p if isinstance(p, Shard) and p.dim == 0 else Replicate()
                                          for p in s.inputs[0]], self.mesh.shape)
        return [(kind, axis, per_row * item * rows, rest[0] if rest else "forward")
                for kind, axis, per_row, *rest in s.comm]

    def _op_seconds(self, pn: PNode, s: Strategy, flops: float, nbytes: float, dtype, backward: bool = False,
                    launches: bool = True) -> float:
        """Seconds of one op's forward (or backward: two kernels) under strategy s: by its
        kernel's shape on a device that describes its kernels (cost.kernels), else a
        roofline.  launches: False for an op fused into its chain's kernel (no launch)."""
        mesh = self.mesh
        count = (2 if backward else 1) if launches else 0
        if mesh.device.kernels is None:
            seconds = C.roofline(flops, nbytes, dtype, mesh, kernels=count, attention=pn.op in ATTENTION_OPS)
        else:
            shapes = [P.local_shape_ceil(self.nodes[src].out_shapes[o], p, mesh.shape)
                      for (src, o), p in zip(pn.inputs, s.inputs)]
            seconds = K.seconds(K.kernel_of(pn.op, pn.node, shapes), flops, nbytes, dtype, mesh, backward=backward,
                                count=count)
        key = K.pointwise_key(pn.op, pn.node)
        if key == "aten.gelu:tanh" and self.backend == "inductor" and mesh.device.pointwise_seconds("aten.sigmoid"):
            key = "aten.sigmoid"   # (compiled as x * sigmoid(2 z) on CPU: runtime/inductor.with_sigmoid_gelus)
        measured = mesh.device.pointwise_seconds(key) if mesh.device.pointwise else None
        if measured is None:
            return seconds
        # evaluated per element of its first operand (the rank's share), below the bandwidth
        # where the device measured it so (DeviceSpec.pointwise: a CPU's)
        (src, o), placement = pn.inputs[0], s.inputs[0]
        elements = P.local_numel(self.nodes[src].out_shapes[o], placement, mesh.shape)
        return max(seconds, elements * measured[1 if backward else 0] + count * mesh.device.op_latency)

    def routing_factor(self, pn: PNode, s: Strategy) -> float:
        """How much longer than balanced routing a mixture-of-experts op runs under strategy
        s: its busiest expert-holding rank's load over the mean (1 where experts are whole)."""
        ways = math.prod(self.mesh.shape[a] for a, kind in enumerate(s.split) if kind in ("e", "te"))
        if ways <= 1:
            return 1.0
        if isinstance(self.moe_imbalance, dict) and ways in self.moe_imbalance:   # measured
            factor = float(self.moe_imbalance[ways])
        elif self.moe_imbalance is not None and not isinstance(self.moe_imbalance, dict):
            factor = float(self.moe_imbalance)
        else:
            src, o = pn.inputs[1]
            factor = C.routing_imbalance(math.prod(self.nodes[src].out_shapes[o]), ways)
        capacity = float(op_arg(pn.node, 11, "capacity", 0.0) or 0.0) if pn.node is not None else 0.0   # a router that caps every expert caps every rank
        return max(1.0, min(factor, capacity)) if capacity > 0 else factor

    def _param_choice(self, pn: PNode, s: Strategy) -> Choice:
        """Model states of a parameter stored in layout s.outputs[0] (ZeRO, Rajbhandari et al.
        2020): weights `item` bytes per local element, gradients `item`, optimizer states
        C.state_bytes (Adam's two moments, plus float32 master weights under mixed
        precision).  ZeRO-1/2 over axes Z of n ranks: each rank keeps ceil(local / n)
        elements of the optimizer state (and, stage 2, of the gradient), steps only those
        (cost.optimizer_seconds), and after the optimizer step the updated parameter is
        all-gathered over Z.  Offload moves the
        optimizer state to host memory or disk (s.offload) and pays the host link for the
        gradient going down and the weights coming up, the host's optimizer step, and on
        disk the states' reads and writes (C.offload_seconds).  Offloaded weights
        (s.offload_weights) take no device bytes between uses, their gradient none either
        (it accumulates in host memory), and cross the host link at each use."""
        mesh = self.mesh
        comm = [0.0] * mesh.ndim
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        layout = s.outputs[0]
        numel = P.local_numel(pn.out_shapes[0], layout, mesh.shape)
        item = pn.out_dtypes[0].itemsize
        mem["params"] = 0.0 if s.offload_weights else numel * item
        if not pn.requires_grad:
            return Choice(0.0, tuple(comm), mem, numel * item)
        state = C.state_bytes(item, self.precision is not None)
        n = math.prod(mesh.shape[a] for a in s.zero_axes)
        owned = math.ceil(numel / n) if s.zero else numel
        # (accumulating, a ZeRO-2 rank keeps the whole local gradient until the last micro-step)
        mem["grads"] = 0.0 if s.offload_weights else (owned if s.zero == 2 and self.accumulation == 1
                                                      else numel) * item
        mem["optimizer"] = 0.0 if s.offload else owned * state
        compute = C.optimizer_seconds(owned, item, self.precision is not None, mesh,
                                      fused=self.backend == "inductor") if not s.offload else 0.0
        for st in self.zero_gather_steps(pn, s):
            comm[st.axis] += st.seconds
        if s.offload:
            compute = C.offload_seconds(s.offload, owned, item, self.precision is not None, mesh.device,
                                        s.offload_weights)
        compute += self._step_copies(pn, s, 0.0 if s.offload_weights else (owned if s.zero == 2 else numel) * item)
        compute *= self.once
        step = 0.0 if s.offload else owned * C.step_temporary_bytes(item, self.precision is not None,
                                                                    self._foreach_step)
        return Choice(compute, tuple(comm), mem, numel * (2 * item + state), step_memory=step)

    def _step_copies(self, pn: PNode, s: Strategy, grad_bytes: float) -> float:
        """Seconds of a parameter's memory passes around its optimizer step besides the
        step itself: the finite check reading its gradient (runtime/faults.check_step: one
        read of `grad_bytes`, this rank's gradient after synchronisation) and, for ZeRO-1/2,
        the flat buffer's copies of the updated chunks' all-gather (zero.all_gather_chunks,
        prices.bucket_copy_bytes)."""
        nbytes = grad_bytes
        if s.zero:
            layout = s.outputs[0]
            whole = math.prod(pn.out_shapes[0]) * pn.out_dtypes[0].itemsize
            pair = (C.layout_code(zero_layout(layout, s.zero_axes)), C.layout_code(layout))
            if pair not in self._gather_copies:   # (one price per pair of layouts)
                self._gather_copies[pair] = C.redistribute_price(*pair, self.mesh)[C.Row.COPY_GATHER, 0]
            nbytes += self._gather_copies[pair] * whole
        return C.copy_seconds(nbytes, self.mesh)

    def zero_gather_steps(self, pn: PNode, s: Strategy) -> tuple:
        """The all-gathers that spread a ZeRO-1/2 parameter's updated chunks after the step."""
        if not s.zero:
            return ()
        layout = s.outputs[0]
        shape, item = pn.out_shapes[0], pn.out_dtypes[0].itemsize
        steps = self._redistribute(shape, item, zero_layout(layout, s.zero_axes), layout)
        return self._once_per_step(C.bucketed(steps, math.prod(shape) * item, ("all_gather",)))

    def _once_per_step(self, steps: tuple) -> tuple:
        """Bucketed steps that run once per optimizer step, each at its share of a micro-step
        (Pricing.accumulation); the rest as they are."""
        if self.accumulation == 1:
            return steps
        return tuple(replace(st, seconds=st.seconds * self.once) if st.bucketed else st for st in steps)

    def _shared_over_micro_steps(self, seconds: np.ndarray):
        """What an edge table saves of a once-per-step bucket's seconds when accumulating
        (Pricing.accumulation): all but its share of one micro-step; 0 at 1."""
        return 0.0 if self.accumulation == 1 else seconds * (1.0 - self.once)

    def grad_destination(self, pn: PNode, s: Strategy, out: int = 0) -> tuple:
        """The layout the gradient of tensor pn[out] must reach when pn takes strategy s:
        its own layout with Partial made Replicate, and for a ZeRO-2 parameter split over
        the ZeRO axes (reduce-scattered, not all-reduced)."""
        target = tuple(P.grad_target(x) for x in s.outputs[out])
        if pn.kind == "param" and s.zero == 2:
            target = zero_layout(target, s.zero_axes)
        return target

    def _redistribute(self, shape, itemsize, src, dst):
        """C.redistribute, remembered per problem."""
        return self.remembered("redistribution", (shape, itemsize, src, dst),
                               lambda: C.redistribute(shape, itemsize, src, dst, self.mesh))

    def edge_steps(self, e: EdgeKey, i: int, j: int):
        """Forward and backward collectives on edge `e` (between representatives) when its
        ends take choices i (of e.a) and j (of e.b); remembered per problem (assemble asks
        for the same few pairs on every layer, and once per plan it compares)."""
        return self.remembered("edge steps", (e, i, j), lambda: self._edge_steps(e, i, j))

    def _edge_steps(self, e: EdgeKey, i: int, j: int):
        a, b = self.nodes[e.a], self.nodes[e.b]
        if e.kind == "grad_in":   # consumer a's gradient joins the sum b
            g = a.strategies[i].grads[e.operand]
            if g is None:
                return (), ()
            shape, item = b.out_shapes[0], b.out_dtypes[0].itemsize
            return (), self._redistribute(shape, item, tuple(g), b.strategies[j].outputs[0])
        if e.kind == "grad_out":  # the sum a reaches the layout of tensor b[out]
            shape, item = a.out_shapes[0], a.out_dtypes[0].itemsize
            target = self.grad_destination(b, b.strategies[j], e.out)
            steps = self._redistribute(shape, item, a.strategies[i].outputs[0], target)
            if b.kind == "param":
                steps = self._once_per_step(C.bucketed(steps, math.prod(shape) * item, bucket_kinds(b.strategies[j])))
            elif self._cone_deferred(b, e.out, [a.strategies[i].outputs[0]])[j, 0]:
                steps = self._once_per_step(C.bucketed(steps, math.prod(shape) * item, ("all_reduce",)))
            return (), steps
        p = a.strategies[i].outputs[e.out]
        q = b.strategies[j].inputs[e.operand]
        g = b.strategies[j].grads[e.operand]
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        fwd = self._redistribute(shape, item, p, q)
        if b.kind == "output" and math.prod(shape) == 1 and self._loss_summed([p], [q])[0, 0]:
            fwd = C.bucketed(fwd, item, ("all_reduce",))   # the loss, summed with the last bucket
        bwd = ()
        if a.requires_grad and g is not None:
            if (e.a, e.out) not in self._summed:
                bwd = self._redistribute(shape, item, g, self.grad_destination(a, a.strategies[i], e.out))
                if a.kind == "param":
                    bwd = self._once_per_step(C.bucketed(bwd, math.prod(shape) * item, bucket_kinds(a.strategies[i])))
                elif self._cone_deferred(a, e.out, [g])[i, 0]:   # left Partial for the parameters' buckets
                    bwd = self._once_per_step(C.bucketed(bwd, math.prod(shape) * item, ("all_reduce",)))
            if a.kind == "param" and (e.b, 0) in self._cones:
                bwd = bwd + self._cone_split_steps(a, a.strategies[i], b, b.strategies[j])
            if a.kind == "param":  # gathered for use, dropped after forward: gather again for backward
                if self.grouped_pair(a.strategies[i], fwd, bwd):
                    whole = math.prod(shape) * item
                    fwd = C.bucketed(fwd, whole, ("all_gather",))
                    bwd = C.bucketed(bwd, whole, ("reduce_scatter",))
                bwd = bwd + tuple(st for st in fwd if st.kind == "all_gather")
        return fwd, bwd

    def edge_reduction(self, e: EdgeKey, i: int, j: int, backward: bool):
        """The one redistribution step (autopar.cost.redistribution.Step, with its dim) of
        edge e's forward or backward move when that move is exactly one all-reduce or one
        reduce-scatter, as the runtime runs it (autopar/runtime/linear_grads.py folds those
        beside linears' GEMMs), else None; e between representatives, choices i and j."""
        a, b = self.nodes[e.a], self.nodes[e.b]
        if e.kind == "grad_out" and backward:
            layouts = (a.strategies[i].outputs[0], self.grad_destination(b, b.strategies[j], e.out))
        elif e.kind == "data" and not backward:
            layouts = (a.strategies[i].outputs[e.out], b.strategies[j].inputs[e.operand])
        elif e.kind == "data" and (e.a, e.out) not in self._summed and b.strategies[j].grads[e.operand] is not None:
            layouts = (b.strategies[j].grads[e.operand], self.grad_destination(a, a.strategies[i], e.out))
        else:
            return None
        steps = plan_redistribute(tuple(layouts[0]), tuple(layouts[1]), self.mesh.shape)
        return steps[0] if len(steps) == 1 and steps[0].kind in ("all_reduce", "reduce_scatter") else None

    def grouped_pair(self, s: Strategy, fwd: tuple, bwd: tuple) -> bool:
        """Whether a weight stored under s and read through moves fwd (its gradient back
        through bwd) is gathered in buckets (autopar/runtime/reshard.py): plain ZeRO-3, the
        weight sharded on an axis where it is read whole, the move one all-gather and its
        gradient's one reduce-scatter on that axis, nothing else synchronising it.  Its
        gathers, the one again in backward and the reduce-scatter then pay `bucket_share`
        of their calls' fixed cost, and the reduce-scatter runs on the bucket stream."""
        return (self.grouped_gathers and not s.zero and not s.offload and len(fwd) == 1 and len(bwd) == 1
                and fwd[0].kind == "all_gather" and bwd[0].kind == "reduce_scatter" and fwd[0].axis == bwd[0].axis)

    @functools.cached_property
    def _summed(self) -> set:
        """Tensors (by representative) whose gradient goes through a gradient-sum node."""
        return {(self.nodes[src].rep, out) for src, out in self.gradsum_of}

    @functools.cached_property
    def _cones(self) -> set:
        """Tensors (node index, output) computed from parameters and constants alone whose
        gradient the runtime may leave Partial for the parameters' bucketed all-reduce
        (passes/collectives._deferrable_cones: a position embedding looked up by positions
        the graph makes, added to batch-split activations): an op's output that reads no
        user input, every other op of its cone (its ancestors up to parameters and
        constants) read only inside the cone, its parameters read only there too."""
        out = set()
        for x in self.nodes:
            if x.kind != "op" or not x.requires_grad or x.from_input or len(x.out_shapes) != 1:
                continue
            cone, todo, ok = {x.index}, [x.index], True
            while todo and ok:
                for src, _ in self.nodes[todo.pop()].inputs:
                    n = self.nodes[src]
                    if src in cone or (n.kind == "input" and not n.requires_grad):
                        continue
                    if n.kind not in ("op", "param") or n.from_input:
                        ok = False
                        break
                    cone.add(src)
                    if n.kind == "op":
                        todo.append(src)
            params = [c for c in cone if self.nodes[c].kind == "param"]
            if ok and params and all(
                    r in cone for c in cone - {x.index} for k in range(len(self.nodes[c].out_shapes))
                    for r, _ in self.readers.get((c, k), ())) \
                    and all(r == x.index for c in params for r, _ in self.readers.get((c, 0), ())):
                out.add((x.index, 0))
        return out

    def _cone_split_steps(self, param: PNode, s: Strategy, root: PNode, t: Strategy) -> tuple:
        """What a cone root's deferred gradient costs more than its bucketed price where its
        parameter (read by the root alone, Problem._cones) is stored split on some axes: the
        runtime defers only over axes where the weight is whole, so there the gradient is
        all-reduced inside backward, whole (its blocking price less the bucketed one the
        root's edge already counts).  () where nothing is added."""
        if (root.index, 0) not in self._cones or not self._replicated(t):
            return ()
        axes = [a for a, (p, n) in enumerate(zip(s.outputs[0], self.mesh.shape))
                if n > 1 and not isinstance(p, Replicate)]
        if not axes:
            return ()
        shape, item = root.out_shapes[0], root.out_dtypes[0].itemsize
        src = tuple(Partial() if a in axes else Replicate() for a in range(self.mesh.ndim))
        blocking = self._redistribute(shape, item, src, tuple(Replicate() for _ in range(self.mesh.ndim)))
        shared = C.bucketed(blocking, math.prod(shape) * item, ("all_reduce",))
        return tuple(replace(b, seconds=b.seconds - c.seconds, fixed=b.fixed - c.fixed)
                     for b, c in zip(blocking, shared))

    def seen_alike(self, choice: dict) -> bool:
        """Whether under `choice` every rank's finite check reads values every rank sees
        (runtime/faults.seen_alike), so the step runs no all-reduce for it: the loss summed
        over every mesh axis of more than one rank, and every trained weight whole there,
        not ZeRO-2/3 or offloaded, its gradient arriving Partial on all those axes (or left
        Partial for its bucket, Problem._cones).  Checked on the whole choice, outside the
        ILP: the check's one scalar all-reduce is the assembled step's (assemble.py); the
        solver does not weigh it."""
        axes = [a for a, n in enumerate(self.mesh.shape) if n > 1]
        if not axes:
            return True

        def strategy(i):
            return self.nodes[self.nodes[i].rep].strategies[choice[i]]

        def partial(lay):
            return lay is not None and all(isinstance(lay[a], Partial) for a in axes)
        for e in self.edges:
            a, b = self.nodes[e.a], self.nodes[e.b]
            if e.kind == "data" and b.kind == "output" and math.prod(a.out_shapes[e.out]) == 1 \
                    and not partial(strategy(e.a).outputs[e.out]):
                return False
            if a.kind == "param" and a.requires_grad:
                s = strategy(e.a)
                if s.zero >= 2 or s.offload or not all(isinstance(s.outputs[0][x], Replicate) for x in axes):
                    return False
                if e.kind == "data" and (a.rep, e.out) not in self._summed and not partial(
                        strategy(e.b).grads[e.operand]) and not (
                        (e.b, 0) in self._cones and self._replicated(strategy(e.b))):
                    return False
            if e.kind == "grad_out" and b.kind == "param" and b.requires_grad and not partial(strategy(e.a).outputs[0]):
                return False
        return True

    @functools.cached_property
    def finite_check(self) -> tuple:
        """The steps of the finite check's all-reduce (runtime/faults.check_step: one float64
        flag over every rank), which a step runs where `seen_alike` is False."""
        axes = [a for a, n in enumerate(self.mesh.shape) if n > 1]
        if not axes:
            return ()
        src = tuple(Partial() if a in axes else Replicate() for a in range(self.mesh.ndim))
        return self._redistribute((), 8, src, tuple(Replicate() for _ in range(self.mesh.ndim)))

    @staticmethod
    def _loss_summed(src: list, dst: list) -> np.ndarray:
        """[src, dst]: where a one-element graph output (the loss) moving from layout src to
        dst is only summed (Partial -> Replicate), which the runtime runs as one more element
        of the last gradient bucket (passes/collectives._scalar_sum, Inserted.output_reduce)."""
        partial = np.array([_summable(x) for x in src])
        whole = np.array([all(isinstance(p, Replicate) for p in y) for y in dst])
        return partial[:, None] & whole[None, :]

    @staticmethod
    def _replicated(s: Strategy) -> bool:
        """Whether strategy s keeps every operand, output and gradient whole (Replicate)."""
        return all(isinstance(p, Replicate) for lay in (*s.inputs, *s.outputs, *(g for g in s.grads if g is not None))
                   for p in lay)

    def _cone_deferred(self, pn: PNode, out: int, layouts) -> np.ndarray:
        """[pn's choices, `layouts`]: where the gradient of cone tensor pn[out] (Problem._cones)
        arriving in each of `layouts` (None: none) stays Partial for the bucketed all-reduce,
        as the runtime defers it: pn's choice whole on every axis, the gradient only Partial
        or Replicate.  (The cone's other nodes and its parameters are taken as whole there
        too, which is what reading them whole at pn mostly means.)"""
        if (pn.index, out) not in self._cones:
            return np.zeros((len(pn.strategies), len(layouts)), bool)
        whole = np.array([self._replicated(s) for s in pn.strategies])
        partial = np.array([g is not None and _summable(g) for g in layouts])
        return whole[:, None] & partial[None, :]

    def _edge_matrix(self, e: EdgeKey) -> np.ndarray:
        """Seconds of edge `e` for every pair of choices (rows: e.a's, columns: e.b's): what
        `edge_steps` prices, computed once per distinct pair of layouts and spread by index
        arrays (a 3-axis mesh gives menus of ~125 choices, so edges of ~15,000 pairs)."""
        a, b = self.nodes[e.a], self.nodes[e.b]
        code = C.layout_code
        if e.kind == "grad_in":   # consumer a's gradient (None: none) joins the sum b
            shape, item = b.out_shapes[0], b.out_dtypes[0].itemsize
            grads = [s.grads[e.operand] for s in a.strategies]
            has = np.array([g is not None for g in grads])
            src = menu([code(g) if g is not None else None for g in grads])
            dst = menu([code(s.outputs[0]) for s in b.strategies])
            return np.where(has[:, None], self.prices.seconds(shape, item, src, dst), 0.0)
        if e.kind == "grad_out":  # the sum a reaches the layout of tensor b[out]
            shape, item = a.out_shapes[0], a.out_dtypes[0].itemsize
            src = menu([code(s.outputs[0]) for s in a.strategies])
            dst = menu([code(self.grad_destination(b, s, e.out)) for s in b.strategies])
            m = self.prices.seconds(shape, item, src, dst)
            readers = self.readers.get((e.b, e.out), [])
            if b.kind != "param" and readers and all(self._folds(self.nodes[r], k) for r, k in readers):
                # the linears' weight gradients hide it (their choices are not this edge's): at
                # least what their smallest hide; step_lower_bound also takes off up to their largest
                grads = [self._weight_gradients(self.nodes[r]) for r, _ in readers]
                folds = self.prices.one_reduction(src, dst)
                least = np.where(folds, np.minimum(m, sum(g.min() for g in grads)), 0.0)
                self.edge_linear_slack[e] = np.where(folds, np.minimum(m, sum(g.max() for g in grads)), 0.0) - least
                m = m - least
            if b.kind == "param":
                bucketed = self.prices.bucketed(shape, item, src, dst, _zero2(b)[None, :])
                m = m - bucketed.paid_here - self._shared_over_micro_steps(bucketed.bucket_seconds)
                self.edge_bucketed[e] = bucketed.bucket_seconds * self.once
                m = m + self._copies(e, bucketed.copy_bytes)
            elif (e.b, e.out) in self._cones:   # left Partial for the parameters' buckets
                deferred = self._cone_deferred(b, e.out, [s.outputs[0] for s in a.strategies]).T
                bucketed = self.prices.bucketed(shape, item, src, dst, np.zeros((1, 1), bool))
                paid = bucketed.paid_here + self._shared_over_micro_steps(bucketed.bucket_seconds)
                m = np.where(deferred, m - paid, m)
                self.edge_bucketed[e] = np.where(deferred, bucketed.bucket_seconds * self.once, 0.0)
                m = m + self._copies(e, np.where(deferred, bucketed.copy_bytes, 0.0))   # (its weights' buckets)
            own = menu([_shape_key(code(s.outputs[0])) for s in a.strategies])
            theirs = menu([_shape_key(code(s.outputs[e.out])) for s in b.strategies])
            return np.where(own.index[:, None] == theirs.index[None, :], m, m + UNUSABLE)
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        p = menu([code(s.outputs[e.out]) for s in a.strategies])
        q = menu([code(s.inputs[e.operand]) for s in b.strategies])
        m = self.prices.seconds(shape, item, p, q)
        if b.kind == "output" and math.prod(shape) == 1:   # the loss, summed with the last bucket
            summed = self._loss_summed([s.outputs[e.out] for s in a.strategies],
                                       [s.inputs[e.operand] for s in b.strategies])
            bucketed = self.prices.bucketed(shape, item, p, q, np.zeros((1, 1), bool))
            m = np.where(summed, m - bucketed.paid_here, m)
        if a.kind == "op" and a.op == "aten.linear" and self.folds_tp \
                and len(self.readers.get((e.a, e.out), ())) == 1:
            m = m - self._row_parallel_hidden(a, e.out, m, self.prices.one_reduction(p, q))
        self.edge_forward[e] = m
        if not a.requires_grad:
            return m
        grads = [s.grads[e.operand] for s in b.strategies]
        has = np.array([g is not None for g in grads])
        bwd = np.zeros_like(m)
        grouped = None
        if (e.a, e.out) not in self._summed:
            g = menu([code(x) if x is not None else None for x in grads])
            dest = menu([code(self.grad_destination(a, s, e.out)) for s in a.strategies])
            bwd = self.prices.seconds(shape, item, dest, g, reverse=True)
            if a.kind != "param" and self._folds(b, e.operand):   # hidden behind b's weight gradient
                hidden = np.minimum(bwd, self._weight_gradients(b)[None, :])
                bwd = bwd - np.where(self.prices.one_reduction(dest, g, reverse=True), hidden, 0.0)
            if (e.a, e.out) in self._cones:   # left Partial for the parameters' buckets
                deferred = self._cone_deferred(a, e.out, grads)
                bucketed = self.prices.bucketed(shape, item, dest, g, np.zeros((1, 1), bool), reverse=True)
                bwd = np.where(deferred, bwd - bucketed.paid_here - self._shared_over_micro_steps(
                    bucketed.bucket_seconds), bwd)
                self.edge_bucketed[e] = np.where(deferred & has[None, :], bucketed.bucket_seconds * self.once, 0.0)
                copied, once = np.where(deferred & has[None, :], bucketed.copy_bytes, 0.0), True
            if a.kind == "param":
                bucketed = self.prices.bucketed(shape, item, dest, g, _zero2(a)[:, None], reverse=True)
                bwd = bwd - bucketed.paid_here - self._shared_over_micro_steps(bucketed.bucket_seconds)
                bucket = bucketed.bucket_seconds * self.once
                copied = np.where(has[None, :], bucketed.copy_bytes, 0.0)
                once = True
                if self.grouped_gathers:   # grouped_pair, for every pair at once
                    plain = np.array([not s.zero and not s.offload for s in a.strategies])
                    grouped = (plain[:, None] & has[None, :] & self.prices.flags(p, q, C.Row.ONE_ALL_GATHER)
                               & self.prices.flags(dest, g, C.Row.ONE_REDUCE_SCATTER, reverse=True))
                    if not grouped.any():
                        grouped = None
                    else:
                        share = C.bucket_share(math.prod(shape) * item)
                        scattered = self.prices.seconds(shape, item, dest, g, reverse=True, share=share)
                        bwd = np.where(grouped, 0.0, bwd)
                        bucket = np.where(grouped, scattered, bucket)
                        # (copied per micro-step: the gathers, in forward and again in backward,
                        # and the reduce-scatter; not once per step)
                        moved = (self.prices.copy_bytes(shape, item, dest, g, "reduce_scatter", reverse=True)
                                 + 2 * self.prices.copy_bytes(shape, item, p, q, "all_gather"))
                        copied = np.where(grouped, moved, copied)
                        once = ~grouped
                        m = np.where(grouped, self.prices.seconds(shape, item, p, q, share=share), m)
                        self.edge_forward[e] = m
                self.edge_bucketed[e] = np.where(has[None, :], bucket, 0.0)
            if a.kind == "param" or (e.a, e.out) in self._cones:   # (a cone's: its weights' buckets)
                bwd = bwd + self._copies(e, copied, once)
        if a.kind == "param" and (e.b, 0) in self._cones:   # a split weight keeps its cone's reduction in backward
            split = np.array([[sum(st.seconds for st in self._cone_split_steps(a, s, b, t)) for t in b.strategies]
                              for s in a.strategies])
            bwd = bwd + split
        if a.kind == "param":  # gathered for use, dropped after forward: gather again for backward
            gathered = self.prices.seconds(shape, item, p, q, gathers=True)
            if grouped is not None:   # the whole move is the gather; the reduce-scatter is the bucket's
                gathered = np.where(grouped, m, gathered)
                bwd = bwd + np.where(grouped, self.edge_bucketed[e], 0.0)
            self.edge_gathers[e] = gathered
            bwd = bwd + gathered
        return m + np.where(has[None, :], bwd, 0.0)

    def _copies(self, e: EdgeKey, nbytes: np.ndarray, once=True) -> np.ndarray:
        """Seconds the runtime's flat buffers spend copying edge e's bucketed collectives
        (`nbytes` per pair of choices, prices.bucket_copy_bytes), with one op's latency where
        something is copied (the copy back into each tensor); `once` (per pair): where they
        run once per optimizer step (a gradient bucket: at its share of a micro-step,
        Pricing.accumulation), not every micro-step (a ZeRO-3 weight's gathers).  Kept in
        edge_copies (and the once-per-step part in edge_copies_once), which the assembled
        step counts as compute (assemble._Tally.edges)."""
        seconds = np.where(nbytes > 0, C.copy_seconds(nbytes, self.mesh) + self.mesh.device.op_latency, 0.0)
        seconds = seconds * np.where(once, self.once, 1.0)
        self.edge_copies[e] = self.edge_copies.get(e, 0.0) + seconds
        self.edge_copies_once[e] = self.edge_copies_once.get(e, 0.0) + np.where(once, seconds, 0.0)
        return seconds

    def _folds(self, reader: PNode, operand: int) -> bool:
        """Whether the runtime computes `reader`'s weight gradient while its input gradient's
        collective runs (autopar/runtime/linear_grads.py: the input of an aten.linear), on a
        device that overlaps them, where the plan asks for it (Pricing.tp_overlap)."""
        return self.folds_tp and reader.kind == "op" and reader.op == "aten.linear" and operand == 0

    def _row_parallel_hidden(self, a: PNode, out: int, m: np.ndarray, folds: np.ndarray) -> np.ndarray:
        """What a linear's output move hides where the runtime computes the GEMM in pieces and
        reduces each while the next computes (`folds`: the move is one all-reduce or
        reduce-scatter; the linear's local output has a dim to cut, prices.gemm_chunk_dim, taken
        as cut whichever dim it scatters): all but the last piece's share of the lesser of the
        move and the linear's forward, less what the GEMM in pieces costs more than whole
        (pieces_extra), [a's choices, the reader's]."""
        forward = np.array([c.forward_s - sum(c.comm) / 2 for c in self.choices[a.rep]])
        local = [P.local_shape(a.out_shapes[out], s.outputs[out], self.mesh.shape) for s in a.strategies]
        cut = np.array([C.gemm_chunk_dim(x, "all_reduce", None) is not None for x in local])
        extra = forward * np.array([self.pieces_extra(a, s, x) for s, x in zip(a.strategies, local)])
        share = (C.GEMM_CHUNKS - 1) / C.GEMM_CHUNKS
        hidden = np.maximum(np.minimum(m, forward[:, None]) * share - extra[:, None], 0.0)
        return np.where(folds & cut[:, None], hidden, 0.0)

    def pieces_extra(self, a: PNode, s, local_out) -> float:
        """The share of linear a's forward under strategy s that computing its output
        (`local_out`, this rank's) in GEMM_CHUNKS pieces adds (prices.gemm_pieces_extra)."""
        src, i = a.inputs[0]
        k = P.local_shape(self.nodes[src].out_shapes[i], s.inputs[0], self.mesh.shape)[-1]
        return C.gemm_pieces_extra(local_out, int(k), self.mesh)

    def _weight_gradients(self, pn: PNode) -> np.ndarray:
        """Seconds of linear pn's weight (and bias) gradient per choice: its backward less
        its forward (the input gradient's GEMM costs what the forward's does)."""
        return np.array([max(c.compute - 2 * (c.forward_s - sum(c.comm) / 2), 0.0) for c in self.choices[pn.rep]])

    # --- queries ----------------------------------------------------------------------------
    def node_cost(self, rep: int) -> np.ndarray:
        return np.array([c.time for c in self.choices[rep]])

    def node_memory(self, rep: int) -> np.ndarray:
        return np.array([sum(c.memory.values()) for c in self.choices[rep]])

    def node_activations(self, rep: int) -> np.ndarray:
        return np.array([c.memory["activations"] for c in self.choices[rep]])

    def node_work(self, rep: int) -> np.ndarray:
        return np.array([c.work for c in self.choices[rep]])

    def node_plain_memory(self, rep: int) -> np.ndarray:
        return np.array([sum(c.memory.values()) if c.plain_memory is None else c.plain_memory
                         for c in self.choices[rep]])



def bucket_kinds(s: Strategy) -> tuple:
    """The reductions of a parameter's gradient the runtime runs in buckets under strategy s:
    all-reduces, and a ZeRO-2 parameter's reduce-scatters (a ZeRO-3 weight's reduce-scatter
    joins a bucket where its moves are grouped: Problem.grouped_pair)."""
    return ("all_reduce", "reduce_scatter") if s.zero == 2 else ("all_reduce",)


def _summable(layout) -> bool:
    """Whether `layout` is Partial on some axis and whole on the rest: one all-reduce (or a
    bucket's share of one) makes it whole."""
    return all(isinstance(p, (Partial, Replicate)) for p in layout) and any(isinstance(p, Partial) for p in layout)


def _zero2(param: PNode) -> np.ndarray:
    """Per choice of a parameter: whether it is ZeRO-2 (its gradient reduce-scatters in buckets)."""
    return np.array([s.zero == 2 for s in param.strategies])


def _shape_key(code: tuple) -> tuple:
    """What `same_local_shape` compares: the shard dim per axis, Replicate and Partial alike."""
    return tuple(c if c >= 0 else -1 for c in code)


