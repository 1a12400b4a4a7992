"""Pipelined execution of a plan with stages (plan.pipeline), on torch.distributed.pipelining.

Devices.  The plan splits mesh axis `axis` into `groups` contiguous device groups; each
group is a sub-mesh of the plan's per-stage shape and runs the stages g, g + groups, ...
(one stage, or `virtual` stages under interleaved 1F1B).  Rank i of one group talks to
rank i of the next (they hold the same shards of what crosses the cut), over a "pipeline"
process group of one rank per group; inside a group, the per-stage plan's collectives run
over the sub-mesh's axes as in an unpipelined plan (tensor, data parallelism, ZeRO).

Graph.  The model is traced for one microbatch, annotated with the per-stage plan, given
its collectives and local shapes like any plan, then cut by passes.pipeline_split.  Each
rank wraps its stages' graphs in modules that read this rank's parameter shards, and
hands them to `PipelineStage`s and the plan's schedule (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
ScheduleDualPipeV), or for chimera to autopar's own runner of two pipelines
(autopar/runtime/pipeline/two_way.py).  User inputs reach every stage as keyword arguments, split
into microbatches by the schedule.

A step.  `train_step(*inputs)` runs the schedule on the global batch: each microbatch's
loss is divided by the number of microbatches before its backward, so the accumulated
gradients are those of the whole batch's mean loss.  Gradients accumulate over the
microbatches unreduced and are reduced over the sub-mesh once (GradSync, see below), then
the gradients of weights read by stages on several device groups
(a tied input embedding and output head) are summed between those groups, so every copy
takes the same optimizer step.  The loss (the sum of the microbatches' shares, reduced
over the sub-mesh where the plan leaves it Partial) is broadcast from the last stage to
every rank and returned.

Gradient buckets stay closed while the microbatches accumulate and open during each
stage's last backward, so the reduction overlaps the end of the schedule; what is left
(weights two local stages read, gradients a zero-bubble weight pass writes without
autograd's hooks) is reduced after the schedule.

ZeRO-3 inside a stage works as without stages (autopar/runtime/regions/reshard.py), per stage and
microbatch: the next weight's gather is prefetched, and with reshard_after_forward (the
default) a gathered weight is not kept from a microbatch's forward to its backward but
gathered again there.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble)

from autopar.cost.schedules import ASYNCHRONOUS, SPLIT_BACKWARD, group_stages, stage_group, stage_groups

from autopar.trace.batching import batch_size, first_microbatch
from autopar.mesh import Mesh
from autopar.passes.collectives import move
from autopar.passes.redistribute import MeshGroups
from autopar.passes.rewrite import param_names

from autopar.runtime.build import bind_gathers, initial_shards, rank_graph
from autopar.runtime.regions.inductor import compile_regions
from autopar.runtime.model import CompiledModel
from autopar.runtime.options import RunOptions
from autopar.runtime.process import STAGE_AXIS, CompileError, group_mesh
from autopar.runtime.regions.reshard import Regather
from autopar.runtime.regions.split_backward import WeightPasses
from autopar.runtime.runner import gather_counts_of, loss_of
from autopar.runtime.state.rank_state import build_rank_state, param_key
from autopar.runtime.pipeline.flushless import FlushlessSchedule
from autopar.runtime.grads.sync import copy_from_flat
from autopar.runtime.pipeline.two_way import TwoWaySchedule

log = logging.getLogger("autopar")



SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}
SCHEDULES.update({name: getattr(pipelining, cls) for name, cls in (("zbv", "ScheduleZBVZeroBubble"),
                                                                   ("dualpipev", "ScheduleDualPipeV"))
                  if hasattr(pipelining, cls)})   # (newer torch)


# schedules autopar runs itself: Chimera's two pipelines (two_way.py), 2BW's stream (flushless.py)
OWN = {"chimera": TwoWaySchedule, "pipedream-2bw": FlushlessSchedule}
SCHEDULES.update(OWN)
MULTI_STAGE = {"interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"}  # schedules that take a list of this rank's stages

def compile_pipelined(model, mesh: Mesh, example_inputs, example_kwargs, plan, *, on_meta: bool, seed,
                      options: RunOptions, precision, device_type: str, seed_of_job: int) -> CompiledModel:
    """compile() for a plan with pipeline stages (see the module docstring): a CompiledModel
    whose runner is a PipelineRunner over this rank's stages."""
    info = plan.pipeline
    full = info.full_mesh
    if full.shape != mesh.shape or full.axis_names != mesh.axis_names:
        raise CompileError(f"the plan was made for mesh {full.shape} {full.axis_names}, not {mesh.shape} "
                           f"{mesh.axis_names}; plan again for this mesh")
    if plan.mesh.shape != info.submesh:
        raise CompileError(f"the plan's per-stage mesh {plan.mesh.shape} is not its pipeline's sub-mesh "
                           f"{info.submesh}; the plan file is inconsistent, plan again")
    if not info.layer_prefix:
        raise CompileError("the plan does not name the repeated layers its stages cut between; plan again "
                           "with this version of autopar")
    n_groups, n_mb = info.groups, info.microbatches
    batch = batch_size(example_inputs, example_kwargs)
    if batch % n_mb:
        raise CompileError(f"the plan splits the batch into {n_mb} microbatches; the inputs' batch of {batch} "
                           f"rows does not divide")
    dm = group_mesh(device_type, mesh, info.axis, n_groups)
    sub = dm[mesh.axis_names] if len(mesh.axis_names) > 1 else dm[mesh.axis_names[0]]
    groups = MeshGroups(sub)
    group = dm.get_coordinate()[0]
    args, kwargs = first_microbatch((tuple(example_inputs), example_kwargs), batch, batch // n_mb)
    rewritten = rank_graph(model, plan, groups, args, kwargs, precision, device_type, seed_of_job)
    traced = rewritten.traced
    stages = [part.stage for part in rewritten.parts]
    name_of = param_names(traced)
    readers: dict = {}   # parameter name -> device groups whose stages read it
    for st in stages:
        for ph in st.params:
            if ph in name_of:
                readers.setdefault(name_of[ph], set()).update(stage_groups(st.index, n_groups, plan.pipeline.schedule))
    # only the weights this rank's stages read are sliced (or initialised: the RNG still runs
    # through every module, so the values equal the whole model's)
    mine = {name: pl for name, pl in plan.param_placements.items() if group in readers.get(name, ())}
    shards = initial_shards(model, mine, groups, on_meta, seed, traced.parts)
    state = build_rank_state(rewritten, plan, groups, shards, model, device_type, precision,
                             holders={param_key(name): len(gs) for name, gs in readers.items()},
                             offload_dir=options.offload_dir)
    planned = traced.parts.named_parameters(model)
    meta = {name: (tuple(planned[name].shape), state.compute_dtype_of(planned[name].dtype)) for name in readers}
    feeds = stage_feeds(stages, group, n_groups, name_of, traced.buffers, plan.pipeline.schedule)
    # gradient buckets start during each stage's last backward; a weight that two of this
    # rank's stages read is complete only after both, so GradSync.finish reduces it
    read_by: dict = {}
    for feed in feeds.values():
        for key in dict.fromkeys(key for kind, key in feed if kind == "param"):   # (tied: one weight, twice)
            read_by[key] = read_by.get(key, 0) + 1
    pieces = {key: f"device group {group} holds the gradient of {state.name_of[key]!r} for its pipeline stages only"
              for key in read_by if state.shards[key].requires_grad}   # one device group's part of the model's

    def runner(cm: CompiledModel) -> PipelineRunner:
        return PipelineRunner(cm, dm, group, rewritten, feeds, readers, meta, options)

    return CompiledModel(rewritten, state, options, runner, batch_scale=n_mb, pieces=pieces,
                         hold=frozenset(key for key, n in read_by.items() if n > 1))


def stage_feeds(stages: list, group: int, n_groups: int, param_of: dict, buffer_of: dict,
                schedule: str = "1f1b") -> dict:
    """Stage index -> what feeds each of its parameter placeholders, ("param", key) or
    ("buffer", key), for the stages device group `group` runs (under `schedule`'s
    placement, cost.schedules.stage_groups: under chimera two stages, each also run by
    another group).  param_of / buffer_of: placeholder ->
    parameter (tied: the owner's name) / buffer name."""
    return {st.index: [("param", param_key(param_of[ph])) if ph in param_of else ("buffer", param_key(buffer_of[ph]))
                       for ph in st.params]
            for st in stages if group in stage_groups(st.index, n_groups, schedule)}


class _StageModule(nn.Module):
    """One stage's graph over this rank's shards: forward(*received, **user_inputs)."""

    def __init__(self, stage, model: CompiledModel, feed: list, regather: Regather, split_backward: bool = False):
        super().__init__()
        self.graph_module = stage.graph_module
        self.inputs = list(stage.inputs)
        self.placeholders = [n.target for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
        self.regather = regather
        self.params = nn.ParameterDict({key: model.shards[key] for kind, key in feed if kind == "param"})
        self.feed = feed
        self.model = [model]  # not a submodule: the model's parameters are not this module's children twice
        self.weights: dict | None = None   # key -> tensor read instead of the parameter (see reading)
        self.compiled: dict = {}   # backend "inductor": training mode -> (split module, its regions)
        # (backend "inductor" under a split-backward schedule: the regions' weight passes, the stage's dw_builder)
        self.weight_passes = WeightPasses() if model.backend != "eager" and split_backward else None
        self.param_placeholders = frozenset(ph for ph, (kind, _) in zip(stage.params, feed) if kind == "param")

    def forward(self, *received, **inputs):
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise CompileError(f"stage inputs {missing} were not passed to the schedule")
        model = self.model[0]
        model.streams.calls += 1
        weights = self.params if self.weights is None else self.weights
        feed = [weights[key] if kind == "param" else model.get_buffer(key) for kind, key in self.feed]
        args = [*received, *(inputs[n] for n in self.inputs), *feed]
        run = self._module(model)
        if not self.regather:
            return run(*args)
        with self.regather.forward(dict(zip(self.placeholders, args))):
            return run(*args)

    @contextlib.contextmanager
    def reading(self, weights: dict):
        """Forwards inside read `weights` (key -> tensor, a stashed version of this stage's
        parameters) instead of the parameters themselves."""
        self.weights = weights
        try:
            yield
        finally:
            self.weights = None

    def _module(self, model):
        """The stage's graph, or under backend "inductor" its compiled regions (one cut per
        training mode, as runtime/runner.GraphRunner does)."""
        if model.backend == "eager":
            return self.graph_module
        if model.training not in self.compiled:
            self.compiled[model.training] = compile_regions(self.graph_module,
                                                            layer_cuts=getattr(model, "device_type", None) == "cuda",
                                                            passes=self.weight_passes,
                                                            params=self.param_placeholders)
        return self.compiled[model.training][0]


def _collecting(method, passes: WeightPasses):
    """A stage's backward_one_chunk that collects the W passes its regions defer
    (split_backward.WeightPasses.collecting)."""

    def run(*args, **kwargs):
        with passes.collecting():
            return method(*args, **kwargs)
    return run


class PipelineRunner:
    """Runs this rank's stages of a pipelined plan (the model's runner, autopar/runtime/runner.py).
    `train_step` runs one step of the plan's schedule on the global batch and returns the
    loss on every rank; `forward` runs the forward passes only and returns the loss.  Whole
    tensors are gathered from the device group that holds them."""

    pipelined = True

    def __init__(self, model: CompiledModel, dm, group: int, rewritten, feeds: dict, readers: dict, meta: dict,
                 options: RunOptions):
        """rewritten: the rank's graphs (runtime/build.RankGraph), one part per stage; feeds:
        stage index -> its parameter placeholders' feed (stage_feeds), for this rank's
        stages; readers: parameter name -> device groups whose stages read it; meta: name
        -> (whole shape, compute dtype)."""
        info = model.plan.pipeline
        self.model = model
        self.dm = dm
        self.group = group
        self.n_groups = info.groups
        self.n_stages = len(rewritten.parts)
        self.n_mb = info.microbatches
        self.schedule_name = info.schedule
        self.pp_group = dm.get_group(STAGE_AXIS)
        self.last_group = stage_group(self.n_stages - 1, self.n_groups, self.schedule_name)
        self.loss_index = None
        self.overlap_grad_sync = True  # False: reduce all gradients after the schedule
        self.owner = {name: min(gs) for name, gs in readers.items()}
        self.meta = meta
        self.tied = self._tied_groups(readers)
        self.stage_modules = []
        pipeline_stages = []
        own = self.schedule_name in OWN
        by_index = {part.stage.index: part for part in rewritten.parts}   # this group's stages in chunk order
        mine = [by_index[i] for i in group_stages(group, self.n_groups, self.n_stages, self.schedule_name)]
        for part in mine:
            st = part.stage
            regather = bind_gathers(part, rewritten, model.plan, model.groups, options, model.device,
                                    model.rank_state.disk)
            module = _StageModule(st, model, feeds[st.index], regather, self.schedule_name in SPLIT_BACKWARD)
            self.stage_modules.append(module)
            if not own:
                # (under Inductor, the W of each microbatch is what its regions' backward deferred)
                dw = {} if module.weight_passes is None else {"dw_builder": module.weight_passes.builder}
                pipeline_stages.append(PipelineStage(module, st.index, self.n_stages, model.device,
                                                     group=self.pp_group, **dw))
        self.pipeline_stages = pipeline_stages
        log.info("pipelined %d stages (%s, %d microbatches); this rank holds stages %s of device group %d",
                 self.n_stages, self.schedule_name, self.n_mb, [part.stage.index for part in mine], group)
        if own:
            received = [len(m.placeholders) - len(m.inputs) - len(m.feed) for m in self.stage_modules]
            self.schedule = OWN[self.schedule_name](self.stage_modules, group, self.n_groups, self.n_mb, self.pp_group,
                                                    model.device, lambda out: self._microbatch_loss(out, None),
                                                    received)
            return
        for stage, module in zip(pipeline_stages, self.stage_modules):
            if module.weight_passes is not None:
                stage.backward_one_chunk = _collecting(stage.backward_one_chunk, module.weight_passes)
            for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._sync_on_last(getattr(stage, name)))
        if self.schedule_name not in SCHEDULES:
            raise CompileError(f"the plan's schedule {self.schedule_name!r} needs a newer torch "
                               f"(torch.distributed.pipelining has no such schedule here); plan with another")
        cls = SCHEDULES[self.schedule_name]
        target = pipeline_stages if self.schedule_name in MULTI_STAGE else pipeline_stages[0]
        if self.schedule_name not in MULTI_STAGE and len(pipeline_stages) != 1:
            raise CompileError(f"{self.schedule_name} runs one stage per device group; the plan puts "
                               f"{len(pipeline_stages)} on group {group}")
        self.schedule = cls(target, self.n_mb, loss_fn=self._microbatch_loss, scale_grads=False)

    def graphs(self) -> list:
        return [m.graph_module for m in self.stage_modules]

    def regions(self) -> list:
        """The compiled regions (backend "inductor") of this rank's stages, every mode run so far."""
        return [r for m in self.stage_modules for _, regions in m.compiled.values() for r in regions]

    def gather_counts(self) -> dict:
        return gather_counts_of(m.regather for m in self.stage_modules)

    def _sync_on_last(self, method):
        """`method` with gradient synchronisation on while the schedule runs a stage's last
        (full or weight) backward, so its buckets go out while backward goes on."""
        sync = self.model.grad_sync

        def run(mb_index, *args, **kwargs):
            if not kwargs.get("last_backward") or not self.overlap_grad_sync:
                return method(mb_index, *args, **kwargs)
            sync.enabled = True
            try:
                return method(mb_index, *args, **kwargs)
            finally:
                sync.enabled = False
        return run

    def _tied_groups(self, readers: dict) -> dict:
        """name -> process group of this rank and its peers in the other device groups that
        read the same weight (every rank creates every such group, in the same order)."""
        out = {}
        flat = self.dm.mesh.reshape(self.n_groups, -1)
        mine = int((flat[self.group] == dist.get_rank()).nonzero()[0, 0])
        made: dict = {}
        for name in sorted(readers):
            gs = tuple(sorted(readers[name]))
            if len(gs) < 2:
                continue
            if gs not in made:
                made[gs] = [dist.new_group([int(flat[g, c]) for g in gs]) for c in range(flat.shape[1])]
            if self.group in gs:
                out[param_key(name)] = made[gs][mine]
        return out

    # --- running -----------------------------------------------------------------------------
    def _microbatch_loss(self, output, _target):
        flat = list(output) if isinstance(output, tuple) else [output]
        loss = loss_of(self.model.io.structure(flat))
        if self.loss_index is None:
            self.loss_index = next((i for i, t in enumerate(flat) if t is loss), None)
        return loss / self.n_mb

    def _run_schedule(self, args, kwargs, train: bool) -> torch.Tensor:
        model = self.model
        flat = model.io.flatten(args, kwargs)
        device = model.device
        inputs = {n: (t.to(device) if isinstance(t, torch.Tensor) else t)
                  for n, t in zip(model.io.input_names(), flat)}
        sync = model.grad_sync
        sync.begin()
        if self.schedule_name in OWN:
            return self._run_own(inputs, train)
        last = any(st.is_last for st in self.pipeline_stages)
        losses: list = []
        extra = {"target": torch.zeros(self.n_mb, device=device), "losses": losses} if last else {}
        if train:
            with sync.no_sync():  # (the last backward of each stage opens it: _sync_on_last)
                self.schedule.step(return_outputs=False, **extra, **inputs)
        else:
            with torch.no_grad():
                self.schedule.eval(return_outputs=False, **extra, **inputs)
        total = torch.zeros((), device=device)
        if last:
            total = torch.stack([t.detach().float().reshape(()) for t in losses]).sum()
            m = model.io.output_reduce.get(self.loss_index)
            if m is not None:  # the loss is a Partial sum over some sub-mesh axes
                total = move(total, m, model.groups)
        dist.broadcast(total, group_src=self.last_group, group=self.pp_group)
        return total

    def _run_own(self, inputs: dict, train: bool) -> torch.Tensor:
        """_run_schedule under a schedule autopar runs itself (OWN): the loss is summed over
        the groups (chimera's two pipelines end on two groups, the last and the first)."""
        model = self.model
        if train:
            with model.grad_sync.no_sync():
                losses = self.schedule.step(inputs, train=True)
        else:
            with torch.no_grad():
                losses = self.schedule.step(inputs, train=False)
        total = torch.zeros((), device=model.device)
        if losses:
            total = torch.stack([t.float().reshape(()) for t in losses]).sum()
            m = model.io.output_reduce.get(self.loss_index)
            if m is not None:
                total = move(total, m, model.groups)
        dist.all_reduce(total, group=self.pp_group)
        return total

    def drain(self) -> None:
        """Asynchronous schedules (pipedream-2bw): run the backwards still pending, so that
        .grad holds the last step's gradient (then the optimizer step), and start the stream
        again; nothing to do for the others."""
        if self.schedule_name not in ASYNCHRONOUS:
            return
        with self.model.grad_sync.no_sync():
            self.schedule.drain()
        self.model.grad_sync.finish()
        self._sum_tied_grads()

    def train_step(self, args, kwargs) -> torch.Tensor:
        """One step of the plan's schedule on the global batch: forward and backward of every
        microbatch, gradient synchronisation; the batch's loss on every rank."""
        loss = self._run_schedule(args, kwargs, train=True)
        self.model.grad_sync.finish()
        self._sum_tied_grads()
        return loss

    def forward(self, args, kwargs):
        """The loss of the global batch (forward passes only), on every rank."""
        return self._run_schedule(args, kwargs, train=False)

    def _sum_tied_grads(self) -> None:
        """Sum the gradients of weights held by several device groups (tied weights; under
        chimera every stage's), one flat all-reduce per process group and dtype."""
        model = self.model
        buckets: dict = {}
        for key, pg in self.tied.items():
            grad = model.grad_sync.zero_grads.get(key)
            if grad is None:
                grad = model.shards[key].grad
            if grad is not None:
                buckets.setdefault((pg, grad.dtype, grad.device), []).append(grad)
        pending = []
        for (pg, _, _), grads in buckets.items():
            flat = torch.cat([g.reshape(-1) for g in grads])
            pending.append((dist.all_reduce(flat, group=pg, async_op=True), flat, grads))
        for work, flat, grads in pending:
            work.wait()
            copy_from_flat(flat, grads)

    def backward(self, loss):
        raise CompileError("a pipelined model runs backward inside its schedule: call cm.train_step(*inputs)")

    def no_sync(self):
        raise CompileError("a pipelined model accumulates over its microbatches itself: raise the plan's "
                           "microbatch count (autopar.Pipeline(microbatches=...)) instead of no_sync")

    def predicted_memory(self) -> dict:
        """The pipeline search's bytes per device for this rank's device group: its stages'
        model states plus the activations of the microbatches its schedule holds in flight."""
        info = self.model.plan.pipeline
        parts = dict(info.group_memory[self.group]) if info.group_memory else {}
        return dict(parts, total=info.memory[self.group])

    def whole(self, local: dict, dtype=None) -> dict:
        """Whole tensors held by each parameter's owning device group, broadcast to every rank
        (`local`: this rank's whole tensors by name)."""
        out = {}
        device = self.model.device
        for name in sorted(self.owner):
            shape, dt = self.meta[name]
            t = local.get(name) if self.group == self.owner[name] else None
            t = torch.empty(shape, dtype=dtype or dt, device=device) if t is None else t.to(device)
            dist.broadcast(t, group_src=self.owner[name], group=self.pp_group)
            out[name] = t
        return out
