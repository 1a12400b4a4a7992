"""The passes that once ran in the runtime, each on a small graph of its own: the graph
computes the same before and after the pass (torch.fx's split_module tests are the model),
and what a graph reads at run time it reads from slots the runtime binds
(autopar/passes/slots.py)."""
from __future__ import annotations

import dataclasses
import operator
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.collectives import Move, move
from autopar.passes.gathers import fetch, gather, mark_gathers
from autopar.passes.localize import place_on
from autopar.passes.random_ops import draw, route_random
from autopar.passes.recompute import outline_recompute
from autopar.passes.rewrite import rewrite
from autopar.passes.slots import GATHERS, GROUPS, STREAMS, SlotError, Unbound, bind, declared
from autopar.runtime.regions.recompute import Region, wrap_regions
from autopar.runtime.regions.rng import RandomStreams
from autopar.trace.export import trace
from autopar.passes.shard_params import shard_full_model
from test_passes import X, OneRank, PlainGathers, WorldAxis, feed, on_ranks, placeholders
from test_passes import megatron   # noqa: F401 (a fixture)

R, S0, P = Replicate(), Shard(0), Partial()
DROPOUT = torch.ops.aten.native_dropout.default


def _dropout_graph() -> fx.GraphModule:
    """x [4, 6] -> native_dropout(p=0.5) -> relu: one random op, its output Shard(0) on
    mesh axis 0 of two (node.meta["autopar"] as annotate writes it)."""
    g = fx.Graph()
    x = g.placeholder("x")
    dropped = g.call_function(DROPOUT, (x, 0.5, True))
    dropped.meta["autopar"] = SimpleNamespace(outputs=[(S0, R)])
    out = g.call_function(torch.ops.aten.relu.default, (g.call_function(operator.getitem, (dropped, 0)),))
    g.output((out,))
    return fx.GraphModule(nn.Module(), g)


def test_random_routing_draws_each_site_from_its_stream_and_keeps_the_op():
    """route_random numbers the one site, notes its split axes (0: Shard on axis 0, not axis
    1), and the routed graph computes what the plain op computes with the generator at the
    site's seed; ranks apart on axis 0 draw apart, ranks apart on axis 1 alike."""
    x = torch.randn(4, 6)
    before = _dropout_graph()
    gm = _dropout_graph()
    sites = route_random(gm)
    assert [(s.op, s.split) for s in sites] == [(DROPOUT, (0,))]
    (node,) = [n for n in gm.graph.nodes if n.target is draw]
    assert node.meta["aten_target"] is DROPOUT and node.kwargs["_autopar_site"] == 0
    assert declared(gm) == {STREAMS}
    streams = RandomStreams(11, OneRank((2, 2), (1, 0)), torch.device("cpu"), sites)
    assert bind(gm, STREAMS, streams) == 1
    state = torch.get_rng_state()
    got = gm(x)[0]
    assert torch.equal(torch.get_rng_state(), state)   # the user's random state is untouched
    torch.manual_seed(streams.seed_of(0))
    torch.testing.assert_close(got, before(x)[0], rtol=0, atol=0)
    seeds = {c: RandomStreams(11, OneRank((2, 2), c), torch.device("cpu"), sites).seed_of(0)
             for c in [(0, 0), (1, 0), (0, 1)]}
    assert seeds[(0, 0)] != seeds[(1, 0)] and seeds[(0, 0)] == seeds[(0, 1)]


def test_a_graph_run_before_its_slots_are_bound_names_the_slot():
    gm = _dropout_graph()
    route_random(gm)
    with pytest.raises(SlotError, match="_autopar_streams.*not bound.*autopar.compile"):
        gm(torch.randn(4, 6))


def test_rewrite_holds_no_process_group_and_binding_makes_it_run(megatron):
    """The passes' graph reads its groups from an unbound slot; bound, it trains as before."""
    model, plan = megatron
    traced = trace(model, (X,))
    gm = rewrite(traced, plan).graph
    assert declared(gm) == {GROUPS} and isinstance(gm._autopar_groups, Unbound)
    args = feed(traced, placeholders(gm), shard_full_model(model, plan.param_placements, OneRank((2,), (0,))),
                {"x": X})
    with pytest.raises(SlotError, match="_autopar_groups"):
        gm(*args)
    assert bind(gm, GROUPS, WorldAxis()) == 1 and declared(gm) == set()


