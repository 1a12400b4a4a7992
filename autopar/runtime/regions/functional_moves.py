"""The plan's moves as functional collectives, so Inductor compiles them with the compute.

Under backend "inductor" every move (autopar/passes/collectives.move: forward src -> dst,
backward grad_src -> grad_dst) runs the same steps as under eager (the one redistribution
planner, autopar/cost/redistribution.plan_redistribute), each collective written as a
`torch.ops._c10d_functional` op followed by its `wait_tensor`: an all-gather is
`all_gather_into_tensor`, a reduce-scatter `reduce_scatter_tensor`, an all-to-all
`all_to_all_single`, an all-reduce `all_reduce`.  Those ops are values in the graph, not
in-place calls on a process group, so torch.compile traces them (the move's backward too,
as an autograd.Function), AOTAutograd puts them in the forward and backward graphs and
Inductor schedules them among the fused kernels.

Everything a step needs is fixed when the move is rewritten: its kind, dims, this rank's
coordinate and the process group's name, so the compiled region holds only constants.
The order of collectives within a group is the graph's, on every rank: Inductor's
compute/communication reordering (`reorder_for_compute_comm_overlap`) is left at torch's
default (off), which keeps the collectives of a region in program order.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from autopar.cost.redistribution import plan_redistribute
from autopar.passes.local_ops import in_dim_order
from autopar.passes.redistribute import normalize_placements

_F = torch.ops._c10d_functional


class FStep(NamedTuple):
    """One step with its group resolved: kind, dim, to_dim, ranks in the group, this
    rank's coordinate on the step's axis, the group's name."""

    kind: str
    dim: int | None
    to_dim: int | None
    n: int
    coord: int
    group: str


def steps_of(src, dst, ndim: int, groups) -> tuple:
    """The FSteps of moving a tensor of rank `ndim` from layout src to dst on this rank."""
    src, dst = normalize_placements(src, ndim, "src"), normalize_placements(dst, ndim, "dst")
    sizes = [groups.size(a) for a in range(len(src))]
    out = []
    for step in plan_redistribute(src, dst, sizes):
        a = step.axis
        group = groups.group_of(step.axes) if step.kind == "all_reduce" and step.span else groups.group(a)
        n = sizes[a] if not (step.kind == "all_reduce" and step.span) else group.size()
        out.append(FStep(step.kind, step.dim, step.to_dim, n, groups.coordinate(a), group.group_name))
    return tuple(out)


def run_steps(t: Tensor, steps: tuple) -> Tensor:
    """t moved by `steps` with functional collectives (differentiable only through
    FunctionalMove, which runs the gradient's own steps)."""
    for s in steps:
        d = s.dim
        if s.kind == "all_gather":   # gathered along dim 0, then the pieces joined along d
            got = _F.wait_tensor(_F.all_gather_into_tensor(t.contiguous(), s.n, s.group))
            t = got if d == 0 else got.view(s.n, *t.shape).movedim(0, d).flatten(d, d + 1)
        elif s.kind == "chunk":
            size = t.size(d) // s.n
            t = t.narrow(d, s.coord * size, size)
        elif s.kind == "zero_pad":
            shape = list(t.shape)
            before, after = list(shape), list(shape)
            before[d], after[d] = s.coord * shape[d], (s.n - 1 - s.coord) * shape[d]
            t = torch.cat([t.new_zeros(before), t, t.new_zeros(after)], dim=d)
        elif s.kind == "reduce_scatter":
            rows = t.movedim(d, 0).contiguous()
            got = _F.wait_tensor(_F.reduce_scatter_tensor(rows, "sum", s.n, s.group))
            t = got.movedim(0, d)
        elif s.kind == "all_to_all":
            send = t.unflatten(s.to_dim, (s.n, t.size(s.to_dim) // s.n)).movedim(s.to_dim, 0).contiguous()
            got = _F.wait_tensor(_F.all_to_all_single(send, [1] * s.n, [1] * s.n, s.group))   # (one row each)
            t = got.movedim(0, d).flatten(d, d + 1)
        elif s.kind == "all_reduce":
            t = _F.wait_tensor(_F.all_reduce(t.contiguous(), "sum", s.group))
        elif s.kind == "keep_on_first":
            if s.coord != 0:
                t = torch.zeros_like(t)
        else:  # pragma: no cover
            raise AssertionError(s)
    return t.contiguous()


class FunctionalMove(torch.autograd.Function):
    """Forward `steps`; the gradient runs `back`."""

    @staticmethod
    def forward(ctx, x, steps, back):
        ctx.back = back
        return run_steps(x, steps)

    @staticmethod
    def backward(ctx, grad):
        return run_steps(grad, ctx.back), None, None


def functional_move(m, groups, ndim: int, order: tuple | None = None):
    """x -> x moved as `m` (a passes.collectives.Move) with functional collectives, laid out
    in `order` like passes.collectives.move."""
    forward = steps_of(m.src, m.dst, ndim, groups) if tuple(m.src) != tuple(m.dst) else ()
    backward = steps_of(m.grad_src, m.grad_dst, ndim, groups) if tuple(m.grad_src) != tuple(m.grad_dst) else ()

    def moved(x):
        return in_dim_order(FunctionalMove.apply(x, forward, backward), order)
    moved.__name__ = "functional_move"
    return moved
