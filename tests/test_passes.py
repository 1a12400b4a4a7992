"""Each pass alone on a small graph, the `split_module` way: the graph after the pass
computes what the graph before it computed, and the pass changed exactly what it should
(the collectives counted, the view sizes divided, the regions cut).

Everything runs in this process.  A pass that leaves collectives in the graph runs on two
ranks that are threads of a threaded process group (torch's own multi-threaded test
backend: real all-reduces, all-gathers and all-to-alls between threads), so the per-rank
graph of a plan on a (2,) mesh runs, forward and backward, against the plain model.  A
pass that leaves none runs on a world of one.  Float64 models: the split sums differ from
the whole ones only in round-off.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg)

import autopar
from autopar.cost.redistribution import plan_redistribute
from autopar.models import build
from autopar.passes.annotate import PlanMismatch, annotate
from autopar.passes.attention_ops import ring_attention, ulysses_attention
from autopar.passes.collectives import insert_collectives, move
from autopar.passes.fold_linears import linear_then_reduce
from autopar.passes.local_ops import local_cross_entropy, scaled_op, shard_offset, vocab_parallel_embedding
from autopar.passes.localize import localize
from autopar.passes.modes import ModeError, mode_switch
from autopar.passes.pipeline_split import assign_stages, split_stages
from autopar.passes.recompute import outline_layers
from autopar.passes.redistribute import redistribute, redistribute_local
from autopar.passes.rewrite import param_names, rewrite
from autopar.passes.shard_params import init_sharded, shard_full_model, shard_of
from autopar.passes.slots import GATHERS, GROUPS, bind
from autopar.runtime.build import bind_rank
from autopar.runtime.regions.rng import RandomStreams
from autopar.trace.batching import first_microbatch
from autopar.trace.export import TraceError, trace
from autopar.trace.paths import module_path
from reference_layouts import check_layout, global_tensor, local_of

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
TP = autopar.Mesh((2,), ("tp",), device="cpu")
DP = autopar.Mesh((2,), ("dp",), device="cpu")
COMMUNICATING = {"all_gather", "all_reduce", "reduce_scatter", "all_to_all"}


# ---------------------------------------------------------------- two ranks in one process

class WorldAxis:
    """AxisGroups of a 1-D mesh over the whole world: on a thread of on_ranks, its rank."""

    ndim = 1

    def size(self, axis: int) -> int:
        return dist.get_world_size()

    def coordinate(self, axis: int) -> int:
        return dist.get_rank()

    def group(self, axis: int):
        return dist.group.WORLD

    def group_of(self, axes: tuple):
        return dist.group.WORLD


class OneRank:
    """AxisGroups of one rank at `coords` on a mesh of `sizes`, for local-only steps."""

    def __init__(self, sizes: tuple, coords: tuple):
        self.sizes, self.coords = sizes, coords

    def size(self, axis: int) -> int:
        return self.sizes[axis]

    def coordinate(self, axis: int) -> int:
        return self.coords[axis]

    def group(self, axis: int):
        raise AssertionError("a local-only step used a process group")


def on_ranks(fn, world: int = 2, timeout_s: float = 60.0) -> list:
    """[fn(rank) for each rank], every rank a thread in a threaded process group of `world`."""
    results, errors = [None] * world, []
    store = dist.HashStore()

    def worker(rank):
        dist.init_process_group(backend="threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # wake the other ranks out of their collectives
            errors.append((rank, exc))
            ProcessLocalGroup.exception_handle(exc)
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        ProcessLocalGroup.reset()
    assert not stuck, f"ranks {stuck} still running after {timeout_s}s"
    if errors:
        rank, exc = errors[0]
        raise AssertionError(f"rank {rank} failed: {exc!r}") from exc
    return results


# ---------------------------------------------------------------- small models

class MLP(nn.Module):
    """x [4, 8] -> fc1 [4, 16] -> relu -> fc2 [4, 8]: Megatron's column-then-row pair."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, hidden), nn.Linear(hidden, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Heads(MLP):
    """The MLP with its hidden dim viewed as 4 heads of 4 in between: [4, 16] -> [4, 4, 4]."""

    def forward(self, x):
        h = self.fc1(x).view(4, 4, 4)
        return self.fc2(torch.relu(h).view(4, 16))


