"""The solve layer's records: what a solve is asked with (SolveOptions), what it returns
(Solved: a choice per node, the ILP's solution, the memory the plan needs), and the
choice itself (Assignment: a strategy per node and the layers it recomputes).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.solve.ilp.formulation import Solution


@dataclass(frozen=True)
class SolveOptions:
    """How hard and on how many cores to solve, given once at the face (autopar.plan) and
    passed down whole.  time_limit: CP-SAT's deterministic seconds per ILP (the search is
    stopped by deterministic time, so the same inputs give the same plan); workers:
    processes that solve recompute assignments and cost pipeline candidates at once (None:
    $AUTOPAR_WORKERS, else the cores this process may use; autopar/solve/forked.py).  The
    plan is the same for any number of workers."""

    time_limit: float = 60.0
    workers: int | None = None

    def __str__(self) -> str:
        workers = "the usable cores" if self.workers is None else f"{self.workers} processes"
        return f"ILP time limit {self.time_limit:g} s, on {workers}"


class Assignment(dict):
    """Node index -> chosen strategy index (every node of the Problem, each layer on its
    own), and `modes`: the recomputed layers (layer path -> "selective" or "full";
    autopar/solve/recompute.py), given when it is made."""

    def __init__(self, picks=(), modes: dict | None = None):
        super().__init__(picks)
        self.modes = {k: v for k, v in (modes or {}).items() if v != "none"}


@dataclass(frozen=True)
class Solved:
    """One solve's answer.  choice: the strategy of every node (an Assignment); solution:
    the ILP's (objective seconds, bound, size, time) of the reduced problem it came from;
    memory: bytes per device the plan needs, the ILP's linear sum plus `beyond`; beyond:
    what it needs past that sum (recompute.beyond_linear: the working memory of its busiest
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
