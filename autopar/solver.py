"""The ILP: one strategy per node, minimising step time under a per-device memory budget.

Alpa's formulation, solved with OR-Tools CP-SAT: a one-hot choice per node, and per edge a
one-hot choice over pairs (source layout class, destination layout class) tied to the two
node choices.  Before any variable is made, each edge matrix is shrunk to its distinct rows
and columns, and a matrix that splits into a row part plus a column part is folded into the
node costs, so only edges whose cost really couples two choices cost variables.
Costs are scaled to integers; the search is single-threaded and stopped by deterministic
time, so the same inputs always give the same plan.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("autopar")


# Among plans of equal predicted time, prefer the one that needs less memory: each byte per
# device adds this many seconds to the objective (1 GiB = 10 us, far below any real step
# time difference, enough to break exact ties such as Megatron's column/row pairs against
# all-gathered column layers, which move the same bytes).
MEMORY_TIE_BREAK = 1e-5 / 2**30


class InfeasibleError(ValueError):
    """No plan fits the memory budget."""


@dataclass(frozen=True)
class Solution:
    choice: tuple           # chosen index per variable node
    objective: float        # seconds (from the integer objective, unscaled)
    bound: float            # best lower bound proven, seconds
    optimal: bool
    gap: float              # (objective - bound) / objective
    variables: int
    constraints: int
    seconds: float

    def __str__(self) -> str:
        state = "optimal" if self.optimal else f"feasible, gap {self.gap:.2%}"
        return (f"ILP {state}: {self.variables} variables, {self.constraints} constraints, "
                f"solved in {self.seconds:.2f}s")


def _fold_edges(costs, edges):
    """Fold separable edge matrices into node costs; keep the rest shrunk to distinct rows/cols."""
    costs = [np.asarray(c, dtype=float).copy() for c in costs]
    kept = []
    for u, v, m in edges:
        m = np.asarray(m, dtype=float)
        if not np.isfinite(m).all():  # forbidden pairs: keep the edge, its pairs leave them out
            rows, row_of = np.unique(m, axis=0, return_inverse=True)
            cols, col_of = np.unique(rows, axis=1, return_inverse=True)
            kept.append((u, v, cols, row_of.reshape(-1), col_of.reshape(-1)))
            continue
        if u == v:
            costs[u] += np.diag(m)
            continue
        base = m[0:1, :] + m[:, 0:1] - m[0, 0]
        if np.allclose(m, base, rtol=1e-12, atol=1e-15 + 1e-12 * float(np.abs(m).max(initial=0))):
            costs[u] += m[:, 0] - m[0, 0]
            costs[v] += m[0, :]
            continue
        rows, row_of = np.unique(m, axis=0, return_inverse=True)
        cols, col_of = np.unique(rows, axis=1, return_inverse=True)
        kept.append((u, v, cols, row_of.reshape(-1), col_of.reshape(-1)))
    return costs, kept


def solve(costs, edges, memory=None, budget=None, allowed=None, *, time_limit=60.0, tiebreak=None) -> Solution:
    """costs[n][i]: seconds of node n under choice i.  edges: (u, v, matrix[i][j]) seconds.
    memory[n][i]: bytes; the sum over nodes of the chosen memory must stay <= budget.
    allowed[n]: a boolean mask of the choices node n may take (None: all).
    tiebreak[n][i]: the bytes the memory tie-break weighs (default: memory); ZeRO variants
    weigh as their stage-0 layout, so states are sharded only when the budget needs it."""
    from ortools.sat.python import cp_model

    start = time.perf_counter()
    n_nodes = len(costs)
    if memory is not None:
        weigh = memory if tiebreak is None else tiebreak
        costs = [np.asarray(c, float) + MEMORY_TIE_BREAK * np.asarray(m, float) for c, m in zip(costs, weigh)]
    costs, kept = _fold_edges(costs, edges)
    allowed = [np.ones(len(c), bool) if allowed is None or allowed[n] is None else np.asarray(allowed[n], bool)
               for n, c in enumerate(costs)]
    for n in range(n_nodes):
        if not allowed[n].any():
            raise InfeasibleError(f"node {n} has no allowed strategy")
    finite = [np.where(allowed[n], costs[n], 0.0) for n in range(n_nodes)]
    scale_ref = sum(float(f.max(initial=0)) for f in finite) + sum(
        float(m[np.isfinite(m)].max(initial=0)) for _, _, m, _, _ in kept)
    scale = 1e9 / scale_ref if scale_ref > 0 else 1.0  # keep the integer objective below ~1e9·a few

    model = cp_model.CpModel()
    x = []
    for n in range(n_nodes):
        vs = []
        for i in range(len(costs[n])):
            if allowed[n][i]:
                vs.append(model.NewBoolVar(f"x{n}_{i}"))
            else:
                vs.append(None)
        model.AddExactlyOne([v for v in vs if v is not None])
        x.append(vs)
    objective = []
    for n in range(n_nodes):
        for i, v in enumerate(x[n]):
            if v is not None:
                c = int(round(costs[n][i] * scale))
                if c:
                    objective.append(c * v)
    for u, v, m, row_of, col_of in kept:
        pairs = {}
        row_members = {}
        col_members = {}
        for i, r in enumerate(row_of):
            if x[u][i] is not None:
                row_members.setdefault(int(r), []).append(x[u][i])
        for j, c in enumerate(col_of):
            if x[v][j] is not None:
                col_members.setdefault(int(c), []).append(x[v][j])
        for r in row_members:
            for c in col_members:
                if not np.isfinite(m[r, c]):
                    continue
                e = model.NewBoolVar(f"e{u}_{v}_{r}_{c}")
                pairs[(r, c)] = e
                w = int(round(m[r, c] * scale))
                if w:
                    objective.append(w * e)
        for r, members in row_members.items():
            model.Add(sum(pairs[(r, c)] for c in col_members if (r, c) in pairs) == sum(members))
        for c, members in col_members.items():
            model.Add(sum(pairs[(r, c)] for r in row_members if (r, c) in pairs) == sum(members))
    if budget is not None and memory is not None:
        # memory in units of budget / 1e9; each term rounded up, so the constraint is never
        # looser than the budget and at most ~1e-9 of it stricter per node
        unit = max(float(budget), 1.0) / 1e9
        terms = []
        for n in range(n_nodes):
            for i, v in enumerate(x[n]):
                if v is not None:
                    b = int(np.ceil(memory[n][i] / unit - 1e-9))
                    if b:
                        terms.append(b * v)
        model.Add(sum(terms) <= int(budget / unit))
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    # The LP relaxation of the pair formulation is strong; add it whole, up front, and skip
    # probing: on transformer graphs this proves optimality many times faster.
    solver.parameters.linearization_level = 2
    solver.parameters.add_lp_constraints_lazily = False
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError("no assignment of strategies fits the memory budget")
    choice = []
    for n in range(n_nodes):
        choice.append(next(i for i, v in enumerate(x[n]) if v is not None and solver.Value(v)))
    proto = model.Proto()
    obj = solver.ObjectiveValue() / scale
    bound = solver.BestObjectiveBound() / scale
    optimal = status == cp_model.OPTIMAL
    sol = Solution(tuple(choice), obj, bound, optimal,
                   0.0 if optimal or obj == 0 else max(0.0, (obj - bound) / obj),
                   len(proto.variables), len(proto.constraints), time.perf_counter() - start)
    log.info("%s", sol)
    return sol


def evaluate(costs, edges, choice) -> float:
    """The objective of a given assignment, in seconds (used by tests and reports)."""
    total = sum(float(costs[n][i]) for n, i in enumerate(choice))
    for u, v, m in edges:
        total += float(np.asarray(m)[choice[u], choice[v]])
    return total
