"""autopar.plan: trace, build the strategy menus and costs, solve the ILP, return a Plan."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import random
import threading
import time
from dataclasses import dataclass

import torch

from autopar.cost.precision import MixedPrecision
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
from autopar.report.records import check_backend
from autopar.solve.problem.pricing import Pricing
from autopar.solve.problem.problem import Problem
from autopar.solve.recompute.modes import check_mode, recompute_record
from autopar.solve.built import Built, build_problem
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
    memory), whether to compare the hand-written layouts, how to solve (SolveOptions), the
    layout to stay within, the precision, the pipeline (None: no search; an
    autopar.Pipeline, possibly empty: its fixed fields), the recomputation policy, and the
    random seeds (None: the best plan, not random ones)."""

    example_inputs: tuple
    example_kwargs: dict | None
    budget: float | None
    compare: bool
    options: SolveOptions
    layout: str | None
    mixed_precision: MixedPrecision | None
    pipeline: Pipeline | None
    searched: bool            # pipeline=True: the search may also answer "no pipeline"
    recompute: str | None
    seeds: tuple | None = None
    moe_imbalance: float | dict | None = None   # a number, or measured: {ways: factor}
    backend: str = "eager"                      # what the plan is priced for (Problem's Pricing)
    accumulation: int = 1                       # micro-steps per optimizer step (Problem's Pricing)
    tp_overlap: bool = True                     # TP collectives beside their GEMMs (Problem's Pricing)

    @property
    def pricing(self) -> Pricing:
        return Pricing(self.moe_imbalance, self.backend, self.accumulation, self.tp_overlap)


def plan(model: torch.nn.Module, mesh: Mesh, example_inputs=(), *, example_kwargs=None,
         memory_budget=None, compare: bool = True, time_limit: float = 60.0, workers: int | None = None,
         layout: str | None = None, mixed_precision=None, pipeline=False, recompute=None,
         moe_imbalance: float | str | None = None, backend: str = "eager", accumulation: int = 1,
         tp_overlap: bool = True) -> Plan:
    """Choose a sharding for every node of `model` on `mesh`.

    example_inputs: tensors (real, fake or meta) of the global batch, as the model's forward
    takes them.  memory_budget: bytes per device ('70GiB' works); None means the device's
    memory.  compare: also cost the hand-written layouts (data parallel, ZeRO-3, Megatron).
    time_limit: CP-SAT's deterministic seconds per ILP; workers: processes that plan at
    once (None: $AUTOPAR_WORKERS, else the cores this process may use; the plan is the same
    for any number).
    layout: instead of the best plan, the best plan within one hand-written layout (a name
    from `autopar.solve.layouts.layouts(mesh)`, e.g. "data-parallel").
    mixed_precision: an autopar.MixedPrecision (or "bf16", "fp16", a torch dtype); costs and
    memory are then those of the low-precision compute with float32 master weights.
    pipeline: True to also search pipeline stages (autopar.solve.pipeline_search): when cutting
    the model into stages is faster, the plan returned is each stage's plan on its sub-mesh
    for one microbatch, and `plan.pipeline` says how many stages, where they are cut, the
    schedule and the microbatch count.  An autopar.Pipeline fixes some of those (axis,
    groups, schedule, microbatches, virtual) and always pipelines; `layout` then applies to
    the stages' plan.
    recompute: None lets the ILP choose activation recomputation per set of identical
    layers (autopar/solve/recompute.py) when the budget needs it; "none", "selective" or "full"
    forces that policy on every repeated layer (for comparisons).  With pipeline=..., the
    search picks one policy for every layer of the stages (the fastest that fits).
    backend: what the plan is priced for: "eager" (every op reads, writes and launches on
    its own) or "inductor" (compile(backend="inductor"): chains of memory-bound ops priced
    as one fused kernel, views and fused ops issuing nothing on the host; plan.backend says
    which).
    accumulation: micro-steps per optimizer step, for a job that accumulates gradients
    (`with cm.no_sync():` around all but the last micro-step's backward); example_inputs
    are then one micro-step's batch.  The optimizer step, ZeRO-1/2's gathers after it and
    the gradient reductions run once per step, so each micro-step is charged 1/accumulation
    of them (a layout that shards optimizer states or reduces more costs less, per
    micro-step, than it does at 1), and a ZeRO-2 rank holds its whole local gradient
    between micro-steps.  The predicted step is one micro-step's; plan.accumulation says
    what it was priced for.  Not with pipeline stages, whose microbatches accumulate
    already (Pipeline(microbatches=...)).
    tp_overlap: True (the default) runs tensor-parallel collectives beside the GEMMs of
    their linears (an input gradient's collective while the weight gradient computes, a
    row-parallel output's in pieces; autopar/runtime/linear_grads.py) and prices what that
    hides on GPUs; False runs and prices them whole (plan.tp_overlap says which; compile
    follows the plan).
    moe_imbalance: for mixture-of-experts models, the busiest expert-holding rank's routed
    rows over the mean (dropless experts run as long as their busiest rank; a trained
    router is seldom even); "measured" runs the model once on the example batch (real
    tensors) and prices each split by the load its ranks would see
    (autopar.trace.experts.measure_routing); None prices uniformly random routing
    (autopar.cost.prices.routing_imbalance: close to 1 for large batches).
    Random valid plans, for testing the passes: autopar.random_plans.
    """
    moe_imbalance = _measured(model, moe_imbalance, example_inputs, example_kwargs)
    request = _request(example_inputs, example_kwargs, memory_budget, compare, time_limit, workers, layout,
                       mixed_precision, pipeline, recompute, None, moe_imbalance, backend, accumulation, tp_overlap)
    with _collector_spared():
        return _warned(_plan(model, mesh, request))[0]


