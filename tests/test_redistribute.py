"""redistribute_local and Redistribute on gloo ranks against a reference built from the global tensor.

The global tensor is integer-valued float64 and Partial pieces are integer summands, so every
sum is exact and results are compared with torch.equal, not a tolerance.
"""
import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.redistribute import (
    MeshGroups, Step, plan_redistribute, reduce_scatter_dim, redistribute, redistribute_local)
from distributed import WorkerError, device_mesh
from reference_layouts import SHAPE, check_layout, global_tensor, local_of, shard_slot

R, P = Replicate(), Partial()
S0, S1, S2 = Shard(0), Shard(1), Shard(2)
PER_AXIS = (R, P, S0, S1, S2)
MESHES = [(4,), (2, 2), (1, 4), (4, 1)]


def named_mesh(shape):
    """The pool's DeviceMesh of `shape`, with axis names: an all-reduce over several axes
    runs on one process group over them, which needs names."""
    return device_mesh(shape, ("a", "b", "c")[:len(shape)])


def test_reference_roundtrips():
    """local_of then global_of gives back the global tensor for every 2-axis layout."""
    glob, sizes = global_tensor(0), (2, 2)
    for pl in itertools.product(PER_AXIS, repeat=2):
        per_rank = [(c, local_of(glob, pl, c, sizes)) for c in itertools.product(range(2), range(2))]
        assert check_layout(glob, per_rank, pl, sizes) == [], pl
    # the nesting rule: (S0, S0) on (2, 4) puts chunk i0*4 + i1 of 8 on rank (i0, i1)
    assert torch.equal(local_of(glob, (S0, S0), (1, 2), (2, 4)), glob[6:7])


# ---------------------------------------------------------------- plans (no processes)

@pytest.mark.parametrize("src, dst, steps", [
    ((S0, S0), (R, S0), ["all_gather(dim 0, axis 1)", "all_gather(dim 0, axis 0)",
                         "chunk(dim 0, axis 1)"]),
    ((S0, S0), (S0, R), ["all_gather(dim 0, axis 1)"]),
    # two all-to-alls would wait on each other: axis 1 gathers, axis 0 swaps, axis 1 chunks
    ((S0, S1), (S1, S0), ["all_gather(dim 1, axis 1)", "all_to_all(dim 0 -> 1, axis 0)",
                          "chunk(dim 0, axis 1)"]),
    ((P, S0), (S0, R), ["all_gather(dim 0, axis 1)", "reduce_scatter(dim 0, axis 0)"]),
    # the all-reduce runs on the half-size tensor, before the gather
    ((S1, P), (R, R), ["all_reduce(axis 1)", "all_gather(dim 1, axis 0)"]),
    # ... and after the chunk when the destination is the smaller one
    ((P, R), (R, S2), ["chunk(dim 2, axis 1)", "all_reduce(axis 0)"]),
    ((S0, R), (P, P), ["zero_pad(dim 0, axis 0)", "keep_on_first(axis 1)"]),
    ((P, S1), (P, S1), []),
])
def test_plan_steps(src, dst, steps):
    assert [str(s) for s in plan_redistribute(src, dst, (2, 2))] == steps


def test_plan_skips_axes_of_size_one():
    assert plan_redistribute((S0, P), (R, R), (1, 4)) == (Step("all_reduce", 1),)


class OneRank:
    """AxisGroups for local-only steps: no process group is ever touched."""

    def __init__(self, sizes, coords):
        self.sizes, self.coords = sizes, coords

    def size(self, axis):
        return self.sizes[axis]

    def coordinate(self, axis):
        return self.coords[axis]

    def group(self, axis):
        raise AssertionError("a local-only redistribution used a process group")


def test_local_steps_without_collectives():
    glob = global_tensor(1)
    for coords in itertools.product(range(2), range(2)):
        g = OneRank((2, 2), coords)
        # R -> S: a slice; R -> P: the value on coordinate 0 of that axis, zeros elsewhere
        y = redistribute_local(glob, (R, R), (S2, S2), g)
        assert torch.equal(y, local_of(glob, (S2, S2), coords, (2, 2))) and y.is_contiguous()
        y = redistribute_local(glob, (R, R), (P, S1), g)
        expect = local_of(glob, (R, S1), coords, (2, 2)) * (coords[0] == 0)
        assert torch.equal(y, expect)
        # S -> P: the own chunk at its offset in zeros
        x = local_of(glob, (S0, R), coords, (2, 2))
        y = redistribute_local(x, (S0, R), (P, R), g)
        assert y.shape == glob.shape and torch.equal(y[4 * coords[0]:4 * coords[0] + 4], x)
        assert y.abs().sum() == x.abs().sum()


def test_uneven_shard_and_bad_placements_raise():
    g = OneRank((4,), (0,))
    with pytest.raises(ValueError, match="dim 1 of size 6 .* mesh axis 0 of size 4"):
        redistribute_local(torch.zeros(8, 6), (R,), (S1,), g)
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        redistribute_local(torch.zeros(8), (R,), (R, R), g)
    with pytest.raises(ValueError, match="does not exist"):
        redistribute_local(torch.zeros(8), (R,), (S1,), g)
    with pytest.raises(ValueError, match="only sum"):
        redistribute_local(torch.zeros(8), (Partial("max"),), (R,), g)


def test_redistribute_short_circuits():
    x = torch.ones(4, requires_grad=True)
    assert redistribute(x, (S0,), (S0,), (P,), (P,), OneRank((4,), (0,))) is x


# ---------------------------------------------------------------- on gloo ranks

