"""One pipeline candidate evaluated (autopar/solve/pipeline/search.py): cut the layers into
stages, run the schedule through the simulator, check memory; and the record of what the
search chose (PipelineChoice), from which the plan's PipelineLayout is built.

Cuts.  Layers are the units: stage s holds a contiguous run of layers, the first stage also
the prefix, the last the suffix.  For S stages the cuts minimise the slowest stage (the
bubble and the steady state both scale with it; a dynamic programme over layer counts).

Schedule.  Each (p, S, schedule, microbatches) candidate is run through the simulator
(autopar.cost.schedules) with the stage times: the step is its makespan plus the slowest
group's once-per-step work (gradient synchronisation, the optimizer's step and gathers);
on an asynchronous device each group starts that work when its own last pass ends, its
synchronisation hidden behind that pass up to its length (step_seconds).  Crossing a cut costs the boundary activation (and
its gradient) over the cut axis.  Memory per device: the stage's model states plus its
activations per microbatch times the microbatches it holds in flight (GPipe: all of them;
1F1B: S - s), which must fit the budget.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from autopar.cost.schedules import (ASYNCHRONOUS, TWO_WAY, V_SHAPED, folds_tp, group_stages, makespan_floor,
                                    simulate_step)
from autopar.mesh import Mesh
from autopar.report.plan import PipelineLayout, Prediction
from autopar.solve.pipeline.costs import STATES, LayerCosts, StageParts
from autopar.solve.built import Built


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
    recompute: str = "none"    # what every repeated layer keeps for backward (autopar/solve/recompute/modes.py)
    built: Built | None = field(default=None, compare=False, repr=False)  # the problem of one stage's plan
    plain: Built | None = field(default=None, compare=False, repr=False)  # the unpipelined problem (whole batch)
    send_s: float = 0.0           # one activation's (or gradient's) trip across a cut
    sends_overlap: bool = False   # sends delay only their receiver (asynchronous devices)
    stage_layout: str | None = None   # the hand-written layout the stages were priced in (None: the free plan)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def rank(self) -> tuple:
        """The order the search picks by: fastest step, then fewest stages."""
        return self.step_s, self.n_stages

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
                + ("" if self.recompute == "none" else "; every layer's activations offloaded to host memory"
                   if self.recompute == "offload" else f"; every layer recomputed ({self.recompute})")
                + (f"; stages laid out as {self.stage_layout}" if self.stage_layout else "")
                + ("; asynchronous: no flush between steps, each step's gradient taken at the weights one "
                   "update older (PipeDream-2BW)" if self.schedule in ASYNCHRONOUS else "")
                + (f"; each send across a cut {self.send_s * 1e3:.2f} ms, "
                   + ("overlapped with the sender's compute" if self.sends_overlap else "added to both stages")
                   if self.send_s else ""))

    def layout(self, full_mesh: Mesh, summary: str | None = None) -> PipelineLayout:
        """The plan's PipelineLayout of this choice (summary: str(self) unless given)."""
        return PipelineLayout(axis=self.axis, groups=self.n_groups, submesh=tuple(self.submesh),
                              stages=tuple(tuple(s) for s in self.stages), schedule=self.schedule,
                              microbatches=self.n_microbatches, virtual=self.n_virtual, step_s=self.step_s,
                              no_pipeline_step_s=self.no_pipeline_s, bubble=self.bubble,
                              stage_s=tuple(self.stage_s), memory=tuple(self.memory), full_mesh=full_mesh,
                              summary=str(self) if summary is None else summary, layer_prefix=self.layer_prefix,
                              layer_indices=tuple(self.layer_indices), group_memory=tuple(self.group_memory),
                              candidates=self.candidates, send_s=self.send_s, sends_overlap=self.sends_overlap)

    def unpipelined(self, mesh: Mesh, predicted: Prediction) -> "PipelineChoice":
        """This search's record with the plan without stages kept instead: one group on the
        whole mesh holding every layer, at `predicted` (that plan's) step and memory."""
        step = predicted.step_s
        return dataclasses.replace(self, axis=None, n_groups=1, submesh=tuple(mesh.shape), stage_layout=None,
                                   stages=((0, len(self.layer_indices)),), schedule="none", n_microbatches=1,
                                   n_virtual=1, step_s=step, no_pipeline_s=step, bubble=0.0, stage_s=(step,),
                                   memory=(predicted.memory_total,), group_memory=(dict(predicted.memory),))


