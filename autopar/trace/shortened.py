"""A deep model's planning trace cut to four or five of its alike layers, each kept layer
standing for a number of the model's (Traced.weights), for problems whose per-layer costs
are all that is asked of them (the pipeline search's stage candidates).

Identical layers share their choices two by two (even layers one set, odd layers the
other: autopar/solve/problem/layers.py), so the ILP of a model of n alike layers is the
ILP of two layers with each cost counted as many times as the layers that share it.  A
trace written from three exported layers (autopar/trace/unroll.py: copies of layer 1 as
layers 2 .. n-2) holds nothing the copies do not repeat, so keeping

    prefix | layer 0 | layer 1 | layer 2 | (layer 3, n odd) | layer n-1 | suffix

with layers 1 and 2 standing for every odd and even layer between the first and the last
(each (n - kept + 2) / 2; the others one) gives the same ILP, cost for cost: every edge
class counts as many edges (an edge counts as the later of its ends: layer 0 -> 1 stands
for every even -> odd step but the last's, layer 2 -> n-1 for that one).  The last layer
keeps its parity (its choices are those of the layers of its parity), which is why an odd
count keeps layer 3.  The last layer reads what layer n-2 wrote; here it reads the kept
layer of n-2's parity, node for node.

The planner plans the whole graph (the runtime runs it); only the costs of a layer are
taken from the short one, and copied to the layers it stands for
(autopar/solve/pipeline/costs.py).
"""
from __future__ import annotations

import torch.fx as fx

from autopar.trace.paths import layer_of, module_path
from autopar.trace.unroll import planning_module


def kept_layers(count: int) -> tuple:
    """The layer indices a trace of `count` alike layers keeps (the module doc), counted
    from the first alike one (lead layers built differently are all kept, each itself)."""
    return (0, 1, 2, 3, count - 1) if count % 2 else (0, 1, 2, count - 1)


def shortened(traced):
    """`traced` (an autopar.trace.export.Traced whose layers were written from three) cut to
    kept_layers, with Traced.weights saying what each kept layer stands for; None where it
    is not shorter or its graph is not laid out as the module doc says (then plan it whole)."""
    if not traced.layers or traced.weights:
        return None
    path, count, lead = traced.layers
    kept = (*range(lead), *(lead + i for i in kept_layers(count - lead)))
    if len(kept) >= count:
        return None
    names = {**traced.params, **traced.buffers}
    nodes = list(traced.graph.graph.nodes)
    layer = {}
    for nd in nodes:
        where = names.get(nd.target) if nd.op == "placeholder" else module_path(nd)
        layer[nd] = layer_of(where, path) if where else None
    if not _outside_at_the_ends(nodes, layer, count):
        return None
    stand_in = _stand_ins(nodes, layer, count - 2, kept[-2])
    if stand_in is None:
        return None
    graph, env = fx.Graph(), {}
    for nd in nodes:
        if layer[nd] is not None and layer[nd] not in kept:
            continue

        def read(src, reader=nd):
            if src in env:
                return env[src]
            if layer[reader] == count - 1 and src in stand_in:
                return env[stand_in[src]]
            raise _Unplaced
        try:
            env[nd] = graph.node_copy(nd, read)
        except _Unplaced:
            return None
    weight = (count - len(kept) + 2) // 2   # (lead layers stand for themselves)
    return type(traced)(planning_module(traced.graph, graph),
                        {k: v for k, v in traced.params.items() if _kept(v, path, kept)},
                        {k: v for k, v in traced.buffers.items() if _kept(v, path, kept)},
                        list(traced.user_inputs), dict(traced.tied), traced.in_spec, traced.out_spec,
                        {k: v for k, v in traced.constants.items() if _kept(k, path, kept)},
                        traced.parts, traced.layers, {i: (weight if i - lead in (1, 2) else 1) for i in kept})


def _outside_at_the_ends(nodes: list, layer: dict, count: int) -> bool:
    """Whether every op outside the layers runs before them (reads nothing a layer made) or
    after them (reads the last layer's or after-ops' outputs only, and no layer reads it)."""
    after = set()
    for nd in nodes:
        if nd.op != "call_function":
            continue
        inside = [src for src in nd.all_input_nodes if layer[src] is not None and src.op != "placeholder"]
        if layer[nd] is not None:
            if any(src in after for src in nd.all_input_nodes):
                return False
        elif inside or any(src in after for src in nd.all_input_nodes):
            if any(layer[src] != count - 1 for src in inside):
                return False
            after.add(nd)
    return True


class _Unplaced(Exception):
    """A kept node reads one that is not kept and has no stand-in."""


def _stand_ins(nodes: list, layer: dict, before_last: int, like: int) -> dict | None:
    """Each op of layer `before_last` -> the op at its place in layer `like` (the kept layer
    of its parity), or None where the two layers do not run the same ops."""
    ops = {i: [nd for nd in nodes if nd.op == "call_function" and layer[nd] == i] for i in (before_last, like)}
    a, b = ops[before_last], ops[like]
    if len(a) != len(b) or any(x.target != y.target for x, y in zip(a, b)):
        return None
    return dict(zip(a, b))


def _kept(name: str, path: str, kept: tuple) -> bool:
    i = layer_of(name, path)
    return i is None or i in kept
