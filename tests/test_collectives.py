"""Collective algorithms of the cost model (autopar.cost.collectives): each formula against its
closed form, the choice per message size, and what the plans record."""
from __future__ import annotations

import dataclasses
import math

import pytest
from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.cost import collectives as K
from autopar.cost.prices import redistribute
from autopar.mesh import PRESETS
from autopar.models import build

B, A, L = 100e9, 2e-6, 5e-6   # bandwidth, latency per step, launch


@pytest.mark.parametrize("n", [2, 6, 8, 64])
def test_formulas_match_their_closed_forms(n):
    m = 3e8
    lg = math.ceil(math.log2(n))
    pow2 = n & (n - 1) == 0
    want = {
        ("all_reduce", "ring"): L + 2 * (n - 1) * A + 2 * (n - 1) / n * m / B,
        ("all_reduce", "tree"): L + 2 * lg * A + 2 * m / B,
        ("all_reduce", "halving-doubling"): L + 2 * lg * A + 2 * (n - 1) / n * m / B + (0 if pow2 else 2 * A + 2 * m / B),
        ("all_reduce", "parameter-server"): L + 2 * A + 2 * (n - 1) * m / B,
        ("all_gather", "ring"): L + (n - 1) * A + (n - 1) / n * m / B,
        ("reduce_scatter", "halving-doubling"): L + lg * A + (n - 1) / n * m / B + (0 if pow2 else A + m / B),
        ("all_gather", "tree"): L + (n - 1) * A + (n - 1) / n * m / B,
        ("all_to_all", "halving-doubling"): L + (n - 1) * A + (n - 1) / n * m / B,
    }
    for (kind, alg), t in want.items():
        assert K.seconds(kind, alg, m, n, B, A, L) == pytest.approx(t, rel=1e-12), (kind, alg)
    assert K.seconds("all_reduce", "ring", m, 1, B, A, L) == 0.0
    with pytest.raises(ValueError, match="unknown collective algorithm 'bcube'"):
        K.line("all_reduce", "bcube", n, B, A, L)


def test_traffic_per_node():
    """Large messages: the parameter server's link carries n - 1 copies each way (time grows
    with n), the ring's carries about two (constant), halving-doubling the same as the ring
    in log2 n steps."""
    m = 1e9
    for n in (8, 64, 512):
        ring = K.seconds("all_reduce", "ring", m, n, B, 0.0, 0.0)
        ps = K.seconds("all_reduce", "parameter-server", m, n, B, 0.0, 0.0)
        hd = K.seconds("all_reduce", "halving-doubling", m, n, B, 0.0, 0.0)
        assert ps / ring == pytest.approx(n, rel=1e-9)
        assert hd == pytest.approx(ring, rel=1e-12)
        assert ring == pytest.approx(2 * (n - 1) / n * m / B)


def test_small_messages_take_the_tree_large_ones_the_ring():
    """On 8 H100 of a node (NCCL: ring or tree) a 1 KB all-reduce is latency-bound and takes
    the tree (log2 8 = 3 steps each way instead of 7), a 1 GB one takes the ring (its
    2(n-1)/n bandwidth term beats the tree's 2); across 1024 ranks over the network the
    tree's latency wins at every size up to gigabytes."""
    mesh = autopar.Mesh((8,), ("gpu",), device="h100")
    assert mesh.device.algorithms == ("ring", "tree")
    assert K.choose("all_reduce", 1e3, 8, mesh.bandwidth[0], mesh.latency[0], 5e-6, mesh.device.algorithms)[0] == "tree"
    assert K.choose("all_reduce", 1e9, 8, mesh.bandwidth[0], mesh.latency[0], 5e-6, mesh.device.algorithms)[0] == "ring"
    big = autopar.Mesh((1024,), ("dp",), device="h100", bandwidth=50e9, latency=5e-6)
    assert K.choose("all_reduce", 1e9, 1024, 50e9, 5e-6, 5e-6, big.device.algorithms)[0] == "tree"
    # gloo on CPU runs rings only
    assert autopar.Mesh((4,), ("dp",), device="cpu").device.algorithms == ("ring",)


def test_moves_and_plans_record_the_algorithm():
    """A redistribution prices each step with the cheapest algorithm and says which; a plan's
    collectives carry it.  On 8 H100 (NCCL, autopar.cost.nccl) a small gradient sum is
    latency-bound and runs the ring under LL (6.6 us base + 14 NVLink steps of 0.6 us, at
    LL's 141 GB/s cap), a large one runs NVLink SHARP."""
    mesh = autopar.Mesh((8,), ("dp",), device="h100")
    small = redistribute((16,), 4, (Partial(),), (Replicate(),), mesh)
    large = redistribute((1 << 28,), 4, (Partial(),), (Replicate(),), mesh)
    assert [s.algorithm for s in small] == ["ring/LL"] and [s.algorithm for s in large] == ["nvls/Simple"]
    assert small[0].seconds == pytest.approx(6.6e-6 + 14 * 0.6e-6 + 2 * 7 / 8 * 64 / 141e9)
    model, example = build("gpt2-124m", device="meta", batch=8)
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    grads = [c for c in plan.collectives if c.kind == "all_reduce" and c.phase == "backward"]
    assert {c.algorithm for c in grads} == {"ring/LL", "nvls/Simple"}, {c.algorithm for c in grads}
    assert all(c.algorithm == "ring/LL" for c in grads if c.nbytes < 1e5)
    again = autopar.Plan.from_dict(plan.to_dict())
    assert [c.algorithm for c in again.collectives] == [c.algorithm for c in plan.collectives]
    assert autopar.Mesh.from_dict(mesh.to_dict()).device.algorithms == ("ring", "tree")
