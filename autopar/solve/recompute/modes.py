"""Activation recomputation as a per-layer choice of the plan.

Each repeated layer (a transformer block) keeps its activations for backward in one of
four ways:

  none       what autograd saves: every op's saved operands and outputs;
  selective  the layer runs under activation checkpointing with a policy that keeps the
             outputs of the expensive operations (matrix products with a weight,
             attention, experts) and recomputes the cheap ones between them (norms,
             activations, dropout, residual adds, rotary embeddings, and with eager
             attention the attention core: QK^T, softmax, dropout, times V, whose
             s^2-sized tensors are Megatron's reason for selective recomputation);
  alternate  as selective, except that every second matrix product with a weight (in the
             layer's order: a Llama block's key, output and up projections) is recomputed
             too: half-way between selective and full in memory and in time (the per-op
             policy of torchtitan's published Llama-3 runs; the planner takes it when asked,
             its own search tries the other modes);
  full       the layer keeps only its inputs and runs its whole forward again in backward;
  offload    the layer keeps what autograd saves, copied to host memory in forward and
             back in its backward (no forward runs again; each byte crosses the host link
             twice, not overlapped with compute: the runtime copies on the compute stream).

The cost model prices each: the activation bytes a layer keeps per device and the
forward (compute and the collectives inside the layer) that backward runs again.  Memory
a recomputed layer needs during its own backward (its activations made again, one layer
at a time) is part of the plan's working memory (working_bytes), not of its activations.
The ILP chooses per set of identical layers (problem/layers.py: all alike, or even and
odd layers apart), so that under a tight budget half the layers can recompute and half
keep everything.
"""
from __future__ import annotations

import math

import numpy as np
import torch.fx.traceback as fx_traceback

from autopar.ops.rules import ALWAYS_KEPT, PRODUCTS, VIEWS
from autopar.solve.problem.graph import compiles
from autopar.report.records import RECOMPUTING, SELECTIVE_MODES, Recompute

MODES = ("none", "selective", "alternate", "full", "offload")
# the modes the planner's own search tries per set of identical layers
SEARCHED = ("selective", "full")


def check_mode(recompute) -> str | None:
    """The `recompute=` argument of autopar.plan: None (the ILP chooses) or one of MODES."""
    if recompute is None or recompute in MODES:
        return recompute
    raise ValueError(f"recompute={recompute!r} is not a recomputation policy; choose one of "
                     f"{', '.join(repr(m) for m in MODES)} (or leave it None to let the planner choose per layer)")


def reads_weight(problem, pn) -> bool:
    """Whether op pn reads a parameter, directly or through views."""
    todo = [src for src, _ in pn.inputs]
    while todo:
        n = problem.nodes[todo.pop()]
        if n.kind == "param":
            return True
        if n.kind == "op" and (n.op in VIEWS):
            todo.extend(src for src, _ in n.inputs)
    return False


def kept_by_selective(problem, pn) -> bool:
    """Whether "selective" keeps op pn's outputs (see the module docstring)."""
    if pn.kind != "op":
        return False
    if pn.op in ALWAYS_KEPT:
        return True
    return pn.op in PRODUCTS and reads_weight(problem, pn)


def kept_nodes(problem, modes: dict, layer: dict | None = None) -> set:
    """The node indices whose outputs their layer's mode keeps: under "selective" each
    kept_by_selective op; under "alternate" the same less every second matrix product of
    the layer, counted in graph order (attention and experts stay kept)."""
    layer = layer_paths(problem) if layer is None else layer
    out, count = set(), {}
    for pn in problem.nodes:
        path = layer.get(pn.index)
        mode = modes.get(path, "none")
        if mode not in SELECTIVE_MODES or not kept_by_selective(problem, pn):
            continue
        if mode == "alternate" and pn.op not in ALWAYS_KEPT:
            count[path] = count.get(path, 0) + 1
            if count[path] % 2 == 0:
                continue
        out.add(pn.index)
    return out


