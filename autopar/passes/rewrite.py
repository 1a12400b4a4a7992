"""rewrite: the per-rank graph from a traced training graph and a plan, every pass in one place.

    rewritten = rewrite(traced, plan, groups, evaluated=...)

runs, in this order, on `traced.graph` (in place):

1. the plan's graph signature checked against the graph's (PlanMismatch: plan again);
2. modes.mode_switch: the constants that differ between the training graph and the
   eval-mode trace, recorded before any pass adds nodes (the two graphs are walked side
   by side, node for node);
3. annotate: the plan's NodeChoice of every node into node.meta["autopar"];
4. collectives.local_input_layouts (local_inputs=True only): each user input laid out as
   its first reader reads it, so callers pass their shard;
5. collectives.insert_collectives: a `move` on every edge whose layouts differ (the
   runtime all-reduces the parameters' Partial gradients itself: Rewritten.grad_sync);
6. localize: view/reshape sizes, means and losses, embeddings, attention and experts
   in their per-rank forms.

The result holds only what the passes made; nothing here touches a device or a process
group (`groups` is stored on the graph and read when it runs).  What the runtime does to
the graph afterwards, and where (autopar/runtime/build.py unless named):

- localize.place_on: tensor-making ops moved to this rank's device;
- RandomStreams.install (autopar/runtime/regions/rng.py): random ops draw from streams numbered
  over the whole graph, so it runs before any cut below;
- pipeline_split (plan.pipeline): `stage_graphs(rewritten, plan)` below, called by
  autopar/runtime/pipeline/pipelined.py after those two, so every stage's graph has them;
- recompute.outline_layers (plan.recompute): autopar/runtime/regions/recompute.apply_recompute,
  on the whole graph (autopar/runtime/compiled.py) or on each stage's graph (pipelined.py),
  after ZeRO-3's regathering has read the graph: its regions are runtime modules that run
  under activation checkpointing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autopar.report.plan import Plan
from autopar.trace.export import TraceError, Traced, graph_signature

from autopar.passes.annotate import PlanMismatch, annotate
from autopar.passes.collectives import insert_collectives, local_input_layouts, move
from autopar.passes.localize import localize
from autopar.passes.modes import ModeSwitch, mode_switch
from autopar.passes.pipeline_split import StageGraph, assign_stages, layer_stages, split_stages


@dataclass(frozen=True)
class Rewritten:
    """What the passes make of a traced training graph and a plan.

    traced: the trace (its graph is `graph`, rewritten in place); graph: the per-rank
    graph, graph(*placeholders) with parameters as this rank's shards and user inputs
    global (or this rank's shards, see input_layouts); modes: how to switch it to eval mode
    and back; grad_sync: parameter name -> mesh axes its gradient is still Partial on (the
    runtime all-reduces it, bucketed); output_reduce: output index -> the Move of a Partial
    scalar (the loss) the runtime sums; input_layouts: each user input's layout, when the
    caller passes shards (None: global inputs)."""

    traced: Traced
    graph: fx.GraphModule
    modes: ModeSwitch
    grad_sync: dict
    output_reduce: dict
    input_layouts: list | None = None

    def __str__(self) -> str:
        moves = sum(1 for n in self.graph.graph.nodes if n.op == "call_function" and n.target is move)
        return (f"per-rank graph of {len(self.graph.graph.nodes)} nodes, {moves} moves; gradient all-reduce "
                f"of {len(self.grad_sync)} parameters and {len(self.output_reduce)} outputs left to the runtime; "
                f"{self.modes}")


def param_names(traced: Traced) -> dict:
    """placeholder -> the parameter's name (tied weights: several placeholders, one name)."""
    return {ph: traced.tied.get(name, name) for ph, name in traced.params.items()}


def rewrite(traced: Traced, plan: Plan, groups, *, evaluated: Traced | TraceError | ModeSwitch | None = None,
            local_inputs: bool = False) -> Rewritten:
    """Run the passes on `traced.graph` in place (see the module docstring).

    groups: the AxisGroups the moves run over (stored on the graph, used only when it
    runs). evaluated: the same model traced in eval mode, or the TraceError tracing it
    raised, or the ModeSwitch itself (one that traces eval mode when first asked), or None:
    without an eval graph the result trains but cannot switch to eval (modes.reason says
    why). local_inputs: lay user inputs out as their first readers read them
    (Rewritten.input_layouts)."""
    gm = traced.graph
    if plan.graph and plan.graph != graph_signature(gm):
        raise PlanMismatch(f"the plan was made for another graph than this model traces to (graph signature "
                           f"{plan.graph}, this model's {graph_signature(gm)}): another model, size, "
                           f"input shape or dtype. Plan again for this model and these inputs")
    if isinstance(evaluated, ModeSwitch):
        modes = evaluated
    elif isinstance(evaluated, Traced):
        modes = mode_switch(gm, evaluated.graph, traced.buffers)
    elif isinstance(evaluated, TraceError):
        modes = ModeSwitch(reason=f"the model could not be traced in eval mode ({evaluated})")
    else:
        modes = ModeSwitch(reason="it was compiled without an eval-mode trace")
    annotate(gm, plan, traced.params, traced.tied)
    input_layouts = local_input_layouts(gm, set(traced.user_inputs)) if local_inputs else None
    inserted = insert_collectives(gm, plan, groups, defer=param_names(traced))
    localize(gm, plan)
    return Rewritten(traced, gm, modes, inserted.grad_sync, inserted.output_reduce, input_layouts)


def stage_graphs(rewritten: Rewritten, plan: Plan) -> list[StageGraph]:
    """The per-rank graph cut into plan.pipeline's stages (passes/pipeline_split.py): stage
    s computes the layers plan.pipeline.stages[s] names and sends what later stages read."""
    info = plan.pipeline
    if info is None or not info.stages:
        raise ValueError("the plan has no pipeline stages; plan with pipeline=True (or an autopar.Pipeline)")
    user_inputs = rewritten.traced.user_inputs
    stage_of = assign_stages(rewritten.graph, user_inputs, info.layer_prefix,
                             layer_stages(info.stages, info.layer_indices))
    return split_stages(rewritten.graph, user_inputs, stage_of, len(info.stages))
