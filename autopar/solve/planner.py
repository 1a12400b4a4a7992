"""autopar.plan: trace, build the strategy menus and costs, solve the ILP, return a Plan."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import logging
import random
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from autopar.cost.precision import MixedPrecision
from autopar.deprecations import REMOVED_IN, AutoparDeprecationWarning, moved_keywords
from autopar.mesh import Mesh, parse_bytes
from autopar.report.plan import ParamState, Plan, SolverStats, Timing
from autopar.solve.assemble import assemble
from autopar.solve.infeasible import infeasible_error
from autopar.solve.layout_checks import check_layout, compare_layouts, faster_layout
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.placements import same_local_shape
from autopar.solve.problem.menus import HEADS_NOTE
from autopar.solve.overlap import solve_problem, step_lower_bound
from autopar.solve.pipeline.options import Pipeline
from autopar.solve.pipeline.costs import stage_problem
from autopar.solve.pipeline.search import search
from autopar.solve.problem.pricing import Pricing
from autopar.solve.problem.problem import Problem
from autopar.solve.recompute.modes import check_mode, recompute_record
from autopar.solve.built import Built, build_problem
from autopar.solve.forked import forked_map, worker_count
from autopar.solve.ilp.solved import SolveOptions
from autopar.solve.recompute.tiers import TierCapacityError, fill_device, within_tiers
from autopar.trace.batching import batch_size
from autopar.ops import op_arg
from autopar.trace.experts import measure_routing
from autopar.trace.export import graph_signature

log = logging.getLogger("autopar")


@dataclass(frozen=True)
class Request:
    """What autopar.plan (or autopar.random_plans) was asked, read once: the model's example
    inputs (the global batch), the memory budget in bytes per device (None: the device's
    memory), how to search (SolveOptions: time limit, workers, comparison, layout), the
    precision, the pipeline (None: no search; an autopar.Pipeline, possibly empty: its fixed
    fields), the recomputation policy, what the step is priced for (Pricing, its MoE
    imbalance measured where asked) and the random seeds (None: the best plan)."""

    example_inputs: tuple
    example_kwargs: dict | None
    budget: float | None
    options: SolveOptions
    mixed_precision: MixedPrecision | None
    pipeline: Pipeline | None
    searched: bool            # pipeline=True: the search may also answer "no pipeline"
    recompute: str | None
    pricing: Pricing
    seeds: tuple | None = None

    @property
    def compare(self) -> bool:
        return self.options.compare

    @property
    def layout(self) -> str | None:
        return self.options.layout


# old keywords of plan() and random_plans() -> (the record keyword, its class, its field)
PLAN_MOVES = {**{k: ("solve", SolveOptions, k) for k in ("compare", "time_limit", "workers", "layout")},
              **{k: ("pricing", Pricing, k) for k in ("backend", "accumulation", "tp_overlap", "moe_imbalance")}}


@moved_keywords("autopar.plan", PLAN_MOVES)
def plan(model: torch.nn.Module, mesh: Mesh, example_inputs=(), *, example_kwargs=None, memory_budget=None,
         mixed_precision=None, pipeline=False, recompute=None, pricing: Pricing | None = None,
         solve: SolveOptions | None = None) -> Plan:
    """Choose a sharding for every node of `model` on `mesh`.

    example_inputs: tensors (real, fake or meta) of the global batch, as the model's forward
    takes them (example_kwargs: its keyword inputs).  memory_budget: bytes per device
    ('70GiB' works); None means the device's memory.
    mixed_precision: an autopar.MixedPrecision (or "bf16", "fp16", a torch dtype); costs and
    memory are then those of the low-precision compute with float32 master weights.
    pipeline: True to also search pipeline stages (autopar.solve.pipeline.search): when cutting
    the model into stages is faster, the plan returned is each stage's plan on its sub-mesh
    for one microbatch, and `plan.pipeline` says how many stages, where they are cut, the
    schedule and the microbatch count.  An autopar.Pipeline fixes some of those (axis,
    groups, schedule, microbatches, virtual) and always pipelines.
    recompute: None lets the ILP choose activation recomputation per set of identical
    layers (autopar/solve/recompute/modes.py) when the budget needs it; "none", "selective" or "full"
    forces that policy on every repeated layer (for comparisons).  With pipeline=..., the
    search picks one policy for every layer of the stages (the fastest that fits).
    pricing: an autopar.Pricing, what the step is priced for and runs as: the backend
    ("eager" or "inductor"), gradient accumulation, tensor-parallel overlap, MoE routing
    imbalance (plan.backend, plan.accumulation, plan.tp_overlap record it).
    solve: an autopar.SolveOptions, how to search: the ILP's time limit, worker processes,
    whether to also solve the hand-written layouts (plan.compare), and optionally one
    hand-written layout to stay within.
    Random valid plans, for testing the passes: autopar.random_plans.
    """
    request = _request(model, example_inputs, example_kwargs, memory_budget, mixed_precision, pipeline, recompute,
                       pricing, solve, None)
    with _collector_spared():
        return _warned(_plan(model, mesh, request))[0]


REQUEST_KEYWORDS = tuple(p.name for p in inspect.signature(plan).parameters.values() if p.kind is p.KEYWORD_ONLY)


@moved_keywords("autopar.random_plans", PLAN_MOVES)
def random_plans(model: torch.nn.Module, mesh: Mesh, example_inputs=(), *, seeds=(0,), **request) -> list[Plan]:
    """Random valid plans of `model` on `mesh`, one per seed in `seeds`: every node's strategy
    drawn uniformly from its menu (from what SolveOptions(layout=...) allows of it, when one
    is named), for testing the passes; each plan's origin is "random:<seed>".  The model is
    traced and costed once.  `request`: autopar.plan's keywords (REQUEST_KEYWORDS), meaning
    what they mean there; with pipeline=..., the stages are searched as plan() does and the
    one seed draws the stages' plan."""
    drawn = _seeds(seeds, request)
    unknown = sorted(set(request) - set(REQUEST_KEYWORDS))
    if unknown:
        raise TypeError(f"autopar.random_plans got {', '.join(k + '=' for k in unknown)}: it takes seeds= and "
                        f"autopar.plan's keywords ({', '.join(REQUEST_KEYWORDS)})")
    if request.get("pipeline", False) is not False and len(drawn) != 1:
        raise ValueError(f"random_plans with pipeline=... draws one plan of the stages, not {len(drawn)}: "
                         f"pass one seed")
    built = _request(model, example_inputs, seeds=drawn, **request)   # (_request's defaults are plan's)
    with _collector_spared():
        return _warned(_plan(model, mesh, built))