class Loss(MLP):
    """A mean-squared loss of the MLP: the mean runs over the batch rows."""

    def forward(self, x, target):
        return ((super().forward(x) - target) ** 2).mean()


def made(cls, *args):
    torch.manual_seed(0)
    return cls(*args).double()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
T = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


@pytest.fixture(scope="module")
def megatron():
    """(model, plan): the MLP under Megatron tensor parallelism on tp=2."""
    model = made(MLP)
    return model, autopar.plan(model, TP, (X,), solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))


def feed(traced, placeholders, values: dict, inputs: dict) -> list:
    """The arguments of a graph with `placeholders`: parameters from values (by name),
    buffers from values or the trace's constants, user inputs from inputs (by placeholder)."""
    names = param_names(traced)
    out = []
    for ph in placeholders:
        if ph in names:
            out.append(values[names[ph]])
        elif ph in traced.buffers:
            name = traced.buffers[ph]
            out.append(values[name] if name in values else traced.constants[name])
        else:
            out.append(inputs[ph])
    return out


def placeholders(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def moves(gm: fx.GraphModule) -> list:
    """The Move of every move node of a rewritten graph, in graph order."""
    return [getattr(gm, n.args[1].target) for n in gm.graph.nodes if n.op == "call_function" and n.target is move]


def collectives(gm: fx.GraphModule, sizes: tuple) -> dict:
    """phase -> the communicating steps its moves run (local slices and pads left out)."""
    out = {"forward": [], "backward": []}
    for m in moves(gm):
        out["forward"] += [s.kind for s in plan_redistribute(m.src, m.dst, sizes) if s.kind in COMMUNICATING]
        out["backward"] += [s.kind for s in plan_redistribute(m.grad_src, m.grad_dst, sizes)
                            if s.kind in COMMUNICATING]
    return out


class PlainGathers:
    """A graph's ZeRO-3 gathers run as the plain moves they were (no prefetch, no buckets)."""

    def gather(self, k, x, m, groups):
        return move(x, m, groups)

    def fetch(self, x):
        return x


def run_per_rank(traced, plan, model, inputs: dict, backward: bool = True):
    """On two thread ranks: this rank's shards of `model`'s parameters (as the plan places
    them), the rewritten graph run on them and `inputs`, and (backward) the shards'
    gradients of the first output's sum.  Returns [(outputs, {name: grad})] per rank."""
    gm = traced.graph
    order = placeholders(gm)
    bind(gm, GROUPS, WorldAxis())
    bind(gm, GATHERS, PlainGathers())

    def job(rank):
        shards = {name: t.requires_grad_() for name, t in
                  shard_full_model(model, plan.param_placements, WorldAxis()).items()}
        out = gm(*feed(traced, order, shards, inputs))
        if backward:
            out[0].sum().backward()
        return [o.detach() for o in out], {name: t.grad for name, t in shards.items()}

    return on_ranks(job)


def full_grads(model, *args) -> dict:
    model.zero_grad()
    model(*args).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------- annotate

def test_annotate_writes_each_planned_choice_and_changes_nothing_else(megatron):
    """Every node the plan names carries its NodeChoice; no node is added, and the graph
    computes what it computed."""
    model, plan = megatron
    traced = trace(model, (X,))
    gm = traced.graph
    order = placeholders(gm)
    args = feed(traced, order, dict(model.named_parameters()), {"x": X})
    before, count = gm(*args)[0], len(gm.graph.nodes)
    annotate(gm, plan, traced.params, traced.tied)
    by_name = {c.name: c for c in plan.nodes}
    annotated = {n.name: n.meta["autopar"] for n in gm.graph.nodes if "autopar" in n.meta}
    assert annotated == by_name and len(annotated) == len(plan.nodes) >= 4
    assert len(gm.graph.nodes) == count
    torch.testing.assert_close(gm(*args)[0], before, rtol=0, atol=0)


def test_annotate_refuses_a_plan_made_for_another_graph(megatron):
    _, plan = megatron
    traced = trace(made(Heads), (X,))  # two views the MLP's plan does not have
    with pytest.raises(PlanMismatch, match=r"node view .* not in the plan.*plan again"):
        annotate(traced.graph, plan, traced.params, traced.tied)


# ---------------------------------------------------------------- insert_collectives

def test_megatron_mlp_has_one_forward_all_reduce_and_trains_like_one_device(megatron):
    """Column-then-row on tp=2: the only collective is the all-reduce of the row linear's
    Partial output, [4, 8] float64 = 256 bytes, forward; the input takes no gradient, so
    backward communicates nothing (Megatron's f operator has nothing to reduce).  The plan
    priced that same collective.  On two ranks the outputs equal the model's and every
    gradient shard is the slice of the model's gradient."""
    model, plan = megatron
    traced = trace(model, (X,))
    gm = traced.graph
    annotate(gm, plan, traced.params, traced.tied)
    inserted = insert_collectives(gm, plan, defer=param_names(traced))
    assert collectives(gm, (2,)) == {"forward": ["all_reduce"], "backward": []}
    assert [(c.kind, c.phase, c.nbytes) for c in plan.collectives if c.tensor != "finite check"] == \
        [("all_reduce", "forward", 4 * 8 * 8)]
    # (the weights are split: the step also compares the ranks' finite checks, after the graph)
    assert [(c.kind, c.phase, c.nbytes) for c in plan.collectives if c.tensor == "finite check"] == \
        [("all_reduce", "step", 8)]
    assert inserted.grad_sync == {} and inserted.output_reduce == {}
    want, grads = model(X), full_grads(model, X)
    for rank, (out, got) in enumerate(run_per_rank(traced, plan, model, {"x": X})):
        torch.testing.assert_close(out[0], want.detach())
        for name, g in got.items():
            torch.testing.assert_close(g, shard_of(grads[name], plan.param_placements[name], OneRank((2,), (rank,))))


def test_data_parallel_leaves_the_gradient_all_reduce_to_the_runtime():
    """Data parallel on dp=2: the batch is sliced (a local chunk, no collective), every
    parameter's gradient all-reduce is deferred to the runtime (grad_sync: all four on axis
    0) and the Partial loss is left for it to sum (output_reduce); the graph itself runs no
    collective at all."""
    model = made(Loss)
    plan = autopar.plan(model, DP, (X, T), solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    traced = trace(model, (X, T))
    annotate(traced.graph, plan, traced.params, traced.tied)
    inserted = insert_collectives(traced.graph, plan, defer=param_names(traced))
    assert collectives(traced.graph, (2,)) == {"forward": [], "backward": []}
    assert inserted.grad_sync == {name: (0,) for name, _ in model.named_parameters()}
    assert list(inserted.output_reduce) == [0]
    m = inserted.output_reduce[0]
    assert (m.src, m.dst) == ((P,), (R,))


# ---------------------------------------------------------------- localize

def test_localize_divides_view_sizes_by_the_split_and_keeps_the_values(megatron):
    """fc1's output is split by columns on tp=2, so the views to [4, 4, 4] and back to
    [4, 16] become [4, 2, 4] and [4, 8] on each rank; the rewritten graph computes the
    model's output on both ranks."""
    model = made(Heads)
    plan = autopar.plan(model, TP, (X,), solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))
    traced = trace(model, (X,))
    gm = traced.graph
    annotate(gm, plan, traced.params, traced.tied)
    insert_collectives(gm, plan, defer=param_names(traced))
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    assert [list(n.args[1]) for n in views] == [[4, 4, 4], [4, 16]]
    localize(gm, plan)
    assert [list(n.args[1]) for n in views] == [[4, 4 // 2, 4], [4, 16 // 2]]
    want, grads = model(X), full_grads(model, X)
    for rank, (out, got) in enumerate(run_per_rank(traced, plan, model, {"x": X})):
        torch.testing.assert_close(out[0], want.detach())
        for name, g in got.items():
            torch.testing.assert_close(g, shard_of(grads[name], plan.param_placements[name], OneRank((2,), (rank,))))


def test_localize_scales_a_mean_over_split_rows_to_its_share():
    """Data parallel on dp=2: each rank's mean over its 2 rows is scaled by 1/2, so the two
    ranks' losses (Partial) add up to the whole batch's mean, and so do their gradients."""
    model = made(Loss)
    plan = autopar.plan(model, DP, (X, T), solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    traced = trace(model, (X, T))
    gm = traced.graph
    annotate(gm, plan, traced.params, traced.tied)
    insert_collectives(gm, plan, defer=param_names(traced))
    localize(gm, plan)
    scaled = [n for n in gm.graph.nodes if n.target is scaled_op]
    assert [(n.args[0], n.args[1]) for n in scaled] == [(torch.ops.aten.mean.default, 0.5)]
    per_rank = run_per_rank(traced, plan, model, {"x": X, "target": T})
    torch.testing.assert_close(sum(out[0] for out, _ in per_rank), model(X, T).detach())
    grads = full_grads(model, X, T)
    for name in grads:
        torch.testing.assert_close(sum(got[name] for _, got in per_rank), grads[name])


# ---------------------------------------------------------------- rewrite: the passes in order

def test_rewrite_runs_the_passes_in_order_and_the_graph_trains_like_one_device(megatron):
    """rewrite = annotate, collectives, localize on the trace (and the eval switch from the
    eval trace), then the row-parallel linear folded with its all-reduce: the Megatron
    MLP's per-rank graph, forward and backward, on two ranks.  Without tp_overlap the
    move stays as collectives made it."""
    model, plan = megatron
    traced = trace(model, (X,))
    rewritten = rewrite(traced, plan, evaluated=trace(model, (X,), mode="eval"))
    assert rewritten.graph is traced.graph and [p.graph for p in rewritten.parts] == [traced.graph]
    assert rewritten.modes.reason == "" and rewritten.modes.switches == {}
    assert rewritten.parts[0].folded == 1
    assert sum(n.target is linear_then_reduce for n in rewritten.graph.graph.nodes) == 1
    assert collectives(rewritten.graph, (2,)) == {"forward": [], "backward": []}
    assert "1 moves" in str(rewritten)
    unfolded = rewrite(trace(model, (X,)), dataclasses.replace(plan, tp_overlap=False))
    assert unfolded.parts[0].folded == 0
    assert collectives(unfolded.graph, (2,)) == {"forward": ["all_reduce"], "backward": []}
    want, grads = model(X), full_grads(model, X)
    for rank, (out, got) in enumerate(run_per_rank(traced, plan, model, {"x": X})):
        torch.testing.assert_close(out[0], want.detach())
        for name, g in got.items():
            torch.testing.assert_close(g, shard_of(grads[name], plan.param_placements[name], OneRank((2,), (rank,))))


def test_rewrite_refuses_a_plan_for_another_size_and_says_why_eval_is_missing(megatron):
    model, plan = megatron
    wider = trace(made(MLP, 32), (X,))
    with pytest.raises(PlanMismatch, match="graph signature .* Plan again"):
        rewrite(wider, plan)
    without = rewrite(trace(model, (X,)), plan)
    assert "without an eval-mode trace" in without.modes.reason
    failed = rewrite(trace(model, (X,)), plan, evaluated=TraceError("data-dependent branch"))
    assert "could not be traced in eval mode (data-dependent branch)" in failed.modes.reason


def test_compile_traces_eval_mode_on_the_first_eval_only(monkeypatch):
    """For a small model the runtime's switch (runtime/build.eval_switch) traces the eval
    graph on the first switch to eval, once; a switch to training before that leaves the graph alone.  A model
    with dropout gets its switch (dropout's train flag) once traced."""
    from autopar.runtime import build
    from autopar.runtime.build import eval_switch
    from autopar.trace.cache import TRACES

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)).double()
    TRACES.clear()
    switch = eval_switch(model, (X,), None)
    assert switch.derive is not None and "first eval()" in str(switch)
    traced_now = len(TRACES)
    gm = trace(model, (X,)).graph
    before = gm.code
    switch.apply(gm, True)
    assert switch.derive is not None and gm.code == before and len(TRACES) == traced_now
    switch.apply(gm, False)
    assert switch.derive is None and switch.reason == "" and len(switch.switches) == 1, switch
    assert gm.code != before and len(TRACES) == traced_now + 1
    switch.apply(gm, True)
    assert gm.code == before and len(TRACES) == traced_now + 1
    # a model past LAZY_EVAL_BYTES is traced in eval mode at once (nothing of it held after)
    monkeypatch.setattr(build, "LAZY_EVAL_BYTES", 0)
    eager = eval_switch(model, (X,), None)
    assert eager.derive is None and len(eager.switches) == 1


# ---------------------------------------------------------------- modes

class DropNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


def test_mode_switch_turns_the_training_graph_into_the_eval_one_and_back():
    """Dropout's and batch norm's flags and the num_batches_tracked update are the only
    differences: after apply(training=False) the training graph computes the model's eval
    output (running statistics, no dropout) and leaves the buffers alone; apply(training=
    True) gives back the training graph's code."""
    model = made(DropNorm)
    traced = trace(model, (X,), cache=False)
    switch = mode_switch(traced.graph, trace(model, (X,), mode="eval", cache=False).graph, traced.buffers)
    assert switch.reason == ""
    assert sorted(w for sw in switch.switches.values() for w, _, _ in sw.args) == ["train", "training"]
    assert sum(sw.skip for sw in switch.switches.values()) == 1
    gm, code = traced.graph, traced.graph.code
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    switch.apply(gm, training=False)
    out = gm(*feed(traced, placeholders(gm), state, {"x": X}))[0]
    torch.testing.assert_close(out, model.eval()(X).detach(), rtol=0, atol=0)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # no update in eval
    switch.apply(gm, training=True)
    assert gm.code == code


def test_mode_switch_names_a_forward_that_differs_in_ops():
    class TrainOnly(MLP):
        def forward(self, x):
            y = super().forward(x)
            return y + 1.0 if self.training else y

    model = made(TrainOnly)
    traced = trace(model, (X,), cache=False)
    switch = mode_switch(traced.graph, trace(model, (X,), mode="eval", cache=False).graph, traced.buffers)
    assert "add" in switch.reason
    with pytest.raises(ModeError, match="cannot run the compiled model in eval mode"):
        switch.apply(traced.graph, training=False)


# ---------------------------------------------------------------- pipeline_split

def test_pipeline_split_stages_in_sequence_compute_the_whole_graph():
    """gpt-tiny's two layers on two stages (a plan for pp=2, one device per stage): stage 0
    holds the embeddings and layer 0, stage 1 layer 1, the final norm and the head (tied to
    the token embedding, so both stages read wte); one tensor (the residual stream) crosses
    the cut; stage 1 run on what stage 0 sent gives the loss of the whole per-rank graph and
    of the model."""
    model, example = build("gpt-tiny", n_layers=2)
    model = model.double()
    plan = autopar.plan(model, autopar.Mesh((2,), ("pp",), device="cpu"), example,
                        solve=autopar.SolveOptions(compare=False),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="gpipe", microbatches=2))
    assert plan.pipeline.stages == ((0, 1), (1, 2)) and plan.mesh.shape == (1,)
    args, _ = first_microbatch((tuple(example), None), 4, 2)
    traced = trace(model, args)
    rewritten = rewrite(traced, plan)
    bind_rank(rewritten, OneRank((1,), (0,)), RandomStreams(0, OneRank((1,), (0,)), torch.device("cpu"),
                                                            rewritten.random))
    stages = [part.stage for part in rewritten.parts]
    values = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    inputs = dict(zip(traced.user_inputs, args))
    whole = rewritten.graph(*feed(traced, placeholders(rewritten.graph), values, inputs))[0]
    first, last = stages
    assert len(first.sent) == 1 and last.received == first.sent
    names = param_names(traced)
    every = [name for name, _ in model.named_parameters()]
    assert {names[p] for p in first.params if p in names} == \
        {"wte.weight", "wpe.weight", *(n for n in every if n.startswith("blocks.0."))}
    assert {names[p] for p in last.params if p in names} == \
        {"wte.weight", "ln_f.weight", "ln_f.bias", *(n for n in every if n.startswith("blocks.1."))}  # tied head
    sent = first.graph_module(*feed(traced, first.inputs + first.params, values, inputs))
    loss = last.graph_module(*sent, *feed(traced, last.inputs + last.params, values, inputs))[0]
    torch.testing.assert_close(loss, whole, rtol=0, atol=0)
    torch.testing.assert_close(loss, model(*args).detach())


def test_assign_stages_puts_each_layer_on_its_stage():
    """Without a plan: on the bare trace, blocks.k's nodes go to stage k; nodes outside the
    layers run as late as their readers allow."""
    model, example = build("gpt-tiny", n_layers=2)
    traced = trace(model, example)
    stage = assign_stages(traced.graph, traced.user_inputs, "blocks", {0: 0, 1: 1})
    for node, s in stage.items():
        path = module_path(node)
        if path.startswith("blocks."):
            assert s == int(path.split(".")[1]), (node.name, path, s)
    stages = split_stages(traced.graph, traced.user_inputs, stage, 2)
    assert [len(st.received) for st in stages] == [0, 1]


# ---------------------------------------------------------------- recompute

class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.sum()


@pytest.mark.parametrize("mode, whole, regions", [("full", (), 1), ("selective", ("tanh",), 2)])
def test_recompute_cuts_a_layer_into_regions_that_compute_the_same(mode, whole, regions):
    """Layer blocks.0 (linear, tanh, linear) becomes one region, or under "selective" with
    tanh kept whole two regions around it: every other node of the layer moves into a
    region, and the graph computes the same value and gradients."""
    model = made(Blocks)
    traced = trace(model, (X,), cache=False)
    gm = traced.graph
    layer = {n.name for n in gm.graph.nodes if n.op == "call_function" and module_path(n).startswith("blocks.0")}
    args = [t.detach().requires_grad_() for t in feed(traced, placeholders(gm), dict(model.named_parameters()),
                                                       {"x": X})]
    before = gm(*args)[0]
    want = torch.autograd.grad(before, args[:-1])
    made_regions = outline_layers(gm, {"blocks.0": mode}, lambda path, m, region, nodes: region, frozenset(whole))
    assert made_regions == [f"_autopar_recompute_{k}" for k in range(regions)]
    inside = {n.name for r in made_regions for n in getattr(gm, r).graph.nodes if n.op == "call_function"}
    left = {n.name for n in gm.graph.nodes} & layer
    assert inside == layer - set(whole) and left == set(whole)
    after = gm(*args)[0]
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(after, args[:-1]), want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---------------------------------------------------------------- shard_params

def test_a_shard_is_the_slice_of_the_whole(megatron):
    """Under Megatron's placements each rank's shard is its slice (columns of fc1, rows of
    fc2.weight's input dim), and the two ranks' shards joined are the parameter."""
    model, plan = megatron
    shards = [shard_full_model(model, plan.param_placements, OneRank((2,), (c,))) for c in range(2)]
    for name, p in model.named_parameters():
        (pl,) = plan.param_placements[name]
        dim = pl.dim if isinstance(pl, Shard) else None
        if dim is None:
            assert all(torch.equal(s[name], p.detach()) for s in shards)
            continue
        assert all(s[name].shape[dim] == p.shape[dim] // 2 for s in shards)
        assert torch.equal(torch.cat([s[name] for s in shards], dim), p.detach())
    assert plan.param_placements["fc1.weight"] == (S0,) and plan.param_placements["fc2.weight"] == (S1,)


def test_initialising_shard_by_shard_gives_the_slices_of_the_seeded_model(megatron):
    _, plan = megatron
    torch.manual_seed(3)
    whole = MLP()
    with torch.device("meta"):
        empty = MLP()
    for c in range(2):
        shards = init_sharded(empty, plan.param_placements, OneRank((2,), (c,)), seed=3)
        for name, p in whole.named_parameters():
            assert torch.equal(shards[name], shard_of(p.detach(), plan.param_placements[name], OneRank((2,), (c,))))


# ---------------------------------------------------------------- redistribute

def test_redistribute_every_pair_on_two_ranks():
    """Every (src, dst) of R, P, S(0), S(1) on a (2,) mesh: the planner's steps, run on two
    thread ranks, give a layout of the same global tensor (integer-valued: exact)."""
    glob = global_tensor(4, (4, 6))
    pairs = list(itertools.product((R, P, S0, S1), repeat=2))

    def job(rank):
        return [redistribute_local(local_of(glob, (src,), (rank,), (2,)), (src,), (dst,), WorldAxis())
                for src, dst in pairs]

    per_rank = on_ranks(job)
    for k, (src, dst) in enumerate(pairs):
        assert check_layout(glob, [((c,), per_rank[c][k]) for c in range(2)], (dst,), (2,)) == [], (src, dst)
    assert [s.kind for s in plan_redistribute((S0,), (S1,), (2,))] == ["all_to_all"]


def test_redistribute_gradient_takes_its_own_layouts():
    """Forward S(0) -> R is an all-gather; its gradient, arriving Partial, leaves as S(0):
    a reduce-scatter, so each rank's gradient is its rows of the summed gradient."""
    glob = global_tensor(5, (4, 6))

    def job(rank):
        x = local_of(glob, (S0,), (rank,), (2,)).requires_grad_()
        y = redistribute(x, (S0,), (R,), (P,), (S0,), WorldAxis())
        (y * (rank + 1)).sum().backward()
        return y.detach(), x.grad

    (y0, g0), (y1, g1) = on_ranks(job)
    assert torch.equal(y0, glob) and torch.equal(y1, glob)
    assert torch.equal(g0, torch.full((2, 6), 3.0, dtype=glob.dtype)) and torch.equal(g1, g0)


def test_local_steps_need_no_process_group():
    glob = global_tensor(6, (4, 6))
    for c in range(2):
        y = redistribute_local(glob, (R,), (S1,), OneRank((2,), (c,)))
        assert torch.equal(y, glob[:, 3 * c: 3 * c + 3])


# ---------------------------------------------------------------- local_ops and attention_ops

def test_vocab_parallel_embedding_and_cross_entropy_on_two_ranks():
    """Rows [8r, 8r + 8) of a 16-row table on rank r: the two ranks' lookups add up to the
    whole lookup; with the 16 classes split the same way, the loss equals the whole one on
    rank 0 (rank 1 holds zero: one copy counts) and the logits' gradients are their slices."""
    g = torch.Generator().manual_seed(7)
    table = torch.randn(16, 4, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 16, (3, 5), generator=g)
    logits = torch.randn(6, 16, generator=g, dtype=torch.float64)
    target = torch.tensor([0, 15, 7, 8, -100, 3])
    whole_logits = logits.clone().requires_grad_()
    want = F.cross_entropy(whole_logits, target)
    want.backward()

    def job(rank):
        assert shard_offset(16, (S0,), 0, WorldAxis()) == (8 * rank, 8)
        looked = vocab_parallel_embedding(table[8 * rank: 8 * rank + 8], tokens, 16, (S0,), (0,), WorldAxis())
        mine = logits[:, 8 * rank: 8 * rank + 8].clone().requires_grad_()
        loss = local_cross_entropy(mine, target, classes=16, logits_placements=(S1,), batch_axes=(),
                                   class_axes=(0,), partial_axes=(0,), groups=WorldAxis())
        loss.backward()
        return looked, loss.detach(), mine.grad

    (e0, l0, g0), (e1, l1, g1) = on_ranks(job)
    torch.testing.assert_close(e0 + e1, F.embedding(tokens, table))
    torch.testing.assert_close(l0 + l1, want.detach())
    assert l1.item() == 0
    torch.testing.assert_close(torch.cat([g0, g1], 1), whole_logits.grad)


@pytest.mark.parametrize("padding_idx", [0, 11])
def test_vocab_parallel_embedding_keeps_the_padding_rows_gradient_zero(padding_idx):
    """nn.Embedding's padding row gets no gradient: split by vocabulary over two ranks, the
    rank holding that row (rank 0 for row 0, rank 1 for row 11, its local row 3) leaves it
    zero, and the two ranks' gradients are the slices of the whole one (they were not:
    the local lookup dropped padding_idx, and Phi-3 under megatron-tp trained wrong)."""
    g = torch.Generator().manual_seed(9)
    table = torch.randn(16, 4, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 16, (4, 6), generator=g)
    tokens[0, :3] = padding_idx
    whole = table.clone().requires_grad_()
    (F.embedding(tokens, whole, padding_idx=padding_idx) * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    assert whole.grad[padding_idx].abs().sum() == 0

    def job(rank):
        mine = table[8 * rank: 8 * rank + 8].clone().requires_grad_()
        out = vocab_parallel_embedding(mine, tokens, 16, (S0,), (0,), WorldAxis(), padding_idx)
        (out * torch.arange(4.0, dtype=torch.float64)).sum().backward()
        return mine.grad

    g0, g1 = on_ranks(job)
    torch.testing.assert_close(torch.cat([g0, g1]), whole.grad, rtol=0, atol=0)


def test_an_embedding_counting_its_rows_runs_replicated():
    """scale_grad_by_freq divides a row's gradient by its count in the batch, which a split
    batch or vocabulary would count locally: the op has no rule, so it runs replicated
    (and the plan says so)."""
    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8, scale_grad_by_freq=True)
            self.head = torch.nn.Linear(8, 16)

        def forward(self, x, y):
            return F.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    x = torch.randint(0, 16, (4, 8))
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    with pytest.warns(UserWarning, match="embedding"):
        plan = autopar.plan(Counted(), mesh, (x, x), solve=autopar.SolveOptions(compare=False))
    assert any("embedding" in op for op in plan.fallback_ops), plan.fallback_ops
    assert plan.param_placements["emb.weight"] == (R,)


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_sequence_parallel_attention_equals_whole_attention(kind):
    """q, k, v [1, 2, 8, 4] with the sequence split over two ranks (rank r: positions
    [4r, 4r + 4)): causal ring and Ulysses attention give each rank its rows of the whole
    attention, and the gradients are the rows of the whole gradients."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    wq, wk, wv = (t.clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(wq, wk, wv, is_causal=True)
    want.sum().backward()

    def job(rank):
        mine = [t[:, :, 4 * rank: 4 * rank + 4].clone().requires_grad_() for t in (q, k, v)]
        if kind == "ring":
            out = ring_attention(*mine, causal=True, scale=None, group=dist.group.WORLD)
        else:
            out = ulysses_attention(*mine, is_causal=True, group=dist.group.WORLD)
        out.sum().backward()
        return out.detach(), [t.grad for t in mine]

    per_rank = on_ranks(job)
    torch.testing.assert_close(torch.cat([out for out, _ in per_rank], 2), want.detach())
    for i, whole in enumerate((wq, wk, wv)):
        torch.testing.assert_close(torch.cat([grads[i] for _, grads in per_rank], 2), whole.grad)


def test_a_split_mean_is_its_share():
    """A mean over rows split two ways: each rank's local mean times 1/2, summed, is the mean."""
    x = torch.arange(8.0)
    halves = [scaled_op(torch.ops.aten.mean.default, 0.5, part) for part in (x[:4], x[4:])]
    assert [h.item() for h in halves] == [0.75, 2.75] and sum(halves).item() == x.mean().item() == 3.5


# ---------------------------------------------------------------- a move keeps the traced layout

class ViewedAttention(nn.Module):
    """Attention whose output goes through `.transpose(1, 2).contiguous().view(b, s, h)`: the
    kernel's output is stored seq-major, so the trace drops the `.contiguous()` and views the
    transpose directly."""

    def __init__(self, h: int = 16, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(h, h, dtype=torch.float64) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).contiguous().view(b, s, h)).pow(2).mean()


def test_a_moved_attention_output_keeps_the_traced_layout_so_its_view_runs():
    """Under a plan that moves attention's output to another layout before the transpose and
    view, the moved tensor is laid out as the traced one (seq-major), so the view works and
    the loss equals one device's."""
    torch.manual_seed(0)
    model = ViewedAttention()
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    mesh = autopar.Mesh((2,), ("tp",), device="cpu")
    for plan in autopar.random_plans(model, mesh, (x,), solve=autopar.SolveOptions(compare=False), seeds=range(40)):
        traced = trace(model, (x,))
        rewritten = rewrite(traced, plan)
        moved = [n for n in rewritten.graph.graph.nodes if n.op == "call_function" and n.target is move
                 and n.args[0].target is torch.ops.aten.scaled_dot_product_attention.default]
        if moved:
            break
    else:
        pytest.fail("no plan of 40 moves the attention output")
    want = model(x).detach()
    outs = [out[0] for out, _ in run_per_rank(traced, plan, model, {"x": x}, backward=False)]
    got = sum(outs) if 0 in rewritten.output_reduce else outs[0]
    torch.testing.assert_close(got, want)
    assert moved[0].args[3] == (0, 2, 1, 3)   # [batch, heads, seq, dim] stored batch, seq, heads, dim
