"""The NCCL model of the cost model (autopar.cost.nccl; docs/COLLECTIVES.md, "The NCCL model"):
bus bandwidths against published nccl-tests figures, the protocol chosen by size, a group's
placement on nodes, and the devices that keep their own lines."""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.cost import collectives as K
from autopar.cost import nccl
from autopar.cost.collective_prices import collective_choice, send_time
from autopar.cost.prices import collective_time, layout_code, redistribute, redistribute_price
from autopar.cost.prices import PRICE_ROWS
from autopar.mesh import PRESETS

GB = 1e9


def busbw(kind: str, nbytes: float, mesh, axis: int = 0) -> float:
    """nccl-tests' bus bandwidth of one call as the model prices it (GB/s)."""
    n = mesh.shape[axis]
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / collective_time(kind, nbytes, axis, mesh) / GB


# (what, kind, bytes, mesh shape, device, published busbw GB/s, source)
PUBLISHED = [
    ("8 H100 all-reduce, NVLink SHARP", "all_reduce", 8e9, (8,), "h100", 480.0,
     "S. Jeaugey, NVIDIA/nccl-tests#212: ~480 GB/s peak busbw on 8 GPUs (476 in nccl-tests#290)"),
    ("8 H100 all-gather (ring)", "all_gather", 8e9, (8,), "h100", 370.0,
     "nccl-tests#212: effective NVLink busbw 370 GB/s for non-all-reduce collectives"),
    ("8 A100 all-reduce", "all_reduce", 8e9, (8,), "a100", 230.0,
     "nccl-tests#149 (S. Jeaugey): ~230 GB/s; nccl-tests#175: 232.5 GB/s measured"),
    ("2 DGX A100 (8 HDR NICs each) all-reduce", "all_reduce", 8e9, (16,), "a100", 192.0,
     "NVIDIA/nccl#812 (quoted in nccl#1576): 192 GB/s AllReduce busbw on DGX A100, 8x200 Gb/s IB"),
    ("H100 one rank per node: one NDR NIC", "all_reduce", 8e9, (8, 8), "h100", 47.0,
     "nccl-tests#290 (A. Laddy): 46-48 GB/s per 400 Gb/s NIC"),
]


