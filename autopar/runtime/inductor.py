"""compile(backend="inductor"): each rank's graph run as Inductor-compiled regions.

After every pass, the rank's graph is copied and the plan's moves of activations (every
move whose tensor does not come straight from a placeholder) are rewritten as functional
collectives (runtime/functional_moves.py): they become ordinary values in the graph.  The
copy is then cut into maximal runs of nodes, in graph order, of two kinds:

- compute: ATen ops (and `getitem` of their tuples) that draw no random numbers, and the
  functional moves;
- the rest: moves of parameters and inputs (ZeRO-3's gathers and the runtime's hooks on
  the parameters' own tensors), the runtime's random draws (dropout masks from autopar's
  own streams, replayed under recomputation; a dropout of probability 0, or in eval mode,
  draws nothing and counts as compute), recomputed regions, autopar's own ops
  (attention over a mesh axis, experts), anything else.

Every compute run with at least MIN_OPS ops that are not views is compiled by
`torch.compile(backend="inductor", fullgraph=True, dynamic=False)`: Inductor fuses its
memory-bound chains (norms, activations, residual adds, dropout's mask product) into few
kernels, AOTAutograd builds the run's backward, and the activation collectives of forward
and backward (Megatron's all-reduces, Megatron-SP's reduce-scatters and all-gathers,
Ulysses' all-to-alls) sit inside the compiled graphs, issued where the graph has them
(Inductor's compute/communication reordering is left off: every rank keeps the graph's
order of collectives).  The rest runs eagerly between the compiled runs, so the gradient
buckets, ZeRO-3's regathers and their prefetch run as the plan priced them.

A run Inductor cannot compile runs eagerly, with one warning naming its first ops and the
error; a compile error never changes a result.  Inductor's FX graph cache (on by default)
keeps the compiled kernels across processes, so a restarted job compiles from the cache.
Fused kernels reorder floating-point operations, so results match eager to rounding (about
1e-6 relative in float32), not bit for bit.
"""
from __future__ import annotations

import logging
import operator
import time
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from autopar.passes.collectives import move
from autopar.runtime.functional_moves import functional_move
from autopar.runtime.reshard import Regather
from autopar.runtime.rng import draws_nothing, is_random
from autopar.solve.graph import VIEWS
from autopar.trace.paths import block_of, module_path

log = logging.getLogger("autopar")

MIN_OPS = 2   # a run with fewer non-view ops is not worth a compiled region


def _aten_name(node: fx.Node) -> str | None:
    """The ATen op's name (`mm`, `add`...) of a node that calls one, else None."""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(target)
        if name.startswith("aten."):
            return name.split(".")[1]
    return None


def is_compute(node: fx.Node) -> bool:
    """Whether a node may run inside a compiled region."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or getattr(node.target, "_autopar_functional", False):
        return True
    # (random ops draw from autopar's streams; a dropout that draws nothing is compute)
    return _aten_name(node) is not None and (not is_random(node) or draws_nothing(node) is not None)


class CompiledRegion(nn.Module):
    """One run of compute nodes: the Inductor-compiled module, or the eager one where
    compiling failed (said once)."""

    def __init__(self, eager: fx.GraphModule, label: str):
        super().__init__()
        self.eager = eager
        self.label = label
        # (kept out of the module tree: the compiled module wraps `eager`, registered above)
        self.__dict__["compiled"] = torch.compile(eager, backend="inductor", fullgraph=True, dynamic=False)
        self.failed = False
        self.compile_s = None
        self.moves = 0   # the plan's moves compiled inside it, as functional collectives

    def forward(self, *args):
        if self.failed:
            return self.eager(*args)
        if self.compile_s is None:   # the first call compiles: say so, and time it
            log.info("autopar: Inductor compiling region %s ...", self.label)
            start = time.perf_counter()
            try:
                out = self.compiled(*args)
            except Exception as exc:   # a region Inductor cannot compile runs eagerly
                self.failed = True
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                warnings.warn(f"autopar: Inductor could not compile the region {self.label} "
                              f"({type(exc).__name__}: {reason[:300]}); it runs eagerly", stacklevel=2)
                return self.eager(*args)
            self.compile_s = time.perf_counter() - start
            log.info("autopar: compiled region %s in %.1f s", self.label, self.compile_s)
            return out
        return self.compiled(*args)


def _from_input(x: fx.Node) -> bool:
    """Whether x is a placeholder (a parameter, a user input), or moves of one: such moves
    stay eager, where the runtime's hooks see the parameters' own tensors (ZeRO-3's
    regathers, a tied weight's gradient-sum point)."""
    while x.op == "call_function" and x.target is move:
        x = x.args[0]
    return x.op == "placeholder"


def with_functional_moves(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of gm whose moves of activations run as functional collectives
    (runtime/functional_moves.py), so they join the compute runs, and whose dropouts that
    draw nothing (rng.draws_nothing: probability 0, or eval mode) run as the plain op
    rather than through their stream, so they do not cut a run either; gm itself is left
    as it is.  Returns (the copy, how many moves were rewritten)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph)
    count = 0
    for node in out.graph.nodes:
        op = draws_nothing(node)
        if op is not None and node.target is not op:   # (runs as the plain op: it draws nothing)
            node.target = op
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "_autopar_site"}
        if node.op != "call_function" or node.target is not move:
            continue
        x, spec, groups_node, *rest = node.args
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or _from_input(x):
            continue
        fn = functional_move(getattr(gm, spec.target), getattr(gm, groups_node.target), val.dim(),
                             rest[0] if rest else None)
        fn._autopar_functional = True
        node.target, node.args = fn, (x,)
        count += 1
    out.recompile()
    return out, count


