"""Sharded checkpoints of a compiled model and its optimizer, with the plan, the step and
the RNG states (autopar.checkpoint's save, load, latest), and the plain model's state dict
from a checkpoint in one process (to_state_dict, export).

The model is saved under the plain model's names (runtime/state/plain_state.py), the optimizer
under parameter names with DTensors (runtime/state/sharded_optimizer.py), both through
torch.distributed.checkpoint, so a checkpoint of one plan, mesh or world size loads into
another.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.trace.fused import Part, Parts

from autopar.runtime.state.plain_state import sharded_state
from autopar.runtime.state.sharded_optimizer import CheckpointError

__all__ = ["CheckpointError", "save", "load", "latest", "to_state_dict", "export"]

# --- autopar.checkpoint.save / load ---------------------------------------------------------------
META = "autopar.json"   # rank 0's record beside torch.distributed.checkpoint's files
FORMAT = 2   # 2: the model under the plain model's names (1: fused weights as parts, tied weights once)


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
    state = sharded_state(cm.rank_state, fused_whole=not parts)
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


def _record_text(record: dict, path: str) -> str:
    """The record as JSON, or a CheckpointError naming what JSON cannot hold."""
    try:
        return json.dumps(record)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"not saving {path}: extra={record.get('extra')!r} is not something JSON can hold "
                              f"({exc}); pass numbers, strings, lists and dicts (a tensor as .item() or "
                              f".tolist())") from None


def _agreed(error: str | None, what: str, value=None) -> list:
    """Every rank's `error` (None: fine) and `value` gathered in one call; where any rank
    has an error, every rank raises the same CheckpointError naming the ranks, so none
    waits for a peer that left.  Returns every rank's `value`, in rank order."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (error, value))
    bad = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
    if bad:
        ranks = ", ".join(str(r) for r, _ in bad)
        raise CheckpointError(f"{what} failed on rank{'s' if len(bad) > 1 else ''} {ranks}: {bad[0][1]}")
    return [v for _, v in every]


