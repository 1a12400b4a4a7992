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
through one of them.  With S equal stages, forward tf and backward tb
per microbatch, B microbatches and v chunks:

    naive         one batch through S stages            bubble (S-1)/S
    gpipe, 1f1b   makespan (B+S-1)(tf+tb)               bubble (S-1)/(B+S-1)
    interleaved   makespan B(tf+tb) + (S-1)(tf+tb)/v     bubble (S-1)/(vB+S-1)
    zero-bubble   makespan B(tf+tb) + (S-1)(tf+tbB-tbW)  for B >= S and tbW <= min(tf, tbB),
                  where tb = tbB + tbW (ZB-H1; see _zero_bubble and bubble_formula)
    zbv           makespan B(tf+tb) + (S-1) max(tbB, 2(tbB-tbW)) / 2   for B >= 2S and
                  tf, tbW <= tbB: with tf = tbB = tbW half ZB-H1's bubble, a sixth of
                  1F1B's, at 1F1B's peak activations (see _zbv and bubble_formula)
    chimera       makespan B(tf+tb) + (S/2-1)(tf+tb)        for tb = tf, B a multiple of S
                  (two pipelines in opposite directions; see chimera_orders and bubble_formula)
    pipedream-2bw step B max_s(tf+tb) in the steady state of a stream of steps, bubble 0 for
                  equal stages (asynchronous: weights one step stale; see _period)

Interleaved 1F1B follows Narayanan et al. 2021 ("Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM"); zero-bubble follows the ZB-H1 schedule of
Qi et al. 2023 ("Zero Bubble Pipeline Parallelism"); zbv the V-shaped schedule of its
section 6 (two chunks per rank, placed so that a microbatch's forward goes down the ranks
and comes back up, as does its backward).
"""
from __future__ import annotations

import heapq

from array import array
from dataclasses import dataclass
from functools import cached_property, lru_cache

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
    GEMMs (runtime/linear_grads.py): not where backward splits off the weight gradients
    itself (SPLIT_BACKWARD); "none", the plan without stages, does."""
    return schedule not in SPLIT_BACKWARD


def least_microbatches(schedule: str | None, groups: int) -> int:
    """The fewest microbatches `schedule` runs over `groups` device groups: one per stage
    for GPipe and 1F1B (one stage per group) and DualPipeV (two), as torch's schedules
    require; 1 for the others (and for None, a schedule not chosen yet)."""
    if schedule in ("gpipe", "1f1b"):
        return groups
    return 2 * groups if schedule == "dualpipev" else 1


Op = tuple  # (kind, microbatch, chunk)


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
        return _peak_in_flight([e.kind for e in self.on(rank)])

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
    start, end = _times(graph, slot_time, S, comm_time)
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
    once per such shape (_Graph, cached) and every call after that is one pass over the
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
    _, end, ends = _times(graph, slot_time, S, comm_time, with_ranks=True)
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


def _peak_in_flight(kinds: list) -> int:
    """Most microbatches held at once over one rank's passes, given their kinds in the order
    they run (see Timeline.max_in_flight)."""
    last = "W" if "W" in kinds else "B"
    held = peak = 0
    for kind in kinds:
        held += (kind == "F") - (kind == last)
        peak = max(peak, held)
    return peak


def _slot_times(schedule: str, S: int, v: int, stage_times: list, backward_ratio: float,
                w_fraction: float) -> list:
    """Seconds of a pass per slot (rank, kind, chunk), as _Graph numbers them."""
    durations = _durations(schedule, S, v, stage_times, backward_ratio, w_fraction)
    return [durations[r][kind, c] for r in range(S) for kind in KINDS for c in range(v)]


def _times(graph, slot_time: list, S: int, comm_time: float, with_ranks: bool = False) -> tuple:
    """(start, end) of every pass of `graph`, in its order: each starts when its rank is
    free and what it waits for from other ranks has arrived (comm_time after it ended).
    with_ranks: also when each rank's last pass ends."""
    n = len(graph.slot)
    start, end = [0.0] * n, [0.0] * n
    free = [0.0] * S
    i = 0
    for r, slot, a, b in zip(graph.rank, graph.slot, graph.first, graph.second):
        t = free[r]
        if a >= 0:
            arrive = end[a] + comm_time
            if arrive > t:
                t = arrive
            if b >= 0:
                arrive = end[b] + comm_time
                if arrive > t:
                    t = arrive
        start[i] = t
        end[i] = free[r] = t + slot_time[slot]
        i += 1
    if with_ranks:
        return start, end, free
    return start, end


