"""Event-driven simulation of pipeline-parallel schedules.

A schedule is, for each rank, the order in which it runs forward (F), backward (B) and,
for zero-bubble, weight-gradient (W) passes of (microbatch, chunk) pairs.  The simulator
starts each pass when the rank is free and its inputs have arrived:

    F(m) on virtual stage s   after F(m) on s-1           (+ comm_time across ranks)
    B(m) on virtual stage s   after B(m) on s+1 (+ comm), and F(m) on s
    W(m) on virtual stage s   after B(m) on s

Chunk c of rank r is virtual stage c*S + r (S ranks, v chunks per rank); under zbv
(two chunks per rank in a V) chunk 0 of rank r is stage r and chunk 1 is stage 2S-1-r, so
rank 0 holds the first and the last stage; under chimera chunk 0 of rank r is stage r of
the down pipeline and chunk 1 stage S-1-r of the up pipeline, each microbatch running
through one of them.

Each schedule's order of passes per rank is autopar.cost.schedule_orders'; the graph of
which pass waits for which, walked once per shape, is autopar.cost.pass_graph's; the
makespans and bubbles the schedules reach with equal stages, in closed form, are
autopar.cost.bubbles'.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from autopar.cost.pass_graph import PassGraph, order_passes, pass_spans
from autopar.cost.schedule_orders import (Op, chimera_orders, dualpipev_orders, gpipe_orders, one_f_one_b_orders,
                                          peak_in_flight, zbv_orders, zero_bubble_orders)

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev", "chimera",
             "pipedream-2bw")
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")   # backward as B (inputs) and W (weights) passes
V_SHAPED = ("zbv", "dualpipev")                        # two chunks per rank, placed as a V
TWO_WAY = ("chimera",)   # two pipelines in opposite directions, every stage held twice
ASYNCHRONOUS = ("pipedream-2bw",)   # no flush between steps: weights one step stale (offered only when allowed)
STREAM_BATCHES = 3   # an asynchronous schedule is simulated as a stream of this many steps
KINDS = ("F", "B", "W")


def folds_tp(schedule: str) -> bool:
    """Whether a stage under `schedule` runs its tensor-parallel collectives beside their
    GEMMs (passes/fold_linears.py): not where backward splits off the weight gradients
    itself (SPLIT_BACKWARD); "none", the plan without stages, does."""
    return schedule not in SPLIT_BACKWARD


def least_microbatches(schedule: str | None, groups: int) -> int:
    """The fewest microbatches `schedule` runs over `groups` device groups: one per stage
    for GPipe and 1F1B (one stage per group) and DualPipeV (two), as torch's schedules
    require; 1 for the others (and for None, a schedule not chosen yet)."""
    if schedule in ("gpipe", "1f1b"):
        return groups
    return 2 * groups if schedule == "dualpipev" else 1


@dataclass(frozen=True)
class Event:
    """One pass on one rank: kind "F", "B" or "W" of `microbatch` on model chunk `chunk`,
    running over [start, end) in the unit of stage_times (seconds for measured events)."""

    rank: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Send:
    """An activation (after an F) or a gradient (after a B) of `microbatch` moving from rank
    `src` to rank `dst` over [start, end): from the pass that made it ending to its arrival."""

    src: int
    dst: int
    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The passes a schedule ran on `n_stages` ranks, with when each started and ended.

    utilisation = sum of pass durations / (n_stages * makespan); bubble_fraction is the
    rest, the share of rank-time spent idle.
    """

    schedule: str
    n_stages: int
    n_microbatches: int
    events: tuple
    n_virtual: int = 1
    sends: tuple = ()    # Sends between ranks (simulated timelines)
    period: float | None = None   # asynchronous schedules: the steady-state step (events: a stream of steps)
    batches: int = 1              # the steps `events` hold

    @classmethod
    def from_events(cls, events, schedule: str = "measured") -> Timeline:
        """A Timeline of measured passes: Events, or dicts with rank, kind, microbatch,
        start, end (seconds, any origin) and optionally chunk; times are shifted so the
        earliest start is 0, and n_stages is one more than the highest rank."""
        events = [e if isinstance(e, Event) else
                  Event(e["rank"], e["kind"], e["microbatch"], e.get("chunk", 0), e["start"], e["end"])
                  for e in events]
        if not events:
            raise ValueError("no events to build a timeline from")
        unknown = {e.kind for e in events} - set(KINDS)
        if unknown:
            raise ValueError(f"event kinds {sorted(unknown)} are not among {KINDS}")
        t0 = min(e.start for e in events)
        events = tuple(sorted((Event(e.rank, e.kind, e.microbatch, e.chunk, e.start - t0, e.end - t0)
                               for e in events), key=lambda e: (e.rank, e.start)))
        return cls(schedule, 1 + max(e.rank for e in events), 1 + max(e.microbatch for e in events), events,
                   1 + max(e.chunk for e in events))

    def on(self, rank: int) -> list:
        """The events of `rank`, in start order."""
        return list(self._by_rank.get(rank, ()))

    @cached_property
    def _by_rank(self) -> dict:
        """rank -> its events in start order (sorted once: the search asks for every rank)."""
        out: dict = {}
        for e in self.events:
            out.setdefault(e.rank, []).append(e)
        return {r: sorted(es, key=lambda e: e.start) for r, es in out.items()}

    @property
    def span(self) -> float:
        """From the first pass's start to the last pass's end."""
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    @property
    def makespan(self) -> float:
        """The time of one step: the span, or for an asynchronous schedule its steady-state
        period (one step of a stream without flushes)."""
        return self.span if self.period is None else self.period

    def busy(self, rank: int) -> float:
        return sum(e.duration for e in self.events if e.rank == rank) / self.batches

    @property
    def utilisation(self) -> float:
        return sum(e.duration for e in self.events) / self.batches / (self.n_stages * self.makespan)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.utilisation

    def max_in_flight(self, rank: int) -> int:
        """Most microbatches whose activations `rank` holds at once: forwards started minus
        backwards finished, where a (microbatch, chunk) is finished by its last backward
        pass (W under zero-bubble, else B).  Each chunk counts as one; with v chunks a
        chunk's activations are 1/v of a stage's."""
        return peak_in_flight([e.kind for e in self.on(rank)])

    def __str__(self) -> str:
        """A header, then one row per rank: its passes in order, with one "." per
        shortest-pass length of idle time before each."""
        unit = min((e.duration for e in self.events if e.duration > 0), default=1.0)
        rows = [f"{self.schedule}: {self.n_stages} stages, {self.n_microbatches} microbatches"
                + (f", {self.n_virtual} chunks per rank" if self.n_virtual > 1 else "")
                + f", makespan {self.makespan:.4g}, bubble {self.bubble_fraction:.1%}"]
        t0 = min(e.start for e in self.events)
        for r in range(self.n_stages):
            cells, t = [], t0
            for e in self.on(r):
                if e.start - t > 1e-9 * unit:
                    cells += ["."] * max(1, round((e.start - t) / unit))
                cells.append(e.label)
                t = e.end
            rows.append(f"rank {r} | " + " ".join(cells))
        return "\n".join(rows)


