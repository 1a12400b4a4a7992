"""The optimizer over what this rank owns of every parameter, and its state under parameter names.

`ShardedOptimizer` runs any elementwise torch optimizer (the user's class, built here over
tensors this rank owns) on this rank's part of every trained parameter: for a parameter
without ZeRO-1/2 the local shard itself (or its float32 master under mixed precision or
offload); for a ZeRO-1/2 parameter only the owned chunk of the flat local tensor (a view
into the parameter, or its master chunk), after which the chunks are all-gathered
(runtime/grads/zero.py).  Elementwise optimizers (SGD, Adam, AdamW, ...) therefore compute exactly
what they compute on the whole model.  It is a torch.optim.Optimizer (LR schedulers take
it); param_groups and state are the wrapped optimizer's.

Its state_dict() is the layout torch.distributed.checkpoint expects (the one
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` uses):

    {"state": {parameter name: {"exp_avg": DTensor, "step": tensor, ...}},
     "param_groups": [{"lr": ..., ..., "params": [parameter names]}]}

A state tensor shaped like the updated tensor becomes a DTensor with the parameter's
placements (a ZeRO chunk is first gathered back into the local tensor's shape over the
ZeRO axes); scalars (Adam's step) stay tensors, the same on every rank.  load_state_dict
takes the same structure from any plan (DTensors are redistributed or cut to this plan's
pieces) and writes it into the optimizer's state.  So the usual DCP pattern works with
the optimizer itself, and the state of one plan or mesh loads into another.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.passes.shard_params import shard_of

from autopar.runtime.state.disk import wait
from autopar.runtime.grads.norms import clip_grad_norm_
from autopar.runtime.process import CompileError
from autopar.runtime.grads.zero import all_gather_chunks, buckets


class CheckpointError(RuntimeError):
    """The optimizer's state cannot be saved or loaded this way; the message says why."""


class WrappedOptimizer(torch.optim.Optimizer):
    """A torch optimizer (`self.optimizer`) that runs on tensors derived from a rank's
    shards (`rank_state`, runtime/state/rank_state.RankState); param_groups, state, state_dict and
    load_state_dict are the wrapped optimizer's, so LR schedulers work.  Subclasses set up
    `optimizer` and define step and zero_grad."""

    def __init__(self, rank_state, optimizer):  # noqa: D107 (no Optimizer.__init__: it would register the
        # parameters a second time; the wrapped optimizer owns them)
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self.rank_state = rank_state
        self.optimizer = optimizer
        self.defaults = optimizer.defaults

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The compiled model's clip_grad_norm_ (every shard and ZeRO chunk counted once)."""
        return clip_grad_norm_(self.rank_state, max_norm, norm_type)