def random_plans(model: torch.nn.Module, mesh: Mesh, example_inputs=(), *, seed: int = 0, count: int = 1,
                 seeds=None, example_kwargs=None, memory_budget=None, compare: bool = True,
                 time_limit: float = 60.0, workers: int | None = None, layout: str | None = None,
                 mixed_precision=None, pipeline=False, recompute=None,
                 moe_imbalance: float | str | None = None, backend: str = "eager",
                 accumulation: int = 1, tp_overlap: bool = True) -> list[Plan]:
    """`count` random valid plans of `model` on `mesh`, drawn with seeds seed, seed + 1, ...
    (or with `seeds`, when given): every node's strategy drawn uniformly from its menu (from
    what `layout` allows of it, when one is named), for testing the passes; each plan's
    origin is "random:<seed>".  The model is traced and costed once.  The other arguments
    are autopar.plan's; with pipeline=..., the stages are searched as plan() does and one
    seed draws the stages' plan (count 1)."""
    drawn = tuple(seeds) if seeds is not None else tuple(range(seed, seed + count))
    if not drawn:
        raise ValueError("random_plans: count must be at least 1 (or seeds non-empty)")
    if pipeline is not False and len(drawn) != 1:
        raise ValueError(f"random_plans with pipeline=... draws one plan of the stages, not {len(drawn)}: "
                         f"pass count=1 (or one seed)")
    moe_imbalance = _measured(model, moe_imbalance, example_inputs, example_kwargs)
    request = _request(example_inputs, example_kwargs, memory_budget, compare, time_limit, workers, layout,
                       mixed_precision, pipeline, recompute, drawn, moe_imbalance, backend, accumulation, tp_overlap)
    with _collector_spared():
        return _warned(_plan(model, mesh, request))


def _warned(plans: list) -> list:
    """Log once what the plans' notes say a user must know: attention heads an axis cannot
    split (why tensor parallelism stops short there)."""
    for note in dict.fromkeys(n for p in plans for n in p.notes if HEADS_NOTE in n):
        log.warning("autopar: %s", note)
    return plans


def _measured(model, moe_imbalance, example_inputs, example_kwargs):
    """moe_imbalance="measured": {experts' ways: busiest rank over the mean} of the sample batch."""
    if not (isinstance(moe_imbalance, str) and moe_imbalance == "measured"):
        return moe_imbalance
    return measure_routing(model, tuple(example_inputs), dict(example_kwargs or {}))