def _seeds(seeds, request: dict) -> tuple:
    """random_plans' seeds, from seeds= or the old seed=/count= (deprecated: they fold into
    seeds=range(seed, seed + count)), checked non-empty."""
    if "seed" in request or "count" in request:
        start, count = request.pop("seed", 0), request.pop("count", 1)
        warnings.warn(f"autopar.random_plans(seed=, count=) is deprecated and goes in release {REMOVED_IN}: pass "
                      f"seeds=range({start}, {start + count})", AutoparDeprecationWarning, stacklevel=4)
        seeds = range(start, start + count)
    drawn = tuple(seeds)
    if not drawn:
        raise ValueError("autopar.random_plans: seeds= is empty; give at least one seed")
    return drawn


def _warned(plans: list) -> list:
    """Log once what the plans' notes say a user must know: attention heads an axis cannot
    split (why tensor parallelism stops short there)."""
    for note in dict.fromkeys(n for p in plans for n in p.notes if HEADS_NOTE in n):
        log.warning("autopar: %s", note)
    return plans


def _request(model, example_inputs, example_kwargs=None, memory_budget=None, mixed_precision=None, pipeline=False,
             recompute=None, pricing=None, solve=None, seeds=None) -> Request:
    """The request plan() and random_plans() were given, checked, with "measured" MoE
    imbalance measured on the example batch."""
    budget = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else None
    pricing = pricing if pricing is not None else Pricing()
    solve = solve if solve is not None else SolveOptions()
    for name, value, cls in (("pricing", pricing, Pricing), ("solve", solve, SolveOptions)):
        if not isinstance(value, cls):
            raise TypeError(f"autopar.plan({name}={value!r}): give an autopar.{cls.__name__}(...) or None")
    if pricing.accumulation > 1 and not (pipeline is False or pipeline is None):
        raise ValueError(f"Pricing(accumulation={pricing.accumulation}) with pipeline=...: a pipelined step already "
                         f"accumulates over its microbatches; give the count as autopar.Pipeline(microbatches=...) "
                         f"instead")
    if isinstance(pricing.moe_imbalance, str):   # "measured": {experts' ways: busiest rank over the mean}
        pricing = dataclasses.replace(pricing, moe_imbalance=measure_routing(model, tuple(example_inputs),
                                                                             dict(example_kwargs or {})))
    return Request(example_inputs, example_kwargs, budget, solve, MixedPrecision.of(mixed_precision),
                   None if pipeline is False or pipeline is None else (Pipeline() if pipeline is True else pipeline),
                   pipeline is True, check_mode(recompute), pricing, seeds)


