"""The kernel-aware compute model (autopar.cost.kernels): GEMM rates by shape, flash and
unfused attention, the per-kernel gap, and its place in plans."""
import dataclasses
import math

import pytest
import torch

import autopar
from autopar.cost import kernels as K
from autopar.cost import prices as C
from autopar import placements
from autopar.mesh import PRESETS, DeviceSpec, KernelEfficiency
from autopar.models import build

H100 = autopar.Mesh((8,), ("dp",), device="h100")
A100 = autopar.Mesh((8,), ("dp",), device="a100")
BF16 = torch.bfloat16


def test_large_square_gemm_runs_at_the_preset_rate():
    m = n = k = 8192
    flops = 2 * m * n * k
    t = K.seconds(K.Gemm(m, n, k), flops, 3 * m * n * 2, BF16, H100)
    rate = flops / t
    assert rate == pytest.approx(H100.device.peak_flops(BF16), rel=0.05)


def test_small_and_skinny_gemms_run_below_the_large_rate():
    kern = H100.device.kernels
    big = K.gemm_efficiency(8192, 8192, 8192, kern)
    assert big == pytest.approx(1.0, abs=0.04)
    assert K.gemm_efficiency(16384, 768, 768, kern) < 0.95 * big          # a short reduction
    # a handful of tiles on 132 SMs: split-K spreads the reduction, on smaller tiles
    assert K.gemm_efficiency(256, 256, 4096, kern) < 0.65
    assert K.gemm_efficiency(256, 256, 256, kern) < 0.15
    # a GEMV-like GEMM (8 rows) is bound by reading its weight, not by padded tiles
    t = K.seconds(K.Gemm(8, 4096, 4096), 2 * 8 * 4096 * 4096, 4096 * 4096 * 2, BF16, H100)
    assert t == pytest.approx(4096 * 4096 * 2 / H100.device.mem_bandwidth + H100.device.kernels.gap, rel=0.01)
    # wave quantisation: one tile more than the SMs hold in one wave halves the rate
    full = K.gemm_efficiency(128 * 132, 256, 8192, kern)
    spill = K.gemm_efficiency(128 * 133, 256, 8192, kern)
    assert full == pytest.approx(1.0, abs=0.02)
    assert spill < 0.75 * full


def test_a_gemm_with_rows_off_16_bytes_runs_on_the_slow_kernel():
    # GPT-2's head: 8,192 tokens x 768 -> 50,257.  Measured on one H100 (docs/gpu/): its
    # three GEMMs together took 15.4 ms, 123 TFLOP/s; padded to 50,304 they run aligned
    flops = 2 * 8192 * 768 * 50257
    odd, padded = K.Gemm(8192, 50257, 768), K.Gemm(8192, 50304, 768)
    assert not odd.aligned(2) and padded.aligned(2)
    assert not K.Gemm(8192, 4096, 770).aligned(2)          # an odd reduction length too
    assert K.Gemm(8191, 4096, 4096).aligned(2)                          # the row count does not matter
    fwd = K.seconds(odd, flops, 0.0, BF16, H100)
    bwd = K.seconds(odd, 2 * flops, 0.0, BF16, H100, backward=True)
    assert fwd + bwd == pytest.approx(15.4e-3, rel=0.15)
    assert K.seconds(padded, flops, 0.0, BF16, H100) < 0.25 * fwd
    # float32 rows are whole vectors every 4 elements, but float32 GEMMs run on the SIMT
    # units, which pay nothing for it
    assert K.Gemm(64, 4100, 64).aligned(4) and not K.Gemm(64, 4100, 64).aligned(2)
    assert K.seconds(odd, flops, 0.0, torch.float32, H100) == pytest.approx(
        K.seconds(padded, flops, 0.0, torch.float32, H100), rel=0.01)
    assert K._itemsize("bfloat16") == 2 and K._itemsize("tfloat32") == 4 and K._itemsize(torch.float32) == 4
    # the plan of GPT-2 on one H100 pays for it: about 15 ms of its step
    model, ex = build("gpt2-124m", device="meta", n_layers=1, batch=8, seq=1024)
    mesh = autopar.Mesh((1,), ("dp",), device="h100")
    odd_step = autopar.plan(model, mesh, ex, solve=autopar.SolveOptions(compare=False), mixed_precision=BF16).step_s
    model, ex = build("gpt2-124m", device="meta", n_layers=1, batch=8, seq=1024, vocab=50304)
    padded_step = autopar.plan(model, mesh, ex, solve=autopar.SolveOptions(compare=False), mixed_precision=BF16).step_s
    assert odd_step - padded_step == pytest.approx(15.4e-3 - 3 * flops / 742e12, rel=0.25)


