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


REPLICATE, PARTIAL = -1, -2  # layout codes: Shard(d) is d (see layout_code)
_KIND_OF_TYPE: dict = {}


def placement_code(p) -> int:
    """Shard(d) -> d, Replicate() -> -1, Partial() -> -2: all the cost model reads of a
    placement (a strided shard costs what a plain one does).  isinstance on torch's
    placement classes is slow, so the answer is kept per placement type."""
    kind = _KIND_OF_TYPE.get(type(p))
    if kind is None:
        kind = ("shard" if isinstance(p, Shard) else "partial" if isinstance(p, Partial)
                else "replicate" if isinstance(p, Replicate) else None)
        if kind is None:
            raise ValueError(f"unsupported placement {p!r}: use Shard(d), Replicate() or Partial()")
        _KIND_OF_TYPE[type(p)] = kind
    return p.dim if kind == "shard" else PARTIAL if kind == "partial" else REPLICATE


def layout_code(placements) -> tuple:
    """One placement code per mesh axis: a small, fast-hashing key for cost tables."""
    return tuple(placement_code(p) for p in placements)


def redistribute(shape, itemsize: int, src, dst, mesh: Mesh) -> tuple[CommStep, ...]:
    """The collectives that turn a tensor of global `shape` from placements `src` into `dst`.

    Partial -> Replicate: reduce-scatter then all-gather (an all-reduce, reported as one);
    Partial -> Shard: reduce-scatter; Shard -> Replicate: all-gather; Shard(i) -> Shard(j):
    all-to-all; Replicate -> Shard or Partial, Shard -> Partial: local, free.
    """
    return redistribute_codes(shape, itemsize, layout_code(src), layout_code(dst), mesh)


def redistribute_codes(shape, itemsize: int, src: tuple, dst: tuple, mesh: Mesh) -> tuple[CommStep, ...]:
    """`redistribute` on layout codes (`layout_code`)."""
    if src == dst:
        return ()
    whole = (math.prod(shape) if shape else 1) * itemsize
    launch = mesh.device.launch_latency
    steps = []
    for kind, a, share, reduce_share in route(src, dst, mesh):
        nbytes = whole * share
        if kind == "all_reduce":
            t = (collective_time("reduce_scatter", whole * reduce_share, a, mesh)
                 + collective_time("all_gather", nbytes, a, mesh) - launch)
        else:
            t = collective_time(kind, nbytes, a, mesh)
        steps.append(CommStep(kind, a, nbytes, t))
    return tuple(steps)


def route(src: tuple, dst: tuple, mesh: Mesh) -> tuple:
    """The steps of a redistribution between layout codes, without sizes: (kind, axis,
    share, reduce_share), share being the fraction of the whole tensor a rank holds when the
    step runs (an all-reduce's all-gather half; reduce_share: its reduce-scatter half)."""
    cur = list(src)
    steps = []

    def share_now():
        share = 1.0
        for c, n in zip(cur, mesh.shape):
            if c >= 0:
                share /= n
        return share

    # 1. free local steps: slicing a replicated tensor shrinks it; a replicated or sharded
    #    tensor is already a valid Partial one (zeros elsewhere) for sums
    for a, (s, d) in enumerate(zip(src, dst)):
        if (s == REPLICATE and d != REPLICATE) or (s >= 0 and d == PARTIAL):
            cur[a] = d
    # 2. reductions: reduce-scatter (the all-reduce's second half is an all-gather in step 4)
    pending_gather = {}
    fast_first = sorted(range(len(src)), key=lambda a: -mesh.bandwidth[a])
    for a in fast_first:
        s, d = src[a], dst[a]
        if s == PARTIAL and d != PARTIAL:
            if d == REPLICATE:
                pending_gather[a] = share_now()
                cur[a] = 0  # stands for "scattered": any dim, only the size matters
            else:
                steps.append(("reduce_scatter", a, share_now(), 0.0))
                cur[a] = d
    # 3. all-to-all between shard dims
    for a, (s, d) in enumerate(zip(src, dst)):
        if s >= 0 and d >= 0 and s != d:
            steps.append(("all_to_all", a, share_now(), 0.0))
            cur[a] = d
    # 4. gathers grow the tensor last
    for a in reversed(fast_first):
        s, d = src[a], dst[a]
        if (s >= 0 and d < 0) or a in pending_gather:
            cur[a] = REPLICATE if a in pending_gather else d
            if a in pending_gather:
                steps.append(("all_reduce", a, share_now(), pending_gather[a]))
            else:
                steps.append(("all_gather", a, share_now(), 0.0))
    return tuple(steps)


def redistribute_price(src: tuple, dst: tuple, mesh: Mesh) -> tuple[float, float, float, float]:
    """`redistribute_codes` as a straight line in the tensor's bytes B > 0: seconds =
    fixed + per_byte * B, and the same two numbers for its all-gathers alone (the ones a
    parameter repeats in backward).  Lets a whole table of layout pairs be priced once and
    scaled to every tensor size."""
    launch = mesh.device.launch_latency
    fixed = per_byte = gather_fixed = gather_per_byte = 0.0
    for kind, a, share, reduce_share in (route(src, dst, mesh) if src != dst else ()):
        n = mesh.shape[a]
        if n == 1:  # collective_time is 0 on a size-1 axis (an all-reduce keeps its -launch)
            fixed -= launch if kind == "all_reduce" else 0.0
            continue
        bw, lat, frac = mesh.bandwidth[a], mesh.latency[a], (n - 1) / n
        if kind == "all_reduce":  # a reduce-scatter and an all-gather in one call
            fixed += launch + 2 * (n - 1) * lat
            per_byte += frac * (reduce_share + share) / bw
        else:
            fixed += launch + (n - 1) * lat
            per_byte += frac * share / bw
            if kind == "all_gather":
                gather_fixed += launch + (n - 1) * lat
                gather_per_byte += frac * share / bw
    return fixed, per_byte, gather_fixed, gather_per_byte


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
