"""Per-rank linear layers on a grid of mesh axes (2D, 2.5D, 3D) and split norms; the
strategies are described in autopar/ops/grid_rule.py.

grid_linear: x's local block is gathered over axis j along `x_dim` (None: x arrived gathered,
a move its readers share, and its gradient goes back Partial over j), W's over axis i along
`w_dim`, the product is reduce-scattered over axis l along `y_dim` (3D only), then the bias
(split like the output's last dim) is added.  Only the local blocks are kept for backward,
which gathers them again: the gradient of the output is gathered over l, dx is
reduce-scattered over j and dW over i.  The bias gradient is the local row sum (a partial
sum over the row axes, which the plan's gradient sync adds up).

split_norm: layer_norm / rms_norm with the normalized dim split over `axes`: the row
statistics are summed over them (the mean first, then the variance from it: the two-pass
form, as accurate as one device's), and backward's two row sums likewise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.passes.redistribute import all_gather_dim, reduce_scatter_dim

MOVED = {"bytes": 0}   # bytes this rank received or sent in grid collectives (read by tests)


def _gather(t, dim, axis, groups):
    if dim is None:   # (x arrived gathered)
        return t
    n = groups.size(axis)
    MOVED["bytes"] += t.numel() * t.element_size() * (n - 1)
    return all_gather_dim(t, dim, groups.group(axis), n)


def _scatter(t, dim, axis, groups):
    if dim is None:   # (x arrived gathered: its gradient goes back Partial)
        return t
    n = groups.size(axis)
    MOVED["bytes"] += t.numel() * t.element_size() * (n - 1) // n
    return reduce_scatter_dim(t, dim, groups.group(axis), n, groups.coordinate(axis), axis)


class _GridLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, i, j, l, x_dim, w_dim, y_dim, groups):
        y = F.linear(_gather(x, x_dim, j, groups), _gather(w, w_dim, i, groups))
        if l is not None:
            y = _scatter(y, y_dim, l, groups)
        if b is not None:
            y = y + b
        ctx.save_for_backward(x, w)
        ctx.axes = (i, j, l, x_dim, w_dim, y_dim, groups)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        i, j, l, x_dim, w_dim, y_dim, groups = ctx.axes
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        db = dy.reshape(-1, dy.size(-1)).sum(0) if need_b else None
        if l is not None:
            dy = _gather(dy.contiguous(), y_dim, l, groups)
        dx = dw = None
        if need_x:
            dx = _scatter(dy.matmul(_gather(w, w_dim, i, groups)), x_dim, j, groups)
        if need_w:
            xg = _gather(x, x_dim, j, groups)
            dwg = dy.reshape(-1, dy.size(-1)).t().matmul(xg.reshape(-1, xg.size(-1)))
            dw = _scatter(dwg, w_dim, i, groups)
        return dx, dw, db, None, None, None, None, None, None, None


def grid_linear(x, w, b, i: int, j: int, l, x_dim: int, w_dim: int, y_dim: int, groups):
    """linear(x, w, b) with x, w, b and the output split over a grid of axes (module doc)."""
    return _GridLinear.apply(x, w, b, i, j, l, x_dim, w_dim, y_dim, groups)


def _row_sum(t, group):
    dist.all_reduce(t, group=group)
    return t


class _SplitNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps, width, rms, group):
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if rms:
            mean = None
            centred = work
        else:
            mean = _row_sum(work.sum(-1, keepdim=True), group) / width
            centred = work - mean
        var = _row_sum(centred.square().sum(-1, keepdim=True), group) / width
        rstd = torch.rsqrt(var + eps)
        y = centred * rstd
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        ctx.save_for_backward(x, rstd, mean if mean is not None else rstd.new_empty(0), w)
        ctx.rms, ctx.width, ctx.group = rms, width, group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, mean, w = ctx.saved_tensors
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xhat = (work if ctx.rms else work - mean) * rstd
        g = dy.to(work.dtype)
        dw = (g * xhat).reshape(-1, g.size(-1)).sum(0).to(w.dtype) if w is not None and ctx.needs_input_grad[1] \
            else None
        db = g.reshape(-1, g.size(-1)).sum(0).to(dy.dtype) if ctx.needs_input_grad[2] else None
        if w is not None:
            g = g * w
        dx = None
        if ctx.needs_input_grad[0]:
            if ctx.rms:
                s = _row_sum((g * xhat).sum(-1, keepdim=True), ctx.group) / ctx.width
                dx = rstd * (g - xhat * s)
            else:
                sums = _row_sum(torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1),
                                ctx.group) / ctx.width
                dx = rstd * (g - sums[..., :1] - xhat * sums[..., 1:])
            dx = dx.to(x.dtype)
        return dx, dw, db, None, None, None, None


def split_norm(x, w, b, eps, width: int, rms: bool, axis: int, groups):
    """layer_norm (rms: rms_norm) of x over its last dim, split over mesh `axis` (`width`:
    the whole dim's size; eps None: rms_norm's default, the dtype's machine epsilon)."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return _SplitNorm.apply(x, w, b, float(eps), width, rms, groups.group(axis))
