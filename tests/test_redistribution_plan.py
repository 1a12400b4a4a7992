"""One redistribution planner (autopar.cost.redistribution): the collectives the cost model prices
are the collectives the runtime runs, and what the runtime runs gives the target layout.

On gloo ranks, every pair of layouts over {Replicate, Partial, Shard(0), Shard(1)} per axis
on meshes (4,), (2, 2) and (2, 2, 2), nested shards included, runs through
redistribute_local with its collectives recorded (kind, mesh axes, bytes of the tensors
they really moved) and is compared with `autopar.cost.prices.redistribute`'s priced list, call for
call; the result is compared with the destination layout of the global tensor.
"""
import itertools
import math

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
import autopar.passes.redistribute as rd
from autopar.cost.prices import layout_code, redistribute, redistribute_price
from autopar.passes.redistribute import MeshGroups, Redistribute, redistribute_local
from autopar.cost.redistribution import Step, plan_codes, plan_redistribute
from distributed import device_mesh
from reference_layouts import check_layout, global_tensor, local_of

R, P = Replicate(), Partial()
S0, S1 = Shard(0), Shard(1)
PER_AXIS = (R, P, S0, S1)
SHAPE = (8, 8)   # every dim divides by the 8 ranks of (2, 2, 2): every layout below is even
NAMES = ("a", "b", "c")


def all_pairs(ndim: int) -> list:
    layouts = list(itertools.product(PER_AXIS, repeat=ndim))
    return [(s, d) for s in layouts for d in layouts]


def steps(src, dst, sizes) -> list:
    return [str(s) for s in plan_redistribute(src, dst, sizes)]


# ---------------------------------------------------------------- the rules (no processes)

@pytest.mark.parametrize("src, dst, sizes, expected", [
    # one axis swaps its shard dim: one all-to-all on half (or a quarter) of the tensor
    ((S0, R), (S1, R), (2, 2), ["all_to_all(dim 0 -> 1, axis 0)"]),
    ((R, S0), (R, S1), (2, 2), ["all_to_all(dim 0 -> 1, axis 1)"]),
    ((S0,), (S1,), (4,), ["all_to_all(dim 0 -> 1, axis 0)"]),
    # nested: axis 1 is the innermost split of dim 0 and becomes dim 1's only one
    ((S0, S0), (S0, S1), (2, 2), ["all_to_all(dim 0 -> 1, axis 1)"]),
    # axis 0 is under axis 1 on dim 0: axis 1 comes off first, then axis 0 swaps
    ((S0, S0), (S1, S0), (2, 2), ["all_gather(dim 0, axis 1)", "all_to_all(dim 0 -> 1, axis 0)",
                                  "chunk(dim 0, axis 1)"]),
    ((S0, S0), (S1, S1), (2, 2), ["all_gather(dim 0, axis 1)", "all_to_all(dim 0 -> 1, axis 0)",
                                  "chunk(dim 1, axis 1)"]),
    # two swaps that wait on each other: the inner axis gathers and chunks instead
    ((S0, S1), (S1, S0), (2, 2), ["all_gather(dim 1, axis 1)", "all_to_all(dim 0 -> 1, axis 0)",
                                  "chunk(dim 0, axis 1)"]),
    # axis 1 lands inside axis 0 on dim 1, as the destination nests them
    ((S1, S0), (S1, S1), (2, 2), ["all_to_all(dim 0 -> 1, axis 1)"]),
    # axis 0 must land under axis 1 on dim 1: axis 1 comes off dim 1 first, goes back on last
    ((S0, S1), (S1, S1), (2, 2), ["all_gather(dim 1, axis 1)", "all_to_all(dim 0 -> 1, axis 0)",
                                  "chunk(dim 1, axis 1)"]),
    # an axis of size 1 holds the whole tensor: (1, 4) is (4,) here
    ((S0, S0), (S1, S1), (1, 4), ["all_to_all(dim 0 -> 1, axis 1)"]),
    # shrink first: the slice before the gather, which then moves a quarter
    ((S0, R), (R, S1), (2, 2), ["chunk(dim 1, axis 1)", "all_gather(dim 0, axis 0)"]),
    # Partial -> Replicate on several axes is one all-reduce, where the tensor is smallest
    ((P, P), (R, R), (2, 2), ["all_reduce(axes 0, 1)"]),
    ((P, R, P), (R, S0, R), (2, 2, 2), ["chunk(dim 0, axis 1)", "all_reduce(axes 0, 2)"]),
    ((P, S1, P), (R, R, R), (2, 2, 2), ["all_reduce(axes 0, 2)", "all_gather(dim 1, axis 1)"]),
])
def test_plan_steps(src, dst, sizes, expected):
    assert steps(src, dst, sizes) == expected


