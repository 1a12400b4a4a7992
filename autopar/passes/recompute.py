"""recompute: cut each layer the plan recomputes out of the per-rank graph into a region
that runs under activation checkpointing (autopar/runtime/regions/recompute.py).

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

import torch.fx as fx

from autopar.report.records import SELECTIVE_MODES
from autopar.trace.paths import module_path


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
