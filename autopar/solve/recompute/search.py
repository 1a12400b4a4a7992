"""Which layers recompute their activations: the fastest plan over the recompute
assignments (autopar/solve/recompute/modes.py's MODES per set of identical layers) that fits the
budget, each assignment a RecomputeCandidate solved by fitting.solve_modes.

Recomputing only adds time, so the assignments are tried only when the fastest plan with
no budget at all does not fit.  Then each assignment's plans are bounded below by a
Lagrangian bound (RecomputeCandidate.lagrangian, LagrangianPiece.bound_under): the least
of seconds + price x (bytes - cap) over its plans, at the price of a byte (byte_price)
where the plan keeping every activation meets the budget, cap being what the assignment's
solve leaves its ILP bytes (a solve with no budget, exact eliminations that rarely need
an ILP: a fraction of a second where a budgeted solve takes seconds).  The plan keeping
every activation is solved under the budget while the byte price is found; an assignment
whose plans cannot beat it even before a solve (the least seconds of any plan, plus the
least its recomputation adds) is settled there, the others get their Lagrangian bound;
then the assignments are solved in the order of their bounds, and those whose bound is
already no better than the best plan found are skipped.  The bounds, and the solves of as
many assignments as there are workers at a time, run in forked processes
(autopar/solve/forked.py); each solve starts from what the plan keeping every activation
needed beyond the ILP's sum, so the plan returned is the same for any number of workers.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np

from autopar.solve.recompute.fitting import priced_solve, solve_modes
from autopar.solve.forked import forked_map, worker_count
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.solve.problem.problem import Problem
from autopar.solve.recompute.modes import SEARCHED, ModeCosts, check_mode, layer_slots, mode_costs
from autopar.solve.ilp.reduce import reduce_problem
from autopar.solve.ilp.solved import SolveOptions, Solved

log = logging.getLogger("autopar")

PRICE_CUTS = 4      # cutting-plane steps of byte_price once the budget is bracketed
PRICE_DOUBLINGS = 8  # times the first price is multiplied by 4 to bracket it
FLOOR_MARGIN = 1e-6  # an assignment's least seconds, lowered by this fraction (each solve rounds its terms)


@dataclass(frozen=True)
class HeldPlan:
    """A plan keeping every activation that fits the budget, as a witness for the bounds:
    its choice and its ILP bytes less its activations (what a recompute assignment leaves
    alike)."""

    choice: dict
    state_bytes: float

    @classmethod
    def of(cls, problem: Problem, choice) -> "HeldPlan":
        return cls(choice, sum(float(sum(c.memory.values()) - c.memory["activations"])
                               for c in (problem.choices[pn.rep][choice[pn.index]] for pn in problem.nodes)))


@dataclass(frozen=True)
class LagrangianPiece:
    """What a lower bound on the ILP objective of any plan under one recompute assignment
    needs: value, the least of seconds + price * bytes over its plans with no budget; the
    byte price; bytes, those of the plan that reaches it; activations: the bytes the
    assignment keeps, per representative node and strategy (ModeCosts.activations)."""

    value: float
    price: float
    bytes: float
    activations: dict

    def bound_under(self, budget: float, reserve: float, held: HeldPlan | None = None) -> float:
        """The lower bound under `budget`, for a solve whose working-memory reserve starts at
        `reserve`.  When some plan of the assignment has ILP bytes under budget - reserve,
        the solve's first try finds one and never falls back to a smaller reserve, so every
        plan it returns stays under budget - reserve and the Lagrangian term is taken there;
        else under the budget.  Two such witnesses are known: the priced plan, and `held`
        (the plan keeping every activation found under the budget), whose bytes under the
        assignment are its state bytes plus the activations the assignment keeps of it (the
        same strategies; a margin of 1e-6 of the budget covers the ILP's rounding up)."""
        cap = budget
        if self.bytes <= budget - reserve:
            cap = budget - reserve
        elif held is not None and reserve > 0:
            kept = sum(float(arr[held.choice[rep]]) for rep, arr in self.activations.items())
            if held.state_bytes + kept <= budget - reserve - 1e-6 * budget:
                cap = budget - reserve
        return self.value - self.price * cap


@dataclass(frozen=True)
class Attempt:
    """What solving one assignment gave: unbudgeted, its optimum with no budget when that
    alone ruled it out (no better than the best plan so far: not solved under the budget);
    found, the plan it found (None: ruled out, or none fits)."""

    unbudgeted: float | None = None
    found: Solved | None = None


@dataclass(frozen=True)
class RecomputeCandidate:
    """One recompute assignment to try: modes, layer path -> "none", "selective" or "full";
    periods, the layer periods its solve tries (1: identical layers alike, 2: alternating)."""

    modes: dict
    periods: tuple

    def __str__(self) -> str:
        return "/".join(dict.fromkeys(self.modes[p] for p in sorted(self.modes)[:2])) + " on even/odd layers"

    def costs(self, problem: Problem) -> ModeCosts:
        return mode_costs(problem, self.modes)

    def least_added(self, problem: Problem) -> float:
        """The least seconds this assignment adds to any plan's ILP objective: the cheapest
        of each node's and edge class's forward run again (and of an offloaded layer's
        copies) over their strategies, summed (ModeCosts.extra and edge_extra)."""
        costs = self.costs(problem)
        return float(sum(float(np.min(a)) for a in costs.extra.values() if np.size(a))
                     + sum(float(np.min(m)) for m in costs.edge_extra.values() if np.size(m)))

    def lagrangian(self, problem: Problem, rule, price: float, options: SolveOptions) -> LagrangianPiece | None:
        """Its LagrangianPiece over its finest period (alternating layers admit every plan of
        identical ones): a solve with no budget (exact eliminations, rarely an ILP).  None:
        no plan."""
        costs = self.costs(problem)
        red = reduce_problem(problem, rule, max(self.periods), costs)
        try:
            sol, mem = priced_solve(red, price, options)
        except InfeasibleError:
            return None
        return LagrangianPiece(sol.bound, price, mem, costs.activations)

    def attempt(self, problem: Problem, rule, budget, options: SolveOptions, reserve: float,
                best: Solved | None) -> Attempt:
        """Its fastest plan under `budget`, its solve's reserve starting at `reserve`; when
        there is a `best` plan already, its optimum with no budget first (a fraction of a
        second): no better than best, the budgeted solve is skipped."""
        costs, reduced = self.costs(problem), {}
        try:
            if best is not None:
                red = reduced[max(self.periods)] = reduce_problem(problem, rule, max(self.periods), costs)
                out = priced_solve(red, 0.0, options)[0].bound
                if out >= best.objective * (1 - 1e-9):
                    return Attempt(unbudgeted=out)
            return Attempt(found=solve_modes(problem, rule, budget, options, self.modes, periods=self.periods,
                                             reserve=reserve, costs=costs, reduced=reduced))
        except InfeasibleError:
            return Attempt()


def mode_assignments(problem: Problem, slots: list, forced) -> list[RecomputeCandidate]:
    """The assignments to try: the forced mode on every layer (periods 1 and 2); unforced,
    each mode other than none on every layer (periods 1 and 2), every pair of distinct
    modes among none and the recomputing ones on even and odd layers (period 2), and
    offload beside none (period 2)."""
    if forced:
        return [RecomputeCandidate({f"{p}.{i}": forced for p, ix in slots for i in ix}, (1, 2))]
    out = [RecomputeCandidate({f"{p}.{i}": mode for p, ix in slots for i in ix}, (1, 2))
           for mode in (*SEARCHED, "offload")]
    paired = [(even, odd) for even in ("none", *SEARCHED) for odd in ("none", *SEARCHED) if even != odd]
    for even, odd in paired + [("offload", "none"), ("none", "offload")]:
        out.append(RecomputeCandidate({f"{p}.{i}": (even if k % 2 == 0 else odd) for p, ix in slots
                                       for k, i in enumerate(ix)}, (2,)))
    return out


def solve_summed(problem: Problem, rule, budget, options: SolveOptions = SolveOptions(), *,
                 minimise_memory=False, recompute=None, free: Solved | None = None) -> Solved:
    """Solve with every identical layer alike (period 1); when the answer moves data between
    consecutive layers, try alternating layouts (period 2) too and keep the faster plan.
    `recompute` forces one mode on every repeated layer; None lets the solve choose per set
    of identical layers among MODES (the module docstring says how).  free: this problem's
    plan under `rule` with no budget, when the caller solved it already."""
    forced = check_mode(recompute)
    slots = layer_slots(problem)
    if not slots or forced == "none" or budget is None or minimise_memory:
        modes = None if forced in (None, "none") else mode_assignments(problem, slots, forced)[0].modes
        return solve_modes(problem, rule, budget, options, modes, minimise_memory=minimise_memory)
    tried = mode_assignments(problem, slots, forced)
    if forced is not None:
        return _search(problem, rule, budget, options, tried, [0.0] * len(tried), None, 0.0)
    # the fastest plan first (a solve with no budget: eliminations, rarely an ILP): when it
    # fits, it is the answer; else what it needs beyond the ILP's sum is where the budgeted
    # solve's reserve starts
    free = free or solve_modes(problem, rule, None, options)
    if free.memory <= budget:
        return free
    keep, bounds = _keep_all_and_bounds(problem, rule, budget, options, tried, free)
    log.debug("no recompute: plan %s, with no budget %.6f", f"{keep.objective:.6f}" if keep else "none fits",
              free.objective)
    if keep is not None and keep.objective <= free.objective * (1 + 1e-9):
        return keep
    reserve = keep.beyond if keep is not None else 0.0
    found = _search(problem, rule, budget, options, tried, bounds, keep, reserve)
    return replace(found, kept=keep) if keep is not None and found is not keep else found


def _keep_all_and_bounds(problem: Problem, rule, budget, options: SolveOptions, tried: list,
                         free: Solved) -> tuple:
    """(the plan keeping every activation under the budget, or None; a lower bound on each
    assignment's plans).  First, side by side in two processes, that plan and the byte
    price (byte_price, whose first solve is the least seconds of any plan with no budget,
    alternating layers allowed).  An assignment's plans are then at least that least plus
    the least its recomputation adds (RecomputeCandidate.least_added: the cheapest forward
    run again, node by node): where that is no better than the plan keeping every
    activation, the assignment is settled without a solve (DeepSeek-V3 on 32 x 8 x 8: all
    eleven, whose Lagrangian bounds took 148 s).  The others get their Lagrangian bound
    (LagrangianPiece.bound_under) too, as many at a time as there are workers.  The bounds
    price bytes where the solves will cap the ILP's sum: the budget less what the fastest
    plan needs beyond that sum (where the budgeted solve starts)."""
    cap = budget - free.beyond if free.beyond < budget else budget
    lines: dict = {}

    def keep_all():
        try:
            return solve_modes(problem, rule, budget, options, reserve=free.beyond)
        except InfeasibleError:
            return None

    def priced():
        return byte_price(problem, rule, cap, options, lines), lines

    (price, lines), keep = forked_map(lambda task: task(), [priced, keep_all], worker_count(options.workers))
    least = lines[0.0][0]
    floors = [(least + candidate.least_added(problem)) * (1 - FLOOR_MARGIN) for candidate in tried]
    best = keep.objective * (1 - 1e-9) if keep is not None else float("inf")
    open_ = [k for k, floor in enumerate(floors) if floor < best]
    if len(open_) < len(tried):
        log.info("recompute: %d of %d assignments settled by their least added seconds (their plans take at "
                 "least %.6f; keeping every activation: %s)", len(tried) - len(open_), len(tried), min(floors),
                 f"{keep.objective:.6f}" if keep is not None else "none fits")
    pieces = forked_map(lambda k: tried[k].lagrangian(problem, rule, price, options), open_,
                        worker_count(options.workers))
    reserve = keep.beyond if keep is not None else 0.0
    held = HeldPlan.of(problem, keep.choice) if keep is not None else None
    bounds = list(floors)
    for k, piece in zip(open_, pieces):
        bounds[k] = float("inf") if piece is None else max(floors[k], piece.bound_under(budget, reserve, held))
    return keep, bounds


def _search(problem: Problem, rule, budget, options: SolveOptions, tried: list, bounds: list,
            best: Solved | None, reserve: float) -> Solved:
    """The best plan over the assignments `tried`, solved in the order of their `bounds` as
    many at a time as there are workers, skipping those whose bound is no better than the
    best plan found (`best`: one already known); each solve's reserve starts at `reserve`."""
    workers = worker_count(options.workers)
    order = sorted(range(len(tried)), key=lambda k: (bounds[k], k))
    start = time.perf_counter()

    def improves(k) -> bool:
        return best is None or bounds[k] < best.objective * (1 - 1e-9)

    done = 0
    while done < len(order) and improves(order[done]):
        batch = [k for k in order[done:done + workers] if improves(k)]
        ahead = best
        attempts = forked_map(lambda k: tried[k].attempt(problem, rule, budget, options, reserve, ahead), batch,
                              workers)
        for k, got in zip(batch, attempts):
            if got.found is not None and got.found.faster_than(best):
                best = got.found
            log.info("recompute assignment %d of %d (%s): bound %.6f, plan %s; best %s, %.1fs",
                     order.index(k) + 1, len(tried), tried[k], bounds[k], f"{got.found.objective:.6f}" if got.found
                     else (f"not solved, its optimum with no budget is {got.unbudgeted:.6f}"
                           if got.unbudgeted is not None else "none fits"),
                     f"{best.objective:.6f}" if best else "none", time.perf_counter() - start)
        done += workers
    if done < len(order):
        log.info("recompute: %d of %d assignments skipped, their bounds no better than %.6f",
                 len(order) - done, len(tried), best.objective)
    if best is None:
        raise InfeasibleError("no assignment of strategies fits the memory budget, recomputing or not")
    return best


def byte_price(problem: Problem, rule, budget, options: SolveOptions, lines: dict | None = None) -> float:
    """The seconds a byte is worth where `budget` binds on the ILP's sum of the plan
    keeping every activation: the Lagrange multiplier that maximises min over plans of
    (seconds + price * (bytes - budget)), found by cutting planes (each solve with no
    budget gives a plan, a line in the price; the next price is where the nearest lines
    over and under the budget cross) over a few solves with no budget."""
    red = reduce_problem(problem, rule, 2)
    lines = {} if lines is None else lines   # price -> (the plan's seconds less price x its bytes, its bytes)

    def line(price) -> tuple:
        if price not in lines:
            sol, mem = priced_solve(red, price, options)
            lines[price] = (sol.objective - price * mem, mem)
        return lines[price]

    s0, m0 = line(0.0)
    if m0 <= budget:
        return 0.0
    price = max(s0, 1e-9) / budget   # a step's seconds per budget: plans shed memory well before
    for _ in range(PRICE_DOUBLINGS):
        if line(price)[1] <= budget:
            break
        price *= 4
    else:
        return price
    for _ in range(PRICE_CUTS):
        lo = max(p for p, (_, m) in lines.items() if m > budget)
        hi = min(p for p, (_, m) in lines.items() if m <= budget)
        (s_lo, m_lo), (s_hi, m_hi) = lines[lo], lines[hi]
        if m_lo <= m_hi or s_hi <= s_lo:
            return hi
        cross = (s_hi - s_lo) / (m_lo - m_hi)   # where the two lines cross
        if cross in lines:
            return cross
        s, m = line(cross)
        if s + cross * (m - budget) >= (s_lo + cross * (m_lo - budget)) * (1 - 1e-9):
            return cross   # no plan under both lines there: the dual's maximum
    return max(lines, key=lambda p: lines[p][0] + p * (lines[p][1] - budget))
