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
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble).  User inputs reach every stage as
keyword arguments, split into microbatches by the schedule.

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

ZeRO-3 inside a stage works as without stages (runtime/reshard.py), per stage and
microbatch: the next weight's gather is prefetched, and with reshard_after_forward (the
default) a gathered weight is not kept from a microbatch's forward to its backward but
gathered again there.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble)
from torch.utils import _pytree as pytree

from autopar.batching import batch_size, first_microbatch
from autopar.mesh import Mesh
from autopar.passes.collectives import move
from autopar.passes.pipeline_split import assign_stages, layer_stages, split_stages
from autopar.passes.redistribute import MeshGroups

from .build import initial_shards, param_names, rewrite
from .model import CompiledModel, gather_counts_of, loss_of, param_key
from .process import CompileError, device_of
from .reshard import Regather

log = logging.getLogger("autopar")

STAGE_AXIS = "_stage"  # the device-group dimension added in front of the mesh's own axes


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}


MULTI_STAGE = {"interleaved-1f1b", "zero-bubble"}  # schedules that take a list of this rank's stages

_MESHES: dict = {}


def group_mesh(device_type: str, mesh: Mesh, axis: str, groups: int):
    """A DeviceMesh of shape (groups, *per-stage shape) named (STAGE_AXIS, *mesh.axis_names):
    device group g holds the ranks whose coordinate on `axis` lies in [g*q, (g+1)*q),
    q = shape[axis] / groups."""
    key = (device_type, mesh.shape, mesh.axis_names, axis, groups)
    if key not in _MESHES:
        a = mesh.axis_names.index(axis)
        q = mesh.shape[a] // groups
        ranks = torch.arange(mesh.size).reshape(mesh.shape)
        ranks = ranks.reshape(mesh.shape[:a] + (groups, q) + mesh.shape[a + 1:]).movedim(a, 0)
        _MESHES[key] = DeviceMesh(device_type, ranks, mesh_dim_names=(STAGE_AXIS, *mesh.axis_names))
    return _MESHES[key]


