"""autopar.compile: a per-rank module that trains like the plain model, on a device mesh.

Under torchrun every rank calls `autopar.compile(model, mesh, example_inputs, plan=...)`
with the same arguments.  The model is traced again and every pass runs on it
(passes/rewrite.py: the plan's choices, the moves between layouts, local shapes, random
streams, the pipeline cut, the linears' fold, ZeRO-3's gathers, recomputed regions); the
runtime binds what the graphs read at run time (runtime/build.py) and each rank keeps only
its shards of the parameters (passes.shard_params).  Two assemblies, one per kind of
plan and alike in shape: compile_plain here, compile_pipelined (runtime/pipeline/pipelined.py).
The result is an nn.Module: `cm(*inputs)` runs forward on the
global batch, `cm.train_step(*inputs)` runs forward and backward and synchronises
gradients, `cm.build_optimizer(torch.optim.AdamW, lr=...)` builds any optimizer over the
local shards.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.cost.schedules import SPLIT_BACKWARD
from autopar.solve.planner import Pricing, SolveOptions, plan as make_plan
from autopar.deprecations import moved_keywords
from autopar.mesh import Mesh
from autopar.passes.redistribute import MeshGroups
from autopar.report.plan import Plan
from autopar.cost.precision import MixedPrecision

from autopar.runtime.build import bind_gathers, initial_shards, rank_graph
from autopar.runtime.state.disk import OFFLOAD_DIR_ENV
from autopar.runtime.checks.faults import CollectiveError, NonFiniteError, collectives_named, set_timeout
from autopar.runtime.checks.join import UnevenInputs
from autopar.runtime.model import CompiledModel
from autopar.runtime.options import AUTO, RunOptions
from autopar.runtime.pipeline.pipelined import compile_pipelined
from autopar.runtime.process import CompileError, device_mesh, ensure_process_group
from autopar.runtime.runner import GraphRunner
from autopar.runtime.state.rank_state import build_rank_state

__all__ = ["compile", "CompiledModel", "CompileError", "UnevenInputs", "CollectiveError", "NonFiniteError"]

log = logging.getLogger("autopar")

# old keywords of compile() -> (the record keyword, its class, its field)
COMPILE_MOVES = {k: ("run", RunOptions, k) for k in (
    "timeout", "check_finite", "check_inputs", "check_inputs_every", "local_inputs", "bucket_mb",
    "reshard_after_forward", "backend", "offload_dir")}


@moved_keywords("autopar.compile", COMPILE_MOVES)
def compile(model: nn.Module, mesh: Mesh, example_inputs=(), *, example_kwargs=None, plan=None,
            memory_budget=None, seed: int | None = None, mixed_precision=None,
            run: RunOptions | None = None) -> "CompiledModel":
    """Compile `model` for `mesh` with `plan` (a Plan, a path to a saved one, or None to plan now).

    A model on the meta device is initialised shard by shard (with `seed` if given); a model
    on CPU is sliced.  Every rank must pass the same model, mesh, inputs and plan.

    memory_budget: with plan=None, the budget rank 0 plans for (as autopar.plan's).

    mixed_precision: an autopar.MixedPrecision (a plan made with one carries it too): the
    module computes in param_dtype, the optimizer keeps float32 master weights, gradients
    are summed in reduce_dtype.

    run: an autopar.RunOptions, how the compiled model runs: the collective timeout, the
    finite and input checks, whether inputs are each rank's own shards (local_inputs), the
    gradient bucket size, ZeRO-3's gathers in backward, the backend (eager, Inductor, or
    "auto": Inductor on GPUs) and the disk tier's directory.  None: RunOptions()."""
    options = run if run is not None else RunOptions()
    if not isinstance(options, RunOptions):
        raise TypeError(f"autopar.compile(run={run!r}): give an autopar.RunOptions(...) or None")
    if options.offload_dir is None and os.environ.get(OFFLOAD_DIR_ENV):
        options = replace(options, offload_dir=os.environ[OFFLOAD_DIR_ENV])
    timeout = options.timeout
    ensure_process_group()
    set_timeout(timeout)
    with collectives_named("compile", timeout):
        cm = _compile(model, mesh, example_inputs, example_kwargs, plan, memory_budget, seed, mixed_precision,
                      options)
    set_timeout(timeout)   # (the groups compile made since)
    return cm


