"""ZeRO-3 at run time: gathered weights are not kept between forward and backward.

A parameter stored Shard on an axis where its op reads it whole is all-gathered just
before use (a move inserted by passes.collectives; its backward reduce-scatters the
gradient).  Autograd would keep the gathered weight alive until backward because the op
saves it; with reshard_after_forward the saved weight is packed as "gather this shard
again" instead (torch.autograd.graph.saved_tensors_hooks) and re-gathered when backward
unpacks it, so between forward and backward a rank holds only its shards, as the cost
model assumes (it charges the second all-gather in backward).  (Within one forward the
gathered weights are held until it ends: saved tensors are recognised by their storage,
which must not be recycled for another tensor meanwhile.)

The gathers of the next parameters are prefetched: when the k-th gather of a forward runs,
the (k+1)-th is started asynchronously, so it overlaps with the compute in between
(moves that are exactly one all-gather; others run when reached).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.fx as fx

from autopar.passes.collectives import move
from autopar.passes.redistribute import plan_redistribute, redistribute_local

from .recompute import note_saved


def _identity(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a move node's forward leaves its tensor as it is (same layout on both sides)."""
    m = getattr(gm, node.args[1].target)
    return tuple(m.src) == tuple(m.dst)


class Regather:
    """Per compiled module: which forward gathers are parameters, their prefetch and the
    saved-tensor hooks.  Graph nodes `move(param, m, groups)` whose forward is only
    all-gathers become `regather.gather(k, param, m, groups)`."""

    def __init__(self, gm: fx.GraphModule, param_placeholders: set, reshard_after_forward: bool, groups):
        self.reshard = reshard_after_forward
        self.groups = groups
        self.sources: dict[int, tuple] = {}   # storage pointer of a gathered weight -> how to gather it
        self.order: list = []                 # (placeholder name, Move) of the gathers, in graph order
        self.pending: dict[int, tuple] = {}   # k -> (work, buffer) of a prefetched gather
        self.feed: dict = {}                  # placeholder name -> this forward's shard tensor
        self.active = False                   # inside forward (a recomputed layer gathers in backward too)
        self.counts = {"gathered": 0, "prefetched": 0, "regathered": 0}  # since compile
        sizes = [groups.size(a) for a in range(groups.ndim)]
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not move:
                continue
            src = node.args[0]
            while src.op == "call_function" and src.target is move and _identity(gm, src):
                src = src.args[0]   # (a tied weight's gradient-sum point: forward is the weight)
            if src.op != "placeholder" or src.target not in param_placeholders:
                continue
            m = getattr(gm, node.args[1].target)
            steps = plan_redistribute(m.src, m.dst, sizes)  # local slices too: a prefetch must do all
            collective = [s for s in steps if s.is_collective]
            if not collective or any(s.kind != "all_gather" for s in collective):
                continue
            k = len(self.order)
            self.order.append((src.target, m, steps))
            node.target = self.gather
            node.args = (k,) + tuple(node.args)
        gm.recompile()

    def __bool__(self) -> bool:
        return bool(self.order)

    # --- forward ----------------------------------------------------------------------------
    def gather(self, k: int, x: torch.Tensor, m, groups) -> torch.Tensor:
        prefetched = self.pending.pop(k, None)
        self._prefetch(k + 1)
        self.counts["gathered"] += 1
        if prefetched is not None:
            self.counts["prefetched"] += 1
            out = _Gathered.apply(x, m, groups, prefetched)
        else:
            out = move(x, m, groups)
        if self.reshard and self.active:  # the entry holds `out` so its memory is not reused for another
            self.sources[out.untyped_storage().data_ptr()] = (x, m, out)  # tensor before forward ends
        return out

    def _prefetch(self, k: int) -> None:
        if k >= len(self.order) or k in self.pending:
            return
        name, m, steps = self.order[k]
        x = self.feed.get(name)
        if x is None or len(steps) != 1:
            return
        step = steps[0]
        group = self.groups.group(step.axis)
        n = self.groups.size(step.axis)
        inp = x.detach().movedim(step.dim, 0).contiguous()
        buf = inp.new_empty((n * inp.shape[0],) + tuple(inp.shape[1:]))
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = fn(buf, inp, group=group, async_op=True)
        self.pending[k] = (work, buf, step.dim)

    @contextlib.contextmanager
    def forward(self, feed: dict):
        """Around one forward: `feed` maps placeholder names to the tensors fed to them."""
        self.feed = feed
        self.active = True
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if self.reshard \
            else contextlib.nullcontext()
        try:
            with hooks:
                yield
        finally:
            for work, _, _ in self.pending.values():
                work.wait()
            self.pending.clear()
            self.sources.clear()
            self.feed = {}
            self.active = False

    # --- saved tensors ----------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        source = self.sources.get(t.untyped_storage().data_ptr())
        if source is None:
            note_saved(t)
            return t
        x, m, _ = source
        return _Recipe(x, m, self.groups, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, packed):
        if not isinstance(packed, _Recipe):
            return packed
        self.counts["regathered"] += 1
        full = redistribute_local(packed.x.detach(), packed.m.src, packed.m.dst, packed.groups)
        return full.as_strided(packed.size, packed.stride, packed.offset)


class _Recipe:
    __slots__ = ("x", "m", "groups", "size", "stride", "offset")

    def __init__(self, x, m, groups, size, stride, offset):
        self.x, self.m, self.groups = x, m, groups
        self.size, self.stride, self.offset = size, stride, offset


class _Gathered(torch.autograd.Function):
    """A prefetched all-gather: forward waits for it; backward is the move's backward."""

    @staticmethod
    def forward(ctx, x, m, groups, prefetched):
        ctx.m, ctx.groups = m, groups
        work, buf, dim = prefetched
        work.wait()
        return buf.movedim(0, dim).contiguous() if dim else buf

    @staticmethod
    def backward(ctx, grad):
        m = ctx.m
        return redistribute_local(grad, m.grad_src, m.grad_dst, ctx.groups), None, None, None

