"""Parameter sharding: every rank holds only its shards of the parameters.

From a full CPU model the shards are sliced.  From a model on the meta device each
submodule is materialised alone, in `named_modules()` order, initialised, sliced and
dropped, so the whole model never exists on one rank and the values equal what
initialising the whole model would give (same seed): the RNG is consumed in the same
order.  A model tells how to initialise one module through `init_module(name, module)`
(autopar's reference models have it); otherwise each module's `reset_parameters()` runs.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate

from autopar.trace.fused import Parts

from autopar.passes.redistribute import redistribute_local


def shard_of(full: torch.Tensor, placements, groups) -> torch.Tensor:
    """This rank's piece of `full` laid out as `placements` (a local slice, no communication)."""
    return redistribute_local(full, tuple(Replicate() for _ in placements), tuple(placements), groups)


def shard_full_model(model: nn.Module, placements: dict, groups, values: dict | None = None,
                     parts: Parts | None = None) -> dict[str, torch.Tensor]:
    """name -> local shard, for every parameter (or part of a fused one) named in
    `placements`; `values` overrides the model's value of some parameters."""
    parts = parts or Parts()
    params = parts.split({**dict(model.named_parameters()), **(values or {})})
    return {name: shard_of(params[name].detach(), pl, groups).clone() for name, pl in placements.items()}


def init_sharded(model: nn.Module, placements: dict, groups, seed: int | None = None,
                 parts: Parts | None = None) -> dict[str, torch.Tensor]:
    """Initialise a meta-device model shard by shard; returns name -> local shard for every
    parameter (or part of a fused one) in `placements` and materialises the (replicated)
    buffers in place on CPU."""
    parts = parts or Parts()
    if seed is not None:
        torch.manual_seed(seed)
    owner = {}  # id(parameter) -> first name (tied weights are one parameter)
    for name, p in model.named_parameters():
        owner.setdefault(id(p), name)
    shards: dict[str, torch.Tensor] = {}
    init_module = getattr(model, "init_module", None)
    for mod_name, module in model.named_modules():
        own = {k: p for k, p in module.named_parameters(recurse=False)}
        bufs = dict(module.named_buffers(recurse=False))
        if not own and not bufs:
            if init_module is not None:
                init_module(mod_name, module)
            continue
        names = {k: owner.get(id(p)) for k, p in own.items()}
        module.to_empty(device="cpu", recurse=False)
        if init_module is not None:
            init_module(mod_name, module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        for k, p in module.named_parameters(recurse=False):
            full_name = names.get(k)
            expected = f"{mod_name}.{k}" if mod_name else k
            if full_name != expected:
                continue
            for name, value in parts.split({full_name: p.detach()}).items():
                if name in placements:
                    shards[name] = shard_of(value, placements[name], groups).clone()
        # drop the full parameters again; buffers stay (they are replicated and small)
        for k, p in list(module.named_parameters(recurse=False)):
            setattr(module, k, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    missing = set(placements) - set(shards)
    if missing:
        raise ValueError(f"could not initialise parameters {sorted(missing)[:5]} shard by shard")
    return shards
