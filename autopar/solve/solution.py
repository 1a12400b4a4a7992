"""From a solved problem to the plan's facts: solve a Problem (identical layers alike, or
alternating when that is faster) and assemble a choice into per-node records, the
collectives it implies and the predicted step time and memory.

The planner (autopar.solve.planner) and the pipeline search (autopar.solve.pipeline_search) both call
these two; neither imports the other's internals.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from autopar.plan.plan import Collective, NodeChoice, Prediction
from autopar.solve.forked import forked_map, worker_count
from autopar.cost.precision import cast_for_trace, meta_inputs
from autopar.solve.problem import Problem
from autopar.solve.reduce import reduce_problem
from autopar.solve.recompute import MODES, ModeCosts, beyond_linear, check_mode, layer_slots, mode_costs
from autopar.solve.ilp import InfeasibleError, solve
from autopar.trace.export import model_fingerprint, trace

log = logging.getLogger("autopar")

CATEGORIES = ("params", "grads", "optimizer", "activations", "working")


@dataclass
class Built:
    """A traced and costed problem, with how long each took; `summed` keeps the result of
    solve_summed(problem, None, None, ...) and `solved` of solve_problem(problem, None,
    None, ...) once someone ran them (the pipeline search prices its stages by the first),
    so neither is solved twice."""

    problem: Problem
    trace_s: float
    costs_s: float
    solved: tuple | None = None   # (choice, solution, memory of the choice)
    summed: tuple | None = None   # the same, of the summed optimum (no overlap re-solve)


def build_problem(model, mesh, args, kwargs, mixed_precision=None, grouped_gathers=True) -> Built:
    """Trace `model` on (args, kwargs) and build its strategy menus and costs on `mesh`
    (grouped_gathers: see Problem).
    Under mixed precision what runs is traced: the model cast to param_dtype on meta inputs.
    Repeated layers are traced three of them and written out (autopar/trace/unroll.py): the same
    graph the runtime traces, checked by its signature when the plan is compiled."""
    start = time.perf_counter()
    traced = planning_trace(model, args, kwargs, mixed_precision)
    t_trace = time.perf_counter() - start
    problem = Problem(traced, mesh, mixed_precision, grouped_gathers)
    t_build = time.perf_counter() - start - t_trace
    log.info("built strategy menus and costs in %.2fs", t_build)
    return Built(problem, t_trace, t_build)


def planning_trace(model, args, kwargs, mixed_precision=None):
    """The trace build_problem plans (cached per model and input shapes: autopar.trace.export)."""
    if mixed_precision is not None:
        args, kwargs = meta_inputs((tuple(args), kwargs))
        return trace(_cast(model, mixed_precision.param_dtype), args, kwargs, unroll=True, shared=True)
    return trace(model, tuple(args), kwargs, unroll=True, shared=True)


_CAST: dict = {}   # (fingerprint, dtype) of the model last cast for tracing -> its cast copy


def _cast(model, dtype):
    """cast_for_trace, remembered for the last model and dtype while the model's fingerprint
    (autopar.trace.export: structure, attributes, shapes) is unchanged: the pipeline search traces
    one model at every microbatch size (a copy of llama3-8b takes 0.03 s)."""
    key = (model_fingerprint(model), dtype)
    if key not in _CAST:
        _CAST.clear()
        _CAST[key] = cast_for_trace(model, dtype)
    return _CAST[key]


def solve_unbudgeted(built: Built, time_limit: float, summed: bool = False) -> tuple:
    """solve_problem(built.problem) with no layout rule and no budget, once per Built;
    summed: only its first step, solve_summed (the plan whose summed seconds are least: what
    a pipeline stage's costs add up, without the overlap-aware second solve)."""
    if built.summed is None:
        built.summed = solve_summed(built.problem, None, None, time_limit)
    if summed:
        return built.summed
    if built.solved is None:
        built.solved = solve_problem(built.problem, None, None, time_limit, summed=built.summed)
    return built.solved


class Assignment(dict):
    """Node index -> chosen strategy index, and `modes`: the recomputed layers (path ->
    "selective" or "full"; autopar/solve/recompute.py)."""

    modes: dict = {}


def solve_problem(problem: Problem, rule, budget, time_limit, minimise_memory=False, recompute=None, summed=None):
    """`solve_summed`, then once more with gradient buckets and prefetched weight gathers
    priced at the shares the first plan hides (Problem.overlapped), keeping whichever
    plan's step, overlap counted (assemble), is faster.  The ILP's objective is a sum and
    cannot see overlap; the second solve lets plans whose communication hides better
    (ZeRO-2 over ZeRO-3, data parallel over more sharding) win.  Only where overlap happens
    (an asynchronous device) and hides at least 1 % of the step.  The second solve keeps the
    first plan's recomputed layers: overlap changes which communication pays, not which
    activations fit.  It is tried without a budget first (cheap: eliminations, rarely an
    ILP), and the budgeted ILP only runs when that unbudgeted plan is faster, overlap
    counted, than the summed one's: on llama3-8b and -70b at scale the discount prefers
    plans that hide less than it assumes, and their budgeted solves cost 5-50 s for a plan
    then rejected.  summed: solve_summed's result for these arguments, when the caller has it."""
    best = summed or solve_summed(problem, rule, budget, time_limit, minimise_memory, recompute)
    if minimise_memory or not problem.mesh.device.asynchronous or not problem.edge_bucketed:
        return best
    first = assemble(problem, best[0])[2]
    if first.hidden_s <= 0.01 * first.step_s:
        return best
    modes = dict(best[0].modes) or None
    costs = mode_costs(problem, modes) if modes else None   # (the overlapped copies share what it reads)
    try:
        # the proxy's own optimum with no budget first (exact eliminations, rarely an ILP):
        # when it fits, it is the second solve's answer.  When, overlap counted, it is not
        # faster than the summed optimum with no budget either, the proxy's discount
        # misleads on this problem (the plans it prefers move more bytes than the step can
        # hide), and the budgeted solve, which ranks memory-saving plans by the same
        # discount, is skipped.  The plan the proxy picks hides other shares than the
        # first: priced again at its own shares (a few rounds, while the step improves),
        # as the plan a tighter budget forces might
        shares = _hidden_shares(first)
        over = problem.overlapped(*shares)
        other = _solve_modes(over, rule, None, time_limit, False, modes, costs=costs)
        step = assemble(problem, other[0])[2]
        for _ in range(3):
            again_shares = _hidden_shares(step)
            if max(abs(x - y) for x, y in zip(again_shares, shares)) < 0.02:
                break   # (priced alike, the solve would return the same plan)
            shares, again_over = again_shares, problem.overlapped(*again_shares)
            again = _solve_modes(again_over, rule, None, time_limit, False, modes, costs=costs)
            again_step = assemble(problem, again[0])[2]
            if again_step.step_s >= step.step_s * (1 - 1e-9):
                break
            other, over, step = again, again_over, again_step
        if budget is not None and other[2] > budget:
            plain = best[0] if best[1].slack else \
                _solve_modes(problem, rule, None, time_limit, False, modes, costs=costs)[0]
            if step.step_s >= assemble(problem, plain)[2].step_s * (1 - 1e-9):
                log.info("overlap-aware second solve skipped: with no budget its plan is not faster, overlap "
                         "counted, than the summed optimum")
                return best
            seen = {"extra": beyond_linear(problem, best[0], costs)[2]}
            other = _solve_modes(over, rule, budget, time_limit, minimise_memory, modes, seen=seen, costs=costs)
            step = assemble(problem, other[0])[2]
    except InfeasibleError:
        return best
    if step.step_s < first.step_s * (1 - 1e-9):
        return other
    return best


def _hidden_shares(predicted) -> tuple:
    """(share of the gradient buckets, share of the prefetchable weight gathers) a plan's
    predicted step hides: the discounts Problem.overlapped prices with."""
    behind = predicted.hidden_s - predicted.prefetch_hidden_s
    buckets = predicted.overlappable_s - predicted.prefetchable_s
    return (behind / buckets if buckets > 0 else 0.0,
            predicted.prefetch_hidden_s / predicted.prefetchable_s if predicted.prefetchable_s > 0 else 0.0)


def solve_summed(problem: Problem, rule, budget, time_limit, minimise_memory=False, recompute=None):
    """Solve with every identical layer alike (period 1); when the answer moves data between
    consecutive layers, try alternating layouts (period 2) too and keep the faster plan.

    Recomputation (autopar/solve/recompute.py): `recompute` forces one mode on every repeated
    layer; None lets the solve choose per set of identical layers among MODES (all alike,
    or even and odd layers apart).  Recomputing only adds time, so the other modes are tried
    only when the budget binds: when the fastest plan with no budget at all does not fit.
    Then each assignment's plans are bounded below by a Lagrangian bound
    (`_unbudgeted_bound`, `_bound_under`): the least of seconds + price x (bytes - cap)
    over its plans, at the price of a byte where the plan keeping every activation meets
    the budget, cap being what the assignment's solve leaves its ILP bytes (a solve with
    no budget, exact eliminations that rarely need an ILP, a fraction of a second where a
    budgeted solve takes seconds).  The plan keeping every activation is solved under the
    budget while those bounds are computed; then the assignments are solved in the order
    of their bounds, and those whose bound is already no better than the best plan found
    are skipped.  The bounds, and the solves of as many assignments as there are workers
    at a time, run in forked processes (autopar/solve/forked.py); each solve starts from what
    the plan keeping every activation needed beyond the ILP's sum, so the plan returned
    is the same for any number of workers."""
    forced = check_mode(recompute)
    slots = layer_slots(problem)
    if not slots or forced == "none" or budget is None or minimise_memory:
        modes = None if forced in (None, "none") else mode_assignments(problem, slots, forced)[0][0]
        return _solve_modes(problem, rule, budget, time_limit, minimise_memory, modes)
    workers = worker_count()
    seen: dict = {}   # what the last plan needed beyond the ILP's sum: where the next solve starts
    tried = mode_assignments(problem, slots, forced)
    best = None
    if forced is None:
        # the fastest plan first (a solve with no budget: eliminations, rarely an ILP): when
        # it fits, it is the answer; else what it needs beyond the ILP's sum is where the
        # budgeted solve's reserve starts
        free = _solve_modes(problem, rule, None, time_limit, False, None, seen=seen)
        if free[2] <= budget:
            return free

        def keep_all():
            try:
                return _solve_modes(problem, rule, budget, time_limit, False, None, seen=seen), seen["extra"]
            except InfeasibleError:
                return None, 0.0

        # the bounds price bytes where the solves will cap the ILP's sum: under the budget
        # less what the fastest plan needs beyond that sum (where the budgeted solve starts)
        cap = budget - seen["extra"] if seen["extra"] < budget else budget

        def bound_all():
            price = _byte_price(problem, rule, cap, time_limit)
            return [_unbudgeted_bound(problem, rule, periods, mode_costs(problem, modes), time_limit, price)
                    for modes, periods in tried]

        # (this process computes the bounds: the assignments' costs it builds stay for the solves it forks next)
        pieces, (best, extra) = forked_map(lambda task: task(), [bound_all, keep_all], workers)
        log.debug("no recompute: plan %s, with no budget %.6f", f"{best[1].objective:.6f}" if best else "none fits",
                  free[1].objective)
        if best is not None and best[1].objective <= free[1].objective * (1 + 1e-9):
            return best
        seen["extra"] = extra
        held = _state_bytes(problem, best[0]) if best is not None else None
        bounds = [_bound_under(piece, budget, extra if best is not None else 0.0, held) for piece in pieces]
    else:
        bounds = [0.0] * len(tried)
    order = sorted(range(len(tried)), key=lambda k: (bounds[k], k))
    start = time.perf_counter()
    snapshot = dict(seen)   # every assignment's solve starts from here, whichever process runs it

    def attempt(k) -> tuple:
        """(its optimum with no budget, when that alone rules it out; the plan it finds)."""
        modes, periods = tried[k]
        costs, reduced = mode_costs(problem, modes), {}
        try:
            if best is not None:
                # its optimum with no budget first (a fraction of a second): no better than
                # the best plan, the budgeted solve is skipped
                red = reduced[max(periods)] = reduce_problem(problem, rule, max(periods), costs)
                out = _priced_solve(red, 0.0, time_limit)[0].bound
                if out >= best[1].objective * (1 - 1e-9):
                    return out, None
            return None, _solve_modes(problem, rule, budget, time_limit, False, modes, periods, dict(snapshot),
                                      costs=costs, reduced=reduced)
        except InfeasibleError:
            return None, None

    def improves(k) -> bool:
        return best is None or bounds[k] < best[1].objective * (1 - 1e-9)

    done = 0
    while done < len(order) and improves(order[done]):
        batch = [k for k in order[done:done + workers] if improves(k)]
        for k, (out, found) in zip(batch, forked_map(attempt, batch, workers)):
            if found is not None and (best is None or found[1].objective < best[1].objective * (1 - 1e-9)):
                best = found
            modes = tried[k][0]
            log.info("recompute assignment %d of %d (%s on even/odd layers): bound %.6f, plan %s; best %s, %.1fs",
                     order.index(k) + 1, len(tried), "/".join(dict.fromkeys(modes[p] for p in sorted(modes)[:2])),
                     bounds[k], f"{found[1].objective:.6f}" if found else
                     (f"not solved, its optimum with no budget is {out:.6f}" if out is not None else "none fits"),
                     f"{best[1].objective:.6f}" if best else "none", time.perf_counter() - start)
        done += workers
    if done < len(order):
        log.info("recompute: %d of %d assignments skipped, their bounds no better than %.6f",
                 len(order) - done, len(tried), best[1].objective)
    if best is None:
        raise InfeasibleError("no assignment of strategies fits the memory budget, recomputing or not")
    return best


def _byte_price(problem: Problem, rule, budget, time_limit) -> float:
    """The seconds a byte is worth where `budget` binds on the ILP's sum of the plan
    keeping every activation: the Lagrange multiplier that maximises min over plans of
    (seconds + price * (bytes - budget)), found by cutting planes (each solve with no
    budget gives a plan, a line in the price; the next price is where the nearest lines
    over and under the budget cross) over a few solves with no budget."""
    red = reduce_problem(problem, rule, 2)
    seen: dict = {}

    def line(price) -> tuple:
        if price not in seen:
            sol, mem = _priced_solve(red, price, time_limit)
            seen[price] = (sol.objective - price * mem, mem)
        return seen[price]

    s0, m0 = line(0.0)
    if m0 <= budget:
        return 0.0
    price = max(s0, 1e-9) / budget   # a step's seconds per budget: plans shed memory well before
    for _ in range(8):
        if line(price)[1] <= budget:
            break
        price *= 4
    else:
        return price
    for _ in range(4):
        lo = max(p for p, (_, m) in seen.items() if m > budget)
        hi = min(p for p, (_, m) in seen.items() if m <= budget)
        (s_lo, m_lo), (s_hi, m_hi) = seen[lo], seen[hi]
        if m_lo <= m_hi or s_hi <= s_lo:
            return hi
        cross = (s_hi - s_lo) / (m_lo - m_hi)   # where the two lines cross
        if cross in seen:
            return cross
        s, m = line(cross)
        if s + cross * (m - budget) >= (s_lo + cross * (m_lo - budget)) * (1 - 1e-9):
            return cross   # no plan under both lines there: the dual's maximum
    return max(seen, key=lambda p: seen[p][0] + p * (seen[p][1] - budget))


def _unbudgeted_bound(problem: Problem, rule, periods, costs: ModeCosts, time_limit, price: float) -> tuple:
    """What a lower bound on the ILP objective of any plan under a recompute assignment
    needs (see _bound_under), over the finest period of `periods` (alternating layers
    admit every plan of identical ones): (the least of seconds + price * bytes over its
    plans, with no budget; `price`; the bytes of the plan that reaches it; and the
    activation bytes the assignment keeps, per representative node and strategy,
    ModeCosts.activations).  A solve with no budget (exact eliminations, rarely an ILP).
    None: no plan."""
    red = reduce_problem(problem, rule, max(periods), costs)
    try:
        sol, mem = _priced_solve(red, price, time_limit)
    except InfeasibleError:
        return None
    return sol.bound, price, mem, costs.activations


def _priced_solve(red, price: float, time_limit) -> tuple:
    """(solution, its ILP bytes) of the reduced problem with no budget and each byte priced
    at `price` seconds, without the memory tie-break (its objective is seconds + price x
    bytes, exactly)."""
    priced = red.costs if price == 0 else [np.asarray(c, float) + price * np.asarray(m, float)
                                           for c, m in zip(red.costs, red.memory)]
    sol = solve(priced, red.edges, red.memory, None, red.allowed, time_limit=time_limit,
                tiebreak=[np.zeros(len(c)) for c in red.costs])
    return sol, _ilp_bytes(red, sol.choice)


def _ilp_bytes(red, choice) -> float:
    """The ILP's linear memory sum of a choice of the reduced problem."""
    return float(sum(red.memory[i][c] for i, c in enumerate(choice)))


def _state_bytes(problem: Problem, choice) -> tuple:
    """(a plan, its ILP bytes less its activations: what a recompute assignment leaves alike)."""
    return choice, sum(float(sum(c.memory.values()) - c.memory["activations"])
                       for c in (problem.choices[pn.rep][choice[pn.index]] for pn in problem.nodes))


def _bound_under(piece, budget, reserve, held=None) -> float:
    """The lower bound from _unbudgeted_bound's pieces under `budget`, for a solve whose
    working-memory reserve starts at `reserve`.  When some plan of the assignment has ILP
    bytes under budget - reserve, the solve's first try finds one and it never falls back
    to a smaller reserve, so every plan it returns stays under budget - reserve and the
    Lagrangian term is taken there; else under the budget.  Two such witnesses are known:
    the priced plan, and `held` ((a plan, its ILP bytes less activations) from
    _state_bytes: the plan keeping every activation found under the budget), whose bytes
    under the assignment are those plus the activations the assignment keeps of it (the
    same strategies; a margin of 1e-6 of the budget covers the ILP's rounding up)."""
    if piece is None:
        return float("inf")
    value, price, mem, activations = piece
    cap = budget
    if mem <= budget - reserve:
        cap = budget - reserve
    elif held is not None and reserve > 0:
        choice, states = held
        kept = sum(float(arr[choice[rep]]) for rep, arr in activations.items())
        if states + kept <= budget - reserve - 1e-6 * budget:
            cap = budget - reserve
    return value - price * cap


def _expand(problem: Problem, red, sol, modes) -> Assignment:
    """The Assignment over every node of a solution of the reduced problem `red`."""
    root_choice = dict(zip(red.roots, sol.choice))
    choice = Assignment()
    choice.modes = {k: v for k, v in (modes or {}).items() if v != "none"}
    for pn in problem.nodes:
        r = red.canon(pn.rep)
        choice[pn.index] = int(red.follow[r][root_choice[red.root_of[r]]])
    return choice


def mode_assignments(problem: Problem, slots: list, forced) -> list:
    """(layer path -> mode, periods) to try: the forced mode on every layer (periods 1 and
    2); unforced, each recomputing mode on every layer (periods 1 and 2) and every pair of
    distinct modes on even and odd layers (period 2)."""
    if forced:
        return [({f"{p}.{i}": forced for p, ix in slots for i in ix}, (1, 2))]
    out = [({f"{p}.{i}": mode for p, ix in slots for i in ix}, (1, 2)) for mode in MODES if mode != "none"]
    for even in MODES:
        for odd in MODES:
            if even != odd:
                out.append(({f"{p}.{i}": (even if k % 2 == 0 else odd) for p, ix in slots
                             for k, i in enumerate(ix)}, (2,)))
    return out


def _solve_modes(problem: Problem, rule, budget, time_limit, minimise_memory, modes, periods=(1, 2), seen=None,
                 costs=None, reduced=None):
    """(choice, solution, memory per device) of the fastest plan under these modes whose
    states, activations and working memory fit the budget together.  The ILP sums a linear
    estimate; what the plan found needs beyond it (recompute.beyond_linear: the working
    memory of its busiest op or recomputed layer, and its activations counted storage by
    storage in their actual layouts, reshard copies included) depends on the plan, so the
    budget the ILP sees is lowered by that much until a plan fits with its own.  `seen`
    carries that amount from one call to the next (other recompute modes need about as
    much), so later calls start there rather than at zero; a start too high for any plan
    falls back to zero."""
    if costs is None and modes:
        costs = mode_costs(problem, modes)
    reduced = {} if reduced is None else reduced   # period -> reduce_problem(problem, rule, period, costs)
    seen = {} if seen is None else seen
    start = reserve = max(0.0, seen.get("extra", 0.0))
    for _ in range(8):
        left = None if budget is None else budget - reserve
        if left is not None and left <= 0:
            break
        try:
            choice, sol, floor = _solve_periods(problem, rule, left, time_limit, minimise_memory, modes, periods,
                                                costs, reduced)
        except InfeasibleError:
            if reserve != start or not start:
                raise
            start = reserve = 0.0
            continue
        extra = beyond_linear(problem, choice, costs)[2]
        if budget is None or minimise_memory or floor + extra <= budget:
            seen["extra"] = extra
            return choice, sol, floor + extra
        reserve = max(reserve, extra)
    raise InfeasibleError("no assignment of strategies fits the memory budget with its working memory")


def _solve_periods(problem: Problem, rule, budget, time_limit, minimise_memory, modes, periods, costs, reduced):
    best = None
    for period in periods:
        if period not in reduced:
            reduced[period] = reduce_problem(problem, rule, period, costs)
        red = reduced[period]
        try:
            if minimise_memory:
                sol = _least_memory(red, time_limit)
            else:
                sol = solve(red.costs, red.edges, red.memory, budget, red.allowed, time_limit=time_limit,
                            tiebreak=red.plain_memory)
        except InfeasibleError:
            if period != periods[-1] and problem.tie:
                continue
            if best is not None:
                break
            raise
        choice = _expand(problem, red, sol, modes)
        floor = _ilp_bytes(red, sol.choice)
        if best is None or sol.objective < best[1].objective * (1 - 1e-9):
            best = (choice, sol, floor)
        if not problem.tie or not moves_between_layers(problem, choice):
            break
    return best


def _least_memory(red, time_limit):
    """The choice needing the least memory: the ILP memory sum plus the working memory of
    the busiest op.  With no edges to price, each cap T on one op's working memory leaves
    every node its least-memory choice among those under T; the best T is among the
    smallest caps every node can meet (the first 64 distinct values above that bound)."""
    allowed = [np.asarray(a, bool) for a in red.allowed]
    work = [np.where(a, w, np.inf) for a, w in zip(allowed, red.work)]
    floor = max((float(w.min()) for w in work), default=0.0)
    caps = np.unique(np.concatenate([w[(w >= floor) & np.isfinite(w)] for w in work] or [np.zeros(1)]))[:64]
    best = None
    for cap in caps:
        masks = [a & (w <= cap) for a, w in zip(allowed, work)]
        total = cap + sum(float(np.where(m, mem, np.inf).min()) for m, mem in zip(masks, red.memory))
        if best is None or total < best[0]:
            best = (total, masks)
    return solve(red.memory, [], None, None, best[1] if best else red.allowed, time_limit=time_limit)


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


def assemble(problem: Problem, choice: dict):
    """Per-node choices, the collectives they imply and the predicted step time and memory."""
    mesh = problem.mesh
    nodes: dict[int, NodeChoice] = {}
    collectives = []
    compute = 0.0
    comm = [0.0] * mesh.ndim
    memory = dict.fromkeys(CATEGORIES, 0.0)
    grad_sums = {}
    edges_into: dict = {}
    for e in problem.edges:  # a data edge belongs to its consumer, a gradient edge to its tensor's producer
        owner = e.b if e.kind == "data" else (e.b if e.kind == "grad_out" else problem.nodes[e.b].source[0])
        edges_into.setdefault(owner, []).append(e)
    backward = {}   # op index -> (its backward compute, the synchronous communication of its backward)
    forward = {}    # op index -> its forward compute and synchronous forward communication
    gathers = {}    # op index -> seconds of the prefetchable weight gathers it waits for
    bucketed = {}   # op index -> seconds of gradient buckets that become ready when its backward ends
    first_reader = _first_readers(problem)
    for pn in problem.nodes:
        i = choice[pn.index]
        s = problem.nodes[pn.rep].strategies[i]
        c = problem.choices[pn.rep][i]
        compute += c.compute
        if pn.kind == "op":
            fwd = c.forward_s - sum(c.comm) / 2
            backward[pn.index] = [c.compute - fwd, sum(c.comm) / 2]
            forward[pn.index] = fwd + sum(c.comm) / 2
        if pn.kind == "param" and s.zero:  # ZeRO-1/2: updated weights all-gathered after the step
            for st in problem.zero_gather_steps(pn, s):
                comm[st.axis] += st.seconds
                collectives.append(Collective("all_gather", (mesh.axis_names[st.axis],), st.nbytes, "step",
                                              pn.param_name, pn.param_name, st.seconds, st.algorithm))
        else:
            for a, t in enumerate(c.comm):
                comm[a] += t
                if t:
                    collectives.append(Collective("all_reduce", (mesh.axis_names[a],), 0.0, "forward", pn.name,
                                                  pn.name, t))
        for k, v in c.memory.items():
            memory[k] += v
        edge_comm = 0.0
        for e in edges_into.get(pn.index, ()):
            fwd, bwd = problem.edge_steps(problem.rep_edge(e), choice[e.a], choice[e.b])
            src = problem.nodes[e.a] if e.kind == "data" else problem.nodes[e.b]
            param = problem.nodes[e.a] if e.kind == "data" else (pn if pn.kind == "param" else None)
            prefetched = (e.kind == "data" and param is not None and param.kind == "param" and len(fwd) == 1
                          and fwd[0].kind == "all_gather")   # the runtime prefetches exactly these
            for phase, steps in (("forward", fwd), ("backward", bwd)):
                for st in steps:
                    if phase == "forward" and pn.index in forward:
                        if prefetched:
                            gathers[pn.index] = gathers.get(pn.index, 0.0) + st.seconds
                        else:
                            forward[pn.index] += st.seconds
                    comm[st.axis] += st.seconds
                    edge_comm += st.seconds
                    if phase == "backward" and st.bucketed and st.kind != "all_gather":   # a gradient bucket
                        at = pn.index if e.kind == "data" else first_reader.get(param.index)
                        bucketed[at] = bucketed.get(at, 0.0) + st.seconds
                    elif phase == "backward" and pn.index in backward:
                        backward[pn.index][1] += st.seconds
                    collectives.append(Collective(st.kind, (mesh.axis_names[st.axis],), st.nbytes, phase,
                                                  pn.name, src.param_name or src.name, st.seconds, st.algorithm))
        if pn.kind == "gradsum":
            src, out = pn.source
            grad_sums[f"{problem.nodes[src].name}:{out}"] = s.outputs[0]
            continue
        nodes[pn.index] = NodeChoice(pn.name, pn.op, pn.module if pn.kind != "param" else pn.param_name,
                                     s.name, tuple(s.split), tuple(s.inputs), tuple(s.outputs), tuple(s.grads),
                                     c.compute, sum(c.comm) + edge_comm, sum(c.memory.values()), tuple(s.reduced))
    modes = getattr(choice, "modes", None)
    costs = mode_costs(problem, modes) if modes else None
    if costs is not None:  # recomputed layers: their forward run again
        compute += costs.seconds(choice)
    memory["activations"], memory["working"], _ = beyond_linear(problem, choice, costs)
    comm_by_axis = {mesh.axis_names[a]: comm[a] for a in range(mesh.ndim)}
    # a CPU rank's collectives reduce on the cores its compute uses: nothing is hidden there
    overlap = mesh.device.asynchronous
    prefetch = hidden_prefetch_seconds(forward, gathers) if overlap else 0.0
    hidden = (hidden_gradient_seconds(backward, bucketed) if overlap else 0.0) + prefetch
    predicted = Prediction(compute + sum(comm) - hidden, compute, comm_by_axis, memory, hidden,
                           sum(bucketed.values()) + sum(gathers.values()), prefetch, sum(gathers.values()))
    return nodes, collectives, predicted, grad_sums



def _first_readers(problem: Problem) -> dict:
    """Parameter node index -> the first op (in forward order) that reads it: its gradient is
    whole once that op's backward has run."""
    out = {}
    for pn in problem.nodes:
        if pn.kind == "op":
            for src, _ in pn.inputs:
                out.setdefault(src, pn.index)
    return out


def hidden_prefetch_seconds(forward: dict, gathers: dict) -> float:
    """How much of the weight gathers forward hides (autopar/runtime/reshard.py): two streams, the
    device running each op's forward (compute and synchronous communication) in order, and
    the communication stream gathering weights one ahead: the first gather runs when its
    op is reached, and each gather starts the next one, which runs while the ops up to its
    reader compute.  An op waits for its own gather; what the stream did meanwhile is
    hidden."""
    clock = busy = 0.0
    ready = {}
    readers = sorted(i for i, t in gathers.items() if t > 0)
    nxt = dict(zip(readers, readers[1:]))
    free = 0.0
    for index in sorted(set(forward) | set(readers)):
        if index in gathers and gathers[index] > 0:
            clock = max(clock, ready[index]) if index in ready else clock + gathers[index]
            if index in nxt:
                after = nxt[index]
                free = ready[after] = max(free, clock) + gathers[after]
        own = forward.get(index, 0.0)
        clock += own
        busy += own
    return max(0.0, sum(gathers.values()) - (clock - busy))


def hidden_gradient_seconds(backward: dict, bucketed: dict) -> float:
    """How much of the bucketed gradient communication backward hides: two streams, the
    device running each op's backward (its compute and synchronous communication) in
    reverse forward order, and the communication stream reducing each gradient bucket once
    the backward of its parameter's first reader has run and the stream is free.  Backward
    ends when both have finished; what the bucket stream did before that is hidden."""
    clock = free = 0.0
    total = 0.0
    for index in sorted(set(backward) | set(bucketed), reverse=True):
        own, sync = backward.get(index, (0.0, 0.0))
        clock += own + sync
        seconds = bucketed.get(index, 0.0)
        if seconds:
            free = max(free, clock) + seconds
            total += seconds
    return max(0.0, total - max(0.0, free - clock))


def step_lower_bound(problem: Problem, time_limit: float) -> float:
    """Seconds no plan of `problem` that the planner can return (under any budget, with any
    recomputation) is predicted to beat.  A plan's step (assemble) is compute + S + O -
    hidden, O being its gradient buckets and prefetched weight gathers, S the rest of its
    communication; the hidden part is at most O and at most what the device stream runs
    (compute + S), so step >= max(compute + S, O) >= a (compute + S) + (1 - a) O for any a
    in [0, 1].  For a in {1, 3/4, 1/2} the least of that sum over every plan, with identical
    layers free to alternate (period 2 holds period 1's plans), no memory budget and no
    memory tie-break, is a bound; the largest of the three is returned.  Recomputing only
    adds time.  Exact eliminations solve each (a transformer costs no ILP)."""
    bound = 0.0
    for a in (1.0, 0.75, 0.5):
        hidden = (2 * a - 1) / a   # a (compute + S) + (1 - a) O = a (compute + S + O - hidden O)
        red = reduce_problem(problem.overlapped(hidden, hidden), None, 2)
        bound = max(bound, a * solve(red.costs, red.edges, None, None, red.allowed, time_limit=time_limit).objective)
    return bound
