"""What compile builds before the model class: this rank's graph (the model traced, the
passes run on it by autopar/passes/rewrite.py) with its run-time objects bound, and this
rank's initial parameter shards.

Binding (passes/slots.py): the passes' graphs read the process groups, the random
streams and the ZeRO-3 gathers from named slots; rank_graph binds the first two on every
graph the rank runs and wraps each recomputed layer's body in its checkpointed Region;
bind_gathers binds each graph's Regather once the rank's state (its disk store) exists.
Nothing here edits a graph."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from autopar.passes.modes import ModeSwitch, mode_switch
from autopar.passes.rewrite import Part, Rewritten, rewrite
from autopar.passes.slots import GATHERS, GROUPS, STREAMS, bind
from autopar.passes.shard_params import init_sharded, shard_full_model
from autopar.report.plan import Plan
from autopar.cost.precision import cast_for_trace, meta_inputs
from autopar.trace.export import TraceError, trace

from autopar.runtime.checks.inputs import expected_inputs
from autopar.runtime.process import device_of
from autopar.runtime.regions.recompute import wrap_regions
from autopar.runtime.regions.reshard import Regather, offloaded_weights
from autopar.runtime.regions.rng import RandomStreams

log = logging.getLogger("autopar")


@dataclass(frozen=True, kw_only=True)
class RankGraph(Rewritten):
    """The passes' Rewritten as this rank runs it: its graphs' process groups and random
    `streams` bound, its recomputed layers Regions; inputs: the runtime.checks.inputs.Expected
    of each user input, read before the passes (global shapes)."""

    streams: RandomStreams
    inputs: list

    def __str__(self) -> str:
        return f"{super().__str__()}; {len(self.streams.sites)} random ops on streams"


def rank_graph(model, plan: Plan, groups, example_inputs, example_kwargs, precision, device_type: str,
               seed_of_job: int, local_inputs: bool = False) -> RankGraph:
    """Trace `model` (cast to param_dtype under mixed precision) in train mode (eval mode on
    the first eval(): eval_switch), run the passes on the training graph
    (autopar/passes/rewrite.py), then bind the graphs' process groups and random streams
    (autopar/runtime/regions/rng.py) and wrap their recomputed layers."""
    if precision is not None:
        example_inputs, example_kwargs = meta_inputs((tuple(example_inputs), example_kwargs))
        model = cast_for_trace(model, precision.param_dtype)
    traced = trace(model, tuple(example_inputs), example_kwargs)
    expected = expected_inputs(traced.graph, traced.user_inputs)
    evaluated = eval_switch(model, tuple(example_inputs), example_kwargs)
    device = device_of(device_type)
    rewritten = rewrite(traced, plan, evaluated=evaluated, local_inputs=local_inputs, device=device)
    streams = RandomStreams(seed_of_job, groups, device, rewritten.random)
    bind_rank(rewritten, groups, streams)
    return RankGraph(**{f.name: getattr(rewritten, f.name) for f in fields(Rewritten)}, streams=streams,
                     inputs=expected)


def bind_rank(rewritten: Rewritten, groups, streams: RandomStreams) -> None:
    """Bind the process groups and the random streams on every graph of `rewritten` (the
    whole graph and the parts) and wrap each part's recomputed layers in their Regions."""
    for gm in {id(g): g for g in [rewritten.graph, *(p.graph for p in rewritten.parts)]}.values():
        bind(gm, GROUPS, groups)
        bind(gm, STREAMS, streams)
    for part in rewritten.parts:
        wrap_regions(part.graph, part.regions, streams, replays=part.stage is not None)


def bind_gathers(part: Part, rewritten: Rewritten, plan: Plan, groups, options, device, disk) -> Regather:
    """The Regather of one graph's ZeRO-3 gathers and host fetches (part.gathers), bound to
    its GATHERS slot; options: the job's RunOptions (reshard_after_forward, bucket size);
    disk: the rank's DiskStore (None: no disk tier)."""
    traced = rewritten.traced
    regather = Regather(part.gathers, options.reshard_after_forward, groups, options.bucket_bytes,
                        offloaded_weights(plan, traced.params, traced.tied), device, disk)
    bind(part.graph, GATHERS, regather)
    return regather


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
