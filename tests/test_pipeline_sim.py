"""Pipeline schedule simulator: closed-form bubbles, dependencies, memory, Gantt SVG.

Equal stages, forward tf = 1 and backward tb = 2 unless a test says otherwise; S stages,
B microbatches, v chunks per rank.
"""
import itertools
import random
import re
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from autopar.cost.bubbles import bubble_formula
from autopar.cost.schedules import (SCHEDULES, SPLIT_BACKWARD, TWO_WAY, Event, Timeline, placement_of,
                                    stage_of)
from autopar.report.gantt import gantt_svg
from autopar.cost.schedules import ASYNCHRONOUS, makespan_floor, simulate, simulate_step

EPS = 1e-9


def check_timeline(tl: Timeline, comm_time: float = 0.0) -> None:
    """Every (virtual stage, microbatch) has one F and one B (and one W under zero-bubble
    and zbv), no rank runs two passes at once, and every pass starts after its inputs arrive
    (zbv: chunk 0 of rank r is stage r, chunk 1 stage 2S-1-r; chimera: microbatch m runs
    down stages 0..S-1 when m % S < S/2, else up, numbered S..2S-1)."""
    S, B, v = tl.n_stages, tl.n_microbatches, tl.n_virtual
    kinds = "FBW" if tl.schedule in SPLIT_BACKWARD else "FB"
    placement = placement_of(tl.schedule)
    two_way = tl.schedule in TWO_WAY
    at = {}
    for e in tl.events:
        at[e.kind, stage_of(e.rank, e.chunk, S, placement), e.microbatch] = e
    count = Counter((e.kind, stage_of(e.rank, e.chunk, S, placement), e.microbatch) for e in tl.events)
    assert set(count.values()) == {1}

    def stages(m):
        if two_way:
            return range(S, 2 * S) if m % S >= S // 2 else range(S)
        return range(S * v)
    assert set(count) == {(k, s, m) for k in kinds for m in range(B) for s in stages(m)}

    for r in range(S):
        passes = tl.on(r)
        assert all(a.end <= b.start + EPS for a, b in itertools.pairwise(passes)), f"rank {r} overlaps"

    def after(e, dep):
        return e.start + EPS >= dep.end + (comm_time if dep.rank != e.rank else 0.0)

    for (kind, s, m), e in at.items():
        if kind == "F" and s > stages(m)[0]:
            assert after(e, at["F", s - 1, m])
        if kind == "B":
            assert after(e, at["F", s, m])
            if s < stages(m)[-1]:
                assert after(e, at["B", s + 1, m])
        if kind == "W":
            assert after(e, at["B", s, m])


CASES = [("naive", 4, 1, {}), ("gpipe", 4, 4, {}), ("gpipe", 3, 5, {"stage_times": [1.0, 2.5, 0.5]}),
         ("1f1b", 4, 8, {}), ("1f1b", 4, 2, {}), ("1f1b", 3, 6, {"stage_times": [2.0, 1.0, 1.5]}),
         ("interleaved-1f1b", 4, 8, {"n_virtual": 2}), ("interleaved-1f1b", 2, 6, {"n_virtual": 3}),
         ("zero-bubble", 4, 8, {}), ("zero-bubble", 4, 2, {}),
         ("zero-bubble", 3, 6, {"stage_times": [1.0, 3.0, 2.0], "backward_ratio": 3.0}),
         ("zbv", 4, 8, {}), ("zbv", 4, 3, {}), ("zbv", 2, 5, {}),
         ("zbv", 3, 7, {"stage_times": [1.0, 3.0, 2.0], "backward_ratio": 3.0, "w_fraction": 0.3}),
         ("dualpipev", 4, 8, {}), ("dualpipev", 2, 5, {}),
         ("dualpipev", 3, 7, {"stage_times": [1.0, 3.0, 2.0], "backward_ratio": 3.0, "w_fraction": 0.3}),
         ("chimera", 4, 8, {}), ("chimera", 2, 2, {}),
         ("chimera", 4, 4, {"stage_times": [1.0, 3.0, 2.0, 0.5], "backward_ratio": 3.0})]


