"""Optimizer state under parameter names, as DTensors, so it moves between plans and meshes.

An optimizer built by `cm.build_optimizer` keeps its state per tensor it updates: a shard
of a parameter, a ZeRO-1/2 chunk of the flat local tensor, or a float32 master copy of
either.  `optimizer_state_dict` turns that into the layout torch.distributed.checkpoint
expects (the one `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` uses):

    {"state": {parameter name: {"exp_avg": DTensor, "step": tensor, ...}},
     "param_groups": [{"lr": ..., ..., "params": [parameter names]}]}

A state tensor shaped like the updated tensor becomes a DTensor with the parameter's
placements (a ZeRO chunk is first gathered back into the local tensor's shape over the
ZeRO axes); scalars (Adam's step) stay tensors, the same on every rank.
`load_optimizer_state_dict` takes the same structure from any plan (DTensors are
redistributed or cut to this plan's pieces) and writes it into the optimizer's state.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autopar.passes.shard_params import shard_of

from .zero import ShardedOptimizer, WrappedOptimizer, all_gather_chunks


class CheckpointError(RuntimeError):
    """The optimizer's state cannot be saved or loaded this way; the message says why."""


def _entries(cm, opt) -> list:
    """(key, parameter shard, ZeroLayout or None, tensor the optimizer updates) per trainable parameter."""
    if isinstance(opt, ShardedOptimizer):
        return list(opt.entries)
    if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, WrappedOptimizer):
        raise CheckpointError(f"optimizer_state_dict takes an optimizer from cm.build_optimizer with an elementwise "
                              f"optimizer (got {type(opt).__name__}); save whole-parameter optimizers' "
                              f"state_dict() per rank")
    by_id = {id(p): k for k, p in cm.shards.items()}
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError("the optimizer holds a tensor that is not one of the compiled model's "
                                      "parameters; build it with cm.build_optimizer")
            out.append((by_id[id(p)], p, None, p))
    return out


def _inner(opt):
    return opt.optimizer if isinstance(opt, ShardedOptimizer) else opt


def _ensure_state(opt, entries) -> None:
    """Give every updated tensor its state (a step at learning rate 0 on zero gradients, as
    torch.distributed.checkpoint does), so a fresh optimizer can be loaded into in place."""
    inner = _inner(opt)
    if all(inner.state.get(t) for _, _, _, t in entries):
        return
    saved = [(g, g["lr"]) for g in inner.param_groups]
    for g, _ in saved:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    for _, _, _, t in entries:
        t.grad = torch.zeros_like(t)
    inner.step()
    for g, lr in saved:
        g["lr"] = lr
    for _, _, _, t in entries:
        t.grad = None


def optimizer_state_dict(cm, opt) -> dict:
    """`opt`'s state under parameter names, DTensors for per-element state (see above)."""
    entries = _entries(cm, opt)
    _ensure_state(opt, entries)
    inner = _inner(opt)
    names = {}
    state = {}
    for key, p, lay, target in entries:
        name = cm.name_of[key]
        names[id(target)] = name
        placements = tuple(cm.plan.param_placements[name])
        shape = torch.Size(cm.full_shape(key))
        out = {}
        for k, v in inner.state.get(target, {}).items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape != target.shape:
                out[k] = v
                continue
            local = v
            if lay is not None:  # a ZeRO chunk: back into the local tensor's shape
                local = torch.zeros(p.shape, dtype=v.dtype, device=p.device)
                local.view(-1)[lay.start: lay.end] = v.to(p.device).view(-1)
                all_gather_chunks([local], [lay], cm.groups)
            local = local.to(p.device).view(p.shape)
            out[k] = DTensor.from_local(local, cm.groups.mesh, placements, run_check=False, shape=shape,
                                        stride=torch.empty(shape, device="meta").stride())
        state[name] = out
    groups = []
    for g in inner.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(t)] for t in g["params"]]})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(cm, opt, saved: dict) -> None:
    """Write `saved` (optimizer_state_dict of this or another plan, loaded by
    torch.distributed.checkpoint or whole) into `opt`'s state."""
    entries = _entries(cm, opt)
    _ensure_state(opt, entries)
    inner = _inner(opt)
    missing = [cm.name_of[k] for k, _, _, _ in entries if cm.name_of[k] not in saved["state"]]
    if missing:
        raise CheckpointError(f"optimizer state lacks parameters {missing[:5]}; it was saved for another model")
    for key, p, lay, target in entries:
        name = cm.name_of[key]
        placements = tuple(cm.plan.param_placements[name])
        mine = inner.state[target]
        for k, v in saved["state"][name].items():
            if not isinstance(v, torch.Tensor) or (v.dim() == 0 and not isinstance(v, DTensor)):
                mine[k] = v.clone() if isinstance(v, torch.Tensor) else v
                continue
            if isinstance(v, DTensor) and v.device_mesh == cm.groups.mesh:
                local = v.redistribute(cm.groups.mesh, placements).to_local()
            else:
                whole = v.full_tensor() if isinstance(v, DTensor) else v
                local = shard_of(whole.to(p.device), placements, cm.groups)
            if lay is not None:
                local = local.reshape(-1)[lay.start: lay.end]
            mine[k].copy_(local.to(mine[k].device, mine[k].dtype).view_as(mine[k]))
    for g, s in zip(inner.param_groups, saved["param_groups"]):
        g.update({k: v for k, v in s.items() if k != "params"})
