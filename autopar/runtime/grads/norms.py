"""The whole model's gradient norm from the pieces the ranks hold, and clipping by it.

After a synchronised backward a rank holds, per trainable parameter, its reduced piece of
the gradient: the local gradient of its shard, or its ZeRO-2 chunk (runtime/state/rank_state.RankState
.zero_grads).  A piece held alike by c ranks (the parameter is whole on mesh axes of c
ranks in all, or read by two pipeline device groups) is counted 1/c times on each, so one
all-reduce of the ranks' sums of |g|^p gives what torch.nn.utils.get_total_norm computes on
one device.  (The infinity norm needs no such division: one MAX all-reduce.)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def local_grads(state):
    """(key, this rank's reduced gradient piece) of every trainable parameter that has one:
    the local gradient, or the ZeRO-2 chunk."""
    for key, p in state.shards.items():
        if p.requires_grad:
            g = state.zero_grads.get(key)
            g = p.grad if g is None else g
            if g is not None:
                yield key, g


@torch.no_grad()
def grad_norm(state, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the whole model's gradient (see the module docstring), on every rank."""
    norm_type = float(norm_type)
    device = state.device
    grads = list(local_grads(state))
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max().double() for _, g in grads]).max() if grads else \
            torch.zeros((), dtype=torch.float64)
        local = local.to(device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return local.float()
    local = torch.zeros((), dtype=torch.float64, device=device)
    for key, g in grads:
        local += g.detach().double().norm(norm_type).pow(norm_type).to(device) / state.copies(key)
    dist.all_reduce(local)
    return local.pow(1.0 / norm_type).float()


@torch.no_grad()
def clip_grad_norm_(state, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for the compiled model: the whole gradient's norm
    (grad_norm), and every gradient piece scaled by min(1, max_norm / (norm + 1e-6)).
    Returns the norm before clipping."""
    total = grad_norm(state, norm_type)
    scale = (float(max_norm) / (total.item() + 1e-6))
    if scale < 1.0:
        for _, g in local_grads(state):
            g.mul_(scale)
    return total
