"""Pipeline stage search (autopar.solve.pipeline.search via autopar.plan(pipeline=True))."""
from __future__ import annotations

import dataclasses
import itertools
import os
import random
import time

import pytest
from torch.distributed.tensor import Shard

import autopar
from autopar.mesh import PRESETS, parse_bytes
from autopar.models import build
from autopar.solve.overlap import step_lower_bound
from autopar.solve.pipeline.candidates import balanced_cuts, v_cuts
from autopar.solve.pipeline.search import search
from autopar.solve.built import build_problem
from autopar.solve.ilp.solved import SolveOptions


def test_balanced_cuts_minimise_the_slowest_stage():
    assert balanced_cuts([1.0] * 8, 4, 0.0, 0.0) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # a heavy prefix (embedding) pushes layers away from the first stage
    assert balanced_cuts([1.0] * 6, 2, 2.0, 0.0) == [(0, 2), (2, 6)]
    assert balanced_cuts([5.0, 1.0, 1.0, 1.0], 2, 0.0, 0.0) == [(0, 1), (1, 4)]


def test_balanced_cuts_are_the_least_slowest_stage_of_every_cut():
    """Against every way to cut small random layer times (zeros and ties included): the
    slowest stage is the least any cut reaches (the dynamic programme's two binary searches
    per stage find what a scan over every first layer would)."""
    rng = random.Random(3)
    for trial in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        units = [rng.choice([0.0, 0.5, 1.0, 2.0, rng.uniform(0.0, 3.0)]) for _ in range(n)]
        head, tail = rng.choice([0.0, 1.5, rng.uniform(0, 4)]), rng.choice([0.0, 2.5, rng.uniform(0, 4)])

        def slowest(bounds):
            edges = [0, *bounds, n]
            return max(sum(units[a:b]) + (head if s == 0 else 0.0) + (tail if s == stages - 1 else 0.0)
                       for s, (a, b) in enumerate(zip(edges, edges[1:])))
        every = list(itertools.combinations(range(1, n), stages - 1))
        least = min(slowest(b) for b in every)
        cuts = balanced_cuts(units, stages, head, tail)
        assert [a for a, _ in cuts][0] == 0 and cuts[-1][1] == n and all(b > a for a, b in cuts)
        assert slowest([a for a, _ in cuts][1:]) == pytest.approx(least, rel=1e-12, abs=1e-12)


def test_v_cuts_balance_each_groups_two_stages():
    """Under a V, group g runs stages g and 2p-1-g: the V cut balances each group's two
    stages together (the head, here 6 layers' worth, rides on group 0 with the first stage),
    where the stage-balanced cut leaves one group slower."""
    units = [3.0, 1, 1, 3, 3, 2, 3, 2, 2, 2, 3, 3, 3, 2, 1, 2, 3, 1, 2, 3, 3, 2, 1, 1]
    head, tail = 0.0, 6.0

    def slowest(cuts):
        load = [sum(units[a:b]) + (head if s == 0 else 0.0) + (tail if s == 7 else 0.0)
                for s, (a, b) in enumerate(cuts)]
        return max(load[g] + load[7 - g] for g in range(4))
    plain, v = balanced_cuts(units, 8, head, tail), v_cuts(units, 8, head, tail)
    assert (slowest(plain), slowest(v)) == (16.0, 15.0)
    assert [a for a, _ in v][0] == 0 and v[-1][1] == 24 and all(b > a for a, b in v)
    assert all(v[i][1] == v[i + 1][0] for i in range(7))


@pytest.fixture(scope="module")
def slow_network_plan():
    """gpt2-1.5b on 8 nodes x 8 H100s whose network between nodes is slow (2.5 GB/s)."""
    model, example = build("gpt2-1.5b", device="meta", batch=16)
    mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
    start = time.perf_counter()
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), pipeline=True)
    return plan, time.perf_counter() - start


