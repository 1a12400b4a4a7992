"""Inductor against eager, and against torch's own compiled data parallelism: median step
of one model under one layout, four ways, on gloo ranks.

- autopar eager: `autopar.compile(..., plan=plan)` (the rank's graph op by op);
- autopar inductor: the same plan, `backend="inductor"` (autopar/runtime/regions/inductor.py);
- torch: the plain model under `torch.compile`, wrapped as torch's own data parallelism
  does it: DistributedDataParallel for the data-parallel layout, FSDP2's `fully_shard` per
  block and on the root for ZeRO-3 (none for megatron-tp, whose activation all-reduces
  Inductor compiles inside the regions as functional collectives); with torch's default
  AdamW, and again with `AdamW(fused=True)`, the kernel autopar's inductor backend steps.

The same model (seed 0), the same global batch split alike, AdamW, every step between
barriers; the variants step in turn, one step each per round (`interleaved`), so a slower
moment of the machine falls on all of them alike; median of `--steps` rounds after
`--warmup` (the first step of a compiled variant is its compile, printed beside it).
Ratios are against autopar eager, measured in the same run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/compiled.py
    ... --models gpt,llama --layouts data-parallel,zero3 --steps 8 --warmup 2
    ... --recompute full         (every block recomputed; selective: keeping the matrix products
                                  and attention, torch's baselines by a selective-checkpoint policy)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

import autopar
from autopar.models import build

MODELS = {"gpt": ("gpt-tiny", dict(hidden=256, n_heads=4, n_layers=4)),
          "llama": ("llama-tiny", dict(dim=256, n_heads=4, n_kv_heads=2, n_layers=4, max_seq=128))}


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def _timed(step, steps: int, warmup: int) -> tuple[float, float]:
    """(first step's seconds, the median of the timed steps)."""
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[warmup:])


def interleaved(steps: dict, rounds: int, warmup: int) -> dict:
    """name -> (first step's seconds, the median of the timed steps) for every step function
    of `steps`, run in turn: each round runs one step of each, every step between barriers,
    so a slower moment of the machine falls on every variant alike and the ratios stay
    fair; the first `warmup` rounds (the first one compiles) are not counted."""
    times = {name: [] for name in steps}
    for _ in range(warmup + rounds):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: (t[0], statistics.median(t[warmup:])) for name, t in times.items()}


def _model(name: str, batch: int, seq: int):
    preset, size = MODELS[name]
    torch.manual_seed(0)
    return build(preset, batch=batch, seq=seq, **size)


def autopar_variant(name, layout, backend, args):
    """One step of the autopar-compiled model under `backend`."""
    model, example = _model(name, args.batch, args.seq)
    mesh = autopar.Mesh((dist.get_world_size(),), ("dp",), device="cpu")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout),
                        recompute=args.recompute)
    cm = autopar.compile(model, mesh, example, plan=plan, run=autopar.RunOptions(backend=backend))
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)

    def step():
        cm.train_step(*example)
        opt.step()
        opt.zero_grad()
    return step


def _product_policy(ctx, func, *args, **kwargs):
    """torch's selective checkpointing, keeping what autopar's "selective" keeps: the matrix
    products (every one here reads a weight) and attention's outputs."""
    from torch.utils.checkpoint import CheckpointPolicy
    kept = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    return CheckpointPolicy.MUST_SAVE if func in kept else CheckpointPolicy.PREFER_RECOMPUTE


def _keeping_products():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(_product_policy)


def torch_variant(name, layout, args, fused: bool = False):
    """The plain model, compiled, under DDP (data-parallel) or FSDP2 (zero3); each rank its
    slice of the global batch; AdamW as torch builds it by default, or its fused kernel
    (what autopar's inductor backend steps)."""
    model, example = _model(name, args.batch, args.seq)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = tuple(t.chunk(world)[rank] for t in example)
    blocks = getattr(model, "blocks", None) or getattr(model, "layers", None) or getattr(model, "h", None)
    if args.recompute is not None:   # every block under activation checkpointing, as autopar's plan
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        extra = {"context_fn": _keeping_products} if args.recompute == "selective" else {}
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, **extra)
    if layout == "data-parallel":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
        run = torch.compile(wrapped)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))

    def step():
        run(*local).backward()
        opt.step()
        opt.zero_grad()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--layouts", default="data-parallel,zero3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--recompute", choices=["selective", "full"],
                        help="every block recomputed so (the torch baselines by checkpoint_wrapper, selective with "
                             "a policy keeping the matrix products and attention)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    say(f"{dist.get_world_size()} gloo ranks, {torch.get_num_threads()} thread each; batch {args.batch} x {args.seq}; "
        f"median of {args.steps} rounds after {args.warmup}, the variants stepping in turn"
        + (f"; recompute {args.recompute}" if args.recompute else ""))
    say(f"{'model':<6} {'layout':<14} {'autopar eager':>14} {'autopar inductor':>17} {'torch + compile':>16} "
        f"{'+ fused AdamW':>17} {'inductor / eager':>17} {'inductor / torch':>17} {'/ torch fused':>17}   "
        f"first steps (compile)")
    for name in args.models.split(","):
        for layout in args.layouts.split(","):
            variants = {"eager": autopar_variant(name, layout, "eager", args),
                        "inductor": autopar_variant(name, layout, "inductor", args)}
            ref_compile = float("nan")
            try:
                if layout not in ("data-parallel", "zero3"):   # (torch's wrappers have no such layout)
                    raise NotImplementedError(f"no torch wrapper for {layout}")
                for key, fused in (("torch", False), ("torch fused", True)):
                    variants[key] = torch_variant(name, layout, args, fused)
                    start = time.perf_counter()
                    variants[key]()   # (its compile: a baseline that fails fails here, alone)
                    if key == "torch":
                        ref_compile = time.perf_counter() - start
            except Exception as exc:   # the baseline failing leaves the rest
                say(f"  torch baseline failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                variants.pop("torch", None)
                variants.pop("torch fused", None)
            got = interleaved(variants, args.steps, args.warmup)
            (eager_first, eager), (ind_first, ind) = got["eager"], got["inductor"]
            ref = got["torch"][1] if "torch" in got else float("nan")
            ref_fused = got["torch fused"][1] if "torch fused" in got else float("nan")
            say(f"{name:<6} {layout:<14} {eager * 1e3:11.1f} ms {ind * 1e3:14.1f} ms {ref * 1e3:13.1f} ms "
                f"{ref_fused * 1e3:14.1f} ms {ind / eager:17.2f} {ind / ref:17.2f} {ind / ref_fused:17.2f}   "
                f"eager {eager_first:.1f} s, inductor {ind_first:.1f} s, torch {ref_compile:.1f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
