"""Measure the machine the plans are for, and fit the cost model's parameters to it.

Run under torchrun on the cluster (all ranks take part; a few minutes at most):

    torchrun --nproc_per_node 4 -m autopar calibrate --out profile.json [--mesh 2x2 --axes dp,tp]

What is measured, on every rank at once (so that ranks sharing a host's cores or links
measure what training gets):

- compute: a linear layer's forward and backward at a few training shapes per dtype,
  fitted as t = c + flops / R (R is the FLOP rate, c the cost of the smallest op); causal
  attention's forward and backward likewise (its own rate: a CPU's fused kernel runs
  small heads far below the matmul rate); torch's AdamW
  step over parameters of a few counts and sizes, fitted as seconds per parameter plus
  seconds per element; an elementwise add over a few sizes,
  fitted as t = c + bytes / W (W the memory bandwidth); on a CPU, elementwise ops that
  evaluate a transcendental function per element (gelu, silu, tanh, softmax; their
  seconds per element, forward and backward); and the cost of one tiny op
  forward and backward (the op latency: kernel launch, or eager dispatch on a CPU).
- a step check (CPU hosts): small GPTs' training steps on every rank at once, against
  the steps predicted for them from the rates above, fitted as a scale on the work and a
  cost per op (step_check: what a model's step adds to single ops, and a busy moment
  during the single-op runs); the work scale is recorded as DeviceSpec.compute_scale, the
  per-op cost replaces op_latency.
- communication: per mesh axis, all-reduce, all-gather, reduce-scatter, all-to-all and a
  send/recv between neighbours over a range of sizes, with the runtime's own collective
  code (autopar/passes/redistribute.py), each fitted as t = f + b * m, m being the bytes
  autopar.cost.collectives' formulas read.  Read through the ring formula of the collective
  (f = L + s(n) a, b = c(n) / B), b gives the bandwidth B; with the axis's full groups and
  groups of 2 ranks measured, the two fixed costs give the launch L and the per-step
  latency a (one group size: half of f each).  Axes inside a node fill the "intra" link,
  axes across nodes the "inter" one (several axes of one class: their mean).  On CPU
  ranks each call is timed after a stretch of compute, as a step makes it (step_chain:
  calls timed back to back are up to 2x cheaper there).

The result is an autopar.DeviceSpec (`DeviceSpec.load(path)`); a link class not measured
(one node: "inter") keeps the base preset's numbers.  Results are cached per cluster
description (ranks, hosts, device, torch and the mesh) under $AUTOPAR_CACHE
(~/.cache/autopar by default); `force=True` measures again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import shutil
import socket
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autopar.cost.collectives import KINDS
from autopar.mesh import PRESETS, DeviceSpec, Mesh
from autopar.models import build
from autopar.solve.planner import plan
from autopar.passes.redistribute import all_gather_dim, all_to_all_dims, reduce_scatter_rows

log = logging.getLogger("autopar")

FORMAT = 4   # 2: CPU collectives timed after compute (step_chain), pointwise ops measured; 3: fused AdamW measured;
# 4: compute rates scaled to a model step (step_check)
# (sizes, repeats) per device type: small enough for minutes on a loaded CPU host
# linear layers (tokens, in, out) and causal attention (batch, heads, seq, head dim) of
# the shapes training runs
LINEAR = {"cpu": ((128, 256, 768), (256, 512, 512), (512, 512, 1024), (512, 1024, 1024)),
          "cuda": ((2048, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 4096), (8192, 8192, 8192))}
ATTENTION = {"cpu": ((2, 8, 64, 32), (2, 8, 128, 32), (2, 8, 256, 64), (4, 8, 256, 64)),
             "cuda": ((1, 32, 2048, 128), (1, 32, 4096, 128), (2, 32, 4096, 128), (1, 32, 8192, 128))}
ELEMENTS = {"cpu": (2**14, 2**18, 2**21, 2**23), "cuda": (2**16, 2**20, 2**24, 2**27)}
MESSAGE = {"cpu": (2**12, 2**15, 2**18, 2**20, 2**22, 2**24), "cuda": (2**16, 2**20, 2**23, 2**26, 2**28)}
DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}


def cache_dir() -> str:
    return os.environ.get("AUTOPAR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "autopar"))


def _progress(text: str) -> None:
    if dist.get_rank() == 0:
        log.info("calibrate: %s", text)


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"


def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


# each timed run repeats the call until it lasts this long: compute runs long enough for
# ranks that share cores to share them as in training (a scheduler's slices are ms long)
MIN_SECONDS = {"compute": 0.15, "comm": 0.02, "quick": 0.002}
STEP_SEGMENT_S = 0.004   # the compute a CPU step runs between two collectives (step_chain)


def _slowest(value: float, device_type: str, group) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if device_type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _timed(fn, device_type: str, repeats: int, group=None, what: str = "comm") -> float:
    """Seconds of one fn(): the median over `repeats` timed runs after warm-up, every rank
    of `group` starting together, each run repeating fn() until it lasts MIN_SECONDS (so
    that ranks sharing cores all run at once, as in training, rather than taking turns
    through a short call); the slowest rank's median (a step waits for the slowest).
    what: "compute" or "comm" (MIN_SECONDS)."""
    fn()
    _sync(device_type)
    start = time.perf_counter()
    fn()
    _sync(device_type)
    once = _slowest(time.perf_counter() - start, device_type, group)
    inner = max(1, min(10000, math.ceil(MIN_SECONDS[what] / max(once, 1e-7))))
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device_type)
        times.append((time.perf_counter() - start) / inner)
    return _slowest(statistics.median(times), device_type, group)


def fit_line(x, t, relative: bool = True) -> tuple:
    """(intercept, slope) of t = intercept + slope * x, least squares; both >= 0.
    relative: on relative error (each point weighted by 1 / t, so small sizes count as much
    as large ones); else on seconds (what a step adds up: a collective whose calls are
    sometimes slow, as gloo's on shared cores, is priced by its mean at every size)."""
    x, t = np.asarray(x, float), np.asarray(t, float)
    w = 1.0 / np.maximum(t, 1e-12) if relative else np.ones_like(t)
    slope, intercept = np.polyfit(x, t, 1, w=w)
    if slope <= 0:   # no growth seen (noise over sizes too small to tell): at most what the largest took
        top = int(np.argmax(x))
        return float(np.min(t)), max(float(t[top] - np.min(t)), 0.1 * float(t[top])) / float(x[top])
    return max(float(intercept), 0.0), float(slope)


# ------------------------------------------------------------------ compute

POINTWISE_ELEMENTS = 2**18   # a transformer MLP's activation on a CPU rank: 256 tokens x 1,024
POINTWISE = {   # DeviceSpec.pointwise keys (autopar.cost.kernels.pointwise_key) and how to run them
    "aten.gelu": F.gelu,
    "aten.gelu:tanh": lambda x: F.gelu(x, approximate="tanh"),
    "aten.silu": F.silu,
    "aten.tanh": torch.tanh,
    "aten.sigmoid": torch.sigmoid,
    "aten.exp": torch.exp,
    "aten.softmax": lambda x: x.view(-1, 1024).softmax(-1),
    "aten.log_softmax": lambda x: x.view(-1, 1024).log_softmax(-1),
}


def measure_pointwise(dev, device_type: str, repeats: int, what: str) -> tuple:
    """(key, forward seconds, backward seconds) of each POINTWISE op over
    POINTWISE_ELEMENTS float32 elements.  On a CPU they compute more than they move: a
    gelu's tanh form takes about 0.9 ms for 2^19 elements, against 0.05 ms for an add, so
    the memory roofline prices it 15x too cheap."""
    x = torch.randn(POINTWISE_ELEMENTS, device=dev, requires_grad=True)
    out = []
    for key, fn in POINTWISE.items():
        grad = torch.ones_like(fn(x))
        fwd = _timed(lambda: fn(x), device_type, repeats, what=what)
        both = _timed(lambda: torch.autograd.grad(fn(x), x, grad), device_type, repeats, what=what)
        out.append((key, fwd, max(both - fwd, 0.0)))
    _progress("pointwise (ns per element, forward / backward): " +
              ", ".join(f"{k} {f / POINTWISE_ELEMENTS * 1e9:.2f}/{b / POINTWISE_ELEMENTS * 1e9:.2f}"
                        for k, f, b in out))
    return tuple(out)


def measure_compute(device_type: str, repeats: int, quick: bool = False) -> dict:
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    what = "quick" if quick else "compute"
    cut = 2 if quick else None   # quick: the two smallest sizes (messages: the smallest and largest)
    flops, attention, rows = {}, {}, {}
    for name in DTYPES[device_type]:
        dtype = getattr(torch, name)
        points = []
        for m, k, n in LINEAR[device_type][:cut]:   # a linear layer's forward and backward: 6 m k n FLOPs
            x = torch.randn(m, k, device=dev).to(dtype).requires_grad_(True)
            w = torch.randn(n, k, device=dev).to(dtype).requires_grad_(True)
            points.append((6.0 * m * k * n, _timed(lambda: F.linear(x, w).sum().backward(), device_type, repeats,
                                                   what=what)))
        c, per_flop = fit_line(*zip(*points))
        flops[name] = 1.0 / per_flop
        rows[f"linear {name}"] = points
        points = []
        for b, h, s, d in ATTENTION[device_type][:cut]:   # causal: 4 b h s^2 d forward (half masked) x 3.5
            q, k_, v = (torch.randn(b, h, s, d, device=dev).to(dtype).requires_grad_(True) for _ in range(3))
            fl = 2.0 * b * h * s * s * d * 3.5
            points.append((fl, _timed(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True).sum()
                                      .backward(), device_type, repeats, what=what)))
        _, per_flop = fit_line(*zip(*points))
        attention[name] = 1.0 / per_flop
        rows[f"attention {name}"] = points
        _progress(f"{name}: linear {flops[name] / 1e9:.1f} GFLOP/s, attention {attention[name] / 1e9:.1f} GFLOP/s")
    points = []
    for n in ELEMENTS[device_type][:cut]:
        a = torch.randn(n, device=dev)
        b = torch.randn(n, device=dev)
        points.append((3.0 * 4 * n, _timed(lambda: torch.add(a, b), device_type, repeats, what=what)))
    _, per_byte = fit_line(*zip(*points))
    rows["add float32"] = points
    bandwidth = 1.0 / per_byte
    _progress(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s")
    pointwise = measure_pointwise(dev, device_type, repeats, what) if device_type != "cuda" else ()
    for key, fwd, bwd in pointwise:
        rows[f"pointwise {key} (elements, forward s, backward s)"] = [(POINTWISE_ELEMENTS, fwd, bwd)]
    # a tiny op's forward, and forward plus backward, in a chain like a model's graph
    x = torch.randn(8, device=dev, requires_grad=True)
    chain = 32

    def forward():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    fwd = _timed(forward, device_type, repeats, what=what)
    both = _timed(lambda: forward().sum().backward(), device_type, repeats, what=what)
    op_latency = fwd / chain
    rows["tiny op"] = [(chain, fwd), (chain, both)]
    _progress(f"op latency: {op_latency * 1e6:.1f} us forward, {(both - fwd) / chain * 1e6:.1f} us backward")
    # torch's AdamW step (as the runtime builds it: torch's default, and the fused kernel the
    # backend "inductor" runs) over k parameters of e elements each
    optimizer = {}
    for fused in (False, True):
        points = []
        for k, e in ((4, 2**10), (32, 2**10), (4, 2**20), (16, 2**18)):
            params = [torch.zeros(e, device=dev, requires_grad=True) for _ in range(k)]
            for p in params:
                p.grad = torch.randn(e, device=dev)
            opt = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if fused else {}))
            points.append((k, k * e, _timed(opt.step, device_type, repeats, what=what)))
        ks, es, ts = (np.array(c, float) for c in zip(*points))
        w = 1.0 / ts   # relative error: the small steps fix the per-parameter cost, the large the per-element
        (per_param, per_element), *_ = np.linalg.lstsq(np.stack([ks, es], 1) * w[:, None], ts * w, rcond=None)
        name = "adamw fused" if fused else "adamw"
        rows[f"{name} (params, elements)"] = points
        _progress(f"{'AdamW, fused' if fused else 'AdamW'}: {max(per_param, 0) * 1e6:.1f} us per parameter, "
                  f"{max(per_element, 1e-15) * 1e9:.2f} ns per element")
        optimizer[fused] = (max(float(per_param), 0.0), max(float(per_element), 1e-15))
    return {"flops": flops, "attention": attention, "mem_bandwidth": bandwidth, "op_latency": op_latency, "points": rows,
            "pointwise": tuple((k, f / POINTWISE_ELEMENTS, b / POINTWISE_ELEMENTS) for k, f, b in pointwise),
            "optimizer": optimizer[False], "optimizer_fused": optimizer[True]}


