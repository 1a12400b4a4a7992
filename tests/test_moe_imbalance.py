"""Routing imbalance in a mixture-of-experts plan's price: a dropless experts op whose
experts are split runs as long as its busiest rank.  By default the price is that of
uniformly random routing (the expected maximum load of balls in bins); moe_imbalance states
a trained router's own."""
from __future__ import annotations

import math
import sys
import pathlib

import pytest

import autopar
from autopar.cost.prices import routing_imbalance

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from hf_archs import build  # noqa: E402


def test_random_routing_imbalance_shrinks_with_the_batch():
    assert routing_imbalance(1000, 1) == 1.0
    assert routing_imbalance(4096, 4) == pytest.approx(1 + math.sqrt(2 * 4 * math.log(4) / 4096))
    assert routing_imbalance(64, 8) > routing_imbalance(65536, 8) > 1.0
    assert routing_imbalance(65536, 8) < 1.03


def _experts_seconds(plan) -> float:
    return sum(n.compute_s for n in plan.nodes if n.op == "autopar.experts")


def test_stated_imbalance_prices_the_busiest_rank():
    model, kwargs = build("mixtral")
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plans = {r: autopar.plan(model, mesh, example_kwargs=kwargs,
                             solve=autopar.SolveOptions(compare=False, layout="expert-parallel"),
                             pricing=autopar.Pricing(moe_imbalance=r)) for r in (1.0, 2.0)}
    default = autopar.plan(model, mesh, example_kwargs=kwargs,
                           solve=autopar.SolveOptions(compare=False, layout="expert-parallel"))
    assert _experts_seconds(plans[2.0]) == pytest.approx(2 * _experts_seconds(plans[1.0]), rel=1e-6)
    # 4 x 16 tokens x 2 slots over 2 expert ranks, randomly routed
    expected = routing_imbalance(4 * 16 * 2, 2)
    assert _experts_seconds(default) == pytest.approx(expected * _experts_seconds(plans[1.0]), rel=1e-6)
    assert plans[1.0].predicted.step_s < default.predicted.step_s < plans[2.0].predicted.step_s
    assert "2.000x the mean rows (moe_imbalance=2)" in str(plans[2.0])
    assert f"{expected:.3f}x the mean rows (uniformly random routing" in str(default)
    # the tokens-only layout does not split experts: imbalance changes nothing there
    dp = [autopar.plan(model, mesh, example_kwargs=kwargs,
                       solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                       pricing=autopar.Pricing(moe_imbalance=r))
          for r in (1.0, 3.0)]
    assert dp[0].predicted.step_s == pytest.approx(dp[1].predicted.step_s)


@pytest.mark.parametrize("bad", [0.5, "high", True])
def test_a_bad_imbalance_is_refused(bad):
    model, kwargs = build("mixtral")
    with pytest.raises(ValueError, match="moe_imbalance"):
        autopar.plan(model, autopar.Mesh((2,), ("tp",), device="cpu"), example_kwargs=kwargs,
                     solve=autopar.SolveOptions(compare=False), pricing=autopar.Pricing(moe_imbalance=bad))


def test_measured_imbalance_is_the_sample_batchs_busiest_rank():
    """moe_imbalance="measured" runs the model once on the example batch: the factor priced
    for experts split over 2 ranks is the busiest half's routed rows over the mean, counted
    here independently from the router's own choices."""
    import torch
    from autopar.trace.experts import measure_routing
    model, kwargs = build("mixtral")
    chosen = []

    def keep(module, args, output):   # the top-k experts each token picked, per layer
        chosen.append(next(t for t in output if not t.is_floating_point()))
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [g.register_forward_hook(keep) for g in gates]
    with torch.no_grad():
        model(**kwargs)
    for h in handles:
        h.remove()
    worst = 0.0
    for picked in chosen:
        per_rank = torch.bincount((picked.reshape(-1) >= 2).long(), minlength=2).double()   # experts 0-1, 2-3
        worst = max(worst, float(per_rank.max() / per_rank.mean()))
    measured = measure_routing(model, (), kwargs)
    assert measured[2] == pytest.approx(worst)
    assert set(measured) == {2, 4} and measured[4] >= measured[2] >= 1.0
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plans = {r: autopar.plan(model, mesh, example_kwargs=kwargs,
                             solve=autopar.SolveOptions(compare=False, layout="expert-parallel"),
                             pricing=autopar.Pricing(moe_imbalance=r)) for r in (1.0, "measured")}
    assert _experts_seconds(plans["measured"]) == pytest.approx(measured[2] * _experts_seconds(plans[1.0]), rel=1e-6)
    assert f"{measured[2]:.3f}x the mean rows (measured on the example batch" in str(plans["measured"])


def test_measuring_needs_real_tensors_and_experts():
    import torch
    model, kwargs = build("llama")
    with pytest.raises(ValueError, match="no experts module"):
        autopar.plan(model, autopar.Mesh((2,), ("tp",), device="cpu"), example_kwargs=kwargs,
                     solve=autopar.SolveOptions(compare=False), pricing=autopar.Pricing(moe_imbalance="measured"))
    with torch.device("meta"):
        model, _ = build("mixtral")
    meta = {k: v.to("meta") for k, v in kwargs.items()}
    with pytest.raises(ValueError, match="real tensors"):
        autopar.plan(model, autopar.Mesh((2,), ("tp",), device="cpu"), example_kwargs=meta,
                     solve=autopar.SolveOptions(compare=False), pricing=autopar.Pricing(moe_imbalance="measured"))
