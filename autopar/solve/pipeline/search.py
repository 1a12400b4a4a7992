"""Pipeline stage search: whether to cut the model into stages, where, on which sub-meshes,
with which schedule and how many microbatches (Alpa's inter-operator pass, Zheng et al.
2022, specialised to models built of repeated layers).

Candidates.  The mesh is split evenly along one axis a into p groups of devices (p divides
shape[a]); every stage runs on a sub-mesh of shape[a] / p along a and the full size along
the other axes, with the same links.  p = 1 is "no pipeline".  The pieces:

- options.py: what is searched (the schedules, autopar.Pipeline's fixed fields,
  the axes and microbatch counts: SearchSpace);
- costs.py: a candidate's stage costs, each (sub-mesh, microbatch) planned by the
  intra-stage ILP once and split per repeated layer (StageCosts);
- workers.py: who traces and costs which candidates on the cores this process may
  use, and what a forked worker hands back (Costed);
- candidates.py: one candidate cut into stages and run through the schedule
  simulator, and the record of the choice (PipelineChoice, whose `layout` is the plan's
  PipelineLayout).

This module runs them: the plain plan and the candidates over the stage axes (the other
axes only when none of those fits), the fastest that fits the budget.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

from autopar.cost.collective_prices import send_time
from autopar.cost.schedules import ASYNCHRONOUS, least_microbatches
from autopar.mesh import parse_bytes
from autopar.solve.pipeline.candidates import SLOWER, PipelineChoice, evaluate, floor, memory_ceiling, plain_choices
from autopar.solve.pipeline.costs import StageCosts
from autopar.solve.pipeline.options import SCHEDULE_CHOICES, Cut, Pipeline, SearchSpace
from autopar.solve.pipeline.workers import cost_in_parallel, trace_and_cost
from autopar.solve.recompute.modes import SEARCHED
from autopar.solve.ilp.solved import SolveOptions
from autopar.trace.batching import batch_size

log = logging.getLogger("autopar")
SLOWER_REASON = "slower than the best found, whatever the schedule"


class _Found:
    """The layouts that fit so far, and how many of the others were rejected, and why.
    Only the best layout's problem stays alive (the planner reuses it)."""

    def __init__(self):
        self.choices: list[PipelineChoice] = []
        self.rejected: dict = {}   # reason -> count

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def add(self, choice: PipelineChoice) -> None:
        self.choices.append(choice)

    def best(self) -> PipelineChoice | None:
        return min(self.choices, key=lambda c: c.rank) if self.choices else None

    @property
    def pipelined(self) -> bool:
        return any(c.axis is not None for c in self.choices)

    def keep_best_problem(self, costs: StageCosts) -> None:
        if self.choices:
            best = self.best().built
            self.choices = [c if c.built is best else dataclasses.replace(c, built=None) for c in self.choices]
            costs.keep_only(best)


def search(model, mesh, example_inputs, example_kwargs=None, *, memory_budget=None, schedules=SCHEDULE_CHOICES,
           microbatches=None, options: SolveOptions = SolveOptions(), fixed: Pipeline | None = None,
           mixed_precision=None, recompute=None, pricing=None, layout: str | None = None) -> PipelineChoice:
    """The fastest pipeline layout (or none) for `model` on `mesh`; see the module docstring.
    fixed: a Pipeline whose set fields the result must have (then never "no pipeline");
    mixed_precision: an autopar.MixedPrecision the stages are costed under; recompute: the
    recomputation policy of every repeated layer (None: the fastest of none, selective, full and
    activation offload to host memory that fits); layout: the hand-written layout the
    stages are planned in (SolveOptions(layout=...)), which the search then prices (None: each
    candidate's free plan, or Megatron-SP where that fits better).
    options.workers: processes that cost candidates at once; each costs whole microbatch
    sizes (one trace each), and the result is the same for any count."""
    start = time.perf_counter()
    space = _space(mesh, batch_size(example_inputs, example_kwargs), memory_budget, schedules, microbatches, fixed,
                   recompute)
    costs = StageCosts(model, mesh, example_inputs, example_kwargs, mixed_precision, options, space.modes,
                       pricing, layout, functools.partial(_tight, space))
    first = space.first_axes()
    # the whole batch on the whole mesh (this process: the planner plans it again) and the
    # candidates over the stage axes, costed side by side; the whole batch and one
    # microbatch size traced first, so that every process writes the other sizes from the
    # two (autopar/trace/rebatch.py)
    trace_and_cost(costs, [space.whole] + [k for k in space.keys(first) if k != space.whole], options.workers)
    base = costs(space.whole)
    plain = plain_choices(base, mesh, costs.problem(space.whole))
    found = _Found()
    for choice in plain:
        if choice.memory[0] <= space.limit and fixed is None:
            found.add(choice)
    for axes in (first, tuple(a for a in range(mesh.ndim) if a not in first)):
        if not axes or found.pipelined or found.rejected.get(SLOWER_REASON):
            break   # (the other axes only when no layout over the stage axes fits: none was
            # simulated and fit, and none was left out for being slower than what fits)
        _search_axes(space, costs, axes, found, start)
    if not found.choices:
        raise _nothing_fits(model, space, found, base)
    none = _fastest_plain(plain, space.limit)
    best = dataclasses.replace(found.best(), candidates=len(found.choices), seconds=time.perf_counter() - start,
                               no_pipeline_s=none.step_s if none is not None else float("inf"),
                               rejected=found.rejected, plain=costs.problem(space.whole))
    log.info("%s (searched %d layouts in %.2fs)", best, best.candidates, best.seconds)
    return best


