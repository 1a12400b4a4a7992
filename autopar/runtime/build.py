"""What compile builds before the model class: this rank's graph (the model traced, the
passes run on it by autopar/passes/rewrite.py, then placed on this rank's device with its
random ops on their streams) and this rank's initial parameter shards."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from autopar.passes.localize import place_on
from autopar.passes.modes import ModeSwitch, mode_switch
from autopar.passes.rewrite import Rewritten, rewrite
from autopar.passes.shard_params import init_sharded, shard_full_model
from autopar.report.plan import Plan
from autopar.cost.precision import cast_for_trace, meta_inputs
from autopar.trace.export import TraceError, trace

from autopar.runtime.checks.inputs import expected_inputs
from autopar.runtime.process import device_of
from autopar.runtime.regions.rng import RandomStreams

log = logging.getLogger("autopar")


@dataclass(frozen=True, kw_only=True)
class RankGraph(Rewritten):
    """The passes' Rewritten as this rank runs it: its graph placed on the device, random
    ops drawing from `streams`; inputs: the runtime.checks.inputs.Expected of each user input,
    read before the passes (global shapes)."""

    streams: RandomStreams
    inputs: list

    def __str__(self) -> str:
        return f"{super().__str__()}; {len(self.streams.sites)} random ops on streams"


def rank_graph(model, plan: Plan, groups, example_inputs, example_kwargs, precision, device_type: str,
               seed_of_job: int, local_inputs: bool = False) -> RankGraph:
    """Trace `model` (cast to param_dtype under mixed precision) in train mode (eval mode on
    the first eval(): eval_switch), run the passes on the training graph
    (autopar/passes/rewrite.py), then put the graph on this rank's device and its random ops
    on their streams (autopar/runtime/regions/rng.py)."""
    if precision is not None:
        example_inputs, example_kwargs = meta_inputs((tuple(example_inputs), example_kwargs))
        model = cast_for_trace(model, precision.param_dtype)
    traced = trace(model, tuple(example_inputs), example_kwargs)
    expected = expected_inputs(traced.graph, traced.user_inputs)
    evaluated = eval_switch(model, tuple(example_inputs), example_kwargs)
    rewritten = rewrite(traced, plan, groups, evaluated=evaluated, local_inputs=local_inputs)
    device = device_of(device_type)
    place_on(rewritten.graph, device)
    streams = RandomStreams(seed_of_job, groups, device)
    streams.install(rewritten.graph)
    return RankGraph(**{f.name: getattr(rewritten, f.name) for f in fields(Rewritten)}, streams=streams,
                     inputs=expected)


# Models holding at most this many bytes of weights and buffers off the meta device trace
# their eval graph on the first eval() (eval_switch), holding the plain model until then.
LAZY_EVAL_BYTES = 64 * 2**20


def eval_switch(model, example_inputs: tuple, example_kwargs) -> ModeSwitch:
    """The switch between the training graph and the eval graph of `model`.

    For a small model the eval graph is traced on the first eval()
    (passes/modes.ModeSwitch.derive), from the untouched training graph held now (the trace
    cache's shared copy): most jobs never leave training mode, and for a small model an
    export per rank is most of compiling.  Until then the compiled model holds the plain one,
    which costs nothing on the meta device (mixed precision's cast copy, a model built on
    meta) and little below LAZY_EVAL_BYTES.  A larger model is traced in eval mode now, so
    that the compiled model keeps no reference to its weights (a caller may release them)."""
    train = trace(model, example_inputs, example_kwargs, shared=True)

    def derive() -> ModeSwitch:
        try:
            evaluated = trace(model, example_inputs, example_kwargs, mode="eval", shared=True)
        except TraceError as exc:  # training needs only the training graph; eval mode says why it is missing
            return ModeSwitch(reason=f"the model could not be traced in eval mode ({exc})")
        return mode_switch(train.graph, evaluated.graph, train.buffers)

    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]
                                                      if not t.is_meta}.values())
    return ModeSwitch(derive=derive) if held <= LAZY_EVAL_BYTES else derive()


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
