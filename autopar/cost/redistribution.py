"""The one redistribution planner: the steps that move a tensor between two layouts on a mesh.

The cost model prices exactly these steps (`autopar.cost.prices.redistribute`) and the runtime
runs exactly these steps (`autopar.passes.redistribute.redistribute_local`), so a plan
never lists a collective that does not run, nor runs one it did not price.

A layout is one placement per mesh axis: torch's `Shard(d)`, `Replicate()`, `Partial()`,
or their integer codes (`layout_code`: Shard(d) is d, Replicate is -1, Partial is -2).
When several mesh axes shard the same tensor dim the earlier axis splits it first and each
piece is split again by the later one: with (Shard(0), Shard(0)) on a (2, 4) mesh the rank
at (i0, i1) holds chunk i0*4 + i1 of 8 equal chunks of dim 0.  `Partial()` means the true
value is the sum over that axis of the local values.  Shards are always even.  An axis of
size 1 holds the whole tensor whatever its placement and takes no step.

So the axes sharding one tensor dim form a stack, outermost (lowest axis) at the bottom.
Every step keeps every stack in mesh order, so that each intermediate layout is again one
placement per axis: a step takes the top axis off a stack (it is the innermost split), or
puts an axis on top that is inner to all axes below it.

The steps (`Step.kind`), on mesh axis a:

    chunk(d)             Replicate -> Shard(d): a local slice
    reduce_scatter(d)    Partial -> Shard(d)
    all_gather(d)        Shard(d) -> Replicate
    zero_pad(d)          Shard(d) -> Partial: the local piece placed in zeros of the gathered size
    all_to_all(d -> e)   Shard(d) -> Shard(e): the all-gather along d and chunk along e in one
    all_reduce           Partial -> Replicate (on several axes at once: `Step.span`)
    keep_on_first        Replicate -> Partial: the value on coordinate 0, zeros elsewhere (exact)

and their order:

 1. per tensor dim, the axes that shard it in both layouts as a common prefix (in mesh
    order) stay;
 2. the other changes run one at a time, shrinking the local tensor before growing it:
    first a chunk or reduce-scatter that can run (its dim has nothing left to take off and
    the destination's outer axes on it are in place; outermost axis first), else an
    all-to-all that can run, else an all-gather or zero-pad of the innermost axis that can
    run.  An all-to-all on axis a from d to e can run when a is the innermost axis on d and
    the axes on e are exactly the destination's axes outer than a: a then becomes e's
    innermost split, and the destination's inner axes on e follow.  So (S(0), R) ->
    (S(1), R) and (R, S(0)) -> (R, S(1)) are one all-to-all, and so is axis 0 of
    (S(0), S(0)) -> (S(1), S(0)) after axis 1's all-gather.  When nothing can run, two
    all-to-alls wait on each other (e.g. (S(0), S(1)) -> (S(1), S(0))): the one on the
    innermost axis becomes an all-gather and, later, a chunk;
 3. Partial -> Replicate axes are all-reduced in one call over all of them (as the
    runtime's gradient sync does; the cost model prices it hierarchically), where the local
    tensor is smallest (the first such point): the steps on other axes are linear and act
    alike on every peer of the reduced axes, so they commute with the reduction;
 4. Replicate -> Partial axes keep the value on coordinate 0, last.

`Step.share` is the fraction of the whole tensor a rank holds when the step starts, so a
step acts on `whole_bytes * share` bytes (an all-gather returns n times that).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

__all__ = ["REPLICATE", "PARTIAL", "COLLECTIVES", "Step", "placement_code", "layout_code",
           "plan_redistribute", "plan_codes", "plan_rows"]

REPLICATE, PARTIAL = -1, -2  # layout codes: Shard(d) is d
COLLECTIVES = frozenset({"all_gather", "reduce_scatter", "all_reduce", "all_to_all"})
_KIND_OF_TYPE: dict = {}


def placement_code(p) -> int:
    """Shard(d) -> d, Replicate() -> -1, Partial() -> -2 (the cost model prices a strided
    shard as a plain one).  isinstance on torch's placement classes is slow, so the kind is
    kept per type."""
    kind = _KIND_OF_TYPE.get(type(p))
    if kind is None:
        kind = ("shard" if isinstance(p, Shard) else "partial" if isinstance(p, Partial)
                else "replicate" if isinstance(p, Replicate) else None)
        if kind is None:
            raise ValueError(f"unsupported placement {p!r}: use Shard(d), Replicate() or Partial()")
        _KIND_OF_TYPE[type(p)] = kind
    if kind == "shard":
        if p.dim < 0:  # its code would read as Replicate or Partial
            raise ValueError(f"{p} counts dims from the end; give the dim from the front "
                             f"(Shard(ndim + {p.dim}))")
        return p.dim
    if kind == "partial":
        op = getattr(p, "reduce_op", "sum")
        if op != "sum":
            raise ValueError(f"Partial({op!r}) is not supported; only sum partials redistribute")
        return PARTIAL
    return REPLICATE


def layout_code(placements) -> tuple:
    """One placement code per mesh axis: a small, fast-hashing key for plans and cost tables."""
    return tuple(placement_code(p) for p in placements)


@dataclass(frozen=True)
class Step:
    """One action on mesh axis `axis` (see the module docstring for the kinds).

    dim: the tensor dim it gathers, pads, slices or scatters (an all-to-all's old shard
    dim); to_dim: an all-to-all's new shard dim; share: the fraction of the whole tensor
    a rank holds when the step starts; span: the further mesh axes one all-reduce covers
    (Partial -> Replicate on several axes is one call over all of them).
    """

    kind: str
    axis: int
    dim: int | None = None
    to_dim: int | None = None
    share: float = 1.0
    span: tuple = ()

    def __str__(self) -> str:
        if self.span:
            return f"{self.kind}(axes {', '.join(map(str, self.axes))})"
        if self.to_dim is not None:
            return f"{self.kind}(dim {self.dim} -> {self.to_dim}, axis {self.axis})"
        return f"{self.kind}(axis {self.axis})" if self.dim is None else \
            f"{self.kind}(dim {self.dim}, axis {self.axis})"

    @property
    def axes(self) -> tuple:
        """Every mesh axis the step acts on, in mesh order."""
        return (self.axis,) + self.span

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVES


def plan_redistribute(src: Sequence, dst: Sequence, sizes: Sequence[int]) -> tuple[Step, ...]:
    """The steps that take a tensor from placements `src` to `dst` on a mesh of axis
    `sizes`, in order.  Shard dims must be non-negative here (the runtime normalizes them
    against the tensor's rank first)."""
    return plan_codes(layout_code(src), layout_code(dst), tuple(sizes))


@functools.lru_cache(maxsize=1 << 14)
def plan_codes(src: tuple, dst: tuple, sizes: tuple) -> tuple[Step, ...]:
    """`plan_redistribute` on layout codes (`layout_code`).  Cached: the runtime runs the
    same few moves every step."""
    return tuple(Step(*row) for row in plan_rows(src, dst, sizes))


def plan_rows(src: tuple, dst: tuple, sizes: tuple) -> tuple:
    """`plan_codes` as plain tuples (kind, axis, dim, to_dim, share, span): what the cost model
    reads, without building a Step per row (it prices tens of thousands of layout pairs
    once each on a 3-axis mesh)."""
    if not len(src) == len(dst) == len(sizes):
        raise ValueError(f"layouts {src} -> {dst} do not match a mesh of {len(sizes)} axes "
                         f"{tuple(sizes)}: give one placement per mesh axis")
    if 1 in sizes:
        src = tuple(c if n > 1 else REPLICATE for c, n in zip(src, sizes))
        dst = tuple(c if n > 1 else REPLICATE for c, n in zip(dst, sizes))
    if src == dst:
        return ()
    rows, split = _shard_moves(src, dst, sizes)
    axes = range(len(src))
    # one all-reduce over every Partial -> Replicate axis, where the local tensor is
    # smallest: before row `at`, or at the end
    splits = [r[4] for r in rows] + [split]
    at = splits.index(max(splits))
    out = [(kind, a, d, e, 1 / before, ()) for kind, a, d, e, before in rows]
    reduce = [a for a in axes if src[a] == PARTIAL and dst[a] == REPLICATE]
    if reduce:
        out.insert(at, ("all_reduce", reduce[0], None, None, 1 / splits[at], tuple(reduce[1:])))
    out += [("keep_on_first", a, None, None, 1 / split, ())
            for a in axes if src[a] == REPLICATE and dst[a] == PARTIAL]
    return tuple(out)


def _changed_axes(src: tuple, dst: tuple, sizes: tuple) -> tuple:
    """(off, on, split): per axis whether its source shard must come off and its
    destination shard go on (the axes sharding a dim in both layouts as a common prefix, in
    mesh order, stay), and how many pieces the source layout cuts the tensor into."""
    k = len(src)
    # (Loops, not all(...): this runs for every pair of layouts the cost model prices.)
    off, on = [False] * k, [False] * k  # a's src shard must come off / its dst shard go on
    split = 1
    for a in range(k):
        s, d = src[a], dst[a]
        kept = s == d and s >= 0
        if kept:
            for b in range(a):
                if (src[b] == s) != (dst[b] == s):
                    kept = False
                    break
        off[a] = s >= 0 and not kept
        on[a] = d >= 0 and not kept
        if s >= 0:
            split *= sizes[a]
    return off, on, split


def _shard_moves(src: tuple, dst: tuple, sizes: tuple) -> tuple:
    """(rows, split): the chunks, reduce-scatters, all-to-alls, all-gathers and zero-pads
    from `src` to `dst` in the order they run, each (kind, axis, dim, to_dim, split before
    the step), shrinking the local tensor before growing it (the module docstring's step
    2), and the split after the last."""
    k = len(src)
    axes = range(k)
    off, on, split = _changed_axes(src, dst, sizes)
    swap = [off[a] and on[a] and src[a] != dst[a] for a in axes]  # Shard(d) -> Shard(e)
    cur = list(src)
    # The stack of dim d is the axes a with cur[a] == d, in mesh order: an axis is on top
    # when no later axis shards its dim.

    def on_top(a: int) -> bool:
        d = cur[a]
        for b in range(a + 1, k):
            if cur[b] == d:
                return False
        return True

    def fits(a: int) -> bool:
        """dst[a]'s stack holds exactly the destination's axes outer than a."""
        e = dst[a]
        for b in axes:
            if b != a and (cur[b] == e) != (b < a and dst[b] == e):
                return False
        return True

    rows = []      # (kind, axis, dim, to_dim, split before the step)
    left = sum(off) + sum(on)
    while left:
        row = None
        for a in axes:  # shrink: chunk / reduce-scatter, outermost first
            if on[a] and not swap[a] and cur[a] < 0 and fits(a):
                row = ("reduce_scatter" if cur[a] == PARTIAL else "chunk", a, dst[a], None, split)
                break
        if row is None:
            for a in axes:
                if swap[a] and on_top(a) and fits(a):
                    row = ("all_to_all", a, cur[a], dst[a], split)
                    break
        if row is None:
            for a in reversed(axes):  # grow: all-gather / zero-pad, innermost first
                if off[a] and not swap[a] and on_top(a):
                    row = ("zero_pad" if dst[a] == PARTIAL else "all_gather", a, cur[a], None, split)
                    break
        if row is None:  # all-to-alls waiting on each other: the innermost gathers, chunks later
            swap[max(a for a in axes if swap[a])] = False
            continue
        rows.append(row)
        kind, a = row[0], row[1]
        if kind in ("all_gather", "zero_pad", "all_to_all"):
            off[a] = False
            left -= 1
            split //= sizes[a]
            cur[a] = PARTIAL if kind == "zero_pad" else REPLICATE
        if kind in ("chunk", "reduce_scatter", "all_to_all"):
            on[a] = swap[a] = False
            left -= 1
            split *= sizes[a]
            cur[a] = dst[a]
    return rows, split
