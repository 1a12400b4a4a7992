"""What a problem is priced for beyond the model and mesh (Pricing), and the table in which
a problem and its pieces remember what they derive (Remembered)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.cost import prices as C
from autopar.mesh import Mesh
from autopar.report.records import check_backend


@dataclass(frozen=True, kw_only=True)
class Pricing:
    """What a plan's step is priced for beyond the model and mesh (autopar.plan(pricing=...);
    the plan records it, and compile runs the step so):

    backend: "eager" (every op reads, writes and launches on its own) or "inductor"
    (compile(run=RunOptions(backend="inductor")): chains of memory-bound ops priced as one
    fused kernel, autopar/solve/problem/fusion.py; views and fused ops issue nothing on the host).

    accumulation: micro-steps per optimizer step, for a job that accumulates gradients
    (`with cm.no_sync():` around all but the last micro-step's backward; the example inputs
    are one micro-step's batch).  What runs once per step, the optimizer step, ZeRO-1/2's
    gathers after it and the bucketed gradient reductions, is priced at 1/accumulation of
    its seconds per micro-step, and a ZeRO-2 parameter keeps its whole local gradient
    between micro-steps (`once`).  Not with pipeline stages, whose microbatches accumulate
    already (Pipeline(microbatches=...)).

    tp_overlap: True runs tensor-parallel collectives beside the GEMMs of their linears
    (passes/fold_linears.py) and prices what that hides on GPUs; False runs and prices them
    whole.

    moe_imbalance: for mixture-of-experts models, the busiest expert-holding rank's routed
    rows over the mean (dropless experts run as long as their busiest rank); "measured"
    runs the model once on the example batch (real tensors) and prices each split by the
    load its ranks would see (the planner turns it into {ways: factor},
    autopar.trace.experts.measure_routing); None prices uniformly random routing
    (autopar.cost.prices.routing_imbalance: close to 1 for large batches)."""

    backend: str = "eager"
    accumulation: int = 1
    tp_overlap: bool = True
    moe_imbalance: float | dict | str | None = None

    def __post_init__(self):
        check_backend(self.backend, where="autopar.Pricing")
        if not isinstance(self.tp_overlap, bool):
            raise ValueError(f"autopar.Pricing(tp_overlap={self.tp_overlap!r}): True runs tensor-parallel collectives "
                             f"beside their GEMMs (and prices it), False runs them whole")
        acc = self.accumulation
        if isinstance(acc, bool) or not isinstance(acc, int) or acc < 1:
            raise ValueError(f"autopar.Pricing(accumulation={acc!r}): give the micro-steps per optimizer step as a "
                             f"whole number of at least 1 (1: every step reduces gradients and steps the optimizer)")
        object.__setattr__(self, "moe_imbalance", _checked_imbalance(self.moe_imbalance))

    @property
    def once(self) -> float:
        """A once-per-step cost's share of one micro-step."""
        return 1.0 / self.accumulation

    def once_per_step(self, steps: tuple) -> tuple:
        """Bucketed steps that run once per optimizer step, each at its share of a micro-step;
        the rest as they are."""
        if self.accumulation == 1:
            return steps
        return tuple(replace(st, seconds=st.seconds * self.once) if st.bucketed else st for st in steps)

    def shared_over_micro_steps(self, seconds):
        """What an edge table saves of a once-per-step bucket's seconds when accumulating: all
        but its share of one micro-step; 0 at 1."""
        return 0.0 if self.accumulation == 1 else seconds * (1.0 - self.once)


class Remembered:
    """`remembered(kind, key, make)`: make(), computed once per problem and (kind, key): what
    planning derives from a problem and asks for again (a recompute assignment's costs, an
    edge's collectives, a holding's bytes per choice).  A problem's overlapped copies share it."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.tables: dict = {}

    def __call__(self, kind: str, key, make):
        table = self.tables.setdefault(kind, {})
        if key not in table:
            table[key] = make()
        return table[key]

    def redistribution(self, shape, itemsize, src, dst) -> tuple:
        """C.redistribute on this problem's mesh, remembered."""
        return self("redistribution", (shape, itemsize, src, dst),
                    lambda: C.redistribute(shape, itemsize, src, dst, self.mesh))


def _checked_imbalance(value):
    """Pricing.moe_imbalance as a float, a {ways: factor} table sorted by ways, "measured"
    or None; a ValueError for anything else."""
    if isinstance(value, dict):   # measured per number of expert-holding ranks
        return dict(sorted(value.items()))
    if value is None or (isinstance(value, str) and value == "measured"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ValueError(f"autopar.Pricing(moe_imbalance={value!r}): give the busiest expert rank's load over the "
                         f"mean load as a number of at least 1 (1.0: perfectly balanced routing; 1.5: the busiest "
                         f"rank gets half again its share), \"measured\" to measure it on the example batch, or "
                         f"None for uniformly random routing")
    return float(value)
