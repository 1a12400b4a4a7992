"""Calibration's link measurements (runtime/calibrate/fit.py): per mesh axis, every collective
kind and a send between neighbours over a range of sizes, run by the runtime's own
collective code, each call timed as a step pays it (after a stretch of compute on CPU
ranks), fitted as launch, per-step latency and bandwidth of the ring formula.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost.collectives import KINDS
from autopar.passes.redistribute import all_gather_dim, all_to_all_dims, reduce_scatter_rows

from autopar.runtime.calibrate.timing import fit_line, progress, timed

MESSAGE = {"cpu": (2**12, 2**15, 2**18, 2**20, 2**22, 2**24), "cuda": (2**16, 2**20, 2**23, 2**26, 2**28)}
STEP_SEGMENT_S = 0.004   # the compute a CPU step runs between two collectives (step_chain)


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
    one = timed(lambda: torch.mm(x, w), device_type, repeats, group, what)
    reps = max(1, round(STEP_SEGMENT_S / max(one, 1e-7)))

    def chain():
        for _ in range(reps):
            torch.mm(x, w)

    return chain, timed(chain, device_type, repeats, group, what)


def in_step(fn, chain, device_type: str, repeats: int, group, quick: bool = False) -> float:
    """Seconds of one collective call fn() as a step pays it: back to back where `chain` is
    None (CUDA), else after the compute chain of step_chain, less the chain, and at least
    what it takes back to back (a small call's difference is within the chain's own
    noise, and a call never costs less than with everything warm)."""
    back_to_back = timed(fn, device_type, repeats, group, "quick" if quick else "comm")
    if chain is None:
        return back_to_back
    run, seconds = chain
    both = timed(lambda: (run(), fn()), device_type, repeats, group, "quick" if quick else "compute")
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
        progress(f"axis {mesh.mesh_dim_names[axis]} (n={n}) {kind}: {bandwidth / 1e9:.2f} GB/s, "
                  f"{latency * 1e6:.1f} us per step, {launch * 1e6:.1f} us per call")
    shared = [out]   # every rank plans with rank 0's fit (an odd rank out measured no pair)
    dist.broadcast_object_list(shared, src=0)
    return {"links": shared[0], "points": points}
