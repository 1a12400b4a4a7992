"""Calibration's compute measurements (runtime/calibrate/fit.py): a linear layer's and causal
attention's rates per dtype, the memory bandwidth, a CPU's transcendental elementwise ops
per element, the op latency, and torch's AdamW step per parameter and element.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from autopar.runtime.calibrate.timing import fit_line, progress, timed

# (sizes, repeats) per device type: small enough for minutes on a loaded CPU host
# linear layers (tokens, in, out) and causal attention (batch, heads, seq, head dim) of
# the shapes training runs
LINEAR = {"cpu": ((128, 256, 768), (256, 512, 512), (512, 512, 1024), (512, 1024, 1024)),
          "cuda": ((2048, 4096, 4096), (4096, 4096, 14336), (8192, 4096, 4096), (8192, 8192, 8192))}
ATTENTION = {"cpu": ((2, 8, 64, 32), (2, 8, 128, 32), (2, 8, 256, 64), (4, 8, 256, 64)),
             "cuda": ((1, 32, 2048, 128), (1, 32, 4096, 128), (2, 32, 4096, 128), (1, 32, 8192, 128))}
ELEMENTS = {"cpu": (2**14, 2**18, 2**21, 2**23), "cuda": (2**16, 2**20, 2**24, 2**27)}
DTYPES = {"cpu": ("float32", "bfloat16"), "cuda": ("float32", "bfloat16", "float16")}

POINTWISE_ELEMENTS = 2**18   # a transformer MLP's activation on a CPU rank: 256 tokens x 1,024
POINTWISE = {   # DeviceSpec.pointwise keys (autopar.cost.kernels.pointwise_key) and how to run them
    "aten.gelu": F.gelu,
    "aten.gelu:tanh": lambda x: F.gelu(x, approximate="tanh"),
    "aten.silu": F.silu,
    "aten.tanh": torch.tanh,
    "aten.sigmoid": torch.sigmoid,
    "aten.exp": torch.exp,
    "aten.softmax": lambda x: x.view(-1, 1024).softmax(-1),
    "aten.log_softmax": lambda x: x.view(-1, 1024).log_softmax(-1),
}


def measure_pointwise(dev, device_type: str, repeats: int, what: str) -> tuple:
    """(key, forward seconds, backward seconds) of each POINTWISE op over
    POINTWISE_ELEMENTS float32 elements.  On a CPU they compute more than they move: a
    gelu's tanh form takes about 0.9 ms for 2^19 elements, against 0.05 ms for an add, so
    the memory roofline prices it 15x too cheap."""
    x = torch.randn(POINTWISE_ELEMENTS, device=dev, requires_grad=True)
    out = []
    for key, fn in POINTWISE.items():
        grad = torch.ones_like(fn(x))
        fwd = timed(lambda: fn(x), device_type, repeats, what=what)
        both = timed(lambda: torch.autograd.grad(fn(x), x, grad), device_type, repeats, what=what)
        out.append((key, fwd, max(both - fwd, 0.0)))
    progress("pointwise (ns per element, forward / backward): " +
              ", ".join(f"{k} {f / POINTWISE_ELEMENTS * 1e9:.2f}/{b / POINTWISE_ELEMENTS * 1e9:.2f}"
                        for k, f, b in out))
    return tuple(out)


def measure_compute(device_type: str, repeats: int, quick: bool = False) -> dict:
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    what = "quick" if quick else "compute"
    cut = 2 if quick else None   # quick: the two smallest sizes (messages: the smallest and largest)
    flops, attention, rows = {}, {}, {}
    for name in DTYPES[device_type]:
        dtype = getattr(torch, name)
        points = []
        for m, k, n in LINEAR[device_type][:cut]:   # a linear layer's forward and backward: 6 m k n FLOPs
            x = torch.randn(m, k, device=dev).to(dtype).requires_grad_(True)
            w = torch.randn(n, k, device=dev).to(dtype).requires_grad_(True)
            points.append((6.0 * m * k * n, timed(lambda: F.linear(x, w).sum().backward(), device_type, repeats,
                                                   what=what)))
        c, per_flop = fit_line(*zip(*points))
        flops[name] = 1.0 / per_flop
        rows[f"linear {name}"] = points
        points = []
        for b, h, s, d in ATTENTION[device_type][:cut]:   # causal: 4 b h s^2 d forward (half masked) x 3.5
            q, k_, v = (torch.randn(b, h, s, d, device=dev).to(dtype).requires_grad_(True) for _ in range(3))
            fl = 2.0 * b * h * s * s * d * 3.5
            points.append((fl, timed(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True).sum()
                                      .backward(), device_type, repeats, what=what)))
        _, per_flop = fit_line(*zip(*points))
        attention[name] = 1.0 / per_flop
        rows[f"attention {name}"] = points
        progress(f"{name}: linear {flops[name] / 1e9:.1f} GFLOP/s, attention {attention[name] / 1e9:.1f} GFLOP/s")
    points = []
    for n in ELEMENTS[device_type][:cut]:
        a = torch.randn(n, device=dev)
        b = torch.randn(n, device=dev)
        points.append((3.0 * 4 * n, timed(lambda: torch.add(a, b), device_type, repeats, what=what)))
    _, per_byte = fit_line(*zip(*points))
    rows["add float32"] = points
    bandwidth = 1.0 / per_byte
    progress(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s")
    pointwise = measure_pointwise(dev, device_type, repeats, what) if device_type != "cuda" else ()
    for key, fwd, bwd in pointwise:
        rows[f"pointwise {key} (elements, forward s, backward s)"] = [(POINTWISE_ELEMENTS, fwd, bwd)]
    # a tiny op's forward, and forward plus backward, in a chain like a model's graph
    x = torch.randn(8, device=dev, requires_grad=True)
    chain = 32

    def forward():
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    fwd = timed(forward, device_type, repeats, what=what)
    both = timed(lambda: forward().sum().backward(), device_type, repeats, what=what)
    op_latency = fwd / chain
    rows["tiny op"] = [(chain, fwd), (chain, both)]
    progress(f"op latency: {op_latency * 1e6:.1f} us forward, {(both - fwd) / chain * 1e6:.1f} us backward")
    # torch's AdamW step (as the runtime builds it: torch's default, and the fused kernel the
    # backend "inductor" runs) over k parameters of e elements each
    optimizer = {}
    for fused in (False, True):
        points = []
        for k, e in ((4, 2**10), (32, 2**10), (4, 2**20), (16, 2**18)):
            params = [torch.zeros(e, device=dev, requires_grad=True) for _ in range(k)]
            for p in params:
                p.grad = torch.randn(e, device=dev)
            opt = torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if fused else {}))
            points.append((k, k * e, timed(opt.step, device_type, repeats, what=what)))
        ks, es, ts = (np.array(c, float) for c in zip(*points))
        w = 1.0 / ts   # relative error: the small steps fix the per-parameter cost, the large the per-element
        (per_param, per_element), *_ = np.linalg.lstsq(np.stack([ks, es], 1) * w[:, None], ts * w, rcond=None)
        name = "adamw fused" if fused else "adamw"
        rows[f"{name} (params, elements)"] = points
        progress(f"{'AdamW, fused' if fused else 'AdamW'}: {max(per_param, 0) * 1e6:.1f} us per parameter, "
                  f"{max(per_element, 1e-15) * 1e9:.2f} ns per element")
        optimizer[fused] = (max(float(per_param), 0.0), max(float(per_element), 1e-15))
    return {"flops": flops, "attention": attention, "mem_bandwidth": bandwidth, "op_latency": op_latency, "points": rows,
            "pointwise": tuple((k, f / POINTWISE_ELEMENTS, b / POINTWISE_ELEMENTS) for k, f, b in pointwise),
            "optimizer": optimizer[False], "optimizer_fused": optimizer[True]}