def compile_pipelined(model, mesh: Mesh, example_inputs, example_kwargs, plan, *, on_meta: bool, seed,
                      bucket_mb: float, precision, device_type: str, seed_of_job: int,
                      reshard_after_forward: bool = True) -> PipelinedModel:
    """compile() for a plan with pipeline stages (see the module docstring)."""
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
    n_stages = len(info.stages)
    batch = batch_size(example_inputs, example_kwargs)
    if batch % n_mb:
        raise CompileError(f"the plan splits the batch into {n_mb} microbatches; the inputs' batch of {batch} "
                           f"rows does not divide")
    dm = group_mesh(device_type, mesh, info.axis, n_groups)
    sub = dm[mesh.axis_names] if len(mesh.axis_names) > 1 else dm[mesh.axis_names[0]]
    groups = MeshGroups(sub)
    group = dm.get_coordinate()[0]
    args, kwargs = first_microbatch((tuple(example_inputs), example_kwargs), batch, batch // n_mb)
    rewritten = rewrite(model, plan, groups, args, kwargs, precision, device_type, seed_of_job)
    traced, gm = rewritten.traced, rewritten.graph
    device = device_of(device_type)
    stage_of = assign_stages(gm, traced.user_inputs, info.layer_prefix,
                             layer_stages(info.stages, info.layer_indices))
    stages = split_stages(gm, traced.user_inputs, stage_of, n_stages)
    name_of = param_names(traced)
    readers: dict = {}   # parameter name -> device groups whose stages read it
    for st in stages:
        for ph in st.params:
            if ph in name_of:
                readers.setdefault(name_of[ph], set()).add(st.index % n_groups)
    # only the weights this rank's stages read are sliced (or initialised: the RNG still runs
    # through every module, so the values equal the whole model's)
    mine = {name: pl for name, pl in plan.param_placements.items() if group in readers.get(name, ())}
    shards = initial_shards(model, mine, groups, on_meta, seed)
    cm = PipelinedModel(rewritten, plan, groups, shards, model, device_type, bucket_mb, precision)
    params = {name: (tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()}
    cm._setup(dm, group, stages, readers, device, reshard_after_forward, params, name_of, traced.buffers)
    return cm


class _StageModule(nn.Module):
    """One stage's graph over this rank's shards: forward(*received, **user_inputs)."""

    def __init__(self, stage, owner: PipelinedModel, feed: list):
        super().__init__()
        self.graph_module = stage.graph_module
        self.inputs = list(stage.inputs)
        self.placeholders = [n.target for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
        self.regather = None  # a Regather of this stage's ZeRO-3 gathers (set by PipelinedModel)
        self.params = nn.ParameterDict({key: owner.shards[key] for kind, key in feed if kind == "param"})
        self._feed = feed
        self._owner = [owner]  # not a submodule: the owner's parameters are not this module's children twice

    def forward(self, *received, **inputs):
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise CompileError(f"stage inputs {missing} were not passed to the schedule")
        owner = self._owner[0]
        owner._streams.calls += 1
        feed = [self.params[key] if kind == "param" else getattr(owner, key) for kind, key in self._feed]
        args = [*received, *(inputs[n] for n in self.inputs), *feed]
        if not self.regather:
            return self.graph_module(*args)
        with self.regather.forward(dict(zip(self.placeholders, args))):
            return self.graph_module(*args)


class PipelinedModel(CompiledModel):
    """This rank's stages of a pipelined plan.  `train_step(*inputs)` runs one step of the
    plan's schedule on the global batch and returns the loss on every rank; `cm(*inputs)`
    runs the forward passes only and returns the loss.  build_optimizer, full_state_dict,
    full_grads, load_full_state_dict and memory_report work as for unpipelined plans
    (whole tensors are gathered from the device group that holds them)."""

    def _setup(self, dm, group: int, stages: list, readers: dict, device, reshard_after_forward: bool,
               params: dict, param_of: dict, buffer_of: dict) -> None:
        """params: name -> (shape, dtype, requires_grad) of the model's parameters;
        param_of / buffer_of: placeholder -> parameter (tied: the owner's name) / buffer name."""
        info = self.plan.pipeline
        self._dm = dm
        self._group = group
        self._n_groups = info.groups
        self._n_stages = len(stages)
        self._n_mb = info.microbatches
        self._check_inputs.batch_scale = self._n_mb  # traced for one microbatch, called with the batch
        self._schedule_name = info.schedule
        self._pp_group = dm.get_group(STAGE_AXIS)
        self._last_group = (self._n_stages - 1) % self._n_groups
        self._device = device
        self._loss_index = None
        self.overlap_grad_sync = True  # False: reduce all gradients after the schedule
        self._owner = {name: min(gs) for name, gs in readers.items()}
        self._meta = {name: (params[name][0], self._compute_dtype_of(params[name][1])) for name in self._owner}
        self._trainable = {name for name, (_, _, grad) in params.items() if grad}
        self._tied = self._tied_groups(readers)
        self._groups_reading = {param_key(name): len(gs) for name, gs in readers.items()}
        self.stage_modules = []
        pipeline_stages = []
        for st in stages:
            if st.index % self._n_groups != group:
                continue
            feed = []
            for ph in st.params:
                if ph in param_of:
                    feed.append(("param", param_key(param_of[ph])))
                else:
                    feed.append(("buffer", param_key(buffer_of[ph])))
            module = _StageModule(st, self, feed)
            module.regather = Regather(module.graph_module, set(st.params), reshard_after_forward, self.groups)
            self.stage_modules.append(module)
            pipeline_stages.append(PipelineStage(module, st.index, self._n_stages, device, group=self._pp_group))
        self.pipeline_stages = pipeline_stages
        # gradient buckets start during each stage's last backward; a weight that two of this
        # rank's stages read is complete only after both, so finish() reduces it
        readers_here: dict = {}
        for module in self.stage_modules:
            for key in module.params:
                readers_here[key] = readers_here.get(key, 0) + 1
        self._grad_sync.hold = {key for key, n in readers_here.items() if n > 1}
        for key in readers_here:  # every gradient here is one device group's part of the model's
            if self.shards[key].requires_grad:
                self._grad_sync.pieces.setdefault(
                    key, f"device group {group} holds the gradient of {self.name_of[key]!r} for its pipeline "
                         f"stages only")
        for stage in pipeline_stages:
            for name in ("backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._sync_on_last(getattr(stage, name)))
        cls = SCHEDULES[self._schedule_name]
        target = pipeline_stages if self._schedule_name in MULTI_STAGE else pipeline_stages[0]
        if self._schedule_name not in MULTI_STAGE and len(pipeline_stages) != 1:
            raise CompileError(f"{self._schedule_name} runs one stage per device group; the plan puts "
                               f"{len(pipeline_stages)} on group {group}")
        self.schedule = cls(target, self._n_mb, loss_fn=self._microbatch_loss, scale_grads=False)
        log.info("pipelined %d stages (%s, %d microbatches); this rank holds stages %s of device group %d",
                 self._n_stages, self._schedule_name, self._n_mb, [s.index for s in stages
                                                                   if s.index % self._n_groups == group], group)

    def _copies(self, key: str) -> int:
        """As CompiledModel._copies, times the device groups holding the weight (tied ones)."""
        return super()._copies(key) * self._groups_reading.get(key, 1)

    def graphs(self) -> list:
        return [self.graph_module] + [m.graph_module for m in getattr(self, "stage_modules", [])]

    def gather_counts(self) -> dict:
        """As CompiledModel.gather_counts, over this rank's stages (per microbatch forward)."""
        return gather_counts_of(m.regather for m in self.stage_modules)

    def _sync_on_last(self, method):
        """`method` with gradient synchronisation on while the schedule runs a stage's last
        (full or weight) backward, so its buckets go out while backward goes on."""
        sync = self._grad_sync

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
        flat = self._dm.mesh.reshape(self._n_groups, -1)
        mine = int((flat[self._group] == dist.get_rank()).nonzero()[0, 0])
        made: dict = {}
        for name in sorted(readers):
            gs = tuple(sorted(readers[name]))
            if len(gs) < 2:
                continue
            if gs not in made:
                made[gs] = [dist.new_group([int(flat[g, c]) for g in gs]) for c in range(flat.shape[1])]
            if self._group in gs:
                out[param_key(name)] = made[gs][mine]
        return out

    # --- running -----------------------------------------------------------------------------
    def _microbatch_loss(self, output, _target):
        flat = list(output) if isinstance(output, tuple) else [output]
        loss = loss_of(self._structure(flat))
        if self._loss_index is None:
            self._loss_index = next((i for i, t in enumerate(flat) if t is loss), None)
        return loss / self._n_mb

    def _inputs(self, args, kwargs) -> dict:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise CompileError(f"inputs do not match the example inputs the model was compiled with "
                               f"(expected structure {self._in_spec}, got {spec})")
        names = [t for kind, t in zip((k for k, _ in self._order), self._placeholders) if kind == "input"]
        self._check_inputs(flat)
        return {n: (t.to(self._device) if isinstance(t, torch.Tensor) else t) for n, t in zip(names, flat)}

    def _run_schedule(self, args, kwargs, train: bool) -> torch.Tensor:
        inputs = self._inputs(args, kwargs)
        self._grad_sync.begin()
        last = any(st.is_last for st in self.pipeline_stages)
        losses: list = []
        extra = {"target": torch.zeros(self._n_mb, device=self._device), "losses": losses} if last else {}
        if train:
            with self._grad_sync.no_sync():  # (the last backward of each stage opens it: _sync_on_last)
                self.schedule.step(return_outputs=False, **extra, **inputs)
        else:
            with torch.no_grad():
                self.schedule.eval(return_outputs=False, **extra, **inputs)
        total = torch.zeros((), device=self._device)
        if last:
            total = torch.stack([t.detach().float().reshape(()) for t in losses]).sum()
            m = self._output_reduce.get(self._loss_index)
            if m is not None:  # the loss is a Partial sum over some sub-mesh axes
                total = move(total, m, self.groups)
        dist.broadcast(total, group_src=self._last_group, group=self._pp_group)
        return total

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """One step of the plan's schedule on the global batch: forward and backward of every
        microbatch, gradient synchronisation; returns the batch's loss on every rank."""
        self._check_joined()
        loss = self._run_schedule(args, kwargs, train=True)
        self._grad_sync.finish()
        self._sum_tied_grads()
        return loss

    def forward(self, *args, **kwargs):
        """The loss of the global batch (forward passes only), on every rank."""
        return self._run_schedule(args, kwargs, train=False)

    def _sum_tied_grads(self) -> None:
        for key, pg in self._tied.items():
            grad = self._grad_sync.zero_grads.get(key)
            if grad is None:
                grad = self.shards[key].grad
            if grad is not None:
                dist.all_reduce(grad, group=pg)

    def backward(self, loss):
        raise CompileError("a pipelined model runs backward inside its schedule: call cm.train_step(*inputs)")

    def no_sync(self):
        raise CompileError("a pipelined model accumulates over its microbatches itself: raise the plan's "
                           "microbatch count (autopar.Pipeline(microbatches=...)) instead of no_sync")

    def predicted_memory(self) -> dict:
        """The pipeline search's bytes per device for this rank's device group: its stages'
        model states plus the activations of the microbatches its schedule holds in flight."""
        info = self.plan.pipeline
        parts = dict(info.group_memory[self._group]) if info.group_memory else {}
        return dict(parts, total=info.memory[self._group])

    # --- whole tensors ----------------------------------------------------------------------
    def _across_groups(self, local: dict, dtype=None) -> dict:
        """Whole tensors held by each parameter's owning device group, broadcast to every rank."""
        out = {}
        for name in sorted(self._owner):
            shape, dt = self._meta[name]
            t = local.get(name) if self._group == self._owner[name] else None
            t = torch.empty(shape, dtype=dtype or dt, device=self._device) if t is None else t.to(self._device)
            dist.broadcast(t, group_src=self._owner[name], group=self._pp_group)
            out[name] = t.cpu()
        return out

    def full_state_dict(self, master: bool = False) -> dict:
        mine = {self.name_of[k]: self.whole_value(k, master) for k in self.shards}
        whole = self._across_groups(mine, torch.float32 if master and self.masters else None)
        return self._with_aliases_and_buffers(whole)

    def _sharded_state_supported(self) -> None:
        raise CompileError("state_dict() of a pipelined model (DTensors over each device group's sub-mesh) is not "
                           "supported yet; save full_state_dict() and load it with load_full_state_dict")

    def full_grads(self) -> dict:
        mine = super().full_grads()
        if not mine:  # no backward yet (the same on every rank)
            return {}
        return {n: g for n, g in self._across_groups(mine).items() if n in self._trainable}
