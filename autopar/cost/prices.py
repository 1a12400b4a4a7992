"""The cost model's prices: compute (a roofline on CPU ranks; GPU kernels by shape in
autopar.cost.kernels), collectives, redistributions and FLOP counts.

All times are seconds per training step on one device; all sizes are bytes per device.

Collectives are priced per call on a mesh's axes (ring, tree, NCCL's algorithms and
protocols) in autopar.cost.collective_prices.

A redistribution costs exactly the steps the runtime runs: `autopar.cost.redistribution`
plans them (axis by axis, shrinking steps before growing ones, an all-to-all where a shard
moves to another dim on one axis) and this module prices each collective among them on the
bytes a rank holds when it runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx as fx

from autopar.cost import collectives
from autopar.cost import kernels as K
from autopar.cost.collective_prices import collective_choice, price_columns
from autopar.mesh import Mesh
from autopar.cost.redistribution import layout_code, plan_rows


def state_bytes(param_itemsize: int, mixed_precision: bool) -> float:
    """Optimizer bytes per trainable parameter element (Adam): two moments in the
    parameter's dtype; under mixed precision float32 moments and a float32 master copy
    (the 12 bytes of the ZeRO paper)."""
    return 12.0 if mixed_precision else 2.0 * param_itemsize


def offloaded_bytes(param_itemsize: int, mixed_precision: bool) -> float:
    """Bytes per trainable element an offloaded parameter keeps off the device: its
    optimizer state and a float32 master copy (under mixed precision the master is part
    of state_bytes; without it the host keeps its own copy of the weights to step)."""
    return state_bytes(param_itemsize, mixed_precision) + (0 if mixed_precision else param_itemsize)


def offload_seconds(tier: str, owned: int, param_itemsize: int, mixed_precision: bool, device,
                    weights: bool = False, uses: int = 2) -> float:
    """One optimizer step of `owned` elements whose states live in `tier` ("host" or
    "disk"): the gradient down and the updated weights up the host link, the host's
    optimizer over them (device.host_optimizer_rate, plus one per-tensor overhead where
    calibrated), and on disk the states read before and written after the step
    (offloaded_bytes over the disk's read and write rates).  The runtime reads the next
    run of parameters while the host steps this one; the price adds the two (it does not
    count that overlap, at most the smaller of the two).

    weights: the stored shard lives in the tier too (ZeRO-Infinity's parameter offload):
    instead of coming up once after the step it crosses the host link at each of its
    `uses` (forward's gather, and backward's where gathered weights are dropped after
    forward), and on disk it is also read at each use and written once after the step.
    The runtime copies it when the gather runs, not ahead, so nothing of it is hidden."""
    per_param = device.optimizer[0] if device.optimizer else 0.0   # the host loops over parameters too
    shard = owned * param_itemsize
    crossings = 1 + (uses if weights else 1)
    seconds = crossings * shard / device.host_bandwidth + owned / device.host_optimizer_rate + per_param
    if tier == "disk":
        held = owned * offloaded_bytes(param_itemsize, mixed_precision)
        seconds += held / device.disk_read_bandwidth + held / device.disk_write_bandwidth
        if weights:
            seconds += uses * shard / device.disk_read_bandwidth + shard / device.disk_write_bandwidth
    return seconds


def routing_imbalance(rows: int, ranks: int) -> float:
    """The busiest rank's share of a mixture-of-experts op's routed rows over the mean share,
    expected when `rows` (tokens x k) pick experts uniformly at random and `ranks` ranks
    hold equal shares of the experts: the maximum load of m balls in n bins, m/n +
    sqrt(2 (m/n) ln n) for m >> n ln n (Raab and Steger 1998), over m/n.  A dropless op
    runs as long as its busiest rank; a trained router is less even than random, which
    `autopar.Pricing(moe_imbalance=...)` states."""
    if ranks <= 1 or rows <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * ranks * math.log(ranks) / rows)


# The runtime steps an elementwise optimizer over runs of at most this many bytes of updated
# tensors (autopar/runtime/state/sharded_optimizer.ShardedOptimizer.step), so the step's
# temporaries take one run's size: 1 GiB of float32 masters under mixed precision makes
# 2 GiB of temporaries, against 11 GB for a 1.4 B-parameter model stepped at once.
STEP_CHUNK_BYTES = 1 << 30


def step_temporary_total(per_param, mixed_precision: bool, foreach: bool) -> float:
    """The optimizer step's temporaries at their largest: each parameter's
    (step_temporary_bytes x its stepped elements, `per_param`) add up within one run of at
    most STEP_CHUNK_BYTES of updated tensors, or one larger tensor alone."""
    per_param = list(per_param)
    if not per_param:
        return 0.0
    cap = STEP_CHUNK_BYTES * step_temporary_bytes(4, mixed_precision, foreach) / 4
    return min(sum(per_param), max(cap, max(per_param)))


def step_temporary_bytes(param_itemsize: int, mixed_precision: bool, foreach: bool) -> float:
    """Bytes per stepped parameter element the optimizer step allocates while it runs, on top
    of the states: under mixed precision each gradient's float32 copy (the runtime hands the
    master weights float32 gradients), and on a GPU, where torch's Adam runs multi-tensor
    (foreach) kernels over the whole parameter list, one temporary the size of the updated
    tensors (the denominator sqrt(v) + eps).  Measured on one H100 for a 1.4 B-parameter
    Llama slice under bf16 mixed precision: the step's peak was 11.14 GB above the states
    and gradients, 2 x 4 bytes x 1.39 B elements (docs/gpu/2026-11-26-h100-gpu_memory.txt).
    On a CPU Adam loops over the tensors one at a time: its temporaries are one tensor's;
    the fused kernel (backend "inductor") makes none either, so `foreach` is False for it.
    The runtime steps in runs (STEP_CHUNK_BYTES; step_temporary_total adds them up)."""
    master = 4 if mixed_precision else param_itemsize
    return (4.0 if mixed_precision else 0.0) + (master if foreach else 0.0)


@dataclass(frozen=True)
class CommStep:
    """One collective of a redistribution: kind on mesh axis `axis`; nbytes: the bytes its
    formula in `collective_time` reads (an all-gather's output, any other's input)."""

    kind: str
    axis: int
    nbytes: float
    seconds: float
    algorithm: str = "ring"
    fixed: float = 0.0   # the part of `seconds` that does not grow with the bytes
    bucketed: bool = False   # run in a bucket with other parameters' (see `bucketed`)


def bucketed(steps: tuple, nbytes: float, kinds: tuple) -> tuple:
    """`steps` of a parameter's gradient or weight as the runtime runs them, in buckets: the
    steps of `kinds` (a gradient's all-reduces, a ZeRO-2 gradient's reduce-scatters, the
    all-gathers of ZeRO-1/2 weights after the step, a grouped ZeRO-3 weight's gathers and
    reduce-scatter) pay `bucket_share` of their fixed cost."""
    cut = 1.0 - bucket_share(nbytes)
    return tuple(replace(st, seconds=st.seconds - st.fixed * cut, bucketed=True) if st.kind in kinds else st
                 for st in steps)


def collective_time(kind: str, nbytes: float, axis: int, mesh: Mesh) -> float:
    return collective_choice(kind, nbytes, axis, mesh)[1]


def redistribute(shape, itemsize: int, src, dst, mesh: Mesh) -> tuple[CommStep, ...]:
    """The collectives that turn a tensor of global `shape` from placements `src` into `dst`,
    in the order they run (`autopar.cost.redistribution`; its local steps are free).  An
    all-reduce over several axes is one call, listed per axis (`price_columns`)."""
    return redistribute_codes(shape, itemsize, layout_code(src), layout_code(dst), mesh)


def redistribute_codes(shape, itemsize: int, src: tuple, dst: tuple, mesh: Mesh) -> tuple[CommStep, ...]:
    """`redistribute` on layout codes (`layout_code`)."""
    if src == dst:
        return ()
    whole = (math.prod(shape) if shape else 1) * itemsize
    priced = price_columns(src, dst, mesh)
    k = min(range(len(priced)), key=lambda i: sum(f + b * whole for _, _, _, f, b, _ in priced[i]))
    return tuple(CommStep(kind, a, whole * share, fixed + per_byte * whole, algorithm, fixed)
                 for kind, a, share, fixed, per_byte, algorithm in priced[k])


class Row:
    """The rows of a `redistribute_price` table, by name: the whole move's line (fixed
    seconds, seconds per byte), its all-gathers' line, the fixed and per-byte parts of its
    all-reduces and reduce-scatters, two flags (1.0 where the whole move is one
    all-gather, or one reduce-scatter), and the bytes a bucket copies per byte of the whole
    tensor where the runtime runs the move's all-reduces, reduce-scatters or all-gathers in
    flat buffers (COPY_*: `bucket_copy_bytes`; the same in every column)."""
    FIXED, PER_BYTE = 0, 1
    GATHER_FIXED, GATHER_PER_BYTE = 2, 3
    ALL_REDUCE_FIXED, REDUCE_SCATTER_FIXED = 4, 5
    ALL_REDUCE_PER_BYTE, REDUCE_SCATTER_PER_BYTE = 6, 7
    ONE_ALL_GATHER, ONE_REDUCE_SCATTER = 8, 9
    COPY_ALL_REDUCE, COPY_REDUCE_SCATTER, COPY_GATHER = 10, 11, 12


PRICE_ROWS = 13   # the rows of a redistribute_price table (Row)
COPY_ROWS = {"all_reduce": Row.COPY_ALL_REDUCE, "reduce_scatter": Row.COPY_REDUCE_SCATTER,
             "all_gather": Row.COPY_GATHER}


def bucket_copy_bytes(kind: str, share: float, n: int) -> float:
    """Bytes a flat-buffer collective copies per byte of the whole tensor, one collective
    of `kind` over n ranks reading `share` of it (plan_rows' share: an all-gather's input,
    any other's): the local pieces copied into the flat buffer (a read and a write per
    byte) and the result copied out of it (autopar/runtime/grads/sync.py: torch.cat into
    the bucket, copy_from_flat back; reshard.py and zero.py: the same around their
    gathers and reduce-scatters).  An all-reduce moves s in and s out, a reduce-scatter s
    in and s / n out, an all-gather s in and n s out."""
    out = {"all_reduce": share, "reduce_scatter": share / n, "all_gather": share * n}[kind]
    return 2.0 * (share + out)


def copy_seconds(nbytes: float, mesh: Mesh) -> float:
    """Seconds of copying `nbytes` (counted read and write, `bucket_copy_bytes`) at the
    device's memory bandwidth."""
    return nbytes / mesh.device.mem_bandwidth
