"""Long contexts: step time and activation memory per rank of ring attention (context
parallel), Ulysses and plain data parallelism, on 4 gloo ranks, at growing sequence lengths.

Sides, each on the same GPT (hidden 128, 4 heads, 2 layers, causal) and the same weights:

    data-parallel     autopar, layout "data-parallel": each rank trains whole sequences
                      (4 sequences per step, one per rank: the least data parallelism can do)
    context-parallel  autopar, layout "context-parallel": 1 sequence per step, split over the
                      4 ranks, ring attention with the load-balanced (zigzag) causal layout
    ulysses           autopar, layout "ulysses": 1 sequence per step, heads swapped in by all-to-all
    torch-cp          torch.distributed.tensor.experimental.context_parallel on the plain model
                      (1 sequence, sharded by torch), when it runs on CPU; the row says why not

Per side and length: the median step (forward, backward, AdamW) over `--steps` steps after
one warm-up, divided by the tokens per step (time per token: data parallelism processes 4x
the tokens of the others per step); the bytes rank 0 saves for backward
(torch.autograd.graph.saved_tensors_hooks, storages once, parameters left out) and the
plan's predicted activations.  Last, the longest sequence each autopar layout fits under an
activation cap per rank (`--cap`, default 64 MiB), from the plan's prediction (checked above
against the measurement), and the planner's longest sequence for llama3-8b (bf16, one
sequence) on 8 and 64 H100 with the ILP free to choose.

Run (about two minutes on 2 cores):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/long_context.py
    ... benchmarks/long_context.py --lengths 512,1024,2048 --steps 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autopar  # noqa: E402
from autopar.models import build  # noqa: E402

WORLD = 4
MiB = 2 ** 20


def log0(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def gpt(seq: int, batch: int, device="cpu"):
    torch.manual_seed(0)
    return build("gpt-tiny", device=device, hidden=128, n_heads=4, n_layers=2, max_seq=max(seq, 64),
                 seq=seq, batch=batch)


def saved_bytes(step, params) -> float:
    seen: dict = {}

    def pack(t):
        try:
            s = t.untyped_storage()
            key, size = s.data_ptr(), s.nbytes()
        except RuntimeError:  # a tensor subclass (DTensor) without storage of its own: count its local part
            local = getattr(t, "_local_tensor", t)
            key, size = id(local), local.numel() * local.element_size()
        if key not in params:
            seen[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return float(sum(seen.values()))


def timed(step, steps: int) -> float:
    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def autopar_side(layout: str, seq: int, steps: int) -> dict:
    batch = WORLD if layout == "data-parallel" else 1
    model, example = gpt(seq, batch)
    mesh = autopar.Mesh((WORLD,), ("sp",), device="cpu")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(layout=layout, compare=False))
    cm = autopar.compile(model, mesh, example, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)

    def step():
        loss = cm.train_step(*example)
        opt.step()
        opt.zero_grad()
        return loss

    params = {p.untyped_storage().data_ptr() for p in cm.parameters()}
    measured = saved_bytes(step, params)
    return {"s_per_token": timed(step, steps) / (batch * seq), "saved": measured,
            "predicted": plan.predicted.memory["activations"]}


def torch_cp_side(seq: int, steps: int) -> dict:
    """The plain model under torch's context_parallel: inputs and targets sharded along the
    sequence by torch (load-balanced), attention run by torch's ring."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    model, (idx, targets) = gpt(seq, 1)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        x, y = idx.clone(), targets.clone()
        with context_parallel(mesh, buffers=[x, y], buffer_seq_dims=[1, 1]):
            loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = saved_bytes(step, params)
    return {"s_per_token": timed(step, steps) / seq, "saved": measured, "predicted": None}


def longest(layout: str, cap: float, lengths) -> int | None:
    """The longest of `lengths` whose plan under `layout` predicts at most `cap` activation bytes per rank."""
    best = None
    for seq in lengths:
        model, example = gpt(seq, WORLD if layout == "data-parallel" else 1, device="meta")
        plan = autopar.plan(model, autopar.Mesh((WORLD,), ("sp",), device="cpu"), example,
                            solve=autopar.SolveOptions(layout=layout, compare=False))
        if plan.predicted.memory["activations"] > cap:
            break
        best = seq
    return best


def llama_longest(devices: int) -> tuple:
    """(longest sequence, its plan's attention strategies) the planner fits for llama3-8b in
    bf16 on `devices` H100 (one axis), doubling from 8,192 tokens; None when none fits."""
    best = (None, "")
    seq = 8192
    while seq <= 2 ** 22:
        model, example = build("llama3-8b", device="meta", batch=1, seq=seq, max_seq=seq)
        try:
            plan = autopar.plan(model, autopar.Mesh((devices,), ("cp",), device="h100"), example,
                                mixed_precision="bf16", solve=autopar.SolveOptions(compare=False))
        except autopar.InfeasibleError as exc:
            return best + (str(exc).split(";")[0],)
        kinds = sorted({n.strategy for n in plan.nodes if n.op == "aten.scaled_dot_product_attention"})
        best = (seq, ", ".join(kinds))
        seq *= 2
    return best + ("",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cap", type=float, default=64.0, help="activation cap per rank, MiB")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/long_context.py")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    lengths = [int(x) for x in args.lengths.split(",")]
    sides = ["data-parallel", "context-parallel", "ulysses", "torch-cp"]
    log0(f"GPT hidden 128, 4 heads, 2 layers, causal; {WORLD} gloo ranks; median of {args.steps} steps")
    log0(f"{'seq':>6} {'side':<18}{'us/token':>10}{'vs dp':>8}{'saved MiB':>11}{'predicted':>11}{'vs dp':>8}")
    for seq in lengths:
        rows = {}
        for side in sides:
            try:
                rows[side] = torch_cp_side(seq, args.steps) if side == "torch-cp" else autopar_side(side, seq, args.steps)
            except Exception as exc:  # torch's context parallel on CPU, or a layout refused
                rows[side] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:90]}"
        dp = rows["data-parallel"]
        for side, r in rows.items():
            if isinstance(r, str):
                log0(f"{seq:>6} {side:<18} not run: {r}")
                continue
            t_ratio = r["s_per_token"] / dp["s_per_token"] if isinstance(dp, dict) else float("nan")
            m_ratio = r["saved"] / dp["saved"] if isinstance(dp, dict) else float("nan")
            pred = f"{r['predicted'] / MiB:>11.2f}" if r["predicted"] is not None else f"{'-':>11}"
            log0(f"{seq:>6} {side:<18}{r['s_per_token'] * 1e6:>10.2f}{t_ratio:>7.2f}x"
                 f"{r['saved'] / MiB:>11.2f}{pred}{m_ratio:>7.2f}x")
    if dist.get_rank() == 0:
        cap = args.cap * MiB
        grid = [256 * 2 ** i for i in range(12)]
        log0(f"\nlongest sequence under {args.cap:.0f} MiB of activations per rank (plan's prediction):")
        for layout in ("data-parallel", "context-parallel", "ulysses"):
            log0(f"  {layout:<18}{longest(layout, cap, grid) or '-':>10}")
        log0("\nplanner, llama3-8b bf16, one sequence, ILP free (longest power-of-two length that fits):")
        for devices in (8, 64):
            seq, kinds, why = llama_longest(devices)
            log0(f"  {devices:>3} x H100: {seq or 'none'} tokens ({kinds or why})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
