"""Causal attention with a sliding window, as one op the planner can split.

Sliding-window models (Mistral, Gemma-2's local layers, Qwen2 with `use_sliding_window`)
hand attention a dense mask, and a dense mask could say anything: the sequence could not
be split around it.  While tracing (autopar/trace/export.py) such a layer runs through the op
`autopar::window_attention(q, k, v, window, scale, gqa)` instead: query i sees key j when
i - window < j <= i.  Its strategies are attention's (batch, heads, ring, Ulysses); ring
attention skips the key blocks wholly outside every query's window.

q [b, h, s, e], k and v [b, kv, s, e] (gqa: h a multiple of kv, head i reads kv head
i // (h / kv)).  Backward recomputes the forward under autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] True where a query at q_pos sees a key at k_pos."""
    diff = q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)
    return (diff >= 0) & (diff < window)


def _math(q, k, v, window: int, scale: float, gqa: bool):
    pos = torch.arange(q.size(2), device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(pos, pos, window), scale=scale,
                                          enable_gqa=gqa)


@torch.library.custom_op("autopar::window_attention", mutates_args=())
def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float,
                     gqa: bool) -> torch.Tensor:
    return _math(q, k, v, window, scale, gqa)


@window_attention.register_fake
def _(q, k, v, window, scale, gqa):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.custom_op("autopar::window_attention_backward", mutates_args=())
def window_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                              scale: float, gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward as one op, for shapes and FLOPs on meta tensors."""
    raise NotImplementedError("autopar::window_attention_backward runs on meta tensors only")


@window_attention_backward.register_fake
def _(grad, q, k, v, window, scale, gqa):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, window, scale, gqa = inputs
    ctx.save_for_backward(q, k, v)
    ctx.args = (window, scale, gqa)


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    if q.device.type == "meta":
        return window_attention_backward(grad, q, k, v, *ctx.args) + (None, None, None)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = _math(*leaves, *ctx.args)
        grads = torch.autograd.grad(out, leaves, grad)
    return tuple(grads) + (None, None, None)


window_attention.register_autograd(_backward, setup_context=_setup)


def _flops(q_shape, v_shape, window: int) -> int:
    """Two matmuls over the keys each query sees: sum over i of min(i + 1, window)."""
    b, h, s, e = q_shape
    seen = sum(min(i + 1, window) for i in range(min(s, window))) + max(0, s - window) * window
    return 2 * b * h * seen * (e + v_shape[-1])


try:  # the FLOP counter the cost model reads
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.autopar.window_attention)
    def _window_flops(q_shape, k_shape, v_shape, window, *args, out_shape=None, **kwargs) -> int:
        return _flops(q_shape, v_shape, window)

    @register_flop_formula(torch.ops.autopar.window_attention_backward)
    def _window_backward_flops(grad_shape, q_shape, k_shape, v_shape, window, *args, out_shape=None,
                               **kwargs) -> int:
        return 5 * _flops(q_shape, v_shape, window) // 2  # scores again, then four products of their size
except (ImportError, TypeError):  # pragma: no cover - an older torch without custom formulas
    pass