@pytest.mark.parametrize("what,kind,nbytes,shape,device,published,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_bus_bandwidth_within_ten_percent_of_nccl_tests(what, kind, nbytes, shape, device, published, source):
    mesh = autopar.Mesh(shape, ("dp", "tp")[:len(shape)], device=device)
    assert busbw(kind, nbytes, mesh) == pytest.approx(published, rel=0.10), source


def test_small_all_reduce_latency_on_128_h100():
    """An 8-byte all-reduce on 16 H100 nodes (128 ranks) took ~62 us (NVIDIA/nccl#1469, NCCL
    2.20.5); the model takes the tree under LL: 6.8 + 2 (7 x 0.6 + log2 16 x 5.0) = 55.2 us."""
    mesh = autopar.Mesh((128,), ("dp",), device="h100")
    algorithm, seconds = collective_choice("all_reduce", 8, 0, mesh)
    assert algorithm == "tree/LL"
    assert seconds == pytest.approx(55.2e-6, rel=1e-3)
    assert seconds == pytest.approx(62e-6, rel=0.15)


def test_ll_wins_tiny_messages_simple_wins_large_ones():
    """All-gather on 8 H100: LL's low latency below ~4.6 MB, LL128 up to ~23 MB, Simple's full
    bandwidth above (where NCCL's own tuning model hands over); NCCL's constants give each
    line in closed form."""
    mesh = autopar.Mesh((8,), ("tp",), device="h100")
    fam, bw = nccl.HOPPER, PRESETS["h100"].intra_bandwidth
    assert collective_choice("all_gather", 1e3, 0, mesh)[0] == "ring/LL"
    assert collective_choice("all_gather", 1e7, 0, mesh)[0] == "ring/LL128"
    assert collective_choice("all_gather", 1e9, 0, mesh)[0] == "ring/Simple"
    lines = {ln.algorithm: ln for ln in nccl.lines("all_gather", nccl.Group(8, 8, 1), fam, bw, 45e9)}
    assert lines["ring/LL"].fixed == pytest.approx(6.6e-6 + 7 * 0.6e-6)
    assert lines["ring/LL"].per_byte == pytest.approx(7 / 8 / 141e9)          # LL capped at 141 GB/s
    assert lines["ring/LL128"].per_byte == pytest.approx(7 / 8 / (0.92 * bw))
    assert lines["ring/Simple"].fixed == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert lines["ring/Simple"].per_byte == pytest.approx(7 / 8 / bw)
    cuts = K.breakpoints(K.cheapest(lines.values()))
    assert cuts == pytest.approx([4.6e6, 23.2e6], rel=0.02)


def test_an_axis_with_eight_ranks_per_node_runs_at_eight_nics():
    """FSDP over 64 H100 (8 nodes, dp is the only axis): each node's ring channels leave
    through its 8 NICs, min(NVLink, 8 x 45 GB/s) = 360 GB/s busbw, not one NIC's 45."""
    mesh = autopar.Mesh((64,), ("dp",), device="h100")
    assert mesh.placement("dp") == (8, 8)
    nic = PRESETS["h100"].inter_bandwidth / GB
    assert nccl.bus_bandwidth(nccl.Group(64, 8, 8), PRESETS["h100"].intra_bandwidth, nic * GB) == pytest.approx(8 * nic * GB)
    for kind in ("all_gather", "reduce_scatter"):
        assert busbw(kind, 4e9, mesh) == pytest.approx(8 * nic, rel=0.05)
        assert busbw(kind, 4e9, mesh) > 7 * nic
    assert busbw("all_reduce", 8e9, mesh) == pytest.approx(8 * nic, rel=0.05)


def test_an_axis_outside_a_full_node_runs_at_one_nic():
    """dp=8 outside tp=8: one dp rank per node, so one NIC per rank (45 GB/s on h100); tp runs
    inside the node over NVLink."""
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    assert mesh.placement("dp") == (1, 8) and mesh.placement("tp") == (8, 1)
    assert mesh.placement(("dp", "tp")) == (8, 8)
    nic = PRESETS["h100"].inter_bandwidth / GB
    assert busbw("all_gather", 4e9, mesh, 0) == pytest.approx(nic, rel=0.01)
    assert busbw("all_gather", 4e9, mesh, 1) == pytest.approx(PRESETS["h100"].intra_bandwidth / GB, rel=0.01)
    # dp=4 outside tp=2 on 8-GPU nodes: 4 dp ranks per node... of a 16-rank job, 2 nodes
    half = autopar.Mesh((4, 2), ("dp", "tp"), device="h100", devices_per_node=4)
    assert half.placement("dp") == (2, 2)
    assert busbw("all_gather", 4e9, half) == pytest.approx(2 * nic, rel=0.01)


def test_all_reduce_over_two_axes_is_one_call_on_their_group():
    """A gradient summed over dp and tp is one NCCL call on all 64 ranks (the runtime's
    grad_sync does one all_reduce on the joint group): priced on the first axis listed, 0 s on
    the other; the same as a 64-rank axis with 8 ranks per node."""
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    flat = autopar.Mesh((64,), ("dp",), device="h100")
    nbytes = 1 << 30
    steps = redistribute((nbytes // 4,), 4, (Partial(), Partial()), (Replicate(), Replicate()), mesh)
    assert [(s.kind, s.axis) for s in steps] == [("all_reduce", 1), ("all_reduce", 0)]
    assert steps[1].seconds == 0.0 and steps[0].algorithm == steps[1].algorithm
    assert steps[0].seconds == pytest.approx(collective_time("all_reduce", nbytes, 0, flat))


def test_all_to_all_and_sends():
    """All-to-all across nodes cannot pool a node's NICs (S. Jeaugey, nccl-tests#267): the
    cross-node share goes through each rank's own NIC.  A pipeline send is one pair: about half
    NVLink's busbw inside a node (nccl-tests#268: ~180 GB/s sendrecv between two H100), one
    NIC across nodes."""
    mesh = autopar.Mesh((64,), ("ep",), device="h100")
    nic, nvl = PRESETS["h100"].inter_bandwidth, PRESETS["h100"].intra_bandwidth
    m = 1e9
    assert collective_time("all_to_all", m, 0, mesh) == pytest.approx(56 / 64 * m / nic, rel=0.01)
    pp = autopar.Mesh((2, 8), ("pp", "tp"), device="h100")
    inside = autopar.Mesh((2, 4), ("pp", "tp"), device="h100")
    assert send_time(1e9, 0, pp) == pytest.approx(1e9 / nic, rel=0.01)
    assert send_time(1e9, 0, inside) == pytest.approx(1e9 / (0.5 * nvl), rel=0.01)
    assert send_time(1e3, 0, inside) == pytest.approx(6.6e-6 + 0.6e-6 + 1e3 / (0.5 * 0.5 * nvl))   # LL


def test_gloo_cpu_keeps_the_ring_model_exactly():
    """The cpu preset (gloo) is priced by autopar.cost.collectives' ring, one table column."""
    mesh = autopar.Mesh((4,), ("dp",), device="cpu")
    dev = mesh.device
    for kind in ("all_reduce", "all_gather", "all_to_all"):
        want = K.seconds(kind, "ring", 1e7, 4, dev.intra_bandwidth, dev.intra_latency, dev.launch_latency)
        assert collective_choice(kind, 1e7, 0, mesh) == ("ring", want)
    assert redistribute_price(layout_code((Partial(),)), layout_code((Replicate(),)), mesh).shape == (PRICE_ROWS, 1)
    assert send_time(1e6, 0, mesh) == dev.launch_latency + dev.intra_latency + 1e6 / dev.intra_bandwidth


def test_calibrated_links_and_given_bandwidths_keep_their_lines():
    """A measured line (`autopar calibrate`) and a bandwidth the user gives an axis keep the
    alpha-beta formulas with those numbers, NCCL's ring and tree taken per call."""
    spec = dataclasses.replace(PRESETS["h100"], links=(("all_gather", "intra", 200e9, 2e-6, 10e-6),))
    mesh = autopar.Mesh((8,), ("tp",), device=spec)
    want = min(K.seconds("all_gather", a, 1e8, 8, 200e9, 2e-6, 10e-6) for a in ("ring", "tree"))
    assert collective_time("all_gather", 1e8, 0, mesh) == want
    assert collective_choice("all_reduce", 1e9, 0, mesh)[0] == "nvls/Simple"   # not measured: NCCL
    given = autopar.Mesh((8,), ("tp",), device="h100", bandwidth=100e9)
    ab = K.seconds("all_reduce", "ring", 1e9, 8, 100e9, given.latency[0], given.device.launch_latency)
    assert collective_choice("all_reduce", 1e9, 0, given) == ("ring", ab)


def test_cheapest_keeps_the_lower_envelope():
    lines = [K.Line("a", 1.0, 3.0), K.Line("b", 2.0, 1.0), K.Line("c", 5.0, 2.0), K.Line("d", 10.0, 0.5)]
    assert [ln.algorithm for ln in K.cheapest(lines)] == ["a", "b", "d"]   # c is never the cheapest
    assert K.breakpoints(K.cheapest(lines)) == pytest.approx([0.5, 16.0])


@pytest.mark.parametrize("shape", [(8, 8), (2, 4, 8)], ids=str)
def test_the_table_lines_are_the_priced_steps_under_nccl(shape):
    """On an NCCL mesh a redistribute_price column scaled to a size is the sum of the steps
    redistribute prices at that size, and the least column is within 10 % of choosing the
    cheapest line per step (collectives.combine keeps NCCL_COLUMNS of them)."""
    mesh = autopar.Mesh(shape, ("a", "b", "c")[:len(shape)], device="h100")
    opts = (Replicate(), Partial(), Shard(0), Shard(1))
    for src in itertools.product(opts, repeat=len(shape)):
        for dst in itertools.product((Replicate(), Shard(0), Shard(1)), repeat=len(shape)):
            table = redistribute_price(layout_code(src), layout_code(dst), mesh)
            assert table.shape == (PRICE_ROWS, K.NCCL_COLUMNS)
            for numel in (64, 1 << 20, 1 << 28):
                whole = numel * 2
                priced = redistribute((numel,), 2, src, dst, mesh)
                lines = table[0] + table[1] * whole
                assert lines.min() == pytest.approx(sum(s.seconds for s in priced), rel=1e-9, abs=1e-15)
                best = sum(collective_time(s.kind, s.nbytes, s.axis, mesh) for s in priced
                           if s.seconds > 0 and s.kind != "all_reduce")
                assert lines.min() >= best * (1 - 1e-9)


def test_families_and_groups_read_well():
    assert nccl.family("h100-sxm") is nccl.HOPPER and nccl.family("a100-40gb") is nccl.AMPERE
    assert str(nccl.Group(64, 8, 8)) == "64 ranks (8 per node on 8 nodes)"
    assert "tuning.cc" in str(nccl.HOPPER)
    with pytest.raises(ValueError, match="per_node and nodes at most ranks"):
        nccl.Group(4, 8, 1)
    assert str(K.Line("ring/LL", 15e-6, 1 / 141e9)) == "ring/LL: 15.0 us + m / 141.0 GB/s"
    assert math.isclose(nccl.bus_bandwidth(nccl.Group(16, 8, 2), 240e9, 22.5e9), 180e9)
    assert np.isfinite(busbw("all_reduce", 1e6, autopar.Mesh((1024,), ("dp",), device="h100")))
