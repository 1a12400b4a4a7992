"""The cost model: compute as a roofline, communication as alpha-beta per mesh axis, memory.

All times are seconds per training step on one device; all sizes are bytes per device.

Collectives on an axis of n ranks with bandwidth B (bytes/s, one direction) and latency a:

    all-gather      L + (n-1) a + (n-1)/n * out_bytes / B
    reduce-scatter  L + (n-1) a + (n-1)/n * in_bytes / B
    all-reduce      L + 2(n-1) a + 2(n-1)/n * bytes / B   (ring: a reduce-scatter and an all-gather in one call)
    all-to-all      L + (n-1) a + (n-1)/n * bytes / B

L is the fixed cost of one collective call (launch and synchronisation).

A redistribution over several axes runs axis by axis, shrinking steps (local slices,
reduce-scatters) before growing ones (all-gathers), so an all-reduce over two axes costs
what a hierarchical all-reduce costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .mesh import Mesh

def state_bytes(param_itemsize: int, mixed_precision: bool) -> float:
    """Optimizer bytes per trainable parameter element (Adam): two moments in the
    parameter's dtype; under mixed precision float32 moments and a float32 master copy
    (the 12 bytes of the ZeRO paper)."""
    return 12.0 if mixed_precision else 2.0 * param_itemsize


@dataclass(frozen=True)
class CommStep:
    """One collective: kind on mesh axis `axis` moving `nbytes` (the local tensor it acts on)."""

    kind: str
    axis: int
    nbytes: float
    seconds: float


def collective_time(kind: str, nbytes: float, axis: int, mesh: Mesh) -> float:
    n = mesh.shape[axis]
    if n == 1 or nbytes == 0:
        return 0.0
    bw, lat, launch = mesh.bandwidth[axis], mesh.latency[axis], mesh.device.launch_latency
    frac = (n - 1) / n
    if kind == "all_reduce":
        return launch + 2 * (n - 1) * lat + 2 * frac * nbytes / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return launch + (n - 1) * lat + frac * nbytes / bw
    raise ValueError(f"unknown collective {kind!r}")


def local_numel(shape, placements, mesh_shape) -> float:
    numel = math.prod(shape) if shape else 1
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            numel /= n
    return numel


def redistribute(shape, itemsize: int, src, dst, mesh: Mesh) -> tuple[CommStep, ...]:
    """The collectives that turn a tensor of global `shape` from placements `src` into `dst`.

    Partial -> Replicate: reduce-scatter then all-gather (an all-reduce, reported as one);
    Partial -> Shard: reduce-scatter; Shard -> Replicate: all-gather; Shard(i) -> Shard(j):
    all-to-all; Replicate -> Shard or Partial, Shard -> Partial: local, free.
    """
    if src == dst:
        return ()
    cur = list(src)
    steps: list[CommStep] = []

    def bytes_now():
        return local_numel(shape, cur, mesh.shape) * itemsize

    # 1. free local steps: slicing a replicated tensor shrinks it; a replicated or sharded
    #    tensor is already a valid Partial one (zeros elsewhere) for sums
    for a, (s, d) in enumerate(zip(src, dst)):
        if (isinstance(s, Replicate) and not isinstance(d, Replicate)) or (
                isinstance(s, Shard) and isinstance(d, Partial)):
            cur[a] = d
    # 2. reductions: reduce-scatter (the all-reduce's second half is an all-gather in step 4)
    pending_gather = []
    fast_first = sorted(range(len(src)), key=lambda a: -mesh.bandwidth[a])
    for a in fast_first:
        s, d = src[a], dst[a]
        if isinstance(s, Partial) and not isinstance(d, Partial):
            nbytes = bytes_now()
            if isinstance(d, Replicate):
                pending_gather.append((a, nbytes))
                cur[a] = Shard(0)  # stands for "scattered": any dim, only the size matters
            else:
                steps.append(CommStep("reduce_scatter", a, nbytes, collective_time("reduce_scatter", nbytes, a, mesh)))
                cur[a] = d
    # 3. all-to-all between shard dims
    for a, (s, d) in enumerate(zip(src, dst)):
        if isinstance(s, Shard) and isinstance(d, Shard) and s.dim != d.dim:
            nbytes = bytes_now()
            steps.append(CommStep("all_to_all", a, nbytes, collective_time("all_to_all", nbytes, a, mesh)))
            cur[a] = d
    # 4. gathers grow the tensor last
    reduce_axes = {a for a, _ in pending_gather}
    for a in reversed(fast_first):
        s, d = src[a], dst[a]
        if (isinstance(s, Shard) and not isinstance(d, Shard)) or a in reduce_axes:
            cur[a] = Replicate() if a in reduce_axes else d
            nbytes = bytes_now()
            if a in reduce_axes:
                rs_bytes = dict(pending_gather)[a]
                t = (collective_time("reduce_scatter", rs_bytes, a, mesh)
                     + collective_time("all_gather", nbytes, a, mesh) - mesh.device.launch_latency)
                steps.append(CommStep("all_reduce", a, nbytes, t))
            else:
                steps.append(CommStep("all_gather", a, nbytes, collective_time("all_gather", nbytes, a, mesh)))
    return tuple(steps)


def grad_target(placement):
    """The placement a tensor's gradient must reach: Shard stays Shard, Partial's is Replicate."""
    return Replicate() if isinstance(placement, Partial) else placement


def roofline(flops: float, nbytes: float, dtype: torch.dtype, mesh: Mesh) -> float:
    dev = mesh.device
    return max(flops / dev.peak_flops(dtype), nbytes / dev.mem_bandwidth)


@dataclass(frozen=True)
class OpWork:
    """Global FLOPs of one node, forward and backward, measured once on meta tensors."""

    fwd_flops: float
    bwd_flops: float


def measure_flops(node, needs_grad=None) -> OpWork:
    """Run the node's op on meta tensors of its global shapes under the FLOP counter.

    needs_grad: per tensor operand (in `tensor_args` order), whether its gradient is wanted;
    backward FLOPs count only those (a first layer computes no gradient of its input)."""
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils import _pytree as pytree
    import torch.fx as fx

    if not isinstance(node.target, torch._ops.OpOverload):
        return OpWork(0.0, 0.0)
    wants_grad = []
    needs = iter(needs_grad) if needs_grad is not None else None

    def meta(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                t = torch.empty(v.shape, dtype=v.dtype, device="meta")
                wanted = next(needs, True) if needs is not None else True
                if v.dtype.is_floating_point and wanted:
                    t.requires_grad_(True)
                    wants_grad.append(t)
                return t
            return v
        return a

    args, kwargs = pytree.tree_map(meta, (node.args, node.kwargs))
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            out = node.target(*args, **kwargs)
        fwd = counter.get_total_flops()
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        bwd = 0
        if outs and wants_grad:
            counter = FlopCounterMode(display=False)
            with counter:
                torch.autograd.grad(outs, wants_grad, [torch.empty_like(o) for o in outs], allow_unused=True)
            bwd = counter.get_total_flops()
    except Exception:  # an op the meta backend cannot run: count no FLOPs, bytes still count
        return OpWork(0.0, 0.0)
    return OpWork(float(fwd), float(bwd))