def test_steps_carry_the_share_a_rank_holds():
    plan = plan_redistribute((S0, S0, R), (S1, S0, S1), (2, 2, 2))
    assert plan == (Step("all_gather", 1, 0, share=1 / 4), Step("all_to_all", 0, 0, 1, share=1 / 2),
                    Step("chunk", 1, 0, share=1 / 2), Step("chunk", 2, 1, share=1 / 4))
    assert plan_redistribute((P, P), (R, R), (2, 4)) == (Step("all_reduce", 0, share=1.0, span=(1,)),)


def test_placements_and_codes_plan_alike():
    for src, dst in all_pairs(2):
        assert plan_redistribute(src, dst, (2, 2)) == plan_codes(layout_code(src), layout_code(dst), (2, 2))
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        plan_redistribute((R,), (R, R), (2, 2))
    with pytest.raises(ValueError, match="only sum"):
        plan_redistribute((Partial("max"),), (R,), (2,))


def priced_calls(shape, itemsize, src, dst, mesh) -> list:
    """`autopar.cost.prices.redistribute`'s collectives as calls (kind, mesh axes, bytes): the
    per-axis rows of the one all-reduce (all its rows, listed together) make one call on
    the bytes of its first row."""
    calls = []
    for st in redistribute(shape, itemsize, src, dst, mesh):
        if st.kind == "all_reduce" and calls and calls[-1][0] == "all_reduce":
            kind, axes, nbytes = calls[-1]
            calls[-1] = (kind, tuple(sorted(axes + (st.axis,))), nbytes)
        else:
            calls.append((st.kind, (st.axis,), st.nbytes))
    return calls


@pytest.mark.parametrize("sizes", [(4,), (2, 4), (2, 2, 2)], ids=str)
def test_the_price_line_is_the_priced_steps(sizes):
    """redistribute_price (a table entry scaled by bytes) equals the sum of the priced steps,
    and the priced calls are the planner's collective steps."""
    mesh = autopar.Mesh(sizes, NAMES[:len(sizes)], bandwidth=[1e9 * (a + 1) for a in range(len(sizes))],
                        latency=1e-6)
    shape, item = (8, 8), 4
    whole = math.prod(shape) * item
    for src, dst in all_pairs(len(sizes)):
        priced = redistribute(shape, item, src, dst, mesh)
        (fixed, per_byte, g_fixed, g_per_byte, ar_fixed, rs_fixed, ar_per_byte,
         rs_per_byte, one_gather, one_scatter, *copies) = redistribute_price(layout_code(src), layout_code(dst), mesh)
        k = int(np.argmin(fixed + per_byte * whole))   # the cheapest algorithm, as the steps took
        assert fixed[k] + per_byte[k] * whole == pytest.approx(sum(s.seconds for s in priced), rel=1e-12)
        assert {s.algorithm for s in priced} <= set(mesh.device.algorithms)
        gathers = [s.seconds for s in priced if s.kind == "all_gather"]
        assert g_fixed[k] + g_per_byte[k] * whole == pytest.approx(sum(gathers), rel=1e-12, abs=1e-18)
        for kind, f, b in (("all_reduce", ar_fixed, ar_per_byte), ("reduce_scatter", rs_fixed, rs_per_byte)):
            mine = [s for s in priced if s.kind == kind]   # the fixed part is what buckets share
            assert f[k] == pytest.approx(sum(s.fixed for s in mine), rel=1e-12, abs=1e-18)
            assert f[k] + b[k] * whole == pytest.approx(sum(s.seconds for s in mine), rel=1e-12, abs=1e-18)
        steps = plan_redistribute(src, dst, sizes)
        alone = [s.kind for s in steps] if len(steps) == 1 else []   # what the runtime groups (reshard.py)
        assert (one_gather[k] == 1.0, one_scatter[k] == 1.0) == (alone == ["all_gather"], alone == ["reduce_scatter"])
        planned = [(s.kind, s.axes, whole * s.share * (sizes[s.axis] if s.kind == "all_gather" else 1))
                   for s in steps if s.is_collective]
        assert priced_calls(shape, item, src, dst, mesh) == planned, (src, dst)
        # what flat buffers copy per byte of the tensor: each call's local input and output,
        # read and written, by kind (prices.bucket_copy_bytes)
        for kind, row in zip(("all_reduce", "reduce_scatter", "all_gather"), copies):
            moved = 0.0
            for s in steps:
                if s.kind == kind:
                    out = {"all_reduce": 1.0, "reduce_scatter": 1.0 / sizes[s.axis], "all_gather": sizes[s.axis]}[kind]
                    moved += 2.0 * s.share * (1.0 + out)
            assert row == pytest.approx(np.full_like(row, moved), rel=1e-12, abs=1e-18), (kind, src, dst)


