"""The ILP's objective is a sum and cannot see overlap: gradient buckets reduced behind
backward and weight gathers prefetched one op ahead (assemble.hidden_gradient_seconds,
hidden_prefetch_seconds).  solve_problem solves once (recompute/search.solve_summed) and
once more with those shares priced at what the first plan hides, keeping the plan whose
step, overlap counted, is faster; step_lower_bound is what no plan can beat.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from autopar.report.plan import Prediction
from autopar.solve.assemble import predict
from autopar.solve.recompute.fitting import solve_modes
from autopar.solve.ilp.formulation import InfeasibleError, solve
from autopar.solve.problem.problem import Problem
from autopar.solve.recompute.modes import beyond_linear, mode_costs
from autopar.solve.recompute.search import solve_summed
from autopar.solve.ilp.reduce import reduce_problem
from autopar.solve.ilp.solved import SolveOptions, Solved

log = logging.getLogger("autopar")

HIDDEN_AT_LEAST = 0.01   # the share of the step a plan must hide before the second solve is tried
SHARE_ROUNDS = 3         # times the shares are priced again at the plan they gave
SHARES_ALIKE = 0.02      # shares closer than this price alike: the solve would return the same plan


@dataclass(frozen=True)
class HiddenShares:
    """The discounts Problem.overlapped prices with: the share of the gradient buckets and
    the share of the prefetchable weight gathers a plan's predicted step hides."""

    buckets: float
    gathers: float

    @classmethod
    def of(cls, predicted: Prediction) -> "HiddenShares":
        behind = predicted.hidden_s - predicted.prefetch_hidden_s - sum(predicted.linear_hidden_s.values())
        buckets = predicted.overlappable_s - predicted.prefetchable_s
        return cls(behind / buckets if buckets > 0 else 0.0,
                   predicted.prefetch_hidden_s / predicted.prefetchable_s if predicted.prefetchable_s > 0 else 0.0)

    def alike(self, other: "HiddenShares") -> bool:
        return max(abs(self.buckets - other.buckets), abs(self.gathers - other.gathers)) < SHARES_ALIKE

    def priced(self, problem: Problem) -> Problem:
        return problem.overlapped(self.buckets, self.gathers)


def solve_problem(problem: Problem, rule, budget, options: SolveOptions = SolveOptions(), *, minimise_memory=False,
                  recompute=None, summed: Solved | None = None, free: Solved | None = None) -> Solved:
    """`solve_summed`, then once more with gradient buckets and prefetched weight gathers
    priced at the shares the first plan hides (Problem.overlapped), keeping whichever
    plan's step, overlap counted (assemble), is faster.  The second solve lets plans whose
    communication hides better (ZeRO-2 over ZeRO-3, data parallel over more sharding) win.
    Only where overlap happens (an asynchronous device) and hides at least 1 % of the step.
    The second solve keeps the first plan's recomputed layers: overlap changes which
    communication pays, not which activations fit.  It is tried without a budget first
    (cheap: eliminations, rarely an ILP), and the budgeted ILP only runs when that
    unbudgeted plan is faster, overlap counted, than the summed one's: on llama3-8b and -70b
    at scale the discount prefers plans that hide less than it assumes, and their budgeted
    solves cost 5-50 s for a plan then rejected.  Where the summed plan recomputes and the
    budget also fits a plan keeping every activation (Solved.kept), that one is taken when
    its step, overlap counted, is faster.  summed: solve_summed's result for these
    arguments, when the caller has it; free: its plan with no budget (solve_summed's)."""
    best = summed or solve_summed(problem, rule, budget, options, minimise_memory=minimise_memory,
                                  recompute=recompute, free=free)
    if minimise_memory or not problem.mesh.device.asynchronous or not problem.edge_prices.bucketed:
        return best
    first = predict(problem, best.choice)
    if best.kept is not None:   # recomputing won on summed seconds; keeping every activation may hide more
        kept = predict(problem, best.kept.choice)
        if kept.step_s < first.step_s * (1 - 1e-9):
            best, first = best.kept, kept
    if first.hidden_s - sum(first.linear_hidden_s.values()) <= HIDDEN_AT_LEAST * first.step_s:
        return best
    try:
        other, step = _overlap_solve(problem, rule, budget, options, best, first)
    except InfeasibleError:
        return best
    if other is not None and step.step_s < first.step_s * (1 - 1e-9):
        return other
    return best