class ModeCosts:
    """What a recompute assignment (layer path -> mode) changes in a Problem, per
    representative node (summed over the nodes it stands for): the activation bytes
    `activations[rep][choice]` (replacing the Choice's), the seconds of forward run again
    `extra[rep][choice]`, and per edge class the forward moves run again `edge_extra[key]`."""

    def __init__(self, problem, modes: dict):
        self.modes = dict(modes)
        nodes = problem.nodes
        layer = layer_paths(problem)
        kept = self.kept = kept_nodes(problem, self.modes, layer)
        # the selective layers that may compile whole (compiled_whole; a pipeline schedule's
        # backward may run a layer's forward twice, and the runtime then keeps the kept
        # outputs as eager checkpointing does)
        self.compilable = set() if problem.pipelined else compiled_whole(problem, self.modes, layer)
        self.layer, self.by_whole = layer, {}
        self.entries, holders = _holdings(problem, self.modes, layer, kept)
        self.activations: dict = {}
        keeps: dict = {}   # node index -> bytes it keeps under its layer's mode, per strategy
        for n, item in self.entries:
            pn = nodes[n]
            share = holders[item[0]] if item[0] is not None else 1
            arr = problem.saved.held_array(pn, item) / share
            self.activations[pn.rep] = self.activations.get(pn.rep, 0.0) + arr
            keeps[n] = keeps.get(n, 0.0) + arr
        self.keeps = keeps
        # per recomputed layer, its ops: (node index, rep, what the node still keeps); what
        # the layer keeps without recomputing, less that, is made again in its backward
        self.members: dict = {}
        for n, path in layer.items():
            if self.modes.get(path, "none") != "none" and nodes[n].kind == "op":
                self.members.setdefault(path, []).append((n, nodes[n].rep, keeps.get(n)))
        self.extra, self.edge_extra = _forward_again(problem, self.modes, layer, kept)
        # an offloaded layer's saved tensors cross the host link twice (down in forward, up in
        # backward).  The ILP's linear terms price each holding whose storage no earlier one
        # holds; seconds() prices a solved choice's storages exactly (host_bytes), as the
        # runtime copies each storage once however many views of it are saved
        self.host_entries = []   # (node index, holding) of what the offloaded layers keep
        self.crossing = 2 / problem.mesh.device.host_bandwidth
        self.linear_crossing: dict = {}   # rep -> the linear terms of the crossings, per strategy
        self.problem = problem
        seen = set()
        for n, held in problem.saved.holdings.items():
            if self.modes.get(layer.get(n)) != "offload":
                continue
            pn = nodes[n]
            for item in held:
                self.host_entries.append((n, item))
                if item[0] is not None and item[0] in seen:
                    continue
                seen.add(item[0])
                term = self.crossing * problem.saved.held_array(pn, item)
                self.extra[pn.rep] = self.extra.get(pn.rep, 0.0) + term
                self.linear_crossing[pn.rep] = self.linear_crossing.get(pn.rep, 0.0) + term

    def entries_for(self, problem, choice: dict) -> list:
        """What backward keeps under a solved choice: self.entries, less the kept outputs no
        backward reads in each selective layer that compiles whole under it (compiled_whole,
        and no op of the layer communicating or moving a tensor inside it, as a
        tensor-parallel layer's folded gradient reductions do).  The ILP's linear terms
        keep every kept output: they hold for every choice."""
        if not self.compilable:
            return self.entries
        whole = frozenset(self.compilable - _moving_layers(problem, choice, self.layer))
        if not whole:
            return self.entries
        if whole not in self.by_whole:
            self.by_whole[whole] = _holdings(problem, self.modes, self.layer, self.kept, whole)[0]
        return self.by_whole[whole]

    def host_bytes(self, problem, choice: dict) -> float:
        """Activation bytes per device the offloaded layers keep in host memory: their
        storages, each once (the runtime copies a storage once however many views of it
        are saved)."""
        return float(problem.saved.kept_bytes(choice, self.host_entries)) if self.host_entries else 0.0

    def activation_bytes(self, choice: dict) -> float:
        """Activation bytes per device of a choice under these modes."""
        return float(sum(arr[choice[rep]] for rep, arr in self.activations.items()))

    def remade(self, problem, choice: dict) -> dict:
        """Layer path -> the activation bytes its backward makes again (live while that
        layer's backward runs, one layer at a time)."""
        out = {}
        for path, members in self.members.items():
            total = 0.0
            for n, rep, kept in members:
                c = choice[n]
                total += problem.choices[rep][c].memory["activations"] - (0.0 if kept is None else kept[c])
            out[path] = max(total, 0.0)
        return out

    def seconds(self, choice: dict) -> float:
        """Seconds per step of the forward the recomputed layers run again, and of the
        offloaded layers' copies (their storages, each once, down and up the host link)."""
        linear = float(sum(arr[choice[rep]] for rep, arr in self.extra.items()) +
                       sum(m[choice[key.a], choice[key.b]] for key, m in self.edge_extra.items()))
        if not self.host_entries:
            return linear
        estimate = float(sum(arr[choice[rep]] for rep, arr in self.linear_crossing.items()))
        return linear - estimate + self.crossing * self.host_bytes(self.problem, choice)