def _compile(model, mesh, example_inputs, example_kwargs, plan, memory_budget, seed, mixed_precision,
             options: RunOptions) -> "CompiledModel":
    start = time.perf_counter()
    world = dist.get_world_size()
    if world != mesh.size:
        raise CompileError(f"mesh {tuple(mesh.shape)} {mesh.axis_names} needs {mesh.size} ranks but the process "
                           f"group has {world}; launch with --nproc_per_node {mesh.size} (or change the mesh)")
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:  # trace the meta model with meta inputs of the same shapes
        example_inputs, example_kwargs = pytree.tree_map(
            lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (tuple(example_inputs), example_kwargs))
    mixed_precision = MixedPrecision.of(mixed_precision)
    cuda = torch.cuda.is_available()
    if plan is None:
        priced_for = auto_backend(None, cuda) if options.backend == AUTO else options.backend
        plan = _plan_once(model, mesh, example_inputs, example_kwargs, memory_budget, mixed_precision, priced_for)
    elif not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if options.backend == AUTO:
        options = replace(options, backend=auto_backend(plan, cuda))
        log.info("backend='auto' runs %r (%s)", options.backend, "a GPU" if cuda else "CPU ranks")
    pipelined = plan.pipeline is not None and plan.pipeline.pipelined
    precision = plan.precision
    if mixed_precision is not None and precision != mixed_precision:
        raise CompileError(f"the plan was made for {precision or 'full precision'}, not {mixed_precision}; "
                           f"plan with mixed_precision={mixed_precision!r} or compile without it")
    if pipelined and options.local_inputs:
        raise CompileError("a pipelined plan takes the global batch (its schedule splits it into microbatches); "
                           "compile it without RunOptions(local_inputs=True)")
    if not pipelined and (plan.mesh.shape != mesh.shape or plan.mesh.axis_names != mesh.axis_names):
        raise CompileError(f"the plan was made for mesh {plan.mesh.shape} {plan.mesh.axis_names}, "
                           f"not {mesh.shape} {mesh.axis_names}; plan again for this mesh")
    _check_frozen(model, plan)
    if plan.backend != options.backend:
        log.info("the plan was priced for backend %r and runs under %r: its predicted step describes the other",
                 plan.backend, options.backend)
    seed_of_job = _agree(plan, seed)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    assemble = compile_pipelined if pipelined else compile_plain
    cm = assemble(model, mesh, example_inputs, example_kwargs, plan, on_meta=on_meta, seed=seed, options=options,
                  precision=precision, device_type=device_type, seed_of_job=seed_of_job)
    cm.train(model.training)
    log.info("compiled %s for %s on rank %d in %.2fs", type(model).__name__, mesh, dist.get_rank(),
             time.perf_counter() - start)
    return cm


def compile_plain(model, mesh: Mesh, example_inputs, example_kwargs, plan, *, on_meta: bool, seed,
                  options: RunOptions, precision, device_type: str, seed_of_job: int) -> CompiledModel:
    """compile() for a plan without stages: the rank's graph (passes run, slots bound), its
    parameter shards and state, its ZeRO-3 gathers bound, run by a GraphRunner.  (The
    pipelined twin: runtime/pipeline/pipelined.compile_pipelined.)"""
    groups = MeshGroups(device_mesh(device_type, mesh))
    rewritten = rank_graph(model, plan, groups, example_inputs, example_kwargs, precision, device_type,
                           seed_of_job, options.local_inputs)
    shards = initial_shards(model, plan.param_placements, groups, on_meta, seed, rewritten.traced.parts)
    state = build_rank_state(rewritten, plan, groups, shards, model, device_type, precision,
                             offload_dir=options.offload_dir)
    (part,) = rewritten.parts
    regather = bind_gathers(part, rewritten, plan, groups, options, state.device, state.disk)
    return CompiledModel(rewritten, state, options, lambda m: GraphRunner(m, regather))


