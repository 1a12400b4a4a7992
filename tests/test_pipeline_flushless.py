"""PipeDream-2BW (schedule "pipedream-2bw", autopar.Pipeline(asynchronous=True)): 1F1B over a
stream of steps without flushes, trained on gloo ranks against a one-device reference of
its update rule W(t+1) = W(t) - lr grad f(W(t-1)) (tests/rt_cases.stale_reference)."""
from __future__ import annotations

import pytest
from rt_cases import build_case, stale_checkpoint, train_stale_and_compare

import autopar
from autopar.cost.bubbles import bubble_formula
from autopar.cost.schedules import simulate


def stale_plan(spec, shape, names, groups, layout=None, microbatches=4):
    model, args, kwargs = build_case(spec)
    return autopar.plan(model, autopar.Mesh(shape, names, device="cpu"), args, example_kwargs=kwargs or None,
                        solve=autopar.SolveOptions(compare=False, layout=layout),
                        pipeline=autopar.Pipeline(axis=names[0], groups=groups, schedule="pipedream-2bw",
                                                  microbatches=microbatches, asynchronous=True))


@pytest.mark.parametrize("model, shape, names, groups, layout, pool", [
    ("gpt-tiny", (2,), ("pp",), 2, None, "pool2"),
    ("llama-tiny", (4,), ("pp",), 4, None, "pool4"),
    ("gpt-tiny", (2, 2), ("pp", "tp"), 2, "megatron-tp", "pool4"),
    ("llama-tiny", (2, 2), ("pp", "dp"), 2, "data-parallel", "pool4"),
])
def test_stale_weights_train_like_the_reference_rule(request, model, shape, names, groups, layout, pool):
    """3 steps + drain: every loss, every update's gradient and the final weights equal the
    one-device reference of 2BW's rule; the first step leaves no gradient (no step is
    complete), and the result is not plain synchronous training."""
    spec = ("autopar", model, (("n_layers", 4), ("batch", 8)))
    plan = stale_plan(spec, shape, names, groups, layout)
    assert plan.pipeline.schedule == "pipedream-2bw"
    assert "asynchronous" in plan.pipeline.summary and "one update older" in plan.pipeline.summary
    results = request.getfixturevalue(pool).run(train_stale_and_compare, spec, plan.to_dict())
    bad = [r for r in results if not r["ok"]]
    assert not bad, bad[0]
    assert all(r["from_synchronous"] > 1e-6 for r in results), results[0]


def test_steady_state_has_no_bubble_and_asks_for_permission():
    """The simulator's steady state: B forwards and backwards per stage per step, the step
    B times the slowest stage (equal stages: no bubble, 1F1B's in-flight microbatches);
    the schedule is refused unless asynchronous=True, and the search offers it only then."""
    tl = simulate("pipedream-2bw", 4, 8)
    assert tl.makespan == pytest.approx(8 * 3) and tl.bubble_fraction == pytest.approx(0.0)
    assert bubble_formula("pipedream-2bw", 4, 8) == 0.0
    assert [tl.max_in_flight(r) for r in range(4)] == [4, 3, 2, 1]
    uneven = simulate("pipedream-2bw", 4, 8, [1.0, 2.0, 1.5, 0.5])
    assert uneven.makespan == pytest.approx(8 * 2.0 * 3)
    assert simulate("1f1b", 4, 8).makespan == pytest.approx((8 + 3) * 3)
    with pytest.raises(ValueError, match="at least n_stages"):
        simulate("pipedream-2bw", 4, 3)
    with pytest.raises(ValueError, match="asynchronous=True"):
        autopar.Pipeline(schedule="pipedream-2bw").check(autopar.Mesh((2,), ("pp",), device="cpu"))
    spec = ("autopar", "gpt-tiny", (("n_layers", 4), ("batch", 8)))
    model, args, _ = build_case(spec)
    mesh = autopar.Mesh((4,), ("pp",), device="cpu")
    plain = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False),
                         pipeline=autopar.Pipeline(axis="pp", groups=4, microbatches=4))
    assert plain.pipeline.schedule != "pipedream-2bw"
    allowed = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False),
                           pipeline=autopar.Pipeline(axis="pp", groups=4, microbatches=4, asynchronous=True))
    assert allowed.pipeline.schedule == "pipedream-2bw"
    assert allowed.pipeline.step_s < plain.pipeline.step_s


def test_no_checkpoint_with_backwards_pending(pool2, tmp_path):
    """Saving while the last step's backwards are pending is refused by name (the state
    would hold half a step); after cm.drain() and the optimizer step it saves and loads."""
    spec = ("autopar", "gpt-tiny", (("n_layers", 4), ("batch", 8)))
    plan = stale_plan(spec, (2,), ("pp",), 2)
    result = pool2.run(stale_checkpoint, spec, plan.to_dict(), str(tmp_path / "ckpt"))[0]
    assert result["refused"] and "cm.drain()" in result["refused"]
    assert result["step"] == 2 and result["same"]