def test_attention_rates_match_the_published_and_measured_figures():
    b, h, s, d = 1, 32, 16384, 128
    shape = K.FlashAttention(s, s, d, causal=True)
    square = 4 * b * h * s * s * d   # the counter counts the whole square; the kernel computes half
    # H100 SXM, head dim 128, causal, 16k tokens: FlashAttention-2 about 350 TFLOP/s forward
    # and 295 backward per FLOP it computes (Shah et al. 2024)
    fa2 = autopar.Mesh((8,), ("dp",), device=dataclasses.replace(
        PRESETS["h100"], kernels=PRESETS["h100"].kernels.with_attention("flash-attn-2")))
    fwd = K.seconds(shape, square, 0.0, BF16, fa2)
    bwd = K.seconds(shape, 2 * square, 0.0, BF16, fa2, backward=True, count=2)
    assert square / 2 / fwd == pytest.approx(350e12, rel=0.05)
    assert square / bwd == pytest.approx(295e12, rel=0.05)
    # torch's own kernel today, as one H200 measured it (8,192 tokens: 882 us forward, 3,830
    # forward and backward; docs/gpu/2026-11-26-h200-gpu_check-after-reliability.json)
    h200 = autopar.Mesh((1,), ("dp",), device="h200")
    short = K.FlashAttention(8192, 8192, 128, causal=True)
    sq = 4 * 32 * 8192 * 8192 * 128
    fwd_m = K.seconds(short, sq, 0.0, BF16, h200)
    both = fwd_m + K.seconds(short, 2 * sq, 0.0, BF16, h200, backward=True, count=2)
    assert fwd_m == pytest.approx(882e-6, rel=0.1)
    assert both == pytest.approx(3830e-6, rel=0.1)
    # without the mask the kernel computes the whole square: about twice the time
    full = K.seconds(dataclasses.replace(shape, causal=False), square, 0.0, BF16, fa2)
    assert full / fwd == pytest.approx(2.0, rel=0.02)
    # smaller heads and short sequences run slower per FLOP
    small = K.attention_efficiency(K.FlashAttention(512, 512, 64, True), H100.device.kernels, False)
    assert small < 0.85 * K.attention_efficiency(shape, H100.device.kernels, False)


def test_unfused_attention_pays_for_the_score_matrix():
    dev = dataclasses.replace(PRESETS["a100"], kernels=PRESETS["a100"].kernels.with_attention("unfused"))
    mesh = autopar.Mesh((8,), ("dp",), device=dev)
    b, h, d = 1, 24, 96
    times = {}
    for s in (1024, 2048, 4096):
        square = 4 * b * h * s * s * d
        times[s] = K.seconds(K.FlashAttention(s, s, d, True), square, 0.0, BF16, mesh)
        scores = b * h * s * s * 2 * 4    # four passes over the bf16 scores
        assert times[s] > scores / mesh.device.mem_bandwidth + square / mesh.device.peak_flops(BF16)
    assert times[4096] / times[2048] == pytest.approx(4.0, rel=0.1)   # quadratic in s, no causal skip
    flash = K.seconds(K.FlashAttention(4096, 4096, d, True), 4 * h * 4096 * 4096 * d, 0.0, BF16, A100)
    assert times[4096] > 2 * flash


def test_attention_kernel_choices_and_bad_names():
    kern = PRESETS["h100"].kernels
    assert kern.with_attention("sdpa") == kern
    fa2 = kern.with_attention("flash-attn-2").attention
    assert fa2 != kern.attention
    assert kern.with_attention("flash-attn-1").attention == tuple(a / 2 for a in fa2)
    assert PRESETS["a100"].kernels.with_attention("flash-attn-2") == PRESETS["a100"].kernels.with_attention("sdpa")
    with pytest.raises(ValueError, match="unknown attention kernel 'flash-attn-9'"):
        kern.with_attention("flash-attn-9")
    with pytest.raises(ValueError, match="attention_kernel 'fused'"):
        KernelEfficiency.from_dict({**kern.to_dict(), "attention_kernel": "fused"})


def test_device_with_kernels_round_trips_and_cpu_has_none(tmp_path):
    dev = PRESETS["a100-40gb"]
    assert dev.kernels.sms == 108 and PRESETS["h200"].kernels.sms == 132
    path = tmp_path / "dev.json"
    dev.save(path)
    assert DeviceSpec.load(path) == dev
    assert PRESETS["cpu"].kernels is None
    # a device file written before kernels existed loads with none
    old = {k: v for k, v in dev.to_dict().items() if k != "kernels"}
    assert DeviceSpec.from_dict(old).kernels is None


