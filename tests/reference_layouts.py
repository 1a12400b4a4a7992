"""A reference for layouts, built from the global tensor: this rank's local tensor of a
layout, and the check that every rank's local tensors are a layout of a global tensor.

The global tensor is integer-valued float64 and Partial pieces are integer summands, so every
sum is exact and results compare with torch.equal, not a tolerance.
"""
import itertools

import torch
from torch.distributed.tensor import Shard

SHAPE = (8, 12, 4)  # the default global shape: every dim divides by 4


def global_tensor(seed: int, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-100, 100, shape, generator=g).double()


def shard_slot(placements, coords, sizes, dim):
    """(index, count): which of `count` equal pieces of `dim` this rank holds (nesting rule)."""
    index, count = 0, 1
    for a, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == dim:
            index, count = index * sizes[a] + coords[a], count * sizes[a]
    return index, count


def local_of(glob, placements, coords, sizes, seed=7):
    """This rank's local tensor of `glob` laid out as `placements`. A Partial axis of size n
    splits the value into n integer summands: random ones on coordinates < n-1, the rest last."""
    t = glob
    for d in range(glob.dim()):
        index, count = shard_slot(placements, coords, sizes, d)
        piece = t.size(d) // count
        t = t.narrow(d, index * piece, piece)
    for a, p in enumerate(placements):
        if p.is_partial() and sizes[a] > 1:
            g = torch.Generator().manual_seed(1000 * seed + a)
            noise = torch.randint(-50, 50, (sizes[a] - 1, *t.shape), generator=g).double()
            c = coords[a]
            t = noise[c] if c < sizes[a] - 1 else t - noise.sum(0)
    return t.clone()


def global_of(locals_, placements, sizes, replica):
    """The global tensor from every rank's local tensor (`locals_`: coords -> tensor), summing
    over Partial axes and reading the ranks whose Replicate-axis coordinates are `replica`."""
    any_local = next(iter(locals_.values()))
    shape = [any_local.size(d) * shard_slot(placements, [0] * len(sizes), sizes, d)[1]
             for d in range(any_local.dim())]
    out = torch.zeros(shape, dtype=any_local.dtype)
    for coords, t in locals_.items():
        if any(coords[a] != replica[a] for a, p in enumerate(placements) if p.is_replicate()):
            continue
        region = out
        for d in range(t.dim()):
            index, _ = shard_slot(placements, coords, sizes, d)
            region = region.narrow(d, index * t.size(d), t.size(d))
        region += t
    return out


def check_layout(glob, per_rank, placements, sizes):
    """Problems with `per_rank` [(coords, local)] as the layout `placements` of `glob`."""
    problems = []
    locals_ = {tuple(c): t for c, t in per_rank}
    if not any(p.is_partial() for p in placements):
        for c, t in locals_.items():
            if not torch.equal(t, local_of(glob, placements, c, sizes)):
                problems.append(f"rank at {c}: wrong local tensor")
    r_axes = [a for a, p in enumerate(placements) if p.is_replicate()]
    for choice in itertools.product(*(range(sizes[a]) for a in r_axes)):
        replica = [0] * len(sizes)
        for a, c in zip(r_axes, choice):
            replica[a] = c
        if not torch.equal(global_of(locals_, placements, sizes, replica), glob):
            problems.append(f"replica {replica}: sum/assembly differs from the global tensor")
    return problems