def _overlap_solve(problem: Problem, rule, budget, options: SolveOptions, best: Solved,
                   first: Prediction) -> tuple:
    """(the overlap-priced plan, its prediction), or (None, None) where its budgeted solve
    is skipped.  The proxy's own optimum with no budget first (exact eliminations, rarely an
    ILP): when it fits, it is the second solve's answer.  When, overlap counted, it is not
    faster than the summed optimum with no budget either, the proxy's discount misleads on
    this problem (the plans it prefers move more bytes than the step can hide), and the
    budgeted solve, which ranks memory-saving plans by the same discount, is skipped.  The
    plan the proxy picks hides other shares than the first: priced again at its own shares
    (a few rounds, while the step improves), as the plan a tighter budget forces might."""
    modes = dict(best.choice.modes) or None
    costs = mode_costs(problem, modes) if modes else None   # (the overlapped copies share what it reads)
    shares = HiddenShares.of(first)
    over = shares.priced(problem)
    other = solve_modes(over, rule, None, options, modes, costs=costs)
    step = predict(problem, other.choice)
    for _ in range(SHARE_ROUNDS):
        again_shares = HiddenShares.of(step)
        if again_shares.alike(shares):
            break
        shares, again_over = again_shares, again_shares.priced(problem)
        again = solve_modes(again_over, rule, None, options, modes, costs=costs)
        again_step = predict(problem, again.choice)
        if again_step.step_s >= step.step_s * (1 - 1e-9):
            break
        other, over, step = again, again_over, again_step
    if budget is not None and other.memory > budget:
        plain = best.choice if best.solution.slack else solve_modes(problem, rule, None, options, modes,
                                                                    costs=costs).choice
        if step.step_s >= predict(problem, plain).step_s * (1 - 1e-9):
            log.info("overlap-aware second solve skipped: with no budget its plan is not faster, overlap "
                     "counted, than the summed optimum")
            return None, None
        reserve = beyond_linear(problem, best.choice, costs)[2]
        other = solve_modes(over, rule, budget, options, modes, reserve=reserve, costs=costs)
        step = predict(problem, other.choice)
    return other, step


def step_lower_bound(problem: Problem, options: SolveOptions = SolveOptions()) -> float:
    """Seconds no plan of `problem` that the planner can return (under any budget, with any
    recomputation) is predicted to beat.  A plan's step (assemble) is compute + S + O -
    hidden, O being its gradient buckets and prefetched weight gathers, S the rest of its
    communication (less, for linears' input gradients, at most what their weight gradients
    hide: Problem.overlapped(linear_most=True)); the hidden part is at most O and at most
    what the device stream runs (compute + S), so
    step >= max(compute + S, O) >= a (compute + S) + (1 - a) O for any a in [0, 1].  For a in {1, 3/4, 1/2} the least of that sum over every plan, with identical
    layers free to alternate (period 2 holds period 1's plans), no memory budget and no
    memory tie-break, is a bound; the largest of the three is returned.  Recomputing only
    adds time.  Exact eliminations solve each (a transformer costs no ILP)."""
    bound = 0.0
    for a in (1.0, 0.75, 0.5):
        hidden = (2 * a - 1) / a   # a (compute + S) + (1 - a) O = a (compute + S + O - hidden O)
        red = reduce_problem(problem.overlapped(hidden, hidden, linear_most=True), None, 2)
        bound = max(bound, a * solve(red.costs, red.edges, None, None, red.allowed,
                                     time_limit=options.time_limit).objective)
    return bound