def plain_choices(costs: LayerCosts | None, mesh: Mesh, built: Built | None) -> list[PipelineChoice]:
    """The plan without stages under each recompute mode (the whole batch on the whole mesh)."""
    out = []
    for mode, parts in (costs.by_mode.items() if costs is not None else ()):
        members = parts.members
        step = sum(c.forward_s + c.backward_s + c.once_s - c.folded_forward - c.folded_backward for c in members)
        held = {k: sum(getattr(c, k) for c in members) for k in (*STATES, "activations")}
        held["working"] = max(c.working for c in members)
        mem = sum(held.values())
        out.append(PipelineChoice(None, 1, mesh.shape, ((0, len(parts.layers)),), "none", 1, 1, step, 0.0, (step,),
                                  (mem,), group_memory=(held,), recompute=mode, built=built))
    return out


SLOWER = "slower"   # what evaluate returns for a candidate that cannot beat the best found


def _stages(parts: StageParts, copies, send, n_stages, overlap, schedule: str = "1f1b") -> tuple:
    """The layers cut into n_stages (balanced_cuts; v_cuts where a device group runs stages
    g and n_stages-1-g) and each stage's forward, backward and once-per-step seconds, model
    states, activations and working bytes.  Under a V-shaped schedule or chimera the last
    stage runs on the first stage's device group, so weights tied between them are held
    once (no copies)."""
    layers, prefix, suffix = parts.layers, parts.prefix, parts.suffix
    v_shaped = schedule in V_SHAPED + TWO_WAY
    paid = 0.0 if overlap else send
    fold = folds_tp(schedule)   # (the stages' tensor-parallel collectives beside their GEMMs)
    def seconds(c):
        return c.forward_s + c.backward_s - (c.folded_forward + c.folded_backward if fold else 0.0)
    units = [seconds(c) for c in layers]
    cut = v_cuts if v_shaped else balanced_cuts
    cuts = cut(units, n_stages, units and seconds(prefix), seconds(suffix))
    fwd, bwd, once, acts, work, host, sync = [], [], [], [], [], [], []
    held_states = {k: [] for k in (*STATES, "synced_grads")}   # (synced_grads: not held beside the rest)
    for s, (a, b) in enumerate(cuts):
        last = [suffix] if v_shaped else [suffix, copies]
        members = list(layers[a:b]) + ([prefix] if s == 0 else []) + (last if s == n_stages - 1 else [])
        fwd.append(sum(c.forward_s - (c.folded_forward if fold else 0.0) for c in members)
                   + (paid if s < n_stages - 1 else 0.0))
        bwd.append(sum(c.backward_s - (c.folded_backward if fold else 0.0) for c in members)
                   + (paid if s > 0 else 0.0))
        once.append(sum(c.once_s for c in members))
        sync.append(sum(c.sync_s for c in members))
        for k, kept in held_states.items():
            kept.append(sum(getattr(c, k) for c in members))
        acts.append(sum(c.activations for c in members))
        work.append(max(c.working for c in members))
        host.append(sum(c.host for c in members))
    return cuts, fwd, bwd, once, held_states, acts, work, host, sync


def _hides_sync(schedule: str, overlap: bool) -> bool:
    """Whether a device group's gradient buckets run beside its last backward and after it
    while the other groups drain (an asynchronous device; not the stream of steps of an
    asynchronous schedule, nor chimera's two pipelines, whose copies sum after the step)."""
    return overlap and schedule not in ASYNCHRONOUS and schedule not in TWO_WAY


def step_seconds(tl, group_once: list, group_sync: list, hides: bool) -> float:
    """A candidate's step from its simulated schedule `tl` (cost.schedules.Step): the
    makespan and then the slowest group's once-per-step work; where `hides` (an
    asynchronous device) each device group starts its once-per-step work when its own last
    pass ends, the runtime's buckets having gone out during that pass (runtime/pipeline/pipelined:
    buckets open for each stage's last backward), so the group's gradient synchronisation
    hides behind that pass up to its length, and a group that ends early (the last stage
    of 1F1B ends its last backward while the first stages drain) runs it in its idle time."""
    if not hides or not tl.ends:
        return tl.makespan + max(group_once)
    return max(tl.makespan, max(end + once - min(sync, last)
                                for end, once, sync, last in zip(tl.ends, group_once, group_sync, tl.last)))


