"""What one tensor's layout means on a mesh, written once for every stage.

A layout is one placement per mesh axis (torch.distributed.tensor's vocabulary):
`Shard(d)` splits dim d over the axis, `Replicate()` gives every rank the whole tensor,
`Partial()` gives every rank a summand of it.  The cost model, the solver, the passes and
the runtime all ask the same questions of a layout (how large is a rank's piece, where does
its gradient go, how is it written in a plan file); the answers live here.

    local_shape((8, 64), (Shard(0), Replicate()), (4, 2)) == (2, 64)
    grad_target(Partial()) == Replicate()
    show_placements((Shard(0), Partial())) == "(S(0), P)"
"""
from __future__ import annotations

import math
import re

from torch.distributed.tensor import Partial, Replicate, Shard


def local_shape(shape, placements, mesh_shape) -> tuple:
    """The shape a rank holds of a tensor of global `shape` laid out as `placements`: each
    Shard divides its dim by its axis's size (rounding down, as the planner's even splits
    do); a Shard of a dim the tensor lacks is ignored."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard) and 0 <= p.dim < len(out):
            out[p.dim] //= n
    return tuple(out)


def local_shape_even(shape, placements, mesh_shape) -> tuple:
    """local_shape, for a layout that must split evenly: raises ValueError naming the dim,
    the shape and the axis size where a Shard does not divide its dim."""
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard) and shape[p.dim] % n:
            raise ValueError(f"dim {p.dim} of shape {tuple(shape)} does not divide by {n}")
    return local_shape(shape, placements, mesh_shape)


def local_shape_ceil(shape, placements, mesh_shape) -> tuple:
    """local_shape of an uneven split as the largest rank holds it (each Shard keeps
    ceil(size / n)): the piece a kernel's time is set by."""
    out = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard) and 0 <= p.dim < len(out):
            out[p.dim] = math.ceil(out[p.dim] / n)
    return tuple(out)


def local_numel(shape, placements, mesh_shape) -> float:
    """Elements a rank holds (fractional where a split is uneven: the mean over ranks)."""
    numel = math.prod(shape) if shape else 1
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            numel /= n
    return numel


def same_local_shape(a, b) -> bool:
    """Whether layouts a and b give every rank a local tensor of the same shape (they differ
    at most in Replicate versus Partial).  Gradients are summed by autograd, which needs the
    sum's layout to have the tensor's own local shape."""
    return all((isinstance(x, Shard) and isinstance(y, Shard) and x.dim == y.dim)
               or (not isinstance(x, Shard) and not isinstance(y, Shard)) for x, y in zip(a, b))


def grad_target(placement):
    """The placement a tensor's gradient must reach: Shard stays Shard, Partial's is Replicate
    (a tensor that is a sum of ranks' pieces gets the whole gradient on each)."""
    return Replicate() if isinstance(placement, Partial) else placement


def grad_targets(placements) -> tuple:
    """grad_target of every axis of a layout."""
    return tuple(grad_target(p) for p in placements)


def placement_str(p) -> str:
    """A placement as a plan file and the printed plan write it: S(d), R or P."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    raise TypeError(f"not a placement: {p!r}")


def placement_from_str(text: str):
    """The placement placement_str wrote."""
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    m = re.fullmatch(r"S\((\d+)\)", text)
    if not m:
        raise ValueError(f"not a placement: {text!r}; write S(dim), R or P")
    return Shard(int(m.group(1)))


def show_placements(placements) -> str:
    """A layout as the printed plan writes it: (S(0), R)."""
    return "(" + ", ".join(placement_str(p) for p in placements) + ")"