class ShardedOptimizer(WrappedOptimizer):
    """`cls` run on what this rank owns of every trained parameter (see the module
    docstring).  entries: (key, parameter shard, ZeroLayout or None, tensor the optimizer
    updates) per trained parameter, in the shards' order."""

    def __init__(self, rank_state, cls, bucket_bytes: int, chunk_bytes: int | None = None,
                 **kwargs):  # noqa: D107
        self.bucket_bytes = bucket_bytes
        self.chunk_bytes = chunk_bytes   # step at most this many bytes of updated tensors at once (None: all)
        self.entries = []
        for key, p in rank_state.shards.items():
            if not p.requires_grad:
                continue
            lay = rank_state.zero_layouts.get(key)
            target = rank_state.masters.get(key)
            if target is None:
                target = p if lay is None else nn.Parameter(p.detach().view(-1)[lay.start: lay.end])
            self.entries.append((key, p, lay, target))
        if not self.entries:
            raise CompileError("every parameter of the model is frozen (requires_grad=False): there is "
                               "nothing to optimise")
        super().__init__(rank_state, cls([t for _, _, _, t in self.entries], **kwargs))
        self.derived = any(t is not p for _, p, _, t in self.entries)   # some updated tensor is not a shard
        self.gathered = [k for k, _, lay, _ in self.entries if lay is not None]

    def _grad_of(self, key, p, lay):
        if lay is None:
            return p.grad
        if lay.stage == 2:
            return self.rank_state.zero_grads.get(key)
        return None if p.grad is None else p.grad.view(-1)[lay.start: lay.end]

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the wrapped optimizer on this rank's part; a closure only where it
        updates the shards themselves (no master weights, no ZeRO-1/2 chunks).

        With `chunk_bytes` (an elementwise torch optimizer, whose state is per tensor) the
        step runs over consecutive runs of the updated tensors of at most that many bytes,
        each its own call of the wrapped optimizer, the others' gradients hidden meanwhile:
        the float32 gradient copies under mixed precision and the foreach kernels'
        temporaries then take one run's size, not the whole model's (on one H100 they were
        2 x 4 bytes per parameter, 11 GB for 1.4 B parameters).  The result is the same:
        each tensor is stepped once, by the same kernels."""
        if closure is not None and self.derived:
            raise ValueError("autopar's sharded optimizer takes no closure: call cm.train_step, then step()")
        if closure is not None or self.chunk_bytes is None:
            with self._resident(self.entries):
                loss = self._step_run(self.entries, closure)
        else:
            loss = None
            own = {id(p): p.grad for _, p, _, target in self.entries if target is p}   # backward's own gradients
            for _, p, _, target in self.entries:
                if target is p:
                    p.grad = None
            runs = list(self._runs())
            disk = self.rank_state.disk
            written = []
            try:
                ahead = disk.fetch(self._on_disk(runs[0])) if disk is not None else None
                for i, run in enumerate(runs):
                    if disk is not None:   # this run's states read; the next run's read while this one steps
                        wait(ahead)
                        if i + 1 < len(runs):
                            ahead = disk.fetch(self._on_disk(runs[i + 1]))
                    for _, p, _, target in run:
                        if target is p:
                            p.grad = own[id(p)]
                    self._step_run(run, None)
                    for _, p, _, target in run:
                        if target is p:
                            p.grad = None
                    if disk is not None:
                        written.append(disk.spill(self._on_disk(run)))
            finally:
                for _, p, _, target in self.entries:
                    if target is p:
                        p.grad = own[id(p)]
                for future in written:
                    wait(future)
        self._gather_chunks()
        return loss

    def _on_disk(self, entries) -> list:
        """(file name, tensor) of what the disk tier holds of `entries`: each disk-tier
        parameter's master and its per-element optimizer states (Adam's moments; scalars
        such as the step count stay in memory)."""
        state = self.rank_state
        out = []
        for key, _, _, target in entries:
            if key not in state.disk_keys:
                continue
            out.append((state.master_file(key), target))
            for name, value in self.optimizer.state.get(target, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out.append((f"{key}.{name}", value))
        return out

    def _resident(self, entries):
        """A context in which the disk tier's part of `entries` is in memory (see _on_disk),
        written out after it with any state the block made."""
        disk = self.rank_state.disk
        return contextlib.nullcontext() if disk is None else disk.resident(lambda: self._on_disk(entries))

    @contextlib.contextmanager
    def _mapped(self):
        """A context in which every disk-tier tensor reads its file through a read-only
        mapping (runtime.state.disk.DiskStore.mapped): tensors taken from them inside (a state
        dict's) keep the mapping, and hold no copy in memory."""
        disk = self.rank_state.disk
        items = self._on_disk(self.entries) if disk is not None else []
        for name, t in items:
            t.data = disk.mapped(name, t)
        try:
            yield
        finally:
            for _, t in items:
                t.data = torch.empty(0, dtype=t.dtype)

    def _runs(self):
        """Consecutive entries whose updated tensors hold at most chunk_bytes together (one
        larger tensor alone)."""
        run, size = [], 0
        for entry in self.entries:
            _, p, lay, target = entry
            numel = lay.end - lay.start if lay is not None else p.numel()   # (a disk-tier target holds no storage now)
            nbytes = numel * target.element_size()
            if run and size + nbytes > self.chunk_bytes:
                yield run
                run, size = [], 0
            run.append(entry)
            size += nbytes
        if run:
            yield run

    def _step_run(self, entries, closure):
        """The wrapped optimizer's step over `entries` (only theirs have gradients)."""
        state = self.rank_state
        temporary = []
        for key, p, lay, target in entries:
            if target is p:
                continue  # the optimizer reads p.grad itself
            g = self._grad_of(key, p, lay)
            target.grad = None if g is None else g.to(target.device, target.dtype)
            temporary.append(target)
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        for key, p, lay, target in entries:
            if target is p or target.grad is None:
                continue
            if key in state.masters:  # master -> the compute weights
                dst = p.view(-1)[lay.start: lay.end] if lay is not None else p
                dst.copy_(target.view_as(dst))
        for t in temporary:
            t.grad = None
        return loss

    def _gather_chunks(self):
        """ZeRO-1/2: the updated chunks all-gathered into every rank's weights, in buckets."""
        state = self.rank_state
        shards, layouts = state.shards, state.zero_layouts
        sizes = {k: shards[k].numel() * shards[k].element_size() for k in self.gathered}
        for run in buckets(self.gathered, layouts, sizes, self.bucket_bytes):
            all_gather_chunks([shards[k] for k in run], [layouts[k] for k in run], state.groups)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, p, _, target in self.entries:
            if target is not p:   # (the wrapped optimizer cleared the shards it updates itself)
                p.grad = None
        self.rank_state.zero_grads.clear()

    def state_dict(self) -> dict:
        """The state under parameter names, DTensors for per-element state (see the module
        docstring): saved with torch.distributed.checkpoint, it loads into another plan or mesh.
        States on disk are given as read-only mappings of their files (on CPU ranks; moved
        to the device on others)."""
        if self.rank_state.disk is None:
            return optimizer_state_dict(self.rank_state, self.entries, self.optimizer)
        with self._resident(self.entries):   # (a fresh optimizer's states made and written out)
            ensure_state(self.optimizer, self.entries)
        with self._mapped():
            return optimizer_state_dict(self.rank_state, self.entries, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load state_dict()'s layout of this or another plan, DTensors or whole tensors."""
        with self._resident(self.entries):
            load_optimizer_state_dict(self.rank_state, self.entries, self.optimizer, state_dict)


# --- the state under parameter names ---------------------------------------------------------------
def ensure_state(optimizer, entries) -> None:
    """Give every updated tensor its state (a step at learning rate 0 on zero gradients, as
    torch.distributed.checkpoint does), so a fresh optimizer can be loaded into in place."""
    if all(optimizer.state.get(t) for _, _, _, t in entries):
        return
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    for g, _ in saved:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    for _, _, _, t in entries:
        t.grad = torch.zeros_like(t)
    optimizer.step()
    for g, lr in saved:
        g["lr"] = lr
    for _, _, _, t in entries:
        t.grad = None


def optimizer_state_dict(state, entries: list, optimizer) -> dict:
    """`optimizer`'s state (a torch optimizer updating the `entries`' targets) under
    parameter names, DTensors for per-element state (see the module docstring)."""
    ensure_state(optimizer, entries)
    names = {}
    out_state = {}
    for key, p, lay, target in entries:
        name = state.name_of[key]
        names[id(target)] = name
        placements = tuple(state.plan.param_placements[name])
        shape = torch.Size(state.full_shape(key))
        out = {}
        for k, v in optimizer.state.get(target, {}).items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape != target.shape:
                out[k] = v
                continue
            local = v
            if lay is not None:  # a ZeRO chunk: back into the local tensor's shape
                local = torch.zeros(p.shape, dtype=v.dtype, device=p.device)
                local.view(-1)[lay.start: lay.end] = v.to(p.device).view(-1)
                all_gather_chunks([local], [lay], state.groups)
            local = local.to(p.device).view(p.shape)
            out[k] = DTensor.from_local(local, state.groups.mesh, placements, run_check=False, shape=shape,
                                        stride=torch.empty(shape, device="meta").stride())
        out_state[name] = out
    groups = []
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(t)] for t in g["params"]]})
    return {"state": out_state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(state, entries: list, optimizer, saved: dict) -> None:
    """Write `saved` (optimizer_state_dict of this or another plan, loaded by
    torch.distributed.checkpoint or whole) into `optimizer`'s state."""
    ensure_state(optimizer, entries)
    missing = [state.name_of[k] for k, _, _, _ in entries if state.name_of[k] not in saved["state"]]
    if missing:
        raise CheckpointError(f"optimizer state lacks parameters {missing[:5]}; it was saved for another model")
    for key, p, lay, target in entries:
        name = state.name_of[key]
        placements = tuple(state.plan.param_placements[name])
        mine = optimizer.state[target]
        for k, v in saved["state"][name].items():
            if not isinstance(v, torch.Tensor) or (v.dim() == 0 and not isinstance(v, DTensor)):
                mine[k] = v.clone() if isinstance(v, torch.Tensor) else v
                continue
            if isinstance(v, DTensor) and v.device_mesh == state.groups.mesh:
                local = v.redistribute(state.groups.mesh, placements).to_local()
            else:
                whole = v.full_tensor() if isinstance(v, DTensor) else v
                local = shard_of(whole.to(p.device), placements, state.groups)
            if lay is not None:
                local = local.reshape(-1)[lay.start: lay.end]
            src = local.to(mine[k].device, mine[k].dtype).view_as(mine[k])
            if src.untyped_storage().data_ptr() == mine[k].untyped_storage().data_ptr():
                # (DCP loaded into the state's own storage through the DTensors optimizer_state_dict
                # gave: where the views differ, a copy in place would read what it overwrites)
                src = src.clone()
            mine[k].copy_(src)
    for g, s in zip(optimizer.param_groups, saved["param_groups"]):
        g.update({k: v for k, v in s.items() if k != "params"})