def simulate(schedule: str, n_stages: int, n_microbatches: int, stage_times=None, *, backward_ratio: float = 2.0,
             n_virtual: int = 1, comm_time: float = 0.0, w_fraction: float = 0.5) -> Timeline:
    """Run `schedule` on `n_stages` ranks and return when every pass ran.

    stage_times: forward time of one microbatch on each stage (default 1.0 each); a
    backward takes backward_ratio times as long.  Under interleaved-1f1b each of the
    n_virtual chunks of a rank takes 1/n_virtual of its stage's times (under zbv: each of
    its two).  Under zero-bubble and zbv the backward splits into B (input gradient) and W
    (weight gradient), W taking w_fraction of it.  comm_time is added when an activation or gradient moves to
    another rank.  naive runs one batch (n_microbatches is taken as 1): stage_times is
    then the time of that batch.
    """
    S, B, v, stage_times = _checked(schedule, n_stages, n_microbatches, stage_times, backward_ratio, n_virtual,
                                    comm_time, w_fraction)
    graph = _graph(schedule, S, B, v)
    slot_time = _slot_times(schedule, S, v, stage_times, backward_ratio, w_fraction)
    start, end = pass_spans(graph, slot_time, S, comm_time)
    events, sends, K = [], {}, len(KINDS)
    for i, (r, slot, m) in enumerate(zip(graph.rank, graph.slot, graph.micro)):
        kind, c = KINDS[slot // v % K], slot % v
        events.append(Event(r, kind, m, c, start[i], end[i]))
        for j in (graph.first[i], graph.second[i]):   # what arrived from other ranks
            if j >= 0:
                src, o = graph.rank[j], (KINDS[graph.slot[j] // v % K], graph.micro[j], graph.slot[j] % v)
                sends[src, r, o] = Send(src, r, o[0], o[1], o[2], end[j], end[j] + comm_time)
    events = tuple(sorted(events, key=lambda e: (e.rank, e.start)))
    sends = tuple(sorted(sends.values(), key=lambda s: (s.start, s.src, s.dst)))
    if schedule in ASYNCHRONOUS:
        return Timeline(schedule, S, B, events, v, sends, _period(events, B), STREAM_BATCHES)
    return Timeline(schedule, S, B, events, v, sends)


@dataclass(frozen=True)
class Step:
    """What the pipeline search reads of a simulated schedule, without its events: the
    makespan (for an asynchronous schedule its steady-state period), the bubble fraction and
    each rank's peak of microbatches in flight (Timeline.max_in_flight)."""

    makespan: float
    bubble_fraction: float
    in_flight: tuple
    # per rank: when its last pass ends, and how long that pass runs (what its gradient
    # buckets, opened during a stage's last backward, can hide behind); empty for an
    # asynchronous schedule (a stream of steps has no last pass)
    ends: tuple = ()
    last: tuple = ()


def simulate_step(schedule: str, n_stages: int, n_microbatches: int, stage_times=None, *,
                  backward_ratio: float = 2.0, n_virtual: int = 1, comm_time: float = 0.0,
                  w_fraction: float = 0.5) -> Step:
    """`simulate`'s makespan, bubble and in-flight peaks, without building its timeline.

    Which pass waits for which, and each rank's peak in flight, depend on the schedule,
    the stage count, the microbatches and the chunks only, not on the times; they are built
    once per such shape (PassGraph, cached) and every call after that is one pass over the
    passes in dependency order, adding times.  The pipeline search calls this for hundreds
    of candidates of one shape (64 ranks x 512 microbatches: 200,000 passes) with different
    stage times.  Same arguments and results as simulate (tests compare them)."""
    S, B, v, stage_times = _checked(schedule, n_stages, n_microbatches, stage_times, backward_ratio, n_virtual,
                                    comm_time, w_fraction)
    if schedule in ASYNCHRONOUS:   # its period reads the stream's forward start times: the full timeline
        tl = simulate(schedule, S, B, stage_times, backward_ratio=backward_ratio, n_virtual=v,
                      comm_time=comm_time, w_fraction=w_fraction)
        return Step(tl.makespan, tl.bubble_fraction, tuple(tl.max_in_flight(r) for r in range(S)))
    graph = _graph(schedule, S, B, v)
    slot_time = _slot_times(schedule, S, v, stage_times, backward_ratio, w_fraction)
    _, end, ends = pass_spans(graph, slot_time, S, comm_time, with_ranks=True)
    last = [slot_time[slot] if slot >= 0 else 0.0 for slot in _last_slots(schedule, S, B, v)]
    makespan = max(end)   # (some rank's first pass waits for nothing and starts at 0)
    busy = sum(n * slot_time[slot] for slot, n in graph.slot_counts)
    return Step(makespan, 1.0 - busy / (S * makespan) if makespan > 0 else 0.0, graph.in_flight,
                tuple(ends), tuple(last))


def makespan_floor(schedule: str, n_stages: int, n_microbatches: int, stage_times=None, *,
                   backward_ratio: float = 2.0, n_virtual: int = 1, comm_time: float = 0.0,
                   w_fraction: float = 0.5) -> float:
    """A lower bound on simulate's makespan, in closed form: no rank starts before the
    first microbatch's forward has crossed the stages below its lowest one (its fill), it
    then runs all its passes one after another, and, where a backward is a rank's last pass,
    the stages below must still run that microbatch's backward (its drain; not under the
    split-backward schedules, whose weight passes may come last).  Under chimera each rank
    takes the nearer end of its two pipelines.  The pipeline search skips the candidates
    whose bound already loses to the best step found (a lower bound: tests check it against
    simulate)."""
    S, B, v, stage_times = _checked(schedule, n_stages, n_microbatches, stage_times, backward_ratio, n_virtual,
                                    comm_time, w_fraction)
    durations = _durations(schedule, S, v, stage_times, backward_ratio, w_fraction)
    if schedule in ASYNCHRONOUS:   # the period of a stream: no fill or drain within it
        return max(durations[r]["F", 0] + durations[r]["B", 0] for r in range(S)) * B
    placement = placement_of(schedule)
    drains = schedule not in SPLIT_BACKWARD
    kinds = KINDS if schedule in SPLIT_BACKWARD else ("F", "B")
    per_chunk = B / 2 if placement == "two-way" else B   # (chimera: half the microbatches down, half up)

    def edge(below: list) -> tuple:
        """(fill, drain) past the (rank, chunk) passes of the stages below, each a hop."""
        fill = sum(durations[r][("F", c)] + comm_time for r, c in below)
        drain = sum(durations[r][("B", c)] + comm_time for r, c in below) if drains else 0.0
        return fill, drain

    out = 0.0
    for r in range(S):
        work = per_chunk * sum(durations[r][kind, c] for kind in kinds for c in range(v))
        if placement == "two-way":   # down pipeline: stages 0..r-1 on ranks 0..r-1; up: ranks S-1..r+1
            down = edge([(q, 0) for q in range(r)])
            up = edge([(q, 1) for q in range(r + 1, S)])
            fill, drain = min(down[0], up[0]), min(down[1], up[1])
        else:
            lowest = stage_of(r, 0, S, placement)
            fill, drain = edge([place_of(k, S, placement) for k in range(lowest)])
        out = max(out, fill + work + drain)
    return out


def _slot_times(schedule: str, S: int, v: int, stage_times: list, backward_ratio: float,
                w_fraction: float) -> list:
    """Seconds of a pass per slot (rank, kind, chunk), as PassGraph numbers them."""
    durations = _durations(schedule, S, v, stage_times, backward_ratio, w_fraction)
    return [durations[r][kind, c] for r in range(S) for kind in KINDS for c in range(v)]


@lru_cache(maxsize=64)
def _last_slots(schedule: str, S: int, B: int, v: int) -> tuple:
    """Each rank's last pass's slot (a rank's passes come in its order in the graph)."""
    graph = _graph(schedule, S, B, v)
    last = [-1] * S
    for r, slot in zip(graph.rank, graph.slot):
        last[r] = slot
    return tuple(last)


@lru_cache(maxsize=64)   # (a few MiB each at the largest shapes the search tries)
def _graph(schedule: str, S: int, B: int, v: int) -> PassGraph:
    """`schedule`'s passes on S ranks, B microbatches and v chunks as a PassGraph."""
    orders, pairs = _orders(schedule, S, B, v)
    placement = placement_of(schedule)
    B = STREAM_BATCHES * B if schedule in ASYNCHRONOUS else B   # (the microbatches the orders hold)
    return order_passes(orders, pairs, KINDS, v, B, lambda r, op: pass_inputs(r, op, S, v, placement), schedule)


def _checked(schedule: str, n_stages: int, n_microbatches: int, stage_times, backward_ratio: float,
             n_virtual: int, comm_time: float, w_fraction: float) -> tuple:
    """simulate's arguments checked: (S, B, v, stage_times as floats), with B = 1 for naive
    and v = 2 for the V-shaped and two-way schedules."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need at least one stage and one microbatch, got n_stages={n_stages}, "
                         f"n_microbatches={n_microbatches}")
    if schedule == "naive":
        n_microbatches = 1
    if schedule in TWO_WAY and (n_stages % 2 or n_microbatches % n_stages):
        raise ValueError(f"chimera needs an even number of stages and a multiple of n_stages microbatches (each "
                         f"unit of n_stages sends half down, half up); got n_stages={n_stages}, "
                         f"n_microbatches={n_microbatches}")
    if schedule in V_SHAPED + TWO_WAY:
        if n_virtual not in (1, 2):
            raise ValueError(f"{schedule} runs two chunks per rank (n_virtual=2), not {n_virtual}")
        n_virtual = 2
    elif n_virtual != 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"n_virtual={n_virtual} applies only to interleaved-1f1b; use n_virtual=1 for {schedule}")
    if n_virtual < 1:
        raise ValueError(f"n_virtual must be at least 1, got {n_virtual}")
    if schedule in ASYNCHRONOUS and n_microbatches < n_stages:
        raise ValueError(f"{schedule} needs at least n_stages = {n_stages} microbatches per step (a step's last "
                         f"backward on the first stage must come before the next step's forwards), got "
                         f"{n_microbatches}")
    if schedule == "dualpipev" and n_microbatches < 2 * n_stages:
        raise ValueError(f"dualpipev needs at least 2 x n_stages = {2 * n_stages} microbatches (its warm-up fills "
                         f"both chunks of every rank), got {n_microbatches}; use zbv or zero-bubble for fewer")
    if schedule == "interleaved-1f1b" and n_microbatches % n_stages:
        raise ValueError(f"interleaved-1f1b runs microbatches in groups of n_stages={n_stages}, but "
                         f"n_microbatches={n_microbatches} is not a multiple; use a multiple of {n_stages}")
    stage_times = [1.0] * n_stages if stage_times is None else [float(t) for t in stage_times]
    if len(stage_times) != n_stages:
        raise ValueError(f"stage_times has {len(stage_times)} entries for n_stages={n_stages}; give one forward "
                         f"time per stage")
    if min(stage_times) < 0 or backward_ratio < 0 or comm_time < 0:
        raise ValueError("stage_times, backward_ratio and comm_time must be non-negative")
    if not 0.0 < w_fraction < 1.0:
        raise ValueError(f"w_fraction must be strictly between 0 and 1, got {w_fraction}")
    return n_stages, n_microbatches, n_virtual, stage_times


def _orders(schedule: str, S: int, B: int, v: int) -> tuple:
    """Each rank's passes in the order `schedule` runs them, and DualPipeV's pairs."""
    pairs: dict = {}
    if schedule in ("naive", "gpipe"):
        orders = gpipe_orders(S, B)
    elif schedule == "zero-bubble":
        orders = zero_bubble_orders(S, B)
    elif schedule == "zbv":
        orders = zbv_orders(S, B)
    elif schedule == "dualpipev":
        orders, pairs = dualpipev_orders(S, B)
    elif schedule == "chimera":
        orders = chimera_orders(S, B)
    elif schedule in ASYNCHRONOUS:   # 1F1B over a stream of steps, never flushed
        orders = one_f_one_b_orders(S, STREAM_BATCHES * B)
    else:
        orders = one_f_one_b_orders(S, B, v)
    return orders, pairs


def _durations(schedule: str, S: int, v: int, stage_times: list, backward_ratio: float, w_fraction: float) -> list:
    """Per rank, {(kind, chunk): seconds of that pass}."""
    tb = backward_ratio * (1.0 - w_fraction if schedule in SPLIT_BACKWARD else 1.0)
    scale = {"F": 1.0 / v, "B": tb / v, "W": backward_ratio * w_fraction / v}
    if schedule in TWO_WAY:   # rank r runs stage r down and stage S-1-r up, each whole
        durations = [{(k, c): stage_times[r if c == 0 else S - 1 - r] * s * v for k, s in scale.items()
                      for c in range(2)} for r in range(S)]
    else:
        durations = [{(k, c): t * s for k, s in scale.items() for c in range(v)} for t in stage_times]
    return durations


def group_stages(group: int, n_groups: int, n_stages: int, schedule: str) -> list:
    """The stages device group `group` runs, in chunk order: g, g + p, ... (p groups), under
    a V-shaped schedule g and 2p-1-g, under chimera g (down) and p-1-g (up)."""
    if schedule in V_SHAPED:
        return [group, 2 * n_groups - 1 - group]
    if schedule in TWO_WAY:
        return [group, n_groups - 1 - group]
    return list(range(group, n_stages, n_groups))


def stage_group(stage: int, n_groups: int, schedule: str) -> int:
    """The device group that runs `stage` (the inverse of group_stages; under chimera the
    down pipeline's copy, see stage_groups)."""
    if schedule in V_SHAPED:
        return place_of(stage, n_groups, "v")[0]
    return stage % n_groups


def stage_groups(stage: int, n_groups: int, schedule: str) -> list:
    """Every device group that runs `stage`: one, or under chimera two (stage k runs on group
    k in the down pipeline and on group S-1-k in the up pipeline)."""
    if schedule in TWO_WAY:
        return sorted({stage, n_groups - 1 - stage})
    return [stage_group(stage, n_groups, schedule)]


def placement_of(schedule: str) -> str:
    """How `schedule` places chunks on ranks: "loop" (chunk c of rank r is stage cS + r),
    "v" (V-shaped: chunk 0 of rank r is stage r, chunk 1 stage 2S-1-r) or "two-way"
    (chimera: chunk 0 of rank r is stage r of the down pipeline, chunk 1 stage S-1-r of the
    up pipeline)."""
    return "two-way" if schedule in TWO_WAY else "v" if schedule in V_SHAPED else "loop"


def stage_of(rank: int, chunk: int, S: int, placement: str = "loop") -> int:
    """The virtual stage chunk `chunk` of `rank` runs (S ranks); under "two-way" the up
    pipeline's stage k is numbered S + k."""
    if placement != "loop":
        return rank if chunk == 0 else 2 * S - 1 - rank
    return chunk * S + rank


def place_of(stage: int, S: int, placement: str = "loop") -> tuple:
    """(rank, chunk) of virtual stage `stage`: the inverse of stage_of."""
    if placement in ("v", "two-way"):
        return (stage, 0) if stage < S else (2 * S - 1 - stage, 1)
    return stage % S, stage // S


def _period(events, B: int) -> float:
    """The steady-state step of a flushless stream: the slowest rank's time from its first
    forward of the middle step to its first forward of the step after (PipeDream-2BW,
    Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training": with B >= S
    microbatches per step, 1F1B without flushes, every stage runs B forwards and backwards
    per step and idles only where a slower stage holds it back, so the step is B times the
    slowest stage's forward + backward and the bubble of equal stages is 0)."""
    starts = {(e.rank, e.microbatch): e.start for e in events if e.kind == "F"}
    ranks = {e.rank for e in events}
    return max(starts[r, 2 * B] - starts[r, B] for r in ranks)


def pass_inputs(rank: int, op: Op, S: int, v: int, placement: str = "loop") -> list:
    """(rank, op) pairs that must finish before `op` runs on `rank`.  Under "two-way" a
    microbatch runs through one pipeline only: chunk 0 goes down the ranks, chunk 1 up."""
    kind, m, c = op
    if kind == "W":
        return [(rank, ("B", m, c))]
    if placement == "two-way":
        k = rank if c == 0 else S - 1 - rank          # stage within its pipeline
        step = 1 if c == 0 else -1                     # the next stage's rank is rank + step
        if kind == "F":
            return [] if k == 0 else [(rank - step, ("F", m, c))]
        return [(rank, ("F", m, c))] + ([(rank + step, ("B", m, c))] if k < S - 1 else [])
    vs = stage_of(rank, c, S, placement)
    if kind == "F":
        if vs == 0:
            return []
        r2, c2 = place_of(vs - 1, S, placement)
        return [(r2, ("F", m, c2))]
    after = [(rank, ("F", m, c))]
    if vs < S * v - 1:
        r2, c2 = place_of(vs + 1, S, placement)
        after.append((r2, ("B", m, c2)))
    return after

