"""Where one GPU's training step goes, for the terms benchmarks/gpu_check.py's totals cannot
separate: the kernels of a step (torch.profiler), the optimizer step alone, and the host's
floor (the same models on 64 tokens, where the kernels take almost nothing).  About a minute
on an H100; run it as gpu_check.py's docstring says (PYTHONPATH with the carried wheels):

    python benchmarks/gpu_profile.py > gpu_profile.txt

The cost model's constants read from it (2026-11-26, one H100, docs/gpu/2026-11-26-h100-*.txt):
KernelEfficiency.misaligned (GPT-2's 50,257-wide head on a fallback GEMM kernel),
DeviceSpec.host_op (host seconds per traced op and direction), the optimizer's passes
(autopar.cost.prices.optimizer_seconds) and the host time of recomputation
(autopar.solve.assemble.RECOMPUTE_HOST; docs/gpu/2026-11-26-h200-recompute-profile.txt).  Each model prints its measured forward and
backward, its optimizer step and zero_grad, and the plan's prediction; the full-size runs
print the profiler's kernel table too.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from torch.profiler import ProfilerActivity, profile

import autopar
import gpu_check
from autopar.models import build

LLAMA = dict(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, vocab=32000, multiple_of=256, seq=2048)
RUNS = [("gpt2 b8x1024", "gpt2-124m", dict(batch=8, seq=1024), True),
        ("gpt2 b1x64 (host floor)", "gpt2-124m", dict(batch=1, seq=64), False),
        ("llama 2048x4L b4x2048", "llama3-8b", dict(LLAMA, batch=4), True),
        ("llama 2048x4L b1x64 (host floor)", "llama3-8b", dict(LLAMA, batch=1, seq=64), False)]


def median_seconds(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile needs a GPU (gpu_check.py --cpu is the CPU check)")
    gpu_check.start_process_group(True)
    device = torch.device("cuda", torch.cuda.current_device())
    preset = gpu_check.choose_setup(type("A", (), {"cpu": False, "dtype": None})()).preset
    print(f"gpu_profile on {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {preset}")
    for name, model_name, overrides, profiled in RUNS:
        for precision in (torch.bfloat16, None):
            torch.manual_seed(0)
            model, example = build(model_name, device="meta", **overrides)
            plan = autopar.plan(model, autopar.Mesh((1,), ("dp",), device=preset), example,
                                solve=autopar.SolveOptions(compare=False), mixed_precision=precision)
            cm = autopar.compile(model, plan.mesh, example, plan=plan, seed=0,
                                 run=autopar.RunOptions(check_finite=False, check_inputs=0, backend="eager"))
            opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)
            batch = tuple(torch.randint(0, model.config.vocab, t.shape, device=device) for t in example)
            for _ in range(3):
                cm.train_step(*batch)
                opt.step()
                opt.zero_grad()

            def step():
                opt.step()
                opt.zero_grad()

            passes = median_seconds(lambda: cm.train_step(*batch))
            whole = median_seconds(lambda: (cm.train_step(*batch), step()), 5)
            print(f"=== {name} mixed={precision}: train_step {passes * 1e3:.2f} ms, optimizer+zero_grad "
                  f"{(whole - passes) * 1e3:.2f} ms, predicted step {plan.step_s * 1e3:.2f} ms ({plan.predicted})",
                  flush=True)
            if profiled:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        cm.train_step(*batch)
                        step()
                    torch.cuda.synchronize()
                table = prof.key_averages()
                print(f"kernel time per step {sum(e.self_device_time_total for e in table) / 3 / 1e3:.2f} ms "
                      f"(operators and their kernels both counted)")
                print(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70), flush=True)
            del cm, opt
            torch.cuda.empty_cache()
    recomputation(preset, device)


def recomputation(preset: str, device) -> None:
    """GPT-2 124M's forward and backward with no, full and selective recomputation: the
    wall clock against the kernels and the host (autopar/solve/assemble.RECOMPUTE_HOST)."""
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model, example = build("gpt2-124m", device="meta", batch=8, seq=1024)
        plan = autopar.plan(model, autopar.Mesh((1,), ("dp",), device=preset), example,
                            solve=autopar.SolveOptions(compare=False), mixed_precision=torch.bfloat16, recompute=mode)
        cm = autopar.compile(model, plan.mesh, example, plan=plan, seed=0,
                             run=autopar.RunOptions(check_finite=False, check_inputs=0, backend="eager"))
        batch = tuple(torch.randint(0, model.config.vocab, t.shape, device=device) for t in example)
        for _ in range(3):
            cm.train_step(*batch)
        passes = median_seconds(lambda: cm.train_step(*batch))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                cm.train_step(*batch)
            torch.cuda.synchronize()
        table = prof.key_averages()
        print(f"=== recompute {mode}: train_step {passes * 1e3:.2f} ms; kernels and operators "
              f"{sum(e.self_device_time_total for e in table) / 2 / 1e3:.2f} ms, host "
              f"{sum(e.self_cpu_time_total for e in table) / 2 / 1e3:.2f} ms per step (profiled); "
              f"predicted step {plan.step_s * 1e3:.2f} ms", flush=True)
        del cm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