def floor(parts: StageParts, copies, send, n_stages, p, n_mb, overlap=False, schedule: str = "1f1b") -> float:
    """The fastest any schedule could run this candidate: no device group runs its passes
    faster than one after another, then its once-per-step work (of which, where the
    gradients' synchronisation may hide, what is not synchronisation).  The search
    simulates candidates in order of it and stops where it exceeds the best step found."""
    _, fwd, bwd, once, _, _, _, _, sync = _stages(parts, copies, send, n_stages, overlap, schedule)
    ratio = sum(bwd) / max(sum(fwd), 1e-30)   # (the simulator runs backward at this share of forward)
    mine = [group_stages(g, p, n_stages, schedule) for g in range(p)]
    share = 0.5 if schedule in TWO_WAY else 1.0   # (chimera: each copy of a stage runs half the microbatches)
    if _hides_sync(schedule, overlap):
        return max(share * n_mb * sum(fwd[s] for s in m) * (1 + ratio) + sum(once[s] - sync[s] for s in m)
                   for m in mine)
    return (share * n_mb * max(sum(fwd[s] for s in m) for m in mine) * (1 + ratio)
            + max(sum(once[s] for s in m) for m in mine))


def evaluate(parts: StageParts, copies, send, n_stages, p, v, schedule, n_mb, limit,
             overlap=False, beat: float = float("inf"), transfer=None,
             host_limit: float = 0.0) -> PipelineChoice | None | str:
    """Cut the layers into n_stages, simulate the schedule, check memory (None: over the
    limit; SLOWER: the schedule's closed-form bound, makespan_floor, already loses to `beat`
    seconds, so it is not simulated).  copies: the model states the last stage holds again
    (weights tied to the first stage's).  send: one activation's (or gradient's) trip
    across a cut.  The schedules post sends without waiting for them; on an asynchronous
    device (overlap) a send delays only the stage that receives it (the simulated
    dependency's latency) while the sender computes on; on CPU ranks the transfer runs on
    the cores the compute uses and adds to both.  transfer(nbytes): seconds to move nbytes
    between two device groups (chimera: device groups g and p-1-g sum the gradients of the
    two stages both hold, once per step).  host_limit: host memory per device (0: unbounded),
    which offloaded activations of the microbatches in flight must fit."""
    cuts, fwd, bwd, once, held_states, acts, work, host, sync = _stages(parts, copies, send, n_stages, overlap,
                                                                        schedule)
    paid = 0.0 if overlap else send
    ratio = sum(bwd) / max(sum(fwd), 1e-30)
    groups = [group_stages(g, p, n_stages, schedule) for g in range(p)]
    group_once = [sum(once[s] for s in mine) for mine in groups]
    group_sync = [sum(sync[s] for s in mine) for mine in groups]
    hides = _hides_sync(schedule, overlap)
    if schedule in TWO_WAY:
        move = transfer or (lambda nbytes: 0.0)
        group_once = [t + move(sum(held_states["synced_grads"][s] for s in mine))
                      for t, mine in zip(group_once, groups)]
    del held_states["synced_grads"]
    if v > 1:  # group g holds stages g, g + p, ... (V-shaped: g and 2p-1-g): its chunks' times add up
        group_f = [sum(fwd[s] for s in mine) for mine in groups]
        shape = (schedule, p, n_mb, group_f)
    else:
        shape = (schedule, n_stages, n_mb, fwd)
    how = dict(backward_ratio=ratio, n_virtual=v, comm_time=send - paid)
    # (a closed-form bound first, fill and drain included: most candidates lose without a simulation)
    # (where the synchronisation may hide, the rank that ends last still runs the rest)
    after = min(o - y for o, y in zip(group_once, group_sync)) if hides else max(group_once)
    if makespan_floor(*shape, **how) + after > beat * (1 + 1e-9):
        return SLOWER
    tl = simulate_step(*shape, **how)
    memory, group_memory = [], []
    for g in range(p):
        held = tl.in_flight[g]
        mine = groups[g]
        held_parts = {k: sum(kept[s] for s in mine) for k, kept in held_states.items()}
        if schedule in ASYNCHRONOUS:   # two stashed weight versions beside the live ones (runtime/pipeline/flushless.py)
            held_parts["params"] *= 3
        held_parts["activations"] = max(acts[s] for s in mine) * held
        held_parts["working"] = max(work[s] for s in mine)
        group_memory.append(held_parts)
        memory.append(sum(held_parts.values()))
        if host_limit > 0 and max(host[s] for s in mine) * held > host_limit:
            return None
    if max(memory) > limit:
        return None
    step = step_seconds(tl, group_once, group_sync, hides)
    return PipelineChoice(None, p, (), tuple(cuts), schedule, n_mb, v, step, tl.bubble_fraction,
                          tuple(f + b for f, b in zip(fwd, bwd)), tuple(memory), group_memory=tuple(group_memory),
                          send_s=send, sends_overlap=overlap)