def _plan(model, mesh, request: Request) -> list[Plan]:
    """The plan (or the random plans) `request` asks for, in a list."""
    if request.pipeline is not None:
        return [_plan_with_pipeline(model, mesh, request)]
    start = time.perf_counter()
    built = build_problem(model, mesh, request.example_inputs, request.example_kwargs, request.mixed_precision,
                          pricing=request.pricing)
    return _plans_built(built, model, mesh, request, start, request.recompute)


_SPARED = {"depth": 0, "restore": None}   # plans in progress (threads, nested calls); how to restore gc
_SPARED_LOCK = threading.Lock()


@contextlib.contextmanager
def _collector_spared():
    """Planning with Python's cyclic collector kept off what was alive before it (the model,
    torch: gc.freeze) and off full passes: those re-scan every object the process holds,
    the traces planning keeps included, a quarter of llama3-8b's 2 s plan.  Young garbage is
    still collected; the collector is as it was once the last plan in progress ends.  (A
    process that froze objects itself keeps its own arrangement.)"""
    with _SPARED_LOCK:
        if _SPARED["depth"] == 0:
            frozen = gc.get_freeze_count() == 0
            _SPARED["restore"] = (gc.get_threshold(), frozen)
            if frozen:
                gc.freeze()
            gc.set_threshold(*gc.get_threshold()[:2], 1 << 30)
        _SPARED["depth"] += 1
    try:
        yield
    finally:
        with _SPARED_LOCK:
            _SPARED["depth"] -= 1
            if _SPARED["depth"] == 0:
                thresholds, frozen = _SPARED["restore"]
                gc.set_threshold(*thresholds)
                if frozen:
                    gc.unfreeze()


def _plans_built(built: Built, model, mesh: Mesh, request: Request, start, recompute,
                 staged=False, stage_layout=None) -> list[Plan]:
    """_plan_built, or the random plans when the request has seeds, in a list."""
    if request.seeds is None:
        return [_plan_built(built, model, mesh, request, start, recompute, staged, stage_layout)]
    every = check_layout(built.problem, model, mesh, request.layout)
    rule = every.get(request.layout) if request.layout is not None else None
    return [_make_plan(built.problem, model, mesh, _random_choice(built.problem, s, rule), None, f"random:{s}", {},
                       request.budget, Timing(trace_s=built.trace_s, costs_s=built.costs_s,
                                              total_s=time.perf_counter() - start))
            for s in request.seeds]