BUCKET_BYTES = 25 * 2**20   # the runtime's gradient buckets (autopar.compile's bucket_mb default)


def redistribute_price(src: tuple, dst: tuple, mesh: Mesh) -> np.ndarray:
    """`redistribute_codes` as straight lines in the tensor's bytes B > 0, one per collective
    algorithm of the device: [PRICE_ROWS, algorithms], rows named by `Row`: seconds = fixed +
    per_byte * B (FIXED, PER_BYTE); the same two numbers for its all-gathers alone
    (GATHER_*: the ones a parameter repeats in backward); the fixed seconds of its
    all-reduces and reduce-scatters (*_FIXED), which a parameter's gradient shares with the
    rest of its bucket (`bucket_share`), and their seconds per byte (*_PER_BYTE); 1.0 in
    ONE_ALL_GATHER where the whole move is one all-gather and in ONE_REDUCE_SCATTER where it
    is one reduce-scatter (the moves of a ZeRO-3 weight the runtime groups into
    buckets, autopar/runtime/regions/reshard.py).  Lets a whole table of layout pairs be priced once and
    scaled to every tensor size, where the cheapest algorithm is taken.  The columns are
    `price_columns`': one per algorithm of a library priced in autopar.cost.collectives; under
    NCCL, collectives.NCCL_COLUMNS lines of (algorithm, protocol) choices, each the cheapest
    over a stretch of sizes."""
    out = np.zeros((PRICE_ROWS, collectives.columns(mesh.device)))
    if src == dst:
        return out
    steps = plan_rows(src, dst, mesh.shape)
    if len(steps) == 1 and steps[0][0] in ("all_gather", "reduce_scatter"):
        out[Row.ONE_ALL_GATHER if steps[0][0] == "all_gather" else Row.ONE_REDUCE_SCATTER] = 1.0
    for kind, a, _, _, share, span in steps:   # (an all-reduce over several axes: one call, one copy)
        if kind in COPY_ROWS:
            out[COPY_ROWS[kind]] += bucket_copy_bytes(kind, share, mesh.shape[a])
    for j, column in enumerate(price_columns(src, dst, mesh, steps)):
        for kind, _, _, f, b, _ in column:
            out[Row.FIXED, j] += f
            out[Row.PER_BYTE, j] += b
            if kind == "all_gather":
                out[Row.GATHER_FIXED, j] += f
                out[Row.GATHER_PER_BYTE, j] += b
            elif kind == "all_reduce":
                out[Row.ALL_REDUCE_FIXED, j] += f
                out[Row.ALL_REDUCE_PER_BYTE, j] += b
            elif kind == "reduce_scatter":
                out[Row.REDUCE_SCATTER_FIXED, j] += f
                out[Row.REDUCE_SCATTER_PER_BYTE, j] += b
    return out


