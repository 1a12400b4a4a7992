"""The autograd steps of ZeRO-3's gathered weights (runtime/regions/reshard.Regather): a prefetched
all-gather, an offloaded weight copied to the device, a weight handed out by its bucket's
gather; and the recipe a saved gathered weight is packed as, to be gathered again in
backward.
"""
from __future__ import annotations

import torch

from autopar.passes.redistribute import redistribute_local


class Recipe:
    """A gathered weight saved for backward as how to gather it again: its shard x, the
    move m (None: an offloaded weight fetched as stored) and the saved view's geometry."""

    __slots__ = ("x", "m", "groups", "size", "stride", "offset", "k")

    def __init__(self, x, m, groups, size, stride, offset, k=None):
        self.x, self.m, self.groups = x, m, groups
        self.size, self.stride, self.offset = size, stride, offset
        self.k = k   # a grouped gather's index (its bucket is gathered again at once), or None


class Gathered(torch.autograd.Function):
    """A prefetched all-gather: forward waits for it; backward is the move's backward."""

    @staticmethod
    def forward(ctx, x, m, groups, prefetched):
        ctx.m, ctx.groups, ctx.home = m, groups, x.device
        work, buf, dim = prefetched
        work.wait()
        return buf.movedim(0, dim).contiguous() if dim else buf

    @staticmethod
    def backward(ctx, grad):
        m = ctx.m
        return redistribute_local(grad, m.grad_src, m.grad_dst, ctx.groups).to(ctx.home), None, None, None


class Fetched(torch.autograd.Function):
    """An offloaded weight copied to the device (and moved from layout m.src to m.dst, m
    None: as stored); backward brings the gradient back to the shard's home."""

    @staticmethod
    def forward(ctx, x, m, groups, regather):
        ctx.m, ctx.groups, ctx.home = m, groups, x.device
        y = regather.device_copy(x, offloaded=True)
        return y if m is None else redistribute_local(y, m.src, m.dst, groups)

    @staticmethod
    def backward(ctx, grad):
        m = ctx.m
        if m is not None:
            grad = redistribute_local(grad, m.grad_src, m.grad_dst, ctx.groups)
        return grad.to(ctx.home), None, None, None


class GroupGathered(torch.autograd.Function):
    """A grouped gather: forward hands out the weight its bucket gathered; backward passes
    the whole gradient to the bucket's reduce-scatter (Regather.add_grad) and returns zero
    for the shard, to which Regather.finish adds the reduced piece."""

    @staticmethod
    def forward(ctx, x, regather, k):
        ctx.regather, ctx.k, ctx.home = regather, k, x.device
        ctx.x = regather.leaf(k, x)   # (the shard parameter, a leaf: not saved through the saved-tensor hooks)
        return regather.take(k)

    @staticmethod
    def backward(ctx, grad):
        ctx.regather.add_grad(ctx.k, ctx.x, grad)
        return torch.zeros(ctx.x.shape, dtype=ctx.x.dtype, device=ctx.home), None, None
