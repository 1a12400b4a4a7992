"""The ILP: one strategy per node, minimising step time under a per-device memory budget.

Alpa's formulation, solved with OR-Tools CP-SAT: a one-hot choice per node, and per edge a
one-hot choice over pairs (source layout class, destination layout class) tied to the two
node choices.  Costs are scaled to integers first.  Before any variable is made, an exact
presolve (ilp/presolve.py) folds what no ILP is needed for into node costs: separable and
single-choice edges, dominated and duplicate choices, nodes that dynamic programming
eliminates (chains, leaves, pairs of nodes joined into one).  Without a binding memory
budget that usually leaves nothing: a transformer graph is solved by elimination alone,
and a 3-axis mesh (menus of ~125 layouts, edges of ~15,000 pairs) costs no ILP.  What it
leaves goes to CP-SAT, each edge shrunk to its distinct rows and columns.  The search is
single-threaded and stopped by deterministic time, so the same inputs always give the
same plan.

The model's three constraint families, each built by its own function (_solve_ilp writes
the formulation out): one-hot choices (_one_hot_choices), edge consistency
(_edge_consistency: an edge's pair variables agree with its two nodes' choices) and the
memory budget (_memory_budget).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from autopar.solve.ilp.presolve import InfeasibleError, Presolve, distinct

log = logging.getLogger("autopar")


# Among plans of equal predicted time, prefer the one that needs less memory: each byte per
# device adds this many seconds to the objective (1 GiB = 10 us, far below any real step
# time difference, enough to break exact ties such as Megatron's column/row pairs against
# all-gathered column layers, which move the same bytes).
MEMORY_TIE_BREAK = 1e-5 / 2**30

# CP-SAT stops once its plan is within this fraction of the best bound it has proved.  Under
# a tight memory budget (gpt-tiny on 2 CPU ranks at 1 MiB) it found the optimum at once and
# then spent five minutes closing the last 0.005 % of the gap; a plan 1e-5 from optimal is
# 10 ns on a 1 ms step.
RELATIVE_GAP = 1e-5
# Where the memory budget is a constraint, the problem is a knapsack and proving the last
# 0.1 % takes minutes even on a small graph: gpt-tiny on a 2x2 mesh with states on host and
# disk (51 nodes) found its optimum early, then spent 70 s proving it to 1e-5; at 1e-3 it
# stops after 14 s with the same plan.  0.1 % of the step is far inside the cost model's own
# error (docs/PERFORMANCE.md).
BUDGET_GAP = 1e-3


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
    slack: bool = False     # the fastest plan with no budget fits it: the budget does not bind

    def __str__(self) -> str:
        state = "optimal" if self.optimal else f"feasible, gap {self.gap:.2%}"
        return (f"ILP {state}: {self.variables} variables, {self.constraints} constraints, "
                f"solved in {self.seconds:.2f}s")


# Internal switch, for tests: off, the ILP is built over every allowed choice (separable edges
# folded, the rest shrunk to distinct rows and columns), as before the presolve existed, so
# a test can check that the presolve keeps the optimum.
PRESOLVE = True


def solve(costs, edges, memory=None, budget=None, allowed=None, *, time_limit=60.0, tiebreak=None) -> Solution:
    """costs[n][i]: seconds of node n under choice i.  edges: (u, v, matrix[i][j]) seconds.
    memory[n][i]: bytes; the sum over nodes of the chosen memory must stay <= budget.
    allowed[n]: a boolean mask of the choices node n may take (None: all).
    tiebreak[n][i]: the bytes the memory tie-break weighs (default: memory); ZeRO variants
    weigh as their stage-0 layout, so states are sharded only when the budget needs it.

    Times are solved in integers (the sum of the nodes' largest costs and edges' largest
    entries scaled to 1e9), memory in units of budget / 1e9 rounded up per term."""
    start = time.perf_counter()
    n_nodes = len(costs)
    if memory is not None:
        weigh = memory if tiebreak is None else tiebreak
        costs = [np.asarray(c, float) + MEMORY_TIE_BREAK * np.asarray(m, float) for c, m in zip(costs, weigh)]
    costs = [np.asarray(c, dtype=float) for c in costs]
    allowed = [np.ones(len(c), bool) if allowed is None or allowed[n] is None else np.asarray(allowed[n], bool)
               for n, c in enumerate(costs)]
    for n in range(n_nodes):
        if not allowed[n].any():
            raise InfeasibleError(f"node {n} has no allowed strategy")
    edges = [(u, v, np.asarray(m, dtype=float)) for u, v, m in edges]
    cap = mem_units = None
    if budget is not None and memory is not None:
        # memory in units of budget / 1e9; each term rounded up, so the constraint is never
        # looser than the budget and at most ~1e-9 of it stricter per node
        unit = max(float(budget), 1.0) / 1e9
        mem_units = [np.ceil(np.asarray(m, float) / unit - 1e-9) for m in memory]
        cap = int(budget / unit)
    if PRESOLVE:
        scale = _scale([np.where(a, c, 0.0) for a, c in zip(allowed, costs)], [m for _, _, m in edges])
        ilp = _solve_presolved([np.round(c * scale) for c in costs],
                               [(u, v, np.round(m * scale)) for u, v, m in edges], mem_units, cap, allowed, time_limit)
        slack = ilp.slack
    else:
        folded, kept = _fold_edges(costs, edges)
        finite = [np.where(allowed[n], folded[n], 0.0) for n in range(n_nodes)]
        scale = _scale(finite, [m for _, _, m, _, _ in kept])
        ilp = _solve_ilp([np.round(c * scale) for c in folded],
                         [(u, v, np.round(m * scale), r, c) for u, v, m, r, c in kept], mem_units, cap, allowed,
                         time_limit)
        slack = budget is None
    obj, bound, optimal = ilp.objective / scale, ilp.bound / scale, ilp.optimal
    sol = Solution(tuple(int(i) for i in ilp.choice), obj, bound, optimal,
                   0.0 if optimal or obj == 0 else max(0.0, (obj - bound) / obj),
                   ilp.variables, ilp.constraints, time.perf_counter() - start, slack)
    log.info("%s", sol)
    return sol


def _solve_presolved(costs, edges, memory, cap, allowed, time_limit) -> "_Solved":
    """solve() on integer costs through Presolve, objective and bound in integer units;
    slack: the fastest plan ignoring memory fits.

    Under a memory budget the problem is first presolved without it: when the fastest
    plan ignoring memory fits anyway, it is the answer (no plan under the budget can be
    faster), and the budget costs no ILP."""
    start = time.perf_counter()
    if memory is not None:
        free = Presolve(costs, edges, None, None, allowed)
        free.run()
        if not free.cost:
            choice = free.expand({})
            if sum(memory[n][i] for n, i in enumerate(choice)) <= cap:
                log.info("presolve: %s; the fastest plan fits the memory budget (%.2fs)", free,
                         time.perf_counter() - start)
                return _Solved(choice, free.offset, free.offset, True, slack=True)
    pre = Presolve(costs, edges, memory, cap, allowed)
    pre.run()
    log.info("presolve: %s (%.2fs)", pre, time.perf_counter() - start)
    nodes = sorted(pre.cost)
    index = {n: k for k, n in enumerate(nodes)}
    kept = []
    for (u, v), m in pre.edges.items():
        rows, row_of = distinct(m, 0)
        cols, col_of = distinct(rows, 1)
        kept.append((index[u], index[v], cols, row_of, col_of))
    binding = pre.mem is not None
    ilp = _solve_ilp([pre.cost[n] for n in nodes], kept, [pre.mem[n] for n in nodes] if binding else None,
                     cap - pre.mem_offset if binding else None, None, time_limit)
    choice = pre.expand({n: int(pre.keep[n][i]) for n, i in zip(nodes, ilp.choice)})
    return _Solved(choice, ilp.objective + pre.offset, ilp.bound + pre.offset, ilp.optimal, ilp.variables,
                   ilp.constraints, memory is None)


def _scale(costs, matrices) -> float:
    """Seconds -> integer objective units: the largest conceivable total maps to ~1e9."""
    ref = sum(float(c.max(initial=0)) for c in costs) + sum(float(m[np.isfinite(m)].max(initial=0)) for m in matrices)
    return 1e9 / ref if ref > 0 else 1.0


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


@dataclass(frozen=True)
class _Solved:
    """What the CP-SAT model (or the presolve alone) gives, in integer objective units:
    the choice per node, the objective and its proven bound, whether optimal, the model's
    size, and whether the fastest plan ignoring memory fits (slack)."""

    choice: list
    objective: float
    bound: float
    optimal: bool
    variables: int = 0
    constraints: int = 0
    slack: bool = False


def _solve_ilp(costs, kept, memory, cap, allowed, time_limit) -> _Solved:
    """The CP-SAT model over integer costs c, edge matrices M and memories m:

        minimise   sum_n sum_i c[n][i] x[n][i]  +  sum_(u,v) sum_(r,k) M[r, k] e[u,v][r, k]
        subject to one-hot choices      sum_i x[n][i] = 1                 for every node n
                   edge consistency     sum_k e[u,v][r, k] = sum_(i in row class r) x[u][i]
                                        sum_r e[u,v][r, k] = sum_(j in column class k) x[v][j]
                                                                          for every kept edge
                   memory budget        sum_n sum_i m[n][i] x[n][i] <= cap

    x[n][i]: node n takes choice i (only allowed choices get a variable); e[u,v][r, k]: the
    edge's source is in row class r and its destination in column class k (equal rows and
    columns of M merged, finite pairs only).  An empty problem is solved without CP-SAT."""
    if not costs:
        return _Solved([], 0.0, 0.0, True)
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x = _one_hot_choices(model, costs, allowed)
    objective = [int(c[i]) * v for n, c in enumerate(costs) for i, v in enumerate(x[n]) if v is not None and int(c[i])]
    for u, v, m, row_of, col_of in kept:
        objective.extend(_edge_consistency(model, x, u, v, m, row_of, col_of))
    if cap is not None:
        _memory_budget(model, x, memory, cap)
    model.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    # The LP relaxation of the pair formulation is strong; add it whole, up front, and skip
    # probing: on transformer graphs this proves optimality many times faster.  The pairs'
    # one-hot rows make millions of binary clauses, which the SAT engine's inprocessing
    # (vivification, subsumption) spends most of a budgeted solve on: off, llama3-70b's
    # recompute assignments on 1,024 devices solve 2-4x faster to the same optimum.
    solver.parameters.linearization_level = 2
    solver.parameters.add_lp_constraints_lazily = False
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.use_sat_inprocessing = False
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.relative_gap_limit = RELATIVE_GAP if cap is None else BUDGET_GAP
    solver.parameters.random_seed = 0
    status = _solve_within(solver, model, time_limit)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise InfeasibleError("no assignment of strategies fits the memory budget")
    choice = [next(i for i, v in enumerate(xs) if v is not None and solver.Value(v)) for xs in x]
    proto = model.Proto()
    return _Solved(choice, solver.ObjectiveValue(), solver.BestObjectiveBound(), status == cp_model.OPTIMAL,
                   len(proto.variables), len(proto.constraints))


def _solve_within(solver, model, time_limit: float):
    """CP-SAT's status on `model` within `time_limit` deterministic seconds; where the limit
    ends the search before any assignment is found (UNKNOWN: not proven infeasible), the
    search runs again with the limit doubled, up to 16 times it (at least 4 s), with a
    warning, so that a short limit still yields a plan.  Raises SearchTimeout beyond."""
    from ortools.sat.python import cp_model

    limit = time_limit
    status = solver.Solve(model)
    while status == cp_model.UNKNOWN and limit < max(16 * time_limit, 4.0):
        limit = max(2 * limit, 0.25)
        log.warning("the ILP found no assignment within time_limit=%g s (deterministic); searching on to %g s. "
                    "Raise the time limit (autopar.plan(..., solve=SolveOptions(time_limit=...))) to skip this",
                    time_limit, limit)
        solver.parameters.max_deterministic_time = limit
        status = solver.Solve(model)
    if status == cp_model.UNKNOWN:
        raise SearchTimeout(f"the ILP found no assignment of strategies within {limit:g} deterministic seconds "
                            f"(time_limit={time_limit:g}, extended {limit / time_limit:g}x): raise time_limit")
    return status


class SearchTimeout(RuntimeError):
    """The ILP's search ended by its time limit before it found any plan (not an infeasible
    budget: the limit is too short for the problem)."""


def _one_hot_choices(model, costs, allowed) -> list:
    """One-hot choices: a boolean x[n][i] per allowed choice i of node n (None where not
    allowed), exactly one true per node."""
    x = []
    for n, c in enumerate(costs):
        vs = [model.NewBoolVar(f"x{n}_{i}") if allowed is None or allowed[n][i] else None for i in range(len(c))]
        model.AddExactlyOne([v for v in vs if v is not None])
        x.append(vs)
    return x


def _edge_consistency(model, x, u, v, m, row_of, col_of) -> list:
    """Edge consistency of one kept edge (u, v) with matrix m over (row class, column
    class): a boolean per finite pair whose sums over a row class equal that class's
    source choices and over a column class its destination choices, so exactly the pair of
    the two nodes' choices is true.  Returns its objective terms."""
    pairs, objective = {}, []
    row_members, col_members = {}, {}
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
            if int(m[r, c]):
                objective.append(int(m[r, c]) * e)
    for r, members in row_members.items():
        model.Add(sum(pairs[(r, c)] for c in col_members if (r, c) in pairs) == sum(members))
    for c, members in col_members.items():
        model.Add(sum(pairs[(r, c)] for r in row_members if (r, c) in pairs) == sum(members))
    return objective


def _memory_budget(model, x, memory, cap) -> None:
    """The memory budget: the chosen memories (integer units of budget / 1e9) sum to at most cap."""
    terms = [int(memory[n][i]) * v for n in range(len(x)) for i, v in enumerate(x[n])
             if v is not None and int(memory[n][i])]
    model.Add(sum(terms) <= int(cap))


def evaluate(costs, edges, choice) -> float:
    """The objective of a given assignment, in seconds (used by tests and reports)."""
    total = sum(float(costs[n][i]) for n, i in enumerate(choice))
    for u, v, m in edges:
        total += float(np.asarray(m)[choice[u], choice[v]])
    return total
