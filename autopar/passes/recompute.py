"""recompute: cut each layer the plan recomputes out of the per-rank graph into a region
body that the runtime runs under activation checkpointing (autopar/runtime/regions/recompute.py).

A layer is the span of graph nodes from the first to the last node whose module path is
the layer's ("blocks.3" or below it), in graph order, with whatever the passes inserted in
between (the moves between layouts, a ZeRO-3 weight's gather, the random ops' stream
draws): all of it runs again in backward.  The span becomes one GraphModule
    region(*inputs) -> tuple(outputs)
where `inputs` are the values the span reads from before it and `outputs` those read after
it; the main graph calls the region (a submodule) in its place.  Under "selective" (and
"alternate", which names fewer) the
nodes the plan names keep their outputs (plan.recompute.kept): their targets are wrapped
so the runtime's saved-tensor policy knows them; those that communicate inside
(plan.recompute.whole: ring or Ulysses attention) split the layer into one region before
and one after them and run in the main graph, so backward does not communicate again.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ops import op_name
from autopar.ops.rules import PRODUCTS
from autopar.passes.fold_linears import ABSORBS
from autopar.report.records import SELECTIVE_MODES
from autopar.trace.paths import module_path

_aten = torch.ops.aten
# the kernels whose outputs a kept op's result lives in: a product's matrix multiply (the
# views around it alias it), attention's fused kernel (output and log-sum-exp); anything
# else a kept op dispatches (a transposed weight, the math path's s x s scores) is made
# again in backward like the cheap ops
PRODUCT_KERNELS = frozenset(getattr(_aten, k) for k in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
                            if hasattr(_aten, k))
ATTENTION_KERNELS = frozenset(getattr(_aten, k) for k in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(_aten, k))
ALL_KERNELS = object()   # a kept op whose kernels are not known here: every op it dispatches
_KEEPING = {"kernels": None}   # while a kept op runs: the kernels whose outputs the policy keeps


@dataclass(frozen=True)
class RegionSite:
    """One recomputed layer cut out of a graph: the submodule `name` (its body, a
    GraphModule) computes layer `path` under `mode`."""

    name: str
    path: str
    mode: str

    def __str__(self) -> str:
        return f"{self.name}: {self.path} ({self.mode})"


def keeping():
    """The kernels (ALL_KERNELS, or a set of ATen overload packets) whose outputs the
    selective policy keeps now: those of the kept op running, else None."""
    return _KEEPING["kernels"]


def kernels_of(node: fx.Node):
    """The dispatched ops whose outputs the selective policy keeps while `node` runs (None:
    every op it dispatches, for a kept op whose kernels are not known here)."""
    name = op_name(node)
    if name in PRODUCTS or node.meta.get(ABSORBS):   # (a folded call: its linears' products, passes/fold_linears.py)
        return PRODUCT_KERNELS
    if name == "aten.scaled_dot_product_attention":
        return ATTENTION_KERNELS
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "autopar":
        return frozenset({target.overloadpacket})   # one custom op (experts, window attention)
    return None


def kept(target, kernels):
    """Wrap a graph node's target: while it runs, keeping() names `kernels` (see
    kernels_of).  (A plain function, not functools.wraps: the graph's code would call the op
    by its own name and skip the wrapper.)"""
    keep = ALL_KERNELS if kernels is None else kernels

    def kept_op(*args, **kwargs):
        outer, _KEEPING["kernels"] = _KEEPING["kernels"], keep
        try:
            return target(*args, **kwargs)
        finally:
            _KEEPING["kernels"] = outer
    kept_op._autopar_kept = (target, kernels)   # (what a layer compiled whole runs instead: inductor.py)
    return kept_op


def outline_recompute(gm: fx.GraphModule, recompute) -> tuple:
    """Cut the layers `recompute` (a plan's Recompute; None: none) names out of gm into
    region bodies (outline_layers); under a selective mode the nodes recompute.kept names
    (or a folded call absorbing one of them) run wrapped by `kept`.  The runtime wraps each
    body in its checkpointed Region (autopar/runtime/regions/recompute.py).  Returns the
    RegionSites."""
    if recompute is None or not recompute.layers:
        return ()
    keep = set(recompute.kept)
    sites = []

    def make(path, mode, body, nodes):
        if mode in SELECTIVE_MODES:
            for name, node in nodes.items():
                if (name in keep or any(a in keep for a in node.meta.get(ABSORBS, ()))) and node.op == "call_function":
                    node.target = kept(node.target, kernels_of(node))
            body.recompile()
        sites.append((path, mode))
        return body
    names = outline_layers(gm, dict(recompute.layers), make, frozenset(recompute.whole))
    return tuple(RegionSite(name, path, mode) for name, (path, mode) in zip(names, sites))


class RecomputeError(ValueError):
    """A layer the plan recomputes cannot be cut out of the graph; the message says why."""


def in_layer(node: fx.Node, path: str) -> bool:
    p = module_path(node)
    return p == path or p.startswith(path + ".")


def outline_layers(gm: fx.GraphModule, layers: dict, make_region, whole=frozenset()) -> list:
    """Replace each layer of `layers` (path -> mode, "full" or "selective") by a call of the
    module make_region(path, mode, graph_module, nodes); the region module names, in order.
    Under "selective" the nodes named in `whole` stay in the main graph, between regions
    (they run once, keeping what autograd saves)."""
    made = []
    for path, mode in layers.items():
        order = list(gm.graph.nodes)
        at = [i for i, n in enumerate(order) if n.op == "call_function" and in_layer(n, path)]
        if not at:
            continue   # (a pipeline stage holds other layers)
        span = order[at[0]: at[-1] + 1]
        if any(n.op not in ("call_function", "get_attr") for n in span):
            raise RecomputeError(f"layer {path} of the graph is not a run of operations "
                                 f"({[n.name for n in span if n.op not in ('call_function', 'get_attr')][:3]} "
                                 f"inside it); plan it without recomputation")
        pieces, piece = [], []
        for n in span:
            if mode in SELECTIVE_MODES and n.name in whole:
                pieces.append(piece)
                piece = []
            else:
                piece.append(n)
        pieces.append(piece)
        for piece in pieces:
            if any(n.op == "call_function" for n in piece):
                made.append(_outline(gm, path, mode, piece, make_region, len(made)))
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _outline(gm: fx.GraphModule, path: str, mode: str, span: list, make_region, number: int) -> str:
    """Cut the run of nodes `span` out of gm into region module number `number`."""
    inside = set(span)
    inputs = []
    for n in span:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in span:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    region_gm = fx.GraphModule(gm, sub)
    name = f"_autopar_recompute_{number}"
    gm.add_submodule(name, make_region(path, mode, region_gm, {n.name: env[n] for n in span}))
    with gm.graph.inserting_before(span[0]):
        call = gm.graph.call_module(name, tuple(inputs))
    with gm.graph.inserting_after(call):
        for k, o in enumerate(outputs):
            got = gm.graph.call_function(operator.getitem, (call, k))
            got.meta = dict(o.meta)
            o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(span):
        gm.graph.erase_node(n)
    return name