@lru_cache(maxsize=64)
def _last_slots(schedule: str, S: int, B: int, v: int) -> tuple:
    """Each rank's last pass's slot (a rank's passes come in its order in the graph)."""
    graph = _graph(schedule, S, B, v)
    last = [-1] * S
    for r, slot in zip(graph.rank, graph.slot):
        last[r] = slot
    return tuple(last)


@dataclass(frozen=True)
class _Graph:
    """A schedule's passes in an order where each comes after the passes it waits for:
    per pass its rank, its slot (rank, kind, chunk: an index into that rank's pass times)
    and the positions of the passes on other ranks it waits for, first and second (-1:
    none; a pass waits for at most two, a forward paired with a backward under dualpipev;
    its own rank's come before it in the rank's order); with how many passes each slot has
    and each rank's peak in flight.  Arrays of ints: 64 ranks x 512 microbatches of
    dualpipev hold 200,000 passes."""

    rank: array
    slot: array
    micro: array
    first: array
    second: array
    slot_counts: tuple
    in_flight: tuple


@lru_cache(maxsize=64)   # (a few MiB each at the largest shapes the search tries)
def _graph(schedule: str, S: int, B: int, v: int) -> _Graph:
    orders, pairs = _orders(schedule, S, B, v)
    placement = placement_of(schedule)
    K = len(KINDS)
    kind_index = {k: i for i, k in enumerate(KINDS)}
    # every pass waits on passes of its own microbatch: per (rank, kind, chunk) the (rank,
    # id of microbatch 0) of each input, a pass's id being ((rank K + kind) v + chunk) B + m
    B = STREAM_BATCHES * B if schedule in ASYNCHRONOUS else B   # (the microbatches the orders hold)
    info = {}   # (rank, kind, chunk) -> (slot, id of microbatch 0, its inputs as (rank, id of microbatch 0))
    for r in range(S):
        for kind in KINDS:
            for c in range(v):
                at = (r * K + kind_index[kind]) * v + c
                info[r, kind, c] = (at, at * B, tuple(
                    (r2, ((r2 * K + kind_index[op2[0]]) * v + op2[2]) * B)
                    for r2, op2 in pass_inputs(r, (kind, 0, c), S, v, placement)))
    where = array("i", [-1]) * (S * K * v * B)   # pass id -> its position in the walk
    rank, slot, micro, first, second = array("i"), array("i"), array("i"), array("i"), array("i")
    pos = [0] * S
    waiting: dict = {}
    todo, queued = list(range(S - 1, -1, -1)), [True] * S
    while todo:   # ranks advanced in any order: one blocked on a pass not yet placed waits for it
        r = todo.pop()
        queued[r] = False
        order = orders[r]
        while pos[r] < len(order):
            op = order[pos[r]]
            kind, m, c = op
            at, base, ins = info[r, kind, c]
            me = base + m
            inputs = [(r2, b2 + m) for r2, b2 in ins]
            partner = pairs.get((r, op)) if pairs else None
            if partner is not None:
                inputs += [(r2, b2 + partner[1]) for r2, b2 in info[r, partner[0], partner[2]][2]
                           if b2 + partner[1] != me]
            missing = -1
            for _, i in inputs:
                if where[i] < 0:
                    missing = i
                    break
            if missing >= 0:
                waiting.setdefault(missing, []).append(r)
                break
            where[me] = len(rank)
            rank.append(r)
            slot.append(at)
            micro.append(m)
            a = b = -1
            for r2, i in inputs:
                if r2 != r:
                    if a < 0:
                        a = where[i]
                    elif b < 0:
                        b = where[i]
                    else:
                        raise AssertionError(f"{schedule}: {op} on rank {r} waits for more than two other ranks' "
                                             f"passes")
            first.append(a)
            second.append(b)
            pos[r] += 1
            blocked = waiting.pop(me, None)
            if blocked:
                for r3 in blocked:
                    if not queued[r3]:
                        queued[r3] = True
                        todo.append(r3)
    if any(p < len(o) for p, o in zip(pos, orders)):
        stuck = {r: orders[r][pos[r]] for r in range(S) if pos[r] < len(orders[r])}
        raise RuntimeError(f"schedule deadlocks; next op per rank: {stuck}")
    in_flight = [_peak_in_flight([op[0] for op in order]) for order in orders]   # (a rank runs them in order)
    counts: dict = {}
    for x in slot:
        counts[x] = counts.get(x, 0) + 1
    return _Graph(rank, slot, micro, first, second, tuple(counts.items()), tuple(in_flight))


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
        orders = _gpipe(S, B)
    elif schedule == "zero-bubble":
        orders = _zero_bubble(S, B)
    elif schedule == "zbv":
        orders = _zbv(S, B)
    elif schedule == "dualpipev":
        orders, pairs = _dualpipev(S, B)
    elif schedule == "chimera":
        orders = chimera_orders(S, B)
    elif schedule in ASYNCHRONOUS:   # 1F1B over a stream of steps, never flushed
        orders = _one_f_one_b(S, STREAM_BATCHES * B)
    else:
        orders = _one_f_one_b(S, B, v)
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


