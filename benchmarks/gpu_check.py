"""Check autopar's predictions on one GPU: one command, about 70 s on an H200 (first run 2026-11-26)
before the backends section was added (it compiles a 1B Llama with Inductor twice: minutes
on a cold cache; not yet run on a GPU).

    python benchmarks/gpu_check.py --out gpu_check.json
    python benchmarks/gpu_check.py --sections ops,configs          # some sections only
    python benchmarks/gpu_check.py --cpu                           # tiny shapes on the CPU (under a minute)
    python benchmarks/gpu_check.py --cpu --sections backends       # Inductor on the CPU (about 20 s)

On a lent machine whose image has torch but not the rest (no ortools, the package not
installed), carry wheels downloaded here into an ignored folder:

    pip download --python-version 3.12 --only-binary=:all: --platform manylinux_2_27_x86_64 \
        --no-deps ortools protobuf immutabledict absl-py -d out/wheels
    # on the device, from the repository root:
    pip install -q --no-deps --target /tmp/site out/wheels/*.whl
    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_check.py --out $OUT/gpu_check.json

No torchrun needed: the script starts a 1-rank process group itself (NCCL on a GPU, gloo on
the CPU, a free local port); under a 1-rank torchrun it uses torchrun's.  Sections, each
printed as it finishes (and `--out` rewritten after each, so a run cut short keeps what it
measured):

1. quickstart: a small GPT planned and compiled with `autopar.compile` on Mesh((1,)) and
   trained for a few AdamW steps in float32 next to the same model trained plainly on the
   same device; max |loss difference| over the steps.  compile's default backend runs
   (Inductor on a GPU since 2026-11-28: equal to float rounding, not bit for bit).
2. calibrate: `autopar calibrate` (autopar/runtime/calibrate/fit.py) on this rank: matmul and attention
   FLOP/s per dtype, memory bandwidth, op latency and the AdamW line, next to the preset
   (h100, h200, a100; h100 for another GPU; cpu).  Later sections
   predict with this profile, and with the preset beside it.
3. ops: about a dozen ops (matmuls large, skinny and small; causal attention at a few
   sequence lengths and head sizes; add, GELU, SiLU; layer and RMS norm; softmax), each the
   only op of a module whose operands are parameters.  The prediction is what the planner
   prices for that node on a (1,) mesh (`autopar.solve.built.build_problem`: the FLOP counter
   on meta tensors, then `cost.roofline` for forward and for backward); the measurement is
   the op's forward, and forward plus backward (torch.autograd.grad of every operand), in
   CUDA events (perf_counter on the CPU), median of several runs after warm-up.  The f+b
   of a tiny op is mostly one autograd.grad call's fixed cost (printed as the floor: about
   150 us on an H200 host), which a model pays once per backward, not per op.
4. configs: six training configurations (GPT-2 124M and a small Llama in bf16 mixed
   precision on a GPU, gpt-tiny and llama-tiny in float32 on the CPU; with and without
   recomputation; two batch sizes): `autopar.plan`'s predicted step and memory per device
   against the median measured step (train_step, optimizer step, zero_grad, as a training
   loop runs them, with no synchronisation between; compiled with check_finite=False and
   check_inputs=0, which the cost model does not price; wall clock between
   synchronisations, train_step alone printed beside it) and
   torch.cuda.max_memory_allocated over the timed steps (n/a on the CPU).
5. backends: one model (a Llama of about 1B parameters in bf16 on a GPU; llama-tiny on the
   CPU) stepped by autopar eager, autopar with `backend="inductor"` and `torch.compile` of
   the plain model (AdamW; on a GPU twice: float32 weights with the forward under bf16
   autocast, the recipe autopar's mixed precision runs, and every weight and state in bf16,
   a cheaper recipe): median step, tokens/s and MFU, each autopar row
   against its plan priced for that backend (`autopar.plan(..., backend=...)`), and the
   first step (Inductor's compile) beside it.  On the CPU only when named in --sections.
6. summary: every row in one table, and the median |predicted / measured - 1| per section.

A section that fails prints its error and the others still run.  `main(argv)` returns the
same record `--out` writes (tests/test_gpu_check.py runs `--cpu`).
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before torch is imported

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.mesh import PRESETS
from autopar.models import build
from autopar.runtime import init_process_group
from autopar.runtime.calibrate.fit import calibrate
from autopar.solve.built import build_problem

SECTIONS = ("quickstart", "calibrate", "ops", "configs", "backends")
CPU_DEFAULT = ("quickstart", "calibrate", "ops", "configs")   # backends compiles with Inductor: asked for by name


def say(*args) -> None:
    print(*args, flush=True)


# ------------------------------------------------------------------ records

@dataclass(frozen=True)
class Row:
    """One prediction next to its measurement.  unit: "s" or "B"; predicted with the
    calibrated profile (or the preset where calibration did not run), preset with the preset."""

    section: str
    name: str
    unit: str
    predicted: float
    measured: float | None
    preset: float | None = None
    detail: str = ""

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.measured if self.measured else None

    @property
    def preset_ratio(self) -> float | None:
        return self.preset / self.measured if self.measured and self.preset else None

    def __str__(self) -> str:
        return (f"{self.name:<44} {_fmt(self.predicted, self.unit):>10} {_fmt(self.measured, self.unit):>10} "
                f"{_ratio(self.ratio):>6}   {_fmt(self.preset, self.unit):>10} {_ratio(self.preset_ratio):>6}"
                + (f"   {self.detail}" if self.detail else ""))


ROW_HEADER = (f"{'':<44} {'predicted':>10} {'measured':>10} {'ratio':>6}   {'preset':>10} {'ratio':>6}")


def _fmt(value, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "B":
        return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


@dataclass(frozen=True)
class Setup:
    """Where the check runs: the device and its name, the dtype ops and configs compute in,
    the preset predicted with beside the calibrated profile (and why, when it stands in)."""

    device: torch.device
    dtype: torch.dtype
    preset: str
    preset_note: str
    gpu: bool
    name: str


# ------------------------------------------------------------------ process group and device

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process_group(gpu: bool) -> bool:
    """A 1-rank group (NCCL on a GPU, gloo on the CPU); True when this call made it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_process_group("nccl" if gpu else "gloo")
    if dist.get_world_size() != 1:
        raise SystemExit(f"gpu_check runs on one device; launched with {dist.get_world_size()} ranks: "
                         f"run `python benchmarks/gpu_check.py` without torchrun")
    return True


