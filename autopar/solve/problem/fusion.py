"""What the backend fuses: under Inductor, chains of memory-bound ops run as one kernel that
reads the chain's inputs once, writes only what leaves the chain and launches once."""
from __future__ import annotations

from autopar.ops.rules import ELEMENTWISE, VIEWS
from autopar.solve.problem.graph import PNode

# ops Inductor fuses with their fusible neighbours into one kernel: pointwise ops, and the
# reductions of norms and softmax, which take pointwise prologues and epilogues
FUSIBLE = ELEMENTWISE | {"aten.layer_norm", "aten.rms_norm", "aten.softmax", "aten._softmax", "aten.log_softmax",
                         "aten._log_softmax"}


def fused_chains(nodes: list, readers: dict, backend: str) -> dict:
    """Under backend "inductor": op index -> (operands its fused chain produced, whether its
    output stays inside the chain, whether it heads the chain).  Inductor runs a chain of
    FUSIBLE ops (linked directly or through views) as one kernel: it reads the chain's
    inputs once, writes only what leaves the chain (to any other op or the graph's
    output), and launches once, for its head; its backward likewise.  Under "eager" every
    op reads, writes and launches on its own (empty)."""
    if backend != "inductor":
        return {}

    def fusible(pn) -> bool:
        return pn.kind == "op" and pn.op in FUSIBLE

    def producer(src: int):
        pn = nodes[src]
        while pn.kind == "op" and pn.op in VIEWS and pn.inputs:
            pn = nodes[pn.inputs[0][0]]
        return pn

    def leaves(index: int, out: int) -> bool:
        for reader, _ in readers.get((index, out), ()):
            r = nodes[reader]
            if r.kind == "op" and r.op in VIEWS:
                if any(leaves(reader, o) for o in range(len(r.out_shapes))):
                    return True
            elif not fusible(r):
                return True
        return False

    chains = {}
    for pn in nodes:
        if fusible(pn):
            fused_in = frozenset(k for k, (src, _) in enumerate(pn.inputs) if fusible(producer(src)))
            kept = not any(leaves(pn.index, o) for o in range(len(pn.out_shapes)))
            chains[pn.index] = (fused_in, kept, not fused_in)
    return chains


def launches(pn: PNode, backend: str, chains: dict) -> bool:
    """Whether op pn launches a kernel the host issues: always under eager; under inductor
    a view is compiled away and a fused op rides its chain head's kernel (`chains`:
    fused_chains')."""
    if backend == "eager":
        return True
    return pn.op not in VIEWS and chains.get(pn.index, ((), False, True))[2]