GEMM_CHUNKS = 2   # a row-parallel linear's output computed in this many pieces, each reduced while the next computes


def gemm_chunk_dim(shape, kind: str, dim: int | None) -> int | None:
    """The dim a row-parallel linear's local output `shape` [.., out] is computed in
    GEMM_CHUNKS pieces along when its one collective (`kind` "all_reduce", or
    "reduce_scatter" along `dim`) is started piece by piece (autopar/passes/fold_linears.py):
    the first of its two leading dims (batch, then sequence) with at least GEMM_CHUNKS rows
    that the collective does not scatter along; None where there is none."""
    for c in (0, 1):
        if c < len(shape) - 1 and shape[c] >= GEMM_CHUNKS and not (kind == "reduce_scatter" and dim == c):
            return c
    return None


def gemm_pieces_extra(local_out, k: int, mesh: Mesh) -> float:
    """The share of a row-parallel linear's forward that computing it in GEMM_CHUNKS pieces
    adds (>= 0): the rate a GEMM of 1/GEMM_CHUNKS of the rows reaches against the whole
    GEMM's (kernels.gemm_efficiency: fewer tiles fill fewer waves), for the rank's output
    `local_out` [.., n] and reduction length k; 0 where the device has no kernel model (CPU
    ranks)."""
    kernels = mesh.device.kernels
    if kernels is None or not local_out:
        return 0.0
    m, n = max(math.prod(local_out[:-1]), 1), int(local_out[-1])
    whole = K.gemm_efficiency(m, n, k, kernels)
    part = K.gemm_efficiency(math.ceil(m / GEMM_CHUNKS), n, k, kernels)
    return max(whole / max(part, 1e-6) - 1.0, 0.0)


