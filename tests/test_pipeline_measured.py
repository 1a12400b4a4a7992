"""Real torch.distributed.pipelining schedules on 4 gloo ranks, timed pass by pass and
compared with the simulator; see tests/pp_cases.py for the model and the job.

Why the comparison is fair on a small CPU host.  The 4 ranks share the host's cores (2
in CI), so a pass's wall time depends on how many ranks compute at the same moment, and
a rank woken by a received activation may wait for a core.  Two things keep the
simulator's account within BUBBLE_TOL of the measured one:
  - compute dominates: one forward of one stage is ~8 ms alone (~20 ms when 4 ranks
    share 2 cores) against hand-offs of 1-3 ms.  With stages 4x lighter (~5 ms per
    forward under sharing) GPipe with 8 microbatches measured 0.15 above the simulator.
  - the simulator is fed what the step measured (pass_times): the mean forward time of
    each stage, the mean backward/forward ratio and the mean hand-off delay as comm_time.
Core sharing on its own pulls the other way: passes that overlap stretch, so the bubble
comes out below a simulation with mean times (an ideal processor-sharing replay of GPipe
with 8 microbatches, 4 ranks on 2 cores, gives 0.19 against the simulator's 0.28).  At
this size the two effects roughly cancel: per step the differences stay within +-0.07,
and each case compares the median of 3 measured steps' differences (within +-0.06, also
with a busy loop taking one of the 2 cores).
"""
import statistics
import xml.etree.ElementTree as ET

import pp_cases
import pytest
import torch

from autopar.runtime.pipeline.pass_times import PassTimes, pass_times
from autopar.cost.schedules import Timeline
from autopar.report.gantt import gantt_svg
from autopar.cost.schedules import simulate