def _redistribute_pairs(mesh_shape, pairs, seed):
    """Job: every (src, dst) on `mesh_shape`; returns (coords, [local result per pair], untouched)."""
    mesh = named_mesh(mesh_shape)
    groups, coords = MeshGroups(mesh), tuple(mesh.get_coordinate())
    glob, out, untouched = global_tensor(seed), [], True
    for src, dst in pairs:
        x = local_of(glob, src, coords, mesh_shape)
        before = x.clone()
        y = redistribute_local(x, src, dst, groups)
        assert y.is_contiguous(), (src, dst)
        untouched &= torch.equal(x, before)
        out.append(y)
    return coords, out, untouched


def _all_pairs(ndim):
    layouts = list(itertools.product(PER_AXIS, repeat=ndim))
    return [(s, d) for s in layouts for d in layouts]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_every_pair_of_layouts(pool4, mesh_shape):
    """All 25 (1-d) or 625 (2-d) (src, dst) pairs of {R, P, S0, S1, S2} per axis."""
    pairs, seed = _all_pairs(len(mesh_shape)), 3
    per_rank = pool4.run(_redistribute_pairs, mesh_shape, pairs, seed)
    glob = global_tensor(seed)
    assert all(untouched for _, _, untouched in per_rank), "redistribute_local modified its input"
    failures = []
    for i, (src, dst) in enumerate(pairs):
        problems = check_layout(glob, [(c, out[i]) for c, out, _ in per_rank], dst, mesh_shape)
        failures += [f"{src} -> {dst}: {p}" for p in problems]
    assert failures == [], f"{len(failures)} failures, first: " + "\n".join(failures[:10])


def test_two_ranks(pool2):
    pairs = _all_pairs(1)
    per_rank = pool2.run(_redistribute_pairs, (2,), pairs, 4)
    glob = global_tensor(4)
    for i, (src, dst) in enumerate(pairs):
        assert check_layout(glob, [(c, out[i]) for c, out, _ in per_rank], dst, (2,)) == [], \
            (src, dst)


def _reduce_scatter_both_ways(seed):
    """Job: Partial -> Shard(1) on axis 1 of (2, 2), native reduce_scatter vs all-reduce + chunk."""
    mesh = named_mesh((2, 2))
    x = global_tensor(seed + mesh.get_rank())
    c = mesh.get_coordinate()[1]
    return [reduce_scatter_dim(x, 1, mesh.get_group(1), 2, c, 1, native=n) for n in (True, False)]


def test_native_reduce_scatter_matches_fallback(pool4):
    per_rank = pool4.run(_reduce_scatter_both_ways, 5)
    for rank, (native, fallback) in enumerate(per_rank):
        peers = (rank - rank % 2, rank - rank % 2 + 1)  # ranks sharing axis 0's coordinate
        total = sum(global_tensor(5 + r) for r in peers)
        assert torch.equal(native, fallback)
        assert torch.equal(native, total[:, 6 * (rank % 2):6 * (rank % 2) + 6])


def _autograd_cases(mesh_shape, cases, seed):
    """Job: y = redistribute(x) and y.backward(dy) per case; returns (coords, [(y, x.grad)])."""
    mesh = named_mesh(mesh_shape)
    groups, coords = MeshGroups(mesh), tuple(mesh.get_coordinate())
    xs, dys = global_tensor(seed), global_tensor(seed + 1)
    out = []
    for src, dst, gsrc, gdst in cases:
        x = local_of(xs, src, coords, mesh_shape).requires_grad_()
        y = redistribute(x, src, dst, gsrc, gdst, groups)
        y.backward(local_of(dys, gsrc, coords, mesh_shape, seed=11))
        out.append((y.detach(), x.grad))
    return coords, out


def _local_shape(placements, sizes):
    return tuple(n // shard_slot(placements, [0] * len(sizes), sizes, d)[1]
                 for d, n in enumerate(SHAPE))


def test_autograd_function(pool4):
    """Forward moves x from src to dst; backward moves dy from grad_src to grad_dst."""
    layouts = list(itertools.product(PER_AXIS, repeat=2))
    rng = random.Random(0)
    cases = [
        ((S0, R), (R, R), (P, R), (S0, R)),   # all-gather, its reduce-scatter gradient
        ((R, S2), (R, R), (R, P), (R, S2)),
        ((R, R), (R, R), (P, P), (R, R)),     # identity forward, all-reduce backward
        ((P, S1), (S0, R), (S0, R), (P, S1)),
    ]
    # random cases; a gradient has its value's local shape, whatever its layout
    by_shape = {}
    for pl in layouts:
        by_shape.setdefault(_local_shape(pl, (2, 2)), []).append(pl)
    for _ in range(40):
        src, dst = rng.choice(layouts), rng.choice(layouts)
        gsrc = rng.choice(by_shape[_local_shape(dst, (2, 2))])
        gdst = rng.choice(by_shape[_local_shape(src, (2, 2))])
        cases.append((src, dst, gsrc, gdst))
    seed = 8
    per_rank = pool4.run(_autograd_cases, (2, 2), cases, seed)
    xs, dys = global_tensor(seed), global_tensor(seed + 1)
    for i, (src, dst, gsrc, gdst) in enumerate(cases):
        ys = [(c, out[i][0]) for c, out in per_rank]
        grads = [(c, out[i][1]) for c, out in per_rank]
        assert check_layout(xs, ys, dst, (2, 2)) == [], ("forward", src, dst)
        assert check_layout(dys, grads, gdst, (2, 2)) == [], ("backward", gsrc, gdst)


def _fails_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise KeyError("deliberate")
    return dist.get_rank()


def test_pool_reports_the_failing_rank_and_stays_usable(pool2):
    with pytest.raises(WorkerError, match=r"(?s)rank\(s\) \[1\].*KeyError: 'deliberate'"):
        pool2.run(_fails_on_rank, 1)
    assert pool2.run(_fails_on_rank, -1) == [0, 1]
