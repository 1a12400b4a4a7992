"""One rank's state of a compiled model: what it holds, and the one function that builds it.

A `RankState` is everything a rank keeps between steps, apart from how a step runs: this
rank's parameter shards (in the compute dtype, on its device), the float32 master weights
the optimizer updates under mixed precision or offload, the ZeRO-1/2 layouts of the
parameters whose optimizer state is split, the buffers the graph reads and the persistent
ones the plain model's state_dict() has, the names (planned name of every shard, tied
aliases, fused weights' parts), the mesh's process groups, and the ZeRO-2 gradient chunks
the gradient synchronisation leaves here.

The model (runtime/model.CompiledModel), its optimizers (runtime/grads/zero.py,
runtime/state/whole_params.py), its state dicts (runtime/state/plain_state.py, runtime/state/optimizer.py)
and its gradient norms (runtime/grads/norms.py) all read and write this one record; none of
them reads another's internals.  The record's fields never change after build_rank_state;
what changes is the tensors' values (a step, a load) and the contents of `zero_grads`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.cost import prices as C
from autopar.cost.precision import MixedPrecision
from autopar.passes.redistribute import MeshGroups, redistribute_local
from autopar.passes.shard_params import shard_of
from autopar.report.plan import Plan
from autopar.trace.fused import Parts

from autopar.runtime.state.disk import DiskStore, check_directory, wait
from autopar.runtime.process import CompileError, device_of
from autopar.runtime.grads.zero import all_gather_chunks, zero_layout


def param_key(name: str) -> str:
    """A parameter's attribute name in the compiled module (dots become '__')."""
    return name.replace(".", "__")


