"""Compute as the kernels run it: a GEMM's rate by its shape, flash attention's by its
sequence, head size and mask, memory-bound ops at the device's bandwidth, and a gap per
kernel (docs/COST_MODEL.md, "Kernels").

A device without KernelEfficiency (the CPU preset, a calibrated CPU rank) prices every op
as `prices.roofline` does; a GPU preset prices:

    GEMM (m x k) @ (k x n):  max(flops / (F e(m, n, k)), bytes / M) + gap
        e(m, n, k) = best over tiles (th, tw, r) of  r x m n z / (waves x sms x th tw)
                     x  (k/z) / (k/z + k_half)  /  (8192 / (8192 + k_half))
        waves = ceil(t z / sms),  t = ceil(m / th) ceil(n / tw) tiles, z = 1 or, where
        t < sms, the split-K factor min(sms // t, k // 256) that spreads the reduction;
        times KernelEfficiency.misaligned where a 16- or 8-bit GEMM's k or n is not a whole
        number of 16-byte vectors (the library falls back to a kernel that loads elements
        one at a time; float32 GEMMs run on the SIMT units, which load them so anyway)
    flash attention:        flops x c / (F a (d / 128)^p s / (s + s_half)) + gap
        c = 1/2 + 64 / s_kv with a causal mask (the kernel skips the blocks above the
        diagonal; the FLOP counter counts the whole square), else 1; a = the forward or
        backward fraction of F; d = head dim (capped at 128); s = the query length
    norms and softmax:      max(bytes / (M r), flops / F) + gap per kernel, r = KernelEfficiency.reduction
    add, sub of one shape:  forward as below; backward free (the gradient is handed on)
    anything else:          max(bytes / M, flops / F) + gap per kernel

F is the device's GEMM rate (DeviceSpec.flops: what a large square GEMM sustains), M its
memory bandwidth.  Backward runs two GEMMs of the same FLOPs, (m x n) @ (n x k) for the
input's gradient and (k x m) @ (m x n) for the weight's, so its efficiency is their
harmonic mean.  Where the host cannot run ahead of the device (op_latency, asynchronous),
the launch bound of `prices.roofline` applies as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.mesh import KernelEfficiency, Mesh

MATMUL_OPS = frozenset({"aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul"})
FLASH_OPS = frozenset({"aten.scaled_dot_product_attention"})
# memory-bound kernels that reduce along rows (mean and variance, a maximum and a sum): they
# stream below the bandwidth an elementwise kernel reaches (KernelEfficiency.reduction)
REDUCTION_OPS = frozenset({"aten.layer_norm", "aten.native_layer_norm", "aten.rms_norm", "aten.group_norm",
                           "aten.softmax", "aten._softmax", "aten.log_softmax", "aten._log_softmax"})
# ops whose backward hands the output's gradient to each operand as it is (no kernel) where
# the operands have one shape
PASS_THROUGH_OPS = frozenset({"aten.add", "aten.sub"})
# elementwise ops that evaluate a transcendental function per element: on a CPU they run
# below memory bandwidth (DeviceSpec.pointwise measures them); keyed by pointwise_key
POINTWISE_OPS = frozenset({"aten.gelu", "aten.silu", "aten.tanh", "aten.sigmoid", "aten.exp", "aten.softmax",
                           "aten._softmax", "aten.log_softmax", "aten._log_softmax", "aten.cross_entropy_loss"})
REFERENCE_K = 8192   # the reduction length of the GEMM a device's `flops` describe
SPLIT_K_MIN = 256    # the shortest reduction slice a split-K GEMM gives one tile


@dataclass(frozen=True)
class Gemm:
    """`batch` GEMMs (m x k) @ (k x n) in one kernel, local to a rank."""

    m: int
    n: int
    k: int
    batch: int = 1

    def __str__(self) -> str:
        return f"GEMM {self.m}x{self.k} @ {self.k}x{self.n}" + (f" x {self.batch}" if self.batch > 1 else "")

    def aligned(self, itemsize: int) -> bool:
        """Whether every operand's and the output's rows are whole 16-byte vectors.  The
        rows are k long (the input, the weight) and n long (the output); the backward's
        GEMMs read and write the same three tensors, so one answer holds for all three."""
        step = max(1, 16 // max(1, itemsize))
        return self.k % step == 0 and self.n % step == 0


@dataclass(frozen=True)
class FlashAttention:
    """A fused attention call on a rank: query length, key length, head dim, causal mask."""

    q_len: int
    kv_len: int
    head_dim: int
    causal: bool

    def __str__(self) -> str:
        return f"attention q {self.q_len} x kv {self.kv_len}, head dim {self.head_dim}" + (
            ", causal" if self.causal else "")


@dataclass(frozen=True)
class Streamed:
    """A memory-bound kernel: `reduction` (norms, softmax) or elementwise; `pass_through`:
    its backward runs no kernel."""

    reduction: bool = False
    pass_through: bool = False

    def __str__(self) -> str:
        return "reduction" if self.reduction else "elementwise" + (" (backward free)" if self.pass_through else "")


def kernel_of(op: str, node: fx.Node, shapes: list) -> Gemm | FlashAttention | Streamed | None:
    """The kernel shape of one op from its tensor operands' local shapes (in operand
    order): a GEMM, fused attention, a memory-bound reduction or pass-through op, or None
    (any other op, or shapes that are not the usual ones)."""
    if op in REDUCTION_OPS:
        return Streamed(reduction=True)
    if op in PASS_THROUGH_OPS and len(shapes) >= 1 and all(tuple(x) == tuple(shapes[0]) for x in shapes):
        return Streamed(pass_through=True)
    if op in MATMUL_OPS:
        if op == "aten.addmm":
            shapes = shapes[1:]
        if len(shapes) < 2 or len(shapes[0]) < 1 or len(shapes[1]) < 1:
            return None
        a, b = shapes[0], shapes[1]
        k = a[-1]
        if op == "aten.linear":   # weight (n, k)
            n = b[0] if len(b) == 2 else 1
        else:
            n = b[-1] if len(b) >= 2 else 1
        if op in ("aten.bmm", "aten.matmul") and len(a) >= 2 and len(b) > 2:   # batched
            m, batch = a[-2], math.prod(a[:-2])
        else:
            m, batch = math.prod(a[:-1]), 1
        return Gemm(int(max(m, 1)), int(max(n, 1)), int(max(k, 1)), int(max(batch, 1)))
    if op == "autopar.grouped_linear" and len(shapes) == 3 and len(shapes[2]) == 3:
        # one GEMM per expert, of its share of the rows (balanced routing)
        rows, (experts, n, k) = shapes[0][0], shapes[2]
        return Gemm(int(max(rows // max(experts, 1), 1)), int(max(n, 1)), int(max(k, 1)), int(max(experts, 1)))
    if op in FLASH_OPS:
        if len(shapes) < 3 or len(shapes[0]) < 2 or len(shapes[1]) < 2:
            return None
        q, kv = shapes[0], shapes[1]
        causal = bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False))
        return FlashAttention(int(q[-2]), int(kv[-2]), int(q[-1]), causal)
    return None


def pointwise_key(op: str, node: fx.Node | None) -> str | None:
    """The DeviceSpec.pointwise key of an elementwise op that computes more than it moves:
    its op name, gelu's tanh approximation as "aten.gelu:tanh", the softmax variants as
    "aten.softmax" and "aten.log_softmax", a cross entropy as the log-softmax over its
    logits it is; None for any other op.  The op's elements are its first operand's."""
    if op not in POINTWISE_OPS:
        return None
    if op == "aten.cross_entropy_loss":
        return "aten.log_softmax"
    if op == "aten.gelu":
        approximate = node.kwargs.get("approximate", "none") if node is not None else "none"
        return "aten.gelu:tanh" if approximate == "tanh" else op
    return op.replace("aten._", "aten.")


def gemm_efficiency(m: int, n: int, k: int, kernels: KernelEfficiency, batch: int = 1) -> float:
    """The fraction of the device's large-GEMM rate `batch` (m x k) @ (k x n) GEMMs in one
    kernel reach: the least wasteful tile's share of its waves times the reduction's
    prologue cost."""
    best = 0.0
    for rows, cols, rate in kernels.tiles:
        tiles = batch * math.ceil(m / rows) * math.ceil(n / cols)
        # too few tiles to fill the SMs: the reduction is split over several (split-K),
        # each a slice of at least SPLIT_K_MIN
        splits = max(1, min(kernels.sms // tiles, k // SPLIT_K_MIN)) if tiles < kernels.sms else 1
        waves = math.ceil(tiles * splits / kernels.sms)
        share = k / splits   # each tile's reduction: its prologue and epilogue weigh on a short one
        reduce = (share / (share + kernels.k_half)) / (REFERENCE_K / (REFERENCE_K + kernels.k_half))
        best = max(best, rate * batch * m * n * splits / (waves * kernels.sms * rows * cols) * min(1.0, reduce))
    return best


def attention_efficiency(shape: FlashAttention, kernels: KernelEfficiency, backward: bool) -> float:
    """The fraction of the device's GEMM rate the flash kernel reaches on `shape`, per FLOP
    the counter counts (so a causal mask's skipped blocks show as a higher rate)."""
    rate = kernels.attention[1 if backward else 0]
    rate *= min(1.0, shape.head_dim / 128) ** kernels.head_dim_exponent
    rate *= shape.q_len / (shape.q_len + kernels.attention_seq_half)
    if shape.causal:
        rate /= min(1.0, 0.5 + 64 / max(shape.kv_len, 1))
    return rate


def unfused_attention_seconds(shape: FlashAttention, flops: float, nbytes: float, rate: float, mesh: Mesh,
                              backward: bool) -> float:
    """Attention without a fused kernel: Q K^T and P V as batched GEMMs over the whole
    score square (`flops`, the FLOP counter's count, is that square; forward 2 GEMMs,
    backward 4), and the scores written, soft-maxed, masked and dropped out at memory
    bandwidth, `score_passes` reads or writes of b h s s_kv 2-byte elements."""
    kernels = mesh.device.kernels
    d = shape.head_dim
    heads_batch = flops / ((4.0 if not backward else 8.0) * shape.q_len * shape.kv_len * d)   # b x heads
    group = max(1, round(heads_batch))
    eff = 2 / (1 / max(gemm_efficiency(shape.q_len, shape.kv_len, d, kernels, group), 1e-6) +
               1 / max(gemm_efficiency(shape.q_len, d, shape.kv_len, kernels, group), 1e-6))
    scores = heads_batch * shape.q_len * shape.kv_len * 2
    passes = kernels.score_passes[1 if backward else 0]
    return flops / (rate * eff) + (passes * scores + nbytes) / mesh.device.mem_bandwidth


def _itemsize(dtype) -> int:
    """Bytes per element of a torch dtype or its name ("bfloat16"; "tfloat32" is 4)."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    found = getattr(torch, str(dtype).replace("torch.", "").replace("tfloat32", "float32"), None)
    return found.itemsize if isinstance(found, torch.dtype) else 2


def seconds(kernel: Gemm | FlashAttention | None, flops: float, nbytes: float, dtype: torch.dtype, mesh: Mesh,
            backward: bool = False, count: int = 1) -> float:
    """Device seconds of `count` kernels of this shape doing `flops` and moving `nbytes` in
    all (the device has KernelEfficiency; see the module docstring)."""
    dev = mesh.device
    kernels = dev.kernels
    rate = dev.peak_flops(dtype)
    if isinstance(kernel, Streamed) and kernel.pass_through and backward:
        return 0.0
    if isinstance(kernel, Gemm):
        m, n, k, b = kernel.m, kernel.n, kernel.k, kernel.batch
        if backward:
            grads = (gemm_efficiency(m, k, n, kernels, b), gemm_efficiency(k, n, m, kernels, b))
            eff = 2 / sum(1 / max(e, 1e-6) for e in grads)
        else:
            eff = gemm_efficiency(m, n, k, kernels, b)
        item = _itemsize(dtype)
        if item <= 2 and not kernel.aligned(item):   # (tensor-core kernels; float32 runs on the SIMT units)
            eff *= kernels.misaligned
        work = max(flops / (rate * max(eff, 1e-6)), nbytes / dev.mem_bandwidth)
    elif isinstance(kernel, FlashAttention) and kernels.attention_kernel == "unfused":
        work = unfused_attention_seconds(kernel, flops, nbytes, rate, mesh, backward)
    elif isinstance(kernel, FlashAttention):
        work = max(flops / (rate * attention_efficiency(kernel, kernels, backward)), nbytes / dev.mem_bandwidth)
    elif isinstance(kernel, Streamed) and kernel.reduction:
        work = max(flops / rate, nbytes / (dev.mem_bandwidth * kernels.reduction))
    else:
        work = max(flops / rate, nbytes / dev.mem_bandwidth)
    device = work + count * kernels.gap
    launch = count * dev.op_latency
    return max(device, launch) if dev.asynchronous else device + launch