# ------------------------------------------------------------------ communication

def _collective(kind: str, nbytes: int, group, n: int, coord: int, device):
    """fn() running one `kind` call whose formula bytes (autopar.cost.collectives) are `nbytes`,
    as the runtime runs it; for "send": rank 2k sends to 2k + 1 of the group."""
    elems = max(n, (int(nbytes) // 4) // n * n)
    if kind == "all_reduce":
        buf = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if kind == "all_gather":
        part = torch.ones(elems // n, device=device)
        return lambda: all_gather_dim(part, 0, group, n)
    if kind == "reduce_scatter":
        table = torch.ones(n, elems // n, device=device)
        return lambda: reduce_scatter_rows(table, group, coord)
    if kind == "all_to_all":
        t = torch.ones(elems, device=device)
        return lambda: all_to_all_dims(t, 0, 0, group, n, 0)
    if kind == "send":
        buf = torch.ones(elems, device=device)
        ranks = dist.get_process_group_ranks(group)
        peer = ranks[coord + 1] if coord % 2 == 0 else ranks[coord - 1]
        if coord % 2 == 0 and coord + 1 >= n:
            return lambda: None
        if coord % 2 == 0:
            return lambda: dist.send(buf, peer, group=group)
        return lambda: dist.recv(buf, peer, group=group)
    raise ValueError(f"unknown collective {kind!r}")


def _steps(kind: str, n: int) -> tuple:
    """(latency steps s(n), bandwidth factor c(n)) of the ring formula (autopar.cost.collectives)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "send":
        return 1, 1.0
    return n - 1, (n - 1) / n


def step_chain(group, device_type: str, repeats: int, quick: bool = False):
    """(fn, seconds) of a matmul chain of about STEP_SEGMENT_S on a synchronous host (CPU
    ranks), or None on CUDA.  A step calls each collective after a stretch of compute, and
    on a host that computes and communicates on the same cores such a call costs more
    than calls timed back to back (the library's threads wake from sleep, its buffers are
    out of cache; the ranks arrived within 0.1 ms of each other, so it is not a wait for
    the slower one): on 2 gloo ranks of a 2-core
    machine a 512 KB all-reduce took 2.9 ms after 4 ms of compute and 2.1 back to back,
    and inside a Megatron-TP step of the GPT in benchmarks/cost_accuracy.py 2.3-2.6 ms
    (median call).  So each collective is timed after the chain, less the chain
    (`in_step`).  On CUDA compute and collectives queue on streams and the host never
    waits at a call."""
    if device_type == "cuda":
        return None
    what = "quick" if quick else "compute"
    x, w = torch.randn(256, 512), torch.randn(512, 512)
    one = _timed(lambda: torch.mm(x, w), device_type, repeats, group, what)
    reps = max(1, round(STEP_SEGMENT_S / max(one, 1e-7)))

    def chain():
        for _ in range(reps):
            torch.mm(x, w)

    return chain, _timed(chain, device_type, repeats, group, what)


def in_step(fn, chain, device_type: str, repeats: int, group, quick: bool = False) -> float:
    """Seconds of one collective call fn() as a step pays it: back to back where `chain` is
    None (CUDA), else after the compute chain of step_chain, less the chain, and at least
    what it takes back to back (a small call's difference is within the chain's own
    noise, and a call never costs less than with everything warm)."""
    back_to_back = _timed(fn, device_type, repeats, group, "quick" if quick else "comm")
    if chain is None:
        return back_to_back
    run, seconds = chain
    both = _timed(lambda: (run(), fn()), device_type, repeats, group, "quick" if quick else "compute")
    return max(both - seconds, back_to_back)


def measure_axis(mesh, axis: int, device_type: str, repeats: int, sizes=None, quick: bool = False) -> dict:
    """Fitted (bandwidth, latency, launch) per collective kind on one mesh axis, each call
    timed as a step pays it (in_step)."""
    group = mesh.get_group(axis)
    n = mesh.size(axis)
    coord = mesh.get_local_rank(axis)
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    # groups of two along this axis, for the second group size (made on every rank, in one order)
    pair_group = None
    if n > 2:
        ranks = np.arange(mesh.mesh.numel()).reshape(tuple(mesh.mesh.shape))
        lines = np.moveaxis(ranks, axis, -1).reshape(-1, n)
        for line in lines:
            for i in range(0, n - 1, 2):
                g = dist.new_group([int(line[i]), int(line[i + 1])])
                if dist.get_rank() in (line[i], line[i + 1]):
                    pair_group = g
    out, points = {}, {}
    chains = {n: step_chain(group, device_type, repeats, quick)}
    if pair_group is not None:
        chains[2] = step_chain(pair_group, device_type, repeats, quick)
    sizes = sizes or MESSAGE[device_type]
    for kind in (*KINDS, "send"):
        fits = {}
        configs = [(group, n, coord)] + ([(pair_group, 2, coord % 2)] if pair_group is not None else [])
        for g, size, c in configs:
            pts = [(float(m), in_step(_collective(kind, m, g, size, c, device), chains[size], device_type, repeats,
                                      g, quick))
                   for m in sizes]
            fits[size] = fit_line(*zip(*pts), relative=device_type == "cuda")
            points[f"{kind} n={size}"] = pts
        f_n, b_n = fits[n]
        steps, factor = _steps(kind, n)
        bandwidth = factor / b_n
        if 2 in fits and n > 2:
            s2 = _steps(kind, 2)[0]
            latency = max((f_n - fits[2][0]) / (steps - s2), 0.0) if steps != s2 else 0.0
            launch = max(f_n - steps * latency, 0.0)
        else:
            launch, latency = f_n / 2, f_n / (2 * steps)
        out[kind] = (bandwidth, latency, launch)
        _progress(f"axis {mesh.mesh_dim_names[axis]} (n={n}) {kind}: {bandwidth / 1e9:.2f} GB/s, "
                  f"{latency * 1e6:.1f} us per step, {launch * 1e6:.1f} us per call")
    shared = [out]   # every rank plans with rank 0's fit (an odd rank out measured no pair)
    dist.broadcast_object_list(shared, src=0)
    return {"links": shared[0], "points": points}


# ------------------------------------------------------------------ a model step

# the step check's models (autopar.models' GPT), many tokens and few, narrow and wide: shapes
# unlike benchmarks/cost_accuracy.py's, which checks the prices on its own model
STEP_MODELS = {False: (dict(hidden=192, n_heads=6, n_layers=3, batch=8, seq=64),
                       dict(hidden=192, n_heads=6, n_layers=3, batch=1, seq=64),
                       dict(hidden=384, n_heads=6, n_layers=2, batch=2, seq=64)),
               True: (dict(hidden=128, n_heads=4, n_layers=2, batch=4, seq=32),
                      dict(hidden=128, n_heads=4, n_layers=2, batch=1, seq=32))}
STEP_SCALE = (0.5, 2.0)   # a work scale outside: the host was busy while part of the calibration ran; say so


def _group_step_seconds(model, example, optimizer, repeats: int, device_type: str, what: str) -> float:
    """Seconds of one plain training step (forward, backward, AdamW, zero_grad) of the
    group: every rank steps at once and each step ends at a barrier, so it lasts until the
    slowest rank's end, as a synchronised step does (_timed).  Ranks that share cores fall
    apart within a step (4 ranks on 2 cores, a data-parallel step's ranks reached the
    gradient all-reduce 46-104 ms into it), so the group's step is longer than each
    rank's own."""
    def step():
        model(*example).backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device_type)
        dist.barrier()

    return _timed(step, device_type, repeats, what=what)


def fit_step(measured, work, ops, op_latency: float, bounds: tuple = (0.25, 4.0)) -> tuple:
    """(work scale s, seconds per op L) with measured_i ~ s work_i + L ops_i, least squares on
    relative error, s within `bounds` and L at least the tiny op's `op_latency` (a step of
    tiny models is mostly ops, which leaves s loose: the bounds keep it physical)."""
    m, w, n = (np.asarray(x, float) for x in (measured, work, ops))
    a, b = w / m, n / m   # 1 ~ s a + L b

    def error(sl):
        return float(np.sum((sl[0] * a + sl[1] * b - 1) ** 2))

    candidates = []
    if len(m) >= 2 and np.ptp(w / np.maximum(n, 1)) > 0:   # (one model, or one ratio: L is not determined)
        (s, per_op), *_ = np.linalg.lstsq(np.stack([a, b], 1), np.ones_like(m), rcond=None)
        candidates.append((float(s), float(per_op)))
        for s in bounds:   # s on a bound, L fitted
            candidates.append((s, float(np.sum((1 - s * a) * b) / np.sum(b * b))))
    # L at the tiny op's, s fitted within the bounds (always feasible)
    s = float(np.sum((1 - op_latency * b) * a) / np.sum(a * a))
    candidates.append((min(max(s, bounds[0]), bounds[1]), op_latency))
    feasible = [(s, per_op) for s, per_op in candidates
                if bounds[0] - 1e-12 <= s <= bounds[1] + 1e-12 and per_op >= op_latency * (1 - 1e-12)]
    return min(feasible, key=error)


def step_check(spec: DeviceSpec, device_type: str, repeats: int, quick: bool) -> tuple:
    """(work scale, seconds per op, rows): small GPTs' training steps (STEP_MODELS) run on
    every rank at once, without communication, against the steps rank 0 predicts for them
    on one device of `spec`, each prediction split into its work (flops and bytes at the
    measured rates) and its ops (op_latency each); fit_step finds how much slower the work
    runs in a model's step and what an op costs there.  The single-op rates miss what a
    step adds on a CPU host: distinct weights that do not stay in the caches as one
    repeated op's do, the allocator, and on ranks that oversubscribe the cores the way the
    scheduler slices a long step (4 ranks on 2 cores: GPT steps measured 1.09-1.54x their
    prediction, the smaller the step the further, a tiny op's 10 us against about 90 us per
    op of a model's step); and a calibration whose single-op runs met a busy moment reads
    slow rates (one 2-rank run: 37.5 GFLOP/s against 72-81 alone), which the step reads
    back as a scale below 1.  rows: (measured s, predicted s, work s, ops) per model.
    (1.0, op_latency, ()) on CUDA: its kernels are priced by shape (KernelEfficiency) and
    checked by benchmarks/gpu_check.py."""
    if device_type == "cuda":
        return 1.0, spec.op_latency, ()
    count = 3 if quick else max(6, repeats)
    measured, predicted = [], []
    without_ops = replace(spec, op_latency=0.0)
    for config in STEP_MODELS[quick]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model, example = build("gpt-tiny", **config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        measured.append(_group_step_seconds(model, example, optimizer, count, device_type,
                                            "quick" if quick else "compute"))
        got = [None]
        if dist.get_rank() == 0:
            try:
                whole, work = (plan(model, Mesh((1,), ("dp",), device=d), example, compare=False).predicted.step_s
                               for d in (spec, without_ops))
                got[0] = (whole, work, (whole - work) / max(spec.op_latency, 1e-12))
            except Exception as exc:   # a planner bug must not lose the measurements: say so, unscaled
                log.warning("calibrate: the step check could not plan its GPT %s (%s: %s); compute rates unscaled",
                            config, type(exc).__name__, exc)
        dist.broadcast_object_list(got, src=0)
        if got[0] is None:
            return 1.0, spec.op_latency, ()
        predicted.append(got[0])
    scale, per_op = fit_step(measured, [p[1] for p in predicted], [p[2] for p in predicted], spec.op_latency)
    if not STEP_SCALE[0] <= scale <= STEP_SCALE[1] and dist.get_rank() == 0:
        log.warning("calibrate: GPT training steps ran %.2fx the work the single-op rates predict: the host was busy "
                    "while part of the calibration ran; the rates are scaled to the steps, but measuring again on an "
                    "idle machine (--force) gives steadier numbers", scale)
    return scale, per_op, tuple((m, *p) for m, p in zip(measured, predicted))


def scaled_compute(spec: DeviceSpec, scale: float, op_latency: float | None = None) -> DeviceSpec:
    """`spec` with its compute work `scale` times slower (step_check): rates divided by it,
    seconds per element multiplied, the links untouched; op_latency (seconds per op):
    replaced where given.  Every compute price is work at these rates plus ops at
    op_latency, so a one-device step's prediction becomes scale x work + ops x op_latency."""
    return replace(spec, flops=tuple((k, v / scale) for k, v in spec.flops),
                   attention_flops=tuple((k, v / scale) for k, v in spec.attention_flops),
                   mem_bandwidth=spec.mem_bandwidth / scale,
                   op_latency=spec.op_latency if op_latency is None else op_latency,
                   optimizer=tuple(x * scale for x in spec.optimizer),
                   optimizer_fused=tuple(x * scale for x in spec.optimizer_fused),
                   pointwise=tuple((k, f * scale, b * scale) for k, f, b in spec.pointwise),
                   host_op=spec.host_op * scale, compute_scale=spec.compute_scale * scale)


# ------------------------------------------------------------------ the whole run

def measure_tiers(directory: str | None, per_node: int, nbytes: int, repeats: int, device_type: str) -> dict:
    """This device's share of the host's memory, and with `directory` of its disk: every
    rank writes its own file of `nbytes` there at once (synced to the disk) and reads it
    back after dropping it from the page cache, so each sees its share of the node's
    drives; the slowest rank's rates.  {"host_memory", and "disk_memory",
    "disk_read_bandwidth", "disk_write_bandwidth" with a directory}."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = {"host_memory": 0.9 * host / per_node}
    if directory is None:
        return out
    os.makedirs(directory, exist_ok=True)
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    back = torch.empty_like(data)
    path = os.path.join(directory, f"autopar-calibrate-{dist.get_rank()}.bin")
    writes, reads = [], []
    try:
        for _ in range(max(1, repeats)):
            dist.barrier()
            start = time.perf_counter()
            with open(path, "wb") as f:
                f.write(memoryview(data.numpy()))
                f.flush()
                os.fsync(f.fileno())
            writes.append(time.perf_counter() - start)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            dist.barrier()
            start = time.perf_counter()
            with open(path, "rb") as f:
                f.readinto(memoryview(back.numpy()))
            reads.append(time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.remove(path)
    if not torch.equal(data, back):
        raise RuntimeError(f"calibrate: {path} read back other bytes than were written; the disk is faulty")
    out["disk_write_bandwidth"] = nbytes / _slowest(float(np.median(writes)), device_type, None)
    out["disk_read_bandwidth"] = nbytes / _slowest(float(np.median(reads)), device_type, None)
    dist.barrier()   # every rank's file gone before the free space is read
    out["disk_memory"] = shutil.disk_usage(directory).free / per_node
    return out


def describe(shape, names, device_type: str) -> dict:
    """What identifies the cluster for the cache: ranks, hosts, device, software, mesh."""
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    name = torch.cuda.get_device_name() if device_type == "cuda" else platform.processor() or platform.machine()
    return {"world": dist.get_world_size(), "hosts": sorted(set(hosts)), "per_node": hosts.count(hosts[0]),
            "device": name, "backend": dist.get_backend(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "mesh": list(shape), "axes": list(names), "format": FORMAT}


def calibrate(shape=None, names=None, base: str | None = None, repeats: int = 5, force: bool = False,
              out: str | None = None, quick: bool = False, offload_dir: str | None = None) -> DeviceSpec:
    """Measure this cluster (every rank calls it) and return the fitted DeviceSpec; rank 0
    writes it to `out` (JSON: the device, the cluster description and every measured point).
    shape/names: the mesh to measure axis by axis (default: one axis over every rank).
    base: the preset whose unmeasured numbers are kept (default h100 on CUDA, cpu otherwise).
    quick: the two smallest sizes of everything and short timed runs (seconds, for tests;
    the numbers are rougher).  offload_dir: a directory on the disk the disk tier would
    use, whose write and read rates are timed (measure_tiers); without it the preset's
    disk numbers are kept.  Host memory is always this device's share of the host's."""
    device_type = _device_type()
    world = dist.get_world_size()
    shape = tuple(shape) if shape else (world,)
    names = tuple(names) if names else tuple(f"ax{i}" for i in range(len(shape)))
    if math.prod(shape) != world:
        raise ValueError(f"calibration mesh {shape} has {math.prod(shape)} devices but {world} ranks run; "
                         f"give --mesh sizes whose product is the world size")
    desc = describe(shape, names, device_type)
    desc["quick"] = quick
    desc["offload_dir"] = offload_dir
    key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    cached = os.path.join(cache_dir(), f"calibration-{key}.json")
    if not force and os.path.exists(cached):
        _progress(f"using the cached calibration {cached} (force=True, or --force on the command line, measures again)")
        spec = DeviceSpec.load(cached)
        if out and dist.get_rank() == 0:
            _write(out, spec, desc, json.load(open(cached)).get("points", {}))
        return spec
    start = time.perf_counter()
    _progress(f"{world} ranks on {len(desc['hosts'])} host(s), {desc['device']}, {desc['backend']}")
    compute = measure_compute(device_type, repeats, quick)
    preset = PRESETS[base or ("h100" if device_type == "cuda" else "cpu")]
    per_node = desc["per_node"]
    inside = Mesh.inside_node(shape, per_node)
    links, points = [], dict(compute["points"])
    if world > 1:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        measured: dict = {}
        for axis in range(len(shape)):
            if shape[axis] < 2:
                continue
            got = measure_axis(mesh, axis, device_type, repeats, MESSAGE[device_type][::4] if quick else None,
                               quick)
            points.update({f"{names[axis]}: {k}": v for k, v in got["points"].items()})
            for kind, line in got["links"].items():
                measured.setdefault((kind, "intra" if inside[axis] else "inter"), []).append(line)
        for (kind, where), lines in sorted(measured.items()):
            links.append((kind, where, *(float(np.mean(col)) for col in zip(*lines))))
    tiers = measure_tiers(offload_dir, desc["per_node"], (16 if quick else 256) * 2**20, 1 if quick else 3,
                          device_type)
    if offload_dir is not None:
        _progress(f"disk at {offload_dir}: write {tiers['disk_write_bandwidth'] / 1e9:.3g} GB/s, read "
                  f"{tiers['disk_read_bandwidth'] / 1e9:.3g} GB/s per device, {tiers['disk_memory'] / 2**30:.1f} GiB "
                  f"free per device")
    flops = dict(preset.flops)
    flops.update(compute["flops"])
    intra = next((x for x in links if x[:2] == ("all_reduce", "intra")), None)
    inter = next((x for x in links if x[:2] == ("all_reduce", "inter")), None)
    spec = replace(
        preset, name=f"{preset.name}-calibrated", flops=tuple(flops.items()),
        attention_flops=tuple(compute["attention"].items()), mem_bandwidth=compute["mem_bandwidth"], op_latency=compute["op_latency"], optimizer=compute["optimizer"],
        optimizer_fused=compute.get("optimizer_fused", ()),
        pointwise=compute["pointwise"],
        asynchronous=device_type == "cuda", devices_per_node=per_node, links=tuple(links),
        intra_bandwidth=intra[2] if intra else preset.intra_bandwidth,
        intra_latency=intra[3] if intra else preset.intra_latency,
        inter_bandwidth=inter[2] if inter else preset.inter_bandwidth,
        inter_latency=inter[3] if inter else preset.inter_latency,
        launch_latency=(intra or inter)[4] if (intra or inter) else preset.launch_latency,
        memory=float(torch.cuda.get_device_properties(0).total_memory) if device_type == "cuda" else preset.memory,
        **tiers,
        source=f"autopar calibrate, {time.strftime('%Y-%m-%d')}: {desc['world']} x {desc['device']} "
               f"({desc['backend']}), mesh {'x'.join(map(str, shape))}")
    shared = [spec]   # every rank plans with rank 0's numbers (its own timings differ a little)
    dist.broadcast_object_list(shared, src=0)
    spec = shared[0]
    scale, per_op, rows = step_check(spec, device_type, repeats, quick)
    if rows:
        tiny = spec.op_latency
        spec = scaled_compute(spec, scale, per_op)
        spec = replace(spec, source=f"{spec.source}; work x{scale:.3f}, {per_op * 1e6:.0f} us per op from GPT steps")
        points["step check (measured s, predicted s, work s, ops)"] = [list(r) for r in rows]
        _progress("step check: GPT steps " + ", ".join(f"{m * 1e3:.1f} ms measured / {p * 1e3:.1f} predicted"
                                                       for m, p, *_ in rows) +
                  f"; work x{scale:.3f}, {per_op * 1e6:.1f} us per op (a tiny op: {tiny * 1e6:.1f})")
    _progress(f"done in {time.perf_counter() - start:.1f} s")
    if dist.get_rank() == 0:
        os.makedirs(cache_dir(), exist_ok=True)
        _write(cached, spec, desc, points)
        if out:
            _write(out, spec, desc, points)
    dist.barrier()
    return spec


def _write(path: str, spec: DeviceSpec, desc: dict, points: dict) -> None:
    with open(path, "w") as f:
        json.dump({"device": spec.to_dict(), "cluster": desc, "points": points}, f, indent=1)
