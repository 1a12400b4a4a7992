"""Multi-dimensional tensor parallelism against 1D Megatron: the planner's predictions for
GPT-3's layers on H100 clusters, and a measured step on 4 CPU ranks.

Planner (one process, meta tensors): GPT-3 175B's layer (hidden 12288, 96 heads, sequence
2048, bf16 with fp32 masters), `--layers` of them, batch `--batch` sequences.  Per cluster,
side by side, each the cheapest plan within its rules (autopar/solve/layouts.py):

    megatron-tp x dp     1D Megatron on the innermost axis, data parallel on the others
    megatron-tp x zero1  the same with the optimizer states sharded over the other axes
    megatron-tp x zero3  the same with the parameters sharded over the other axes (ZeRO-3)
    tp-2d / tp-3d        every layer's linear layers on the grid (SUMMA 2D or 2.5D; the 3D matmul)
    tp-2d-ws             2D weight-stationary: each weight split by columns on one axis and rows
                         on the other, never moved; data parallel on the further axes
    autopar              the ILP free to choose (the grid forms are in its menus)

Rows give the predicted step, its communication, the peak memory per device, whether it
fits the 80 GB H100, the grid forms the plan uses, and the step over the baseline's: the
fastest 1D Megatron row that fits.

Measured (under torchrun, 4 gloo ranks): a GPT (hidden 256, 4 layers, batch 8, sequence
128), 1D Megatron on (4,) against SUMMA on (2, 2): median step over `--steps`.

Run:
    python benchmarks/grid_tp.py                       # the planner's tables (a few minutes)
    python benchmarks/grid_tp.py --sweep               # the ILP's form across meshes and batches
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/grid_tp.py --measure
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from autopar.models import build  # noqa: E402
from autopar.ops.grid_rule import GRID_FORMS  # noqa: E402
from autopar.ops.strategy import crossed_axes  # noqa: E402

GiB = 2 ** 30
MEGATRON = ("megatron-tp x dp", "megatron-tp x zero1", "megatron-tp x zero3")

# (title, mesh shape, axis names, devices per node, layouts)
CLUSTERS = [
    ("64 H100 (8 nodes x 8, NVLink inside a node)", (8, 8), ("node", "gpu"), 8,
     MEGATRON + ("tp-2d", "tp-2d-ws")),
    ("64 H100, one per node (every link the network)", (8, 8), ("x", "y"), 1, MEGATRON + ("tp-2d", "tp-2d-ws")),
    ("512 H100 (64 nodes x 8)", (8, 8, 8), ("dp", "node", "gpu"), 8, MEGATRON + ("tp-2d", "tp-3d", "tp-2d-ws")),
]


def grid_forms(plan) -> str:
    """The multi-dimensional forms of the plan's linear layers: grid forms by name, and "2d-ws"
    for the weight-stationary 2D split (columns on one axis, rows on another)."""
    forms = Counter(n.strategy.split(" [", 1)[0] if n.strategy.split(" ", 1)[0] in GRID_FORMS else "2d-ws"
                    for n in plan.nodes if n.op == "aten.linear"
                    and (n.strategy.split(" ", 1)[0] in GRID_FORMS or crossed_axes(n.split)))
    return ", ".join(f"{k} x{v}" for k, v in sorted(forms.items())) or "-"


SWEEP_MESHES = [((8, 8), 8), ((8, 8), 1), ((16, 16), 8), ((8, 8, 8), 8), ((8, 8, 8), 1), ((16, 16, 16), 8)]
SWEEP_WORK = [(1, 8192), (16, 2048), (256, 2048)]   # (batch, sequence)


def sweep() -> None:
    """Which form the ILP gives GPT-3's layers (two of them, hidden 12288) across meshes and
    batches: 1D (Megatron's split on one axis), 2D weight-stationary, or a grid form; its step
    against the cheapest grid layout's."""
    print("GPT-3 layers (hidden 12288, 96 heads), 2 layers, bf16; the ILP's plan against the grid layouts")
    print(f"  {'mesh':14s} {'per node':>8s} {'batch x seq':>12s} {'ILP ms':>8s} {'grid ms':>8s}  {'grid layout':11s} "
          f"ILP's linear layers")
    for shape, per_node in SWEEP_MESHES:
        mesh = autopar.Mesh(shape, tuple("abcd"[:len(shape)]), device="h100", devices_per_node=per_node)
        for batch, seq in SWEEP_WORK:
            model, args = build("gpt2-124m", device="meta", hidden=12288, n_heads=96, n_layers=2, max_seq=seq,
                                batch=batch, seq=seq)
            plan = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False), mixed_precision="bf16")
            grids = []
            for layout in ("tp-2d", "tp-3d"):
                try:
                    grids.append((autopar.plan(model, mesh, args, mixed_precision="bf16",
                                               solve=autopar.SolveOptions(compare=False, layout=layout))
                                  .predicted.step_s, layout))
                except ValueError:   # (a grid this mesh or batch cannot have)
                    continue
            linears = [n for n in plan.nodes if n.op == "aten.linear" and n.module.startswith("blocks.")]
            ws = sum(1 for n in linears if crossed_axes(n.split))
            grid = sum(1 for n in linears if n.strategy.split(" ", 1)[0] in GRID_FORMS)
            what = f"{ws} of {len(linears)} 2D weight-stationary, {grid} grid"
            g_ms, g_name = min(grids) if grids else (float("nan"), "-")
            print(f"  {str(shape):14s} {per_node:8d} {f'{batch} x {seq}':>12s} {plan.predicted.step_s * 1e3:8.1f} "
                  f"{g_ms * 1e3:8.1f}  {g_name:11s} {what}", flush=True)


