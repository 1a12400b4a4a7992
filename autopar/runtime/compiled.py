"""autopar.compile: a per-rank module that trains like the plain model, on a device mesh.

Under torchrun every rank calls `autopar.compile(model, mesh, example_inputs, plan=...)`
with the same arguments.  The model is traced again, the plan's choices written into the
graph (passes.annotate), moves inserted between layouts (passes.collectives), shapes made
local (passes.localize), and each rank keeps only its shards of the parameters
(passes.shard_params).  The result is an nn.Module: `cm(*inputs)` runs forward on the
global batch, `cm.train_step(*inputs)` runs forward and backward and synchronises
gradients, `cm.build_optimizer(torch.optim.AdamW, lr=...)` builds any optimizer over the
local shards.
"""
from __future__ import annotations

import logging
import math
import os
import numbers
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.cost.schedules import SPLIT_BACKWARD
from autopar.solve.planner import plan as make_plan
from autopar.report.records import check_backend
from autopar.mesh import Mesh
from autopar.passes.redistribute import MeshGroups
from autopar.report.plan import Plan
from autopar.cost.precision import MixedPrecision

from autopar.runtime.build import initial_shards, rank_graph
from autopar.runtime.state.disk import OFFLOAD_DIR_ENV
from autopar.runtime.checks.faults import (
    DEFAULT_TIMEOUT_S, CollectiveError, NonFiniteError, collectives_named, set_timeout)
from autopar.runtime.checks.inputs import CHECKED_CALLS, SAMPLE_EVERY
from autopar.runtime.grads.linear import fold_linear_gradients, kept_nodes
from autopar.runtime.checks.join import UnevenInputs
from autopar.runtime.model import CompiledModel
from autopar.runtime.options import RunOptions
from autopar.runtime.pipeline.pipelined import compile_pipelined
from autopar.runtime.process import CompileError, device_mesh, device_of, ensure_process_group
from autopar.runtime.regions.recompute import apply_recompute
from autopar.runtime.regions.reshard import Regather, offloaded_weights
from autopar.runtime.runner import GraphRunner
from autopar.runtime.state.rank_state import build_rank_state

__all__ = ["compile", "CompiledModel", "CompileError", "UnevenInputs", "CollectiveError", "NonFiniteError"]

log = logging.getLogger("autopar")

# compile(timeout=...)'s least value.  The timeout bounds every wait of a collective for its
# slowest peer, compile's own included: setting up the gloo or NCCL groups of the mesh, and
# waiting at compile's first collective for the ranks that trace the model more slowly,
# take seconds.  Below a second nothing but a mistaken unit (milliseconds) is plausible.
MIN_TIMEOUT_S = 1.0

AUTO = "auto"   # compile(backend=...)'s default: auto_backend chooses


def check_timeout(timeout) -> float:
    """compile's `timeout` in seconds, or ValueError saying what it bounds and what to give."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout):
        problem = "not a finite number of seconds"
    elif timeout < MIN_TIMEOUT_S:
        problem = f"under the least timeout, {MIN_TIMEOUT_S:g} s"
    else:
        return float(timeout)
    raise ValueError(f"autopar.compile(timeout={timeout!r}): {problem}. The timeout bounds how long every collective "
                     f"waits for the slowest rank, compile's own included (setting up the gloo or NCCL process "
                     f"groups and waiting for ranks that trace the model more slowly take seconds); give "
                     f"timeout=60 or more (the default is {DEFAULT_TIMEOUT_S:g})")


def check_options(bucket_mb, check_inputs, check_inputs_every) -> None:
    """compile's numeric options other than the timeout, or ValueError naming the option,
    its value and what it may be."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real) or not math.isfinite(bucket_mb) \
            or bucket_mb <= 0:
        raise ValueError(f"autopar.compile(bucket_mb={bucket_mb!r}): the gradient bucket size must be a positive "
                         f"number of MiB (25 is DDP's default; larger buckets mean fewer, later all-reduces)")
    for name, value, what in (("check_inputs", check_inputs, "how many first calls compare every input's hash"),
                              ("check_inputs_every", check_inputs_every,
                               "after those, every how many calls one is compared")):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"autopar.compile({name}={value!r}): {what}; a whole number of at least 0 "
                             f"(0 turns it off)")


