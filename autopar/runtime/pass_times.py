"""Record when each pass of a real `torch.distributed.pipelining` schedule ran, on every
rank, and turn the records into a Timeline that `bubble_fraction`, `gantt_svg` and the
simulator understand.

    stage = PipelineStage(submodule, rank, n_ranks, device)
    schedule = ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn)
    recorder = EventRecorder(stage)
    schedule.step(x, target=y)                  # warm-up (metadata inference, allocator)
    recorder.clear()
    schedule.step(x, target=y)                  # the step to measure
    tl = gather_timeline(recorder, "gpipe")     # collective: every rank gets all events
    costs = pass_times(tl)                      # mean F per stage, B/F, hand-off delay
    costs.simulate("gpipe", n_microbatches)     # the simulator's account of the same run

How passes are found.  The schedules of torch 2.13 (GPipe, 1F1B, interleaved, zero-bubble)
run a pass by calling the stage's `forward_one_chunk(mb, ...)`, `backward_one_chunk(mb,
...)` (full or, under zero-bubble schedules, input-gradient backward) and
`backward_weight_one_chunk(mb)`, always through the stage object.  EventRecorder replaces
these three methods on the stage instance by timed wrappers, so the microbatch index is
the schedule's own (the first argument), not a count.  Hooks on the submodule would not
do: the schedule's metadata inference also runs the submodule (extra forwards to filter
out); a full backward hook fires once the input's gradient exists, which can be before
the first layer's weight gradient is accumulated, and on stage 0, whose input needs no
gradient, it fires at the start of the backward, when the output's gradient arrives.
A pass's time covers its compute only: the schedule waits for the received activation or
gradient before calling the method and sends after it returns, so waiting shows up as
idle time.  The last stage's loss is computed by the schedule between its forward and
the next pass and is in neither.

Timestamps are `time.perf_counter()`, CLOCK_MONOTONIC on Linux: one clock shared by all
processes of a host, so events of ranks on one host line up as they are.  Ranks on
several hosts have offset clocks; align them before reading a bubble off such a timeline.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

from autopar.cost.schedules import Event, Timeline, simulate

_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


class EventRecorder:
    """Times every forward ("F"), backward ("B") and weight-gradient ("W") pass that a
    pipelining schedule runs on `stages` (the PipelineStages of this rank; several under
    interleaved schedules).

    Each pass appends Event(rank, kind, microbatch, chunk, start, end) to `events`, where
    rank is the stage's rank in its pipeline group and chunk = stage_index // group size
    (stage i lives on rank i % group size, so chunk c of rank r is virtual stage c*S + r as
    in `simulate`).  Backwards skipped because the schedule has no loss are not recorded.
    `close()` (or leaving a `with` block) puts the stages' own methods back.
    """

    def __init__(self, *stages):
        if not stages:
            raise ValueError("EventRecorder needs at least one PipelineStage to time")
        self.events: list[Event] = []
        self._stages = stages
        for stage in stages:
            for name, kind in _METHODS.items():
                setattr(stage, name, self._timed(stage, getattr(stage, name), kind))

    def _timed(self, stage, method, kind: str):
        chunk = stage.stage_index // stage.group_size

        @functools.wraps(method)
        def timed(mb_index, *args, **kwargs):
            start = time.perf_counter()
            result = method(mb_index, *args, **kwargs)
            if kind == "F" or stage.has_backward:
                self.events.append(Event(stage.group_rank, kind, mb_index, chunk, start, time.perf_counter()))
            return result

        return timed

    def clear(self) -> None:
        """Forget the passes recorded so far (call it after the warm-up steps)."""
        self.events.clear()

    def close(self) -> None:
        for stage in self._stages:
            for name in _METHODS:
                vars(stage).pop(name, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def gather_timeline(recorder_or_events, schedule: str = "measured", group=None) -> Timeline:
    """All ranks' recorded passes as one Timeline, on every rank of `group` (default: the
    world); a collective, so every rank of the group must call it.

    recorder_or_events: this rank's EventRecorder or list of Events.  Ranks are the
    recorders' pipeline-group ranks, so `group` only carries the gather and may be any
    group holding all pipeline ranks.
    """
    import torch.distributed as dist

    events = getattr(recorder_or_events, "events", recorder_or_events)
    per_rank = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, list(events), group=group)
    return Timeline.from_events([e for rank_events in per_rank for e in rank_events], schedule)


@dataclass(frozen=True)
class PassTimes:
    """What `simulate` needs to replay a measured run: the mean forward time of one
    microbatch on each stage (seconds), the mean backward over the mean forward time
    (all stages together) and the hand-off delay, the mean time from the end of a pass
    to the start of the cross-rank pass that was waiting for its output (the mean, not
    the median: the simulator adds it to every hand-off, so the rare slow wake-up of an
    oversubscribed host belongs in it)."""

    forward: tuple
    backward_ratio: float
    comm_time: float

    def simulate(self, schedule: str, n_microbatches: int) -> Timeline:
        return simulate(schedule, len(self.forward), n_microbatches, list(self.forward),
                        backward_ratio=self.backward_ratio, comm_time=self.comm_time)

    def __str__(self) -> str:
        fwd = ", ".join(f"{t * 1e3:.3g}" for t in self.forward)
        return (f"forward [{fwd}] ms per stage, backward {self.backward_ratio:.3g}x forward, "
                f"hand-off {self.comm_time * 1e3:.3g} ms")


def pass_times(tl: Timeline) -> PassTimes:
    """Mean pass times and hand-off delay of a measured single-chunk Timeline (F and B
    passes only, as GPipe and 1F1B run).

    A hand-off is F(m) on rank r-1 -> F(m) on rank r, or B(m) on rank r+1 -> B(m) on rank
    r, counted only where rank r sat idle for it (its previous pass ended before the
    input's producer did), so the gap is transfer plus wake-up, not rank r being busy.
    """
    if tl.n_virtual != 1 or any(e.kind == "W" for e in tl.events):
        raise ValueError(f"pass_times reads single-chunk F/B timelines; this one has {tl.n_virtual} chunks "
                         f"per rank and kinds {sorted({e.kind for e in tl.events})}")
    at = {(e.kind, e.rank, e.microbatch): e for e in tl.events}
    forward = []
    for r in range(tl.n_stages):
        times = [e.duration for e in tl.on(r) if e.kind == "F"]
        if not times:
            raise ValueError(f"rank {r} ran no forward pass; record a step on every rank before pass_times")
        forward.append(statistics.fmean(times))
    total = {k: sum(e.duration for e in tl.events if e.kind == k) for k in "FB"}
    gaps = []
    for r in range(tl.n_stages):
        prev_end = None
        for e in tl.on(r):
            src = e.rank - 1 if e.kind == "F" else e.rank + 1
            dep = at.get((e.kind, src, e.microbatch))
            if dep is not None and (prev_end is None or prev_end <= dep.end):
                gaps.append(e.start - dep.end)
            prev_end = e.end
    return PassTimes(tuple(forward), total["B"] / total["F"], statistics.fmean(gaps) if gaps else 0.0)