@dataclass(frozen=True, eq=False)
class RankState:
    """One rank's part of the model's state (see the module docstring).  Keys ("key") are
    param_key(planned name): `h__0__attn__c_attn__weight`."""

    plan: Plan
    groups: MeshGroups
    device: torch.device
    precision: MixedPrecision | None
    shards: nn.ParameterDict   # key -> this rank's shard, compute dtype, plan's placements
    masters: dict              # key -> float32 master (a ZeRO chunk of it; on the host when offloaded)
    zero_layouts: dict         # key -> runtime.grads.zero.ZeroLayout of a ZeRO-1/2 parameter
    buffers: dict              # key -> buffer the graph reads, or a persistent one of the plain model
    buffer_names: dict         # plain model's name -> key of its persistent buffers
    aliases: dict              # tied name -> the name its weight is planned under
    name_of: dict              # key -> planned name (a fused weight's part: `w[:, 0:64]`)
    parts: Parts               # fused weights planned as parts: the shards hold parts, the user sees wholes
    trained: frozenset         # the plain model's trained parameter names
    sync_axes: dict            # key -> mesh axes runtime.grads.sync all-reduces its gradient over
    holders: dict = field(default_factory=dict)   # key -> device groups holding a copy (a tied head); else 1
    zero_grads: dict = field(default_factory=dict)  # key -> this rank's chunk of a ZeRO-2 summed gradient
    disk: object = None        # runtime.state.disk.DiskStore holding the masters (and optimizer states) of disk_keys
    disk_keys: frozenset = frozenset()   # keys whose optimizer states the plan keeps on disk
    offloaded_weights: dict = field(default_factory=dict)   # key -> tier ("host", "disk") its stored shard lives in

    def master_file(self, key: str) -> str:
        """The disk store's name for parameter `key`'s float32 master."""
        return f"{key}.master"

    def resident_master(self, key: str, write_back: bool = False):
        """A context in which parameter `key`'s master is in memory (a disk-tier master read
        back, and written out again after where write_back); nothing to do for the others."""
        if key not in self.disk_keys:
            return contextlib.nullcontext()
        return self.disk.resident(lambda: [(self.master_file(key), self.masters[key])], write_back=write_back)

    def __str__(self) -> str:
        trained = sum(p.requires_grad for p in self.shards.values())
        return (f"RankState({len(self.shards)} shards ({trained} trained, {len(self.masters)} with float32 masters, "
                f"{len(self.zero_layouts)} ZeRO-1/2), {len(self.buffers)} buffers, {len(self.aliases)} tied aliases, "
                f"{len(self.parts.parts)} fused parts, mesh {self.plan.mesh.shape} on {self.device})")

    @property
    def device_type(self) -> str:
        return self.device.type

    def compute_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter or buffer of `dtype` computes in (param_dtype under mixed precision)."""
        return self.precision.param_dtype if self.precision is not None and dtype == torch.float32 else dtype

    def full_shape(self, key: str) -> tuple:
        """The whole shape of parameter `key`."""
        shape = list(self.shards[key].shape)
        for axis, p in enumerate(self.plan.param_placements[self.name_of[key]]):
            if isinstance(p, Shard):
                shape[p.dim] *= self.groups.size(axis)
        return tuple(shape)

    def copies(self, key: str) -> int:
        """How many ranks hold the same piece of parameter `key`'s gradient as this rank: the
        sizes of the mesh axes it is whole on, less those a ZeRO-2 chunk splits, times the
        device groups holding a copy (a tied weight read by two pipeline groups)."""
        lay = self.zero_layouts.get(key)
        chunked = set(lay.reduce_axes + lay.rest_axes) if lay is not None and lay.stage == 2 else set()
        placements = self.plan.param_placements[self.name_of[key]]
        size = 1
        for a, p in enumerate(placements):
            if not isinstance(p, Shard) and a not in chunked:
                size *= self.groups.size(a)
        return size * self.holders.get(key, 1)

    def local_value(self, key: str, master: bool = False) -> torch.Tensor:
        """This rank's shard of parameter `key`; master=True: of its float32 master weights
        where the optimizer keeps them (a ZeRO chunk gathered back into the shard's shape,
        collectives over the ZeRO axes)."""
        p = self.shards[key]
        if not (master and key in self.masters):
            return p
        lay = self.zero_layouts.get(key)
        with self.resident_master(key):
            m = self.masters[key].detach().to(p.device, copy=True)
        if lay is None:
            return m.view(p.shape)
        local = torch.zeros(p.shape, dtype=m.dtype, device=p.device)
        local.view(-1)[lay.start: lay.end] = m
        all_gather_chunks([local], [lay], self.groups)
        return local

    def whole(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """`local`, laid out as parameter `key`, whole on every rank (collectives on every rank)."""
        placements = self.plan.param_placements[self.name_of[key]]
        return redistribute_local(local.detach(), tuple(placements), tuple(Replicate() for _ in placements),
                                  self.groups)

    def whole_grad(self, key: str) -> torch.Tensor | None:
        """Parameter `key`'s reduced gradient whole on every rank (ZeRO-2 chunks gathered);
        None before any backward."""
        p = self.shards[key]
        grad = p.grad
        chunk = self.zero_grads.get(key)
        if chunk is not None:
            lay = self.zero_layouts[key]
            grad = torch.zeros_like(p, dtype=chunk.dtype)
            grad.view(-1)[lay.start: lay.end] = chunk
            all_gather_chunks([grad], [lay], self.groups)
        return None if grad is None else self.whole(key, grad)

    @torch.no_grad()
    def load_param(self, key: str, value) -> None:
        """Parameter `key` set from a DTensor or a whole tensor (its master weights too)."""
        p = self.shards[key]
        placements = tuple(self.plan.param_placements[self.name_of[key]])
        if isinstance(value, DTensor) and value.device_mesh == self.groups.mesh:
            local = value.redistribute(self.groups.mesh, placements).to_local()
        elif isinstance(value, DTensor):
            local = shard_of(value.full_tensor().to(p.device), placements, self.groups)
        else:
            local = shard_of(value.to(p.device), placements, self.groups)
        if local.data_ptr() != p.data_ptr():
            p.copy_(local.to(p.device, p.dtype))
        if key in self.masters:
            with self.resident_master(key, write_back=True):
                m = self.masters[key]
                lay = self.zero_layouts.get(key)
                src = local.detach().reshape(-1)[lay.start: lay.end] if lay is not None else local.detach()
                m.copy_(src.to(m.device, m.dtype).view_as(m))


def build_rank_state(rewritten, plan: Plan, groups: MeshGroups, shards: dict, model: nn.Module, device_type: str,
                     precision: MixedPrecision | None, holders: dict | None = None,
                     offload_dir=None) -> RankState:
    """This rank's state from this rank's graph (runtime/build.RankGraph), the plan, its
    initial shards (planned name -> tensor, runtime/build.initial_shards) and the user's
    model (for its buffers, tied names and which parameters it trains).  holders: key ->
    device groups holding a copy of the weight (pipelined plans; default 1).  offload_dir:
    where the plan keeps optimizer states on disk, the directory this rank's store
    (runtime.state.disk.DiskStore) is made in, checked first (runtime.state.disk.check_directory); the
    masters are written there as they are made.  A parameter whose plan offloads its
    weights (ParamState.weights) is stored in host memory (pinned on GPUs), or on disk as
    a shared mapping of its file: the device holds none of it between uses."""
    traced = rewritten.traced
    device = device_of(device_type)
    parts = traced.parts
    trainable = {n: p.requires_grad for n, p in parts.named_parameters(model).items()}

    def compute(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(_compute_dtype(precision, t.dtype))

    sync = {param_key(name): axes for name, axes in rewritten.grad_sync.items() if name in shards and trainable[name]}
    zero_layouts = {}
    for name, state in plan.param_states.items():
        if state.stage and name in shards and trainable[name]:  # (a stage holds some of the parameters)
            k = param_key(name)
            axes = tuple(plan.mesh.axis_names.index(a) for a in state.axes)
            zero_layouts[k] = zero_layout(state.stage, axes, sync.get(k, ()), shards[name].numel(), groups,
                                          state.offload)
    model_name = {param_key(k): k for k in shards}
    masters = _masters(plan, shards, trainable, zero_layouts, precision, device)
    weights_tier = {param_key(name): state.offload for name, state in plan.param_states.items()
                    if state.weights and name in shards and trainable.get(name, False)}
    synced = sorted(k for k in weights_tier if sync.get(k))
    if synced and device.type == "cuda":
        raise CompileError(f"the plan keeps the weights of {[model_name[k] for k in synced[:3]]} in host memory or on "
                           f"disk, and their gradients are summed over mesh axes after backward, which runs on the "
                           f"device only; plan them with their weights on the device (ParamState.weights=False)")
    params = nn.ParameterDict({param_key(k): nn.Parameter(compute(v).to(device), requires_grad=trainable[k])
                               for k, v in shards.items() if param_key(k) not in weights_tier})
    buffers, buffer_names = _buffers(rewritten, model, compute, device)
    # names the plain model's state_dict() has: tied aliases (and the persistent buffers, _buffers)
    aliases = {n: traced.tied[n] for n, _ in model.named_parameters(remove_duplicate=False)
               if traced.tied.get(n, n) != n}
    disk_keys = frozenset(k for k in masters if getattr(plan.param_states.get(model_name[k]), "offload", "") == "disk")
    disk = None
    if disk_keys:
        need = sum(masters[k].numel() * C.offloaded_bytes(shards[model_name[k]].element_size(), precision is not None)
                   for k in disk_keys)
        need += sum(shards[model_name[k]].numel() * _compute_dtype(precision, shards[model_name[k]].dtype).itemsize
                    for k, tier in weights_tier.items() if tier == "disk")
        directory = check_directory(offload_dir, need, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        disk = DiskStore(directory, dist.get_rank() if dist.is_initialized() else 0)
    for k, tier in weights_tier.items():   # stored shards beyond the device (regions/reshard.py fetches them)
        value = compute(shards[model_name[k]])
        if tier == "disk":
            value = disk.mapping(f"{k}.weight", value)
        elif device.type == "cuda":
            value = value.pin_memory()
        params[k] = nn.Parameter(value.cpu(), requires_grad=True)
    params = nn.ParameterDict({param_key(k): params[param_key(k)] for k in shards})   # (the shards' order)
    state = RankState(plan=plan, groups=groups, device=device, precision=precision, shards=params, masters=masters,
                      zero_layouts=zero_layouts, buffers=buffers, buffer_names=buffer_names, aliases=aliases,
                      name_of=model_name, parts=parts,
                      trained=frozenset(n for n, p in model.named_parameters() if p.requires_grad),
                      sync_axes=sync, holders=dict(holders or {}), disk=disk, disk_keys=disk_keys,
                      offloaded_weights=weights_tier)
    if disk is not None:
        wait(disk.spill((state.master_file(k), masters[k]) for k in sorted(disk_keys)))
    return state


def _compute_dtype(precision: MixedPrecision | None, dtype: torch.dtype) -> torch.dtype:
    return precision.param_dtype if precision is not None and dtype == torch.float32 else dtype


def _masters(plan: Plan, shards: dict, trainable: dict, zero_layouts: dict, precision: MixedPrecision | None,
             device: torch.device) -> dict:
    """key -> the master weights of each trained floating-point parameter under mixed
    precision (float32) or offload (in the host's memory): its ZeRO chunk where it has one."""
    masters = {}
    for name, value in shards.items():
        k = param_key(name)
        state = plan.param_states.get(name)
        offload = state is not None and state.offload
        if trainable.get(name, False) and value.is_floating_point() and (precision is not None or offload):
            lay = zero_layouts.get(k)
            part = value.detach().reshape(-1)[lay.start: lay.end] if lay is not None else value.detach()
            home = torch.device("cpu") if offload else device
            dtype = torch.float32 if precision is not None else value.dtype
            masters[k] = nn.Parameter(part.to(home, dtype, copy=True))
    return masters


def _buffers(rewritten, model: nn.Module, compute, device: torch.device) -> tuple[dict, dict]:
    """(key -> buffer, plain model's name -> key): the buffers the graph reads, in the
    compute dtype (`compute`), and the plain model's persistent ones (those the graph does
    not read are kept as they are, so a state dict is complete)."""
    traced = rewritten.traced
    buffers = {}
    plain_buffers = dict(model.named_buffers())
    for node in rewritten.graph.graph.nodes:   # the buffers the graph reads
        if node.op == "placeholder" and node.target in traced.buffers and node.target not in traced.params:
            name = traced.buffers[node.target]
            buf = plain_buffers.get(name, traced.constants.get(name))  # (a constant the forward creates)
            if buf is None or buf.is_meta:
                raise CompileError(f"buffer {name} has no value; initialise it before compiling")
            buffers[param_key(name)] = compute(buf).to(device)
    persistent = set(model.state_dict(keep_vars=True))
    buffer_names = {}
    for name, buf in model.named_buffers():
        if name not in persistent:
            continue
        if param_key(name) not in buffers:
            if buf.is_meta:
                continue
            buffers[param_key(name)] = buf.detach().clone().to(device)
        buffer_names[name] = param_key(name)
    return buffers, buffer_names
