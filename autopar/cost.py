"""The cost model: compute as a roofline, communication as alpha-beta per mesh axis, memory.

All times are seconds per training step on one device; all sizes are bytes per device.

Collectives on an axis of n ranks with bandwidth B (bytes/s, one direction) and latency a,
under the ring:

    all-gather      L + (n-1) a + (n-1)/n * out_bytes / B
    reduce-scatter  L + (n-1) a + (n-1)/n * in_bytes / B
    all-reduce      L + 2(n-1) a + 2(n-1)/n * bytes / B   (a reduce-scatter and an all-gather in one call)
    all-to-all      L + (n-1) a + (n-1)/n * bytes / B

L is the fixed cost of one collective call (launch and synchronisation).  Where the
device's library runs other algorithms too (DeviceSpec.algorithms: NCCL's double binary
tree), each call is priced at the cheapest (autopar.collectives: the tree's logarithmic
latency wins on small all-reduces and on many ranks).

A redistribution costs exactly the steps the runtime runs: `autopar.redistribution`
plans them (axis by axis, shrinking steps before growing ones, an all-to-all where a shard
moves to another dim on one axis) and this module prices each collective among them on the
bytes a rank holds when it runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from . import collectives
from .mesh import Mesh
from .redistribution import COLLECTIVES, layout_code, plan_rows


def state_bytes(param_itemsize: int, mixed_precision: bool) -> float:
    """Optimizer bytes per trainable parameter element (Adam): two moments in the
    parameter's dtype; under mixed precision float32 moments and a float32 master copy
    (the 12 bytes of the ZeRO paper)."""
    return 12.0 if mixed_precision else 2.0 * param_itemsize


@dataclass(frozen=True)
class CommStep:
    """One collective of a redistribution: kind on mesh axis `axis`; nbytes: the bytes its
    formula in `collective_time` reads (an all-gather's output, any other's input)."""

    kind: str
    axis: int
    nbytes: float
    seconds: float
    algorithm: str = "ring"


def collective_choice(kind: str, nbytes: float, axis: int, mesh: Mesh) -> tuple:
    """(algorithm, seconds) of one collective call on mesh axis `axis`: the cheapest of the
    device's algorithms (autopar.collectives)."""
    return collectives.choose(kind, nbytes, mesh.shape[axis], mesh.bandwidth[axis], mesh.latency[axis],
                              mesh.device.launch_latency, mesh.device.algorithms)


def collective_time(kind: str, nbytes: float, axis: int, mesh: Mesh) -> float:
    return collective_choice(kind, nbytes, axis, mesh)[1]


def local_numel(shape, placements, mesh_shape) -> float:
    numel = math.prod(shape) if shape else 1
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            numel /= n
    return numel


def redistribute(shape, itemsize: int, src, dst, mesh: Mesh) -> tuple[CommStep, ...]:
    """The collectives that turn a tensor of global `shape` from placements `src` into `dst`,
    in the order they run (`autopar.redistribution`; its local steps are free).  An
    all-reduce over several axes is one call, listed per axis (`_price_rows`)."""
    return redistribute_codes(shape, itemsize, layout_code(src), layout_code(dst), mesh)


def redistribute_codes(shape, itemsize: int, src: tuple, dst: tuple, mesh: Mesh) -> tuple[CommStep, ...]:
    """`redistribute` on layout codes (`layout_code`)."""
    if src == dst:
        return ()
    whole = (math.prod(shape) if shape else 1) * itemsize
    priced = [_price_rows(src, dst, mesh, alg) for alg in mesh.device.algorithms]
    k = min(range(len(priced)), key=lambda i: sum(f + b * whole for _, _, _, f, b in priced[i]))
    return tuple(CommStep(kind, a, whole * share, fixed + per_byte * whole, mesh.device.algorithms[k])
                 for kind, a, share, fixed, per_byte in priced[k])


def redistribute_price(src: tuple, dst: tuple, mesh: Mesh) -> np.ndarray:
    """`redistribute_codes` as straight lines in the tensor's bytes B > 0, one per collective
    algorithm of the device: [4, algorithms] of seconds = fixed + per_byte * B, and the same
    two numbers for its all-gathers alone (the ones a parameter repeats in backward).  Lets
    a whole table of layout pairs be priced once and scaled to every tensor size, where the
    cheapest algorithm is taken."""
    algorithms = mesh.device.algorithms
    out = np.zeros((4, len(algorithms)))
    if src == dst:
        return out
    for j, alg in enumerate(algorithms):
        for kind, _, _, f, b in _price_rows(src, dst, mesh, alg):
            out[0, j] += f
            out[1, j] += b
            if kind == "all_gather":
                out[2, j] += f
                out[3, j] += b
    return out


def _price_rows(src: tuple, dst: tuple, mesh: Mesh, algorithm: str = "ring") -> list:
    """(kind, axis, share, fixed s, s per byte of the whole tensor) per collective of the
    planned steps under `algorithm`, share being the fraction of the whole tensor
    `collective_time` reads (an all-gather's output, any other's input).

    An all-reduce over several axes is one call, priced as a hierarchical one and listed
    per axis, fastest axis first: that axis reduce-scatters and all-gathers the whole
    local tensor, the next one all-reduces the 1/n left, and so on; one launch in all."""
    launch = mesh.device.launch_latency
    rows = []
    for kind, a, _, _, share, span in plan_rows(src, dst, mesh.shape):
        if kind not in COLLECTIVES:
            continue
        if kind == "all_reduce":
            levels = sorted((a,) + span, key=lambda x: -mesh.bandwidth[x]) if span else (a,)
            first = launch
            for x in levels:
                f, b = collectives.line(kind, algorithm, mesh.shape[x], mesh.bandwidth[x], mesh.latency[x], first)
                rows.append((kind, x, share, f, b * share))
                share, first = share / mesh.shape[x], 0.0
            continue
        n = mesh.shape[a]  # > 1: the planner gives axes of size 1 no step
        if kind == "all_gather":
            share *= n
        f, b = collectives.line(kind, algorithm, n, mesh.bandwidth[a], mesh.latency[a], launch)
        rows.append((kind, a, share, f, b * share))
    return rows


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
