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

import functools
import json
import os
import random
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from autopar.trace.fused import Part, Parts
from autopar.passes.shard_params import shard_of

from autopar.runtime.plain_state import sharded_state
from autopar.runtime.zero import ShardedOptimizer, WrappedOptimizer, all_gather_chunks


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
            src = local.to(mine[k].device, mine[k].dtype).view_as(mine[k])
            if src.untyped_storage().data_ptr() == mine[k].untyped_storage().data_ptr():
                # (DCP loaded into the state's own storage through the DTensors optimizer_state_dict
                # gave: where the views differ, a copy in place would read what it overwrites)
                src = src.clone()
            mine[k].copy_(src)
    for g, s in zip(inner.param_groups, saved["param_groups"]):
        g.update({k: v for k, v in s.items() if k != "params"})


# --- autopar.checkpoint.save / load ---------------------------------------------------------------
META = "autopar.json"   # rank 0's record beside torch.distributed.checkpoint's files
FORMAT = 2   # 2: the model under the plain model's names (1: fused weights as parts, tied weights once)


def give_sharded_state(cm, opt) -> None:
    """`opt.state_dict()` and `opt.load_state_dict(sd)` in torch.distributed.checkpoint's
    layout (optimizer_state_dict above), so the usual DCP pattern works with the optimizer
    itself: the state of one plan or mesh loads into another."""
    opt.state_dict = functools.partial(optimizer_state_dict, cm, opt)
    opt.load_state_dict = functools.partial(load_optimizer_state_dict, cm, opt)


def _flat_shapes(state: dict, prefix: str = "") -> dict:
    """Key (as DCP names it: nested keys joined by '.') -> global shape of every tensor."""
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_shapes(v, key + "."))
        elif isinstance(v, torch.Tensor):
            out[key] = tuple(v.shape)
    return out


def _check_fits(path: str, saved: dict, state: dict, names: list, known: set) -> None:
    """The checkpoint at `path` (its `saved` metadata) has every tensor of `state` at its
    shape, and no parameter it holds is unknown to the model (`names`: every model-level
    name, on whichever rank, in the model's order; `known`: every name the model takes);
    else a CheckpointError naming the first mismatch (model entries in the model's order,
    then the optimizer's)."""
    rank = {f"model.{n}": k for k, n in enumerate(names)}
    wanted = sorted(_flat_shapes(state).items(), key=lambda kv: (kv[0] not in rank, rank.get(kv[0], 0)))
    for key, shape in wanted:
        if key not in saved:
            where = key.split(".", 1)
            raise CheckpointError(f"checkpoint {path} has no {key!r}: it was saved from another model (or "
                                  f"without {where[0]!r}); the first missing entry is {key!r}")
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != shape:
            raise CheckpointError(f"checkpoint {path}: {key!r} is {tuple(size)} there but {shape} in this model; "
                                  f"it was saved from a model of another size")
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in known)
    if extra:
        raise CheckpointError(f"checkpoint {path} holds {extra[0]!r}, which this model does not have "
                              f"({len(extra)} such entries); it was saved from another model")


def _model_state(cm, saved: dict) -> dict:
    """cm's sharded state under the names the checkpoint (`saved`: its metadata) uses: the
    plain model's; in a checkpoint written before autopar saved those (format 1), fused
    weights as their parts and tied weights once."""
    parts = any(f"model.{n}" in saved for n in cm.parts.parts)
    state = sharded_state(cm, fused_whole=not parts)
    return {n: v for n, v in state.items() if n not in cm.aliases or f"model.{n}" in saved}


def _rng_state(device_type: str) -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device_type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(saved: dict, device_type: str) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if device_type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"])


def save(path, cm, optimizer=None, *, step: int | None = None, extra: dict | None = None) -> str:
    """Save the compiled model's (and `optimizer`'s) sharded state to directory `path` with
    torch.distributed.checkpoint, beside the plan, the step, `extra` (anything JSON can
    hold: the data loader's position, a config) and every rank's RNG states.  Every rank
    calls it; no rank holds a whole tensor it does not own.  The directory appears whole or
    not at all: it is written under a temporary name and renamed once every rank is done,
    so a job killed while saving keeps its previous checkpoint.  Returns `path`."""
    path = os.fspath(path)
    rank = dist.get_rank()
    partial = f"{path}.partial"
    if rank == 0 and os.path.isdir(partial):
        shutil.rmtree(partial)
    dist.barrier()
    state = {"model": cm.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(cm, optimizer)
    dcp.save(state, checkpoint_id=partial)
    os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
    torch.save(_rng_state(cm.device_type), os.path.join(partial, "rng", f"rank{rank}.pt"))
    if rank == 0:
        record = {"format": FORMAT, "step": step, "extra": extra, "world_size": dist.get_world_size(),
                  "optimizer": optimizer is not None, "plan": cm.plan.to_dict()}
        with open(os.path.join(partial, META), "w") as f:
            json.dump(record, f)
    dist.barrier()
    if rank == 0:
        if os.path.isdir(path):
            old = f"{path}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(partial, path)
            shutil.rmtree(old)
        else:
            os.rename(partial, path)
    dist.barrier()
    return path


def load(path, cm, optimizer=None) -> dict:
    """Load a checkpoint written by `save` (under any plan, mesh or world size) into `cm`
    and `optimizer`, and restore this rank's RNG states when the checkpoint has them (same
    world size).  Returns {"step", "extra", "plan"} as saved (the plan as a dict).  A
    checkpoint of another model raises CheckpointError naming the first entry that does not
    fit; one saved without the optimizer, when `optimizer` is given, too."""
    path = os.fspath(path)
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a checkpoint written by autopar.checkpoint.save (no {META}); "
                              f"a bare torch.distributed.checkpoint directory loads with dcp.load + "
                              f"cm.load_state_dict")
    with open(meta_path) as f:
        record = json.load(f)
    if optimizer is not None and not record.get("optimizer"):
        raise CheckpointError(f"checkpoint {path} was saved without an optimizer; load it with optimizer=None "
                              f"and start the optimizer afresh")
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": _model_state(cm, saved)}
    if optimizer is not None:
        state["optim"] = optimizer_state_dict(cm, optimizer)
    names = cm.state_dict_names()
    _check_fits(path, saved, state, names, set(names) | set(cm.plan.param_placements))
    dcp.load(state, checkpoint_id=path)
    cm.load_state_dict(state["model"])
    if optimizer is not None:
        load_optimizer_state_dict(cm, optimizer, state["optim"])
    rng = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if record.get("world_size") == dist.get_world_size() and os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False), cm.device_type)
    return {"step": record.get("step"), "extra": record.get("extra"), "plan": record.get("plan")}