def bucket_share(nbytes: float) -> float:
    """The share of one collective call's fixed cost a parameter gradient of `nbytes` pays:
    the runtime joins gradients into buckets of BUCKET_BYTES (autopar/runtime/grads/sync.py) and
    reduces each bucket in one call, so a gradient pays its bytes' share of that call's
    launch and latency."""
    return min(1.0, nbytes / BUCKET_BYTES)


def roofline(flops: float, nbytes: float, dtype: torch.dtype, mesh: Mesh, kernels: int = 1,
             attention: bool = False) -> float:
    """Seconds of `kernels` kernels doing `flops` and moving `nbytes` in all: the slower of
    the device's FLOP rate (attention: its fused attention kernel's) and memory bandwidth,
    with each kernel's launch (op_latency) hidden behind the work when the host runs ahead
    of the device, added when it does not."""
    dev = mesh.device
    work = max(flops / dev.peak_flops(dtype, attention), nbytes / dev.mem_bandwidth)
    launch = kernels * dev.op_latency
    return max(work, launch) if dev.asynchronous else work + launch


def optimizer_seconds(elements: float, param_itemsize: int, mixed_precision: bool, mesh: Mesh,
                      fused: bool = False) -> float:
    """Adam's step over one parameter's `elements`: memory-bound.  On a GPU torch's
    multi-tensor AdamW updates every parameter in a few launches (no launch is charged per
    parameter) but in eight passes over the state: weight decay, the first moment's lerp,
    the second moment's scale and addcmul, its square root, the bias correction and the
    epsilon into a temporary, and the update: ADAMW_ACCESSES reads and writes of an element
    of the updated tensor (20 x 4 = 80 bytes per float32 element).  Under mixed precision
    the gradient is cast to float32 before and the float32 master copied into the weight
    after (runtime/state/sharded_optimizer.py): 2 (4 + param bytes) more.  Measured on one H100
    (docs/gpu/2026-11-26-h100-host.txt): 26-29 ps per element in float32 and 33 with
    master weights, against 27 and 31 here.  A CPU rank runs the for-loop Adam, about ten
    eager ops per parameter, priced as one read and write of the weight, gradient and
    state.  A calibrated device has the step measured.

    fused: AdamW's fused kernel (what the runtime builds under backend "inductor",
    runtime/state/optimizer.fused_options) reads the updated tensor, its gradient and both
    moments once and writes the tensor and the moments: FUSED_ADAMW_ACCESSES, one launch
    per device and dtype for all the parameters (none charged per parameter)."""
    if not elements:
        return 0.0
    measured = mesh.device.optimizer_fused if fused else mesh.device.optimizer
    if measured:   # (autopar calibrate)
        per_param, per_element = measured
        return per_param + per_element * elements
    state = state_bytes(param_itemsize, mixed_precision)
    updated = 4 if mixed_precision else param_itemsize
    cast = 2 * (4 + param_itemsize) if mixed_precision else 0
    if fused:
        return roofline(0.0, elements * (FUSED_ADAMW_ACCESSES * updated + cast), torch.float32, mesh, kernels=0)
    if not mesh.device.asynchronous:
        nbytes = elements * (3 * param_itemsize + 2 * state)
        return roofline(0.0, nbytes, torch.float32, mesh, kernels=10)
    nbytes = elements * (ADAMW_ACCESSES * updated + cast)
    return roofline(0.0, nbytes, torch.float32, mesh, kernels=0)


