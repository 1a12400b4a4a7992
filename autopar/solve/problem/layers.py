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