def test_slow_network_gets_stages_across_nodes_and_the_node_splits_each_stage(slow_network_plan):
    """Stages go across the slow links and each keeps a whole node, whose 8 GPUs split every
    microbatch.  A stage's gradients sum once per step over NVLink (its problem is priced
    for the step's microbatches, solve/pipeline/costs.stage_problem), so with memory to spare the
    weights stay whole on the node and attention splits the sequence (ring); under a budget
    the replicated weights do not fit and the node runs tensor parallelism instead: every
    MLP matrix split on gpu (fc1 by column, fc2 by row; the 25 heads do not divide 8 ways,
    and 1600 / 8 = 200 columns fill a GEMM's 128- or 256-wide tiles poorly, so the
    attention projections may stay whole)."""
    plan, _ = slow_network_plan
    for budget in (None, "2.8GiB"):
        if budget is not None:
            model, example = build("gpt2-1.5b", device="meta", batch=16)
            mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
            plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), pipeline=True,
                                memory_budget=budget)
        pp = plan.pipeline
        assert pp.axis == "node" and pp.groups > 1            # stages across nodes
        assert pp.submesh[1] == 8                                # each stage keeps the whole node
        assert pp.step_s < pp.no_pipeline_step_s
        assert sum(b - a for a, b in pp.stages) == 48 and pp.stages[0][0] == 0
        gpu = plan.mesh.axis_names.index("gpu")
        matrices = [n for n, pl in plan.param_placements.items() if n.startswith("blocks.") and n.endswith("weight")
                    and isinstance(pl[gpu], Shard)]
        mlp = [n for n in matrices if ".mlp." in n]
        if budget is None:
            assert not mlp and "sequence split in attention: gpu=ring" in str(plan), matrices[:5]
        else:
            assert max(pp.memory) <= parse_bytes(budget) and len(mlp) == 2 * 48, matrices[:5]


def test_plain_plan_is_skipped_only_where_it_cannot_win(slow_network_plan):
    """With stages far ahead, the plain plan is not planned under the budget: the lower
    bound on any plan without stages (overlap.step_lower_bound) is above the pipeline's
    step, and below the step of the plain plan it stood in for."""
    plan, _ = slow_network_plan
    model, example = build("gpt2-1.5b", device="meta", batch=16)
    mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
    plain = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False))
    bound = step_lower_bound(build_problem(model, mesh, example, None).problem)
    assert plan.pipeline.step_s < bound <= plain.predicted.step_s * (1 + 1e-9)
    assert plan.pipeline.no_pipeline_step_s > plan.pipeline.step_s


def test_fast_uniform_network_and_small_model_use_no_pipeline():
    model, example = build("gpt2-124m", device="meta", batch=8)
    mesh = autopar.Mesh((8,), ("dp",), device="h100", bandwidth=450e9)
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), pipeline=True)
    assert plan.pipeline.axis is None
    assert plan.mesh.shape == (8,)


def test_pipeline_plans_round_trip(slow_network_plan, tmp_path):
    plan, _ = slow_network_plan
    path = tmp_path / "pp.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
    assert "stages over node" in str(plan)
    assert plan.device_mesh().shape == (8, 8) and plan.mesh.shape == tuple(plan.pipeline.submesh)
    assert plan.mesh.shape[0] == 8 // plan.pipeline.groups


def test_split_pass_cuts_the_planned_graph_at_the_stage_boundaries(slow_network_plan):
    """The per-stage graph of the gpt2-1.5b plan, cut as the plan says: each stage computes
    exactly its layers, one tensor (the residual stream) crosses each cut, the embeddings
    run on the first stage and the head and loss on the last, and the tied embedding
    matrix is read by both of them (each gathers its own copy)."""
    import re

    from autopar.passes.rewrite import param_names, rewrite
    from autopar.trace.batching import first_microbatch
    from autopar.trace.paths import module_path
    from autopar.trace.export import trace

    plan, _ = slow_network_plan
    pp = plan.pipeline
    model, example = build("gpt2-1.5b", device="meta", batch=16)
    (args, _) = first_microbatch((tuple(example), None), 16, 16 // pp.microbatches)
    traced = trace(model, args)
    stages = [part.stage for part in rewrite(traced, plan).parts]   # (never run here: no slot bound)
    assert len(stages) == len(pp.stages) >= 2
    name_of = param_names(traced)
    for st, (a, b) in zip(stages, pp.stages):
        layers = {int(m.group(1)) for n in st.graph_module.graph.nodes
                  if (m := re.match(r"blocks\.(\d+)\.", module_path(n)))}
        assert layers == set(range(a, b)), (st.index, sorted(layers))
        if st.index:
            assert len(st.received) == 1, st.received
        params = {name_of[p] for p in st.params if p in name_of}
        assert ("wte.weight" in params) == (st.index in (0, len(stages) - 1))
        assert ("wpe.weight" in params) == (st.index == 0)
        assert ("ln_f.weight" in params) == (st.index == len(stages) - 1)
    assert len(stages[-1].sent) == 1  # the loss


@pytest.mark.parametrize("fixed", [autopar.Pipeline(axis="node", groups=2, schedule="1f1b", microbatches=4), None])
def test_search_builds_each_problem_once(monkeypatch, fixed):
    """The planner reuses the problem the search built (and solved) for the winner: one
    Problem per (sub-mesh, microbatch) candidate plus the unpipelined one, none rebuilt."""
    import autopar.solve.built as built_module
    built = []
    original = built_module.Problem.build

    def counting(traced, mesh, *args, **kwargs):
        inputs = tuple(tuple(n.meta["val"].shape) for n in traced.graph.graph.nodes
                       if n.op == "placeholder" and n.target in traced.user_inputs)
        built.append((mesh.shape, inputs))
        return original(traced, mesh, *args, **kwargs)

    monkeypatch.setattr(built_module.Problem, "build", counting)
    model, example = build("gpt-tiny", device="meta", batch=8)
    mesh = autopar.Mesh((2, 2), ("node", "gpu"), device="h100", bandwidth=(2e9, 300e9))
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), pipeline=fixed or True)
    assert len(built) == len(set(built)), built
    if fixed is not None:
        assert plan.pipeline.pipelined and len(built) == 2   # the whole mesh and the one fixed candidate