def bubble_formula(schedule: str, n_stages: int, n_microbatches: int, n_virtual: int = 1, *,
                   backward_ratio: float = 2.0, w_fraction: float = 0.5) -> float:
    """The bubble fraction `simulate` measures, in closed form, for equal stages and no
    communication time (S stages, B microbatches, v chunks, tf = 1, tb = backward_ratio):

        naive             (S-1) / S
        gpipe, 1f1b       (S-1) / (B + S-1)          bubble time (S-1)(tf+tb)
        interleaved-1f1b  (S-1) / (vB + S-1)         bubble time (S-1)(tf+tb)/v (Narayanan et al. 2021)
        zero-bubble       (S-1) x / (B(tf+tb) + (S-1) x),  x = max(tf, tbB, tf + tbB - tbW),
                          tbW = w_fraction tb, tbB = tb - tbW; for B >= S (ZB-H1, Qi et al. 2023)
        zbv               (S-1) y / (B(tf+tb) + (S-1) y),  y = max(tbB, 2(tbB - tbW)) / 2,
                          for B >= 2S and tf, tbW <= tbB (ZB-V, the same paper, section 6)
        chimera           (S-2) / (2B + S-2)         for tb = tf and B a multiple of S (Li and
                          Hoefler 2021, table 2): bubble time (S/2-1)(tf+tb), under half of 1F1B's
        pipedream-2bw     0                          for B >= S: the steady state of a stream of
                          steps without flushes (Narayanan et al. 2021), weights one step stale

    zero-bubble and zbv depend on backward_ratio: with the defaults x = tf, y = tf / 2 and
    the fractions are (S-1) / (3B + S-1) and (S-1) / (6B + S-1).  ZB-V's idle time is the
    last rank's wait for the first microbatch's forward to reach it ((S-1) half-stage
    forwards, the fill no schedule avoids); the rest of its warm-up and cool-down fill with
    W passes.
    """
    S, B, v = n_stages, n_microbatches, n_virtual
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule == "naive":
        return (S - 1) / S
    if schedule in ("gpipe", "1f1b"):
        return (S - 1) / (B + S - 1)
    if schedule == "interleaved-1f1b":
        if B % S:
            raise ValueError(f"interleaved-1f1b needs n_microbatches a multiple of n_stages={S}, got {B}")
        return (S - 1) / (v * B + S - 1)
    if schedule in ASYNCHRONOUS:
        if B < S:
            raise ValueError(f"{schedule} needs n_microbatches >= n_stages, got {B} < {S}")
        return 0.0
    if schedule == "chimera":
        if S % 2 or B % S or backward_ratio != 1.0:
            raise ValueError(f"the chimera closed form holds for an even number of stages, a multiple of them as "
                             f"microbatches and backward as long as forward; got {S} stages, {B} microbatches, "
                             f"backward_ratio {backward_ratio:g}: use simulate() instead")
        return (S - 2) / (2 * B + S - 2)
    tb_w = w_fraction * backward_ratio
    tb_b = backward_ratio - tb_w
    if schedule == "zbv":
        if B < 2 * S or tb_w > tb_b or tb_b < 1.0:
            raise ValueError(f"the zbv closed form holds for n_microbatches >= 2 n_stages and a weight pass and "
                             f"forward no longer than the input-gradient pass; got {B} microbatches for {S} stages, "
                             f"forward 1, input gradient {tb_b:g}, weight gradient {tb_w:g}: use simulate() instead")
        y = max(tb_b, 2.0 * (tb_b - tb_w)) / 2.0
        return (S - 1) * y / (B * (1.0 + backward_ratio) + (S - 1) * y)
    if B < S:
        raise ValueError(f"the zero-bubble closed form holds for n_microbatches >= n_stages, got {B} < {S}; "
                         f"use simulate() instead")
    x = max(1.0, tb_b, 1.0 + tb_b - tb_w)
    return (S - 1) * x / (B * (1.0 + backward_ratio) + (S - 1) * x)


