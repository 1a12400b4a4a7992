"""Planning time held by checks (the slow tier): the large plans of benchmarks/plan_time.py
timed in one process against llama3-8b on 64 H100 timed beside them, as ratios that do
not depend on the machine, so the next change that slows planning fails here.

The bounds are today's quiet-machine ratios with room for a loaded one (2026-12-07, 2
cores: 8b-8x8 1.41 s, 8b-8x8-pp 6.57 s (4.7x), 405b-16k-pp 59.6 s (42x), dsv3-2048 18.0 s
(12.7x), qwen3-235b-2048 13.6 s (9.7x); docs/PERFORMANCE.md#planning-time-at-scale).  The
issue's target for the pipeline search is 2x plain planning: not met today, the bound
holds what is.  Every case is planned in a fresh process, as the benchmark plans it, and
each ratio is against the fastest of three plans of the 8B case.  The predicted
steps are held too (plan quality must not drop for speed): 405b-16k-pp 2.488 s,
dsv3-2048 1.201 s."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plan_time  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = {"405b-16k-pp": 2.48786, "dsv3-2048": 1.20146}
BOUNDS = {"8b-8x8-pp": 7.0, "405b-16k-pp": 65.0, "dsv3-2048": 20.0, "qwen3-235b-2048": 15.0}


def _plan_seconds(name: str) -> tuple[float, dict]:
    """Planning seconds (plan.timing: no imports, no model build) of one case in a fresh
    process, as the benchmark times it: in this process a second plan of the same model
    reuses its trace, which made the 8B plan 20 % quicker and the ratios unfair."""
    row = plan_time.run_case_subprocess(name, False, timeout=900)
    assert "error" not in row, row
    return row["total_s"], row


@pytest.fixture(scope="module")
def eight_b() -> float:
    """The 8B case's planning time: the fastest of three (a loaded machine slows some)."""
    return min(_plan_seconds("8b-8x8")[0] for _ in range(3))


@pytest.mark.parametrize("case", list(BOUNDS))
def test_large_plans_stay_within_their_share_of_the_8b_plan(case, eight_b):
    if plan_time.SCALE[case].hf:
        pytest.importorskip("transformers")
    seconds, row = _plan_seconds(case)
    ratio = seconds / eight_b
    assert ratio <= BOUNDS[case], f"{case}: {seconds:.1f} s, {ratio:.1f}x the 8B plan ({eight_b:.2f} s)"
    if case in STEPS:
        assert row["step_s"] == pytest.approx(STEPS[case], rel=1e-3)