def test_forked_workers_build_each_problem_once_and_export_once_each(monkeypatch, tmp_path):
    """Costing candidates in three processes (autopar/solve/pipeline/workers.py), the
    processes together build one Problem per (sub-mesh, microbatch rows) key, each in one
    process, and each process runs torch.export once: this one the whole batch, the first
    forked worker the largest other microbatch size, the second its own size (a trace is
    written from an export cached in the same process and another's outline,
    autopar/trace/rebatch.py; the workers fork before any export).  gpt-tiny on 2 x 2
    inside one node: both axes are cut, in 2, with 4 or 8 microbatches (2 and 1 rows),
    besides the whole batch of 8: five keys in three microbatch sizes.  Each process
    appends a line per build and per export to a file, so the forked ones are counted."""
    import torch
    import autopar.solve.built as built_module
    log = tmp_path / "calls"
    original_problem, original_export = built_module.Problem.build, torch.export.export

    def record(line):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {line}\n")

    def counting_problem(traced, mesh, *args, **kwargs):
        rows = {tuple(n.meta["val"].shape)[0] for n in traced.graph.graph.nodes
                if n.op == "placeholder" and n.target in traced.user_inputs}
        record(f"build {mesh.shape} {sorted(rows)}")
        return original_problem(traced, mesh, *args, **kwargs)

    def counting_export(*args, **kwargs):
        record("export")
        return original_export(*args, **kwargs)

    monkeypatch.setattr(built_module.Problem, "build", counting_problem)
    monkeypatch.setattr(torch.export, "export", counting_export)
    model, example = build("gpt-tiny", device="meta", batch=8, n_layers=7)   # (a model no other test traced)
    mesh = autopar.Mesh((2, 2), ("node", "gpu"), device="h100", bandwidth=(2e9, 300e9))
    choice = search(model, mesh, example, options=SolveOptions(workers=3))
    calls = [line.split(" ", 1) for line in log.read_text().splitlines()]
    builds = sorted(what for _, what in calls if what.startswith("build"))
    assert builds == ["build (1, 2) [1]", "build (1, 2) [2]", "build (2, 1) [1]", "build (2, 1) [2]",
                      "build (2, 2) [8]"], calls
    exporters = [pid for pid, what in calls if what == "export"]
    assert len(exporters) == len(set(exporters)) == 3 and str(os.getpid()) in exporters, calls
    assert choice.candidates >= 2


def test_tight_budget_recomputes_inside_the_stages():
    """gpt2-1.5b with 16 layers at 4,096 tokens on 8 x 8 H100: under 7 GiB the stages keep
    every activation; under 1.6 GiB no layout that keeps them all fits (the least, 8 stages
    of two layers with microbatches of one sequence, needs 1.62 GiB) and the search
    recomputes every layer of its stages (selective); under 1.25 GiB it offloads every
    layer's activations to host memory (1,291 ms against 1,360 ms recomputing in full).
    Each is slower than the one before (2026-11-27: 957.4 ms under 1.6 GiB, 1,291.1 ms
    under 1.25 GiB), and the plan carries the policy for every layer.  The stages are asked for (an empty
    autopar.Pipeline()): without them the plain plan, with ZeRO and recomputation of its
    own, is faster at these budgets and pipeline=True returns it."""
    model, example = build("gpt2-1.5b", device="meta", batch=64, seq=4096, max_seq=4096, n_layers=16)
    mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
    steps = []
    for budget, recomputes in (("7GiB", False), ("1.6GiB", True), ("1.25GiB", True)):
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                            pipeline=autopar.Pipeline(), memory_budget=budget)
        pp = plan.pipeline
        assert pp.pipelined and max(pp.memory) <= parse_bytes(budget, "budget")
        if not recomputes:
            assert plan.recompute is None or not plan.recompute.layers
        else:
            modes = set(plan.recompute.layers.values())
            assert len(modes) == 1 and modes <= {"selective", "full", "offload"}, plan.recompute
            mode = modes.pop()
            said = "activations offloaded to host memory" if mode == "offload" else f"recomputed ({mode})"
            assert len(plan.recompute.layers) == 16 and said in pp.summary, pp.summary
        steps.append(pp.step_s)
    assert steps[0] < steps[1] < steps[2], steps