def _weight_gather(node: fx.Node) -> bool:
    """Whether a node makes a weight ready for its reader and reads nothing computed: a
    ZeRO-3 gather (Regather.gather) or a move of a placeholder (a tied weight's
    gradient-sum point, a weight's local slice)."""
    if node.op != "call_function":
        return False
    if isinstance(getattr(node.target, "__self__", None), Regather) and node.target.__name__ == "gather":
        return True
    return node.target is move and _from_input(node)


def _layer(node: fx.Node):
    """The repeated layer a node computes in ((list path, index); None outside any layer)."""
    return block_of(module_path(node))


def _reader_layer(node: fx.Node):
    """The layer of the first node that reads what a weight gather makes (through other
    gathers of it: an identity move, then its gather); None when nothing reads it."""
    readers = sorted(node.users, key=lambda u: u._sort_key if hasattr(u, "_sort_key") else 0)
    for u in readers:
        if _weight_gather(u):
            return _reader_layer(u)
        return ("read", _layer(u))
    return None


def with_weights_ahead(gm: fx.GraphModule) -> int:
    """Move each weight gather (_weight_gather) of gm, in place, to the start of the stretch
    of its reader's layer: the consecutive compute nodes of one layer since the last node
    that is neither compute nor a weight gather.  A layer then gathers its weights at its
    start (ZeRO-3's bucket of them at once, as the runtime's buckets do anyway) and its
    compute is one run, not one run per weight; the gathers keep their order (the
    runtime's prefetch counts them in it), and a gather at a layer's start stays where it
    is.  Returns how many gathers moved."""
    moved = 0
    stretch, first = object(), None   # the current stretch's layer and first node
    since: set = set()                 # the nodes after `first`, as they stand now
    for node in list(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        since.add(node)
        if node.op == "get_attr":
            continue
        if _weight_gather(node):
            inputs = [x for x in node.all_input_nodes if x in since]
            if (first is not None and _reader_layer(node) == ("read", stretch)
                    and all(x.op == "get_attr" for x in inputs)):
                for x in inputs:   # (its spec and groups, read where it now runs)
                    first.prepend(x)
                    since.discard(x)
                first.prepend(node)
                since.discard(node)
                moved += 1
            continue
        if not is_compute(node):
            stretch, first = object(), None
            continue
        if not node.meta.get("nn_module_stack") and first is not None:
            continue   # (a node the passes made, a move of an activation: part of the stretch it is in)
        layer = _layer(node)
        if first is None or layer != stretch:
            stretch, first, since = layer, node, {node}
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def compile_regions(gm: fx.GraphModule) -> tuple[fx.GraphModule, list]:
    """gm cut into runs (module docstring), its moves rewritten as functional collectives and
    joined to the compute around them, its weights' gathers moved to their layers' starts
    (with_weights_ahead), its compute runs wrapped as CompiledRegions; returns (the split
    module, the regions)."""
    gm, moves = with_functional_moves(gm)
    ahead = with_weights_ahead(gm)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    run_of: dict = {}
    part, kind = 0, None
    for node in nodes:
        k = is_compute(node)
        if k != kind:
            part, kind = part + 1, k
        run_of[node] = part
    compute_parts = {run_of[n] for n in nodes if is_compute(n)}
    heavy = {p: sum(1 for n in nodes if run_of[n] == p and is_compute(n) and n.target is not operator.getitem
                    and f"aten.{_aten_name(n)}" not in VIEWS) for p in compute_parts}
    first = {}
    for node in nodes:
        first.setdefault(run_of[node], node)
    split = split_module(gm, gm, lambda n: run_of.get(n, 0), keep_original_order=True)
    regions = []
    for p in sorted(compute_parts):
        name = f"submod_{p}"
        sub = getattr(split, name, None)
        if sub is None or heavy[p] < MIN_OPS:
            continue
        ops = [_aten_name(n) or "getitem" for n in sub.graph.nodes if n.op == "call_function"]
        where = first[p].meta.get("nn_module_stack") or {}
        module = next(reversed(where.values()))[0] if where else ""
        label = f"{len(regions) + 1} ({len(ops)} ops from {ops[0]}{f' in {module}' if module else ''})"
        region = CompiledRegion(sub, label)
        region.moves = sum(1 for n in sub.graph.nodes if getattr(n.target, "_autopar_functional", False))
        setattr(split, name, region)
        regions.append(region)
    log.info("autopar: backend inductor: %d compiled regions with %d of the plan's moves inside (the first step "
             "compiles them; Inductor's FX graph cache keeps them for later processes); %d runs of compute too "
             "small to compile run eagerly; %d weight gathers moved to their layers' starts", len(regions), moves,
             len(compute_parts) - len(regions), ahead)
    return split, regions
