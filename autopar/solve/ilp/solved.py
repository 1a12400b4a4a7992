"""The solve layer's records: what a solve is asked with (SolveOptions), what it returns
(Solved: a choice per node, the ILP's solution, the memory the plan needs), and the
choice itself (Assignment: a strategy per node and the layers it recomputes).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from autopar.solve.ilp.formulation import Solution


@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    """How to search for the plan (autopar.plan(solve=...)), passed down whole.

    time_limit: CP-SAT's deterministic seconds per ILP (the search is stopped by
    deterministic time, so the same inputs give the same plan; a search that runs out is
    given longer, autopar/solve/ilp/formulation.py).  workers: processes that solve recompute
    assignments and cost pipeline candidates at once (None: $AUTOPAR_WORKERS, else the
    cores this process may use; autopar/solve/forked.py); the plan is the same for any
    number.  compare: also solve within each hand-written layout (data parallel, ZeRO-3,
    Megatron, ...) for the plan's comparison table (plan.compare); False skips those ILPs.
    layout: instead of the best plan, the best plan within one hand-written layout (a name
    from `autopar.solve.layouts.layouts(mesh)`, e.g. "data-parallel"); with a pipeline, the
    layout of the stages' plan."""

    time_limit: float = 60.0
    workers: int | None = None
    compare: bool = True
    layout: str | None = None

    def __post_init__(self):
        limit = self.time_limit
        if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"autopar.SolveOptions(time_limit={limit!r}): CP-SAT's deterministic seconds per ILP, a "
                             f"positive number (60 is the default; small models solve in well under a second)")
        workers = self.workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"autopar.SolveOptions(workers={workers!r}): processes that plan at once, a whole number "
                             f"of at least 1, or None for $AUTOPAR_WORKERS or else the usable cores")
        if not isinstance(self.compare, bool):
            raise ValueError(f"autopar.SolveOptions(compare={self.compare!r}): True also solves the hand-written "
                             f"layouts for plan.compare, False skips them")
        if self.layout is not None and not isinstance(self.layout, str):
            raise ValueError(f"autopar.SolveOptions(layout={self.layout!r}): the name of a hand-written layout "
                             f"(autopar.solve.layouts.layouts(mesh): e.g. 'data-parallel', 'megatron-tp'), or None")

    def __str__(self) -> str:
        workers = "the usable cores" if self.workers is None else f"{self.workers} processes"
        return f"ILP time limit {self.time_limit:g} s, on {workers}"


class Assignment(dict):
    """Node index -> chosen strategy index (every node of the Problem, each layer on its
    own), and `modes`: the recomputed layers (layer path -> "selective" or "full";
    autopar/solve/recompute/modes.py), given when it is made."""

    def __init__(self, picks=(), modes: dict | None = None):
        super().__init__(picks)
        self.modes = {k: v for k, v in (modes or {}).items() if v != "none"}


@dataclass(frozen=True)
class Solved:
    """One solve's answer.  choice: the strategy of every node (an Assignment); solution:
    the ILP's (objective seconds, bound, size, time) of the reduced problem it came from;
    memory: bytes per device the plan needs, the ILP's linear sum plus `beyond`; beyond:
    what it needs past that sum (recompute/modes.beyond_linear: the working memory of its busiest
    op or recomputed layer, activations counted storage by storage), where the next solve
    of the same problem starts its working-memory reserve.  kept: where this plan recomputes
    layers, the plan the same budget fits keeping every activation (when one fits), whose
    summed objective lost but whose overlap may still win (overlap.solve_problem)."""

    choice: Assignment
    solution: Solution
    memory: float
    beyond: float = 0.0
    kept: "Solved | None" = None

    @property
    def objective(self) -> float:
        """The ILP objective in seconds (summed: overlap not counted)."""
        return self.solution.objective

    def faster_than(self, other: "Solved | None") -> bool:
        """Whether this plan's objective beats `other`'s by more than rounding (None: no plan yet)."""
        return other is None or self.objective < other.objective * (1 - 1e-9)

    def __str__(self) -> str:
        modes = "/".join(sorted(set(self.choice.modes.values()))) or "none"
        return (f"plan of {self.objective * 1e3:.4g} ms (summed), {self.memory / 2**30:.2f} GiB per device "
                f"({self.beyond / 2**30:.2f} GiB beyond the ILP's sum), recompute {modes}; {self.solution}")