def compile(model: nn.Module, mesh: Mesh, example_inputs=(), *, example_kwargs=None, plan=None,
            memory_budget=None, seed: int | None = None, bucket_mb: float = 25.0,
            local_inputs: bool = False, mixed_precision=None,
            reshard_after_forward: bool = True, timeout: float = DEFAULT_TIMEOUT_S,
            check_finite: bool = True, check_inputs: int = CHECKED_CALLS,
            check_inputs_every: int = SAMPLE_EVERY, backend: str = "auto", offload_dir=None) -> "CompiledModel":
    """Compile `model` for `mesh` with `plan` (a Plan, a path to a saved one, or None to plan now).

    A model on the meta device is initialised shard by shard (with `seed` if given); a model
    on CPU is sliced.  Every rank must pass the same model, mesh, inputs and plan.

    local_inputs: the compiled module takes each rank's own shard of every input (laid out
    as `cm.input_layouts` says, see `cm.shard_inputs`) instead of the global batch.

    mixed_precision: an autopar.MixedPrecision (a plan made with one carries it too): the
    module computes in param_dtype, the optimizer keeps float32 master weights, gradients
    are summed in reduce_dtype.

    reshard_after_forward: ZeRO-3 weights gathered for forward are dropped and gathered
    again in backward (False: kept from forward to backward, one gather fewer).

    timeout: seconds any collective may wait (every process group of the job, compile's
    own included): a stalled rank ends every rank with a CollectiveError naming the
    collective (autopar/runtime/faults.py).  check_finite: train_step raises NonFiniteError on
    every rank when the loss or a gradient is NaN or infinite (one scalar all-reduce per
    step); the user may switch it later as cm.check_finite.  check_inputs: during the first this
    many calls the ranks compare a hash of their inputs (autopar/runtime/inputs.py): without
    local_inputs every rank must pass the same global batch (0 turns it off).
    check_inputs_every: after those calls, every this many-th call's inputs are compared by
    a hash that rides in the step's NaN-check all-reduce (no extra collective where the
    step makes that all-reduce; 0 turns it off).  timeout is at
    least MIN_TIMEOUT_S (1 s): a minute or more leaves room for ranks that load data or
    evaluate at different speeds.

    backend: "eager" runs the rank's graph op by op; "inductor" compiles its compute
    between collectives with torch.compile (autopar/runtime/inductor.py: regions compile on
    the first step, a region Inductor cannot compile runs eagerly with a warning; results
    match eager to float rounding, not bit for bit; under the split-backward schedules each
    region's backward runs as two compiled passes, runtime/split_backward.py).  "auto" (the
    default) takes Inductor on GPUs and eager on CPU ranks and for split-backward schedules
    (auto_backend); cm.backend says which ran.

    offload_dir: a directory on a local disk (NVMe) where a plan that keeps optimizer
    states on disk writes them (autopar/runtime/disk.py): each rank makes its own
    directory inside it, checked for room at compile and removed when the job ends.  A
    plan without the disk tier ignores it.  Unset, the environment's AUTOPAR_OFFLOAD_DIR
    is taken (a job script's one setting for every compile)."""
    timeout = check_timeout(timeout)
    check_backend(backend, auto=True, where="autopar.compile")
    check_options(bucket_mb, check_inputs, check_inputs_every)
    options = RunOptions(timeout_s=float(timeout), check_finite=bool(check_finite), compared_calls=int(check_inputs),
                         sample_every=int(check_inputs_every), bucket_mb=bucket_mb,
                         reshard_after_forward=reshard_after_forward, backend=backend,
                         offload_dir=str(offload_dir) if offload_dir is not None else os.environ.get(OFFLOAD_DIR_ENV))
    ensure_process_group()
    set_timeout(timeout)
    with collectives_named("compile", timeout):
        cm = _compile(model, mesh, example_inputs, example_kwargs, plan, memory_budget, seed, local_inputs,
                      mixed_precision, options)
    set_timeout(timeout)   # (the groups compile made since)
    return cm


def _compile(model, mesh, example_inputs, example_kwargs, plan, memory_budget, seed, local_inputs,
             mixed_precision, options: RunOptions) -> "CompiledModel":
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
    if pipelined and local_inputs:
        raise CompileError("a pipelined plan takes the global batch (its schedule splits it into microbatches); "
                           "compile it without local_inputs=True")
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
    if pipelined:
        cm = compile_pipelined(model, mesh, example_inputs, example_kwargs, plan, on_meta=on_meta, seed=seed,
                               options=options, precision=precision, device_type=device_type,
                               seed_of_job=seed_of_job)
    else:
        groups = MeshGroups(device_mesh(device_type, mesh))
        rewritten = rank_graph(model, plan, groups, example_inputs, example_kwargs, precision, device_type,
                               seed_of_job, local_inputs)
        shards = initial_shards(model, plan.param_placements, groups, on_meta, seed, rewritten.traced.parts)
        traced = rewritten.traced
        if plan.tp_overlap:   # TP collectives beside their GEMMs (runtime/linear_grads.py)
            fold_linear_gradients(rewritten.graph, kept_nodes(plan))
        # ZeRO-3 weights whose gradient nothing else synchronises gather and reduce in buckets
        alone = frozenset(ph for ph, name in traced.params.items()
                          if not rewritten.grad_sync.get(name) and not getattr(plan.param_states.get(name), "stage", 0))
        regather = Regather(rewritten.graph, set(traced.params), options.reshard_after_forward, groups, alone,
                            options.bucket_bytes, offloaded_weights(plan, traced.params, traced.tied),
                            device_of(device_type))
        apply_recompute(rewritten.graph, plan, rewritten.streams)
        state = build_rank_state(rewritten, plan, groups, shards, model, device_type, precision,
                                 offload_dir=options.offload_dir)
        regather.disk = state.disk
        cm = CompiledModel(rewritten, state, options, lambda m: GraphRunner(m, regather))
    cm.train(model.training)
    log.info("compiled %s for %s on rank %d in %.2fs", type(model).__name__, mesh, dist.get_rank(),
             time.perf_counter() - start)
    return cm


def auto_backend(plan: Plan | None, cuda: bool) -> str:
    """What compile(backend="auto") runs: Inductor on GPUs, where it stepped a 1.04B Llama in
    0.78x eager's time on one H200 (benchmarks/gpu_check.py, 2026-11-28); eager on CPU
    ranks, where Inductor's gain depends on the model (0.82-1.23x eager's step,
    benchmarks/compiled.py) and its first step compiles for seconds to minutes; eager for a
    plan whose pipeline splits the backward (zero-bubble and DualPipe schedules), which
    run compiled (runtime/split_backward.py) but are not measured on a GPU yet.  plan None: the backend compile plans for."""
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
                                 memory_budget=memory_budget, compare=False,
                                 mixed_precision=mixed_precision, backend=backend).to_dict()]
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
    if given, else its torch.initial_seed(); see autopar/runtime/rng.py)."""
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