def compiled_whole(problem, modes: dict, layer: dict) -> set:
    """The paths of the selective layers that backend "inductor" compiles as one region with
    the checkpoint inside (runtime/regions/inductor: every op of the layer an ATen op that draws no
    random numbers, and torch new enough to annotate the kept ops)."""
    if problem.pricing.backend != "inductor" or not hasattr(fx_traceback, "annotate"):
        return set()
    paths = {path for path, mode in modes.items() if mode in SELECTIVE_MODES}
    for n, path in layer.items():
        pn = problem.nodes[n]
        if path in paths and pn.kind == "op" and not compiles(pn):
            paths.discard(path)
    return paths


def _moving_layers(problem, choice: dict, layer: dict) -> set:
    """The layer paths that, under a solved choice, have an op communicating inside or a
    tensor moved between their ops (forward or backward)."""
    nodes = problem.nodes
    out = {layer[n] for n in layer if nodes[n].kind == "op" and nodes[nodes[n].rep].strategies[choice[n]].comm}
    for e in problem.edges:
        if nodes[e.a].kind in ("param", "input") or nodes[e.b].kind in ("param", "input"):
            continue   # (a weight's gather runs before the layer's region, its gradient's reduction after)
        pa, pb = layer.get(e.a), layer.get(e.b)
        # (a data edge inside one layer; a gradient's sum over its readers touching one)
        paths = ({pa} if pa == pb else set()) if e.kind == "data" else {pa, pb}
        paths = {p for p in paths if p is not None and p not in out}
        if paths:
            m = problem.edge_costs.get(problem.rep_edge(e))
            if m is not None and m[choice[e.a], choice[e.b]] > 0:
                out |= paths
    return out


def _read_in_backward(problem, nodes_of_layer: list, kept: set) -> set:
    """The storages (node, output) that the backward of a selective layer compiled whole
    reads: what each op's derivative keeps (its holdings), and, for each op that is not kept
    but whose output backward reads, what running it again reads, followed back until a
    kept op's output or the layer's inputs.  The compiled graph's partitioner saves a kept
    output only when backward reads it (a block's last projection, read only by the
    residual add, is not saved), where eager checkpointing caches every kept output."""
    nodes = problem.nodes
    mine = set(nodes_of_layer)
    needed: set = set()
    todo = []

    def need(key):
        if key not in needed:
            needed.add(key)
            todo.append(key)

    for n in nodes_of_layer:
        for key, kind, index, _ in problem.saved.holdings.get(n, ()):
            if kind == "in":
                need(problem.saved.storage_root(*nodes[n].inputs[index]))
            elif kind == "out":
                need(key)
    while todo:
        src, _ = todo.pop()
        if src in mine and src not in kept and nodes[src].kind == "op":
            for s, o in nodes[src].inputs:   # (run again in backward: reads its operands)
                need(problem.saved.storage_root(s, o))
    return needed


