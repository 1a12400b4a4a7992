"""rewrite: the per-rank graph from a traced training graph and a plan, every pass in one place.

    rewritten = rewrite(traced, plan, evaluated=..., device=...)

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
   in their per-rank forms;
7. localize.place_on (device given): tensor-making ops on the rank's device;
8. random_ops.route_random: every random op draws from its stream, numbered over the
   whole graph (so before the cut below);
9. pipeline_split (a pipelined plan): the graph cut into plan.pipeline's stages;

then on each graph the runtime runs (the whole graph, or each stage's: Rewritten.parts):

10. fold_linears.fold_linear_gradients (plan.tp_overlap, and a schedule that keeps
    backward whole): tensor-parallel collectives beside their linears' GEMMs;
11. gathers.mark_gathers: ZeRO-3's weight gathers and offloaded weights' fetches;
12. recompute.outline_recompute (plan.recompute): each recomputed layer cut into a region
    body, after 11 so that a layer's gathers run again with it.

The result holds only what the passes made: nothing here touches a process group or a
random generator.  What the graphs read at run time they read from named slots
(passes/slots.py: the process groups, the random streams, the gathers), which the runtime
binds (autopar/runtime/build.py), where it also wraps each region body in its
checkpointed Region.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.cost.schedules import folds_tp
from autopar.report.plan import Plan
from autopar.trace.export import TraceError, Traced, graph_signature

from autopar.passes.annotate import PlanMismatch, annotate
from autopar.passes.collectives import insert_collectives, local_input_layouts, move
from autopar.passes.fold_linears import fold_linear_gradients, kept_nodes
from autopar.passes.gathers import GatherSites, mark_gathers
from autopar.passes.localize import localize, place_on
from autopar.passes.modes import ModeSwitch, mode_switch
from autopar.passes.pipeline_split import StageGraph, assign_stages, layer_stages, split_stages
from autopar.passes.random_ops import route_random
from autopar.passes.recompute import outline_recompute


@dataclass(frozen=True)
class Part:
    """One graph the runtime runs: the whole per-rank graph (stage None) or one pipeline
    stage's (stage: its StageGraph, whose graph_module is `graph`).  folded: the linears'
    collectives folded beside their GEMMs; gathers: the GatherSites of its ZeRO-3 gathers;
    regions: the RegionSites of its recomputed layers."""

    graph: fx.GraphModule
    stage: StageGraph | None
    folded: int
    gathers: GatherSites
    regions: tuple

    def __str__(self) -> str:
        where = "whole graph" if self.stage is None else f"stage {self.stage.index}"
        return (f"{where}: {len(self.graph.graph.nodes)} nodes, {self.folded} folded linears, {self.gathers}, "
                f"{len(self.regions)} recomputed regions")


@dataclass(frozen=True)
class Rewritten:
    """What the passes make of a traced training graph and a plan.

    traced: the trace (its graph is `graph`, rewritten in place); graph: the per-rank
    graph, graph(*placeholders) with parameters as this rank's shards and user inputs
    global (or this rank's shards, see input_layouts); modes: how to switch it to eval mode
    and back; grad_sync: parameter name -> mesh axes its gradient is still Partial on (the
    runtime all-reduces it, bucketed); output_reduce: output index -> the Move of a Partial
    scalar (the loss) the runtime sums; output_layouts: output index -> placements of a large
    output returned as it lies (ops.returned_split); input_layouts: each user input's layout, when the
    caller passes shards (None: global inputs); random: the RandomSites of the graph's
    random ops (passes/random_ops.py); parts: the graphs the runtime runs (Part: the whole
    graph, or each pipeline stage's)."""

    traced: Traced
    graph: fx.GraphModule
    modes: ModeSwitch
    grad_sync: dict
    output_reduce: dict
    input_layouts: list | None = None
    random: tuple = ()
    parts: tuple = ()
    output_layouts: dict = field(default_factory=dict)

    def __str__(self) -> str:
        moves = sum(1 for n in self.graph.graph.nodes if n.op == "call_function" and n.target is move)
        return (f"per-rank graph of {len(self.graph.graph.nodes)} nodes, {moves} moves, {len(self.random)} random "
                f"ops on streams, {len(self.parts)} part(s); gradient all-reduce of {len(self.grad_sync)} parameters "
                f"and {len(self.output_reduce)} outputs left to the runtime; {self.modes}")


def param_names(traced: Traced) -> dict:
    """placeholder -> the parameter's name (tied weights: several placeholders, one name)."""
    return {ph: traced.tied.get(name, name) for ph, name in traced.params.items()}


def rewrite(traced: Traced, plan: Plan, *, evaluated: Traced | TraceError | ModeSwitch | None = None,
            local_inputs: bool = False, device: torch.device | None = None) -> Rewritten:
    """Run the passes on `traced.graph` in place (see the module docstring).

    evaluated: the same model traced in eval mode, or the TraceError tracing it raised, or
    the ModeSwitch itself (one that traces eval mode when first asked), or None: without an
    eval graph the result trains but cannot switch to eval (modes.reason says why).
    local_inputs: lay user inputs out as their first readers read them
    (Rewritten.input_layouts).  device: where the rank runs (None: tensor-making ops stay
    on the device they were traced on)."""
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
    inserted = insert_collectives(gm, plan, defer=param_names(traced))
    localize(gm, plan)
    if device is not None:
        place_on(gm, device)
    random = route_random(gm)
    pipelined = plan.pipeline is not None and plan.pipeline.pipelined
    graphs = [(st.graph_module, st) for st in stage_graphs(gm, traced.user_inputs, plan)] if pipelined \
        else [(gm, None)]
    fold = plan.tp_overlap and (not pipelined or folds_tp(plan.pipeline.schedule))
    sizes, params, off_device = tuple(plan.mesh.shape), set(traced.params), offloaded(traced, plan)
    grouped = frozenset() if pipelined else bucketable(traced, plan, inserted.grad_sync)
    parts = []
    for g, stage in graphs:   # steps 10-12 on each graph the runtime runs
        folded = fold_linear_gradients(g, sizes, kept_nodes(plan)) if fold else 0
        gathers = mark_gathers(g, params, sizes, grouped=grouped, offloaded=off_device)
        parts.append(Part(g, stage, folded, gathers, outline_recompute(g, plan.recompute)))
    return Rewritten(traced, gm, modes, inserted.grad_sync, inserted.output_reduce, input_layouts, random,
                     tuple(parts), dict(inserted.output_layouts))


def bucketable(traced: Traced, plan: Plan, grad_sync: dict) -> frozenset:
    """The parameter placeholders whose ZeRO-3 gathers may share buckets: those whose
    gradient nothing else synchronises (no all-reduce left to the runtime, no ZeRO stage)."""
    return frozenset(ph for ph, name in traced.params.items()
                     if not grad_sync.get(name) and not getattr(plan.param_states.get(name), "stage", 0))


def offloaded(traced: Traced, plan: Plan) -> frozenset:
    """The parameter placeholders whose plan keeps the stored weight off the device (host or disk)."""
    return frozenset(ph for ph, name in traced.params.items()
                     if getattr(plan.param_states.get(traced.tied.get(name, name)), "weights", False))


def stage_graphs(gm: fx.GraphModule, user_inputs, plan: Plan) -> list[StageGraph]:
    """The per-rank graph gm cut into plan.pipeline's stages (passes/pipeline_split.py): stage
    s computes the layers plan.pipeline.stages[s] names and sends what later stages read."""
    info = plan.pipeline
    if info is None or not info.stages:
        raise ValueError("the plan has no pipeline stages; plan with pipeline=True (or an autopar.Pipeline)")
    stage_of = assign_stages(gm, user_inputs, info.layer_prefix, layer_stages(info.stages, info.layer_indices))
    return split_stages(gm, user_inputs, stage_of, len(info.stages))