# ---------------------------------------------------------------- on gloo ranks

class Recorder:
    """Inside a job: records every collective redistribute_local runs as (kind, mesh axes,
    bytes), from the tensors it really moved (an all-gather's output, any other's input),
    and counts the torch.distributed calls under them (one per collective)."""

    COLLECTIVE_CALLS = {"all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all",
                        "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "broadcast"}

    def __init__(self, groups: MeshGroups, ndim: int):
        self.axes_of = {id(groups.group(a)): (a,) for a in range(ndim)}
        for k in range(2, ndim + 1):
            for axes in itertools.combinations(range(ndim), k):
                self.axes_of[id(groups.group_of(axes))] = axes
        self.log: list = []
        self.dist_calls = 0

    def take(self) -> tuple:
        log, calls = self.log, self.dist_calls
        self.log, self.dist_calls = [], 0
        return log, calls

    def __enter__(self):
        self.saved = {name: getattr(rd, name) for name in
                      ("all_gather_dim", "reduce_scatter_dim", "_all_reduce", "all_to_all_dims", "dist")}
        real, log, axes_of = self.saved, self.log_append, self.axes_of
        recorder = self

        def nbytes(t):
            return t.numel() * t.element_size()

        def all_gather(t, dim, group, n):
            out = real["all_gather_dim"](t, dim, group, n)
            log(("all_gather", axes_of[id(group)], nbytes(out)))
            return out

        def reduce_scatter(t, dim, group, n, coord, axis, native=None):
            log(("reduce_scatter", axes_of[id(group)], nbytes(t)))
            return real["reduce_scatter_dim"](t, dim, group, n, coord, axis, native)

        def all_reduce(t, group, owned):
            log(("all_reduce", axes_of[id(group)], nbytes(t)))
            return real["_all_reduce"](t, group, owned)

        def all_to_all(t, dim, to_dim, group, n, axis):
            log(("all_to_all", axes_of[id(group)], nbytes(t)))
            return real["all_to_all_dims"](t, dim, to_dim, group, n, axis)

        class CountingDist:
            def __getattr__(self, name):
                fn = getattr(real["dist"], name)
                if name not in Recorder.COLLECTIVE_CALLS:
                    return fn

                def counted(*args, **kwargs):
                    recorder.dist_calls += 1
                    return fn(*args, **kwargs)
                return counted

        rd.all_gather_dim, rd.reduce_scatter_dim, rd._all_reduce, rd.all_to_all_dims = (
            all_gather, reduce_scatter, all_reduce, all_to_all)
        rd.dist = CountingDist()
        return self

    def log_append(self, entry):
        self.log.append(entry)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(rd, name, value)


def _run_pairs(mesh_shape, pairs, seed):
    """Job: every (src, dst) pair; returns (coords, [(local result, collectives run, dist calls)]),
    the results as numpy arrays (thousands of tensors would each pass a file descriptor)."""
    mesh = device_mesh(mesh_shape, NAMES[:len(mesh_shape)])
    groups, coords = MeshGroups(mesh), tuple(mesh.get_coordinate())
    glob, out = global_tensor(seed, SHAPE), []
    with Recorder(groups, len(mesh_shape)) as rec:
        for src, dst in pairs:
            y = redistribute_local(local_of(glob, src, coords, mesh_shape), src, dst, groups)
            out.append((y.numpy(),) + rec.take())
    return coords, out


def _check_pairs(per_rank, mesh_shape, pairs, seed):
    glob = global_tensor(seed, SHAPE)
    mesh = autopar.Mesh(mesh_shape, NAMES[:len(mesh_shape)], device="cpu")
    failures, with_all_to_all = [], 0
    for i, (src, dst) in enumerate(pairs):
        priced = priced_calls(SHAPE, 8, src, dst, mesh)
        with_all_to_all += any(kind == "all_to_all" for kind, _, _ in priced)
        for coords, results in per_rank:
            _, ran, dist_calls = results[i]
            if ran != priced:
                failures.append(f"{src} -> {dst} on rank {coords}: ran {ran}, priced {priced}")
            if dist_calls != len(ran):
                failures.append(f"{src} -> {dst} on rank {coords}: {dist_calls} torch.distributed "
                                f"calls for {len(ran)} collectives")
        failures += [f"{src} -> {dst}: {p}" for p in
                     check_layout(glob, [(c, torch.from_numpy(out[i][0])) for c, out in per_rank], dst,
                                  mesh_shape)]
    assert failures == [], f"{len(failures)} failures, first:\n" + "\n".join(failures[:10])
    return with_all_to_all


def test_every_pair_on_four_ranks_in_a_row(pool4):
    pairs = all_pairs(1)
    per_rank = pool4.run(_run_pairs, (4,), pairs, 1)
    # S(0) <-> S(1): the two pairs an all-to-all serves on one axis
    assert _check_pairs(per_rank, (4,), pairs, 1) == 2


def test_every_pair_on_a_2x2_mesh(pool4):
    pairs = all_pairs(2)
    per_rank = pool4.run(_run_pairs, (2, 2), pairs, 2)
    assert _check_pairs(per_rank, (2, 2), pairs, 2) > 0


def test_every_pair_on_a_2x2x2_mesh(pool8):
    pairs = all_pairs(3)
    per_rank = pool8.run(_run_pairs, (2, 2, 2), pairs, 3)
    assert _check_pairs(per_rank, (2, 2, 2), pairs, 3) > 0


# ---------------------------------------------------------------- gradients through an all-to-all

GRAD_CASES = [
    ((2, 2), (S0, R), (S1, R)),
    ((2, 2), (R, S0), (R, S1)),
    ((2, 2), (S0, S0), (S0, S1)),
    ((2, 2), (S0, S0), (S1, S1)),
    ((2, 2), (S0, S1), (S1, S0)),
    ((4,), (S0,), (S1,)),
]


def _mirror(src, dst):
    """The gradient's layouts: it arrives as dst with Replicate made Partial (each replica's
    loss counts once) and leaves as src (no Partial here)."""
    return tuple(P if p.is_replicate() else p for p in dst), tuple(src)


def _grads_through_moves(cases, seed):
    """Job: y = Redistribute(x), loss = sum(sin(y) * w) with w the destination's piece of W
    (zero on replicas other than coordinate 0, so each element counts once); returns per
    case (coords, x.grad, forward collectives, backward collectives)."""
    xs, ws = global_tensor(seed, SHAPE), global_tensor(seed + 1, SHAPE)
    out = []
    for mesh_shape, src, dst in cases:
        mesh = device_mesh(mesh_shape, NAMES[:len(mesh_shape)])
        groups, coords = MeshGroups(mesh), tuple(mesh.get_coordinate())
        first = all(coords[a] == 0 for a, p in enumerate(dst) if p.is_replicate())
        w = local_of(ws, dst, coords, mesh_shape) * first
        x = local_of(xs, src, coords, mesh_shape).requires_grad_()
        with Recorder(groups, len(mesh_shape)) as rec:
            y = Redistribute.apply(x, src, dst, *_mirror(src, dst), groups)
            forward, _ = rec.take()
            (y.sin() * w).sum().backward()
            backward, _ = rec.take()
        out.append((coords, x.grad, forward, backward))
    return out


def test_gradient_of_an_all_to_all_is_the_inverse_all_to_all(pool4):
    seed = 5
    per_rank = pool4.run(_grads_through_moves, GRAD_CASES, seed)
    xs = global_tensor(seed, SHAPE).requires_grad_()
    (xs.sin() * global_tensor(seed + 1, SHAPE)).sum().backward()
    for i, (mesh_shape, src, dst) in enumerate(GRAD_CASES):
        forward = [s for s in plan_redistribute(src, dst, mesh_shape) if s.is_collective]
        backward = [s for s in plan_redistribute(*_mirror(src, dst), mesh_shape) if s.is_collective]
        assert any(s.kind == "all_to_all" for s in forward)
        # each forward all-to-all d -> e on axis a comes back as e -> d on axis a
        assert {(s.axis, s.to_dim, s.dim) for s in forward if s.kind == "all_to_all"} == \
            {(s.axis, s.dim, s.to_dim) for s in backward if s.kind == "all_to_all"}
        for rank in per_rank:
            coords, grad, ran_fwd, ran_bwd = rank[i]
            assert [k for k, _, _ in ran_fwd] == [s.kind for s in forward]
            assert [k for k, _, _ in ran_bwd] == [s.kind for s in backward]
            expect = local_of(xs.grad, src, coords, mesh_shape)
            torch.testing.assert_close(grad, expect, rtol=1e-12, atol=1e-12,
                                       msg=f"{src} -> {dst} on rank {coords}")