def choose_setup(args) -> Setup:
    gpu = torch.cuda.is_available() and not args.cpu
    if not gpu:
        return Setup(torch.device("cpu"), getattr(torch, args.dtype or "float32"), "cpu", "", False,
                     f"CPU ({torch.get_num_threads()} threads)")
    name = torch.cuda.get_device_name()
    low = name.lower()
    if "h200" in low:
        preset, note = "h200", ""
    elif "h100" in low:
        preset, note = "h100", ""
    elif "a100" in low:
        preset, note = "a100", ""
    else:
        preset, note = "h100", f"no preset for {name}: the h100 preset stands in"
    return Setup(torch.device("cuda", torch.cuda.current_device()), getattr(torch, args.dtype or "bfloat16"),
                 preset, note, True, name)


def sync(setup: Setup) -> None:
    if setup.gpu:
        torch.cuda.synchronize()


def free_memory(setup: Setup) -> None:
    gc.collect()
    if setup.gpu:
        torch.cuda.empty_cache()


def timed(fn, setup: Setup, repeats: int, min_s: float, warmup: int = 2) -> float:
    """Seconds of one fn(): the median of `repeats` runs after `warmup` calls, each run
    repeating fn() until it lasts about min_s; CUDA events on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    sync(setup)
    start = time.perf_counter()
    fn()
    sync(setup)
    inner = max(1, min(1000, math.ceil(min_s / max(time.perf_counter() - start, 1e-7))))
    times = []
    for _ in range(repeats):
        if setup.gpu:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3 / inner)
        else:
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def median_error(rows) -> float | None:
    errors = [abs(r.ratio - 1) for r in rows if r.ratio is not None]
    return statistics.median(errors) if errors else None


# ------------------------------------------------------------------ 1. quick start

def quickstart(setup: Setup, args) -> dict:
    """gpt-tiny (CPU) or a 2-layer GPT-2 124M (GPU) in float32, compiled on Mesh((1,)) next
    to a plain copy on the same device, `args.steps` AdamW steps on one batch."""
    name, size = ("gpt2-124m", dict(n_layers=2, batch=4, seq=256)) if setup.gpu else ("gpt-tiny", {})
    torch.manual_seed(0)
    model, example = build(name, **size)
    reference = copy.deepcopy(model).to(setup.device)
    batch = tuple(t.to(setup.device) for t in example)
    mesh = autopar.Mesh((1,), ("dp",), device=setup.preset)
    start = time.perf_counter()
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False))
    planned = time.perf_counter() - start
    cm = autopar.compile(model, mesh, example, plan=plan)
    compiled = time.perf_counter() - start - planned
    say(f"{name} {dict(size) or ''} float32 on {setup.name}, backend {cm.backend!r} (compile's default): planned "
        f"in {planned:.2f} s, compiled in {compiled:.2f} s; {plan.predicted}")
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for step in range(args.steps):
        loss = cm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        ref = reference(*batch)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(float(loss.item()))
        ref_losses.append(float(ref.item()))
        say(f"  step {step}  compiled {losses[-1]:.6f}  plain {ref_losses[-1]:.6f}  "
            f"diff {abs(losses[-1] - ref_losses[-1]):.1e}")
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    say(f"max |loss difference| over {args.steps} steps: {diff:.2e}")
    return {"model": name, "config": size, "losses": losses, "plain_losses": ref_losses, "max_abs_diff": diff,
            "plan_s": planned, "compile_s": compiled, "backend": cm.backend}


# ------------------------------------------------------------------ 2. calibration

def calibrate_device(setup: Setup, args):
    """autopar calibrate on this rank (cached per machine; --recalibrate measures again)."""
    start = time.perf_counter()
    spec = calibrate(base=setup.preset, repeats=2 if not setup.gpu else 5, quick=not setup.gpu,
                     force=args.recalibrate)
    took = time.perf_counter() - start
    preset = PRESETS[setup.preset]
    say(f"calibrated in {took:.1f} s: {spec.source}")
    say(f"{'':<28} {'calibrated':>15} {'preset ' + setup.preset:>15} {'calibrated/preset':>17}")
    table = {}

    def line(label, cal, pre, scale, unit):
        table[label] = {"calibrated": cal, "preset": pre}
        ratio = f"{cal / pre:.2f}" if cal and pre else "n/a"
        kept = "   (not measured: the preset's)" if cal == pre else ""
        say(f"{label:<28} {cal / scale:>10.3g} {unit:<4} {pre / scale:>10.3g} {unit:<4} {ratio:>16}{kept}")

    for dtype, _ in spec.flops:
        line(f"matmul {dtype}", spec.peak_flops(dtype), preset.peak_flops(dtype), 1e12, "TF/s")
    for dtype, _ in spec.attention_flops:
        line(f"attention {dtype}", spec.peak_flops(dtype, attention=True),
             preset.peak_flops(dtype, attention=True), 1e12, "TF/s")
    line("memory bandwidth", spec.mem_bandwidth, preset.mem_bandwidth, 1e9, "GB/s")
    line("op latency", spec.op_latency, preset.op_latency, 1e-6, "us")
    if spec.optimizer:
        pre = preset.optimizer or (0.0, float("nan"))
        say(f"{'AdamW':<28} {spec.optimizer[0] * 1e6:.2f} us/param + {spec.optimizer[1] * 1e12:.1f} ps/element"
            + (f" (preset {pre[0] * 1e6:.2f} us + {pre[1] * 1e12:.1f} ps)" if preset.optimizer
               else " (preset: memory traffic at its bandwidth)"))
        table["adamw"] = {"calibrated": list(spec.optimizer), "preset": list(preset.optimizer)}
    say(f"asynchronous (launch hidden behind work): {spec.asynchronous}; memory {spec.memory / 2**30:.1f} GiB")
    return spec, {"seconds": took, "source": spec.source, "rates": table, "device": spec.to_dict()}


# ------------------------------------------------------------------ 3. per op

class OneOp(nn.Module):
    """fn(*operands) as a module whose operands are parameters (so that backward computes
    every operand's gradient, as inside a model), returning the sum (the planner needs a
    scalar loss; its node is not counted)."""

    def __init__(self, fn, shapes, dtype, device):
        super().__init__()
        self.fn = fn
        self.operands = nn.ParameterList([nn.Parameter(torch.empty(s, dtype=dtype, device=device)) for s in shapes])

    def forward(self):
        return self.fn(*self.operands).sum()


@dataclass(frozen=True)
class OpCase:
    name: str
    fn: object
    shapes: tuple
    op: str            # the aten op whose node is priced (autopar's name for it)


def _layer_norm(x, w, b):
    return F.layer_norm(x, w.shape, w, b)


def _rms_norm(x, w):
    return F.rms_norm(x, w.shape, w)


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def op_cases(gpu: bool) -> list:
    def mm(m, k, n, label):
        return OpCase(f"matmul {label} {m}x{k}x{n}", torch.matmul, ((m, k), (k, n)), "aten.matmul")

    def sdpa(b, h, s, d):
        return OpCase(f"sdpa causal b{b} h{h} s{s} d{d}", _causal, ((b, h, s, d),) * 3,
                      "aten.scaled_dot_product_attention")

    if gpu:
        n, rows, width = 2**26, 16384, 4096
        cases = [mm(8192, 8192, 8192, "large"), mm(4096, 4096, 4096, "square"), mm(16384, 4096, 128, "skinny"),
                 mm(256, 256, 256, "small"),
                 OpCase("linear 8192 tokens 4096->14336", F.linear, ((8192, 4096), (14336, 4096)), "aten.linear"),
                 OpCase("linear 8192 tokens 768->50257 (rows off 16 B)", F.linear, ((8192, 768), (50257, 768)),
                        "aten.linear"),
                 sdpa(8, 12, 1024, 64), sdpa(2, 32, 4096, 128), sdpa(1, 32, 8192, 128)]
    else:
        n, rows, width = 2**18, 512, 256
        cases = [mm(256, 256, 256, "square"), mm(1024, 256, 16, "skinny"), mm(32, 32, 32, "small"),
                 OpCase("linear 512 tokens 256->512", F.linear, ((512, 256), (512, 256)), "aten.linear"),
                 sdpa(1, 4, 64, 32), sdpa(1, 4, 256, 32)]
    return cases + [
        OpCase(f"add {n}", torch.add, ((n,), (n,)), "aten.add"),
        OpCase(f"gelu {n}", F.gelu, ((n,),), "aten.gelu"),
        OpCase(f"silu {n}", F.silu, ((n,),), "aten.silu"),
        OpCase(f"layer_norm {rows}x{width}", _layer_norm, ((rows, width), (width,), (width,)), "aten.layer_norm"),
        OpCase(f"rms_norm {rows}x{width}", _rms_norm, ((rows, width), (width,)), "aten.rms_norm"),
        OpCase(f"softmax {rows}x{width}", lambda x: torch.softmax(x, -1), ((rows, width),), "aten.softmax"),
    ]


def priced_op(case: OpCase, dtype, spec) -> tuple:
    """(forward, forward + backward) seconds the planner prices the case's node at on a (1,)
    mesh of `spec`."""
    module = OneOp(case.fn, case.shapes, dtype, "meta")
    problem = build_problem(module, autopar.Mesh((1,), ("dp",), device=spec), (), None).problem
    nodes = [pn for pn in problem.nodes if pn.kind == "op" and pn.op == case.op]
    if not nodes:
        found = sorted({pn.op for pn in problem.nodes if pn.kind == "op"})
        raise ValueError(f"{case.name}: no {case.op} node in the traced graph (ops: {found})")
    choices = [problem.choices[pn.rep][0] for pn in nodes]
    return sum(c.forward_s for c in choices), sum(c.compute for c in choices)


def measure_op(case: OpCase, setup: Setup, args) -> tuple:
    """(forward, forward + backward) measured seconds."""
    operands = [torch.randn(s, dtype=setup.dtype, device=setup.device).requires_grad_(True) for s in case.shapes]
    out = case.fn(*operands)
    grad = torch.randn_like(out)
    min_s = 0.005 if setup.gpu else 0.02
    forward = timed(lambda: case.fn(*operands), setup, args.repeats, min_s)
    both = timed(lambda: torch.autograd.grad(case.fn(*operands), operands, grad), setup, args.repeats, min_s)
    return forward, both


def backward_floor(setup: Setup, args) -> float:
    """Measured seconds of forward and backward of the smallest op (x * 2, one element)."""
    x = torch.ones(1, dtype=setup.dtype, device=setup.device, requires_grad=True)
    return timed(lambda: torch.autograd.grad(x * 2, (x,), torch.ones_like(x)), setup, args.repeats,
                 0.005 if setup.gpu else 0.02)


def per_op(setup: Setup, spec, args) -> list:
    preset = PRESETS[setup.preset]
    rows = []
    say(f"dtype {str(setup.dtype).replace('torch.', '')}; forward and forward+backward (f+b) of each op")
    floor = backward_floor(setup, args)
    say(f"(one torch.autograd.grad call of a 1-element multiply measures {_fmt(floor, 's')}: the floor of "
        f"every f+b below, paid once per backward, not per op)")
    say(ROW_HEADER)
    for case in op_cases(setup.gpu):
        try:
            fwd_p, both_p = priced_op(case, setup.dtype, spec)
            fwd_pre, both_pre = priced_op(case, setup.dtype, preset)
            fwd_m, both_m = measure_op(case, setup, args)
        except Exception as exc:   # one op failing leaves the others
            say(f"{case.name}: FAILED {type(exc).__name__}: {exc}")
            free_memory(setup)
            continue
        for part, p, pre, m in (("fwd", fwd_p, fwd_pre, fwd_m), ("f+b", both_p, both_pre, both_m)):
            rows.append(Row("ops", f"{case.name} {part}", "s", p, m, pre))
            say(rows[-1])
        free_memory(setup)
    return rows


# ------------------------------------------------------------------ 4. per config

@dataclass(frozen=True)
class Config:
    name: str
    model: str
    overrides: dict
    recompute: str


def configs(gpu: bool) -> list:
    if gpu:
        gpt = dict(batch=8, seq=1024)
        llama = dict(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, vocab=32000, multiple_of=256, seq=2048)
        return [Config("gpt2-124m b8x1024", "gpt2-124m", gpt, "none"),
                Config("gpt2-124m b16x1024", "gpt2-124m", dict(gpt, batch=16), "none"),
                Config("gpt2-124m b8x1024 full recompute", "gpt2-124m", gpt, "full"),
                Config("llama 2048x4L b2x2048", "llama3-8b", dict(llama, batch=2), "none"),
                Config("llama 2048x4L b4x2048", "llama3-8b", dict(llama, batch=4), "none"),
                Config("llama 2048x4L b4x2048 selective", "llama3-8b", dict(llama, batch=4), "selective")]
    gpt = dict(hidden=128, n_heads=4, batch=4, seq=32)
    llama = dict(dim=128, n_heads=4, n_kv_heads=2, batch=4, seq=32)
    return [Config("gpt-tiny h128 b4x32", "gpt-tiny", gpt, "none"),
            Config("gpt-tiny h128 b8x32", "gpt-tiny", dict(gpt, batch=8), "none"),
            Config("gpt-tiny h128 b4x32 full recompute", "gpt-tiny", gpt, "full"),
            Config("llama-tiny d128 b4x32", "llama-tiny", llama, "none"),
            Config("llama-tiny d128 b8x32", "llama-tiny", dict(llama, batch=8), "none"),
            Config("llama-tiny d128 b4x32 selective", "llama-tiny", llama, "selective")]


def run_config(config: Config, setup: Setup, spec, args) -> list:
    """Plan (calibrated profile and preset), compile, time the steps; two rows."""
    torch.manual_seed(0)
    model, example = build(config.model, device="meta", **config.overrides)
    precision = setup.dtype if setup.dtype != torch.float32 else None
    vocab = model.config.vocab
    plans = {}
    for label, device in (("calibrated", spec), ("preset", setup.preset)):
        plans[label] = autopar.plan(model, autopar.Mesh((1,), ("dp",), device=device), example,
                                    solve=autopar.SolveOptions(compare=False), mixed_precision=precision,
                                    recompute=config.recompute)
    plan = plans["calibrated"]
    cm = autopar.compile(model, plan.mesh, example, plan=plan, seed=0,
                         run=autopar.RunOptions(check_finite=False, check_inputs=0, backend="eager"))
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)
    batch = tuple(torch.randint(0, vocab, t.shape, device=setup.device) for t in example)
    times, passes = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and setup.gpu:
            torch.cuda.reset_peak_memory_stats()
        sync(setup)
        start = time.perf_counter()
        cm.train_step(*batch)   # a training loop: no synchronisation between the pass and the step
        opt.step()
        opt.zero_grad()
        sync(setup)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    for i in range(args.steps):   # the forward and backward alone
        sync(setup)
        start = time.perf_counter()
        cm.train_step(*batch)
        sync(setup)
        passes.append(time.perf_counter() - start)
        opt.zero_grad()
    measured = statistics.median(times)
    split = f"train_step alone {statistics.median(passes) * 1e3:.2f} ms"
    peak = torch.cuda.max_memory_allocated() if setup.gpu else None
    recomputed = (f"; {len(plan.recompute.layers)} layers recompute, +{plan.recompute.added_s * 1e3:.2f} ms"
                  if plan.recompute is not None and plan.recompute.layers else "")
    del cm, opt
    return [Row("configs", f"{config.name} step", "s", plan.step_s, measured, plans["preset"].step_s,
                f"{split}{recomputed}"),
            Row("configs", f"{config.name} memory", "B", plan.memory_per_device, peak,
                plans["preset"].memory_per_device,
                ", ".join(f"{k} {_fmt(v, 'B')}" for k, v in plan.predicted.memory.items()))]


def per_config(setup: Setup, spec, args) -> list:
    rows = []
    say(f"training in {str(setup.dtype).replace('torch.', '')}"
        f"{' mixed precision (float32 master weights)' if setup.dtype != torch.float32 else ''}; "
        f"median of {args.steps} steps after {args.warmup}")
    say(ROW_HEADER)
    for config in configs(setup.gpu):
        try:
            got = run_config(config, setup, spec, args)
        except Exception as exc:   # one configuration failing leaves the others
            say(f"{config.name}: FAILED {type(exc).__name__}: {exc}")
            free_memory(setup)
            continue
        rows += got
        for row in got:
            say(row)
        free_memory(setup)
    return rows


# ------------------------------------------------------------------ 5. summary and the whole run

def per_backend(setup: Setup, spec, args) -> list:
    """autopar eager, autopar inductor and torch.compile of the plain model, one config."""
    if setup.gpu:
        name, overrides = "llama3-8b", dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, vocab=32000,
                                            multiple_of=256, batch=4, seq=2048)
    else:
        name, overrides = "llama-tiny", dict(dim=128, n_heads=4, n_kv_heads=2, batch=4, seq=32)
    torch.manual_seed(0)
    model, example = build(name, device="meta", **overrides)
    precision = setup.dtype if setup.dtype != torch.float32 else None
    mesh = autopar.Mesh((1,), ("dp",), device=spec)
    tokens = math.prod(example[0].shape)
    params = sum(p.numel() for p in model.parameters())
    label = f"{name} {params / 1e9:.2f}B" if setup.gpu else name   # (the family's builder, resized)
    peak = spec.peak_flops(setup.dtype)
    vocab = model.config.vocab
    batch = tuple(torch.randint(0, vocab, t.shape, device=setup.device) for t in example)
    rows = []

    def run(step) -> tuple:
        times = []
        for i in range(args.warmup + args.steps):
            sync(setup)
            start = time.perf_counter()
            step()
            sync(setup)
            times.append(time.perf_counter() - start)
        return times[0], statistics.median(times[args.warmup:])

    def detail(first, measured) -> str:
        mfu = 6 * params * tokens / measured / peak
        return f"{tokens / measured:,.0f} tokens/s, MFU {mfu:.1%} (6 N T); first step {first:.1f} s"

    measured = {}
    for backend in ("eager", "inductor"):
        torch.manual_seed(0)
        model, example = build(name, device="meta", **overrides)   # (compile initialises a model once)
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                            pricing=autopar.Pricing(backend=backend), mixed_precision=precision)
        cm = autopar.compile(model, mesh, example, plan=plan, seed=0,
                             run=autopar.RunOptions(check_finite=False, check_inputs=0, backend=backend))
        opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)

        def step():
            cm.train_step(*batch)
            opt.step()
            opt.zero_grad()
        first, measured[backend] = run(step)
        rows.append(Row("backends", f"{label} autopar {backend}", "s", plan.step_s, measured[backend], None,
                        detail(first, measured[backend])))
        del cm, opt
        free_memory(setup)
    # torch.compile of the plain model, twice: the same recipe as autopar's mixed precision
    # (float32 weights and AdamW states, the forward in the compute dtype under autocast),
    # then every weight and state in the compute dtype (half the optimizer's traffic: a
    # cheaper recipe, not the same training)
    recipes = [("float32 weights, autocast", torch.float32, True),
               (f"{str(setup.dtype).removeprefix('torch.')} weights", setup.dtype, False)]
    if setup.dtype == torch.float32:
        recipes = recipes[1:]
    for recipe, weights, autocast in recipes:
        torch.manual_seed(0)
        plain, _ = build(name, device=setup.device, **overrides)
        plain = plain.to(weights)
        compiled = torch.compile(plain)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

        def step():
            with torch.autocast(setup.device.type, dtype=setup.dtype, enabled=autocast):
                loss = compiled(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
        first, took = run(step)
        rows.append(Row("backends", f"{label} torch.compile ({recipe})", "s", plan.step_s, took, None,
                        detail(first, took) + f"; autopar inductor / this {measured['inductor'] / took:.2f}; "
                        f"predicted column: autopar inductor's plan"))
        del plain, compiled, opt
        free_memory(setup)
    for r in rows:
        say(r)
    return rows


def summary(result: dict, rows: list) -> dict:
    say(f"{'section':<9}" + ROW_HEADER)
    for row in rows:
        say(f"{row.section:<9}{row}")
    out = {}
    if "quickstart" in result:
        out["quickstart max |loss diff|"] = result["quickstart"]["max_abs_diff"]
    ops = [r for r in rows if r.section == "ops"]
    out["ops f+b median |pred/meas - 1|"] = median_error([r for r in ops if r.name.endswith("f+b")])
    out["ops fwd median |pred/meas - 1|"] = median_error([r for r in ops if r.name.endswith("fwd")])
    out["ops f+b median |preset/meas - 1|"] = median_error(
        [replace(r, predicted=r.preset) for r in ops if r.name.endswith("f+b") and r.preset])
    steps = [r for r in rows if r.section == "configs" and r.unit == "s"]
    memory = [r for r in rows if r.section == "configs" and r.unit == "B"]
    out["configs step median |pred/meas - 1|"] = median_error(steps)
    out["configs step median |preset/meas - 1|"] = median_error([replace(r, predicted=r.preset) for r in steps])
    out["configs memory median |pred/meas - 1|"] = median_error(memory)
    say("")
    for key, value in out.items():
        say(f"{key:<42} {'n/a' if value is None else f'{value:.3g}'}")
    if result["errors"]:
        say(f"sections that failed: {', '.join(result['errors'])}")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this path (after every section)")
    parser.add_argument("--sections", default=None,
                        help=f"comma-separated subset of {','.join(SECTIONS)} (the summary always prints; default all on a GPU, all but backends on the CPU)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with tiny shapes (auto without CUDA)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="ops and configs compute dtype (default bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--steps", type=int, help="timed training steps per config (default 10 GPU, 4 CPU); "
                                                  "also the quick start's steps")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per config (default 3 GPU, 1 CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per op (default 7 GPU, 3 CPU)")
    parser.add_argument("--recalibrate", action="store_true", help="measure again instead of the cached profile")
    args = parser.parse_args(argv)
    setup_gpu = torch.cuda.is_available() and not args.cpu
    sections = [s.strip() for s in (args.sections or ",".join(SECTIONS if setup_gpu else CPU_DEFAULT)).split(",")
                if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")

    setup = choose_setup(args)
    args.steps = args.steps or (10 if setup.gpu else 4)
    args.warmup = args.warmup if args.warmup is not None else (3 if setup.gpu else 1)
    args.repeats = args.repeats or (7 if setup.gpu else 3)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    made = start_process_group(setup.gpu)
    start = time.perf_counter()
    say(f"gpu_check on {setup.name}, torch {torch.__version__}, preset {setup.preset}"
        + (f" ({setup.preset_note})" if setup.preset_note else ""))
    result: dict = {"device": setup.name, "torch": torch.__version__, "preset": setup.preset,
                    "preset_note": setup.preset_note, "dtype": str(setup.dtype).replace("torch.", ""),
                    "sections": sections, "errors": {}, "seconds": {}}
    rows: list = []
    spec = PRESETS[setup.preset]

    def write():
        result["rows"] = [dict(asdict(r), ratio=r.ratio, preset_ratio=r.preset_ratio) for r in rows]
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=str)

    def section(name, title, fn):
        if name not in sections:
            return None
        say(f"\n== {title} ==")
        began = time.perf_counter()
        try:
            return fn()
        except Exception as exc:   # a GPU run is rare: one section's failure leaves the others
            traceback.print_exc()
            sys.stderr.flush()
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            say(f"{name} FAILED: {type(exc).__name__}: {exc}")
            free_memory(setup)
            return None
        finally:
            free_memory(setup)
            result["seconds"][name] = time.perf_counter() - began
            say(f"({name}: {result['seconds'][name]:.1f} s)")
            write()

    try:
        got = section("quickstart", "1. quick start: compiled vs plain, float32", lambda: quickstart(setup, args))
        if got is not None:
            result["quickstart"] = got
        got = section("calibrate", "2. calibration", lambda: calibrate_device(setup, args))
        if got is not None:
            spec, result["calibration"] = got
        elif "ops" in sections or "configs" in sections:
            say(f"\n(no calibrated profile: predictions use the {setup.preset} preset)")
        result["predicted_with"] = spec.name
        got = section("ops", "3. per op: predicted vs measured", lambda: per_op(setup, spec, args))
        rows += got or []
        got = section("configs", "4. per config: plan vs measured step and peak memory",
                      lambda: per_config(setup, spec, args))
        rows += got or []
        got = section("backends", "5. backends: autopar eager, autopar inductor, torch.compile",
                      lambda: per_backend(setup, spec, args))
        rows += got or []
        say(f"\n== 6. summary (predicted with {spec.name}) ==")
        result["summary"] = summary(result, rows)
        result["seconds"]["total"] = time.perf_counter() - start
        say(f"total {result['seconds']['total']:.1f} s")
        write()
    finally:
        if made:
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