@pytest.mark.parametrize("comm_time", [0.0, 0.25])
@pytest.mark.parametrize("schedule, S, B, kwargs", CASES)
def test_every_pass_once_no_overlap_dependencies_hold(schedule, S, B, kwargs, comm_time):
    tl = simulate(schedule, S, B, comm_time=comm_time, **kwargs)
    check_timeline(tl, comm_time)
    assert {e.rank for e in tl.events} == set(range(S))


def test_naive_uses_a_quarter_of_four_ranks():
    tl = simulate("naive", 4, 8)
    assert tl.n_microbatches == 1  # one batch, no microbatching
    assert tl.utilisation == 0.25
    assert tl.makespan == 4 * (1 + 2)
    assert bubble_formula("naive", 4, 8) == 0.75


@pytest.mark.parametrize("backward_ratio", [1.0, 2.0, 3.5])
def test_gpipe_4x4_utilisation_is_four_sevenths(backward_ratio):
    tl = simulate("gpipe", 4, 4, backward_ratio=backward_ratio)
    assert tl.utilisation == pytest.approx(4 / 7)
    assert tl.bubble_fraction == pytest.approx(3 / 7)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S, B", [(2, 4), (4, 4), (4, 8), (8, 16), (4, 2)])
def test_gpipe_and_1f1b_bubble_closed_form(schedule, S, B):
    tl = simulate(schedule, S, B)
    assert tl.makespan == pytest.approx((B + S - 1) * 3)
    assert tl.bubble_fraction == pytest.approx((S - 1) / (B + S - 1))
    assert bubble_formula(schedule, S, B) == pytest.approx(tl.bubble_fraction)


def test_gpipe_unequal_stages_and_comm_time():
    # identical jobs through a flow shop: sum of stage times + (B-1) x slowest, forward and backward
    assert simulate("gpipe", 4, 4, [1, 2, 1, 1]).makespan == pytest.approx(3 * (5 + 3 * 2))
    # each of the 2(S-1) hops on the critical path pays comm_time once
    assert simulate("gpipe", 4, 4, comm_time=0.5).makespan == pytest.approx(21 + 2 * 3 * 0.5)


@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_bubble_time_is_1f1b_over_v(v):
    S, B = 4, 8
    one_f_one_b = simulate("1f1b", S, B).makespan - B * 3
    tl = simulate("interleaved-1f1b", S, B, n_virtual=v)
    assert one_f_one_b == pytest.approx((S - 1) * 3)
    assert tl.makespan - B * 3 == pytest.approx(one_f_one_b / v)
    assert tl.bubble_fraction == pytest.approx(bubble_formula("interleaved-1f1b", S, B, v))
    assert tl.bubble_fraction == pytest.approx((S - 1) / (v * B + S - 1))


def test_interleaved_with_one_chunk_is_1f1b():
    assert simulate("interleaved-1f1b", 4, 8).events == simulate("1f1b", 4, 8).events


def test_zero_bubble_beats_1f1b():
    S, B = 4, 8
    zb, base = simulate("zero-bubble", S, B), simulate("1f1b", S, B)
    assert zb.bubble_fraction < base.bubble_fraction
    # ZB-H1 with tB = tW = tf: bubble time (S-1)(tf + tB - tW) = S-1, a third of 1F1B's 3(S-1)
    assert zb.makespan - B * 3 == pytest.approx((base.makespan - B * 3) / 3)
    assert zb.bubble_fraction == pytest.approx((S - 1) / (3 * B + S - 1))
    assert zb.bubble_fraction == pytest.approx(bubble_formula("zero-bubble", S, B))
    assert [zb.max_in_flight(r) for r in range(S)] == [S] * S  # the 1F1B peak, on every rank


@pytest.mark.parametrize("backward_ratio, w_fraction", [(1.0, 0.25), (3.0, 0.75), (4.0, 0.5)])
def test_zero_bubble_formula_other_splits(backward_ratio, w_fraction):
    tl = simulate("zero-bubble", 4, 8, backward_ratio=backward_ratio, w_fraction=w_fraction)
    assert tl.bubble_fraction == pytest.approx(
        bubble_formula("zero-bubble", 4, 8, backward_ratio=backward_ratio, w_fraction=w_fraction))