def _holdings(problem, modes: dict, layer: dict, kept: set, compiled: set = frozenset()) -> tuple:
    """(entries: (node index, holding) of what backward keeps under `modes`; holders:
    storage -> how many entries hold it).  A layer that keeps everything holds what
    autograd saves; selectively, only the kept ops' outputs (and what else their kernels
    return); a recomputed layer also holds the inputs it reads from outside itself.  A
    selective layer in `compiled` (compiled_whole) holds, of those, only the storages its
    backward reads (_read_in_backward)."""
    nodes = problem.nodes
    entries = []
    holders: dict = {}
    members: dict = {}   # layer path -> its nodes' indices, ascending
    for n, path in layer.items():
        members.setdefault(path, []).append(n)
    read = {path: _read_in_backward(problem, sorted(members[path]), kept) for path in compiled}

    def hold(n, item):
        entries.append((n, item))
        if item[0] is not None:   # (a node of a shortened trace: as many as it stands for, StandIns.holders)
            holders[item[0]] = holders.get(item[0], 0) + problem.stand_ins.holders(item[0][0], n)

    for n in sorted(set(problem.saved.holdings) | set(problem.saved.kept_holdings)):
        mode = modes.get(layer.get(n), "none")
        # (kept as a step keeps them: compiled, less what the partitioner runs again)
        held = problem.saved.kept_holdings.get(n, ()) if mode == "none" else problem.saved.holdings.get(n, ())
        if mode == "offload":
            continue   # (all of it in host memory)
        if mode == "none":
            for item in held:
                hold(n, item)
        elif mode in SELECTIVE_MODES and n in kept:   # its outputs, and what else its kernel
            pn = nodes[n]                            # returns (attention's log-sum-exp)
            read_back = read.get(layer.get(n))
            for j, shape in enumerate(pn.out_shapes):
                if read_back is None or (n, j) in read_back:
                    hold(n, ((n, j), "result", j, math.prod(shape) * pn.out_dtypes[j].itemsize))
            for item in held:
                if item[1] == "new":
                    hold(n, item)
                elif item[1] in ("in", "out"):   # under a strategy that communicates inside, the
                    hold(n, (None, "own " + item[1], item[2], item[3]))   # op runs whole (Recompute.whole)
    for path, mode in modes.items():
        if mode not in RECOMPUTING:
            continue
        for pn in (nodes[n] for n in sorted(members.get(path, ()))):
            if pn.kind != "op":
                continue
            for k, (src, o) in enumerate(pn.inputs):
                if layer.get(src) == path:
                    continue   # (a region holds every input it reads, rotary tables and masks too,
                key = problem.saved.storage_root(src, o)   # as its ops read them: after their moves)
                root = nodes[key[0]]
                if root.kind != "op":
                    hold(pn.index, (None, "leaf", k, 0.0))   # (counted only as a move's copy)
                    continue
                if path in read and key not in read[path]:
                    continue
                hold(pn.index, (key, "in", k, math.prod(root.out_shapes[key[1]]) * root.out_dtypes[key[1]].itemsize))
    return entries, holders


def _forward_again(problem, modes: dict, layer: dict, kept: set) -> tuple:
    """(rep -> seconds per strategy of the forward recomputed layers run again; edge class
    -> seconds per layout pair of the forward moves they run again)."""
    extra: dict = {}
    edge_extra: dict = {}
    forward: dict = {}   # rep -> its strategies' forward seconds
    moving: dict = {}    # edge class -> its forward moves' seconds, None where it moves nothing
    for pn in problem.nodes:
        mode = modes.get(layer.get(pn.index), "none")
        if mode not in RECOMPUTING or pn.kind != "op":
            continue
        if not (mode in SELECTIVE_MODES and pn.index in kept):
            if pn.rep not in forward:
                forward[pn.rep] = np.array([c.forward_s for c in problem.choices[pn.rep]])
            extra[pn.rep] = extra.get(pn.rep, 0.0) + forward[pn.rep]
    for e in problem.edges:
        if e.kind != "data" or modes.get(layer.get(e.b), "none") not in RECOMPUTING:
            continue
        key = problem.rep_edge(e)
        if key not in moving:
            fwd = problem.edge_prices.forward.get(key)
            moving[key] = fwd if fwd is not None and fwd.any() else None
        if moving[key] is not None:
            edge_extra[key] = edge_extra.get(key, 0.0) + moving[key]
    return extra, edge_extra