def _plan_built(built: Built, model, mesh: Mesh, request: Request, start, recompute, staged=False,
                stage_layout=None) -> Plan:
    """plan() from a traced and costed problem (the pipeline search's, when it made one).
    recompute: the policy (the request's, or the one the search chose for the stages).
    staged: the problem is one microbatch of a pipelined model, whose stages' memory the
    pipeline search checked: the whole model is then planned without a budget, in the
    hand-written `stage_layout` where the search priced the stages in one."""
    problem, layout, options = built.problem, request.layout, request.options
    limit = request.budget if request.budget is not None else mesh.device.memory
    every = check_layout(problem, model, mesh, layout)
    rule = every.get(layout if layout is not None or not staged else stage_layout)
    try:
        plain_modes = layout is None and recompute in (None, "none")
        best = built.known(staged, stage_layout if staged else None) if plain_modes else None
        if best is None:
            # (the unbudgeted summed optimum, when it fits, is the budgeted one's first step)
            best = solve_problem(problem, rule, None if layout or staged else limit, options,
                                 recompute=recompute,
                                 summed=built.first_step(limit) if plain_modes and rule is None else None,
                                 free=built.free() if plain_modes and rule is None else None)
        best = within_tiers(problem, best, rule, lambda allowed: solve_problem(
            problem, allowed, None if layout or staged else limit, options, recompute=recompute))
        best = fill_device(problem, best, rule, None if layout or staged else limit)
    except TierCapacityError:   # (its own message says what to do)
        raise
    except InfeasibleError:
        raise infeasible_error(problem, model, mesh, limit, options, recompute) from None
    choice, compared = best.choice, {}
    if request.compare:
        compared, choices = compare_layouts(problem, mesh, options, recompute)
        if layout is None and not staged:
            choice = faster_layout(problem, choice, compared, choices, limit)
    timing = Timing(trace_s=built.trace_s, costs_s=built.costs_s, solve_s=best.solution.seconds,
                    total_s=time.perf_counter() - start)
    origin = "ilp" if layout is None else f"layout:{layout}"
    result = _make_plan(problem, model, mesh, choice, best.solution, origin, compared, request.budget, timing,
                        recompute)
    log.info("planned %s on %s in %.2fs (trace %.2fs)", type(model).__name__, mesh, time.perf_counter() - start,
             built.trace_s)
    return result


def _plan_with_pipeline(model, mesh, request: Request) -> Plan:
    """The pipeline search's plan: the winner's stage plan with its PipelineLayout, or the
    plan without stages when that is not slower.  A forked process plans the plan without
    stages while this one plans the stages (gpt2-1.5b on 64 H100: 0.2 of 2.8 s), or, where
    it must first be bounded (_plain_plan), solves the bound's three solves (405B-shaped on
    16,384 devices: 5 s of the plan's 37)."""
    start = time.perf_counter()
    fixed = None if request.searched else request.pipeline
    choice = search(model, mesh, request.example_inputs, request.example_kwargs, memory_budget=request.budget,
                    options=request.options, fixed=fixed, mixed_precision=request.mixed_precision,
                    recompute=request.recompute, pricing=request.pricing, layout=request.layout)
    contest = choice.axis is not None and fixed is None and choice.plain is not None
    staged = None
    if contest:   # (the stage plan here, beside the plain plan's bound or, unbounded, the plain plan itself)
        clear = _clearly_slower(choice)
        tasks = [lambda: _staged_or_error(model, mesh, request, choice),
                 (lambda: step_lower_bound(choice.plain.problem, request.options)) if clear else
                 (lambda: _plain_or_error(model, mesh, request, choice))]
        if worker_count(request.options.workers) > 1:
            staged, other = forked_map(lambda task: task(), tasks, 2)
        else:   # (one process: the stage plan only where the plain plan does not win)
            other = tasks[1]()
        if isinstance(other, Exception):
            raise other
        plain = _plain_plan(model, mesh, request, choice, other) if clear else other
        if plain is not None and plain.predicted.step_s <= choice.step_s:
            log.info("the plan without stages (%.4g ms) is not slower than the best pipeline (%.4g ms): keeping it",
                     plain.predicted.step_s * 1e3, choice.step_s * 1e3)
            summary = (f"pipeline: none (the best of {choice.candidates} pipelined layouts, {choice.step_s * 1e3:.1f} "
                       f"ms, was not faster than {plain.predicted.step_s * 1e3:.1f} ms without stages)")
            info = choice.unpipelined(mesh, plain.predicted).layout(mesh, summary)
            timing = dataclasses.replace(plain.timing, pipeline_search_s=choice.seconds,
                                         total_s=time.perf_counter() - start)
            return dataclasses.replace(plain, pipeline=info, timing=timing)
        if plain is not None:
            choice = dataclasses.replace(choice, no_pipeline_s=plain.predicted.step_s)
    result = staged if staged is not None else _staged_or_error(model, mesh, request, choice)
    if isinstance(result, Exception):
        raise result
    timing = dataclasses.replace(result.timing, pipeline_search_s=choice.seconds, total_s=time.perf_counter() - start)
    return dataclasses.replace(result, pipeline=choice.layout(mesh), timing=timing)