def test_the_gap_is_paid_per_kernel_and_the_launch_bound_stays():
    tiny = K.seconds(None, 0.0, 1024.0, BF16, H100, count=2)
    assert tiny == pytest.approx(max(2 * H100.device.kernels.gap + 1024 / H100.device.mem_bandwidth,
                                     2 * H100.device.op_latency))
    # a CPU rank (no kernel description) keeps the roofline with eager launches added
    cpu = autopar.Mesh((2,), ("dp",), device="cpu")
    assert C.roofline(1e9, 1e6, torch.float32, cpu) == pytest.approx(
        1e9 / cpu.device.peak_flops(torch.float32) + cpu.device.op_latency)


def test_kernel_shapes_read_from_local_operands():
    from torch.distributed.tensor import Replicate, Shard
    assert placements.local_shape_ceil((8, 1024, 4096), (Shard(0), Replicate()), (4, 2)) == (2, 1024, 4096)
    assert placements.local_shape_ceil((10,), (Shard(0), Shard(0)), (2, 2)) == (3,)
    m, ex = build("gpt2-124m", device="meta", batch=8, seq=512, hidden=256, n_layers=1, n_heads=4, vocab=512,
                  max_seq=512)
    plan = autopar.plan(m, H100, ex, solve=autopar.SolveOptions(layout="data-parallel", compare=False))
    linear = [n for n in plan.nodes if n.op == "aten.linear"]
    attention = [n for n in plan.nodes if n.op == "aten.scaled_dot_product_attention"]
    assert linear and attention
    # the attention node is priced by the flash model on its rank's batch (8 sequences over
    # 8 ranks: one each), forward and backward, with the causal mask halving the work
    shape = K.FlashAttention(512, 512, 64, causal=True)
    square = 4 * 1 * 4 * 512 * 512 * 64
    expected = K.seconds(shape, square, 0.0, torch.float32, H100)
    assert attention[0].compute_s >= expected
    assert attention[0].split == ('b0',)   # the batch split over dp
    assert attention[0].compute_s < 4 * expected + 1e-5
    assert all(n.compute_s > 0 for n in linear)


def test_small_models_are_priced_slower_per_flop_than_large_ones():
    """The drift the published runs show: a 125M model's step reaches a smaller share of
    the GEMM rate than a 7B one's at the same tokens."""
    def mfu(hidden, layers, heads):
        m, ex = build("gpt2-124m", device="meta", batch=8, seq=2048, hidden=hidden, n_layers=layers,
                      n_heads=heads, vocab=50368, max_seq=2048, bias=False)
        plan = autopar.plan(m, autopar.Mesh((1,), ("dp",), device="a100"), ex,
                            solve=autopar.SolveOptions(layout="data-parallel", compare=False),
                            mixed_precision=autopar.MixedPrecision())
        n = sum(p.numel() for p in m.parameters())
        return 6 * n * ex[0].numel() / plan.predicted.step_s / A100.device.peak_flops(BF16)
    small, large = mfu(768, 12, 6), mfu(4096, 4, 32)
    assert small < 0.9 * large < large <= 1.0
    assert not math.isnan(small)


def test_norms_run_below_the_bandwidth_and_adds_backward_is_free():
    """Norms and softmax reduce along rows and stream at KernelEfficiency.reduction of the
    bandwidth an elementwise kernel reaches; an add of two same-shaped tensors hands its
    gradient on without a kernel (the one-H200 check measured add's forward and backward
    at the forward's time)."""
    dev = H100.device
    nbytes = 2 * 16384 * 4096 * 2
    norm = K.seconds(K.kernel_of("aten.layer_norm", None, [(16384, 4096)]), 0.0, nbytes, BF16, H100)
    plain = K.seconds(None, 0.0, nbytes, BF16, H100)
    assert norm - dev.kernels.gap == pytest.approx((plain - dev.kernels.gap) / dev.kernels.reduction)
    add = K.kernel_of("aten.add", None, [(4, 8), (4, 8)])
    assert K.seconds(add, 0.0, nbytes, BF16, H100, backward=True, count=2) == 0.0
    bias = K.kernel_of("aten.add", None, [(4, 8), (8,)])   # broadcast: backward sums over rows
    assert bias is None and K.seconds(bias, 0.0, nbytes, BF16, H100, backward=True, count=2) > 0


def test_cross_entropy_kernel_choices_round_trip_and_bad_names():
    kern = PRESETS["h100"].kernels
    assert kern.cross_entropy == "torch" and kern.with_cross_entropy("torch") == kern
    fused = kern.with_cross_entropy("fused")
    assert fused.cross_entropy == "fused" and KernelEfficiency.from_dict(fused.to_dict()) == fused
    with pytest.raises(ValueError, match="unknown cross-entropy kernel 'liger'.*torch.*fused"):
        kern.with_cross_entropy("liger")
    with pytest.raises(ValueError, match="cross_entropy 'xla'"):
        KernelEfficiency.from_dict(dict(kern.to_dict(), cross_entropy="xla"))