def auto_backend(plan: Plan | None, cuda: bool) -> str:
    """What compile(backend="auto") runs: Inductor on GPUs, where it stepped a 1.04B Llama in
    0.78x eager's time on one H200 (benchmarks/gpu_check.py, 2026-11-28); eager on CPU
    ranks, where Inductor's gain depends on the model (0.82-1.23x eager's step,
    benchmarks/compiled.py) and its first step compiles for seconds to minutes; eager for a
    plan whose pipeline splits the backward (zero-bubble and DualPipe schedules), which
    run compiled (runtime/regions/split_backward.py) but are not measured on a GPU yet.  plan None: the backend compile plans for."""
    if not cuda:
        return "eager"
    if plan is not None and plan.pipeline is not None and plan.pipeline.pipelined \
            and plan.pipeline.schedule in SPLIT_BACKWARD:
        return "eager"
    return "inductor"


def _plan_once(model, mesh: Mesh, example_inputs, example_kwargs, memory_budget, mixed_precision,
               backend: str = "eager") -> Plan:
    """The plan for compile(plan=None): made on rank 0 and sent to every rank, so a slow
    plan is paid once per job.  Rank 0's failure (an infeasible budget, say) is raised on
    every rank."""
    made = [None]
    if dist.get_rank() == 0:
        try:
            made = [make_plan(model, mesh, example_inputs, example_kwargs=example_kwargs,
                              memory_budget=memory_budget, mixed_precision=mixed_precision,
                              pricing=Pricing(backend=backend), solve=SolveOptions(compare=False)).to_dict()]
        except Exception as exc:  # every rank must leave the broadcast below
            made = [f"{type(exc).__name__}: {exc}"]
            dist.broadcast_object_list(made, src=0)
            raise
        log.info("rank 0 planned %s; sending the plan to %d ranks", type(model).__name__, dist.get_world_size())
    dist.broadcast_object_list(made, src=0)
    if isinstance(made[0], str):
        raise CompileError(f"planning failed on rank 0: {made[0]}")
    return Plan.from_dict(made[0])


def _check_frozen(model, plan: Plan) -> None:
    """The plan's frozen parameters are the model's: a plan made with a parameter trained
    has no gradient path for it frozen, and the other way round."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    planned = set(plan.frozen)
    if frozen != planned:
        now, was = sorted(frozen - planned), sorted(planned - frozen)
        parts = ([f"frozen now but trained when planned: {now[:4]}"] if now else []) + (
            [f"trained now but frozen when planned: {was[:4]}"] if was else [])
        raise CompileError(f"the plan was made with other parameters frozen (requires_grad=False) than the model "
                           f"has ({'; '.join(parts)}); plan again after freezing, or freeze as when planning")


def _agree(plan: Plan, seed) -> int:
    """Check every rank holds the same plan; return the job's random seed (rank 0's: `seed`
    if given, else its torch.initial_seed(); see autopar/runtime/regions/rng.py)."""
    mine = (plan.hash(), int(seed) if seed is not None else torch.initial_seed())
    told = [None] * dist.get_world_size()
    dist.all_gather_object(told, mine)
    hashes = [h for h, _ in told]
    if len(set(hashes)) > 1:
        odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise CompileError(f"ranks hold different plans (plan hash by rank: {hashes}; ranks {odd} differ from "
                           f"rank 0). Give every rank the same plan file, or let every rank plan with the same "
                           f"model, mesh and inputs.")
    return told[0][1]
