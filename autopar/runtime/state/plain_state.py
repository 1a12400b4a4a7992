"""The compiled model's state under the plain model's names, and back.

The compiled model holds its parameters under *planned* names: a fused projection as its
parts (`h.0.attn.c_attn.weight[:, 0:64]`, autopar/trace/fused.py) and a tied weight once, under
the name its first reader gave it.  The user, the plain model, torch.distributed.checkpoint
and every tool after them (inference servers, other trainers, safetensors files) know the
plain model's `state_dict()` names: a fused weight whole, a tied weight under each of its
names, the persistent buffers.  `sharded_state` gives a rank's state (runtime/state/rank_state.RankState)
under those names as DTensors, `full_state` and `full_grads` as whole tensors on every rank,
`load_state` takes a state dict under them (or under the planned names of an older
checkpoint), `load_full_state` whole tensors, and `state_names` lists them.

A fused weight whole, as one DTensor.  Its parts are concatenated along `dim`.  On a mesh
axis where every part has the same placement and it does not split `dim` (ZeRO-3's rows,
a replica), the whole keeps that placement and each rank's block of the whole is its
parts' local tensors side by side.  Where the parts split `dim` (Megatron's column split of
q, k and v: rank r holds q_r, k_r and v_r, which no placement of the whole describes) or
disagree (a multi-query key head kept whole beside split query heads), the whole is split
on the axis along its largest other dim instead, or replicated there when it has no other
dim (a bias).  Saving such a weight costs one all-to-all over that axis (an all-gather of
a bias); loading it, the way back.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard


def as_dtensor(local: torch.Tensor, mesh, placements: tuple, shape) -> DTensor:
    """`local` as this rank's block of a DTensor of global `shape` (no communication)."""
    shape = torch.Size(shape)
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def placements_off_dim(placements: list, dim: int, shape) -> tuple:
    """One placement per mesh axis for a tensor of `shape` whose blocks along `dim` come from
    tensors placed as `placements` (one tuple per block): the blocks' common placement on an
    axis where they agree and it does not split `dim`, else Shard of the largest other dim
    (the first of equals), or Replicate for a 1-D tensor.  The result never splits `dim`."""
    ndim = len(shape)
    others = [d for d in range(ndim) if d != dim]
    other = max(others, key=lambda d: (shape[d], -d)) if others else None
    out = []
    for on_axis in zip(*placements):
        p = on_axis[0]
        splits_dim = isinstance(p, Shard) and p.dim % ndim == dim
        if splits_dim or any(q != p for q in on_axis[1:]):
            p = Shard(other) if other is not None else Replicate()
        out.append(p)
    return tuple(out)


def _join(mesh, pieces: list) -> DTensor:
    """The DTensor of a fused weight from its parts' DTensors (in order along the parts' dim)."""
    part0, _ = pieces[0]
    dim = part0.dim
    shape = list(pieces[0][1].shape)
    shape[dim] = sum(t.shape[dim] for _, t in pieces)
    target = placements_off_dim([t.placements for _, t in pieces], dim, shape)
    local = torch.cat([(t.redistribute(mesh, target) if tuple(t.placements) != target else t).to_local()
                       for _, t in pieces], dim=dim)
    return as_dtensor(local, mesh, target, shape)


def split_whole(state, name: str, value) -> dict:
    """part name -> value of the parts of fused weight `name` from its whole value: a
    DTensor on the compiled model's mesh (made not to split the parts' dim, then cut
    locally), or a whole tensor (cut into views)."""
    pieces = state.parts.of_whole[name]
    dim = pieces[0].dim
    mesh = state.groups.mesh
    if isinstance(value, DTensor) and value.device_mesh == mesh:
        target = placements_off_dim([tuple(value.placements)], dim, value.shape)
        local = (value.redistribute(mesh, target) if tuple(value.placements) != target else value).to_local()
        out = {}
        for p in pieces:
            shape = list(value.shape)
            shape[dim] = p.stop - p.start
            out[p.name] = as_dtensor(p.of(local), mesh, target, shape)
        return out
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    return {p.name: p.of(whole) for p in pieces}


def sharded_state(state, *, fused_whole: bool = True, aliases: bool = True) -> dict:
    """This rank's state under the plain model's names: parameters as DTensors on the
    compiled model's mesh (their float32 masters where the optimizer keeps them), a fused
    weight whole (see the module docstring: collectives over the axes its parts split), a
    tied weight under each of its names (one DTensor), persistent buffers as tensors.  A
    pipelined rank gives its stages' parameters.  fused_whole=False: fused weights as their
    parts; aliases=False: tied weights once (how checkpoints were written before)."""
    mesh = state.groups.mesh
    planned = {}
    for key in state.shards:
        name = state.name_of[key]
        planned[name] = as_dtensor(state.local_value(key, master=True).detach(), mesh,
                                 tuple(state.plan.param_placements[name]), state.full_shape(key))
    out = {}
    for name, value in planned.items():
        part = state.parts.parts.get(name)
        if part is None or not fused_whole:
            out[name] = value
        elif part.whole not in out:
            out[part.whole] = _join(mesh, [(p, planned[p.name]) for p in state.parts.of_whole[part.whole]])
    if aliases:
        out.update({alias: out[owner] for alias, owner in state.aliases.items() if owner in out})
    out.update({name: state.buffers[key].detach() for name, key in state.buffer_names.items()})
    return out


def state_names(state) -> list:
    """Every key sharded_state() gives on some rank, in the model's order (tied aliases
    after the parameters, then the buffers)."""
    names = list(dict.fromkeys(state.parts.whole_of(n) for n in state.plan.param_placements))
    return names + list(state.aliases) + list(state.buffer_names)


