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

from autopar.cost.schedules import KINDS, TWO_WAY, Event, Timeline, pass_inputs, placement_of, simulate

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
    microbatch on each rank (seconds; with several chunks per rank, the sum of its chunks'
    means), the mean backward (B + W) over the mean forward time (all ranks together) and
    the hand-off delay, the mean time from the end of a pass to the start of the
    cross-rank pass that was waiting for its output (the mean, not the median: the
    simulator adds it to every hand-off, so the rare slow wake-up of an oversubscribed
    host belongs in it).  chunks: per rank, each chunk's mean forward (chimera's stages
    differ between a rank's two chunks); w_fraction: the weight passes' share of backward
    (schedules that split it)."""

    forward: tuple
    backward_ratio: float
    comm_time: float
    chunks: tuple = ()
    w_fraction: float = 0.5

    def simulate(self, schedule: str, n_microbatches: int) -> Timeline:
        if schedule in TWO_WAY:   # stage k runs as chunk 0 of rank k and chunk 1 of rank S-1-k
            S = len(self.chunks)
            stage_times = [statistics.fmean((self.chunks[k][0], self.chunks[S - 1 - k][1])) for k in range(S)]
            return simulate(schedule, S, n_microbatches, stage_times, backward_ratio=self.backward_ratio,
                            comm_time=self.comm_time)
        v = len(self.chunks[0]) if self.chunks else 1
        return simulate(schedule, len(self.forward), n_microbatches, list(self.forward), n_virtual=v,
                        backward_ratio=self.backward_ratio, comm_time=self.comm_time, w_fraction=self.w_fraction)

    def __str__(self) -> str:
        fwd = ", ".join(f"{t * 1e3:.3g}" for t in self.forward)
        return (f"forward [{fwd}] ms per stage, backward {self.backward_ratio:.3g}x forward, "
                f"hand-off {self.comm_time * 1e3:.3g} ms")


def pass_times(tl: Timeline) -> PassTimes:
    """Mean pass times and hand-off delay of a measured Timeline, whose `schedule` names
    how its chunks are placed (cost.schedules.placement_of; a name the simulator does not
    know is read as one chunk per rank, or chunk c of rank r as stage cS + r).

    A hand-off is a pass waiting for another rank's pass (the forward of the stage before,
    the backward of the stage after: cost.schedules' dependencies), counted only where the
    rank sat idle for it (its previous pass ended before the input's producer did), so the
    gap is transfer plus wake-up, not the rank being busy.
    """
    placement = placement_of(tl.schedule)
    S, v = tl.n_stages, tl.n_virtual
    at = {(e.rank, (e.kind, e.microbatch, e.chunk)): e for e in tl.events}
    chunks = []
    for r in range(S):
        means = []
        for c in range(v):
            times = [e.duration for e in tl.on(r) if e.kind == "F" and e.chunk == c]
            if not times:
                raise ValueError(f"rank {r} ran no forward pass" + (f" of chunk {c}" if v > 1 else "")
                                 + "; record a step on every rank before pass_times")
            means.append(statistics.fmean(times))
        chunks.append(tuple(means))
    total = {k: sum(e.duration for e in tl.events if e.kind == k) for k in KINDS}
    gaps = []
    for r in range(S):
        prev_end = None
        for e in tl.on(r):
            for r2, op in pass_inputs(r, (e.kind, e.microbatch, e.chunk), S, v, placement):
                dep = at.get((r2, op))
                if r2 != r and dep is not None and (prev_end is None or prev_end <= dep.end):
                    gaps.append(e.start - dep.end)
            prev_end = e.end
    backward = total["B"] + total["W"]
    return PassTimes(tuple(sum(c) for c in chunks), backward / total["F"], statistics.fmean(gaps) if gaps else 0.0,
                     tuple(chunks), total["W"] / backward if total["W"] else 0.5)
