"""autopar.plan(accumulation=k): a job that accumulates gradients over k micro-steps
(`cm.no_sync()` around all but the last) pays the optimizer step, ZeRO-1/2's gathers after
it and the bucketed gradient reductions once per step, so each micro-step is charged 1/k of
them (Pricing.accumulation); a ZeRO-2 rank keeps its whole local gradient between
micro-steps; ZeRO-3's reduce-scatters run every micro-step.  Planned on the h100 preset (an
asynchronous device, where backward hides gradient buckets) from meta tensors."""
from __future__ import annotations

import math

import pytest

import autopar
from rt_cases import accumulate_vs_whole_batch, build_case

GPT = ("autopar", "gpt-tiny", (("hidden", 128), ("batch", 8)))
K = 4


def _plans(layout, shape=(4,), names=("dp",), spec=GPT, **kw):
    model, example, _ = build_case(spec)
    mesh = autopar.Mesh(shape, names, device="h100")
    return [autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout),
                         pricing=autopar.Pricing(accumulation=k), **kw) for k in (1, K)]


def _optimizer(plan) -> float:
    return sum(n.compute_s for n in plan.nodes if n.op == "parameter")


def _seconds(plan, kind, phase) -> float:
    return sum(c.seconds for c in plan.collectives_of(kind=kind, phase=phase))


def test_data_parallel_shares_the_optimizer_and_the_all_reduce_over_the_micro_steps():
    one, acc = _plans("data-parallel")
    assert acc.accumulation == K and one.accumulation == 1
    assert [(n.strategy, n.outputs) for n in one.nodes] == [(n.strategy, n.outputs) for n in acc.nodes]
    assert _optimizer(acc) == pytest.approx(_optimizer(one) / K, rel=1e-9)
    # a parameter's gradient is all-reduced once per step, and so is the position
    # embedding's sum over the batch: that gradient stays Partial back to the weight and
    # joins its bucket (passes/collectives._deferrable_cones), as the runtime runs it
    reduced = 0.0
    for a, b in zip(one.collectives_of(phase="backward"), acc.collectives_of(phase="backward")):
        assert (a.kind, a.tensor, a.nbytes) == (b.kind, b.tensor, b.nbytes)
        assert b.seconds == pytest.approx(a.seconds / K, rel=1e-9), a
        reduced += a.seconds
    assert reduced > 0
    assert [a.tensor for a in one.collectives_of(phase="backward") if a.tensor not in one.param_placements] \
        == ["embedding_1"]
    ops = [n.compute_s for n in one.nodes if n.op != "parameter"]
    assert ops == [n.compute_s for n in acc.nodes if n.op != "parameter"]
    # the buckets overlap the last micro-step's backward only: what it hides of them, shared over K
    assert one.predicted.hidden_s > 0
    assert acc.predicted.hidden_s == pytest.approx(one.predicted.hidden_s / K, rel=1e-9)
    assert acc.predicted.memory == one.predicted.memory
    # the whole step: K micro-steps of forward and backward, the once-per-step work once
    once = _optimizer(one) + reduced - one.predicted.hidden_s
    assert K * acc.predicted.step_s == pytest.approx(K * (one.predicted.step_s - once) + once, rel=1e-9)


def test_zero2_keeps_its_whole_gradient_and_gathers_once():
    one, acc = _plans("zero2")
    assert _seconds(one, "reduce_scatter", "backward") > 0 and _seconds(one, "all_gather", "step") > 0
    for kind, phase in (("reduce_scatter", "backward"), ("all_gather", "step")):
        assert _seconds(acc, kind, phase) == pytest.approx(_seconds(one, kind, phase) / K, rel=1e-9), kind
    params = one.predicted.memory["params"]   # (no mixed precision: gradients as wide as the weights)
    assert one.predicted.memory["grads"] == pytest.approx(params / 4, rel=0.02)
    assert acc.predicted.memory["grads"] == pytest.approx(params, rel=1e-9)


def test_zero3_reduce_scatters_every_micro_step():
    one, acc = _plans("zero3")
    scattered = _seconds(one, "reduce_scatter", "backward")
    assert scattered > 0
    assert _seconds(acc, "reduce_scatter", "backward") == pytest.approx(scattered, rel=1e-9)
    assert _seconds(acc, "all_gather", "forward") == pytest.approx(_seconds(one, "all_gather", "forward"), rel=1e-9)
    assert _optimizer(acc) == pytest.approx(_optimizer(one) / K, rel=1e-9)


def test_the_plan_is_never_slower_than_a_hand_written_layout_at_the_same_accumulation():
    """On a (2, 2) mesh the ILP's plan against every hand-written layout priced for the same
    accumulation (plan.baselines), per micro-step; and its accumulation is recorded, printed
    and kept by a round trip."""
    model, example, _ = build_case(("autopar", "gpt-tiny", (("hidden", 256), ("batch", 8))))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plan = autopar.plan(model, mesh, example, pricing=autopar.Pricing(accumulation=8))
    fits = [p.step_s for p in plan.baselines.values() if not isinstance(p, str) and p.memory_total <= 80 * 2**30]
    assert fits and plan.predicted.step_s <= min(fits) * (1 + 1e-9)
    assert "gradient accumulation over 8 micro-steps" in str(plan)
    again = autopar.Plan.from_dict(plan.to_dict())
    assert again.accumulation == 8 and again.predicted == plan.predicted


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_a_bad_accumulation_is_refused(bad):
    model, example, _ = build_case(GPT)
    with pytest.raises(ValueError, match=r"accumulation=.*micro-steps per optimizer step"):
        autopar.plan(model, autopar.Mesh((4,), ("dp",), device="h100"), example,
                     pricing=autopar.Pricing(accumulation=bad))


def test_accumulation_with_pipeline_stages_is_refused():
    model, example, _ = build_case(GPT)
    with pytest.raises(ValueError, match=r"microbatches"):
        autopar.plan(model, autopar.Mesh((2, 2), ("pp", "dp"), device="h100"), example,
                     pricing=autopar.Pricing(accumulation=2), pipeline=autopar.Pipeline(axis="pp"))


@pytest.mark.parametrize("layout", ["data-parallel", "zero2"])
def test_a_plan_priced_for_accumulation_trains_like_the_whole_batch(pool4, layout):
    """What the user runs with such a plan: micro-steps under no_sync, then one that reduces;
    the gradients equal one step on the whole batch."""
    model, example, _ = build_case(("autopar", "gpt-tiny", (("batch", 16),)))
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout))
    result = pool4.run(accumulate_vs_whole_batch, plan.to_dict(), 4, True)[0]
    assert result["accumulation"] == 4 and result["bucketed"] > 0
    assert result["worst"] <= 0, result