def _check_shapes(state, given: dict) -> None:
    """RuntimeError naming every entry of `given` (a state dict) whose shape is not the
    model's (this rank's parameters, their fused wholes and tied aliases), as torch's
    load_state_dict."""
    shapes = {state.name_of[k]: tuple(state.full_shape(k)) for k in state.shards}
    for whole, pieces in state.parts.of_whole.items():
        if pieces[0].name in shapes:
            shape = list(shapes[pieces[0].name])
            shape[pieces[0].dim] = sum(p.stop - p.start for p in pieces)
            shapes[whole] = tuple(shape)
    shapes.update({alias: shapes[owner] for alias, owner in state.aliases.items() if owner in shapes})
    bad = [f"{n}: {tuple(v.shape)} in the state dict, {shapes[n]} in the model" for n, v in given.items()
           if n in shapes and tuple(v.shape) != shapes[n]]
    if bad:
        raise RuntimeError(f"size mismatch for {'; '.join(bad[:5])}"
                           f"{f' (and {len(bad) - 5} more)' if len(bad) > 5 else ''}: the state dict is of a model "
                           f"of another size; build the model with the same config")


@torch.no_grad()
def load_state(state, given: dict, strict: bool = True):
    """Load `given` (a state dict: plain names, or the planned names of parts; DTensors of
    any plan or mesh, or whole tensors) into `state`'s shards (runtime/state/rank_state.RankState),
    master weights and buffers; a tied weight under either of its names.  Returns torch's `_IncompatibleKeys` under the plain names:
    the plain model's entries that `given` lacks (of this rank's stages) and the entries
    the model does not have; strict=True raises KeyError naming them instead."""
    held = [state.name_of[k] for k in state.shards]          # planned names of this rank's parameters
    held_set = set(held)
    _check_shapes(state, given)
    known = set(state.plan.param_placements) | set(state.parts.of_whole) | set(state.aliases) | set(state.buffer_names)
    values, unexpected = {}, []
    for name, value in given.items():
        if name not in known:
            unexpected.append(name)
        elif name in state.parts.of_whole:
            if any(p.name in held_set for p in state.parts.of_whole[name]):
                values.update(split_whole(state, name, value))
        elif name in state.aliases:
            values.setdefault(state.aliases[name], value)
        else:
            values[name] = value      # the owner's own name wins over an alias
    tied = {}
    for alias, owner in state.aliases.items():
        tied.setdefault(owner, []).append(alias)
    missing = []
    for name in held:
        if name in values:
            continue
        part = state.parts.parts.get(name)
        if part is not None and not any(p.name in values for p in state.parts.of_whole[part.whole]):
            name = part.whole          # the whole fused weight is missing: say so under its name
        for n in [name] + tied.get(name, []):
            if n not in missing:
                missing.append(n)
    missing += [n for n in state.buffer_names if n not in given]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not fit the model: missing {missing[:5]}"
                       f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''}, unexpected "
                       f"{unexpected[:5]}{f' (and {len(unexpected) - 5} more)' if len(unexpected) > 5 else ''}; "
                       f"load the plain model's own state_dict() (or cm.state_dict() through "
                       f"torch.distributed.checkpoint), or pass strict=False to load what fits")
    for key in state.shards:
        value = values.get(state.name_of[key])
        if value is not None:
            state.load_param(key, value)
    for name, key in state.buffer_names.items():
        if name in given:
            value = given[name]
            value = value.full_tensor() if isinstance(value, DTensor) else value
            state.buffers[key].copy_(value.to(state.buffers[key].device))
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def load_full_state(state, given: dict) -> None:
    """Load whole tensors (full_state(), the plain model's state_dict()) into the shards,
    master weights and buffers; KeyError if a parameter is missing."""
    result = load_state(state, given, strict=False)
    missing = [n for n in result.missing_keys if n not in state.buffer_names]
    if missing:
        raise KeyError(f"state dict lacks parameters {sorted(missing)[:5]}")


def full_state(state, whole, master: bool = False) -> dict:
    """The plain model's state_dict(), whole, on every rank: every parameter (tied ones
    under each of their names) and the persistent buffers, on the CPU.  whole: the runner's
    whole(local, dtype) (runtime/runner.py: a pipelined plan broadcasts each weight from the
    device group holding it).  master=True: the float32 master weights where the optimizer
    keeps them (mixed precision, offload), gathered from their ZeRO chunks.  Copies: later
    steps do not change them (a whole parameter on the CPU is otherwise the live one)."""
    mine = {state.name_of[k]: state.whole(k, state.local_value(k, master)) for k in state.shards}
    out = state.parts.join(whole(mine, torch.float32 if master and state.masters else None))
    params = {n: _copy(t) for n, t in out.items()}
    params.update({alias: params[name] for alias, name in state.aliases.items() if name in params})
    params.update({name: _copy(state.buffers[key]) for name, key in state.buffer_names.items()})
    return params


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU, never sharing its memory (.cpu() of a CPU tensor is itself)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def full_grads(state, whole) -> dict:
    """Every trained parameter's reduced gradient whole (ZeRO-2 chunks gathered), on every
    rank, on the CPU; {} before any backward.  whole: as for full_state."""
    mine = {}
    for k in state.shards:
        grad = state.whole_grad(k)
        if grad is not None:
            mine[state.name_of[k]] = grad
    if not mine:  # no backward yet (the same on every rank)
        return {}
    return {n: g.cpu() for n, g in state.parts.join(whole(mine)).items() if n in state.trained}
