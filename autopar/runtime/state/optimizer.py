"""Which optimizer a rank gets from `cm.build_optimizer`, and the state dict of any optimizer
over the compiled model's shards.

An elementwise optimizer (ELEMENTWISE, or elementwise=True) runs on this rank's shards,
their ZeRO-1/2 chunks or their float32 master weights (runtime/state/sharded_optimizer
.ShardedOptimizer) and computes exactly what it computes on the whole model; any other
(Adafactor, ...) runs on whole parameters, each on one owner rank
(runtime/state/whole_params.WholeParamOptimizer), unless every parameter is whole here anyway.
Both wrap an optimizer of the user's class built here; the user's own objects are never
changed.  Both are torch.optim.Optimizers, so LR schedulers take them.
"""
from __future__ import annotations

import inspect
import logging

import torch
from torch.distributed.tensor import Shard

from autopar.cost.prices import STEP_CHUNK_BYTES
from autopar.runtime.process import CompileError
from autopar.runtime.state.sharded_optimizer import (
    CheckpointError, ShardedOptimizer, WrappedOptimizer, load_optimizer_state_dict, optimizer_state_dict)
from autopar.runtime.state.whole_params import ELEMENTWISE, WholeParamOptimizer

log = logging.getLogger("autopar")


def fused_options(cls, kwargs: dict) -> dict:
    """`kwargs` with fused=True added where `cls` has a fused update (torch's Adam, AdamW,
    SGD, Adagrad: one kernel per device and dtype reads each parameter, its gradient and its
    states once) and the caller chose neither `fused` nor `foreach`; else `kwargs` as given."""
    if "fused" in kwargs or "foreach" in kwargs or "fused" not in inspect.signature(cls.__init__).parameters:
        return kwargs
    return {**kwargs, "fused": True}


def build_optimizer(state, cls, elementwise: bool | None, *, pipelined: bool, bucket_bytes: int,
                    fuse: bool = False, **kwargs) -> WrappedOptimizer:
    """`cls(**kwargs)` over what this rank owns of the parameters of `state`
    (runtime/state/rank_state.RankState), as the module docstring says.  pipelined: the model runs
    pipeline stages (no whole-parameter optimizer over split weights there yet);
    bucket_bytes: the size of the all-gathers of ZeRO-1/2 chunks after a step; fuse: the
    update runs as the class's fused kernel where it has one (fused_options; the backend
    "inductor" compiles the step, and the plan prices it so)."""
    if fuse:
        asked, kwargs = kwargs, fused_options(cls, kwargs)
        if kwargs is not asked:
            log.info("%s steps with its fused kernel (backend inductor); pass fused=False for torch's default",
                     cls.__name__)
    if elementwise is None:
        elementwise = cls in ELEMENTWISE
    pieces = bool(state.zero_layouts) or any(
        isinstance(p, Shard) for k, q in state.shards.items() if q.requires_grad
        for p in state.plan.param_placements[state.name_of[k]])
    if not elementwise and pieces:
        if state.masters or pipelined:
            raise CompileError(f"{cls.__name__} reads whole parameters (it is not in autopar's list of "
                               f"elementwise optimizers), and this plan splits them; running it on whole "
                               f"parameters is not supported with mixed precision, offload or pipeline "
                               f"stages yet. Use an elementwise optimizer (e.g. AdamW), a plan that keeps "
                               f"weights whole, or pass elementwise=True if {cls.__name__} is elementwise")
        optimizer = WholeParamOptimizer(state, cls, **kwargs)
        log.info("%s runs on whole parameters (%s)", cls.__name__, optimizer)
        return optimizer
    # an elementwise torch optimizer keeps its state per tensor: it may step in runs (the
    # optimizer step's temporaries then take one run's size, cost.prices.STEP_CHUNK_BYTES)
    chunk = STEP_CHUNK_BYTES if cls in ELEMENTWISE else None
    return ShardedOptimizer(state, cls, bucket_bytes, chunk, **kwargs)


def entries_of(state, optimizer) -> tuple:
    """(entries, the torch optimizer holding their state) of an optimizer from
    build_optimizer, or of one the user built over the compiled model's shards:
    entries as ShardedOptimizer.entries."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.entries, optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, WrappedOptimizer):
        raise CheckpointError(f"optimizer_state_dict takes an optimizer from cm.build_optimizer with an elementwise "
                              f"optimizer (got {type(optimizer).__name__}); save whole-parameter optimizers' "
                              f"state_dict() per rank")
    by_id = {id(p): k for k, p in state.shards.items()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError("the optimizer holds a tensor that is not one of the compiled model's "
                                      "parameters; build it with cm.build_optimizer")
            out.append((by_id[id(p)], p, None, p))
    return out, optimizer


def state_dict_of(state, optimizer) -> dict:
    """`optimizer`'s state under parameter names, DTensors for per-element state
    (runtime/state/sharded_optimizer.py), whichever optimizer over the shards it is."""
    if isinstance(optimizer, ShardedOptimizer):   # (it knows which of its states are on disk)
        return optimizer.state_dict()
    entries, inner = entries_of(state, optimizer)
    return optimizer_state_dict(state, entries, inner)


def load_state_dict_into(state, optimizer, saved: dict) -> None:
    """Write `saved` (state_dict_of this or another plan) into `optimizer`'s state."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.load_state_dict(saved)
        return
    entries, inner = entries_of(state, optimizer)
    load_optimizer_state_dict(state, entries, inner, saved)
