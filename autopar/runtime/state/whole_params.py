"""Optimizers whose update depends on a parameter's shape run on whole parameters.

Adam, SGD and the other elementwise optimizers compute on a shard or a ZeRO chunk exactly
what they compute on the whole tensor, so build_optimizer hands them this rank's pieces.
Adafactor (factored second moments over rows and columns), Shampoo, Muon and any other
optimizer that reads a matrix's shape or whole-matrix statistics would compute something
else on a piece.  For those, WholeParamOptimizer shards the optimizer by parameter instead:

- every trainable parameter has one owner rank (largest first, to the least loaded rank);
- at step() each parameter's reduced gradient and current value are gathered whole (every
  rank takes part in the collectives; only the owner keeps them), the owner runs the
  optimizer on its whole parameters, and the updated value is broadcast from the owner
  and each rank keeps its shard.

Optimizer state lives only on the owner (state memory divided by parameter), but each step
moves every weight and gradient whole: correct for any optimizer, slower than the
elementwise path.  ELEMENTWISE lists the optimizers known to be safe on pieces; pass
`elementwise=True` to build_optimizer for another optimizer you know to be elementwise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.passes.shard_params import shard_of

from autopar.runtime.state.sharded_optimizer import WrappedOptimizer

ELEMENTWISE = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                         torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
                         torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD})


def owners(sizes: dict, world: int) -> dict:
    """key -> owning rank: largest parameter first, each to the least loaded rank."""
    load = [0] * world
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[key] = rank
        load[rank] += sizes[key]
    return out


class WholeParamOptimizer(WrappedOptimizer):
    """`cls` on whole parameters, each on its owner rank (see the module docstring);
    `rank_state` is the compiled model's runtime/state/rank_state.RankState."""

    def __init__(self, rank_state, cls, **kwargs):  # noqa: D107
        self.keys = [k for k, p in rank_state.shards.items() if p.requires_grad]
        shapes = {k: rank_state.full_shape(k) for k in self.keys}
        self.owner = owners({k: torch.Size(s).numel() for k, s in shapes.items()}, dist.get_world_size())
        me = dist.get_rank()
        device = next(iter(rank_state.shards.values())).device
        self.whole = {k: nn.Parameter(torch.empty(shapes[k], dtype=rank_state.shards[k].dtype, device=device))
                      for k in self.keys if self.owner[k] == me}
        # a rank that owns nothing still has param_groups (for LR schedulers)
        params = list(self.whole.values()) or [nn.Parameter(torch.zeros(0, device=device))]
        super().__init__(rank_state, cls(params, **kwargs))

    def __repr__(self) -> str:
        return f"WholeParamOptimizer({self.optimizer!r}, {len(self.whole)} of {len(self.keys)} parameters here)"

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("autopar's optimizers take no closure: call cm.train_step, then step()")
        state = self.rank_state
        for key in self.keys:  # gather (every rank takes part), the owner keeps
            grad, value = state.whole_grad(key), state.whole(key, state.local_value(key))
            if key in self.whole:
                self.whole[key].copy_(value)
                self.whole[key].grad = grad
        self.optimizer.step()
        for key in self.keys:
            p = state.shards[key]
            value = self.whole[key].detach() if key in self.whole else torch.empty(
                state.full_shape(key), dtype=p.dtype, device=p.device)
            dist.broadcast(value, src=self.owner[key])
            p.copy_(shard_of(value, state.plan.param_placements[state.name_of[key]], state.groups))
        for w in self.whole.values():
            w.grad = None

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for key in self.keys:
            self.rank_state.shards[key].grad = None
        self.rank_state.zero_grads.clear()