def _staged_or_error(model, mesh, request: Request, choice) -> Plan | Exception:
    """The plan of the search's winner (one stage's problem, or the whole mesh's without
    stages), or the error planning it raised (raised by the caller where it is kept)."""
    try:
        built = choice.built  # the winner's problem, as the search traced, costed and solved it
        if built is None:  # (a candidate whose problem was dropped while a better one led, or a worker's)
            built = stage_problem(model, mesh, request.example_inputs, request.example_kwargs,
                                  request.mixed_precision, tuple(choice.submesh),
                                  batch_size(request.example_inputs, request.example_kwargs) // choice.n_microbatches,
                                  request.pricing)
        staged = choice.axis is not None
        return _plans_built(built, model, built.problem.mesh, request, time.perf_counter(),
                            choice.recompute if staged else request.recompute, staged,
                            choice.stage_layout if staged else None)[0]
    except Exception as exc:   # noqa: BLE001 (kept for the caller, which raises it where the plan is kept)
        return exc


def _plain_or_error(model, mesh, request: Request, choice) -> Plan | None | Exception:
    """_plain_plan unbounded, or the error it raised (raised by the caller)."""
    try:
        return _plain_plan(model, mesh, request, choice, 0.0)
    except Exception as exc:   # noqa: BLE001 (kept for the caller, which raises it where the plan is kept)
        return exc


def _clearly_slower(choice) -> bool:
    """Whether the search's own estimate of the plan without stages is clearly slower than
    the best pipeline: only then is it bounded before it is planned (_plain_plan)."""
    return choice.no_pipeline_s > 1.1 * choice.step_s


def _plain_plan(model, mesh, request: Request, choice, bound: float) -> Plan | None:
    """The search never loses: the plain plan, planned as pipeline=False plans it (under the
    budget, with ZeRO and recomputation chosen by the ILP), to keep when it is not slower
    than the best pipeline; None where it is not planned: no plan without stages can be as
    fast as the pipeline (`bound`: overlap.step_lower_bound, three solves, asked only where
    the search's own estimate of the plain plan is clearly slower than the pipeline; else
    0), or none fits."""
    if bound > choice.step_s * (1 + 1e-6):
        log.info("no plan without stages can beat the best pipeline (%.4g ms): any takes at least %.4g ms "
                 "(overlap.step_lower_bound)", choice.step_s * 1e3, bound * 1e3)
        return None
    try:
        return _plans_built(choice.plain, model, mesh, request, time.perf_counter(), request.recompute)[0]
    except InfeasibleError:
        return None


