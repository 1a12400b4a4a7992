"""ZeRO-1/2 (Rajbhandari et al., 2020), mixed-precision master weights and optimizer offload.

A parameter with ZeRO stage 1 or 2 over mesh axes Z is stored whole on those axes (its
placement says Replicate there) but its optimizer state is split: flatten the local tensor,
pad it to n·c elements (n = ranks on Z, c = ceil(numel / n)) and let the rank with chunk
index k own elements [k·c, min((k+1)·c, numel)).  Only the owner updates them; after the
step the chunks are all-gathered so every rank holds the whole updated parameter again.
At stage 2 the gradient is split too: backward's Partial gradient is reduce-scattered into
the owned chunk instead of all-reduced.

The chunk index orders the axes the gradient still has to be summed over (P, from the
graph: the axes it arrives Partial on) before the others (R = Z minus P):
k = (rank in P) · n_R + (rank in R).  A reduce-scatter over P then hands each rank its
P-chunk, of which it keeps its R-th part; the all-gather after the step runs over R, then P.

Mixed precision: the module computes with param_dtype weights; the optimizer updates
float32 master weights (its owned chunk of them under ZeRO-1/2) and copies them back.
Offload: master weights and optimizer state live on the host (CPU), gradients go down and
updated weights come up each step.  The optimizer that runs on the chunks and masters is
runtime/state/sharded_optimizer.ShardedOptimizer; the layouts are part of runtime/state/rank_state.RankState.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.passes.redistribute import reduce_scatter_rows


@dataclass(frozen=True)
class ZeroLayout:
    """One parameter's chunking under ZeRO-1/2 (see the module docstring)."""

    stage: int
    reduce_axes: tuple   # P: axes its gradient is summed over by the runtime
    rest_axes: tuple     # R: ZeRO axes on which the gradient arrives already summed
    numel: int
    chunk: int           # c
    n_reduce: int
    n_rest: int
    index: int           # k, this rank's chunk
    offload: str = ""    # the tier its master and optimizer state live in: "host", "disk" or "" (the device)

    @property
    def start(self) -> int:
        return min(self.index * self.chunk, self.numel)

    @property
    def end(self) -> int:
        return min((self.index + 1) * self.chunk, self.numel)

    @property
    def geometry(self) -> tuple:
        """Parameters with the same geometry share collectives (buckets)."""
        return self.reduce_axes, self.rest_axes


def zero_layout(stage: int, zero_axes: tuple, reduce_axes: tuple, numel: int, groups, offload="") -> ZeroLayout:
    p_axes = tuple(a for a in zero_axes if a in reduce_axes)
    r_axes = tuple(a for a in zero_axes if a not in reduce_axes)
    n_p = math.prod(groups.size(a) for a in p_axes)
    n_r = math.prod(groups.size(a) for a in r_axes)
    k = _group_rank(groups, p_axes) * n_r + _group_rank(groups, r_axes)
    return ZeroLayout(stage, p_axes, r_axes, numel, math.ceil(numel / (n_p * n_r)), n_p, n_r, k, offload)


def _group_rank(groups, axes: tuple) -> int:
    """This rank's index among its peers on `axes` (row-major over the axes in mesh order)."""
    index = 0
    for a in axes:
        index = index * groups.size(a) + groups.coordinate(a)
    return index


def padded(flat: torch.Tensor, length: int) -> torch.Tensor:
    if flat.numel() == length:
        return flat
    out = flat.new_zeros(length)
    out[: flat.numel()] = flat
    return out


def reduce_scatter_start(grads: list, layouts: list, groups, reduce_dtype=None):
    """Start summing each full local gradient (Partial over its layout's reduce axes) over
    those axes, keeping this rank's chunk: one asynchronous collective for the whole list
    (all of one geometry).  `reduce_scatter_finish(handle)` waits and returns the chunks
    (end - start elements each, in the gradients' dtype)."""
    lay0 = layouts[0]
    dtype = reduce_dtype or grads[0].dtype
    rows = [padded(g.reshape(-1).to(dtype), lay.n_reduce * lay.n_rest * lay.chunk).view(lay.n_reduce, -1)
            for g, lay in zip(grads, layouts)]
    table = torch.cat(rows, dim=1) if len(rows) > 1 else rows[0].clone()
    work, row = None, table[0]
    if lay0.n_reduce > 1:
        work, row = reduce_scatter_rows(table, groups.group_of(lay0.reduce_axes), _group_rank(groups, lay0.reduce_axes),
                                        async_op=True)
    return work, row, [g.dtype for g in grads], layouts, _group_rank(groups, lay0.rest_axes)


def reduce_scatter_finish(handle) -> list:
    work, row, dtypes, layouts, rest = handle
    if work is not None:
        work.wait()
    out, offset = [], 0
    for dtype, lay in zip(dtypes, layouts):
        part = row[offset: offset + lay.n_rest * lay.chunk].view(lay.n_rest, lay.chunk)[rest]
        out.append(part[: lay.end - lay.start].to(dtype).clone())
        offset += lay.n_rest * lay.chunk
    return out


def all_gather_chunks(params: list, layouts: list, groups) -> None:
    """After the step: every rank's updated chunks spread so each holds its parameters whole
    again (in place), over R then over P; one collective per axis set for the whole list."""
    lay0 = layouts[0]
    pieces = [padded(p.detach().reshape(-1)[lay.start: lay.end], lay.chunk) for p, lay in zip(params, layouts)]
    local = torch.cat(pieces)
    if lay0.n_rest > 1:  # chunks -> P-chunks
        gathered = _all_gather_rows(local, lay0.n_rest, groups.group_of(lay0.rest_axes))
        parts, offset = [], 0
        for lay in layouts:
            parts.append(gathered[:, offset: offset + lay.chunk].reshape(-1))
            offset += lay.chunk
        local = torch.cat(parts)
    widths = [lay.n_rest * lay.chunk for lay in layouts]
    if lay0.n_reduce > 1:  # P-chunks -> whole
        gathered = _all_gather_rows(local, lay0.n_reduce, groups.group_of(lay0.reduce_axes))
    else:
        gathered = local.view(1, -1)
    offset = 0
    with torch.no_grad():
        for p, lay, w in zip(params, layouts, widths):
            p.view(-1).copy_(gathered[:, offset: offset + w].reshape(-1)[: lay.numel])
            offset += w


def _all_gather_rows(local: torch.Tensor, n: int, group) -> torch.Tensor:
    """[n, numel]: row i is rank i's `local`."""
    flat = local.new_empty(n * local.numel())
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(flat, local.contiguous(), group=group)
    return flat.view(n, -1)


def buckets(keys: list, layouts: dict, sizes: dict, limit_bytes: int) -> list:
    """Keys grouped by geometry, each group cut into runs of about `limit_bytes`."""
    by_geometry: dict = {}
    for k in keys:
        by_geometry.setdefault(layouts[k].geometry, []).append(k)
    out = []
    for members in by_geometry.values():
        run, size = [], 0
        for k in members:
            run.append(k)
            size += sizes[k]
            if size >= limit_bytes:
                out.append(run)
                run, size = [], 0
        if run:
            out.append(run)
    return out
