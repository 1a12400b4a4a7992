"""The fastest plan under one recompute assignment that fits the memory budget: identical
layers alike (period 1) or alternating (period 2), the ILP's budget lowered by what the
plan needs beyond its linear memory sum until a plan fits with its own.

The recompute search (autopar/solve/recompute/search.py) calls solve_modes once per
assignment; the overlap re-solve (autopar/solve/overlap.py) once more per discount.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.solve.ilp.formulation import InfeasibleError, Solution, solve
from autopar.solve.problem.problem import Problem
from autopar.solve.recompute.modes import ModeCosts, beyond_linear, mode_costs
from autopar.solve.ilp.reduce import reduce_problem
from autopar.solve.ilp.solved import Assignment, SolveOptions, Solved

RESERVE_TRIES = 8   # budgets the reserve is raised through before no plan is said to fit


def solve_modes(problem: Problem, rule, budget, options: SolveOptions, modes=None, *, periods=(1, 2),
                minimise_memory=False, reserve: float = 0.0, costs: ModeCosts | None = None,
                reduced: dict | None = None) -> Solved:
    """The fastest plan under these modes (layer path -> mode; None: every layer keeps its
    activations) whose states, activations and working memory fit `budget` together.  The
    ILP sums a linear estimate; what the plan found needs beyond it (Solved.beyond) depends
    on the plan, so the budget the ILP sees is lowered by that much until a plan fits with
    its own.  reserve: where that lowering starts (another solve's Solved.beyond: other
    recompute modes need about as much); a start too high for any plan falls back to zero.
    reduced: period -> reduce_problem(problem, rule, period, costs), filled as it goes."""
    if costs is None and modes:
        costs = mode_costs(problem, modes)
    reduced = {} if reduced is None else reduced
    start = reserve = max(0.0, reserve)
    for _ in range(RESERVE_TRIES):
        left = None if budget is None else budget - reserve
        if left is not None and left <= 0:
            break
        try:
            found = _solve_periods(problem, rule, left, options, minimise_memory, modes, periods, costs, reduced)
        except InfeasibleError:
            if reserve != start or not start:
                raise
            start = reserve = 0.0
            continue
        extra = beyond_linear(problem, found.choice, costs)[2]
        if budget is None or minimise_memory or found.memory + extra <= budget:
            return dataclasses.replace(found, memory=found.memory + extra, beyond=extra)
        reserve = max(reserve, extra)
    raise InfeasibleError("no assignment of strategies fits the memory budget with its working memory")


def _solve_periods(problem: Problem, rule, budget, options: SolveOptions, minimise_memory, modes, periods, costs,
                   reduced) -> Solved:
    """The best of `periods` (memory: the ILP's linear sum only); period 2 only where the
    period-1 plan reshards between consecutive layers."""
    best = None
    for period in periods:
        if period not in reduced:
            reduced[period] = reduce_problem(problem, rule, period, costs)
        red = reduced[period]
        try:
            if minimise_memory:
                sol = least_memory(red, options)
            else:
                sol = solve(red.costs, red.edges, red.memory, budget, red.allowed, time_limit=options.time_limit,
                            tiebreak=red.plain_memory)
        except InfeasibleError:
            if period != periods[-1] and problem.tie:
                continue
            if best is not None:
                break
            raise
        found = Solved(expand(problem, red, sol, modes), sol, ilp_bytes(red, sol.choice))
        if best is None or found.faster_than(best):
            best = found
        if not problem.tie or not moves_between_layers(problem, found.choice):
            break
    return best


def least_memory(red, options: SolveOptions) -> Solution:
    """The choice needing the least memory: the ILP memory sum plus the working memory of
    the busiest op.  With no edges to price, each cap T on one op's working memory leaves
    every node its least-memory choice among those under T; the best T is among the
    smallest caps every node can meet (the first 64 distinct values above that bound)."""
    allowed = [np.asarray(a, bool) for a in red.allowed]
    work = [np.where(a, w, np.inf) for a, w in zip(allowed, red.work)]
    floor = max((float(w.min()) for w in work), default=0.0)
    caps = np.unique(np.concatenate([w[(w >= floor) & np.isfinite(w)] for w in work] or [np.zeros(1)]))[:64]
    best_total, best_masks = None, None
    for cap in caps:
        masks = [a & (w <= cap) for a, w in zip(allowed, work)]
        total = cap + sum(float(np.where(m, mem, np.inf).min()) for m, mem in zip(masks, red.memory))
        if best_total is None or total < best_total:
            best_total, best_masks = total, masks
    return solve(red.memory, [], None, None, best_masks if best_masks is not None else red.allowed,
                 time_limit=options.time_limit)


def priced_solve(red, price: float, options: SolveOptions) -> tuple[Solution, float]:
    """(solution, its ILP bytes) of the reduced problem with no budget and each byte priced
    at `price` seconds, without the memory tie-break (its objective is seconds + price x
    bytes, exactly)."""
    priced = red.costs if price == 0 else [np.asarray(c, float) + price * np.asarray(m, float)
                                           for c, m in zip(red.costs, red.memory)]
    sol = solve(priced, red.edges, red.memory, None, red.allowed, time_limit=options.time_limit,
                tiebreak=[np.zeros(len(c)) for c in red.costs])
    return sol, ilp_bytes(red, sol.choice)


def ilp_bytes(red, choice) -> float:
    """The ILP's linear memory sum of a choice of the reduced problem."""
    return float(sum(red.memory[i][c] for i, c in enumerate(choice)))


def expand(problem: Problem, red, sol: Solution, modes) -> Assignment:
    """The Assignment over every node of a solution of the reduced problem `red`."""
    root_choice = dict(zip(red.roots, sol.choice))
    picks = {}
    for pn in problem.nodes:
        r = red.canon(pn.rep)
        picks[pn.index] = int(red.follow[r][root_choice[red.root_of[r]]])
    return Assignment(picks, modes)


def moves_between_layers(problem: Problem, choice: dict) -> bool:
    """Whether a tensor travelling from one repeated layer to the next is resharded on the
    way (directly, or through ops that sit between the layers)."""
    spans = {}
    for n, (prefix, _) in problem.block.items():
        if problem.nodes[n].kind == "op":
            lo, hi = spans.get(prefix, (n, n))
            spans[prefix] = (min(lo, n), max(hi, n))

    def inside(n):
        return any(lo <= n <= hi for lo, hi in spans.values())

    for e in problem.edges:
        if e.kind != "data" or problem.nodes[e.a].kind != "op":
            continue
        a, b = problem.block.get(e.a), problem.block.get(e.b)
        if (a or b) and a != b and inside(e.a) and inside(e.b) and \
                problem.edge_costs[problem.rep_edge(e)][choice[e.a], choice[e.b]] > 0:
            return True
    return False