def _step(plan) -> float:
    """The step a plan predicts: its pipeline's makespan when it has stages."""
    return plan.pipeline.step_s if plan.pipeline is not None and plan.pipeline.pipelined else plan.predicted.step_s


@pytest.mark.parametrize("name, batch, shape, bandwidth, budget", [
    ("gpt-tiny", 8, (2, 2), (2e9, 300e9), None),
    ("gpt-tiny", 8, (2, 2), (2e9, 300e9), "3MiB"),
    ("llama-tiny", 16, (4, 2), (2.5e9, 450e9), None),
    ("gpt2-124m", 16, (2, 4), (2.5e9, 450e9), "6GiB"),
    ("gpt2-124m", 16, (2, 4), (100e9, 450e9), None),
    # the unbudgeted plain plan is over this budget, ZeRO brings it under: the search used to
    # drop it and return a pipeline predicted 24 % slower
    ("gpt2-124m", 16, (2, 4), (100e9, 450e9), "2332MiB"),
])
def test_search_never_loses_to_the_plain_plan(name, batch, shape, bandwidth, budget):
    """pipeline=True is never predicted slower than pipeline=False: the plain candidate is
    planned under the same budget and precision (ZeRO and recomputation as the ILP picks
    them), and kept when the best pipeline is not faster."""
    model, example = build(name, device="meta", batch=batch)
    mesh = autopar.Mesh(shape, ("node", "gpu"), device="h100", bandwidth=bandwidth)
    kw = dict(solve=autopar.SolveOptions(compare=False), memory_budget=budget, mixed_precision="bf16")
    try:
        plain = autopar.plan(model, mesh, example, **kw)
    except autopar.InfeasibleError:
        plain = None
    searched = autopar.plan(model, mesh, example, pipeline=True, **kw)
    if plain is None:
        assert searched.pipeline.pipelined   # only stages fit
        return
    assert _step(searched) <= plain.predicted.step_s * (1 + 1e-9), (searched.pipeline.summary, plain.predicted)
    # the bound that lets the planner skip the plain plan holds for the plan it skips
    problem = build_problem(model, mesh, example, None, autopar.MixedPrecision.of("bf16")).problem
    bound = step_lower_bound(problem)
    # (the bound comes from the ILP's integer units, each term rounded: 1e-6 relative slack)
    assert 0 < bound <= plain.predicted.step_s * (1 + 1e-6)
    if not searched.pipeline.pipelined:
        assert searched.predicted.step_s == pytest.approx(plain.predicted.step_s, rel=1e-9)
    elif searched.pipeline.no_pipeline_step_s != pytest.approx(plain.predicted.step_s, rel=1e-9):
        assert bound > _step(searched)   # skipped: no plain plan could have been as fast


def test_search_logs_its_progress(caplog):
    """A long search says at INFO how far it is and the best layout so far."""
    model, example = build("gpt-tiny", device="meta", batch=8)
    mesh = autopar.Mesh((2, 2), ("node", "gpu"), device="h100", bandwidth=(2e9, 300e9))
    with caplog.at_level("INFO", logger="autopar"):
        autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), pipeline=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pipeline search:")]
    assert lines, [r.getMessage() for r in caplog.records]
    done, total = (int(x.split()[-1] if i == 0 else x.split()[0]) for i, x in enumerate(lines[-1].split(" of ")[:2]))
    assert total >= 2 and 0 <= done <= total and "best so far" in lines[-1], lines[-1]


def test_parallel_costing_gives_the_same_choice(caplog):
    """Candidates costed in forked worker processes (one task per microbatch size) give the
    same layout, step and candidate count as costing them one after another."""
    model, example = build("gpt-tiny", device="meta", batch=8)
    mesh = autopar.Mesh((2, 2), ("node", "gpu"), device="h100", bandwidth=(2e9, 300e9))
    with caplog.at_level("INFO", logger="autopar"):
        two = search(model, mesh, example, options=SolveOptions(workers=2))
    assert any("workers in" in r.getMessage() for r in caplog.records)
    one = search(model, mesh, example, options=SolveOptions(workers=1))
    fields = ("axis", "n_groups", "submesh", "stages", "schedule", "n_microbatches", "n_virtual", "step_s", "memory",
              "candidates", "recompute")
    assert [getattr(two, f) for f in fields] == [getattr(one, f) for f in fields]


def _slow_network_gpt():
    model, example = build("gpt2-1.5b", device="meta", batch=16)
    return model, example, autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))


