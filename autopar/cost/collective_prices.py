"""One collective call priced on a mesh's axes: the link it runs over (axis_link), the lines
it may run as (axis_lines, NCCL's or alpha-beta), the cheapest (collective_choice), a
point-to-point send (send_time), and a redistribution's collectives priced as columns of
lines (price_columns), which autopar.cost.prices sums per tensor.

Collectives on an axis of n ranks with bandwidth B (bytes/s, one direction) and latency a,
under the ring:

    all-gather      L + (n-1) a + (n-1)/n * out_bytes / B
    reduce-scatter  L + (n-1) a + (n-1)/n * in_bytes / B
    all-reduce      L + 2(n-1) a + 2(n-1)/n * bytes / B   (a reduce-scatter and an all-gather in one call)
    all-to-all      L + (n-1) a + (n-1)/n * bytes / B

L is the fixed cost of one collective call (launch and synchronisation).  That is the
model of gloo (the CPU preset), of a calibrated device's measured lines and of an axis
given its own bandwidth or latency.  A device that runs NCCL (the GPU presets) is priced as
NCCL runs each call instead (autopar.cost.nccl): its algorithm and protocol by message
size, on the group's placement over nodes (k ranks per node share k NICs), each call at
the cheapest line (autopar.cost.collectives).
"""
from __future__ import annotations

import functools
import math

from autopar.cost import collectives, nccl
from autopar.cost.collectives import Line
from autopar.cost.redistribution import COLLECTIVES, plan_rows
from autopar.mesh import NCCL, Mesh


def axis_link(kind: str, axis: int, mesh: Mesh) -> tuple:
    """(bandwidth, latency, launch) of one `kind` call on mesh axis `axis`.  A calibrated
    device (DeviceSpec.links) has its own line per collective kind and link class (gloo's
    reduce-scatter is an all-reduce underneath: its measured bandwidth shows it); a mesh
    given its own per-axis bandwidth or latency scales the measured ones alike."""
    dev = mesh.device
    inside = mesh.inside[axis]
    found = dev.link(kind, inside)
    if found is None:
        return mesh.bandwidth[axis], mesh.latency[axis], dev.launch_latency
    bandwidth, latency, launch = found
    base_bw = dev.intra_bandwidth if inside else dev.inter_bandwidth
    base_lat = dev.intra_latency if inside else dev.inter_latency
    bandwidth *= mesh.bandwidth[axis] / base_bw
    latency *= mesh.latency[axis] / base_lat if base_lat else 1.0
    return bandwidth, latency, launch


def runs_nccl(kind: str, axes: tuple, mesh: Mesh) -> bool:
    """Whether `kind` calls on mesh `axes` are priced by autopar.cost.nccl: the device runs
    NCCL (DeviceSpec.algorithms == autopar.mesh.NCCL), has no measured line for `kind` on
    these axes' links (`autopar calibrate`'s lines are kept), and the user gave none of the
    axes its own bandwidth or latency (Mesh(bandwidth=..., latency=...): those axes keep the
    alpha-beta lines of autopar.cost.collectives with the numbers given)."""
    dev = mesh.device
    if dev.algorithms != NCCL:
        return False
    for a in axes:
        inside = mesh.inside[a]
        own = ((dev.intra_bandwidth, dev.intra_latency) if inside else (dev.inter_bandwidth, dev.inter_latency))
        if dev.link(kind, inside) is not None or (mesh.bandwidth[a], mesh.latency[a]) != own:
            return False
    return True


@functools.lru_cache(maxsize=4096)
def axis_lines(kind: str, axes: tuple, mesh: Mesh) -> tuple:
    """The `Line`s one `kind` call may run as on the group of ranks along mesh `axes` (one
    axis, or the several one all-reduce spans), bytes as in `collective_time`.  Under NCCL
    (`runs_nccl`): autopar.cost.nccl on the group's placement (`Mesh.placement`), the lines
    cheapest at some size, labelled "algorithm/protocol".  Otherwise: one line per algorithm
    of the device (autopar.cost.collectives) with `axis_link`, on one axis."""
    if runs_nccl(kind, axes, mesh):
        dev = mesh.device
        per_node, nodes = mesh.placement(axes)
        group = nccl.Group(math.prod(mesh.shape[a] for a in axes), per_node, nodes)
        return nccl.lines(kind, group, nccl.family(dev.name), dev.intra_bandwidth, dev.inter_bandwidth)
    (axis,) = axes
    bandwidth, latency, launch = axis_link(kind, axis, mesh)
    return tuple(Line(alg, *collectives.line(kind, alg, mesh.shape[axis], bandwidth, latency, launch))
                 for alg in mesh.device.algorithms)