def test_place_on_runs_tensor_making_ops_on_the_rank_device():
    """An arange traced on the meta device: the graph cannot run on CPU until place_on."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(torch.ops.aten.arange.default, (4,), {"device": torch.device("meta"),
                                                                "dtype": torch.float32})
    g.output((g.call_function(torch.ops.aten.add.Tensor, (x, r)),))
    gm = fx.GraphModule(nn.Module(), g)
    x = torch.randn(3, 4)
    with pytest.raises((RuntimeError, NotImplementedError)):
        gm(x)
    place_on(gm, torch.device("cpu"))
    torch.testing.assert_close(gm(x)[0], x + torch.arange(4.0))


class _Recorded(PlainGathers):
    """A GATHERS slot that runs each gather as its plain move and notes the calls."""

    def __init__(self):
        self.calls = []

    def gather(self, k, x, m, groups):
        self.calls.append(("gather", k))
        return super().gather(k, x, m, groups)

    def fetch(self, x):
        self.calls.append(("fetch",))
        return x.clone()


def _gather_graph() -> fx.GraphModule:
    """w [4, 3] stored Shard(0) on a mesh axis of two, all-gathered (its gradient
    reduce-scattered back) for x @ w; b read as stored by an add."""
    root = nn.Module()
    root.m = Move((S0,), (R,), (P,), (S0,))
    g = fx.Graph()
    x, w, b = (g.placeholder(n) for n in ("x", "w", "b"))
    with g.inserting_after(b):
        groups = g.get_attr(GROUPS)
    root._autopar_groups = Unbound(GROUPS)   # (as passes/slots.slot declares it)
    whole = g.call_function(move, (w, g.get_attr("m"), groups))
    y = g.call_function(torch.ops.aten.mm.default, (x, whole))
    g.output((g.call_function(torch.ops.aten.add.Tensor, (y, b)),))
    return fx.GraphModule(root, g)


def test_mark_gathers_numbers_the_weight_gathers_and_fetches_offloaded_weights_the_same_values():
    """One gather (k=0, bucketable: one all-gather forward, one reduce-scatter backward on
    axis 0, dim 0) and one fetch of the offloaded b; on two ranks the marked graph gives
    the unmarked graph's output and gradients, every gather and fetch through the slot."""
    sites = mark_gathers(_gather_graph(), {"w", "b"}, (2,), grouped=frozenset({"w"}), offloaded=frozenset({"b"}))
    assert len(sites.order) == 1 and sites.order[0][0] == "w" and sites.flat == {0: (0, 0)} and sites.fetches == 1
    assert "1 weight gathers (1 bucketable), 1 host fetches" == str(sites)
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 4), torch.randn(4, 3), torch.randn(3)

    def job(rank):
        out = []
        for marked in (False, True):
            gm = _gather_graph()
            recorded = _Recorded()
            if marked:
                mark_gathers(gm, {"w", "b"}, (2,), grouped=frozenset({"w"}), offloaded=frozenset({"b"}))
                assert [n.target for n in gm.graph.nodes if n.target in (gather, fetch)] == [gather, fetch]
                bind(gm, GATHERS, recorded)
            bind(gm, GROUPS, WorldAxis())
            shard = w[2 * rank: 2 * rank + 2].clone().requires_grad_()
            y = gm(x, shard, b)[0]
            y.sum().backward()
            out.append((y.detach(), shard.grad, sorted(recorded.calls)))
        return out
    for plain, marked in on_ranks(job):
        torch.testing.assert_close(marked[0], plain[0], rtol=0, atol=0)
        torch.testing.assert_close(marked[1], plain[1], rtol=0, atol=0)
        assert plain[2] == [] and marked[2] == [("fetch",), ("gather", 0)]


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_outline_recompute_cuts_each_layer_into_a_body_that_computes_the_same(mode):
    """blocks.0 and blocks.1 become region bodies (submodules) called in their place;
    under selective the kept product runs wrapped by `kept`; the graph's output and
    gradients equal the uncut graph's, bodies run plainly or wrapped in checkpointed Regions."""
    torch.manual_seed(0)
    model = _Layers().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    traced = trace(model, (x,), cache=False)
    gm = traced.graph
    params = dict(model.named_parameters())
    order = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def run(graph):
        leaves = {name: p.detach().clone().requires_grad_() for name, p in params.items()}
        args = [leaves[traced.params[n.target]] if n.target in traced.params else x for n in order]
        out = graph(*args)[0]
        out.backward()
        return out.detach(), [leaves[name].grad for name in params]
    want = run(gm)
    products = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    recompute = SimpleNamespace(layers={"blocks.0": mode, "blocks.1": mode}, kept=products[:1], whole=())
    sites = outline_recompute(gm, recompute)
    assert [(s.name, s.path, s.mode) for s in sites] == [
        ("_autopar_recompute_0", "blocks.0", mode), ("_autopar_recompute_1", "blocks.1", mode)]
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == [s.name for s in sites]
    wrapped = [n for s in sites for n in gm.get_submodule(s.name).graph.nodes
               if hasattr(n.target, "_autopar_kept")]
    assert len(wrapped) == (1 if mode == "selective" else 0)
    for got, w in zip(run(gm), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    regions = wrap_regions(gm, sites, None)
    assert all(isinstance(r, Region) for r in regions) and len(regions) == 2
    for got, w in zip(run(gm), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


def test_rewrite_cuts_a_pipelined_plan_into_parts_and_folds_only_where_the_schedule_keeps_backward_whole(megatron):
    """A plan without stages is one part, the whole graph; tp_overlap folds its linears."""
    model, plan = megatron
    rewritten = rewrite(trace(model, (X,)), plan)
    (part,) = rewritten.parts
    assert part.stage is None and part.graph is rewritten.graph and part.folded == 1
    assert "whole graph" in str(part)
    off = rewrite(trace(model, (X,)), dataclasses.replace(plan, tp_overlap=False))
    assert off.parts[0].folded == 0