def _gpipe(S: int, B: int) -> list:
    """All forwards in order, then all backwards in reverse order, on every rank."""
    return [[("F", m, 0) for m in range(B)] + [("B", m, 0) for m in reversed(range(B))] for _ in range(S)]


def _one_f_one_b(S: int, B: int, v: int = 1) -> list:
    """1F1B (PipeDream-flush) and, for v > 1, interleaved 1F1B as in Megatron-LM.

    Rank r runs its k-th forward on chunk (k // S) % v of microbatch (k // (S v)) S + k % S
    (microbatches go in groups of S through each chunk in turn), and its backwards in the
    same order with the chunks reversed.  Warmup: (S - r - 1) forwards for v = 1;
    2 (S - r - 1) + (v - 1) S for v > 1; then one forward, one backward; then the rest
    of the backwards.
    """
    total = B * v

    def op(kind: str, k: int) -> Op:
        chunk = (k // S) % v
        return kind, (k // (S * v)) * S + k % S, v - 1 - chunk if kind == "B" else chunk

    orders = []
    for r in range(S):
        warmup = min(S - r - 1 if v == 1 else 2 * (S - r - 1) + (v - 1) * S, total)
        order = [op("F", k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [op("F", warmup + i), op("B", i)]
        order += [op("B", k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _zero_bubble(S: int, B: int) -> list:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the 1F1B order with each
    backward split into B (input gradient, on the critical path) and W (weight gradient,
    needed only by the optimizer step).  Rank r runs W(i) right after B(i + r) and the
    last r W's after its final B, so the tail bubbles fill with W's while every rank
    holds at most S microbatches, the peak of 1F1B.

    With equal stages and B >= S the bubble is (S-1) max(tf, tb_B, tf + tb_B - tb_W) per
    rank, which is (S-1)(tf + tb_B - tb_W) as in the paper when tb_W <= min(tf, tb_B):
    with the default split (tb_B = tb_W = tf) a third of 1F1B's (S-1)(tf + tb).
    """
    orders = []
    for r, order in enumerate(_one_f_one_b(S, B)):
        split, n_b = [], 0
        for kind, m, c in order:
            split.append((kind, m, c))
            if kind == "B":
                if n_b >= r:
                    split.append(("W", n_b - r, 0))
                n_b += 1
        orders.append(split + [("W", m, 0) for m in range(max(B - r, 0), B)])
    return orders


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


def _zbv(S: int, B: int) -> list:
    """ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): chunk 0 of rank
    r is stage r and chunk 1 stage 2S-1-r; backward split into B and W as in ZB-H1.

    Per rank r, with n = max(B, 2S-1) microbatches planned and those past B dropped:
    warm-up 2(S-r)-1 forwards of chunk 0, then r times (forward chunk 1, forward chunk 0),
    then S-r times (forward, B, W of chunk 1); steady state (forward, B, W of chunk 0, then
    of chunk 1) until every forward ran; cool-down r times (B chunk 0, B chunk 1), S-r
    times (B, W of chunk 0), then the W's left, chunk 1's first.  A rank holds at most 2S
    chunks' activations (S stages' worth, as 1F1B), and with tf = tbB = tbW the steady
    state has no idle time."""
    n = max(B, 2 * S - 1)
    orders = []
    for r in range(S):
        order: list = []
        done = {kind: [0, 0] for kind in KINDS}

        def run(kind: str, chunk: int) -> None:
            order.append((kind, done[kind][chunk], chunk))
            done[kind][chunk] += 1

        for _ in range(2 * (S - r) - 1):
            run("F", 0)
        for _ in range(r):
            run("F", 1)
            run("F", 0)
        for _ in range(S - r):
            for kind in KINDS:
                run(kind, 1)
        while done["F"][1] < done["F"][0] or done["F"][0] < n:
            if done["F"][0] < n:
                run("F", 0)
            run("B", 0)
            run("W", 0)
            for kind in KINDS:
                run(kind, 1)
        for _ in range(r):
            run("B", 0)
            run("B", 1)
        for _ in range(S - r):
            run("B", 0)
            run("W", 0)
        for chunk in (1, 0):
            while done["W"][chunk] < done["B"][chunk]:
                run("W", chunk)
        orders.append([op for op in order if op[1] < B])
    return orders


def _dualpipev(S: int, B: int) -> list:
    """DualPipeV (DeepSeek-AI 2025, "DeepSeek-V3 Technical Report", section 3.2.1, in the
    V-shaped "cut-in-half" form): the V placement of zbv, a microbatch's backward of one
    chunk paired with another's forward of the other (F&B: the pair starts when both can,
    and on GPUs each hides the other's communication; here they run one after the other,
    F&B = F + B), and weight passes deferred only
    where they fill the warm-up and cool-down.  A backward with its weight pass right after
    it is a full backward.  Per rank r (n = B >= 2S microbatches):

        2(S-r-1) x F0;  (r+1) x (F0 F1);  (S-r-1) x (B1, deferred W, F1);
        (n-2S+r+1) x (F0 B1W1, F1 B0W0) (on the last rank the first F0 and B1 unpaired);
        (S-r-1) x (B1W1, F1 B0W0);
        (r+1) x (B1, B0), the second half with W deferred;  (S-r-1) x (W, B0 deferred);
        (r+1) x W

    where a deferred W runs the oldest waiting weight pass.  Returns the orders and the
    pairs {(rank, forward): backward}."""
    orders, pairs = [], {}
    for r in range(S):
        order: list = []
        count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
        waiting: list = []

        def forward(chunk: int) -> None:
            order.append(("F", count["F", chunk], chunk))
            count["F", chunk] += 1

        def backward(chunk: int, defer: bool = False) -> None:
            op = ("B", count["B", chunk], chunk)
            count["B", chunk] += 1
            order.append(op)
            if defer:
                waiting.append(("W", op[1], chunk))
            else:
                order.append(("W", op[1], chunk))

        def weight() -> None:
            order.append(waiting.pop(0))

        for _ in range(2 * (S - r - 1)):
            forward(0)
        for _ in range(r + 1):
            forward(0)
            forward(1)
        for _ in range(S - r - 1):
            backward(1, defer=True)
            weight()
            forward(1)
        def pair(f_chunk: int, b_chunk: int) -> None:
            pairs[r, ("F", count["F", f_chunk], f_chunk)] = ("B", count["B", b_chunk], b_chunk)
            forward(f_chunk)
            backward(b_chunk)

        for i in range(B - 2 * S + r + 1):
            if i == 0 and r == S - 1:   # the last rank's first two are not paired (less idle time)
                forward(0)
                backward(1)
            else:
                pair(0, 1)
            pair(1, 0)
        for _ in range(S - r - 1):
            backward(1)
            pair(1, 0)
        defer = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                defer = True
            backward(1, defer)
            if i == (r + 1) // 2 and r % 2 == 0:
                defer = True
            backward(0, defer)
        for _ in range(S - r - 1):
            weight()
            backward(0, defer=True)
        while waiting:
            weight()
        orders.append(order)
    return orders, pairs


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


def chimera_orders(S: int, B: int) -> list:
    """Chimera (Li and Hoefler 2021, "Chimera: Efficiently Training Large-Scale Neural
    Networks with Bidirectional Pipelines"): two pipelines over the same S ranks (S even),
    the down pipeline placing stage k on rank k (chunk 0), the up pipeline on rank S-1-k
    (chunk 1).  Of each S microbatches the first S/2 go down, the rest up.

    The order is the list schedule of both pipelines at equal pass times: whenever a rank
    is free it runs a ready backward first (the shallower stage's first), else a ready
    forward (the deeper stage's first), with at most min(S/2, S-k) microbatches in flight
    on stage k, as 1F1B would hold for S/2.  At backward = forward this is the paper's
    schedule: (S/2-1)(tf+tb) idle per rank for any multiple of S microbatches (its
    bubble ratio (D-2)/(2N+D-2)), stage k's rank holding S/2 + 1 to S microbatches.
    Longer backwards leave gaps between consecutive units of S (the paper's "direct
    concatenation")."""
    return [list(order) for order in _chimera_cached(S, B)]


@lru_cache(maxsize=256)
def _chimera_cached(S: int, B: int) -> tuple:
    half = S // 2
    queue = {c: [m for m in range(B) if (m % S >= half) == c] for c in (0, 1)}   # microbatches per pipeline
    end = [-1.0] * (S * 4 * B)   # ((rank 2 + kind) 2 + chunk) B + microbatch -> its end (kind: F 0, B 1)
    free = [0.0] * S
    started = [[0, 0] for _ in range(S)]
    held = [[[], []] for _ in range(S)]      # forwards waiting for their backward, per chunk
    orders = [[] for _ in range(S)]

    def candidate(r):
        """Rank r's next pass if one is ready: (start, ...ordering keys, op), or None.  It
        depends on rank r's own state and on its neighbours' ends only (pass_inputs: a
        forward waits for the stage before's forward, a backward for the stage after's
        backward; its own forward ran when it was taken)."""
        best = None
        for c in (0, 1):
            k = r if c == 0 else S - 1 - r
            step = 1 if c == 0 else -1    # the next stage's rank is r + step
            mine = held[r][c]
            if mine:
                m = mine[0]
                t = free[r]
                if k < S - 1:
                    after = end[(((r + step) * 2 + 1) * 2 + c) * B + m]
                    t = None if after < 0 else max(t, after)
                if t is not None:
                    got = (t, False, k, ("B", m, c))
                    best = got if best is None or got < best else best
            if started[r][c] < len(queue[c]) and len(mine) < min(half, S - k):
                m = queue[c][started[r][c]]
                t = free[r]
                if k > 0:
                    before = end[(((r - step) * 2) * 2 + c) * B + m]
                    t = None if before < 0 else max(t, before)
                if t is not None:
                    got = (t, True, -k, ("F", m, c))
                    best = got if best is None or got < best else best
        return best

    # the earliest ready pass over all ranks, the lowest rank on a tie; a heap of each rank's
    # candidate, recomputed only where a pass changed what is ready (its rank and neighbours)
    version = [0] * S
    heap = []
    for r in range(S):
        got = candidate(r)
        if got is not None:
            heap.append((got[0], r, 0, got[3]))
    heapq.heapify(heap)
    for _ in range(2 * B * S):
        while True:
            t, r, ver, op = heapq.heappop(heap)
            if ver == version[r]:
                break
        kind, m, c = op
        free[r] = end[((r * 2 + (kind == "B")) * 2 + c) * B + m] = t + 1.0
        orders[r].append(op)
        if kind == "F":
            held[r][c].append(m)
            started[r][c] += 1
        else:
            held[r][c].remove(m)
        for r2 in (r - 1, r, r + 1):
            if 0 <= r2 < S:
                version[r2] += 1
                got = candidate(r2)
                if got is not None:
                    heapq.heappush(heap, (got[0], r2, version[r2], got[3]))
    return tuple(tuple(o) for o in orders)


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