def planner(layers: int, batch: int) -> None:
    model, args = build("gpt2-124m", device="meta", hidden=12288, n_heads=96, n_layers=layers, max_seq=2048,
                        batch=batch, seq=2048)
    print(f"GPT-3 layers (hidden 12288, 96 heads), {layers} layers, batch {batch} x 2048 tokens, bf16; "
          f"baseline: the fastest of {', '.join(MEGATRON)} that fits")
    for title, shape, names, per_node, layouts in CLUSTERS:
        mesh = autopar.Mesh(shape, names, device="h100", devices_per_node=per_node)
        print(f"\n{title}: mesh {shape} {names}")
        print(f"  {'layout':22s} {'step ms':>9s} {'comm ms':>9s} {'GiB':>6s} fits  {'x base':>6s}  {'plan s':>6s}  grid")
        rows = []
        for layout in layouts + ("autopar",):
            start = time.perf_counter()
            try:
                plan = autopar.plan(model, mesh, args,
                                    solve=autopar.SolveOptions(compare=False,
                                                               layout=None if layout == "autopar" else layout),
                                    mixed_precision="bf16")
            except Exception as exc:   # (a layout that cannot be had on this mesh: say why)
                rows.append((layout, None, str(exc)[:120], 0.0))
                continue
            rows.append((layout, plan, "", time.perf_counter() - start))
        fitting = [plan.predicted.step_s for layout, plan, _, _ in rows
                   if layout in MEGATRON and plan is not None and plan.predicted.memory_total <= 80e9]
        base = min(fitting) if fitting else None
        for layout, plan, why, seconds in rows:
            if plan is None:
                print(f"  {layout:22s} not possible: {why}")
                continue
            p = plan.predicted
            step, mem = p.step_s, p.memory_total / GiB
            ratio = f"{step / base:6.2f}" if base else "     -"
            print(f"  {layout:22s} {step * 1e3:9.1f} {sum(p.comm_s.values()) * 1e3:9.1f} {mem:6.1f} "
                  f"{'yes' if p.memory_total <= 80e9 else 'no ':4s} {ratio}  {seconds:6.1f}  {grid_forms(plan)}")


def measure(steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run under torchrun --nproc_per_node 4")
    rows = []
    for shape, layout in (((4,), "megatron-tp"), ((2, 2), "tp-2d"), ((2, 2), "tp-2d-ws")):
        torch.manual_seed(0)
        model, args = build("gpt-tiny", hidden=256, n_heads=8, n_layers=4, batch=8, seq=128, max_seq=128)
        mesh = autopar.Mesh(shape, tuple("ab"[:len(shape)]), device="cpu")
        plan = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout=layout))
        cm = autopar.compile(model, plan.device_mesh(), args, plan=plan)
        opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)
        times = []
        for _ in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            cm.train_step(*args)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        rows.append((layout, shape, statistics.median(times[1:]), plan.predicted.step_s, grid_forms(plan)))
    if rank == 0:
        base = rows[0][2]
        print("GPT hidden 256, 4 layers, batch 8 x 128, 4 gloo ranks; baseline 1D Megatron on (4,)")
        print(f"  {'layout':14s} {'mesh':8s} {'measured ms':>11s} {'x base':>6s} {'predicted ms':>12s}  grid")
        for layout, shape, t, pred, forms in rows:
            print(f"  {layout:14s} {str(shape):8s} {t * 1e3:11.1f} {t / base:6.2f} {pred * 1e3:12.1f}  {forms}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", action="store_true", help="time 1D Megatron against SUMMA on 4 gloo ranks")
    ap.add_argument("--sweep", action="store_true", help="which form the ILP picks across meshes and batches")
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if args.measure:
        measure(args.steps)
    elif args.sweep:
        sweep()
    else:
        planner(args.layers, args.batch)


if __name__ == "__main__":
    main()