BUBBLE_TOL = 0.10
CASES = [("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8)]
_RUNS: dict = {}


def measured(pool, schedule: str, n_microbatches: int) -> list:
    """The per-rank results of pp_cases.measured_bubble, run once per session and case."""
    if (schedule, n_microbatches) not in _RUNS:
        _RUNS[schedule, n_microbatches] = pool.run(pp_cases.measured_bubble, schedule, n_microbatches)
    return _RUNS[schedule, n_microbatches]


def torch_order(schedule: str, rank: int, S: int, B: int) -> list:
    """The passes torch 2.13 runs on `rank`, in order.  GPipe: all forwards, then all
    backwards in forward order (the simulator runs them in reverse, which gives the same
    bubble for equal stages).  1F1B: the simulator's order (S - rank - 1 warm-up
    forwards, then alternating, then the remaining backwards)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(B)] + [("B", m) for m in range(B)]
    return [(e.kind, e.microbatch) for e in simulate("1f1b", S, B).on(rank)]


def test_pass_times_recover_simulator_inputs():
    """On a simulated timeline pass_times returns exactly the simulator's inputs: a hand-off
    to an idle rank starts comm_time after its input's pass ends."""
    tl = simulate("1f1b", 4, 8, [1.0, 2.0, 1.5, 0.5], backward_ratio=2.5, comm_time=0.25)
    costs = pass_times(tl)
    assert costs.forward == pytest.approx((1.0, 2.0, 1.5, 0.5))
    assert costs.backward_ratio == pytest.approx(2.5)
    assert costs.comm_time == pytest.approx(0.25)
    assert costs.simulate("1f1b", 8).bubble_fraction == pytest.approx(tl.bubble_fraction)


@pytest.mark.parametrize("schedule, kwargs", [
    ("zbv", {"stage_times": [1.0, 2.0, 1.5, 0.5], "w_fraction": 0.4}),
    ("chimera", {"stage_times": [1.0, 2.0, 1.5, 0.5]}),
    ("interleaved-1f1b", {"stage_times": [1.0, 2.0, 1.5, 0.5], "n_virtual": 2})])
def test_pass_times_recover_simulator_inputs_with_two_chunks(schedule, kwargs):
    """Two chunks per rank (interleaved, ZB-V's V, Chimera's two pipelines) and weight
    passes: pass_times gives back the per-rank (Chimera: per-stage) forward times, the
    backward ratio, the weight share and the hand-off, and its replay has the same bubble."""
    tl = simulate(schedule, 4, 8, backward_ratio=2.5, comm_time=0.25, **kwargs)
    costs = pass_times(tl)
    if schedule == "chimera":
        assert [statistics.fmean((costs.chunks[k][0], costs.chunks[3 - k][1])) for k in range(4)] == \
            pytest.approx(kwargs["stage_times"])
    else:
        assert costs.forward == pytest.approx(tuple(kwargs["stage_times"]))
    assert costs.backward_ratio == pytest.approx(2.5)
    assert costs.comm_time == pytest.approx(0.25)
    if schedule == "zbv":
        assert costs.w_fraction == pytest.approx(0.4)
    assert costs.simulate(schedule, 8).bubble_fraction == pytest.approx(tl.bubble_fraction)


@pytest.mark.parametrize("schedule,n_microbatches", CASES)
def test_measured_bubble_matches_simulator(pool4, schedule, n_microbatches):
    """Every rank ran one F and one B of every microbatch, in torch's order, and the
    measured bubble is within BUBBLE_TOL of simulate() fed with the measured times."""
    S, B = 4, n_microbatches
    timelines = measured(pool4, schedule, B)[0]["timelines"]
    rows = []
    for tl in timelines:
        assert (tl.n_stages, tl.n_microbatches, len(tl.events)) == (S, B, 2 * S * B)
        for r in range(S):
            assert [(e.kind, e.microbatch) for e in tl.on(r)] == torch_order(schedule, r, S, B)
        costs = pass_times(tl)
        rows.append((tl.bubble_fraction, costs.simulate(schedule, B).bubble_fraction, costs))
    report = "\n".join(f"measured {m:.3f} simulated {s:.3f} ({c})" for m, s, c in rows)
    diff = statistics.median(m - s for m, s, _ in rows)
    assert abs(diff) < BUBBLE_TOL, f"{schedule}, {B} microbatches: median difference {diff:+.3f}\n{report}"


@pytest.mark.parametrize("schedule,n_microbatches", [("gpipe", 4), ("1f1b", 8)])
def test_pipeline_matches_single_device(pool4, schedule, n_microbatches):
    """The 4-stage pipeline's loss (mean of the microbatch losses) and every parameter's
    gradient equal those of build_model() run whole on the whole batch.  The gradients are
    ~1e-4 at most (32 ReLU layers shrink the signal), so atol 1e-9 is 1e-5 of them; the
    pipeline is off by ~1e-10 (summation order).  A microbatch left out of the sum would be
    off by ~1e-5, a missing 1/n_microbatches scale by ~1e-4."""
    results = measured(pool4, schedule, n_microbatches)
    model = pp_cases.build_model()
    x, target = pp_cases.batch(n_microbatches)
    loss = pp_cases.loss_fn(model(x), target)
    loss.backward()
    assert statistics.fmean(results[-1]["losses"]) == pytest.approx(loss.item(), rel=1e-5)
    grads = {name: g for rank_result in results for name, g in rank_result["grads"].items()}
    assert sorted(grads) == sorted(name for name, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_gantt_of_measured_gpipe(pool4, tmp_path):
    """The SVG of a measured GPipe step parses and holds one event rect per pass, of its
    kind, plus the background and one legend swatch per kind."""
    tl = measured(pool4, "gpipe", 4)[0]["timelines"][-1]
    path = gantt_svg(tl, tmp_path / "gpipe-measured.svg", title="measured gpipe")
    root = ET.parse(path).getroot()
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    events = [r.get("class").split()[1] for r in rects if r.get("class").startswith("event")]
    assert sorted(events) == sorted(e.kind for e in tl.events) == ["B"] * 16 + ["F"] * 16
    assert len(rects) == 1 + len(tl.events) + 2
    assert f"bubble {tl.bubble_fraction:.1%}" in ET.tostring(root, encoding="unicode")


def test_pass_times_reads_and_errors():
    """A readable summary; a rank without forwards is named."""
    costs = PassTimes((0.0123, 0.02), 2.04, 0.0015)
    assert str(costs) == "forward [12.3, 20] ms per stage, backward 2.04x forward, hand-off 1.5 ms"
    equal = PassTimes((0.01, 0.01), 2.0, 0.0).simulate("gpipe", 2)
    assert equal.bubble_fraction == pytest.approx(1 / 3)  # (S-1) / (B+S-1)
    tl = simulate("gpipe", 2, 2)
    with pytest.raises(ValueError, match="rank 1 ran no forward"):
        pass_times(Timeline("measured", 2, 2, tuple(e for e in tl.events if e.rank == 0)))
