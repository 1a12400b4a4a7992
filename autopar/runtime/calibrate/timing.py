"""Timed runs for calibration (runtime/calibrate/fit.py): every rank of a group runs the call at
once, long enough to share the cores as training does, and the slowest rank's median is
the time; the line fits every measurement is read through; calibration's progress lines.
"""
from __future__ import annotations

import logging
import math
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("autopar")

# each timed run repeats the call until it lasts this long: compute runs long enough for
# ranks that share cores to share them as in training (a scheduler's slices are ms long)
MIN_SECONDS = {"compute": 0.15, "comm": 0.02, "quick": 0.002}


def progress(text: str) -> None:
    if dist.get_rank() == 0:
        log.info("calibrate: %s", text)


def synchronize(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def slowest(value: float, device_type: str, group) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if device_type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def timed(fn, device_type: str, repeats: int, group=None, what: str = "comm") -> float:
    """Seconds of one fn(): the median over `repeats` timed runs after warm-up, every rank
    of `group` starting together, each run repeating fn() until it lasts MIN_SECONDS (so
    that ranks sharing cores all run at once, as in training, rather than taking turns
    through a short call); the slowest rank's median (a step waits for the slowest).
    what: "compute" or "comm" (MIN_SECONDS)."""
    fn()
    synchronize(device_type)
    start = time.perf_counter()
    fn()
    synchronize(device_type)
    once = slowest(time.perf_counter() - start, device_type, group)
    inner = max(1, min(10000, math.ceil(MIN_SECONDS[what] / max(once, 1e-7))))
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        synchronize(device_type)
        times.append((time.perf_counter() - start) / inner)
    return slowest(statistics.median(times), device_type, group)


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
