"""What a problem is priced for beyond the model and mesh (Pricing), and the table in which
a problem and its pieces remember what they derive (Remembered)."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from autopar.cost import prices as C
from autopar.mesh import Mesh


class Pricing(NamedTuple):
    """What a problem is priced for beyond the model and mesh: moe_imbalance, the busiest
    expert rank's load over the mean (a number, or {ways: factor} measured; None: uniformly
    random routing, C.routing_imbalance), the backend the plan runs under ("inductor":
    chains of memory-bound ops priced as fused, see autopar/solve/fusion.py), and the
    micro-steps that accumulate gradients for each optimizer step (`cm.no_sync()` around all
    but the last): what runs once per step, the optimizer step, ZeRO-1/2's gathers after it
    and the bucketed gradient reductions (grad_sync's all-reduces and ZeRO-2
    reduce-scatters), is priced at 1/accumulation of its seconds per micro-step, and a
    ZeRO-2 parameter keeps its whole local gradient between micro-steps (`once`).
    tp_overlap: whether the runtime runs tensor-parallel collectives beside their GEMMs
    (runtime/linear_grads.py; False: priced whole, as a runtime without that overlap runs
    them)."""

    moe_imbalance: float | dict | None = None
    backend: str = "eager"
    accumulation: int = 1
    tp_overlap: bool = True

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