@pytest.mark.parametrize("S", [2, 4, 8])
@pytest.mark.parametrize("factor", [2, 3, 8])
def test_zbv_bubble_closed_form(S, factor):
    """ZB-V at 2, 4 and 8 stages (B >= 2S microbatches): with tf = tbB = tbW its idle time
    per rank is (S-1) half-stage forwards, half ZB-H1's (S-1) tf and a sixth of 1F1B's
    3(S-1) tf, holding 2S chunks (S stages' activations, 1F1B's peak) on the first rank."""
    B = factor * S
    zbv, zb, base = simulate("zbv", S, B), simulate("zero-bubble", S, B), simulate("1f1b", S, B)
    idle = zbv.makespan - 3 * B
    assert idle == pytest.approx((S - 1) / 2)
    assert idle == pytest.approx((zb.makespan - 3 * B) / 2)
    assert idle == pytest.approx((base.makespan - 3 * B) / 6)
    assert zbv.bubble_fraction == pytest.approx(bubble_formula("zbv", S, B))
    assert zbv.bubble_fraction == pytest.approx((S - 1) / (6 * B + S - 1))
    assert max(zbv.max_in_flight(r) for r in range(S)) == 2 * S == zbv.max_in_flight(0)


@pytest.mark.parametrize("S, B", [(2, 4), (4, 9), (8, 16), (4, 32)])
@pytest.mark.parametrize("backward_ratio, w_fraction", [(2.0, 0.4), (3.0, 0.5), (4.0, 0.25), (3.0, 1 / 3)])
def test_zbv_formula_other_splits(S, B, backward_ratio, w_fraction):
    """Input-gradient pass longer than the weight pass and the forward: idle per rank
    (S-1) max(tbB, 2(tbB - tbW)) / 2."""
    tl = simulate("zbv", S, B, backward_ratio=backward_ratio, w_fraction=w_fraction)
    tb_w = backward_ratio * w_fraction
    tb_b = backward_ratio - tb_w
    assert tl.makespan - B * (1 + backward_ratio) == pytest.approx((S - 1) * max(tb_b, 2 * (tb_b - tb_w)) / 2)
    assert tl.bubble_fraction == pytest.approx(
        bubble_formula("zbv", S, B, backward_ratio=backward_ratio, w_fraction=w_fraction))


@pytest.mark.parametrize("S", [2, 4, 8])
@pytest.mark.parametrize("factor", [2, 3, 5])
def test_dualpipev_bubble_and_memory(S, factor):
    """DualPipeV (F&B pairs run one after the other: F&B = F + B): at tf = tbB = tbW its idle
    time per rank is (S-1) half-stage forwards, as ZB-V's, and its first rank holds 2S + 1
    chunks (DeepSeek's table: PP + 1 activations for PP = 2S stages, against ZB-V's PP)."""
    B = factor * S
    dpv, zbv = simulate("dualpipev", S, B), simulate("zbv", S, B)
    assert dpv.makespan - 3 * B == pytest.approx((S - 1) / 2) == pytest.approx(zbv.makespan - 3 * B)
    assert max(dpv.max_in_flight(r) for r in range(S)) == 2 * S + 1
    assert max(zbv.max_in_flight(r) for r in range(S)) == 2 * S


@pytest.mark.parametrize("S, B", [(2, 4), (4, 9), (8, 16)])
@pytest.mark.parametrize("backward_ratio, w_fraction", [(2.0, 0.25), (3.0, 1 / 3), (4.0, 0.5), (2.0, 0.4)])
def test_dualpipev_within_deepseeks_bound(S, B, backward_ratio, w_fraction):
    """The simulated idle time never exceeds DeepSeek's (PP/2-1)(F&B + B - 3W), in chunk
    times (F = tf/2, B = tb/2 the full backward, W its weight part, F&B = F + B)."""
    tl = simulate("dualpipev", S, B, backward_ratio=backward_ratio, w_fraction=w_fraction)
    f, b, w = 0.5, backward_ratio / 2, backward_ratio * w_fraction / 2
    assert tl.makespan - B * (1 + backward_ratio) <= (S - 1) * ((f + b) + b - 3 * w) + EPS


