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
    plans = {r: autopar.plan(model, mesh, example_kwargs=kwargs, compare=False, layout="expert-parallel",
                             moe_imbalance=r) for r in (1.0, 2.0)}
    default = autopar.plan(model, mesh, example_kwargs=kwargs, compare=False, layout="expert-parallel")
    assert _experts_seconds(plans[2.0]) == pytest.approx(2 * _experts_seconds(plans[1.0]), rel=1e-6)
    # 4 x 16 tokens x 2 slots over 2 expert ranks, randomly routed
    expected = routing_imbalance(4 * 16 * 2, 2)
    assert _experts_seconds(default) == pytest.approx(expected * _experts_seconds(plans[1.0]), rel=1e-6)
    assert plans[1.0].predicted.step_s < default.predicted.step_s < plans[2.0].predicted.step_s
    assert "2.000x the mean rows (moe_imbalance=2)" in str(plans[2.0])
    assert f"{expected:.3f}x the mean rows (uniformly random routing" in str(default)
    # the tokens-only layout does not split experts: imbalance changes nothing there
    dp = [autopar.plan(model, mesh, example_kwargs=kwargs, compare=False, layout="data-parallel", moe_imbalance=r)
          for r in (1.0, 3.0)]
    assert dp[0].predicted.step_s == pytest.approx(dp[1].predicted.step_s)


@pytest.mark.parametrize("bad", [0.5, "high", True])
def test_a_bad_imbalance_is_refused(bad):
    model, kwargs = build("mixtral")
    with pytest.raises(ValueError, match="moe_imbalance"):
        autopar.plan(model, autopar.Mesh((2,), ("tp",), device="cpu"), example_kwargs=kwargs, compare=False,
                     moe_imbalance=bad)