def _make_plan(problem, model, mesh, choice, sol, origin, compared, budget, timing, recompute=None) -> Plan:
    assembled = assemble(problem, choice)
    nodes, predicted = assembled.nodes, assembled.predicted
    chosen = recompute_record(problem, choice, predicted, recompute)
    parts = problem.traced.parts
    params, states = {}, {}
    for pn in problem.nodes:
        if pn.kind == "param":
            params[pn.param_name] = nodes[pn.index].outputs[0]
            s = problem.nodes[pn.rep].strategies[choice[pn.index]]
            if s.zero or s.offload:   # (s.offload: the tier, "host" or "disk")
                states[pn.param_name] = ParamState(s.zero, tuple(mesh.axis_names[a] for a in s.zero_axes), s.offload,
                                                      s.offload_weights)
    solver = SolverStats(len(problem.nodes), len(problem.choices))
    if sol is not None:
        solver = dataclasses.replace(solver, optimal=sol.optimal, gap=sol.gap, objective_s=sol.objective,
                                     bound_s=sol.bound, variables=sol.variables, constraints=sol.constraints)
    return Plan(mesh=mesh, model=type(model).__name__,
                param_placements=_order_params(model, params, parts), nodes=tuple(nodes[i] for i in sorted(nodes)),
                collectives=assembled.collectives, predicted=predicted, solver=solver, baselines=compared,
                memory_budget=budget, fallback_ops=tuple(problem.fallback_ops),
                layers=tuple((p, tuple(ix)) for p, ix in problem.layer_groups), grad_sums=assembled.grad_sums,
                origin=origin, timing=timing, param_states={k: states[k] for k in _order_params(model, states, parts)},
                precision=problem.precision,
                frozen=tuple(n for n, p in model.named_parameters() if not p.requires_grad),
                graph=graph_signature(problem.traced.graph),
                notes=tuple(m.removeprefix("autopar: ") for m in problem.warnings
                            if not m.startswith("autopar: no sharding rule")) + _routing_notes(problem, choice),
                recompute=chosen, backend=problem.pricing.backend, accumulation=problem.pricing.accumulation,
                tp_overlap=problem.pricing.tp_overlap)


def _routing_notes(problem, choice) -> tuple:
    """What a mixture-of-experts plan's price assumes about routing: the busiest expert
    rank's rows over the mean, as priced (NodePrices.routing_factor)."""
    factors = [problem.node_prices.routing_factor(pn, problem.nodes[pn.rep].strategies[choice[pn.index]])
               for pn in problem.nodes if pn.kind == "op" and pn.op == "autopar.experts"]
    split = [f for f in factors if f > 1.0]
    if not split:
        return ()
    if isinstance(problem.pricing.moe_imbalance, dict):
        how = "measured on the example batch: " + ", ".join(
            f"{f:.3f} over {ways} ranks" for ways, f in problem.pricing.moe_imbalance.items())
    elif problem.pricing.moe_imbalance is not None:
        how = f"moe_imbalance={problem.pricing.moe_imbalance:g}"
    else:
        how = ("uniformly random routing of this batch; a trained router is seldom as even: say how uneven "
               "with autopar.plan(moe_imbalance=...)")
    capped = [float(op_arg(pn.node, 11, "capacity", 0.0) or 0.0) for pn in problem.nodes
              if pn.kind == "op" and pn.op == "autopar.experts"]
    capped = [c for c in capped if c > 0]
    if capped:
        how += (f"; the router caps each expert at {min(capped):.3f}x the mean rows (its capacity: rows past it are "
                f"dropped), so no rank is priced above that")
    return (f"experts priced as long as their busiest rank: {max(split):.3f}x the mean rows ({how})",)


def _order_params(model, params: dict, parts) -> dict:
    """Parameter names in `model.named_parameters()` order (a fused weight's parts in its
    place); tied weights appear once, as there."""
    out = {}
    for name in parts.named_parameters(model):
        if name in params:
            out[name] = params[name]
    for name, p in params.items():
        out.setdefault(name, p)
    return out


def _random_choice(problem: Problem, seed: int, rule=None) -> dict:
    """Every node (each layer on its own) takes a strategy drawn uniformly from its menu, or
    from what the layout's `rule` allows of it (the whole menu where it allows nothing: the
    rule does not speak to that node, as for the ILP)."""
    rng = random.Random(seed)
    choice = {}
    for pn in problem.nodes:
        rep = problem.nodes[pn.rep]
        menu = rep.strategies
        ok = list(range(len(menu)))
        if rule is not None:
            ok = [i for i in ok if rule(problem, rep, menu[i])] or ok
        if pn.kind == "gradsum":  # a sum autograd can do: the tensor's own local shape
            src, out = pn.source
            p = problem.nodes[problem.nodes[src].rep].strategies[choice[src]].outputs[out]
            ok = [i for i in ok if same_local_shape(menu[i].outputs[0], p)] or [
                i for i in range(len(menu)) if same_local_shape(menu[i].outputs[0], p)]
        choice[pn.index] = rng.choice(ok)
    return choice
