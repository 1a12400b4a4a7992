"""Jobs for tests/test_sequence_parallel.py that run on every rank of a WorkerPool."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import autopar
from autopar.trace.attention import window_attention
from autopar.report.plan import Plan
from rt_cases import build_case


def saved_activation_bytes(spec: tuple, plan_dict: dict) -> dict:
    """Bytes this rank keeps for backward in one training step of the plan
    (runtime.regions.recompute.measure_saved), and the plan's predicted activation memory."""
    from autopar.runtime.regions.recompute import measure_saved
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    return {"measured": float(measure_saved(cm, *args, **kwargs)), "predicted": plan.predicted.memory["activations"]}


def ring_blocks_and_numerics(n_heads: int, kv_heads: int, seq: int, causal: bool, seed: int = 0,
                             window: int | None = None) -> dict:
    """Ring attention on this rank's slice of a random sequence against F.scaled_dot_product_attention
    of the whole one: the largest differences of output and q, k, v gradients, and the score
    blocks this rank computed (forward)."""
    import torch.distributed as dist

    from autopar.passes import attention_ops as A
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n_heads, seq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, seq, 8, generator=g, dtype=torch.float64)
    w = torch.randn(2, n_heads, seq, 8, generator=g, dtype=torch.float64)
    n, r = dist.get_world_size(), dist.get_rank()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    if window is None:
        ref = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=kv_heads != n_heads)
    else:
        ref = window_attention(*whole, window, 8 ** -0.5, kv_heads != n_heads)
    (ref * w).sum().backward()
    part = [t.chunk(n, 2)[r].clone().requires_grad_() for t in (q, k, v)]
    before = A.BLOCKS["computed"]
    out = A.ring_attention(*part, causal=causal, scale=None, group=dist.group.WORLD, window=window)
    blocks = A.BLOCKS["computed"] - before
    (out * w.chunk(n, 2)[r]).sum().backward()
    diff = {"out": float((out - ref.chunk(n, 2)[r]).detach().abs().max())}
    for name, a, b in zip("qkv", part, whole):
        diff[name] = float((a.grad - b.grad.chunk(n, 2)[r]).abs().max())
    return {"blocks": blocks, "diff": diff}
