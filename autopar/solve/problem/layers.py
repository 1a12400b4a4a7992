"""Identical repeated layers share one set of choices: the problem does not grow with depth."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.trace.paths import block_of

SHARE_PERIOD = 2  # see share_layers and reduce_problem(period=...)


@dataclass
class LayerSharing:
    """layer_groups: (module prefix, indices) of each set of identical layers; tie:
    representative of an odd layer's node -> that of the even layer (period 1 ties them);
    block: node index -> (prefix, layer index) of the layer it belongs to."""

    layer_groups: list
    tie: dict
    block: dict


def args_signature(node: fx.Node):
    def norm(a):
        if isinstance(a, fx.Node):
            return "node"
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype)):
            return a
        return type(a).__name__
    return norm(node.args), tuple(sorted((k, norm(v)) for k, v in node.kwargs.items()))



def share_layers(nodes: list, readers: dict, gradsum_of: dict) -> LayerSharing:
    """Identical repeated layers (same ops, shapes and wiring) share representatives.

    Layers alternate between SHARE_PERIOD sets of choices (even layers share one set, odd
    layers the other), so the problem does not grow with depth yet alternating layouts,
    such as Megatron's column/row pattern over bare linear layers, stay reachable."""
    blocks: dict[tuple, list[int]] = {}
    for pn in nodes:
        key = block_of(pn.module) if pn.kind in ("op", "param") else None
        if key is not None:
            blocks.setdefault(key, []).append(pn.index)
    for pn in nodes:
        pn.rep = pn.index
    by_sig: dict[tuple, list[int]] = {}
    for key, members in blocks.items():
        local = {m: k for k, m in enumerate(members)}
        sig = []
        for m in members:
            pn = nodes[m]
            rest = pn.module[len(f"{key[0]}.{key[1]}"):]
            wiring = tuple((local[s], o) if s in local else ("ext", nodes[s].requires_grad)
                           for s, o in pn.inputs)
            sig.append((pn.kind, pn.op, rest, tuple(pn.out_shapes), tuple(pn.out_dtypes), wiring,
                        args_signature(pn.node), pn.requires_grad))
        by_sig.setdefault((key[0], tuple(sig)), []).append(key[1])
    layer_groups = []
    tie: dict[int, int] = {}  # representative of an odd layer -> that of the even layer
    block: dict[int, tuple] = {}
    for (prefix, _), indices in by_sig.items():
        indices.sort()
        for i in indices:
            for m in blocks[(prefix, i)]:
                block[m] = (prefix, i)
        for k, i in enumerate(indices[SHARE_PERIOD:], start=SHARE_PERIOD):
            first = blocks[(prefix, indices[k % SHARE_PERIOD])]
            for rep, m in zip(first, blocks[(prefix, i)]):
                nodes[m].rep = rep
        if len(indices) > 1:
            for even, odd in zip(blocks[(prefix, indices[0])], blocks[(prefix, indices[1])]):
                tie[odd] = even
        layer_groups.append((prefix, indices))
    for (src, out), gs in gradsum_of.items():
        rep_gs = gradsum_of.get((nodes[src].rep, out))
        if rep_gs is not None and len(readers[(src, out)]) == len(readers[(nodes[src].rep, out)]):
            nodes[gs].rep = rep_gs
    for odd, even in list(tie.items()):
        gs_odd, gs_even = (gradsum_of.get((n, 0)) for n in (odd, even))
        if gs_odd is not None and gs_even is not None and nodes[gs_odd].rep == gs_odd:
            tie[gs_odd] = gs_even
    return LayerSharing(layer_groups, tie, block)


@dataclass(frozen=True)
class StandIns:
    """What each node of a shortened trace (autopar/trace/shortened.py) stands for:
    weights, node index -> how many of the model's nodes it counts as (those of a kept
    layer standing for several; absent: one); places, node index -> its place in the
    layers' order (its layer's index; `after` past them, for a node that reads what they
    made; absent: before them).  An edge
    counts as the later of its ends (edge_weight).  Empty for a whole trace."""

    weights: dict
    places: dict
    after: int = 0

    def weight(self, index: int) -> int:
        return self.weights.get(index, 1)

    def holders(self, owner: int, holder: int) -> int:
        """How many holders of one storage `holder` stands for (SavedMemory.savers): those
        of every layer it stands for where the storage is made before or past the layers
        (each layer's ops hold it), one where a layer made it (one copy of that layer's)."""
        at = self.places.get(owner)
        return 1 if at is not None and at < self.after else self.weight(holder)

    def edge_weight(self, a: int, b: int) -> int:
        if not self.weights:
            return 1
        pa, pb = self.places.get(a, -1), self.places.get(b, -1)
        return self.weight(a if pa > pb else b)


def stand_ins(nodes: list, block: dict, layers: tuple, weights: dict) -> StandIns:
    """The StandIns of a problem's nodes (`block` from share_layers) traced with
    Traced.layers and Traced.weights."""
    if not weights:
        return StandIns({}, {})
    path, count, _ = layers
    places, out = {}, {}
    for pn in nodes:   # (in graph order, gradient sums last)
        src = pn.source[0] if pn.kind == "gradsum" else pn.index
        at = block.get(src)
        if at is not None and at[0] == path:
            places[pn.index] = at[1]
            if weights.get(at[1], 1) != 1:
                out[pn.index] = weights[at[1]]
        elif src in places:   # (a gradient sum of a tensor made past the layers)
            places[pn.index] = places[src]
        elif pn.kind in ("op", "output") and any(i in places and nodes[i].kind != "param" for i, _ in pn.inputs):
            places[pn.index] = count   # past the layers: it reads what they made
    return StandIns(out, places, count)
