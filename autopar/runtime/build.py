"""What compile builds before the model class: the per-rank graph (trace, then the passes:
the plan written in, collectives between layouts, local shapes, device, random streams)
and this rank's initial parameter shards."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.passes.annotate import PlanMismatch, annotate
from autopar.passes.collectives import insert_collectives, local_input_layouts
from autopar.passes.localize import localize, place_on
from autopar.passes.modes import ModeSwitch, mode_switch
from autopar.passes.shard_params import init_sharded, shard_full_model
from autopar.plan.plan import Plan
from autopar.cost.precision import cast_for_trace, meta_inputs
from autopar.trace.export import TraceError, graph_signature, trace

from autopar.runtime.inputs import expected_inputs
from autopar.runtime.process import device_of
from autopar.runtime.rng import RandomStreams

log = logging.getLogger("autopar")


@dataclass
class Rewritten:
    """What `rewrite` makes of a model and a plan: the traced training graph, the per-rank
    graph the passes made of it, how it switches to eval mode, its random streams, and
    (local_inputs) the layout of each user input."""

    traced: object
    graph: object
    modes: ModeSwitch
    streams: RandomStreams
    inputs: list          # runtime.inputs.Expected per user input
    grad_sync: dict       # parameter name -> mesh axes the runtime all-reduces its gradient over
    output_reduce: dict   # output index -> Move of a Partial scalar the runtime sums (the loss)
    input_layouts: list | None = None


def rewrite(model, plan: Plan, groups, example_inputs, example_kwargs, precision, device_type: str,
            seed_of_job: int, local_inputs: bool = False) -> Rewritten:
    """Trace `model` (cast to param_dtype under mixed precision) in train and eval mode and
    run the passes on the training graph: the plan written into it, collectives between
    layouts, local shapes, the device, random ops on their streams (autopar/runtime/rng.py)."""
    if precision is not None:
        example_inputs, example_kwargs = meta_inputs((tuple(example_inputs), example_kwargs))
        model = cast_for_trace(model, precision.param_dtype)
    traced = trace(model, tuple(example_inputs), example_kwargs)
    if plan.graph and plan.graph != graph_signature(traced.graph):
        raise PlanMismatch(f"the plan was made for another graph than this model traces to (graph signature "
                           f"{plan.graph}, this model's {graph_signature(traced.graph)}): another model, size, "
                           f"input shape or dtype. Plan again for this model and these inputs")
    try:
        evaluated = trace(model, tuple(example_inputs), example_kwargs, mode="eval")
        modes = mode_switch(traced.graph, evaluated.graph, traced.buffers)
    except TraceError as exc:  # training needs only the training graph; eval mode says why it is missing
        modes = ModeSwitch(reason=f"the model could not be traced in eval mode ({exc})")
    expected = expected_inputs(traced.graph, traced.user_inputs)
    gm = traced.graph
    annotate(gm, plan, traced.params, traced.tied)
    input_layouts = local_input_layouts(gm, set(traced.user_inputs)) if local_inputs else None
    inserted = insert_collectives(gm, plan, groups, defer=param_names(traced))
    localize(gm, plan)
    device = device_of(device_type)
    place_on(gm, device)
    streams = RandomStreams(seed_of_job, groups, device)
    streams.install(gm)
    return Rewritten(traced, gm, modes, streams, expected, inserted.grad_sync, inserted.output_reduce, input_layouts)


def initial_shards(model, placements: dict, groups, on_meta: bool, seed, parts) -> dict:
    """This rank's shards of the parameters (and parts of fused ones) in `placements`:
    initialised shard by shard from a meta model, else sliced."""
    if on_meta:
        return init_sharded(model, placements, groups, seed, parts)
    return shard_full_model(model, placements, groups, _rank0_values(model), parts)


def _rank0_values(model) -> dict:
    """Parameters whose values differ between the ranks' models (built unseeded, or after
    seeding each rank differently), as rank 0 holds them; DDP starts from rank 0's weights
    for the same reason.  The user's model is left as it is.  One all-gather of two sums per
    parameter finds them; only those are broadcast."""
    params = dict(model.named_parameters())
    names = list(params)
    device = device_of("cuda" if dist.get_backend() == "nccl" else "cpu")
    local = torch.tensor([[params[n].detach().double().sum().item(), params[n].detach().double().abs().sum().item()]
                          for n in names], dtype=torch.float64, device=device).reshape(len(names), 2)
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    odd = [n for i, n in enumerate(names) if any(not torch.equal(e[i], every[0][i]) for e in every[1:])]
    if not odd:
        return {}
    if dist.get_rank() == 0:
        log.warning("the ranks' models hold different values in %d parameters (e.g. %s): every rank starts from "
                    "rank 0's (seed every rank alike before building the model to avoid this)", len(odd), odd[0])
    out = {}
    for n in odd:
        t = params[n].detach().to(device, copy=True).contiguous()
        dist.broadcast(t, src=0)
        out[n] = t.cpu()
    return out


def param_names(traced) -> dict:
    """placeholder -> the parameter's name (tied weights: several placeholders, one name)."""
    return {ph: traced.tied.get(name, name) for ph, name in traced.params.items()}
