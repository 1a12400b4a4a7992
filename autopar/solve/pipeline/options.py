"""What the pipeline search ranges over (autopar/solve/pipeline/search.py): the schedules,
what the user fixed (Pipeline), and the candidates: a mesh axis cut into device groups and
a microbatch count, each costed at one (sub-mesh shape, microbatch rows) key.

Which axes: a mesh with an axis named "pp" is pipelined on it, as given; otherwise the
axes that cross nodes (stages across nodes leave the fast links inside a stage, where
tensor parallelism needs them), and every axis of a mesh inside one node; the other axes
too when no layout over those fits the budget.  autopar.Pipeline(axis=...) names any axis.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from autopar.cost.schedules import ASYNCHRONOUS, SCHEDULES, V_SHAPED, least_microbatches
from autopar.mesh import Mesh

# The schedules a pipeline may run: the simulator's (autopar.cost.schedules.SCHEDULES), less
# "naive" (one microbatch at a time, which no runtime schedule runs).
SCHEDULE_CHOICES = tuple(s for s in SCHEDULES if s != "naive")
DATA_AXES = ("dp", "data", "fsdp", "zero", "ddp", "batch")   # axis names that split a stage's rows


@dataclass(frozen=True)
class Pipeline:
    """What to fix of the pipeline layout; a field left None is searched.

        autopar.plan(model, mesh, x, pipeline=autopar.Pipeline(axis="dp", groups=2, schedule="1f1b"))

    axis: the mesh axis cut into device groups; groups: how many (stages = groups x
    virtual); schedule: one of SCHEDULE_CHOICES; microbatches: per step (dividing the batch);
    virtual: stages per group (interleaved-1f1b: searched; zbv, dualpipev: always 2, placed as
    a V; chimera: 1, each stage held by two groups, one per direction); asynchronous: allow
    schedules that never flush the pipeline between steps, so that each step's gradient is
    taken at the weights one step older than those it updates (PipeDream-2BW: W(t+1) = W(t)
    - lr grad f(W(t-1))); off by default, since it changes what training computes.  With any
    constraint the result is pipelined even where no pipeline would be faster."""

    axis: str | None = None
    groups: int | None = None
    schedule: str | None = None
    microbatches: int | None = None
    virtual: int | None = None
    asynchronous: bool = False

    def check(self, mesh) -> None:
        """Raise ValueError naming the field that cannot hold on `mesh`."""
        if self.axis is not None and self.axis not in mesh.axis_names:
            raise ValueError(f"Pipeline(axis={self.axis!r}): the mesh's axes are {mesh.axis_names}")
        if self.schedule is not None and self.schedule not in SCHEDULE_CHOICES:
            raise ValueError(f"Pipeline(schedule={self.schedule!r}): choose one of {SCHEDULE_CHOICES}")
        if self.schedule in ASYNCHRONOUS and not self.asynchronous:
            raise ValueError(f"Pipeline(schedule={self.schedule!r}) trains with weights one step stale (each step's "
                             f"gradient taken at the weights before the last update); pass "
                             f"Pipeline(schedule={self.schedule!r}, asynchronous=True) to allow it")
        if self.schedule in V_SHAPED and self.virtual not in (None, 2):
            raise ValueError(f"Pipeline(virtual={self.virtual}): {self.schedule} runs two stages per device group, "
                             f"placed as a V (group g holds stages g and 2p-1-g); leave virtual unset")
        elif self.virtual not in (None, 1) and self.schedule not in (None, "interleaved-1f1b", *V_SHAPED):
            raise ValueError(f"Pipeline(virtual={self.virtual}): only interleaved-1f1b runs several stages "
                             f"per device group, not {self.schedule}")
        if self.schedule == "chimera" and self.groups is not None and (
                self.groups % 2 or (self.microbatches or self.groups) % self.groups):
            raise ValueError(f"Pipeline(schedule='chimera', groups={self.groups}, microbatches={self.microbatches}): "
                             f"chimera runs an even number of device groups (its two pipelines meet in the middle) "
                             f"and a multiple of groups as microbatches (half of each unit down, half up)")
        if self.groups is not None and self.microbatches is not None:
            least = least_microbatches(self.schedule, self.groups)
            if self.microbatches < least:
                raise ValueError(f"Pipeline(schedule={self.schedule!r}, groups={self.groups}, "
                                 f"microbatches={self.microbatches}): {self.schedule} runs at least one microbatch "
                                 f"per stage ({least} stages); give microbatches >= {least}")
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
class Cut:
    """One candidate: mesh axis `axis` cut into `groups` device groups, the batch into
    `microbatches`."""

    axis: int
    groups: int
    microbatches: int

    def sub_shape(self, mesh: Mesh) -> tuple:
        """Each device group's mesh shape."""
        return tuple(s // self.groups if a == self.axis else s for a, s in enumerate(mesh.shape))


@dataclass(frozen=True)
class SearchSpace:
    """The search's settings: the mesh, the global batch, the memory limit per device, the
    schedules and microbatch counts to try (None: 2p, 4p and one row each for p groups), what the user
    fixed, and the recompute modes the stages may take (fastest first)."""

    mesh: Mesh
    batch: int
    limit: float
    schedules: tuple
    microbatches: tuple | None
    fixed: Pipeline | None
    modes: tuple

    @property
    def whole(self) -> tuple:
        """The key of the plan without stages: the whole batch on the whole mesh."""
        return tuple(self.mesh.shape), self.batch

    def key(self, cut: Cut) -> tuple:
        """(sub-mesh shape, microbatch rows) a candidate is costed at."""
        return cut.sub_shape(self.mesh), self.batch // cut.microbatches

    def first_axes(self) -> tuple:
        """The axes cut first (see the module docstring); every axis when the user fixed
        the axis (the candidates then keep only that one)."""
        mesh = self.mesh
        if self.fixed is not None and self.fixed.axis is not None:
            return tuple(range(mesh.ndim))
        if "pp" in mesh.axis_names:
            return (mesh.axis_names.index("pp"),)
        across = tuple(a for a, inside in enumerate(mesh.inside_node(mesh.shape, mesh.device.devices_per_node))
                       if not inside)
        return across or tuple(range(mesh.ndim))

    def cuts(self, axes) -> list[Cut]:
        """Every candidate that cuts one of `axes`."""
        mesh, fixed = self.mesh, self.fixed
        return [Cut(axis, p, n_mb) for axis, size in enumerate(mesh.shape) if axis in axes
                for p in (d for d in range(2, size + 1) if size % d == 0)
                if fixed is None or fixed.allows(mesh.axis_names[axis], p, None, None, None)
                for n_mb in self.microbatch_counts(p, axis)]

    def keys(self, axes) -> list:
        """The keys the candidates over `axes` are costed at, once each, in order."""
        return list(dict.fromkeys(self.key(cut) for cut in self.cuts(axes)))

    def microbatch_counts(self, p: int, axis: int | None = None) -> list:
        """2p and 4p microbatches, and microbatches of one row per data-parallel rank of the
        stage (the least activation memory in flight and the smallest bubble, what
        Megatron-LM runs at scale, Narayanan et al. 2021): the stage's axes named for data
        parallelism (DATA_AXES) split its rows, the others (tensor parallelism) do not; so does
        what is left inside a stage of the cut axis where it is named "pp" (a stage problem
        may keep it for data alone: problem/menus.stage_data_axes) or for data (llama3-8b on
        dp 8 x tp 8 cut in 2 took 64 one-row microbatches on 4 data ranks, 4x slower than
        its best pipeline, not 16 of 4 rows).  Without that remainder, DeepSeek-V3's
        2 stages of 16 x 8 x 8 on 256 rows took microbatches of 8 rows, which no data-parallel
        menu on 16 x 8 ranks can split: its full menus, a CP-SAT model of 1.1 million
        variables, were 300 of the search's 341 s."""
        if self.microbatches is not None:
            return [m for m in self.microbatches if self.batch % m == 0]
        counts = [m for m in (2 * p, 4 * p) if m <= self.batch and self.batch % m == 0]  # B = p: a large bubble
        names = self.mesh.axis_names
        rows = math.prod(n for a, (n, name) in enumerate(zip(self.mesh.shape, names))
                         if a != axis and name.lower() in DATA_AXES)
        if axis is not None and (names[axis] == "pp" or names[axis].lower() in DATA_AXES):
            rows *= self.mesh.shape[axis] // p
        if self.batch % rows == 0 and self.batch // rows > 4 * p:
            counts.append(self.batch // rows)
        return counts or ([p] if self.batch % p == 0 else [])

    def virtuals(self, schedule: str, layers: int = 0, groups: int = 1) -> tuple:
        """Stages per device group to try under `schedule`: under interleaved 1F1B one and
        two, and three or four where that many stages split the `layers` evenly over the
        `groups` (Korthikanti et al. 2022 ran GPT-530B's 105 layers over 35 groups as 3)."""
        if schedule in V_SHAPED:
            return (2,)
        if schedule != "interleaved-1f1b":
            return (1,)
        if self.fixed is not None and self.fixed.virtual:
            return (self.fixed.virtual,)
        return (1, 2) + tuple(v for v in (3, 4) if layers and layers % (groups * v) == 0)