def _space(mesh, batch, memory_budget, schedules, microbatches, fixed, recompute) -> SearchSpace:
    limit = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else mesh.device.memory
    if fixed is not None:
        fixed.check(mesh)
        if fixed.microbatches is not None:
            if batch % fixed.microbatches:
                raise ValueError(f"Pipeline(microbatches={fixed.microbatches}) does not divide the batch of {batch}")
            microbatches = [fixed.microbatches]
    return SearchSpace(mesh, batch, limit, tuple(schedules), None if microbatches is None else tuple(microbatches),
                       fixed, ("none", *SEARCHED, "offload") if recompute is None else (recompute,))


def _tight(space: SearchSpace, key, free) -> bool:
    """Whether some layout of the candidates costed at `key` might not fit the budget under
    the free stage plan's fastest recompute mode (memory_ceiling: every forward in flight):
    only then are the hand-written stage layouts priced beside it (costs.layer_costs), since
    they keep less but run no faster."""
    modes = ["none"] if "none" in free.by_mode else list(free.by_mode)
    for cut in space.cuts(range(space.mesh.ndim)):
        if space.key(cut) != key:
            continue
        p = cut.groups
        for schedule in space.schedules:
            for v in space.virtuals(schedule, len(free.layer_indices), p):
                if len(free.layer_indices) < p * v:
                    continue
                if any(memory_ceiling(free.by_mode[m], free.copies, p * v, p, v, schedule, cut.microbatches)
                       > space.limit for m in modes):
                    return True
    return False


def _fastest_plain(plain: list, limit) -> PipelineChoice | None:
    """The fastest plain layout that fits (else the first)."""
    none = None
    for choice in plain:
        mem = choice.memory[0]
        if none is None or (mem <= limit and (none.memory[0] > limit or choice.step_s < none.step_s)):
            none = choice
    return none


def _search_axes(space: SearchSpace, costs: StageCosts, axes, found: _Found, start) -> None:
    """Cost every candidate that cuts one of `axes`, then evaluate them fastest floor first
    (candidates.floor: the step no schedule can beat), stopping where the floor
    exceeds the best step found: only the candidates that could still win are simulated."""
    todo = space.cuts(axes)
    cost_in_parallel(costs, costs.missing(space.keys(axes)), costs.options.workers)
    tasks = []
    for cut in todo:
        if costs(space.key(cut)) is None:
            found.reject("no plan fits a stage")
            continue
        tasks += _tasks(space, costs, cut)
    tasks.sort(key=lambda t: t[0])
    done = 0
    for low, cut, got, schedule, v, mode, parts, send in tasks:
        best = found.best()
        if best is not None and low > best.step_s * (1 + 1e-9):
            break
        _place(space, costs, cut, got, schedule, v, mode, parts, send, found)
        done += 1
        if done % 50 == 0:
            _progress(done, len(tasks), found, start)
    if len(tasks) > done:
        found.rejected[SLOWER_REASON] = found.rejected.get(SLOWER_REASON, 0) + len(tasks) - done
    _progress(done, len(tasks), found, start)
    found.keep_best_problem(costs)


