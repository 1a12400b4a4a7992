"""Grouped linear layers as one planned op: `autopar::grouped_linear`.

Some mixture-of-experts code keeps one stacked weight per projection, `weight [experts,
out, in]`, and calls it with the routed rows sorted by expert and each expert's row count
(Hugging Face's JetMoE, for its experts and its attention experts; ScatterMoE-style code):
`linear(rows, sizes)`, where `sizes` is a `.tolist()` of the counts, known only when the
step runs.  While tracing, such a module runs this op instead, each row carrying its
expert's id (trace/experts.row_experts, fixed shapes):

    grouped_linear(x [rows, in], ids [rows], weight [E, out, in]) -> [rows, out]:
        y[r] = weight[ids[r]] @ x[r]  (zero where ids[r] names no expert)

Rows are independent, so the op splits like a linear layer: rows (data parallel, the
weight's gradient a Partial sum), the output features (weight Shard(1)) or the input
features (weight Shard(2), output Partial); the expert dim never splits
(autopar/ops/rules.py).  The op's own implementation is the one-device reference: a loop
over experts, exact.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from autopar.trace.experts import row_experts, takes_rows_and_counts
from autopar.trace.patches import listed_counts

log = logging.getLogger("autopar")


def grouped_linear_math(x, ids, weight):
    """Each row times its expert's weight (differentiable); rows of no expert stay zero."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for e in range(weight.shape[0]):
        rows = (ids == e).nonzero().squeeze(-1)
        if rows.numel():
            out = out.index_put((rows,), x[rows] @ weight[e].T)
    return out


@torch.library.custom_op("autopar::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grouped_linear_math(x, ids, weight)


@grouped_linear.register_fake
def _(x, ids, weight):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("autopar::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(grad: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward as one op, for shapes and the FLOP count on meta tensors."""
    raise NotImplementedError("autopar::grouped_linear_backward runs on meta tensors only")


@grouped_linear_backward.register_fake
def _(grad, x, ids, weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, ids, weight = inputs
    ctx.save_for_backward(x, ids, weight)


def _backward(ctx, grad):
    x, ids, weight = ctx.saved_tensors
    if x.device.type == "meta":
        gx, gw = grouped_linear_backward(grad, x, ids, weight)
        return gx, None, gw
    gx = grad.new_zeros(x.shape)
    gw = torch.zeros_like(weight)
    for e in range(weight.shape[0]):
        rows = (ids == e).nonzero().squeeze(-1)
        if rows.numel():
            g = grad[rows]
            gx = gx.index_put((rows,), g @ weight[e])
            gw[e] = g.T @ x[rows]
    return gx, None, gw


grouped_linear.register_autograd(_backward, setup_context=_setup)

try:  # the FLOP counter the cost model reads
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.autopar.grouped_linear)
    def _flops(x_shape, ids_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * x_shape[0] * weight_shape[1] * weight_shape[2]

    @register_flop_formula(torch.ops.autopar.grouped_linear_backward)
    def _backward_flops(grad_shape, x_shape, ids_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
        return 4 * x_shape[0] * weight_shape[1] * weight_shape[2]
except (ImportError, TypeError):  # pragma: no cover - an older torch without custom formulas
    pass


def grouped_linear_weight(module):
    """The module's own stacked weight [E, out, in] when it is a grouped linear layer: that
    one parameter and a forward taking (rows, sizes); else None."""
    own = list(module.named_parameters(recurse=False))
    if len(own) != 1 or own[0][0] != "weight" or own[0][1].dim() != 3:
        return None
    return own[0][1] if takes_rows_and_counts(module) else None


def _reproduces(module, weight) -> bool:
    """Whether the op reproduces the module: it runs once on a few random rows with random
    weights of its shape (small ones distinct per expert, large ones one expert's repeated)."""
    n_experts, out, width = weight.shape
    gen = torch.Generator().manual_seed(0)
    if weight.numel() <= 1 << 22:
        probe = torch.randn(weight.shape, generator=gen)
    else:
        probe = torch.randn((1, out, width), generator=gen).expand(weight.shape)
    counts = [0] * n_experts
    counts[0], counts[-1] = 2, 1
    rows = torch.randn(3, width, generator=gen)
    try:
        with torch.no_grad():
            expected = torch.func.functional_call(module, {"weight": probe}, (rows, counts))
    except Exception:
        return False
    got = grouped_linear_math(rows, row_experts(torch.tensor(counts), 3), probe)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-6)


def _forward(module, rows, sizes):
    counts = sizes if isinstance(sizes, torch.Tensor) else listed_counts(sizes, rows.device)
    return grouped_linear(rows, row_experts(counts, rows.shape[0]), module.weight)


@contextlib.contextmanager
def grouped_linears_as_op(model: torch.nn.Module):
    """While tracing, every grouped linear layer the op reproduces runs through it."""
    patched = []
    for name, module in model.named_modules():
        weight = grouped_linear_weight(module)
        if weight is None:
            continue
        if not _reproduces(module, weight):
            log.warning("autopar: grouped linear layer %s traced as written: the op (rows times their "
                        "expert's weight) does not reproduce it", name)
            continue
        module.forward = _forward.__get__(module)
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
