"""Checkpoint save and load: autopar against torchtitan-style DCP of an FSDP2 model.

    torchrun --nproc_per_node 4 benchmarks/checkpoint.py [--hidden 512 --n-layers 8] [--repeats 3]

Sides, on the same GPT (gpt-tiny widened; one AdamW step taken so the optimizer has state),
4 gloo ranks:

    fsdp2            torch.distributed.fsdp.fully_shard on every block and the root; the state
                     dicts of torch.distributed.checkpoint.state_dict (get_model_state_dict,
                     get_optimizer_state_dict), dcp.save / dcp.load + set_*_state_dict, as
                     torchtitan's checkpointer does
    autopar zero3    autopar.compile with layout "zero3" on (4,): autopar.checkpoint.save / load
    autopar dp       layout "data-parallel" on (4,) (every rank holds every weight: DCP writes
                     each replicated tensor once)
    autopar tp x dp  layout "megatron-tp x dp" on (2, 2)

Each side saves `--repeats` times into a fresh directory and loads back as many times
(timed on rank 0 between barriers, median reported); bytes per rank are the sizes of the
`.distcp` files each rank wrote (rank 0's also holds the metadata and, for autopar, the
plan and RNG files, counted apart).  After loading, every side's whole weights are checked
against what it saved.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from runtime_overhead import init_gloo, log0

import autopar
import autopar.checkpoint
from autopar.models import build

WORLD = 4


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _bytes_by_rank(path: str) -> tuple[list, int]:
    """Bytes of each rank's data files (DCP names them __<rank>_<n>.distcp), and the rest."""
    per = [0] * WORLD
    other = 0
    for root, _, files in os.walk(path):
        for f in files:
            size = os.path.getsize(os.path.join(root, f))
            if f.endswith(".distcp") and f.startswith("__"):
                per[int(f[2:].split("_")[0])] += size
            else:
                other += size
    return per, other


def _model(args):
    torch.manual_seed(0)
    return build("gpt-tiny", hidden=args.hidden, n_heads=args.n_heads, n_layers=args.n_layers, batch=8, seq=64)


def fsdp2_side(args, base: str) -> dict:
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model, example = _model(args)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = tuple(t.chunk(WORLD)[dist.get_rank()] for t in example)
    model(*local).backward()
    opt.step()
    opt.zero_grad()
    before = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}

    def save(path):
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)

    def load(path):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])

    out = _run(args, base, "fsdp2", save, load)
    after = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    out["exact"] = all(torch.equal(after[k], before[k]) for k in before)
    return out


def autopar_side(args, base: str, label: str, layout: str, shape: tuple, names: tuple) -> dict:
    model, example = _model(args)
    mesh = autopar.Mesh(shape, names, device="cpu")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout))
    cm = autopar.compile(model, mesh, example, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-3)
    cm.train_step(*example)
    opt.step()
    opt.zero_grad()
    before = cm.full_state_dict()
    out = _run(args, base, label, lambda path: autopar.checkpoint.save(path, cm, opt, step=1),
               lambda path: autopar.checkpoint.load(path, cm, opt))
    after = cm.full_state_dict()
    out["exact"] = all(torch.equal(after[k], before[k]) for k in before)
    return out


def _run(args, base: str, label: str, save, load) -> dict:
    path = os.path.join(base, label.replace(" ", "_"))
    saves, loads = [], []
    for _ in range(args.repeats):
        if dist.get_rank() == 0 and os.path.isdir(path):
            shutil.rmtree(path)
        saves.append(_timed(lambda: save(path)))
    for _ in range(args.repeats):
        loads.append(_timed(lambda: load(path)))
    per, other = _bytes_by_rank(path)
    return {"label": label, "save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "bytes": per, "other": other}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_gloo(WORLD, "benchmarks/checkpoint.py")
    base = tempfile.mkdtemp(prefix="autopar-ckpt-") if dist.get_rank() == 0 else ""
    box = [base]
    dist.broadcast_object_list(box, src=0)
    base = box[0]
    model, _ = _model(args)
    n_params = sum(p.numel() for p in model.parameters())
    rows = [fsdp2_side(args, base),
            autopar_side(args, base, "autopar zero3", "zero3", (WORLD,), ("dp",)),
            autopar_side(args, base, "autopar dp", "data-parallel", (WORLD,), ("dp",)),
            autopar_side(args, base, "autopar tp x dp", "megatron-tp x dp", (2, 2), ("dp", "tp"))]
    log0(f"gpt-tiny hidden={args.hidden} n_layers={args.n_layers}: {n_params / 1e6:.2f} M parameters, float32, "
         f"model + AdamW state ({n_params * 12 / 2**20:.1f} MiB in all); {WORLD} gloo ranks, median of "
         f"{args.repeats}")
    log0(f"{'side':18s} {'save s':>8s} {'load s':>8s}  {'MiB per rank (data files)':>32s}  {'other KiB':>9s}  exact")
    for r in rows:
        per = " ".join(f"{b / 2**20:7.2f}" for b in r["bytes"])
        log0(f"{r['label']:18s} {r['save_s']:8.3f} {r['load_s']:8.3f}  {per:>32s}  {r['other'] / 2**10:9.1f}  "
             f"{r['exact']}")
    ref = rows[0]
    log0("autopar / fsdp2:          save    load   bytes (largest rank)")
    for r in rows[1:]:
        log0(f"  {r['label']:22s} {r['save_s'] / ref['save_s']:6.2f}  {r['load_s'] / ref['load_s']:6.2f}   "
             f"{max(r['bytes']) / max(ref['bytes']):6.2f}")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