def send_time(nbytes: float, axis: int, mesh: Mesh) -> float:
    """One point-to-point send of `nbytes` between neighbours on `axis` (a pipeline cut).
    Under NCCL: one send/recv pair (autopar.cost.nccl.send_lines), over NVLink where the
    axis lies inside a node, else through one NIC."""
    if runs_nccl("send", (axis,), mesh):
        dev = mesh.device
        lines = nccl.send_lines(mesh.inside[axis], nccl.family(dev.name), dev.intra_bandwidth, dev.inter_bandwidth)
        return min(ln.seconds(nbytes) for ln in lines)
    bandwidth, latency, launch = axis_link("send", axis, mesh)
    return launch + latency + nbytes / bandwidth


def collective_choice(kind: str, nbytes: float, axis: int, mesh: Mesh) -> tuple:
    """(algorithm, seconds) of one collective call on mesh axis `axis`: the cheapest of its
    `axis_lines` (ties: the first)."""
    lines = axis_lines(kind, (axis,), mesh)
    if mesh.shape[axis] <= 1 or nbytes == 0:
        return lines[0].algorithm, 0.0
    best = min(lines, key=lambda ln: ln.seconds(nbytes))
    return best.algorithm, best.seconds(nbytes)


def price_columns(src: tuple, dst: tuple, mesh: Mesh, rows: list | None = None) -> list:
    """The planned steps' collectives priced, as columns (`collectives.columns`): each a list
    of (kind, axis, share, fixed s, s per byte of the whole tensor, algorithm) per
    collective, share being the fraction of the whole tensor `collective_time` reads (an
    all-gather's output, any other's input).  Column j runs every collective under the
    device's j-th algorithm; under NCCL, column j is one of the few combinations of
    (algorithm, protocol) per collective that is the cheapest over some stretch of the
    tensor's sizes (`collectives.combine`).

    An all-reduce over several axes is one call (autopar/runtime/grads/sync.py), listed per
    axis, fastest axis first.  Under NCCL it is priced as one call on the group of all those
    axes (the first row; the others cost 0 s).  Otherwise as a hierarchical one: the fastest
    axis reduce-scatters and all-gathers the whole local tensor, the next one all-reduces the
    1/n left, and so on; one launch in all.  rows: plan_rows(src, dst, mesh.shape), where
    the caller has them."""
    algorithms = mesh.device.algorithms
    steps = []   # (kind, axis, share, lines in the whole tensor's bytes; None: priced with the step before)
    for kind, a, _, _, share, span in (plan_rows(src, dst, mesh.shape) if rows is None else rows):
        if kind not in COLLECTIVES:
            continue
        if kind == "all_reduce":
            levels = sorted((a,) + span, key=lambda x: -axis_link(kind, x, mesh)[0]) if span else (a,)
            if runs_nccl(kind, levels, mesh):
                for i, x in enumerate(levels):
                    steps.append((kind, x, share, None if i else tuple(ln.scaled(share) for ln in
                                                                        axis_lines(kind, tuple(levels), mesh))))
                    share /= mesh.shape[x]
                continue
            first = True
            for x in levels:
                bandwidth, latency, launch = axis_link(kind, x, mesh)
                steps.append((kind, x, share, tuple(
                    Line(alg, *collectives.line(kind, alg, mesh.shape[x], bandwidth, latency,
                                                launch if first else 0.0)).scaled(share) for alg in algorithms)))
                share, first = share / mesh.shape[x], False
            continue
        if kind == "all_gather":
            share *= mesh.shape[a]  # > 1: the planner gives axes of size 1 no step
        steps.append((kind, a, share, tuple(ln.scaled(share) for ln in axis_lines(kind, (a,), mesh))))
    if algorithms == NCCL:
        chosen = collectives.combine([lines for *_, lines in steps if lines is not None], collectives.NCCL_COLUMNS)
    else:
        chosen = [tuple(lines[j] for *_, lines in steps) for j in range(len(algorithms))]
    columns = []
    for picks in chosen:
        picks, rows, last = iter(picks), [], None
        for kind, a, share, lines in steps:
            last = next(picks) if lines is not None else Line(last.algorithm, 0.0, 0.0)
            rows.append((kind, a, share, last.fixed, last.per_byte, last.algorithm))
        columns.append(rows)
    return columns