def test_search_picks_zbv_where_its_bubble_pays():
    """8 device groups and 8 microbatches (B >= S, but fewer than 2S): ZB-V's two stages per
    group in a V fill its warm-up and cool-down with weight passes, so its bubble is below
    ZB-H1's and 1F1B's at about their memory; the search picks it over each of them."""
    model, example, mesh = _slow_network_gpt()
    steps = {}
    for schedule in ("1f1b", "zero-bubble", "zbv", None):
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                            pipeline=autopar.Pipeline(axis="node", groups=8, microbatches=8, schedule=schedule))
        steps[schedule or "free"] = plan.pipeline
    free = steps["free"]
    assert free.schedule == "zbv" and len(free.stages) == 16 and free.virtual == 2
    assert steps["zbv"].step_s < steps["zero-bubble"].step_s < steps["1f1b"].step_s
    assert steps["zbv"].bubble < steps["zero-bubble"].bubble < steps["1f1b"].bubble
    assert max(steps["zbv"].memory) < 1.1 * max(steps["zero-bubble"].memory)


def test_search_does_not_pick_zbv_with_too_few_microbatches():
    """4 microbatches on 8 groups: ZB-V's warm-up (2(S-r)-1 forwards before the first
    backward) cannot fill, and ZB-H1 is faster: the search picks zero-bubble."""
    model, example, mesh = _slow_network_gpt()
    free = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                        pipeline=autopar.Pipeline(axis="node", groups=8, microbatches=4)).pipeline
    zbv = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                       pipeline=autopar.Pipeline(axis="node", groups=8, microbatches=4, schedule="zbv")).pipeline
    assert free.schedule == "zero-bubble"
    assert free.step_s < zbv.step_s


def test_search_picks_chimera_only_where_its_second_copy_is_cheap():
    """gpt2-1.5b, batch 8, 2 device groups, 2 microbatches.  Cut along the GPUs of a node
    (NVLink), Chimera's two pipelines leave no bubble, and summing the gradients of the
    stage copies costs little: the search picks it over ZB-H1 and 1F1B, at the memory of
    a second copy of the weights.  Cut across nodes (2.5 GB/s), that sum costs more than
    the bubble it saves, and the search rightly takes zero-bubble.  (Among every schedule
    interleaved 1F1B over 8 stages is priced 0.3 % faster than Chimera here: the stages'
    free plan replicates the weights over the 4 GPUs, their gradients summed once per step,
    which makes Chimera's sum of the two copies 2.1-2.6 GiB a group.)"""
    model, example = build("gpt2-1.5b", device="meta", batch=8)
    mesh = autopar.Mesh((2, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
    steps = {s: search(model, mesh, example, fixed=autopar.Pipeline(axis="gpu", groups=2, microbatches=2, schedule=s),
                       schedules=("1f1b", "zero-bubble", "chimera"))
             for s in ("1f1b", "zero-bubble", None)}
    free = steps[None]
    assert free.schedule == "chimera" and free.bubble < 0.01 and free.n_stages == 2
    assert free.step_s < steps["zero-bubble"].step_s < steps["1f1b"].step_s
    assert max(free.memory) > 1.2 * max(steps["1f1b"].memory)   # every group holds both stages
    across = search(model, mesh, example, fixed=autopar.Pipeline(axis="node", groups=2, microbatches=2))
    chimera = search(model, mesh, example, fixed=autopar.Pipeline(axis="node", groups=2, microbatches=2,
                                                                  schedule="chimera"))
    assert across.schedule != "chimera" and across.step_s < chimera.step_s


def test_large_vocabulary_head_gives_the_last_stage_fewer_layers():
    """Llama-3-8B's 128,256-row head is stage work: cut into 4 stages, the last stage takes
    fewer of the 32 layers than the others, and the plan's summary names the cut."""
    model, example = build("llama3-8b", device="meta", batch=8)
    mesh = autopar.Mesh((4, 8), ("node", "gpu"), device="h100")
    pp = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                      pipeline=autopar.Pipeline(axis="node", groups=4, schedule="1f1b", microbatches=8)).pipeline
    layers = [b - a for a, b in pp.stages]
    assert sum(layers) == 32 and layers[-1] < max(layers[1:-1])
    cut = ", ".join(f"{a}-{b - 1}" for a, b in pp.stages)
    assert f"(layers {cut})" in pp.summary


def test_offloaded_activations_in_flight_fit_host_memory():
    """Under 1.25 GiB gpt2-1.5b's stages offload every layer's activations on an H100 with a
    200 GB/s host link (Grace Hopper's NVLink-C2C class; over the SXM part's 55 GB/s PCIe
    link recomputing in full is priced faster) and 225 GB of host memory per GPU; with 0.5
    GB of host memory per GPU the microbatches in flight would not fit there, and the
    search recomputes in full instead."""
    model, example = build("gpt2-1.5b", device="meta", batch=64, seq=4096, max_seq=4096, n_layers=16)
    modes = {}
    for host in (225e9, 0.5e9):
        device = dataclasses.replace(PRESETS["h100"], host_memory=host, host_bandwidth=200e9)
        mesh = autopar.Mesh((8, 8), ("node", "gpu"), device=device, bandwidth=(2.5e9, 450e9))
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                            pipeline=autopar.Pipeline(), memory_budget="1.25GiB")
        modes[host] = set(plan.recompute.layers.values())
    assert modes == {225e9: {"offload"}, 0.5e9: {"full"}}, modes