def _checksums(directory: str, rank: int, world: int) -> dict:
    """CRC-32 of each shard file this rank checks (every world-th in name order)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))
    out = {}
    for name in names[rank::world]:
        crc = 0
        with open(os.path.join(directory, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                crc = zlib.crc32(block, crc)
        out[name] = crc
    return out


def save(path, cm, optimizer=None, *, step: int | None = None, extra: dict | None = None) -> str:
    """Save the compiled model's (and `optimizer`'s) sharded state to directory `path` with
    torch.distributed.checkpoint, beside the plan, the step, `extra` (anything JSON can
    hold: the data loader's position, a config), every rank's RNG states and a CRC-32 of
    every shard file (checked by load).  Every rank calls it; no rank holds a whole tensor
    it does not own.  The directory appears whole or not at all: it is written under a
    temporary name (`path`.partial, which `latest` never reads) and renamed once every rank
    is done, so a job killed while saving, or a save that fails on any rank (every rank
    then raises the same CheckpointError), keeps its previous checkpoint the latest.
    `extra` is checked before any shard is written.  Returns `path`."""
    path = os.fspath(path)
    rank = dist.get_rank()
    record = {"format": FORMAT, "step": step, "extra": extra, "world_size": dist.get_world_size(),
              "optimizer": optimizer is not None}
    try:
        _record_text(record, path)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    _agreed(error if rank == 0 else None, "checking extra=")
    pending = getattr(getattr(cm.runner, "schedule", None), "any_pending", None)
    if pending is not None and pending():   # (asked of every rank: the last stage has nothing pending)
        raise CheckpointError(f"not saving {path}: the asynchronous pipeline (pipedream-2bw) still has the last "
                              f"step's backwards to run and its gradient to apply; call cm.drain() and the "
                              f"optimizer step first, then save")
    partial = f"{path}.partial"
    if rank == 0 and os.path.isdir(partial):
        shutil.rmtree(partial)
    dist.barrier()
    state = {"model": cm.state_dict()}
    if optimizer is not None:
        state["optim"] = cm.optimizer_state_dict(optimizer)
    dcp.save(state, checkpoint_id=partial)
    sums, error = {}, None
    try:
        os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
        torch.save(_rng_state(cm.device_type), os.path.join(partial, "rng", f"rank{rank}.pt"))
        sums = _checksums(partial, rank, dist.get_world_size())
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    every = _agreed(error, f"saving {path}", sums)
    if rank == 0:
        try:
            record.update(plan=cm.plan.to_dict(), checksums={k: v for got in every for k, v in got.items()})
            with open(os.path.join(partial, META + ".tmp"), "w") as f:
                f.write(_record_text(record, path))
            os.replace(os.path.join(partial, META + ".tmp"), os.path.join(partial, META))
        except OSError as exc:
            error = f"writing its record {os.path.join(partial, META)}: {type(exc).__name__}: {exc}"
    _agreed(error, f"saving {path}")
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
    if path is None:
        raise CheckpointError("nothing to load: the path is None (autopar.checkpoint.latest found no complete "
                              "checkpoint, as on a first run); resume only where there is one: "
                              "`last = latest(dir); start = load(last, cm, opt)['step'] + 1 if last else 0`")
    path = os.fspath(path)
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        hint = (f"; it is a save that never finished (latest() skips those): load {path[:-len('.partial')]} or "
                f"another complete one" if path.endswith(".partial") else
                "; a bare torch.distributed.checkpoint directory loads with dcp.load + cm.load_state_dict")
        raise CheckpointError(f"{path} is not a checkpoint written by autopar.checkpoint.save (no {META}){hint}")
    record = _read_record(meta_path)
    _verify(path, record)
    if optimizer is not None and not record.get("optimizer"):
        raise CheckpointError(f"checkpoint {path} was saved without an optimizer; load it with optimizer=None "
                              f"and start the optimizer afresh")
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {"model": _model_state(cm, saved)}
    if optimizer is not None:
        state["optim"] = cm.optimizer_state_dict(optimizer)
    names = cm.state_dict_names()
    _check_fits(path, saved, state, names, set(names) | set(cm.plan.param_placements))
    dcp.load(state, checkpoint_id=path)
    cm.load_state_dict(state["model"])
    if optimizer is not None:
        cm.load_optimizer_state_dict(optimizer, state["optim"])
    rng = os.path.join(path, "rng", f"rank{dist.get_rank()}.pt")
    if record.get("world_size") == dist.get_world_size() and os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=False), cm.device_type)
    return {"step": record.get("step"), "extra": record.get("extra"), "plan": record.get("plan")}


def _read_record(meta_path: str) -> dict:
    """A checkpoint's record, or a CheckpointError naming the damaged file and the fix."""
    try:
        with open(meta_path) as f:
            record = json.load(f)
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
        return record
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint record {meta_path} is damaged ({type(exc).__name__}: {exc}); load "
                              f"another checkpoint (autopar.checkpoint.latest skips damaged ones)") from None


def _verify(path: str, record: dict) -> None:
    """Each shard file's CRC-32 against the record's (checkpoints saved before autopar kept
    them have none); every rank checks its share of the files and all agree."""
    sums = record.get("checksums")
    if not sums:
        return
    error = None
    try:
        ranks = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        got = _checksums(path, *ranks)
        missing = sorted(set(sums) - set(n for n in os.listdir(path) if n.endswith(".distcp")))
        bad = [n for n, crc in got.items() if sums.get(n) != crc] + missing
        if bad:
            error = (f"checkpoint {path}: shard {bad[0]} is {'missing' if bad[0] in missing else 'damaged'} "
                     f"(its CRC-32 differs from the one saved); load an earlier checkpoint")
    except OSError as exc:
        error = f"checkpoint {path}: {type(exc).__name__}: {exc}"
    if dist.is_initialized():
        _agreed(error, f"checking {path}")
    elif error:
        raise CheckpointError(error)


def latest(directory) -> str | None:
    """The complete checkpoint with the highest step (then the newest) among the
    subdirectories of `directory` that `save` wrote, or None (a first run): where a
    restarted job resumes.  Saves that never finished (`*.partial`, `*.old`) are never
    read; a damaged record is skipped with a warning naming it."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = []
    for d in sorted(os.listdir(directory)):
        meta = os.path.join(directory, d, META)
        if d.endswith((".partial", ".old")) or not os.path.isfile(meta):
            continue
        try:
            step = _read_record(meta).get("step")
        except CheckpointError as exc:
            warnings.warn(f"autopar: {exc}", stacklevel=2)
            continue
        found.append(((step if isinstance(step, int) else -1, os.path.getmtime(meta)), os.path.join(directory, d)))
    return max(found)[1] if found else None


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