def latest(directory) -> str | None:
    """The complete checkpoint with the highest step (then the newest) among the
    subdirectories of `directory` that `save` wrote, or None: where a restarted job resumes."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    done = [os.path.join(directory, d) for d in os.listdir(directory)
            if os.path.isfile(os.path.join(directory, d, META))]

    def order(d):
        with open(os.path.join(d, META)) as f:
            step = json.load(f).get("step")
        return (step if isinstance(step, int) else -1, os.path.getmtime(os.path.join(d, META)))
    return max(done, key=order, default=None)


# --- the plain model's state dict in one file -------------------------------------------------------
_PART = re.compile(r"^(?P<whole>.+)\[(?P<dims>(?::, )*)(?P<start>\d+):(?P<stop>\d+)\]$")


def _join_parts(state: dict) -> dict:
    """Fused weights saved as their parts (`w[:, 0:64]`, checkpoints of format 1) joined
    back into the plain model's `w` (a weight whose parts do not cover it stays as parts)."""
    parts = {}
    for name in state:
        m = _PART.match(name)
        if m is not None:
            parts[name] = Part(m["whole"], m["dims"].count(":, "), int(m["start"]), int(m["stop"]))
    if not parts:
        return state
    found = Parts(parts)
    whole = {w: ps for w, ps in found.of_whole.items()
             if ps[0].start == 0 and all(a.stop == b.start for a, b in zip(ps, ps[1:]))}
    found = Parts({p.name: p for ps in whole.values() for p in ps})
    return found.join(state)


def to_state_dict(path, key: str | None = "model") -> dict:
    """The plain model's state_dict(), whole tensors on the CPU, from the checkpoint at `path`
    (written by `save`, or by `dcp.save({"model": cm.state_dict(), ...})`): what
    `model.load_state_dict(...)` takes, for inference or another trainer.  key: the entry the
    model's state was saved under (None: the checkpoint's top level, `dcp.save(cm.state_dict())`).
    Reads in this process alone (no process group, every tensor whole: call it on one rank).
    torch's `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` writes the whole
    checkpoint (model and optimizer, nested) instead; this keeps only the model.  Fused weights
    of a format-1 checkpoint (saved as their parts) are joined; its tied weights appear
    once, under the first name (load with strict=False, or re-tie)."""
    path = os.fspath(path)
    reader = FileSystemReader(path)
    metadata = reader.read_metadata()
    planner_data = metadata.planner_data or {}
    prefix = "" if key is None else f"{key}."
    state = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        where = tuple(planner_data.get(fqn, ()))
        if where:
            if (key is None and len(where) != 1) or (key is not None and (len(where) != 2 or where[0] != key)):
                continue
            name = where[-1]
        elif fqn.startswith(prefix):
            name = fqn[len(prefix):]
        else:
            continue
        state[name] = torch.empty(md.size, dtype=md.properties.dtype)
    if not state:
        hint = "" if key is None else "; pass key=None for a checkpoint of dcp.save(cm.state_dict())"
        raise CheckpointError(f"checkpoint {path} holds no tensors under {key!r}{hint}")
    dcp.load(state if key is None else {key: state}, storage_reader=reader, no_dist=True)
    return _join_parts(state)


def export(path, out_file, key: str | None = "model") -> str:
    """Write the plain model's state_dict() from the checkpoint at `path` (see to_state_dict)
    to `out_file`: a safetensors file when its name ends in `.safetensors` (needs the
    `safetensors` package), else with torch.save.  Returns `out_file`."""
    out_file = os.fspath(out_file)
    state = to_state_dict(path, key)
    if out_file.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise CheckpointError(f"writing {out_file} needs the safetensors package: pip install safetensors, "
                                  f"or name the file *.pt for torch.save") from exc
        save_file({n: t.contiguous() for n, t in state.items()}, out_file)
    else:
        torch.save(state, out_file)
    return out_file