def test_interleaving_tries_three_or_four_stages_a_group_where_they_split_the_layers():
    """Interleaved 1F1B is searched with 1 and 2 stages per device group, and 3 or 4 where
    that many split the layers evenly (GPT-530B: 105 layers over 35 groups runs 3 a group,
    as Korthikanti et al. 2022 did); a fixed count is kept; other schedules stay at theirs."""
    from autopar.solve.pipeline.options import SearchSpace
    space = SearchSpace(autopar.Mesh((4,), ("pp",), device="h100"), 8, 80e9, ("interleaved-1f1b",), None, None,
                        ("none",))
    assert space.virtuals("interleaved-1f1b", 105, 35) == (1, 2, 3)
    assert space.virtuals("interleaved-1f1b", 32, 4) == (1, 2, 4)
    assert space.virtuals("interleaved-1f1b", 10, 2) == (1, 2)
    assert space.virtuals("1f1b", 105, 35) == (1,) and space.virtuals("zbv", 8, 2) == (2,)
    fixed = dataclasses.replace(space, fixed=autopar.Pipeline(virtual=5))
    assert fixed.virtuals("interleaved-1f1b", 105, 35) == (5,)


def test_one_row_per_data_rank_counts_what_is_left_of_pp():
    """The microbatch of one row per data-parallel rank counts, besides the axes named for
    data, what a stage keeps of the axis it cuts where that is named "pp" (its stage
    problem may use it for data alone) or for data (llama3-8b's 64 rows on dp 8 x tp 8 cut
    in 2 are 16 microbatches of 4 rows, not 64 of one row on 4 data ranks): DeepSeek-V3's 256 rows on 32 x 8 x 8 cut in 2 are never 8-row microbatches
    for 16 x 8 data ranks (a candidate no data-parallel menu could split)."""
    from autopar.solve.pipeline.options import SearchSpace
    mesh = autopar.Mesh((32, 8, 8), ("pp", "dp", "ep"), device="h100")
    space = SearchSpace(mesh, 256, 80e9, ("1f1b",), None, None, ("none",))
    assert space.microbatch_counts(2, 0) == [4, 8]          # 128 data ranks: no row each to spare
    assert space.microbatch_counts(32, 0) == [64, 128]      # 8 data ranks: 32 rows beside 4p = 128
    assert space.microbatch_counts(4, 0) == [8, 16]
    keys = space.keys((0,))
    assert ((16, 8, 8), 8) not in keys and all(rows % shape[0] == 0 for shape, rows in keys), keys
    other = SearchSpace(autopar.Mesh((2, 64), ("dp", "pp"), device="h100"), 1024, 80e9, ("1f1b",), None, None,
                        ("none",))
    assert other.microbatch_counts(2, 1) == [4, 8, 16]      # 2 x 32 data ranks: 16 rows a microbatch
    plain = SearchSpace(autopar.Mesh((2, 64), ("dp", "tp"), device="h100"), 1024, 80e9, ("1f1b",), None, None,
                        ("none",))
    assert plain.microbatch_counts(2, 1) == [4, 8, 512]     # tp's remainder splits no rows
    cut_dp = SearchSpace(autopar.Mesh((8, 8), ("dp", "tp"), device="h100"), 64, 80e9, ("1f1b",), None, None,
                         ("none",))
    assert cut_dp.microbatch_counts(2, 0) == [4, 8, 16]    # dp's remainder of 4 splits rows: 4 a microbatch
    assert cut_dp.microbatch_counts(8, 0) == [16, 32, 64]


def test_one_stage_schedules_need_a_microbatch_per_stage():
    """GPipe and 1F1B run at least one microbatch per stage (torch's schedules refuse fewer
    at compile): a fixed layout that asks for fewer is refused when planned, naming the
    fix, and the search never offers them with fewer."""
    model, example = build("gpt-tiny", batch=8)
    mesh = autopar.Mesh((2,), ("pp",), device="cpu")
    for schedule in ("1f1b", "gpipe"):
        with pytest.raises(ValueError, match=f"{schedule} runs at least one microbatch per stage .2 stages.; "
                                             f"give microbatches >= 2"):
            autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                         pipeline=autopar.Pipeline(axis="pp", groups=2, schedule=schedule, microbatches=1))
    with pytest.raises(ValueError, match="dualpipev runs at least one microbatch per stage .4 stages."):
        autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                     pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="dualpipev", microbatches=2))
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, microbatches=1))
    assert plan.pipeline.pipelined and plan.pipeline.microbatches == 1
    assert plan.pipeline.schedule not in ("1f1b", "gpipe", "dualpipev")


