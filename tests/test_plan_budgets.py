"""Planning time held by checks (the slow tier): the large plans of benchmarks/plan_time.py
against llama3-8b on 64 H100 planned beside them, as ratios of the CPU seconds planning
takes (the process's and its forked planners'), so the next change that slows planning
fails here on any machine, loaded or not: wall-clock ratios moved with the load (CI's
8b-8x8-pp read 7.2x the 8B plan where a quiet machine reads 4.7x, its two planning
processes sharing the cores with other jobs), CPU seconds hardly do.

The bounds are today's ratios with room (2026-12-07, third session, CPU seconds over the
8B plan's 1.57: 8b-8x8-pp 8.5, 5.4x; 405b-16k-pp 58.9, 37.5x (was 52-65x); dsv3-2048 6.8,
4.3x; dsv3-2048-pp 176, 112x (was 680 CPU seconds); qwen3-235b-2048 28.9, 18.4x (16-17x
before); fourth session, over the 8B plan's 1.41-1.42: 8b-8x8-pp 5.9-6.0, 4.2x;
405b-16k-pp 45.4, 32x; dsv3-2048-pp 130, 92x; the wall-clock figures, and the issue's targets for them, are
docs/PERFORMANCE.md#planning-time-at-scale).  qwen3-235b-2048-pp (75 CPU seconds, 48x) is
held by the benchmark alone: two minutes of CI for what dsv3-2048-pp already guards.
Every case is planned in a fresh process, as the benchmark plans it, and each ratio is
against the least of three plans of the 8B case.  The predicted steps are held too (plan
quality must not drop for speed): 405b-16k-pp 2.488 s, dsv3-2048 1.201 s, dsv3-2048-pp
1.374 s."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plan_time  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = {"405b-16k-pp": 2.48786, "dsv3-2048": 1.20146, "dsv3-2048-pp": 1.37406}
BOUNDS = {"8b-8x8-pp": 6.0, "405b-16k-pp": 45.0, "dsv3-2048": 8.0, "dsv3-2048-pp": 125.0, "qwen3-235b-2048": 24.0}


def _plan_seconds(name: str) -> tuple[float, dict]:
    """CPU seconds of planning (no imports, no model build; plan_time's cpu_s) of one case
    in a fresh process, as the benchmark plans it: in this process a second plan of the same
    model reuses its trace, which made the 8B plan 20 % quicker and the ratios unfair."""
    row = plan_time.run_case_subprocess(name, False, timeout=900)
    assert "error" not in row, row
    return row["cpu_s"], row


@pytest.fixture(scope="module")
def eight_b() -> float:
    """The 8B case's planning CPU seconds: the least of three."""
    return min(_plan_seconds("8b-8x8")[0] for _ in range(3))


@pytest.mark.parametrize("case", list(BOUNDS))
def test_large_plans_stay_within_their_share_of_the_8b_plan(case, eight_b):
    if plan_time.SCALE[case].hf:
        pytest.importorskip("transformers")
    seconds, row = _plan_seconds(case)
    ratio = seconds / eight_b
    assert ratio <= BOUNDS[case], (f"{case}: {seconds:.1f} CPU seconds ({row['total_s']:.1f} s wall), {ratio:.1f}x "
                                   f"the 8B plan's {eight_b:.2f}")
    if case in STEPS:
        assert row["step_s"] == pytest.approx(STEPS[case], rel=1e-3)