def mode_costs(problem, modes: dict) -> ModeCosts:
    """ModeCosts(problem, modes), built once per problem and assignment (a plan's solves,
    its overlap-aware re-solves and assemble all price the same one)."""
    return problem.remembered("mode costs", tuple(sorted(modes.items())), lambda: ModeCosts(problem, modes))


def beyond_linear(problem, choice: dict, costs: ModeCosts | None = None) -> tuple:
    """(exact activation bytes, working bytes, what the plan needs beyond the ILP's linear
    memory sum) of a solved choice under recompute costs (None: nothing recomputed).  The
    ILP sums states, gradients and its activation estimate; the plan is held to states and
    gradients plus the larger of the exact activations with the working memory and the
    optimizer step's temporaries.  That bounds the peak (report.records.peak_bytes, where the
    gradients are not yet there at backward's start) from above: the planner keeps that
    margin, room for gradient accumulation, and plans as it did before the peak was split
    into its two moments (a lower, plan-dependent reserve made the budgeted search's plans
    less monotonic in the budget)."""
    if costs is None:
        entries = problem.saved.saved_entries()
        linear = sum(problem.choices[pn.rep][choice[pn.index]].memory["activations"] for pn in problem.nodes)
    else:
        entries, linear = costs.entries_for(problem, choice), costs.activation_bytes(choice)
    exact = problem.saved.kept_bytes(choice, entries)
    work = working_bytes(problem, choice, costs)
    return exact, work, max(exact + work, problem.node_prices.step_memory(choice)) - linear


def working_bytes(problem, choice: dict, costs: ModeCosts | None = None) -> float:
    """The most memory live at one moment beyond the model states and the saved
    activations: over the ops, the gradients of an op's outputs and inputs while its
    backward runs (Choice.work, in the op's layouts), plus, inside a recomputed layer, the
    activations that layer makes again for its backward.  Saved activations are all still
    held at the start of backward, where the largest op (the logits and their loss) often
    runs, so the plan's peak is states + activations + this."""
    layer = layer_paths(problem)
    remade = costs.remade(problem, choice) if costs is not None else {}
    peak = 0.0
    for pn in problem.nodes:
        if pn.kind == "op":
            peak = max(peak, problem.choices[pn.rep][choice[pn.index]].work + remade.get(layer.get(pn.index), 0.0))
    return peak


def layer_paths(problem) -> dict:
    """node index -> "prefix.i" of the repeated layer it belongs to."""
    return {n: f"{prefix}.{i}" for n, (prefix, i) in problem.block.items()}


def layer_slots(problem) -> list:
    """(prefix, indices) of each set of identical layers with more than one layer."""
    return [(prefix, tuple(ix)) for prefix, ix in problem.layer_groups if len(ix) > 1]


def recompute_record(problem, choice, predicted, forced):
    """The plan's Recompute record for a solved choice (None: nothing recomputed and
    nothing forced)."""
    modes = dict(getattr(choice, "modes", None) or {})
    if not modes:
        return None if forced is None else Recompute({}, forced=forced)
    layer = layer_paths(problem)
    costs = mode_costs(problem, modes)
    kept = tuple(pn.name for pn in problem.nodes if pn.index in costs.kept)
    whole = tuple(pn.name for pn in problem.nodes if pn.name in kept
                  and problem.nodes[pn.rep].strategies[choice[pn.index]].comm)
    keeping = problem.saved.kept_bytes(choice, problem.saved.saved_entries())
    added = costs.seconds(choice)
    note = ""
    if any(m in SELECTIVE_MODES for m in modes.values()):
        fused = any(pn.op in ALWAYS_KEPT for pn in problem.nodes if layer.get(pn.index) in modes)
        note = ("selective keeps the projections' and the fused attention's outputs (fused attention holds no "
                "s x s tensors, so what it drops is the norms, activations, dropout masks and rotary tables)"
                if fused else "selective recomputes the attention core (QK^T, softmax, dropout, x V) and the "
                              "cheap ops, keeping the projections' outputs")
        if "alternate" in modes.values():
            note += "; alternate also recomputes every second projection of its layers"
    return Recompute(modes, kept, float(keeping - predicted.memory["activations"]), added, forced, note, whole)
