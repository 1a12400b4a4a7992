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
(~/.cache/autopar by default); `force=True` measures again.  The measurements live beside
this module: runtime/calibrate/compute.py, links.py and step.py, all timed by timing.py;
this one runs them and fits the DeviceSpec.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import socket
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.mesh import PRESETS, DeviceSpec, Mesh

from autopar.runtime.calibrate.compute import measure_compute
from autopar.runtime.calibrate.links import MESSAGE, measure_axis
from autopar.runtime.calibrate.step import scaled_compute, step_check
from autopar.runtime.calibrate.timing import progress, slowest

FORMAT = 4   # 2: CPU collectives timed after compute (step_chain), pointwise ops measured; 3: fused AdamW measured;
# 4: compute rates scaled to a model step (step_check)


def cache_dir() -> str:
    return os.environ.get("AUTOPAR_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "autopar"))



def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"


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
    out["disk_write_bandwidth"] = nbytes / slowest(float(np.median(writes)), device_type, None)
    out["disk_read_bandwidth"] = nbytes / slowest(float(np.median(reads)), device_type, None)
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
        progress(f"using the cached calibration {cached} (force=True, or --force on the command line, measures again)")
        spec = DeviceSpec.load(cached)
        if out and dist.get_rank() == 0:
            _write(out, spec, desc, json.load(open(cached)).get("points", {}))
        return spec
    start = time.perf_counter()
    progress(f"{world} ranks on {len(desc['hosts'])} host(s), {desc['device']}, {desc['backend']}")
    compute = measure_compute(device_type, repeats, quick)
    preset = PRESETS[base or ("h100" if device_type == "cuda" else "cpu")]
    points = dict(compute["points"])
    links = _measure_links(shape, names, desc["per_node"], device_type, repeats, quick, points)
    tiers = measure_tiers(offload_dir, desc["per_node"], (16 if quick else 256) * 2**20, 1 if quick else 3,
                          device_type)
    if offload_dir is not None:
        progress(f"disk at {offload_dir}: write {tiers['disk_write_bandwidth'] / 1e9:.3g} GB/s, read "
                 f"{tiers['disk_read_bandwidth'] / 1e9:.3g} GB/s per device, {tiers['disk_memory'] / 2**30:.1f} GiB "
                 f"free per device")
    spec = _fitted(preset, compute, links, tiers, desc, shape, device_type)
    shared = [spec]   # every rank plans with rank 0's numbers (its own timings differ a little)
    dist.broadcast_object_list(shared, src=0)
    spec = _step_checked(shared[0], device_type, repeats, quick, points)
    progress(f"done in {time.perf_counter() - start:.1f} s")
    if dist.get_rank() == 0:
        os.makedirs(cache_dir(), exist_ok=True)
        _write(cached, spec, desc, points)
        if out:
            _write(out, spec, desc, points)
    dist.barrier()
    return spec


def _measure_links(shape, names, per_node: int, device_type: str, repeats: int, quick: bool, points: dict) -> list:
    """(kind, "intra" or "inter", bandwidth, latency, launch) per collective kind and link
    class, measured axis by axis (measure_axis; several axes of one class: their mean); the
    measured points added to `points`.  Empty on one rank."""
    links: list = []
    if math.prod(shape) < 2:
        return links
    inside = Mesh.inside_node(shape, per_node)
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
    return links


def _fitted(preset: DeviceSpec, compute: dict, links: list, tiers: dict, desc: dict, shape,
            device_type: str) -> DeviceSpec:
    """`preset` with what was measured: compute rates (measure_compute), links (their
    all-reduce lines also as the intra- and inter-node bandwidth and latency), the memory
    tiers (measure_tiers) and the device's memory on CUDA."""
    flops = dict(preset.flops)
    flops.update(compute["flops"])
    intra = next((x for x in links if x[:2] == ("all_reduce", "intra")), None)
    inter = next((x for x in links if x[:2] == ("all_reduce", "inter")), None)
    return replace(
        preset, name=f"{preset.name}-calibrated", flops=tuple(flops.items()),
        attention_flops=tuple(compute["attention"].items()), mem_bandwidth=compute["mem_bandwidth"], op_latency=compute["op_latency"], optimizer=compute["optimizer"],
        optimizer_fused=compute.get("optimizer_fused", ()),
        pointwise=compute["pointwise"],
        asynchronous=device_type == "cuda", devices_per_node=desc["per_node"], links=tuple(links),
        intra_bandwidth=intra[2] if intra else preset.intra_bandwidth,
        intra_latency=intra[3] if intra else preset.intra_latency,
        inter_bandwidth=inter[2] if inter else preset.inter_bandwidth,
        inter_latency=inter[3] if inter else preset.inter_latency,
        launch_latency=(intra or inter)[4] if (intra or inter) else preset.launch_latency,
        memory=float(torch.cuda.get_device_properties(0).total_memory) if device_type == "cuda" else preset.memory,
        **tiers,
        source=f"autopar calibrate, {time.strftime('%Y-%m-%d')}: {desc['world']} x {desc['device']} "
               f"({desc['backend']}), mesh {'x'.join(map(str, shape))}")


def _step_checked(spec: DeviceSpec, device_type: str, repeats: int, quick: bool, points: dict) -> DeviceSpec:
    """`spec` scaled to small GPTs' steps (step.step_check; unchanged on CUDA), the
    step check's rows added to `points`."""
    scale, per_op, rows = step_check(spec, device_type, repeats, quick)
    if not rows:
        return spec
    tiny = spec.op_latency
    spec = scaled_compute(spec, scale, per_op)
    spec = replace(spec, source=f"{spec.source}; work x{scale:.3f}, {per_op * 1e6:.0f} us per op from GPT steps")
    points["step check (measured s, predicted s, work s, ops)"] = [list(r) for r in rows]
    progress("step check: GPT steps " + ", ".join(f"{m * 1e3:.1f} ms measured / {p * 1e3:.1f} predicted"
                                                  for m, p, *_ in rows) +
             f"; work x{scale:.3f}, {per_op * 1e6:.1f} us per op (a tiny op: {tiny * 1e6:.1f})")
    return spec


def _write(path: str, spec: DeviceSpec, desc: dict, points: dict) -> None:
    with open(path, "w") as f:
        json.dump({"device": spec.to_dict(), "cluster": desc, "points": points}, f, indent=1)