def memory_ceiling(parts: StageParts, copies, n_stages, p, v, schedule, n_mb) -> float:
    """The most any device group of this layout could hold, whatever the simulator finds:
    evaluate's memory with every forward a group runs (n_mb per stage it holds) in flight
    at once; the simulator's peak (Timeline.max_in_flight) is never more.  The search asks
    it of a candidate's free plan before pricing the hand-written layouts beside it
    (costs.layer_costs), which can only win where the free plan does not fit."""
    _, _, _, _, held_states, acts, work, _, _ = _stages(parts, copies, 0.0, n_stages, False, schedule)
    most = 0.0
    for g in range(p):
        mine = group_stages(g, p, n_stages, schedule)
        states = sum(sum(held_states[k][s] for s in mine) * (3 if k == "params" and schedule in ASYNCHRONOUS else 1)
                     for k in STATES)
        most = max(most, states + max(acts[s] for s in mine) * n_mb * len(mine) + max(work[s] for s in mine))
    return most


def v_cuts(units, n_stages, head, tail):
    """Contiguous runs of layers for a V-shaped schedule, where device group g runs stages g
    and n_stages-1-g: the cuts that minimise the slowest group's two stages together.  From
    balanced_cuts, each boundary is moved a layer at a time while that lowers the slowest
    group (then the sum of squared group loads); stage 0 carries `head` and the last stage
    `tail`, both on group 0, which so gets fewer layers."""
    return _v_cuts(tuple(units), n_stages, head or 0.0, tail)


@functools.lru_cache(maxsize=4096)
def _v_cuts(units, n_stages, head, tail):
    bounds = [a for a, _ in _balanced_cuts(units, n_stages, head, tail)][1:]   # first layer of stages 1..

    def score(bounds):
        edges = [0, *bounds, len(units)]
        load = [sum(units[a:b]) + (head if s == 0 else 0.0) + (tail if s == n_stages - 1 else 0.0)
                for s, (a, b) in enumerate(zip(edges, edges[1:]))]
        groups = [load[g] + load[n_stages - 1 - g] for g in range(n_stages // 2)]
        return max(groups), sum(x * x for x in groups)

    best = score(bounds)
    improved = True
    while improved:
        improved = False
        for i in range(len(bounds)):
            for step in (-1, 1):
                moved = list(bounds)
                moved[i] += step
                low = moved[i - 1] if i else 0
                high = moved[i + 1] if i + 1 < len(moved) else len(units)
                if not low < moved[i] < high:
                    continue
                got = score(moved)
                if got < best:
                    bounds, best, improved = moved, got, True
    edges = [0, *bounds, len(units)]
    return list(zip(edges, edges[1:]))


def balanced_cuts(units, n_stages, head, tail):
    """Contiguous runs of layers minimising the slowest stage (stage 0 also carries `head`,
    the last `tail`): dynamic programme over (stages used, layers placed); each answer
    remembered (the search asks again for every schedule and microbatch count)."""
    return _balanced_cuts(tuple(units), n_stages, head or 0.0, tail)


@functools.lru_cache(maxsize=4096)
def _balanced_cuts(units, n_stages, head, tail):
    # best[s][j]: the slowest of s stages holding the first j layers.  Over the last stage's
    # first layer i, best[s-1][i] never falls and the last stage's load (layers i..j-1)
    # never rises, so the least max(...) is where they cross: two binary searches per (s,
    # j) instead of a scan, giving the scan's answer (the first i reaching the least value)
    n = len(units)
    prefix = [0.0]
    for u in units:
        prefix.append(prefix[-1] + u)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    back = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        extra = (head if s == 1 else 0.0) + (tail if s == n_stages else 0.0)
        before = best[s - 1]
        for j in range(s, n - (n_stages - s) + 1):
            top = prefix[j]

            def load(i):
                return top - prefix[i] + extra

            lo, hi = s - 1, j   # the first i in [s-1, j) with before[i] >= load(i), or j
            while lo < hi:
                mid = (lo + hi) // 2
                if before[mid] >= load(mid):
                    hi = mid
                else:
                    lo = mid + 1
            cross = lo
            least = min(before[cross] if cross < j else inf, load(cross - 1) if cross > s - 1 else inf)
            value, at = (before[cross], cross) if cross < j else (inf, 0)
            if cross > s - 1 and load(cross - 1) <= least + 1e-15:
                lo, hi = s - 1, cross - 1   # the first i whose load is within rounding of the least
                while lo < hi:
                    mid = (lo + hi) // 2
                    if load(mid) <= least + 1e-15:
                        hi = mid
                    else:
                        lo = mid + 1
                value, at = max(before[lo], load(lo)), lo
            best[s][j], back[s][j] = value, at
    cuts, j = [], n
    for s in range(n_stages, 0, -1):
        i = back[s][j]
        cuts.append((i, j))
        j = i
    return cuts[::-1]
