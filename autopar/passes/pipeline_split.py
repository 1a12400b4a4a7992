"""split_stages: cut a localized graph into pipeline stages.

Which nodes carry activations.  A node that depends both on a user input and on a
parameter computes on activations; it gets a stage.  Inside repeated layer k (module path
`<layer_prefix>.k...`) that is the stage holding layer k (plan.pipeline.stages); any
other such node runs as late as its readers allow (the earliest stage among them; the
graph's outputs count as the last stage).  So embeddings land on stage 0, the final norm,
head and loss on the last, and a collective between two layers (the all-gather of a
sharded residual stream before a LayerNorm) runs on the stage that reads its result:
what crosses the cut is the smaller, unmoved tensor, once.  Every other node reads no activation: a
parameter's gather or cast, a table built from buffers, a mask or the targets' reshape
built from the inputs alone.  It has no stage of its own; each stage that reads it
computes its own copy.  So a tied weight is gathered where it is read, and no constant or
target travels between stages (the user inputs reach every stage as keyword arguments).

Crossing values.  A value computed on stage s and read on stage t > s (or returned by the
graph) crosses every boundary between them: stage s sends it, stages s+1..t-1 receive it
and send it on.  It keeps its layout: every stage runs the same per-stage plan on a
sub-mesh of the same shape, so rank i of the next device group holds the same shard of it.
Autograd carries its gradient back along the same path.

Each stage becomes a GraphModule
    stage(*received, *user_inputs, *params_and_buffers) -> tuple(sent)
where the last stage sends the graph's flat outputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autopar.trace.paths import layer_of, module_path


class SplitError(ValueError):
    """The graph cannot be cut as the plan says; the message names the node and the fix."""


@dataclass
class StageGraph:
    """One stage: graph_module(*received, *inputs, *params) returns the values in `sent`.
    received / sent: names of nodes of the whole graph, in the order they travel;
    inputs: the user-input placeholders it reads; params: parameter and buffer placeholders."""

    index: int
    graph_module: fx.GraphModule
    received: list
    inputs: list
    params: list
    sent: list


def layer_stages(stages, layer_indices) -> dict:
    """Layer index -> stage from plan.pipeline's stages ((first, last + 1) positions in
    layer_indices)."""
    out = {}
    for s, (a, b) in enumerate(stages):
        for pos in range(a, b):
            out[layer_indices[pos]] = s
    return out


def assign_stages(gm: fx.GraphModule, user_inputs, layer_prefix: str, stage_of_layer: dict) -> dict:
    """node -> stage for every node that carries activations (see the module docstring)."""
    user_inputs = set(user_inputs)
    reads_input, reads_param = set(), set()
    stage: dict = {}
    hinted: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            (reads_input if node.target in user_inputs else reads_param).add(node)
            continue
        if node.op in ("get_attr", "output"):
            continue
        ins = node.all_input_nodes
        if any(a in reads_input for a in ins):
            reads_input.add(node)
        if any(a in reads_param for a in ins):
            reads_param.add(node)
        if node not in reads_input or node not in reads_param:
            continue
        layer = layer_of(module_path(node), layer_prefix)
        hinted[node] = layer is not None
        hint = stage_of_layer.get(layer, 0) if layer is not None else 0
        stage[node] = max([hint] + [stage[a] for a in ins if a in stage])  # the earliest it can run
    last = max(stage_of_layer.values(), default=0)
    for node in reversed(list(stage)):  # a node outside the layers runs as late as its readers allow
        if not hinted[node]:
            later = [last if u.op == "output" else stage[u] for u in node.users if u.op == "output" or u in stage]
            stage[node] = min(later, default=stage[node])
    return stage


def split_stages(gm: fx.GraphModule, user_inputs, stage: dict, n_stages: int) -> list[StageGraph]:
    """Cut `gm` into n_stages StageGraphs by `stage` (from assign_stages)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    used = {s: set() for s in range(n_stages)}
    for node, s in stage.items():
        for user in node.users:
            t = n_stages - 1 if user.op == "output" else stage.get(user)
            if t is None:
                raise SplitError(f"node {node.name} ({module_path(node) or 'model'}) carries activations into "
                                 f"{user.name}, which reads no activation; this graph cannot be cut into stages")
            if t < s:
                raise SplitError(f"node {user.name} on stage {t} reads {node.name} from later stage {s}")
            for b in range(s, t):
                used[b].add(node)
    crossing = [sorted(used[b], key=order.get) for b in range(n_stages - 1)]
    user_inputs = set(user_inputs)
    out = []
    for s in range(n_stages):
        received = crossing[s - 1] if s else []
        sent = crossing[s] if s < n_stages - 1 else [a for a in flat_out if isinstance(a, fx.Node)]
        mine = [n for n, t in stage.items() if t == s]
        needed = set(mine)
        todo = list(mine) + [v for v in sent if v not in stage]  # outputs that carry no activation
        placeholders = set()
        while todo:
            node = todo.pop()
            needed.add(node)
            for a in node.all_input_nodes:
                if a.op == "placeholder":
                    placeholders.add(a)
                elif a not in stage and a not in needed:
                    todo.append(a)
        have = set(received)
        for n in mine:
            for a in n.all_input_nodes:
                if a in stage and stage[a] != s and a not in have:
                    raise SplitError(f"stage {s} reads {a.name} from stage {stage[a]} but does not receive it")
        graph = fx.Graph()
        env = {}
        for v in received:
            env[v] = graph.placeholder(f"recv_{v.name}")
        inputs = [p for p in gm.graph.nodes if p.op == "placeholder" and p in placeholders and p.target in user_inputs]
        params = [p for p in gm.graph.nodes if p.op == "placeholder" and p in placeholders
                  and p.target not in user_inputs]
        for p in inputs + params:
            env[p] = graph.placeholder(p.target)
            env[p].meta = dict(p.meta)
        for node in sorted(needed - set(received), key=order.get):
            if node.op == "placeholder":
                continue
            env[node] = graph.node_copy(node, lambda a: env[a])
        if s < n_stages - 1:
            graph.output(tuple(env[v] for v in sent))
        else:
            graph.output(tuple(fx.map_arg(a, lambda x: env[x]) for a in flat_out))
        graph.lint()
        module = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        out.append(StageGraph(s, module, [v.name for v in received], [p.target for p in inputs],
                              [p.target for p in params], [v.name for v in sent]))
    return out