def _request(example_inputs, example_kwargs, memory_budget, compare, time_limit, workers, layout, mixed_precision,
             pipeline, recompute, seeds, moe_imbalance=None, backend="eager", accumulation=1,
             tp_overlap=True) -> Request:
    budget = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else None
    if not isinstance(tp_overlap, bool):
        raise ValueError(f"tp_overlap={tp_overlap!r}: True runs tensor-parallel collectives beside their GEMMs "
                         f"(and prices it), False runs them whole")
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(f"accumulation={accumulation!r}: give the micro-steps per optimizer step as a whole number "
                         f"of at least 1 (1: every step reduces gradients and steps the optimizer)")
    if accumulation > 1 and not (pipeline is False or pipeline is None):
        raise ValueError(f"accumulation={accumulation} with pipeline=...: a pipelined step already accumulates over "
                         f"its microbatches; give the count as autopar.Pipeline(microbatches=...) instead")
    if isinstance(moe_imbalance, dict):   # measured per number of expert-holding ranks
        moe_imbalance = dict(sorted(moe_imbalance.items()))
    elif moe_imbalance is not None:
        if isinstance(moe_imbalance, bool) or not isinstance(moe_imbalance, (int, float)) or not moe_imbalance >= 1:
            raise ValueError(f"moe_imbalance={moe_imbalance!r}: give the busiest expert rank's load over the mean "
                             f"load as a number of at least 1 (1.0: perfectly balanced routing; 1.5: the busiest "
                             f"rank gets half again its share), \"measured\" to measure it on the example batch, "
                             f"or None for uniformly random routing")
        moe_imbalance = float(moe_imbalance)
    return Request(example_inputs, example_kwargs, budget, compare, SolveOptions(time_limit, workers), layout,
                   MixedPrecision.of(mixed_precision), None if pipeline is False or pipeline is None
                   else (Pipeline() if pipeline is True else pipeline), pipeline is True, check_mode(recompute),
                   seeds, moe_imbalance, check_backend(backend), accumulation, tp_overlap)


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
        best = built.known(limit, staged, stage_layout if staged else None) if plain_modes else None
        if best is None:
            # (the unbudgeted summed optimum, when it fits, is the budgeted one's first step)
            best = solve_problem(problem, rule, None if layout or staged else limit, options,
                                 recompute=recompute,
                                 summed=built.first_step(limit) if plain_modes and rule is None else None)
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
    plan without stages when that is not slower."""
    start = time.perf_counter()
    fixed = None if request.searched else request.pipeline
    choice = search(model, mesh, request.example_inputs, request.example_kwargs, memory_budget=request.budget,
                    options=request.options, fixed=fixed, mixed_precision=request.mixed_precision,
                    recompute=request.recompute, pricing=request.pricing, layout=request.layout)
    if choice.axis is not None and fixed is None and choice.plain is not None:
        plain = _plain_plan(model, mesh, request, choice)
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
    built = choice.built  # the winner's problem, as the search traced, costed and solved it
    if built is None:  # (a candidate whose problem was dropped while a better one led, or a worker's)
        built = stage_problem(model, mesh, request.example_inputs, request.example_kwargs, request.mixed_precision,
                              tuple(choice.submesh),
                              batch_size(request.example_inputs, request.example_kwargs) // choice.n_microbatches,
                              request.pricing)
    staged = choice.axis is not None
    result = _plans_built(built, model, built.problem.mesh, request, time.perf_counter(),
                          choice.recompute if staged else request.recompute, staged,
                          choice.stage_layout if staged else None)[0]
    timing = dataclasses.replace(result.timing, pipeline_search_s=choice.seconds, total_s=time.perf_counter() - start)
    return dataclasses.replace(result, pipeline=choice.layout(mesh), timing=timing)


def _plain_plan(model, mesh, request: Request, choice) -> Plan | None:
    """The search never loses: the plain plan, planned as pipeline=False plans it (under the
    budget, with ZeRO and recomputation chosen by the ILP), to keep when it is not slower
    than the best pipeline; None where it is not planned: no plan without stages can be as
    fast as the pipeline (the bound costs three solves: asked only where the search's own
    estimate of the plain plan is clearly slower than the pipeline), or none fits."""
    clearly = choice.no_pipeline_s > 1.1 * choice.step_s
    bound = step_lower_bound(choice.plain.problem, request.options) if clearly else 0.0
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
