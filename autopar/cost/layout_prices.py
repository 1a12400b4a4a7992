"""Redistribution prices between whole menus of layouts, each pair of layouts priced once.

A problem's edges ask for [choices of the producer, choices of the consumer] seconds of
moving one tensor; on a 3-axis mesh menus hold ~125 layouts, so an edge has ~15,000
pairs, and the same pairs come back on every edge of the same shape.  `LayoutPrices`
keeps one table per mesh: layout code -> id, and per pair of ids the `redistribute_price`
lines (rows named by `prices.Row`, one column per collective algorithm), so a tensor's
seconds are two numbers per pair scaled by its bytes and minimised over algorithms.

A menu is given as a `Menu` (its distinct layout codes, and the index of each choice's
code among them: `menu(codes)`); a None code stands for no tensor and is priced 0 s.
"""
from __future__ import annotations

import collections
import math
import threading
from dataclasses import dataclass

import numpy as np

from autopar.cost import collectives
from autopar.cost import prices as C
from autopar.mesh import Mesh


@dataclass(frozen=True)
class Menu:
    """A menu's layouts grouped so each distinct layout is priced once: `codes` in first-seen
    order, and `index[i]` the position of choice i's code among them."""

    codes: list
    index: np.ndarray


def menu(keys: list) -> Menu:
    distinct: dict = {}
    index = np.array([distinct.setdefault(k, len(distinct)) for k in keys], dtype=int)
    return Menu(list(distinct), index)


@dataclass(frozen=True)
class Bucketed:
    """What a parameter gradient's reduction costs where the runtime buckets it
    (autopar/runtime/grads/sync.py), [choices, choices]: `paid_here` the fixed cost of the
    calls less the gradient's own share (what the step saves by bucketing, to subtract
    from the edge), `bucket_seconds` what the bucket stream runs for this gradient,
    `copy_bytes` what the bucket's flat buffer copies of it (prices.bucket_copy_bytes: in
    and back out, read and write)."""

    paid_here: np.ndarray
    bucket_seconds: np.ndarray
    copy_bytes: np.ndarray


