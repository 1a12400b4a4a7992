"""annotate: write the plan's choice of every node into the graph (node.meta["autopar"]).

Reads: a training-IR GraphModule traced from the same model and inputs as the plan.
Writes: node.meta["autopar"] = NodeChoice for planned nodes; parameter placeholders that
alias an earlier one (tied weights) get node.meta["autopar_alias"] = that placeholder.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.ops import NO_OUTPUT, op_name, outputs_of
from autopar.report.plan import Plan


class PlanMismatch(ValueError):
    """The plan was made for a different graph (another model, input shape or version)."""


def annotate(gm: fx.GraphModule, plan: Plan, params: dict, tied: dict) -> fx.GraphModule:
    """params: placeholder -> parameter name; tied: parameter name -> name it is listed under."""
    by_name = {n.name: n for n in plan.nodes}
    canonical = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.target in params:
            name = tied.get(params[node.target], params[node.target])
            if name in canonical:
                node.meta["autopar_alias"] = canonical[name]
                continue
            canonical[name] = node
        choice = by_name.get(node.name)
        if choice is not None:
            node.meta["autopar"] = choice
        elif node.op == "call_function" and node.meta.get("val") is not None and _planned_kind(node):
            raise PlanMismatch(f"node {node.name} ({node.target}) is not in the plan: the plan was made for "
                               f"another model or input shape; plan again (autopar.plan) for this one")
    missing = set(by_name) - {n.name for n in gm.graph.nodes}
    if missing:
        raise PlanMismatch(f"plan names nodes {sorted(missing)[:5]} that this model's graph does not have; "
                           f"plan again for this model and these input shapes")
    return gm


def _planned_kind(node: fx.Node) -> bool:
    name = op_name(node)
    return name != "getitem" and name not in NO_OUTPUT and bool(outputs_of(node))