def test_a_forced_layout_prices_the_stages_that_run():
    """plan(layout=..., pipeline=...) plans the stages in that layout, and the search prices,
    cuts and checks the memory of those stages, not of each candidate's free plan: under
    megatron-tp x zero1 on (pp 2, dp 4, tp 2) every weight's optimizer state is a quarter
    on each rank, so the device groups' optimizer bytes add up to the stage plan's (the free
    plan of a stage, which keeps whole states under accumulation, priced them 4 x before
    2026-12-03), and the pipeline's step is the schedule of the forced stages: slower than
    the free stages' or equal, never faster."""
    model, example = build("llama3-8b", device="meta", batch=32, seq=1024, dim=1024, n_layers=8, n_heads=8,
                           n_kv_heads=4, vocab=32000, max_seq=1024)   # (no tied weights: each held once)
    mesh = autopar.Mesh((2, 4, 2), ("pp", "dp", "tp"), device="h100", bandwidth=(25e9, 25e9, 450e9))
    pipeline = autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=4)
    mp = autopar.MixedPrecision()
    forced = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp x zero1"),
                          pipeline=pipeline, mixed_precision=mp)
    assert forced.pipeline.pipelined
    assert {forced.zero_stage(name) for name in forced.param_placements} == {1}
    held = sum(g["optimizer"] for g in forced.pipeline.group_memory)
    assert held == pytest.approx(forced.predicted.memory["optimizer"], rel=0.05)
    free = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), pipeline=pipeline,
                        mixed_precision=mp)
    assert forced.pipeline.step_s >= free.pipeline.step_s * (1 - 1e-9)


def test_each_group_synchronises_its_gradients_when_its_own_last_pass_ends():
    """On an asynchronous device a device group starts its once-per-step work when its own
    last pass ends (the runtime's buckets open during each stage's last backward), its
    gradients' synchronisation hidden behind that pass up to its length; a group that ends
    early does it while the others drain.  On CPU ranks (no overlap), and for the
    asynchronous schedules, it all follows the makespan."""
    from autopar.cost.schedules import Step
    from autopar.solve.pipeline.candidates import step_seconds
    tl = Step(makespan=10.0, bubble_fraction=0.1, in_flight=(2, 1), ends=(10.0, 8.0), last=(1.0, 1.0))
    once, sync = [2.0, 3.0], [1.5, 0.5]
    # group 0: 10 + 2 - min(1.5, 1) = 11; group 1: 8 + 3 - 0.5 = 10.5
    assert step_seconds(tl, once, sync, hides=True) == pytest.approx(11.0)
    assert step_seconds(tl, once, sync, hides=False) == pytest.approx(13.0)
    # nothing left after the pass: the step is the makespan
    assert step_seconds(tl, [0.5, 0.5], [0.5, 0.5], hides=True) == pytest.approx(10.0)
    assert step_seconds(Step(10.0, 0.1, (2, 1)), once, sync, hides=True) == pytest.approx(13.0)


