"""Collectives as NCCL runs them: one call's time under each (algorithm, protocol) pair
NCCL's tuner weighs, as straight lines in the call's bytes (docs/COLLECTIVES.md, "The NCCL
model").

A call runs on a group of n ranks placed k per node on N nodes (n = k N; `Group`).  m is
the bytes the call reads, as in autopar.cost.collectives: an all-gather's output, a
reduce-scatter's or all-reduce's input (NCCL sizes its own choice on the same bytes:
count times n for all-gather and reduce-scatter, src/enqueue.cc).

Bus bandwidth.  The Simple protocol's ring moves data at the group's bus bandwidth

    B = B_nvl                     inside one node (N = 1)
    B = min(B_nvl, k B_nic)       across nodes: each node's ring channels leave through the
                                  NICs of its k ranks (one NIC per GPU on DGX/HGX nodes)

with B_nvl and B_nic the device's intra_bandwidth and inter_bandwidth (what nccl-tests shows
as busbw inside a node and per NIC).  Where the inner mesh axes fill the node (k = 1) a
rank has one NIC; a data-parallel axis with 8 of its ranks per node uses 8.

Protocols scale B (NCCL's ncclTopoTuneModel, src/graph/tuning.cc): LL carries 8 bytes of
data per 16-byte line, so half of B, capped at an absolute rate; LL128 carries 120 of
every 128 bytes, 0.92 B; Simple all of B.  The tree all-reduce runs at 0.92 B (Simple),
B / 3.8 (LL), and 7/9 (one node) or 120/128 (several) of 0.92 B (LL128).

Time of one call (seconds; the per-byte terms are nccl-tests' busbw definitions):

    ring all-reduce         base + (2(n-1) - 2(N-1)) s_nvl + 2(N-1) s_net   + 2(n-1)/n m / B_p
    ring all-gather / r-s   base + ((n-1) - (N-1)) s_nvl + (N-1) s_net      + (n-1)/n m / B_p
    tree all-reduce         base + 2((k-1) s_nvl + floor(log2 N) s_net)      + 2 m / B_tree_p
    NVLS all-reduce (N = 1) s_nvls                                           + 2(n-1)/n m / (g B)
    all-to-all              base + s + (n-1) s_peer  + max((k-1)/n / B_nvl, (n-k)/n / B_nic) m
    send (one pair)         base + s                                         + m / B_p2p

base is the per-(algorithm, protocol) base latency, s_nvl and s_net the per-step latency
of an NVLink and a network hop; across nodes an NVLink step costs at least NCCL's network
overhead (x3 for Simple), a ring all-reduce across nodes under Simple pays 1.4x its
latency (NCCL's "plateau" factor), and with one rank per node the ring pays the tree's
network step latency.  NVLS (NVLink SHARP, Hopper) reduces inside the NVSwitch: g B is the
busbw nccl-tests shows for it.

Each list keeps only the lines that are the cheapest at some size (`collectives.cheapest`),
so the planner's tables stay small: two to four lines per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cost.collectives import Line, cheapest

PROTOCOLS = ("LL", "LL128", "Simple")


@dataclass(frozen=True)
class Group:
    """The ranks of one collective call: `ranks` in all, `per_node` of them in each of
    `nodes` nodes (ranks = per_node * nodes where the mesh divides evenly)."""

    ranks: int
    per_node: int
    nodes: int

    def __post_init__(self):
        if min(self.ranks, self.per_node, self.nodes) < 1 or max(self.per_node, self.nodes) > self.ranks:
            raise ValueError(f"group of {self.ranks} ranks, {self.per_node} per node on {self.nodes} nodes: "
                             f"each must be a positive integer, per_node and nodes at most ranks")

    def __str__(self) -> str:
        return f"{self.ranks} ranks ({self.per_node} per node on {self.nodes} node{'s' * (self.nodes > 1)})"


@dataclass(frozen=True)
class Family:
    """NCCL's tuning constants for one GPU generation, in seconds and bytes/s.

    Latencies are NCCL's defaults in src/graph/tuning.cc (ncclTunerConstantsDefaults,
    NVIDIA/nccl master 5067397c), by (algorithm, protocol) with protocols ordered LL, LL128,
    Simple: `base` is baseLatencies; `nvlink_step` and `net_step` are hwLatencies for an
    NVLink and a network hop.  `ll_cap` is llMaxBws for one node, two nodes and more (the
    multi-node rows depend on the host CPU: Intel for DGX H100, AMD for DGX A100).
    `net_overhead` is NCCL's per-step network post overhead (1 us Intel, 2 us AMD).
    `nvls_gain`: NVLS all-reduce busbw over the ring's inside a node (0: no NVLS);
    `nvls_latency`: NCCL's NVLS hardware latency.  `p2p_fraction`: one send/recv pair's
    bandwidth over NVLink as a share of the ring's busbw; `peer_step`: what each further
    peer adds to an all-to-all's latency (an estimate: NCCL's tuner has no p2p model).
    `source`: where the numbers come from.
    """

    name: str
    base: tuple = (("tree", (6.8e-6, 14.0e-6, 8.4e-6)), ("ring", (6.6e-6, 14.0e-6, 8.4e-6)))
    nvlink_step: tuple = (("tree", (0.6e-6, 1.25e-6, 4.0e-6)), ("ring", (0.6e-6, 1.9e-6, 3.4e-6)))
    net_step: tuple = (("tree", (5.0e-6, 8.5e-6, 14.0e-6)), ("ring", (2.7e-6, 4.0e-6, 14.0e-6)))
    ll_cap: tuple = (141.0e9, 39.0e9, 20.4e9)
    net_overhead: float = 1e-6
    ll_fraction: float = 0.5
    ll128_fraction: float = 0.92
    tree_fraction: float = 0.92
    tree_ll_divisor: float = 3.8
    tree_ll128_one_node: float = 7.0 / 9.0
    tree_ll128_nodes: float = 120.0 / 128.0
    ring_plateau: float = 1.4
    nvls_gain: float = 0.0
    nvls_latency: float = 25e-6
    p2p_fraction: float = 0.5
    peer_step: float = 0.2e-6
    source: str = ""

    def latency(self, table: str, algorithm: str, protocol: str) -> float:
        return dict(getattr(self, table))[algorithm][PROTOCOLS.index(protocol)]

    def __str__(self) -> str:
        return f"NCCL tuning constants for {self.name} ({self.source})"


# DGX H100: Intel Xeon hosts; NVLS all-reduce reaches ~480 GB/s busbw on 8 GPUs where the
# ring reaches ~370 (S. Jeaugey, NVIDIA/nccl-tests#212; 476 GB/s in nccl-tests#290).
# Sends over NVLink: nccl-tests#268 saw sendrecv_perf between two H100 plateau at ~180 GB/s,
# about half the ring's 370.
HOPPER = Family("hopper", ll_cap=(141.0e9, 39.0e9, 20.4e9), net_overhead=1e-6, nvls_gain=480.0 / 370.0,
                source="NCCL src/graph/tuning.cc defaults (Hopper row, Intel host); NVLS and p2p from "
                       "nccl-tests#212, #268")
# DGX A100: AMD EPYC hosts (llMaxBws' AMD row, 2 us network overhead), no NVLS.
AMPERE = Family("ampere", ll_cap=(87.7e9, 22.5e9, 19.0e9), net_overhead=2e-6,
                source="NCCL src/graph/tuning.cc defaults (Ampere row, AMD host)")
FAMILIES = {"h100": HOPPER, "h200": HOPPER, "a100": AMPERE}


def family(device_name: str) -> Family:
    """The constants for a device preset by its name's prefix ("h100-sxm" -> HOPPER); any other
    NCCL device is taken as Hopper, the newest generation modelled."""
    for prefix, fam in FAMILIES.items():
        if device_name.lower().startswith(prefix):
            return fam
    return HOPPER


def bus_bandwidth(group: Group, nvlink: float, network: float) -> float:
    """The Simple ring's bus bandwidth of `group` (bytes/s): NVLink inside a node; across
    nodes, the node's k NICs, at most NVLink (see the module docstring)."""
    if group.nodes == 1:
        return nvlink
    return min(nvlink, group.per_node * network)


