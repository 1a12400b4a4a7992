"""autopar.plan: trace, build the strategy menus and costs, solve the ILP, return a Plan."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import random
import threading
import time

import torch

from autopar.solve import layouts as B
from autopar.mesh import Mesh, parse_bytes
from autopar.trace.batching import batch_size
from autopar.solve.pipeline_search import search, stage_problem
from autopar.cost.precision import MixedPrecision
from autopar.plan.plan import ParamState, PipelineLayout, Plan, SolverStats, Timing
from autopar.solve.problem import Problem
from autopar.solve.menus import same_local_shape
from autopar.solve.recompute import check_mode, layer_slots, recompute_record
from autopar.solve.solution import (
    Built, assemble, build_problem, solve_problem, solve_summed, step_lower_bound)
from autopar.solve.ilp import InfeasibleError
from autopar.trace.export import graph_signature

log = logging.getLogger("autopar")


def plan(model: torch.nn.Module, mesh: Mesh, example_inputs=(), *, example_kwargs=None,
         memory_budget=None, compare: bool = True, time_limit: float = 60.0, layout: str | None = None,
         random_seed=None, mixed_precision=None, pipeline=False, recompute=None):
    """Choose a sharding for every node of `model` on `mesh`.

    example_inputs: tensors (real, fake or meta) of the global batch, as the model's forward
    takes them.  memory_budget: bytes per device ('70GiB' works); None means the device's
    memory.  compare: also cost the hand-written layouts (data parallel, ZeRO-3, Megatron).
    layout: instead of the best plan, the best plan within one hand-written layout (a name
    from `autopar.solve.layouts.layouts(mesh)`, e.g. "data-parallel").  random_seed: instead,
    a random valid plan (every node's strategy drawn from its menu): for testing the passes;
    a list of seeds gives a list of plans (the model is traced and costed once).
    mixed_precision: an autopar.MixedPrecision (or "bf16", "fp16", a torch dtype); costs and
    memory are then those of the low-precision compute with float32 master weights.
    pipeline: True to also search pipeline stages (autopar.solve.pipeline_search): when cutting
    the model into stages is faster, the plan returned is each stage's plan on its sub-mesh
    for one microbatch, and `plan.pipeline` says how many stages, where they are cut, the
    schedule and the microbatch count.  An autopar.Pipeline fixes some of those (axis,
    groups, schedule, microbatches, virtual) and always pipelines; `layout` and
    `random_seed` then apply to the stages' plan.
    recompute: None lets the ILP choose activation recomputation per set of identical
    layers (autopar/solve/recompute.py) when the budget needs it; "none", "selective" or "full"
    forces that policy on every repeated layer (for comparisons).  With pipeline=..., the
    search picks one policy for every layer of the stages (the fastest that fits).
    """
    with _collector_spared():
        return _plan(model, mesh, example_inputs, example_kwargs, memory_budget, compare, time_limit, layout,
                     random_seed, mixed_precision, pipeline, recompute)


def _plan(model, mesh, example_inputs, example_kwargs, memory_budget, compare, time_limit, layout, random_seed,
          mixed_precision, pipeline, recompute):
    mixed_precision = MixedPrecision.of(mixed_precision)
    recompute = check_mode(recompute)
    if pipeline:
        return _plan_with_pipeline(model, mesh, example_inputs, example_kwargs, memory_budget, compare,
                                   time_limit, mixed_precision, None if pipeline is True else pipeline,
                                   layout, random_seed, recompute)
    start = time.perf_counter()
    budget = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else None
    built = build_problem(model, mesh, example_inputs, example_kwargs, mixed_precision)
    return _plan_built(built, model, mesh, budget, compare, time_limit, layout, random_seed, start, recompute)


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


def _plan_built(built: Built, model, mesh: Mesh, budget, compare, time_limit, layout, random_seed, start,
                recompute=None, staged=False):
    """plan() from a traced and costed problem (the pipeline search's, when it made one).
    staged: the problem is one microbatch of a pipelined model, whose stages' memory the
    pipeline search checked: the whole model is then planned without a budget."""
    problem, t_trace, t_build = built.problem, built.trace_s, built.costs_s
    limit = budget if budget is not None else mesh.device.memory
    rules = B.layouts(mesh)
    every = B.layouts(mesh, every=True)
    if any(pn.op == "autopar.experts" for pn in problem.nodes):
        rules["expert-parallel"] = every["expert-parallel"]
    if layout is not None and layout not in every:
        raise ValueError(f"unknown layout {layout!r} for mesh {mesh}; choose one of {sorted(every)}")
    origin = "ilp" if layout is None else f"layout:{layout}"
    if layout is not None and B.unavailable(every[layout], problem):
        raise ValueError(f"layout {layout!r} is not possible for {type(model).__name__} on {mesh}: "
                         f"{B.unavailable(every[layout], problem)}")
    if random_seed is not None:
        seeds = [random_seed] if isinstance(random_seed, int) else list(random_seed)
        made = [_make_plan(problem, model, mesh, _random_choice(problem, s), None, f"random:{s}", {}, budget,
                           Timing(trace_s=t_trace, costs_s=t_build, total_s=time.perf_counter() - start))
                for s in seeds]
        return made[0] if isinstance(random_seed, int) else made
    try:
        plain_modes = layout is None and recompute in (None, "none")
        if plain_modes and staged and built.summed is not None:
            best, sol, _ = built.summed   # the plan the pipeline search priced its stages by
        elif plain_modes and built.solved is not None and built.solved[2] <= limit:
            best, sol, _ = built.solved  # the unbudgeted optimum fits: the budgeted one is the same
        else:
            # (the unbudgeted summed optimum, when it fits, is the budgeted one's first step)
            summed = built.summed if plain_modes and built.summed is not None and built.summed[2] <= limit else None
            best, sol, _ = solve_problem(problem, every.get(layout), None if layout or staged else limit,
                                         time_limit, recompute=recompute, summed=summed)
    except InfeasibleError:
        raise _infeasible(problem, model, mesh, limit, time_limit, recompute) from None
    compared, choices = {}, {}
    if compare:
        for name, rule in rules.items():
            if not B.relevant(name, problem):
                continue
            if B.unavailable(rule, problem):
                compared[name] = B.unavailable(rule, problem)
                continue
            try:
                # (summed, not re-solved for overlap: a hand-written layout leaves few choices)
                c, _, _ = solve_summed(problem, rule, None, time_limit, recompute=recompute)
                compared[name] = assemble(problem, c)[2]
                choices[name] = c
            except InfeasibleError as exc:
                compared[name] = str(exc)
        if layout is None and not staged:
            best = _faster_layout(problem, best, compared, choices, limit)
    timing = Timing(trace_s=t_trace, costs_s=t_build, solve_s=sol.seconds, total_s=time.perf_counter() - start)
    result = _make_plan(problem, model, mesh, best, sol, origin, compared, budget, timing, recompute)
    log.info("planned %s on %s in %.2fs (trace %.2fs)", type(model).__name__, mesh, time.perf_counter() - start, t_trace)
    return result


def _plan_with_pipeline(model, mesh, example_inputs, example_kwargs, memory_budget, compare, time_limit,
                        mixed_precision, fixed=None, layout=None, random_seed=None, recompute=None) -> Plan:
    start = time.perf_counter()
    if random_seed is not None and not isinstance(random_seed, int):
        raise ValueError("with pipeline=..., random_seed takes one seed, not a list")
    choice = search(model, mesh, example_inputs, example_kwargs, memory_budget=memory_budget,
                    time_limit=time_limit, fixed=fixed, mixed_precision=mixed_precision, recompute=recompute)
    budget = parse_bytes(memory_budget, "memory_budget") if memory_budget is not None else None
    plain = None
    if choice.axis is not None and fixed is None and choice.plain is not None:
        # the search never loses: the plain plan, planned as pipeline=False plans it (under the
        # budget, with ZeRO and recomputation chosen by the ILP), is kept when it is not slower;
        # it is not planned when no plan without stages can be as fast as the pipeline (the
        # bound costs three solves: asked only where the search's own estimate of the plain
        # plan is clearly slower than the pipeline)
        clearly = choice.no_pipeline_s > 1.1 * choice.step_s
        bound = step_lower_bound(choice.plain.problem, time_limit) if clearly else 0.0
        if bound > choice.step_s * (1 + 1e-6):
            log.info("no plan without stages can beat the best pipeline (%.4g ms): any takes at least %.4g ms "
                     "(solution.step_lower_bound)", choice.step_s * 1e3, bound * 1e3)
        else:
            try:
                plain = _plan_built(choice.plain, model, mesh, budget, compare, time_limit, layout, random_seed,
                                    time.perf_counter(), recompute)
            except InfeasibleError:
                plain = None
        if plain is not None and plain.predicted.step_s <= choice.step_s:
            log.info("the plan without stages (%.4g ms) is not slower than the best pipeline (%.4g ms): keeping it",
                     plain.predicted.step_s * 1e3, choice.step_s * 1e3)
            summary = (f"pipeline: none (the best of {choice.candidates} pipelined layouts, {choice.step_s * 1e3:.1f} "
                       f"ms, was not faster than {plain.predicted.step_s * 1e3:.1f} ms without stages)")
            info = PipelineLayout(axis=None, groups=1, submesh=tuple(mesh.shape),
                                  stages=((0, len(choice.layer_indices)),),
                                  schedule="none", microbatches=1, virtual=1, step_s=plain.predicted.step_s,
                                  no_pipeline_step_s=plain.predicted.step_s, bubble=0.0,
                                  stage_s=(plain.predicted.step_s,), memory=(plain.predicted.memory_total,),
                                  full_mesh=mesh, summary=summary, layer_prefix=choice.layer_prefix,
                                  layer_indices=tuple(choice.layer_indices),
                                  group_memory=(dict(plain.predicted.memory),), candidates=choice.candidates)
            timing = dataclasses.replace(plain.timing, pipeline_search_s=choice.seconds,
                                         total_s=time.perf_counter() - start)
            return dataclasses.replace(plain, pipeline=info, timing=timing)
    if plain is not None:
        choice = dataclasses.replace(choice, no_pipeline_s=plain.predicted.step_s)
    built = choice.built  # the winner's problem, as the search traced, costed and solved it
    if built is None:  # (a candidate whose problem was dropped while a better one led, or a worker's)
        built = stage_problem(model, mesh, example_inputs, example_kwargs, mixed_precision, tuple(choice.submesh),
                              batch_size(example_inputs, example_kwargs) // choice.n_microbatches)
    staged = choice.axis is not None
    result = _plan_built(built, model, built.problem.mesh, budget, compare, time_limit, layout, random_seed,
                         time.perf_counter(), choice.recompute if staged else recompute, staged)
    info = PipelineLayout(axis=choice.axis, groups=choice.n_groups, submesh=tuple(choice.submesh),
                          stages=tuple(tuple(s) for s in choice.stages), schedule=choice.schedule,
                          microbatches=choice.n_microbatches, virtual=choice.n_virtual, step_s=choice.step_s,
                          no_pipeline_step_s=choice.no_pipeline_s, bubble=choice.bubble,
                          stage_s=tuple(choice.stage_s), memory=tuple(choice.memory), full_mesh=mesh,
                          summary=str(choice), layer_prefix=choice.layer_prefix,
                          layer_indices=tuple(choice.layer_indices), group_memory=tuple(choice.group_memory),
                          candidates=choice.candidates)
    timing = dataclasses.replace(result.timing, pipeline_search_s=choice.seconds, total_s=time.perf_counter() - start)
    return dataclasses.replace(result, pipeline=info, timing=timing)


def _infeasible(problem, model, mesh, limit, time_limit, recompute=None) -> InfeasibleError:
    """The error for a budget no plan fits: the least memory any plan needs, what it is made
    of, and what would make the model fit (recomputation among it, with what it saves)."""
    layered = bool(layer_slots(problem))
    keep, _, kept_floor = solve_problem(problem, None, None, time_limit, minimise_memory=True, recompute="none")
    least = recompute if recompute in ("selective", "full") else ("full" if layered and recompute is None else "none")
    if least != "none":
        choice, _, floor = solve_problem(problem, None, None, time_limit, minimise_memory=True, recompute=least)
    else:
        choice, floor = keep, kept_floor
    memory = assemble(problem, choice)[2].memory
    gib = 2**30
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in memory.items())
    states = floor - memory["activations"] - memory["working"]
    devices = math.ceil(mesh.size * floor / limit)
    offloaded = sum(1 for pn in problem.nodes if pn.kind == "param"
                    and problem.nodes[pn.rep].strategies[choice[pn.index]].offload)
    hints = [f"about {devices} devices instead of {mesh.size} (more data- or tensor-parallel ranks: "
             f"states and activations both shrink with the device count)"]
    if memory["activations"] > 0.2 * floor:
        hints.append(f"fewer activations: activations are {memory['activations'] / floor:.0%} of that minimum, "
                     f"so a smaller batch per step (gradient accumulation keeps the global batch)")
    if layered and least == "none":
        try:
            full = solve_problem(problem, None, None, time_limit, minimise_memory=True, recompute="full")[2]
            hints.append(f"recomputing activations in backward: recompute='full' (or None, to let the planner "
                         f"choose per layer) saves {(kept_floor - full) / gib:.2f} GiB per device, for a least of "
                         f"{full / gib:.2f} GiB")
        except InfeasibleError:
            pass
    with_recompute = ""
    if least != "none":
        with_recompute = (f" and every repeated layer recomputed in full (which saves {(kept_floor - floor) / gib:.2f} "
                          f"GiB against keeping every activation)" if least == "full" else
                          f" and every repeated layer recomputed selectively (saving {(kept_floor - floor) / gib:.2f} "
                          f"GiB; recompute='full' or None saves more)")
    if states > 0.2 * floor:
        how = "offloaded to host memory" if offloaded else "sharded"
        hints.append(f"smaller model states: weights, gradients and optimizer states are {states / floor:.0%} of "
                     f"it even {how}; mixed precision (autopar.MixedPrecision) halves weights and gradients")
    return InfeasibleError(
        f"no plan of {type(model).__name__} on {mesh} fits {limit / gib:.2f} GiB per device; the smallest any "
        f"plan needs is {floor / gib:.2f} GiB per device (GiB: {parts}), with every parameter sharded "
        f"(ZeRO-3 or tensor parallel), {offloaded} parameters' optimizer states offloaded to the host"
        f"{with_recompute}. To fit: " + "; or ".join(hints) + f"; or raise memory_budget to at least "
        f"{floor / gib:.2f} GiB.")


def _faster_layout(problem, best, compared: dict, choices: dict, limit):
    """The ILP sums communication; the step it predicts subtracts what gradient buckets
    hide behind backward (solution.hidden_gradient_seconds), which no linear objective
    sees.  So a hand-written layout compared with the plan can come out faster once
    overlap is counted: then that layout's choice is the plan (within the budget), and the
    log says so."""
    mine = assemble(problem, best)[2]
    fits = {n: p for n, p in compared.items() if n in choices and p.memory_total <= limit}
    if not fits:
        return best
    name = min(fits, key=lambda n: fits[n].step_s)
    if fits[name].step_s < mine.step_s * (1 - 1e-9):
        log.info("%s is predicted faster than the ILP's choice once backward's overlap is counted "
                 "(%.4g ms against %.4g ms): planning with it", name, fits[name].step_s * 1e3, mine.step_s * 1e3)
        chosen = choices[name]
        return chosen
    return best


def _make_plan(problem, model, mesh, choice, sol, origin, compared, budget, timing, recompute=None) -> Plan:
    nodes, collectives, predicted, grad_sums = assemble(problem, choice)
    chosen = recompute_record(problem, choice, predicted, recompute)
    parts = problem.traced.parts
    params, states = {}, {}
    for pn in problem.nodes:
        if pn.kind == "param":
            params[pn.param_name] = nodes[pn.index].outputs[0]
            s = problem.nodes[pn.rep].strategies[choice[pn.index]]
            if s.zero or s.offload:
                states[pn.param_name] = ParamState(s.zero, tuple(mesh.axis_names[a] for a in s.zero_axes), s.offload)
    solver = SolverStats(len(problem.nodes), len(problem.choices))
    if sol is not None:
        solver = dataclasses.replace(solver, optimal=sol.optimal, gap=sol.gap, objective_s=sol.objective,
                                     bound_s=sol.bound, variables=sol.variables, constraints=sol.constraints)
    return Plan(mesh=mesh, model=type(model).__name__,
                param_placements=_order_params(model, params, parts), nodes=tuple(nodes[i] for i in sorted(nodes)),
                collectives=tuple(collectives), predicted=predicted, solver=solver, baselines=compared,
                memory_budget=budget, fallback_ops=tuple(problem.fallback_ops),
                layers=tuple((p, tuple(ix)) for p, ix in problem.layer_groups), grad_sums=grad_sums,
                origin=origin, timing=timing, param_states={k: states[k] for k in _order_params(model, states, parts)},
                precision=problem.precision,
                frozen=tuple(n for n, p in model.named_parameters() if not p.requires_grad),
                graph=graph_signature(problem.traced.graph),
                notes=tuple(m.removeprefix("autopar: ") for m in problem.warnings
                            if not m.startswith("autopar: no sharding rule")),
                recompute=chosen)


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


def _random_choice(problem: Problem, seed: int) -> dict:
    """Every node (each layer on its own) takes a strategy drawn uniformly from its menu."""
    rng = random.Random(seed)
    choice = {}
    for pn in problem.nodes:
        menu = problem.nodes[pn.rep].strategies
        if pn.kind == "gradsum":  # a sum autograd can do: the tensor's own local shape
            src, out = pn.source
            p = problem.nodes[problem.nodes[src].rep].strategies[choice[src]].outputs[out]
            ok = [i for i, s in enumerate(menu) if same_local_shape(s.outputs[0], p)]
            choice[pn.index] = rng.choice(ok)
        else:
            choice[pn.index] = rng.randrange(len(menu))
    return choice
