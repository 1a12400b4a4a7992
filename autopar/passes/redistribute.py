"""Move a tensor between placements on a device mesh, on local tensors with plain collectives.

Placements are torch's (`Shard(d)`, `Replicate()`, `Partial()`), one per mesh axis, nested
in mesh order: with (Shard(0), Shard(0)) on a (2, 4) mesh the rank at (i0, i1) holds chunk
i0*4 + i1 of 8 equal chunks of dim 0.  `Partial()` means the true value is the sum over
that axis of the local values.  Shards are always even.

The steps come from the one redistribution planner, `autopar.cost.redistribution` (its module
docstring has the rules); the cost model prices the same steps.  `redistribute_local`
runs them, and `Redistribute` / `redistribute` wrap them for autograd (the gradient
travels with its own pair of layouts, e.g. forward Shard(0) -> Replicate, backward
Partial -> Shard(0); an all-to-all's gradient is the inverse all-to-all).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Placement, Shard

from autopar.cost.redistribution import Step, placement_code, plan_redistribute

__all__ = ["AxisGroups", "MeshGroups", "Step", "plan_redistribute", "redistribute_local", "reduce_scatter_rows",
           "Redistribute", "redistribute"]


@runtime_checkable
class AxisGroups(Protocol):
    """What the runtime provides about this rank's place on the mesh.

    The rank of this process inside `group(axis)` must equal `coordinate(axis)`: collectives
    return pieces in group-rank order and the steps read them in coordinate order.
    """

    def size(self, axis: int) -> int: ...

    def coordinate(self, axis: int) -> int: ...

    def group(self, axis: int): ...

    def group_of(self, axes: tuple):
        """One process group over several mesh axes (an all-reduce over all of them)."""


class MeshGroups:
    """AxisGroups of a torch DeviceMesh (one process group per mesh axis)."""

    def __init__(self, mesh):
        self.mesh = mesh
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"this rank ({dist.get_rank()}) is not part of the mesh {mesh}")
        self._coord = tuple(coord)
        self._sizes = tuple(mesh.size(a) for a in range(mesh.ndim))
        self._groups = [mesh.get_group(a) for a in range(mesh.ndim)]
        for a, g in enumerate(self._groups):
            if dist.get_rank(g) != self._coord[a]:
                raise ValueError(f"mesh axis {a}: group rank {dist.get_rank(g)} differs from "
                                 f"mesh coordinate {self._coord[a]}")

    @property
    def ndim(self) -> int:
        return len(self._sizes)

    def size(self, axis: int) -> int:
        return self._sizes[axis]

    def coordinate(self, axis: int) -> int:
        return self._coord[axis]

    def group(self, axis: int):
        return self._groups[axis]

    def group_of(self, axes: tuple):
        """One process group over several mesh axes (this rank's peers on all of them)."""
        axes = tuple(axes)
        if len(axes) == 1:
            return self._groups[axes[0]]
        cache = self.__dict__.setdefault("_flat", {})
        if axes not in cache:
            names = self.mesh.mesh_dim_names
            if names is None:
                raise ValueError(f"a process group over mesh axes {axes} (one all-reduce over them) needs "
                                 f"a DeviceMesh with axis names: init_device_mesh(..., mesh_dim_names=...)")
            cache[axes] = self.mesh[tuple(names[a] for a in axes)]._flatten().get_group()
        return cache[axes]

    def __repr__(self) -> str:
        return f"MeshGroups(sizes={self._sizes}, coordinate={self._coord})"


# ---------------------------------------------------------------- placements

def normalize_placements(placements: Sequence[Placement], ndim: int | None, name: str) -> tuple:
    """Placements with Shard dims made non-negative against a tensor of rank `ndim`,
    checked (an unsupported placement or reduce op raises, naming it)."""
    out = []
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and ndim is not None:
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError(f"{name}[{axis}] = {p} names a dim of a {ndim}-d tensor that "
                                 f"does not exist")
            p = Shard(d)
        placement_code(p)
        out.append(p)
    return tuple(out)


# ---------------------------------------------------------------- execution

def all_gather_dim(t: Tensor, dim: int, group, n: int) -> Tensor:
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def _chunk(t: Tensor, dim: int, n: int, coord: int, axis: int) -> Tensor:
    if t.size(dim) % n:
        raise ValueError(f"cannot shard dim {dim} of size {t.size(dim)} (local shape "
                         f"{tuple(t.shape)}) evenly over mesh axis {axis} of size {n}: the plan "
                         f"must only split dims that divide, or the tensor must be padded")
    return t.narrow(dim, coord * (t.size(dim) // n), t.size(dim) // n)


def all_to_all_dims(t: Tensor, dim: int, to_dim: int, group, n: int, axis: int) -> Tensor:
    """Shard(dim) -> Shard(to_dim) on one mesh axis of n ranks: t [.., s, .., m, ..] (s on
    dim, m on to_dim) is cut into n pieces along to_dim, piece r goes to the group's rank r,
    and the n pieces received are joined along dim in rank order: [.., n*s, .., m/n, ..].
    One `all_to_all_single` (gloo and NCCL both run it) on a to_dim-first copy."""
    _chunk(t, to_dim, n, 0, axis)  # divisibility check with a clear message
    send = t.unflatten(to_dim, (n, t.size(to_dim) // n)).movedim(to_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.movedim(0, dim).flatten(dim, dim + 1)


def _all_reduce(t: Tensor, group, owned: bool) -> Tensor:
    """Partial -> Replicate, in place on a contiguous buffer of our own (`owned`: t is one)."""
    if not (owned and t.is_contiguous()):
        t = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(t, group=group)
    return t


def _zero_pad(t: Tensor, dim: int, n: int, coord: int) -> Tensor:
    shape = list(t.shape)
    shape[dim] *= n
    out = t.new_zeros(shape)
    out.narrow(dim, coord * t.size(dim), t.size(dim)).copy_(t)
    return out


def reduce_scatter_rows(table: Tensor, group, index: int, native: bool | None = None, async_op: bool = False):
    """table [n, m], Partial over the group's n ranks: sum it and keep row `index` (this
    rank's place in the group).  Gloo emulates reduce-scatter with an all-reduce anyway, so
    there we all-reduce `table` in place (pass a buffer of your own) and take the row;
    elsewhere a real reduce_scatter_tensor.  Returns (work or None, row); the row is valid
    after work.wait()."""
    if native is None:
        native = dist.get_backend(group) != "gloo"
    if not native:
        work = dist.all_reduce(table, group=group, async_op=async_op)
        return work, table[index]
    row = table.new_empty(table.shape[1:])
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(row, table.reshape(-1), group=group, async_op=async_op)
    return work, row


def reduce_scatter_dim(t: Tensor, dim: int, group, n: int, coord: int, axis: int,
                    native: bool | None = None) -> Tensor:
    """Partial -> Shard(dim) on one axis (reduce_scatter_rows on a dim-first copy)."""
    _chunk(t, dim, n, coord, axis)  # divisibility check with a clear message
    inp = t.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    _, row = reduce_scatter_rows(inp.view(n, -1), group, coord, native)
    if row.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
        row = row.clone()   # (emulated: keep this rank's part alone, as a reduce-scatter leaves it)
    return row.view((inp.size(0) // n,) + tuple(inp.shape[1:])).movedim(0, dim)


def redistribute_local(x: Tensor, src: Sequence[Placement], dst: Sequence[Placement],
                       groups: AxisGroups) -> Tensor:
    """The local tensor of the global tensor that `x` is a piece of, laid out as `dst`.

    x: this rank's local tensor of a global tensor laid out as `src` (one placement per mesh
    axis of `groups`). Returns a new contiguous tensor (or `x` itself when nothing changes);
    `x` is never modified. No autograd: see `redistribute`.
    """
    src = normalize_placements(src, x.dim(), "src")
    dst = normalize_placements(dst, x.dim(), "dst")
    sizes = [groups.size(a) for a in range(len(src))]
    t, owned = x, False  # owned: t is a buffer of ours (not x, not a view of it)
    made = False         # some step made a new buffer (t is it, or a slice of it)
    for step in plan_redistribute(src, dst, sizes):
        made = made or step.kind != "chunk"
        a, d, n = step.axis, step.dim, sizes[step.axis]
        c = groups.coordinate(a)
        if step.kind == "all_gather":
            t, owned = all_gather_dim(t, d, groups.group(a), n), True
        elif step.kind == "zero_pad":
            t, owned = _zero_pad(t, d, n, c), True
        elif step.kind == "chunk":
            t = _chunk(t, d, n, c, a)
            owned = False  # a view: a later in-place all-reduce must copy first
        elif step.kind == "reduce_scatter":
            t, owned = reduce_scatter_dim(t, d, groups.group(a), n, c, a), True
        elif step.kind == "all_to_all":
            t, owned = all_to_all_dims(t, d, step.to_dim, groups.group(a), n, a), True
        elif step.kind == "all_reduce":  # one call over all its axes
            group = groups.group_of(step.axes) if step.span else groups.group(a)
            t, owned = _all_reduce(t, group, owned), True
        elif step.kind == "keep_on_first":
            if c != 0:
                t, owned = torch.zeros_like(t, memory_format=torch.contiguous_format), True
        else:  # pragma: no cover
            raise AssertionError(step)
    if made and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        # a slice of a buffer a collective made: keep this rank's part alone, so that a
        # reader saving it for backward does not hold the whole buffer
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


class Redistribute(torch.autograd.Function):
    """y = x moved from `src` to `dst`; its gradient, arriving laid out as `grad_src`, leaves
    laid out as `grad_dst` (usually the mirror: forward S(0) -> R, backward P -> S(0))."""

    @staticmethod
    def forward(ctx, x, src, dst, grad_src, grad_dst, groups):
        ctx.grad_src, ctx.grad_dst, ctx.groups = grad_src, grad_dst, groups
        return redistribute_local(x, src, dst, groups)

    @staticmethod
    def backward(ctx, grad):
        return redistribute_local(grad, ctx.grad_src, ctx.grad_dst, ctx.groups), \
            None, None, None, None, None


def redistribute(x: Tensor, src, dst, grad_src, grad_dst, groups: AxisGroups) -> Tensor:
    """`Redistribute.apply`, or `x` itself when neither the value nor its gradient moves."""
    if tuple(src) == tuple(dst) and tuple(grad_src) == tuple(grad_dst):
        return x
    return Redistribute.apply(x, tuple(src), tuple(dst), tuple(grad_src), tuple(grad_dst),
                              groups)