def test_the_floor_stays_below_every_simulated_step_with_hidden_synchronisation():
    """The search stops at the first candidate whose floor loses; with each group's
    synchronisation hidden as it ends, the floor (every group's passes one after another,
    then what of its once-per-step work is not synchronisation) is still below the step
    evaluate simulates, for random stage costs, schedules and microbatch counts."""
    from autopar.solve.pipeline.candidates import evaluate, floor
    from autopar.solve.pipeline.costs import StageCost, StageParts
    rng = random.Random(5)

    def cost():
        once = rng.uniform(0.0, 2.0)
        return StageCost(forward_s=rng.uniform(0.1, 1.0), backward_s=rng.uniform(0.2, 2.0), once_s=once,
                         params=1.0, grads=1.0, optimizer=1.0, activations=1.0, sync_s=rng.uniform(0.0, once))

    checked = 0
    for trial in range(60):
        layers = tuple(cost() for _ in range(rng.choice([4, 6, 8])))
        parts = StageParts(layers, cost(), cost())
        copies = StageCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        p = rng.choice([2, 4])
        schedule = rng.choice(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"])
        v = 2 if schedule == "interleaved-1f1b" else 1
        if len(layers) < p * v:
            continue
        n_mb = rng.choice([p, 2 * p, 4 * p])
        for overlap in (False, True):
            got = evaluate(parts, copies, 0.01, p * v, p, v, schedule, n_mb, float("inf"), overlap)
            low = floor(parts, copies, 0.01, p * v, p, n_mb, overlap, schedule)
            assert low <= got.step_s * (1 + 1e-9), (schedule, p, n_mb, overlap, low, got.step_s)
            checked += 1
    assert checked >= 60


def test_memory_ceiling_is_never_below_what_a_simulated_layout_holds():
    """The search prices a candidate's hand-written stage layouts only where some layout of
    it might not fit under the free plan (search._tight, by memory_ceiling: every forward a
    device group runs in flight at once).  So the ceiling must be at or above the memory
    evaluate finds, for random stage costs and every schedule, virtual count and
    microbatch count (asynchronous schedules' stashed weights, chimera's two copies and the
    V-shaped schedules' two chunks included)."""
    from autopar.cost.schedules import least_microbatches
    from autopar.solve.pipeline.candidates import evaluate, memory_ceiling
    from autopar.solve.pipeline.costs import StageCost, StageParts
    from autopar.solve.pipeline.options import SCHEDULE_CHOICES, SearchSpace
    rng = random.Random(11)
    space = SearchSpace(autopar.Mesh((8,), ("pp",), device="h100"), 64, 80e9, SCHEDULE_CHOICES, None, None, ("none",))

    def cost():
        return StageCost(forward_s=rng.uniform(0.1, 1.0), backward_s=rng.uniform(0.2, 2.0), once_s=0.1,
                         params=rng.uniform(1, 4), grads=rng.uniform(1, 4), optimizer=rng.uniform(2, 8),
                         activations=rng.uniform(0.5, 3.0), working=rng.uniform(0, 2))

    checked, tight = 0, 0
    for trial in range(40):
        layers = tuple(cost() for _ in range(rng.choice([4, 6, 8, 12])))
        parts = StageParts(layers, cost(), cost())
        copies = StageCost(0.0, 0.0, 0.0, params=0.5, grads=0.5, optimizer=1.0, activations=0.0)
        p = rng.choice([2, 4])
        for schedule in SCHEDULE_CHOICES:
            for v in space.virtuals(schedule, len(layers), p):
                n_mb = rng.choice([p, 2 * p, 4 * p])
                if len(layers) < p * v or n_mb < least_microbatches(schedule, p) or (
                        schedule == "chimera" and (p % 2 or n_mb % p)) or (
                        schedule == "interleaved-1f1b" and n_mb % p):
                    continue
                got = evaluate(parts, copies, 0.01, p * v, p, v, schedule, n_mb, float("inf"), True)
                ceiling = memory_ceiling(parts, copies, p * v, p, v, schedule, n_mb)
                assert max(got.memory) <= ceiling * (1 + 1e-12), (schedule, p, v, n_mb, got.memory, ceiling)
                tight += max(got.memory) >= 0.5 * ceiling
                checked += 1
    assert checked >= 200 and tight >= checked // 4   # (and not so loose that it always prices them)


@pytest.mark.slow   # (four pipeline searches: 15 s)
def test_hand_written_stage_layouts_priced_only_where_the_free_plan_may_not_fit():
    """Where every layout of a candidate fits under its free stage plan, the hand-written
    stage layouts (Megatron-SP, Megatron x ZeRO-1), which keep less but run no faster, are not
    priced; where the budget binds they are, and one wins.  Either way the search returns
    what it returns pricing them for every candidate."""
    from autopar.solve.pipeline import search as searching
    model, example = build("llama3-8b", device="meta", batch=32, seq=1024, dim=1024, n_layers=8, n_heads=8,
                           n_kv_heads=4, vocab=32000, max_seq=1024)
    mesh = autopar.Mesh((2, 4, 2), ("pp", "dp", "tp"), device="h100", bandwidth=(25e9, 25e9, 450e9))
    options = SolveOptions(compare=False, workers=1)
    tight = searching._tight
    for budget, priced in ((None, False), ("0.6GiB", True)):
        seen = []
        searching._tight = lambda space, key, free, seen=seen: seen.append(tight(space, key, free)) or seen[-1]
        try:
            lazy = search(model, mesh, example, memory_budget=budget, options=options,
                          mixed_precision=autopar.MixedPrecision())
            searching._tight = lambda space, key, free: True
            eager = search(model, mesh, example, memory_budget=budget, options=options,
                           mixed_precision=autopar.MixedPrecision())
        finally:
            searching._tight = tight
        assert any(seen) == priced and len(seen) >= 2, (budget, seen)
        assert (lazy.step_s, lazy.schedule, lazy.n_microbatches, lazy.stage_layout, lazy.recompute) == (
            eager.step_s, eager.schedule, eager.n_microbatches, eager.stage_layout, eager.recompute)
        assert (lazy.stage_layout is not None) == priced, (budget, lazy)