def lines(kind: str, group: Group, fam: Family, nvlink: float, network: float) -> tuple:
    """The `Line`s of one `kind` call on `group` that are the cheapest at some size, labelled
    "algorithm/protocol".  nvlink, network: the Simple busbw of NVLink and of one NIC."""
    n, k, nodes = group.ranks, group.per_node, group.nodes
    if n <= 1:
        return (Line("none", 0.0, 0.0),)
    bw = bus_bandwidth(group, nvlink, network)
    if kind == "all_to_all":
        hop = fam.latency("net_step" if nodes > 1 else "nvlink_step", "ring", "Simple")
        per_byte = max((k - 1) / n / nvlink, (n - k) / n / network)
        return (Line("pairwise/Simple", fam.latency("base", "ring", "Simple") + hop + (n - 1) * fam.peer_step,
                     per_byte),)
    if kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {kind!r}; one of all_reduce, all_gather, reduce_scatter, all_to_all")
    cap = fam.ll_cap[min(nodes, 3) - 1]
    reduce_all = kind == "all_reduce"
    steps = 2 * (n - 1) if reduce_all else n - 1
    net_steps = (2 if reduce_all else 1) * (nodes - 1)
    frac = steps / n
    out = []
    for p in PROTOCOLS:
        ring_bw = {"LL": min(cap, fam.ll_fraction * bw), "LL128": fam.ll128_fraction * bw, "Simple": bw}[p]
        nvl = fam.latency("nvlink_step", "ring", p)
        if nodes > 1:
            nvl = max(nvl, fam.net_overhead * (3 if p == "Simple" else 1))
        net = fam.latency("net_step", "ring" if k > 1 else "tree", p)
        fixed = fam.latency("base", "ring", p) + (steps - net_steps) * nvl + net_steps * net
        if reduce_all and nodes > 1 and p == "Simple":
            fixed *= fam.ring_plateau
        out.append(Line(f"ring/{p}", fixed, frac / ring_bw))
        if reduce_all:
            tree = fam.tree_fraction * bw
            tree_bw = {"LL": min(tree / fam.tree_ll_divisor, cap),
                       "LL128": tree * (fam.tree_ll128_one_node if nodes == 1 else fam.tree_ll128_nodes),
                       "Simple": tree}[p]
            fixed = fam.latency("base", "tree", p) + 2 * ((k - 1) * fam.latency("nvlink_step", "tree", p)
                                                          + int(math.log2(nodes)) * fam.latency("net_step", "tree", p))
            out.append(Line(f"tree/{p}", fixed, 2 / tree_bw))
    if reduce_all and nodes == 1 and fam.nvls_gain > 0:
        out.append(Line("nvls/Simple", fam.nvls_latency, frac / (fam.nvls_gain * bw)))
    return cheapest(out)


def send_lines(inside: bool, fam: Family, nvlink: float, network: float) -> tuple:
    """The `Line`s of one point-to-point send between neighbours (a pipeline cut): over
    NVLink (`inside`) at `p2p_fraction` of its busbw, else through one NIC; LL for small
    messages (NCCL sends below NCCL_P2P_LL_THRESHOLD, 16 KiB, with LL), Simple for large."""
    hop = "nvlink_step" if inside else "net_step"
    bw = fam.p2p_fraction * nvlink if inside else network
    return cheapest(tuple(Line(f"p2p/{p}", fam.latency("base", "ring", p) + fam.latency(hop, "ring", p),
                               1 / (fam.ll_fraction * bw if p == "LL" else bw)) for p in ("LL", "Simple")))
