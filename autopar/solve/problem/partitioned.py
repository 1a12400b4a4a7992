"""What a compiled step keeps for backward when nothing is recomputed by the plan.

Under backend "inductor" each compiled region's forward and backward are split by the
compiler's partitioner, which saves for backward only what it cannot cheaply run again: a
pointwise op's output (a GELU's inner terms, a norm's scaled input, SwiGLU's gated
product) is recomputed in backward from what is kept anyway, where eager autograd keeps
every operand each op's derivative reads.  The model here, per tensor that some op's
derivative reads (SavedMemory.holdings):

- it is kept when its producer is not recomputable: a matrix product, attention, an
  embedding, a norm or softmax kernel, a reduction that shrinks its input more than
  fourfold, an op that runs eagerly (random draws, autopar's own ops), or a parameter or
  input;
- it is kept when a derivative that is not pointwise reads it (a matrix product's weight
  gradient reads its input: backward materialises it, so running its producer again would
  cost a kernel);
- it is kept when a reader sits in another compiled region (regions end at a layer's
  bounds and at every eager op);
- otherwise its producer runs again in backward, and what that reads is needed in turn.

Tensors are taken from the latest producer back, so that every reader of a tensor is
known when it is decided.  Where recomputing a tensor would keep a larger one, the
partitioner's minimum cut would keep the smaller; the model does not weigh that (the
pointwise chains it runs again keep or shrink their operands' sizes in the families
tested).
"""
from __future__ import annotations

import heapq
import math

from autopar.ops.rules import ELEMENTWISE
from autopar.ops.rules import VIEWS
from autopar.solve.problem.graph import compiles

# ops the partitioner runs again in backward rather than keep (pointwise ops, views, copies
# and casts), and reductions it runs again unless they shrink their input more than 4x
RECOMPUTABLE = (ELEMENTWISE - {"aten.dropout", "aten.native_dropout"}) | VIEWS | {
    "aten.clone", "aten._to_copy", "aten.to", "aten.type_as", "aten.contiguous", "aten.reshape",
    "aten.view_as_real", "aten.view_as_complex", "aten.cat", "aten.stack"}
REDUCTIONS = frozenset({"aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.var", "aten.std"})


def partitioned_holdings(nodes: list, holdings: dict, block: dict, storage_root) -> dict:
    """node index -> the holdings (SavedMemory.holdings' items) a compiled step keeps for it,
    under the module docstring's model; items of tensors run again are dropped, and a
    recomputed op holds (as "in" items) the operands it reads that are kept.  block: node
    index -> its layer (solve/problem/layers.py); storage_root: SavedMemory.storage_root."""
    region = _regions(nodes, block)
    kept: dict = {}
    needs: dict = {}   # storage -> [(reader, item, whether the reader's derivative is pointwise)]
    heap: list = []

    def need(key, reader, item, pointwise):
        if key not in needs:
            needs[key] = []
            heapq.heappush(heap, (-key[0], -key[1]))
        needs[key].append((reader, item, pointwise))

    for n, items in holdings.items():
        pn = nodes[n]
        pointwise = recomputable(pn)
        kept[n] = []
        for item in items:
            key, kind = item[0], item[1]
            if kind in ("in", "out") and key is not None:
                need(key, n, item, pointwise)
            else:
                kept[n].append(item)
    while heap:
        key = tuple(-x for x in heapq.heappop(heap))
        src = nodes[key[0]]
        readers = needs[key]
        if src.kind == "op" and recomputable(src) and all(
                pointwise and region.get(reader) == region.get(src.index) for reader, _, pointwise in readers):
            for k, (s, o) in enumerate(src.inputs):   # run again: what it reads is needed
                root = storage_root(s, o)
                head = nodes[root[0]]
                if head.kind != "op":
                    kept.setdefault(src.index, []).append((None, "leaf", k, 0.0))
                    continue
                item = (root, "in", k, math.prod(head.out_shapes[root[1]]) * head.out_dtypes[root[1]].itemsize)
                need(root, src.index, item, True)
            continue
        for reader, item, _ in readers:
            kept.setdefault(reader, []).append(item)
    return {n: items for n, items in kept.items() if items}


def recomputable(pn) -> bool:
    """Whether the partitioner may run op pn again in backward (RECOMPUTABLE, REDUCTIONS that
    shrink their input at most fourfold, and only ops that run compiled)."""
    if pn.kind != "op" or not compiles(pn):
        return False
    if pn.op in RECOMPUTABLE:
        return True
    if pn.op in REDUCTIONS and pn.out_shapes:
        return 4 * math.prod(pn.out_shapes[0]) >= sum(math.prod(s) for s in _in_shapes(pn))
    return False


def _in_shapes(pn) -> list:
    return [a.meta["val"].shape for a in pn.node.all_input_nodes
            if hasattr(a.meta.get("val"), "shape")]


def _regions(nodes: list, block: dict) -> dict:
    """op index -> its compiled region: a new one at each layer's bounds and around each op
    that runs eagerly."""
    out, region, last = {}, 0, None
    for pn in nodes:
        if pn.kind != "op":
            continue
        where = block.get(pn.index)
        if not compiles(pn):
            region += 1
            out[pn.index] = region
            region, last = region + 1, None
            continue
        if where != last:
            region, last = region + 1, where
        out[pn.index] = region
    return out