class LayoutPrices:
    """The price table of one mesh: grows as layouts are met, prices a pair once."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.ids: dict = {}
        self.table = np.full((C.PRICE_ROWS, collectives.columns(mesh.device), 0, 0), np.nan)
        self._lock = threading.Lock()   # (a table shared by plans in several threads: shared_prices)

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def lines(self, src: Menu, dst: Menu, reverse: bool = False) -> np.ndarray:
        """[PRICE_ROWS, algorithms, distinct src, distinct dst] redistribute_price lines
        (`reverse`: each priced from the dst layout to the src one)."""
        with self._lock:
            rows, cols = self._ids(src.codes), self._ids(dst.codes)
            return self._priced(cols, rows).transpose(0, 1, 3, 2) if reverse else self._priced(rows, cols)

    def flags(self, src: Menu, dst: Menu, row: int, reverse: bool = False) -> np.ndarray:
        """[choices of src, choices of dst] booleans of the flag row `row` (prices.Row.ONE_*)."""
        return self.lines(src, dst, reverse)[row, 0][np.ix_(src.index, dst.index)] > 0.5

    def one_reduction(self, src: Menu, dst: Menu, reverse: bool = False) -> np.ndarray:
        """[choices of src, choices of dst] booleans: the whole move is one all-reduce (over
        one axis or several, one call) or one reduce-scatter, the input-gradient moves the
        runtime starts beside a linear's weight gradient (autopar/passes/fold_linears.py)."""
        lines = self.lines(src, dst, reverse)
        only = (np.isclose(lines[C.Row.FIXED], lines[C.Row.ALL_REDUCE_FIXED], rtol=1e-9, atol=0.0)
                & np.isclose(lines[C.Row.PER_BYTE], lines[C.Row.ALL_REDUCE_PER_BYTE], rtol=1e-9, atol=0.0)
                & (lines[C.Row.PER_BYTE] > 0)).all(axis=0)
        return (only | (lines[C.Row.ONE_REDUCE_SCATTER, 0] > 0.5))[np.ix_(src.index, dst.index)]

    def copy_bytes(self, shape, item: int, src: Menu, dst: Menu, kind: str, reverse: bool = False) -> np.ndarray:
        """[choices of src, choices of dst] bytes the runtime's flat buffers copy where it
        runs the move's collectives of `kind` in buckets (prices.bucket_copy_bytes)."""
        whole = (math.prod(shape) if shape else 1) * item
        return self.lines(src, dst, reverse)[C.COPY_ROWS[kind], 0][np.ix_(src.index, dst.index)] * whole

    def seconds(self, shape, item: int, src: Menu, dst: Menu, reverse: bool = False, gathers: bool = False,
                share: float = 1.0) -> np.ndarray:
        """[choices of src, choices of dst] seconds of moving a tensor of `shape` (elements of
        `item` bytes) from each row's layout to each column's (`reverse`: from each column's
        to each row's), the cheapest algorithm per pair; `gathers`: only the all-gathers
        among the steps; `share`: of the calls' fixed seconds (a bucket member's,
        prices.bucket_share)."""
        whole = (math.prod(shape) if shape else 1) * item
        if whole == 0:
            return np.zeros((len(src.index), len(dst.index)))
        lines = self.lines(src, dst, reverse)
        fixed, per_byte = ((lines[C.Row.GATHER_FIXED], lines[C.Row.GATHER_PER_BYTE]) if gathers
                           else (lines[C.Row.FIXED], lines[C.Row.PER_BYTE]))
        if share == 1.0:
            return (fixed + per_byte * whole).min(axis=0)[np.ix_(src.index, dst.index)]
        # the algorithm is the one the tensor's own size picks (as prices.redistribute lists
        # it); the bucket then shares that choice's fixed seconds
        best = (lines[C.Row.FIXED] + lines[C.Row.PER_BYTE] * whole).argmin(axis=0)[None]
        seconds = np.take_along_axis(fixed * share + per_byte * whole, best, axis=0)[0]
        return seconds[np.ix_(src.index, dst.index)]

    def bucketed(self, shape, item: int, src: Menu, dst: Menu, zero2: np.ndarray,
                 reverse: bool = False) -> Bucketed:
        """The bucketed part of a parameter gradient's reduction priced by `seconds` with the
        same arguments: the fixed cost of its all-reduces, and of its reduce-scatters where
        `zero2` (broadcastable to [src, dst]: the parameter's ZeRO-2 choices; ZeRO-3's run per
        parameter), less the gradient's own share of the calls."""
        whole = (math.prod(shape) if shape else 1) * item
        if whole == 0:
            empty = np.zeros((len(src.index), len(dst.index)))
            return Bucketed(empty, empty, empty)
        lines = self.lines(src, dst, reverse)
        best = (lines[C.Row.FIXED] + lines[C.Row.PER_BYTE] * whole).argmin(axis=0)   # `seconds`' algorithm

        def pick(row):
            return np.take_along_axis(row, best[None], axis=0)[0][np.ix_(src.index, dst.index)]

        fixed = pick(lines[C.Row.ALL_REDUCE_FIXED]) + np.where(zero2, pick(lines[C.Row.REDUCE_SCATTER_FIXED]), 0.0)
        per_byte = (pick(lines[C.Row.ALL_REDUCE_PER_BYTE])
                    + np.where(zero2, pick(lines[C.Row.REDUCE_SCATTER_PER_BYTE]), 0.0))
        share = C.bucket_share(whole)
        copies = (pick(lines[C.Row.COPY_ALL_REDUCE])
                  + np.where(zero2, pick(lines[C.Row.COPY_REDUCE_SCATTER]), 0.0)) * whole
        return Bucketed(fixed * (1.0 - share), fixed * share + per_byte * whole, copies)

    def _ids(self, codes) -> np.ndarray:
        return np.array([self.ids.setdefault(c, len(self.ids)) for c in codes], dtype=int)

    def _priced(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """[PRICE_ROWS, algorithms, len(src), len(dst)] between layouts by id, each pair
        computed once (the table grows as layouts are met; unknown prices are NaN)."""
        size = len(self.ids)
        if size > self.table.shape[2]:
            grown = np.full(self.table.shape[:2] + (2 * size, 2 * size), np.nan)
            grown[:, :, :self.table.shape[2], :self.table.shape[3]] = self.table
            self.table = grown
        sub = self.table[:, :, src[:, None], dst[None, :]]
        missing = np.isnan(sub[0, 0])
        if missing.any():
            code = list(self.ids)
            for x, y in zip(*np.nonzero(missing)):
                s, d = code[src[x]], code[dst[y]]
                self.table[:, :, src[x], dst[y]] = 0.0 if s is None or d is None else C.redistribute_price(
                    s, d, self.mesh)
            sub = self.table[:, :, src[:, None], dst[None, :]]
        return sub


SHARED_MESHES = 4   # meshes whose price tables shared_prices keeps
_SHARED: collections.OrderedDict = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()


def shared_prices(mesh: Mesh) -> LayoutPrices:
    """The price table of `mesh`, one for every problem built on an equal mesh in this
    process (of the last SHARED_MESHES meshes met): a pair's price depends on the two
    layouts and the mesh alone, and the pipeline search builds a problem per microbatch
    size on each sub-mesh, then the planner the winner's again (a 3-axis table prices
    36,000 pairs, most of building the 405B-shaped Llama's stage problems)."""
    with _SHARED_LOCK:
        table = _SHARED.pop(mesh, None)
        if table is None:
            table = LayoutPrices(mesh)
        _SHARED[mesh] = table
        while len(_SHARED) > SHARED_MESHES:
            _SHARED.popitem(last=False)
        return table
