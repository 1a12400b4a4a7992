"""Pipeline stage search: whether to cut the model into stages, where, on which sub-meshes,
with which schedule and how many microbatches (Alpa's inter-operator pass, Zheng et al.
2022, specialised to models built of repeated layers).

Candidates.  The mesh is split evenly along one axis a into p groups of devices (p divides
shape[a]); every stage runs on a sub-mesh of shape[a] / p along a and the full size along
the other axes, with the same links.  p = 1 is "no pipeline".  Which axes: a mesh with an
axis named "pp" is pipelined on it, as given; otherwise the axes that cross nodes (stages
across nodes leave the fast links inside a stage, where tensor parallelism needs them),
and every axis of a mesh inside one node; the other axes too when no layout over those fits
the budget.  autopar.Pipeline(axis=...) names any axis.

Stage costs.  For each sub-mesh and microbatch size the whole model is planned by the
intra-stage ILP (tensor, data parallelism and ZeRO inside the stage) on a microbatch; the
plan's per-node times are summed per repeated layer, plus what runs before the first layer
(embeddings) and after the last (head, loss).  Every op pays the device's op latency once
per pass (forward, and twice in backward; cost.roofline): small microbatches are not
free, which is what keeps small models on fast networks out of pipelines.  Per microbatch
a layer costs its compute and activation communication; its gradient synchronisation,
optimizer step and optimizer all-gathers run once per step.  Crossing a cut costs the boundary activation (and its gradient) over axis a.

Cuts.  Layers are the units: stage s holds a contiguous run of layers, the first stage also
the prefix, the last the suffix.  For S stages the cuts minimise the slowest stage (the
bubble and the steady state both scale with it; a dynamic programme over layer counts).

Schedule.  Each (p, S, schedule, microbatches) candidate is run through the simulator
(autopar.cost.schedules) with the stage times: the step is its makespan plus the slowest
stage's once-per-step synchronisation.  Memory per device: the stage's model states plus
its activations per microbatch times the microbatches it holds in flight (GPipe: all of
them; 1F1B: S - s), which must fit the budget.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import re
import time
from dataclasses import dataclass, field

from autopar.trace.batching import batch_size, first_microbatch
from autopar.cost.prices import local_numel, send_time
from autopar.solve.forked import forked_lanes, forked_map, worker_count
from autopar.mesh import Mesh, parse_bytes
from autopar.solve.recompute import MODES, ModeCosts, kept_by_selective, layer_paths
from autopar.solve.solution import Built, assemble, build_problem, planning_trace, solve_unbudgeted
from autopar.solve.ilp import InfeasibleError
from autopar.trace.export import adopt_outlines, exported_outlines
from autopar.cost.schedules import simulate

log = logging.getLogger("autopar")

SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@dataclass(frozen=True)
class StageCost:
    """Seconds and bytes of one candidate stage layout, per microbatch unless noted."""

    forward_s: float
    backward_s: float
    once_s: float        # per step: gradient synchronisation, optimizer all-gathers
    params: float        # bytes of parameters,
    grads: float         # ... of gradients
    optimizer: float     # ... and of optimizer states (with master weights)
    activations: float   # bytes kept for backward per microbatch
    working: float = 0.0  # the most any one op needs beyond them while it runs (recompute.working_bytes)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Pipeline:
    """What to fix of the pipeline layout; a field left None is searched.

        autopar.plan(model, mesh, x, pipeline=autopar.Pipeline(axis="dp", groups=2, schedule="1f1b"))

    axis: the mesh axis cut into device groups; groups: how many (stages = groups x
    virtual); schedule: one of SCHEDULE_CHOICES; microbatches: per step (dividing the batch);
    virtual: stages per group (interleaved-1f1b only).  With any constraint the result is
    pipelined even where no pipeline would be faster."""

    axis: str | None = None
    groups: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    virtual: int | None = None

    def check(self, mesh) -> None:
        """Raise ValueError naming the field that cannot hold on `mesh`."""
        if self.axis is not None and self.axis not in mesh.axis_names:
            raise ValueError(f"Pipeline(axis={self.axis!r}): the mesh's axes are {mesh.axis_names}")
        if self.schedule is not None and self.schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"Pipeline(schedule={self.schedule!r}): choose one of {SCHEDULE_CHOICES}")
        if self.virtual not in (None, 1) and self.schedule not in (None, "interleaved-1f1b"):
            raise ValueError(f"Pipeline(virtual={self.virtual}): only interleaved-1f1b runs several stages "
                             f"per device group, not {self.schedule}")
        if self.groups is not None:
            sizes = [mesh.shape[mesh.axis_names.index(self.axis)]] if self.axis else list(mesh.shape)
            if self.groups < 2 or not any(s % self.groups == 0 for s in sizes):
                raise ValueError(f"Pipeline(groups={self.groups}): no mesh axis of size {sizes} splits into "
                                 f"{self.groups} groups (at least 2)")

    def allows(self, axis, groups, schedule, microbatches, virtual) -> bool:
        """Whether a candidate agrees with every set field (a candidate's None: not decided yet)."""
        return all(want is None or got is None or want == got for want, got in ((self.axis, axis), (self.groups, groups),
                   (self.schedule, schedule), (self.microbatches, microbatches), (self.virtual, virtual)))


@dataclass(frozen=True)
class PipelineChoice:
    """What the search chose.  axis: the mesh axis split into `n_groups` device groups (None:
    no pipeline); stages: (first layer, last layer + 1) per stage, stage 0 also holding the
    prefix and the last stage the suffix; submesh: each group's mesh shape."""

    axis: str | None
    n_groups: int
    submesh: tuple
    stages: tuple
    schedule: str
    n_microbatches: int
    n_virtual: int
    step_s: float
    bubble: float
    stage_s: tuple
    memory: tuple          # bytes per device of each device group
    candidates: int = 0
    seconds: float = 0.0
    no_pipeline_s: float = 0.0
    rejected: dict = field(default_factory=dict)   # reason -> count
    layer_prefix: str = ""  # module path of the repeated layers ("blocks" for blocks.0, blocks.1, ...)
    layer_indices: tuple = ()  # their indices in order; stages count positions in this list
    group_memory: tuple = ()   # per device group: {params, grads, optimizer, activations, working} bytes per device
    recompute: str = "none"    # what every repeated layer keeps for backward (autopar/solve/recompute.py)
    built: Built | None = field(default=None, compare=False, repr=False)  # the problem of one stage's plan
    plain: Built | None = field(default=None, compare=False, repr=False)  # the unpipelined problem (whole batch)
    send_s: float = 0.0           # one activation's (or gradient's) trip across a cut
    sends_overlap: bool = False   # sends delay only their receiver (asynchronous devices)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def __str__(self) -> str:
        if self.axis is None:
            return (f"pipeline: none (best pipelined candidate of {self.candidates} was not faster; "
                    f"step {self.step_s * 1e3:.1f} ms)")
        cuts = ", ".join(f"{a}-{b - 1}" for a, b in self.stages)
        return (f"pipeline: {self.n_stages} stages over {self.axis} (layers {cuts}), each on sub-mesh "
                f"{'x'.join(map(str, self.submesh))}; {self.schedule} with {self.n_microbatches} microbatches"
                + (f", {self.n_virtual} virtual stages per group" if self.n_virtual > 1 else "")
                + f"; step {self.step_s * 1e3:.1f} ms (no pipeline: {self.no_pipeline_s * 1e3:.1f} ms), "
                f"bubble {self.bubble:.1%}, memory per device up to {max(self.memory) / 2**30:.2f} GiB"
                + (f"; every layer recomputed ({self.recompute})" if self.recompute != "none" else "")
                + (f"; each send across a cut {self.send_s * 1e3:.2f} ms, "
                   + ("overlapped with the sender's compute" if self.sends_overlap else "added to both stages")
                   if self.send_s else ""))


def search(model, mesh, example_inputs, example_kwargs=None, *, memory_budget=None, schedules=SCHEDULE_CHOICES,
           microbatches=None, time_limit: float = 60.0, fixed: Pipeline | None = None,
           mixed_precision=None, recompute=None, workers: int | None = None) -> PipelineChoice:
    """The fastest pipeline layout (or none) for `model` on `mesh`; see the module docstring.
    fixed: a Pipeline whose set fields the result must have (then never "no pipeline");
    mixed_precision: an autopar.MixedPrecision the stages are costed under; recompute: the
    recomputation policy of every repeated layer (None: the fastest of MODES that fits).
    workers: processes that cost candidates at once (None: $AUTOPAR_WORKERS, else the
    cores this process may use); each costs whole microbatch sizes (one trace each), and the
    result is the same for any count."""
    start = time.perf_counter()
    limit = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else mesh.device.memory
    batch = batch_size(example_inputs, example_kwargs)
    results = []
    rejected: dict = {}
    cost_cache: dict = {}
    problems: dict = {}  # (sub-mesh shape, microbatch rows) -> Built, kept only for the best candidate so far
    modes = MODES if recompute is None else (recompute,)

    def costs_for(sub_shape, mb_size):
        key = (sub_shape, mb_size)
        if key not in cost_cache:
            problems[key] = stage_problem(model, mesh, example_inputs, example_kwargs, mixed_precision, sub_shape,
                                          mb_size)
            cost_cache[key] = _layer_costs(problems[key], model, time_limit, modes)
            if key == (tuple(mesh.shape), batch) and cost_cache[key] is not None:
                # the plan without stages as the planner solves it with no budget (the
                # overlap-aware second solve; Built.solved), while the other processes cost
                # candidates: the planner takes it when it fits
                solve_unbudgeted(problems[key], time_limit)
        return cost_cache[key]

    def keep_best_problem():
        """Only the best candidate's problem stays alive (the planner reuses it)."""
        if results:
            best = min(results, key=lambda c: (c.step_s, c.n_stages)).built
            results[:] = [c if c.built is best else _replace(c, built=None) for c in results]
            for key in [k for k, b in problems.items() if b is not best and k != (mesh.shape, batch)]:
                del problems[key]

    if fixed is not None:
        fixed.check(mesh)
        if fixed.microbatches is not None:
            if batch % fixed.microbatches:
                raise ValueError(f"Pipeline(microbatches={fixed.microbatches}) does not divide the batch of {batch}")
            microbatches = [fixed.microbatches]
    first = _stage_axes(mesh) if fixed is None or fixed.axis is None else tuple(range(mesh.ndim))
    whole = (tuple(mesh.shape), batch)
    # the whole batch on the whole mesh (this process: the planner plans it again) and the
    # candidates over the stage axes, costed side by side; the whole batch and one
    # microbatch size traced first, so that every process writes the other sizes from the
    # two (autopar/trace/rebatch.py)
    keys = [whole] + [k for k in _candidate_keys(mesh, batch, first, fixed, microbatches) if k != whole]
    _trace_and_cost(model, example_inputs, example_kwargs, mixed_precision, keys, workers, costs_for, cost_cache)
    # no pipeline: the plain plan of the whole batch
    base = costs_for(*whole)
    none = None
    for mode, (layers, prefix, suffix) in (base[0].items() if base is not None else ()):
        members = [prefix, *layers, suffix]
        step = sum(c.forward_s + c.backward_s + c.once_s for c in members)
        parts = {k: sum(getattr(c, k) for c in members) for k in ("params", "grads", "optimizer", "activations")}
        parts["working"] = max(c.working for c in members)
        mem = sum(parts.values())
        plain = PipelineChoice(None, 1, mesh.shape, ((0, len(layers)),), "none", 1, 1, step, 0.0, (step,), (mem,),
                               group_memory=(parts,), recompute=mode, built=problems.get((mesh.shape, batch)))
        if none is None or (mem <= limit and (none.memory[0] > limit or step < none.step_s)):
            none = plain   # the fastest plain layout that fits (else the first)
        if mem <= limit and fixed is None:
            results.append(plain)

    def search_axes(axes):
        """Cost and evaluate every candidate that cuts one of `axes`."""
        todo = _candidates(mesh, batch, axes, fixed, microbatches)
        keys = _candidate_keys(mesh, batch, axes, fixed, microbatches)
        _cost_in_parallel([k for k in keys if k not in cost_cache], workers, costs_for, cost_cache)
        for done, (axis, p, n_mb) in enumerate(todo, 1):
            sub_shape = tuple(s // p if a == axis else s for a, s in enumerate(mesh.shape))
            got = costs_for(sub_shape, batch // n_mb)
            if got is None:
                rejected["no plan fits a stage"] = rejected.get("no plan fits a stage", 0) + 1
                continue
            by_mode, boundary, names, copies = got
            send = send_time(boundary, axis, mesh)  # one activation (or gradient) across a cut
            for schedule in schedules:
                virtuals = (fixed.virtual,) if fixed is not None and fixed.virtual else (1, 2)
                for v in (virtuals if schedule == "interleaved-1f1b" else (1,)):
                    n_stages = p * v
                    if len(names[1]) < n_stages or (schedule == "interleaved-1f1b" and n_mb % p):
                        continue
                    if fixed is not None and not fixed.allows(mesh.axis_names[axis], p, schedule, n_mb, v):
                        continue
                    for mode, (layers, prefix, suffix) in by_mode.items():
                        choice = _evaluate(layers, prefix, suffix, copies, send, n_stages, p, v, schedule,
                                           n_mb, limit, rejected, mesh.device.asynchronous)
                        if choice is not None:
                            results.append(_replace(_with_place(choice, mesh.axis_names[axis], p, sub_shape),
                                                    layer_prefix=names[0], layer_indices=tuple(names[1]),
                                                    recompute=mode,
                                                    built=problems.get((sub_shape, batch // n_mb))))
                            break   # (modes go from fastest to least memory: the first that fits wins)
            keep_best_problem()
            _progress(done, len(todo), mesh.axis_names[axis], p, n_mb, results, start)

    for axes in (first, tuple(a for a in range(mesh.ndim) if a not in first)):
        if not axes or any(c.axis is not None for c in results):
            break   # (the other axes only when no layout over the stage axes fits)
        search_axes(axes)
    if not results and fixed is not None:
        raise ValueError(f"no pipeline layout of {type(model).__name__} on {mesh} satisfies {fixed} within "
                         f"{limit / 2**30:.2f} GiB per device (rejected: {rejected or 'none'}); the model has "
                         f"{len(base[2][1]) if base else '?'} repeated layers, the batch {batch} rows")
    if not results:
        raise ValueError(f"no pipeline or plain layout of {type(model).__name__} fits {limit / 2**30:.2f} GiB "
                         f"per device on {mesh}")
    best = min(results, key=lambda c: (c.step_s, c.n_stages))
    base_step = none.step_s if none is not None else float("inf")
    seconds = time.perf_counter() - start
    best = _replace(best, candidates=len(results), seconds=seconds, no_pipeline_s=base_step, rejected=rejected,
                    plain=problems.get((mesh.shape, batch)))
    log.info("%s (searched %d layouts in %.2fs)", best, len(results), seconds)
    return best


def stage_problem(model, mesh, example_inputs, example_kwargs, mixed_precision, sub_shape, mb_size) -> Built:
    """The traced and costed problem of one stage candidate: the model on a sub-mesh of
    `mesh` shaped `sub_shape` (same links), for a microbatch of `mb_size` rows.  Pipeline
    stages gather their ZeRO-3 weights one by one (autopar/runtime/pipelined.py): only the whole
    mesh's candidate prices them grouped."""
    sub = Mesh(sub_shape, mesh.axis_names, device=mesh.device, bandwidth=mesh.bandwidth, latency=mesh.latency)
    batch = batch_size(example_inputs, example_kwargs)
    args, kwargs = first_microbatch((tuple(example_inputs), example_kwargs), batch, mb_size)
    return build_problem(model, sub, args, kwargs, mixed_precision, tuple(sub_shape) == tuple(mesh.shape))


def _stage_axes(mesh) -> tuple:
    """The axes the search cuts into device groups (see the module docstring)."""
    if "pp" in mesh.axis_names:
        return (mesh.axis_names.index("pp"),)
    across = tuple(a for a, inside in enumerate(mesh.inside_node(mesh.shape, mesh.device.devices_per_node))
                   if not inside)
    return across or tuple(range(mesh.ndim))


def _candidates(mesh, batch, axes, fixed, microbatches) -> list:
    """(axis, groups p, microbatches) of every candidate that cuts one of `axes`."""
    return [(axis, p, n_mb) for axis, size in enumerate(mesh.shape) if axis in axes
            for p in (d for d in range(2, size + 1) if size % d == 0)
            if fixed is None or fixed.allows(mesh.axis_names[axis], p, None, None, None)
            for n_mb in _microbatch_counts(batch, p, microbatches)]


def _candidate_keys(mesh, batch, axes, fixed, microbatches) -> list:
    """(sub-mesh shape, microbatch rows) each candidate over `axes` is costed at, once each."""
    return list(dict.fromkeys((tuple(s // p if a == axis else s for a, s in enumerate(mesh.shape)), batch // n_mb)
                              for axis, p, n_mb in _candidates(mesh, batch, axes, fixed, microbatches)))


def _trace_and_cost(model, example_inputs, example_kwargs, mixed_precision, keys, workers, costs_for,
                    cost_cache: dict) -> None:
    """Trace and cost `keys` (the whole batch's first) into cost_cache with costs_for, on the
    cores this process may use (autopar/solve/forked.py).  This process exports the whole batch
    and a forked one the largest other microbatch size, at the same time; each sends the
    other its trace's outline, from which with its own it writes every other size
    (autopar/trace/rebatch.py: 0.07 s against 0.6 s for an export of llama3-8b).  Further
    processes write every size from the two outlines.  Microbatch sizes are dealt as in
    _deal; the whole batch's stays here, the exported size's with the process that
    exported it.  With one worker or one size: the whole batch traced, the search's loop
    costs the keys in turn."""
    batch = keys[0][1]
    whole = (model, example_inputs, example_kwargs or {}, mixed_precision)
    groups = _groups(keys)
    lanes = min(worker_count(workers), len(groups))
    if lanes < 2:
        planning_trace(*whole)
        return
    size = max(s for s in groups if s != batch)
    shares = _deal(groups, lanes, {0: groups[batch], 1: groups[size]})

    def cost(share):
        return _cost_share(costs_for, share)

    def here(peers):
        start = time.perf_counter()
        mine = pickle.dumps(exported_outlines(planning_trace(*whole)))
        for peer in peers:
            peer.send(mine)
        if len(peers) > 1:   # (the processes beyond the first need its outline now)
            theirs = peers[0].recv()
            for peer in peers[1:]:
                peer.send(theirs)
        got = cost(shares[0][:1])   # (the whole batch needs nothing from the others)
        if len(peers) == 1:
            theirs = peers[0].recv()
        if theirs is not None:
            adopt_outlines(pickle.loads(theirs))
        got.update(cost(shares[0][1:]))
        log.info("pipeline search: the whole batch and %d other microbatch sizes traced and %d candidate "
                 "sub-problems costed by this process and %d workers in %.1fs", len(groups) - 1, len(keys),
                 lanes - 1, time.perf_counter() - start)
        return got

    def there(k, peer):
        if k == 1:
            try:
                traced = planning_trace(model, *first_microbatch((tuple(example_inputs), example_kwargs), batch,
                                                                 size), mixed_precision)
                peer.send(pickle.dumps(exported_outlines(traced)))
            except Exception:   # (costed below, where the error is raised again and reported)
                peer.send(None)
            got = cost(shares[1][:1])   # (its own size needs nothing from the others)
            found = [peer.recv()]
        else:
            got, found = {}, [peer.recv(), peer.recv()]
        for outlines in found:
            if outlines is not None:
                adopt_outlines(pickle.loads(outlines))
        got.update(cost(shares[k][1:] if k == 1 else shares[k]))
        return got

    for got in forked_lanes(here, there, lanes):
        cost_cache.update(got)   # (this process's share is cached already)


def _cost_share(costs_for, share) -> dict:
    """{key: costs_for(*key)} over a share's groups (_deal)."""
    return {key: costs_for(*key) for group in share for key in group}


def _groups(keys) -> dict:
    """Microbatch rows -> the keys of that size (one trace serves them), in order."""
    out: dict = {}
    for key in keys:
        out.setdefault(key[1], []).append(key)
    return out


def _deal(groups: dict, lanes: int, placed: dict) -> list:
    """Shares of `lanes` processes, each a list of groups (_groups): `placed` (lane -> group)
    first, the others largest first, each to the least loaded process.  A group weighs one
    per key, plus 0.2 for writing its trace (autopar/trace/rebatch.py); the whole batch's (the
    first group: it is solved once more) two per key, and a placed group no more."""
    shares = [[] for _ in range(lanes)]
    loads = [0.0] * lanes
    first = next(iter(groups))
    for lane, group in placed.items():
        shares[lane].append(group)
        loads[lane] += len(group) * (2.0 if group is groups[first] else 1.0)
    for group in sorted((g for g in groups.values() if not any(g is p for p in placed.values())),
                        key=lambda g: -len(g)):
        lane = loads.index(min(loads))
        loads[lane] += len(group) + 0.2
        shares[lane].append(group)
    return shares


def _cost_in_parallel(keys, workers, costs_for, cost_cache: dict) -> None:
    """Cost `keys` into cost_cache with costs_for in forked processes (autopar/solve/forked.py),
    once this process has the traces every size is written from: groups of one microbatch
    size dealt by _deal.  This process keeps the problems of its own share.  Nothing here
    (the search's loop costs them in turn) with one worker or one group."""
    groups = _groups(keys)
    lanes = min(worker_count(workers), len(groups))
    if lanes < 2:
        return
    start = time.perf_counter()
    for got in forked_map(lambda share: _cost_share(costs_for, share), _deal(groups, lanes, {}), lanes):
        cost_cache.update(got)   # (this process's share is cached already)
    log.info("pipeline search: %d candidate sub-problems costed by this process and %d workers in %.1fs",
             len(keys), lanes - 1, time.perf_counter() - start)


def _progress(done, total, axis, p, n_mb, results, start) -> None:
    """One INFO line per sub-mesh and microbatch size searched: how far, the best so far."""
    best = min(results, key=lambda c: (c.step_s, c.n_stages)) if results else None
    what = "none fits yet" if best is None else (
        f"best so far {best.step_s * 1e3:.1f} ms ("
        + (f"{best.n_stages} stages over {best.axis}, {best.schedule}, {best.n_microbatches} microbatches"
           if best.axis is not None else "no pipeline") + ")")
    log.info("pipeline search: %d of %d sub-meshes x microbatch counts costed (%s split in %d, %d microbatches); "
             "%d layouts fit; %s; %.1fs", done, total, axis, p, n_mb, len(results), what, time.perf_counter() - start)


def _replace(c: PipelineChoice, **kw) -> PipelineChoice:
    return dataclasses.replace(c, **kw)


def _with_place(c: PipelineChoice, axis: str, p: int, sub_shape) -> PipelineChoice:
    return _replace(c, axis=axis, n_groups=p, submesh=tuple(sub_shape))


def _evaluate(layers, prefix, suffix, copies, send, n_stages, p, v, schedule, n_mb, limit, rejected,
              overlap=False):
    """Cut the layers into n_stages, simulate the schedule, check memory.  copies: the model
    states the last stage holds again (weights tied to the first stage's).  send: one
    activation's (or gradient's) trip across a cut.  The schedules post sends without
    waiting for them; on an asynchronous device (overlap) a send delays only the stage that
    receives it (the simulated dependency's latency) while the sender computes on; on CPU
    ranks the transfer runs on the cores the compute uses and adds to both."""
    paid = 0.0 if overlap else send
    units = [c.forward_s + c.backward_s for c in layers]
    cuts = _balanced_cuts(units, n_stages, units and (prefix.forward_s + prefix.backward_s),
                          suffix.forward_s + suffix.backward_s)
    fwd, bwd, once, acts, work = [], [], [], [], []
    held_states = {k: [] for k in ("params", "grads", "optimizer")}
    for s, (a, b) in enumerate(cuts):
        members = layers[a:b] + ([prefix] if s == 0 else []) + ([suffix, copies] if s == n_stages - 1 else [])
        fwd.append(sum(c.forward_s for c in members) + (paid if s < n_stages - 1 else 0.0))
        bwd.append(sum(c.backward_s for c in members) + (paid if s > 0 else 0.0))
        once.append(sum(c.once_s for c in members))
        for k, kept in held_states.items():
            kept.append(sum(getattr(c, k) for c in members))
        acts.append(sum(c.activations for c in members))
        work.append(max(c.working for c in members))
    ratio = sum(bwd) / max(sum(fwd), 1e-30)
    if v > 1:  # group g holds stages g, g + p, ...: its chunks' times add up
        group_f = [sum(fwd[g::p]) for g in range(p)]
        tl = simulate(schedule, p, n_mb, stage_times=group_f, backward_ratio=ratio, n_virtual=v,
                      comm_time=send - paid)
    else:
        tl = simulate(schedule, n_stages, n_mb, stage_times=fwd, backward_ratio=ratio, comm_time=send - paid)
    memory, group_memory = [], []
    for g in range(p):
        held = tl.max_in_flight(g)
        mine = range(g, n_stages, p)
        parts = {k: sum(kept[s] for s in mine) for k, kept in held_states.items()}
        parts["activations"] = max(acts[s] for s in mine) * held
        parts["working"] = max(work[s] for s in mine)
        group_memory.append(parts)
        memory.append(sum(parts.values()))
    if max(memory) > limit:
        rejected["over the memory budget"] = rejected.get("over the memory budget", 0) + 1
        return None
    group_once = [sum(once[s] for s in range(g, n_stages, p)) for g in range(p)]
    step = tl.makespan + max(group_once)
    return PipelineChoice(None, p, (), tuple(cuts), schedule, n_mb, v, step, tl.bubble_fraction,
                          tuple(f + b for f, b in zip(fwd, bwd)), tuple(memory), group_memory=tuple(group_memory),
                          send_s=send, sends_overlap=overlap)


def _balanced_cuts(units, n_stages, head, tail):
    """Contiguous runs of layers minimising the slowest stage (stage 0 also carries `head`,
    the last `tail`): dynamic programme over (stages used, layers placed)."""
    n = len(units)
    prefix = [0.0]
    for u in units:
        prefix.append(prefix[-1] + u)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    back = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                t = prefix[j] - prefix[i] + (head if s == 1 else 0.0) + (tail if s == n_stages else 0.0)
                cand = max(best[s - 1][i], t)
                if cand < best[s][j] - 1e-15:
                    best[s][j], back[s][j] = cand, i
    cuts, j = [], n
    for s in range(n_stages, 0, -1):
        i = back[s][j]
        cuts.append((i, j))
        j = i
    return cuts[::-1]


def _microbatch_counts(batch: int, p: int, wanted) -> list:
    if wanted is not None:
        return [m for m in wanted if batch % m == 0]
    counts = [m for m in (2 * p, 4 * p) if m <= batch and batch % m == 0]  # B = p leaves a large bubble
    return counts or ([p] if batch % p == 0 else [])


def _layer_costs(built: Built, model, time_limit, modes=("none",)):
    """Plan the built problem by its summed optimum (kept in `built.summed`: the stage costs
    below add up the plan's seconds, so that is the plan they price best) and split the plan's
    costs per repeated layer: ({mode: (layers, prefix, suffix)}, boundary bytes, (layer
    prefix, indices), tied copies), or None when nothing fits.  Under a recompute mode
    (every repeated layer alike) a layer keeps what recompute.ModeCosts says, its backward
    runs again the forward of the ops it does not keep, and its working memory includes
    what it makes again."""
    problem = built.problem
    try:
        choice, _, _ = solve_unbudgeted(built, time_limit, summed=True)
    except InfeasibleError:
        return None
    nodes, collectives, _, _ = assemble(problem, choice)
    if not problem.layer_groups:
        raise ValueError(f"{type(model).__name__} has no repeated layers (modules named like blocks.0, "
                         f"blocks.1, ...) to cut into pipeline stages")
    prefix_name, indices = max(problem.layer_groups, key=lambda g: len(g[1]))
    pattern = re.compile(re.escape(prefix_name) + r"\.(\d+)(\.|$)")
    once: dict = {}
    params = {pn.param_name for pn in problem.nodes if pn.kind == "param"}
    for c in collectives:  # per-step collectives: gradients of parameters, the optimizer's gathers
        if (c.phase == "backward" and c.tensor in params) or c.phase == "step":
            once[c.node] = once.get(c.node, 0.0) + c.seconds
    n_layers = len(indices)
    position = {i: k for k, i in enumerate(sorted(indices))}
    keys, forward = {}, {}   # node index -> its bucket; op -> the forward seconds it runs per microbatch
    buckets = {k: [0.0] * 8 for k in ["prefix", "suffix", "copies", *range(n_layers)]}
    seen_layer = False
    for idx in sorted(nodes):
        pn = problem.nodes[idx]
        n = nodes[idx]
        m = pattern.match(n.module or "")
        if m and int(m.group(1)) in position:
            key = position[int(m.group(1))]
            seen_layer = seen_layer or pn.kind == "op"
        elif pn.kind == "param":
            key = "prefix" if _first_reader_before_layers(problem, pn, pattern) else "suffix"
        else:
            key = "suffix" if seen_layer else "prefix"
        keys[idx] = key
        b = buckets[key]
        c = problem.choices[pn.rep][choice[idx]]
        total = n.compute_s + n.comm_s
        o = once.get(n.name, 0.0) + ((once.get(n.module, 0.0) + n.compute_s) if pn.kind == "param" else 0.0)
        per_mb = max(total - o, 0.0)
        bwd_share = 2.0 / 3.0 if pn.requires_grad else 0.0
        f = per_mb * (1 - bwd_share)
        b[1] += per_mb * bwd_share
        b[0] += f
        forward[idx] = f if pn.kind == "op" else 0.0
        b[2] += o
        b[3] += c.memory["params"]
        b[4] += c.memory["grads"]
        b[5] += c.memory["optimizer"]
        b[6] += c.memory["activations"]
        b[7] = max(b[7], c.work if pn.kind == "op" else 0.0)
        if key == "prefix" and pn.kind == "param" and _read_after_layers(problem, pn, pattern):
            for k, kind in ((3, "params"), (4, "grads"), (5, "optimizer")):  # a tied head: the last
                buckets["copies"][k] += c.memory[kind]                       # stage holds it too
    boundary = _boundary_bytes(problem, choice, position, pattern)
    by_mode = {}
    for mode in modes:
        got = {k: list(b) for k, b in buckets.items()}
        if mode != "none":
            costs = ModeCosts(problem, {f"{prefix_name}.{i}": mode for i in indices})
            layer = layer_paths(problem)
            remade = costs.remade(problem, choice)
            for b in got.values():
                b[6] = 0.0
            for idx, key in keys.items():
                b = got[key]
                kept = costs.keeps.get(idx)
                b[6] += 0.0 if kept is None else float(kept[choice[idx]])
                path = layer.get(idx)
                if path in costs.modes and problem.nodes[idx].kind == "op":
                    if not (mode == "selective" and kept_by_selective(problem, problem.nodes[idx])):
                        b[1] += forward[idx]   # backward runs its forward again
                    work = problem.choices[problem.nodes[idx].rep][choice[idx]].work
                    b[7] = max(b[7], float(work + remade[path]))
        by_mode[mode] = ([StageCost(*got[k]) for k in range(n_layers)], StageCost(*got["prefix"]),
                         StageCost(*got["suffix"]))
    return by_mode, boundary, (prefix_name, sorted(indices)), StageCost(*buckets["copies"])


def _first_reader_before_layers(problem, pn, pattern) -> bool:
    """A parameter outside the layers belongs to the prefix if it is read before any layer
    (embeddings; a tied head reads it again at the end: the prefix owns it)."""
    readers = [r for r, _ in problem.readers.get((pn.index, 0), [])]
    if not readers:
        return True
    first = min(readers)
    return not any(problem.nodes[r].kind == "op" and pattern.match(problem.nodes[r].module or "")
                   for r in range(first))


def _read_after_layers(problem, pn, pattern) -> bool:
    """Whether a parameter is also read after the last repeated layer (a head tied to the
    input embedding): the last stage then holds a copy of it."""
    readers = [r for r, _ in problem.readers.get((pn.index, 0), [])]
    layer_ops = [i for i, n in enumerate(problem.nodes) if n.kind == "op" and pattern.match(n.module or "")]
    return bool(readers and layer_ops) and max(readers) > max(layer_ops)


def _boundary_bytes(problem, choice, position, pattern) -> float:
    """Bytes per device of the tensor that flows from one layer into the next (the largest
    such tensor: the residual stream)."""
    best = 0.0
    for pn in problem.nodes:
        m = pattern.match(pn.module or "")
        if pn.kind != "op" or not m:
            continue
        for src, out in pn.inputs:
            sm = pattern.match(problem.nodes[src].module or "")
            if sm and sm.group(1) != m.group(1):
                s = problem.nodes[src]
                layout = problem.nodes[s.rep].strategies[choice[src]].outputs[out]
                nbytes = local_numel(s.out_shapes[out], layout, problem.mesh.shape) * s.out_dtypes[out].itemsize
                best = max(best, nbytes)
    return best

