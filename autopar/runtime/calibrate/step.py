"""Calibration's step check (runtime/calibrate/fit.py): small GPTs' training steps on every rank
at once against the steps predicted from the single-op rates, fitted as a scale on the
work and a cost per op, and the device description scaled by them.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from autopar.mesh import DeviceSpec, Mesh
from autopar.models import build
from autopar.solve.planner import SolveOptions, plan

from autopar.runtime.calibrate.timing import synchronize, timed

QUICK = SolveOptions(compare=False)   # the step check's plans: no comparison table

log = logging.getLogger("autopar")

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
    slowest rank's end, as a synchronised step does (timed).  Ranks that share cores fall
    apart within a step (4 ranks on 2 cores, a data-parallel step's ranks reached the
    gradient all-reduce 46-104 ms into it), so the group's step is longer than each
    rank's own."""
    def step():
        model(*example).backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize(device_type)
        dist.barrier()

    return timed(step, device_type, repeats, what=what)


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
                whole, work = (plan(model, Mesh((1,), ("dp",), device=d), example, solve=QUICK).predicted.step_s
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