ADAMW_ACCESSES = 20   # element reads and writes of torch's multi-tensor AdamW step (optimizer_seconds)
FUSED_ADAMW_ACCESSES = 7   # ... of its fused kernel: tensor, gradient, two moments read; tensor, moments written


@dataclass(frozen=True)
class OpWork:
    """Global FLOPs of one node, forward and backward, measured once on meta tensors."""

    fwd_flops: float
    bwd_flops: float


_FLOPS: dict = {}   # (op, arg_signature of its arguments, needs_grad) -> OpWork


def arg_signature(value):
    """Arguments as a hashable description: tensors by (shape, stride, dtype)
    (problem/saved.py probes ops by it, measure_flops remembers counts by it)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("T", tuple(val.shape), tuple(val.stride()), val.dtype)
        return ("V", val if isinstance(val, (int, float, bool, type(None))) else repr(val))
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(arg_signature(v) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((k, arg_signature(v)) for k, v in value.items())
    if isinstance(value, torch.device):
        return ("C", "meta")   # run where its operands are (a move to the device is a no-op there)
    return ("C", value if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.layout,
                                             torch.memory_format)) else repr(value))


def measure_flops(node, needs_grad=None) -> OpWork:
    """Run the node's op on meta tensors of its global shapes under the FLOP counter, once
    per op, argument signature and needs_grad (a model's layers, and the pipeline search's
    sub-meshes of one microbatch size, repeat them).

    needs_grad: per tensor operand (in `tensor_args` order), whether its gradient is wanted;
    backward FLOPs count only those (a first layer computes no gradient of its input)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return OpWork(0.0, 0.0)
    key = (node.target, arg_signature((node.args, node.kwargs)), None if needs_grad is None else tuple(needs_grad))
    if key not in _FLOPS:
        if len(_FLOPS) > 100_000:
            _FLOPS.clear()
        _FLOPS[key] = _count_flops(node, needs_grad)
    return _FLOPS[key]


def _count_flops(node, needs_grad) -> OpWork:
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils import _pytree as pytree

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
