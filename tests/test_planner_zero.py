"""The ILP chooses how much model state to shard under a memory budget (llama3-8b on
64 H100s, dp=8 x tp=8): never over the budget, never a slower plan when a faster one fits,
more sharding as the budget shrinks, and a clear error below the least any plan needs."""
from __future__ import annotations

import re

import pytest

import autopar
from autopar.models import build

BUDGETS = [None, "15GiB", "10GiB", "7GiB"]


@pytest.fixture(scope="module")
def sweep():
    model, example = build("llama3-8b", device="meta", batch=8)
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    plans = [autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                          memory_budget=b) for b in BUDGETS]
    return model, example, mesh, plans


def _states(plan) -> float:
    m = plan.predicted.memory
    return m["params"] + m["grads"] + m["optimizer"]


def test_budget_is_kept_and_time_only_grows_as_it_shrinks(sweep):
    _, _, mesh, plans = sweep
    limits = [mesh.device.memory if b is None else autopar.mesh.parse_bytes(b) for b in BUDGETS]
    for plan, limit in zip(plans, limits):
        assert plan.predicted.memory_total <= limit
    for i, (plan, limit) in enumerate(zip(plans, limits)):
        for bigger in plans[:i]:
            assert plan.predicted.step_s >= bigger.predicted.step_s * (1 - 1e-9)
            if bigger.predicted.memory_total <= limit:  # a faster plan that fits is never passed over
                assert plan.predicted.step_s <= bigger.predicted.step_s * (1 + 1e-9)


def test_plans_shard_more_state_as_the_budget_shrinks(sweep):
    _, _, _, plans = sweep
    stages = [{plan.zero_stage(n) for n in plan.param_placements} for plan in plans]
    # (with room to spare ZeRO may still pay for itself: each rank steps only its chunk of Adam)
    assert stages[-1] & {2, 3}                                  # tight: ZeRO-2/3 somewhere
    states = [_states(p) for p in plans]
    assert all(a >= b for a, b in zip(states, states[1:])), states
    assert states[-1] < 0.5 * states[0]


def test_a_budget_below_the_minimum_names_the_minimum_and_the_fixes(sweep):
    model, example, mesh, _ = sweep
    # (with weights and activations offloadable, 1 GiB fits: 0.25 GiB does not)
    with pytest.raises(autopar.InfeasibleError) as info:
        autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), memory_budget="0.25GiB")
    text = str(info.value)
    floor = float(re.search(r"least-memory plan found needs ([\d.]+) GiB", text).group(1))
    assert 0.25 < floor < 3
    for hint in ("devices instead of 64", "activations offloaded to host memory", "with their weights",
                 "raise memory_budget"):
        assert hint in text, text
    with pytest.raises(autopar.InfeasibleError) as info:   # recomputation forced off: the error offers it
        autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), memory_budget="0.25GiB",
                     recompute="none")
    saved = re.search(r"recompute='full' \(or None, to let the planner choose per layer\) saves ([\d.]+) GiB "
                      r"per device, for a least of ([\d.]+) GiB", str(info.value))
    assert saved and float(saved.group(2)) >= floor - 0.01, str(info.value)   # (full keeps more than offload)
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                        memory_budget=f"{floor * 1.01:.3f}GiB")
    assert plan.predicted.memory_total <= floor * 1.01 * 2**30


def test_zero3_weights_are_priced_as_the_runtimes_buckets():
    """Under ZeRO-3 the runtime gathers a layer's weights in one call per bucket, and
    reduce-scatters their gradients the same way on the bucket stream (autopar/runtime/regions/reshard.py):
    each weight's gathers (forward and again in backward) and its reduce-scatter pay its
    bytes' share of a call's fixed seconds, no more; the solver's edge tables agree with
    the steps the plan lists, and a problem told the runtime does not group (pipeline
    stages) prices every call whole."""
    from autopar.solve.layouts import zero3
    from autopar.cost.prices import bucket_share
    from autopar.solve.assemble import predict
    from autopar.solve.overlap import solve_problem
    from autopar.solve.built import build_problem
    model, example = build("gpt-tiny", device="meta")
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    grouped = build_problem(model, mesh, example, {}).problem
    alone = build_problem(model, mesh, example, {}, grouped_gathers=False).problem
    choice = solve_problem(grouped, zero3, None).choice
    checked = 0
    for e in grouped.edges:
        a = grouped.nodes[e.a]
        i, j = choice[e.a], choice[e.b]
        key = grouped.rep_edge(e)
        fwd, bwd = grouped.steps.of(key, i, j)
        # (and the flat buffers' copies around the bucketed calls, which run on the compute stream)
        copies = grouped.edge_prices.copies.get(key)
        copied = float(copies[i, j]) if copies is not None else 0.0
        assert grouped.edge_costs[key][i, j] == pytest.approx(sum(st.seconds for st in fwd + bwd) + copied,
                                                              rel=1e-9, abs=1e-15)
        if e.kind != "data" or a.kind != "param" or not a.requires_grad or not fwd:
            continue
        whole_fwd, whole_bwd = alone.steps.of(alone.rep_edge(e), i, j)
        assert alone.rep_edge(e) not in alone.edge_prices.copies or not alone.edge_prices.copies[alone.rep_edge(e)][i, j]
        assert alone.edge_costs[alone.rep_edge(e)][i, j] == pytest.approx(
            sum(st.seconds for st in whole_fwd + whole_bwd), rel=1e-9, abs=1e-15)
        assert [st.kind for st in fwd] == ["all_gather"]
        if (a.rep, e.out) in grouped.paths.summed:   # a tied weight: its gradient is summed elsewhere
            assert not fwd[0].bucketed
            continue
        assert [st.kind for st in bwd] == ["reduce_scatter", "all_gather"]
        share = bucket_share(fwd[0].nbytes)
        for mine, theirs in zip(fwd + bwd, whole_fwd + whole_bwd):
            assert mine.bucketed and not theirs.bucketed
            assert mine.seconds == pytest.approx(theirs.seconds - theirs.fixed * (1 - share), rel=1e-9)
            assert mine.seconds < theirs.seconds
        # copied: the gathered weight out of the flat buffer twice and its gradient into the
        # reduce-scatter's (2 (s + n s) per gather, 2 (s + s / n) for the reduce-scatter, s its share)
        n, share = mesh.shape[0], 1.0 / mesh.shape[0]
        moved = 2 * 2 * (share + n * share) + 2 * (1.0 + 1.0 / n)
        assert copied == pytest.approx(moved * fwd[0].nbytes / mesh.device.mem_bandwidth + mesh.device.op_latency,
                                       rel=1e-9)
        checked += 1
    assert checked >= 10
    mine, theirs = predict(grouped, choice), predict(alone, choice)
    assert mine.step_s < theirs.step_s
    # the reduce-scatters now run on the bucket stream beside backward
    assert mine.overlappable_s - mine.prefetchable_s > theirs.overlappable_s - theirs.prefetchable_s