def _tasks(space: SearchSpace, costs: StageCosts, cut: Cut) -> list:
    """(floor, cut, stage costs, schedule, virtual count, recompute mode, its parts, send
    seconds) of every layout of one cut: each stage layout (the free plan's and the
    hand-written ones of costs.stage_layouts), schedule, virtual stage count and
    recompute mode."""
    mesh, fixed = space.mesh, space.fixed
    key = space.key(cut)
    p, n_mb, name = cut.groups, cut.microbatches, mesh.axis_names[cut.axis]
    out = []
    for got in costs(key).variants():   # the free stage plan, then the hand-written ones
        send = send_time(got.boundary, cut.axis, mesh)  # one activation (or gradient) across a cut
        for schedule in space.schedules:
            for v in space.virtuals(schedule, len(got.layer_indices), p):
                n_stages = p * v
                if len(got.layer_indices) < n_stages or n_mb < least_microbatches(schedule, p) or (
                        schedule == "interleaved-1f1b" and n_mb % p) or (schedule == "chimera" and (p % 2 or n_mb % p)):
                    continue
                if fixed is not None and not fixed.allows(name, p, schedule, n_mb, v):
                    continue
                if schedule in ASYNCHRONOUS and (fixed is None or not fixed.asynchronous or n_mb < p):
                    continue   # (stale weights only where the user allowed them)
                for mode, parts in got.by_mode.items():
                    low = floor(parts, got.copies, send, n_stages, p, n_mb, mesh.device.asynchronous, schedule)
                    out.append((low, cut, got, schedule, v, mode, parts, send))
    return out


def _place(space: SearchSpace, costs: StageCosts, cut: Cut, got, schedule, v, mode, parts, send,
           found: _Found) -> None:
    """Simulate one layout and keep it where it fits the memory budget."""
    mesh = space.mesh
    p, n_mb = cut.groups, cut.microbatches
    best = found.best()
    choice = evaluate(parts, got.copies, send, p * v, p, v, schedule, n_mb, space.limit, mesh.device.asynchronous,
                      best.step_s if best is not None else float("inf"),
                      transfer=functools.partial(send_time, axis=cut.axis, mesh=mesh), host_limit=mesh.device.host_memory)
    if choice is SLOWER:
        found.reject(SLOWER_REASON)
    elif choice is None:
        found.reject("over the memory budget")
    else:
        found.add(dataclasses.replace(choice, axis=mesh.axis_names[cut.axis], n_groups=p,
                                      submesh=tuple(space.key(cut)[0]), layer_prefix=got.layer_prefix,
                                      layer_indices=got.layer_indices, recompute=mode,
                                      built=costs.problem(space.key(cut)), stage_layout=got.layout))


def _nothing_fits(model, space: SearchSpace, found: _Found, base) -> ValueError:
    mesh, limit = space.mesh, space.limit
    if space.fixed is not None:
        return ValueError(f"no pipeline layout of {type(model).__name__} on {mesh} satisfies {space.fixed} within "
                          f"{limit / 2**30:.2f} GiB per device (rejected: {found.rejected or 'none'}); the model has "
                          f"{len(base.layer_indices) if base else '?'} repeated layers, the batch {space.batch} rows")
    return ValueError(f"no pipeline or plain layout of {type(model).__name__} fits {limit / 2**30:.2f} GiB "
                      f"per device on {mesh}")


def _progress(done, total, found: _Found, start) -> None:
    """One INFO line every 50 layouts simulated and one at the end: how far, the best so
    far (the layouts not simulated cannot beat it)."""
    best = found.best()
    what = "none fits yet" if best is None else (
        f"best so far {best.step_s * 1e3:.1f} ms ("
        + (f"{best.n_stages} stages over {best.axis}, {best.schedule}, {best.n_microbatches} microbatches"
           if best.axis is not None else "no pipeline") + ")")
    log.info("pipeline search: %d of %d layouts simulated (fastest floor first; the rest cannot be faster); "
             "%d fit; %s; %.1fs", done, total, len(found.choices), what, time.perf_counter() - start)