@pytest.mark.parametrize("S", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 3])
def test_chimera_bubble_and_memory_are_the_papers(S, factor):
    """Chimera (Li and Hoefler 2021, table 2), forward and backward equally long: bubble
    ratio (D-2)/(2N+D-2), idle time (D/2-1)(tf+tb) per rank against 1F1B's (D-1)(tf+tb);
    activations between D/2 + 1 and D microbatches per rank (1F1B: 1 to D); every stage
    held on two ranks."""
    B = factor * S
    tl = simulate("chimera", S, B, backward_ratio=1.0)
    assert tl.bubble_fraction == pytest.approx(bubble_formula("chimera", S, B, backward_ratio=1.0))
    assert tl.bubble_fraction == pytest.approx((S - 2) / (2 * B + S - 2))
    assert tl.makespan == pytest.approx(2 * B + (S - 2))
    assert simulate("1f1b", S, B, backward_ratio=1.0).makespan == pytest.approx(2 * B + 2 * (S - 1))
    held = [tl.max_in_flight(r) for r in range(S)]
    assert min(held) == S // 2 + 1 and max(held) == S
    assert {(e.rank, e.chunk) for e in tl.events} == {(r, c) for r in range(S) for c in (0, 1)}


@pytest.mark.parametrize("S, B", [(4, 4), (8, 8), (4, 8)])
def test_chimera_longer_backward(S, B):
    """With backward twice forward, one unit of S microbatches still beats 1F1B, but the
    units concatenated leave gaps (the paper's "direct concatenation"): the simulator shows
    what the search weighs."""
    chimera, one = simulate("chimera", S, B), simulate("1f1b", S, B)
    if B == S:
        assert chimera.makespan < one.makespan
    assert chimera.makespan >= B * 3 + (S // 2 - 1) * 3 - EPS
    with pytest.raises(ValueError, match="backward as long as forward"):
        bubble_formula("chimera", S, B)
    with pytest.raises(ValueError, match="multiple of n_stages"):
        simulate("chimera", S, B + 1)
    with pytest.raises(ValueError, match="even number"):
        simulate("chimera", 3, 6)


def test_zbv_closed_form_outside_its_range_says_so():
    with pytest.raises(ValueError, match="n_microbatches >= 2 n_stages"):
        bubble_formula("zbv", 4, 7)
    with pytest.raises(ValueError, match="two chunks per rank"):
        simulate("zbv", 4, 8, n_virtual=3)
    with pytest.raises(ValueError, match="at least 2 x n_stages"):
        simulate("dualpipev", 4, 7)


@pytest.mark.parametrize("S, B", [(4, 8), (4, 2), (8, 16)])
def test_max_in_flight(S, B):
    one_f_one_b, gpipe = simulate("1f1b", S, B), simulate("gpipe", S, B)
    assert [one_f_one_b.max_in_flight(r) for r in range(S)] == [min(S - r, B) for r in range(S)]
    assert [gpipe.max_in_flight(r) for r in range(S)] == [B] * S


def test_str_rows():
    text = str(simulate("gpipe", 4, 4))
    lines = text.splitlines()
    assert lines[0] == "gpipe: 4 stages, 4 microbatches, makespan 21, bubble 42.9%"
    assert lines[4] == "rank 3 | . . . F0 F1 F2 F3 B3 B2 B1 B0"
    assert len(lines) == 5


@pytest.mark.parametrize("call, message", [
    (lambda: simulate("pipedream", 4, 4), "1f1b, interleaved-1f1b, zero-bubble"),
    (lambda: simulate("interleaved-1f1b", 4, 6, n_virtual=2), "multiple of 4"),
    (lambda: simulate("gpipe", 4, 4, [1.0, 1.0]), "stage_times has 2 entries for n_stages=4"),
    (lambda: simulate("1f1b", 4, 4, n_virtual=2), "only to interleaved-1f1b"),
    (lambda: simulate("1f1b", 0, 4), "at least one stage"),
    (lambda: bubble_formula("zero-bubble", 4, 2), "n_microbatches >= n_stages"),
])
def test_errors_say_what_to_do(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _rects(path):
    root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    return root, [r.get("class") for r in root.iter(f"{ns}rect")]


def test_gantt_gpipe_4x4(tmp_path):
    tl = simulate("gpipe", 4, 4)
    path = gantt_svg(tl, tmp_path / "gpipe.svg")
    assert path == tmp_path / "gpipe.svg" and path.exists()
    root, classes = _rects(path)
    # 1 background + one per event + one legend swatch per kind present (F, B)
    assert len(classes) == 1 + 32 + 2
    assert Counter(classes) == {"background": 1, "event F": 16, "event B": 16, "legend": 2}
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "bubble 42.9%" in texts[0]
    assert sorted(t for t in texts if t.isdigit() and len(t) == 1).count("3") == 8  # F3, B3 on 4 ranks


def test_gantt_measured_events_normalised(tmp_path):
    def measured_pass(rank, kind, start, end, t0=12_345.0):  # seconds, arbitrary origin
        return {"rank": rank, "kind": kind, "microbatch": 0, "start": t0 + start, "end": t0 + end}

    measured = [measured_pass(0, "F", 0.0, 0.01), measured_pass(1, "F", 0.012, 0.022),
                measured_pass(1, "B", 0.022, 0.042), measured_pass(0, "B", 0.044, 0.064)]
    tl = Timeline.from_events(measured)
    assert tl.n_stages == 2 and tl.makespan == pytest.approx(0.064)
    assert tl.utilisation == pytest.approx(0.06 / (2 * 0.064))

    path = gantt_svg(measured, tmp_path / "measured.svg", title="measured")
    root, classes = _rects(path)
    assert Counter(classes) == {"background": 1, "event F": 2, "event B": 2, "legend": 2}
    xs = [float(r.get("x")) for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "event F"]
    assert min(xs) == pytest.approx(70.0)  # the earliest start sits at the left edge of the plot

    as_events = [Event(chunk=0, **m) for m in measured]
    _, classes = _rects(gantt_svg(as_events, tmp_path / "events.svg"))
    assert len(classes) == 1 + 4 + 2


def test_all_schedules_listed():
    assert SCHEDULES == ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev", "chimera",
                         "pipedream-2bw")


def test_one_list_of_schedules_from_simulator_to_runtime():
    """The schedules a plan may name (the search's, the CLI's, autopar.Pipeline's) are the
    simulator's less "naive", and the runtime has a torch schedule class for each."""
    from autopar.runtime.pipeline.pipelined import SCHEDULES as RUNS
    from autopar.solve.pipeline.options import SCHEDULE_CHOICES
    assert SCHEDULE_CHOICES == tuple(s for s in SCHEDULES if s != "naive")
    assert set(RUNS) == set(SCHEDULE_CHOICES)


@pytest.mark.parametrize("S", [2, 4, 8])
def test_chimera_receives_in_the_order_it_sends(S, monkeypatch):
    """Under NCCL (no message tags) every device group must receive from each neighbour in
    the order that neighbour sends: it holds for the chimera orders autopar runs, and a
    swapped order is refused by name."""
    from autopar.runtime.pipeline import two_way
    for k in (1, 2, 3):
        two_way.check_order(S, k * S)
    if S == 2:
        return
    orders = [list(o) for o in two_way.chimera_orders(S, S)]
    first = next(i for i, op in enumerate(orders[0]) if op[0] == "F")
    second = next(i for i, op in enumerate(orders[0]) if op[0] == "F" and i > first and op[2] == orders[0][first][2])
    orders[0][first], orders[0][second] = orders[0][second], orders[0][first]
    monkeypatch.setattr(two_way, "chimera_orders", lambda s, b: orders)
    with pytest.raises(Exception, match="receives from group 0 in another order"):
        two_way.check_order(S, S)


@pytest.mark.parametrize("schedule, S, B, per_microbatch", [("1f1b", 4, 4, 6), ("zbv", 2, 4, 4), ("chimera", 4, 8, 6)])
def test_sends_simulated_and_drawn(tmp_path, schedule, S, B, per_microbatch):
    """Every activation and gradient crossing ranks is one Send, from the end of the pass
    that made it to comm_time later, and one line in the Gantt chart (1F1B on 4 ranks: 3
    boundaries each way; ZB-V on 2: stages 0-1 and 2-3 cross, 1-2 stays on rank 1)."""
    tl = simulate(schedule, S, B, comm_time=0.25)
    assert len(tl.sends) == per_microbatch * B
    ends = {(e.rank, e.kind, e.microbatch, e.chunk): e.end for e in tl.events}
    for m in tl.sends:
        assert m.src != m.dst and m.end - m.start == pytest.approx(0.25)
        assert m.start == ends[m.src, m.kind, m.microbatch, m.chunk]
    root = ET.parse(gantt_svg(tl, tmp_path / "g.svg")).getroot()
    lines = [ln.get("class") for ln in root.iter("{http://www.w3.org/2000/svg}line") if "send" in ln.get("class", "")]
    assert Counter(lines) == Counter(f"send {m.kind}" for m in tl.sends)
    assert Counter(lines)["send F"] == Counter(lines)["send B"] == per_microbatch * B // 2


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_simulate_step_is_simulate_without_the_timeline(schedule):
    """The pipeline search's fast path (a dependency graph built once per shape, then one
    pass adding times) gives simulate's makespan, bubble and in-flight peaks, for uneven
    stages, communication time, several backward splits and microbatch counts; a second
    call of the same shape with other times (the cached graph) too; and the same errors."""
    rng = random.Random(7)
    checked = 0
    for S in (1, 2, 3, 4, 6):
        for B in (1, 3, 4, 8, 12, 24):
            for trial in range(3):
                v = 2 if schedule == "interleaved-1f1b" and trial == 1 else 1
                kw = dict(stage_times=[rng.uniform(0.5, 2.0) for _ in range(S)], backward_ratio=rng.uniform(0.5, 3.0),
                          n_virtual=v, comm_time=rng.choice([0.0, rng.uniform(0.0, 1.0)]),
                          w_fraction=rng.uniform(0.2, 0.8))
                try:
                    tl = simulate(schedule, S, B, **kw)
                except ValueError as exc:
                    with pytest.raises(ValueError, match=re.escape(str(exc))):
                        simulate_step(schedule, S, B, **kw)
                    continue
                step = simulate_step(schedule, S, B, **kw)
                assert step.makespan == pytest.approx(tl.makespan, rel=1e-12)
                assert step.bubble_fraction == pytest.approx(tl.bubble_fraction, rel=1e-9, abs=1e-12)
                assert step.in_flight == tuple(tl.max_in_flight(r) for r in range(S))
                if schedule not in ASYNCHRONOUS:   # each rank's end and its last pass's length
                    mine = [[e for e in tl.events if e.rank == r] for r in range(S)]
                    assert step.ends == pytest.approx([max(e.end for e in m) for m in mine], rel=1e-12)
                    assert step.last == pytest.approx([m[-1].end - m[-1].start for m in mine], rel=1e-12)
                checked += 1
    assert checked >= 25


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_makespan_floor_never_exceeds_the_simulated_makespan(schedule):
    """The search skips a candidate whose closed-form bound (fill, every pass of the busiest
    rank, drain) already loses; the bound must never exceed what simulate measures, with
    uneven stages, communication and any split, and it is reached for one stage."""
    rng = random.Random(11)
    checked = 0
    for S in (1, 2, 3, 4, 6, 8):
        for B in (1, 2, 4, 8, 16, 24):
            for trial in range(3):
                v = 2 if schedule == "interleaved-1f1b" and trial == 1 else 1
                kw = dict(stage_times=[rng.uniform(0.2, 3.0) for _ in range(S)], backward_ratio=rng.uniform(0.5, 3.0),
                          n_virtual=v, comm_time=rng.choice([0.0, rng.uniform(0.0, 1.0), rng.uniform(0.0, 5.0)]),
                          w_fraction=rng.uniform(0.2, 0.8))
                try:
                    tl = simulate(schedule, S, B, **kw)
                except ValueError:
                    continue
                assert makespan_floor(schedule, S, B, **kw) <= tl.makespan * (1 + 1e-9)
                checked += 1
    assert checked >= 20
    if schedule not in ("chimera",) + SPLIT_BACKWARD:   # one stage runs its passes back to back
        assert makespan_floor(schedule, 1, 4, [1.5]) == pytest.approx(simulate(schedule, 1, 4, [1.5]).makespan)


def test_makespan_floor_counts_the_fill_and_drain():
    """1F1B on 4 equal stages of forward 1, backward 2, 8 microbatches: the last rank waits 3
    forwards, runs 8 x 3, and the 3 stages below then run its last backward: 3 + 24 + 6 = 33,
    which is 1F1B's makespan (B + S - 1)(tf + tb)."""
    assert makespan_floor("1f1b", 4, 8) == pytest.approx(33.0)
    assert simulate("1f1b", 4, 8).makespan == pytest.approx(33.0)
