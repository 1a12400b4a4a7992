"""gathers: ZeRO-3's weight gathers and offloaded weights' fetches, marked for the runtime.

    sites = mark_gathers(gm, params, sizes, grouped=..., offloaded=...)

A parameter stored Shard on an axis where its op reads it whole is all-gathered before use
by a move (passes/collectives.py).  Each such move whose forward is only all-gathers
(local slices allowed) becomes

    move(param, m, groups)  ->  gather(<GATHERS slot>, k, param, m, groups)

numbered k = 0, 1, ... in graph order; and each reader of an offloaded weight (its stored
shard in host memory or on disk) that takes it without a gather reads

    fetch(<GATHERS slot>, param)

made before the first such reader.  The runtime binds the GATHERS slot to its Regather
(autopar/runtime/regions/reshard.py: prefetch, buckets, saved-tensor hooks, copies to the
device), built from the GatherSites this returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from autopar.passes.collectives import move
from autopar.passes.redistribute import plan_redistribute
from autopar.passes.slots import GATHERS, slot


@dataclass(frozen=True)
class GatherSites:
    """What mark_gathers marked in one graph.  order: k -> (placeholder name, Move, the
    forward's redistribute steps); flat: k -> (mesh axis, dim) of a gather that may share
    a bucket (one all-gather forward, one reduce-scatter backward on the same axis and dim,
    of a weight in `grouped`); fetches: how many fetch nodes."""

    order: tuple = ()
    flat: dict = field(default_factory=dict)
    fetches: int = 0

    def __bool__(self) -> bool:
        return bool(self.order) or bool(self.fetches)

    def __str__(self) -> str:
        return f"{len(self.order)} weight gathers ({len(self.flat)} bucketable), {self.fetches} host fetches"


def gather(gathers, k: int, x, m, groups):
    """Gather site k: the bound Regather's k-th gather of weight x."""
    return gathers.gather(k, x, m, groups)


def fetch(gathers, x):
    """An offloaded weight copied to the device by the bound Regather."""
    return gathers.fetch(x)


def _identity(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether a move node's forward leaves its tensor as it is (same layout on both sides)."""
    m = getattr(gm, node.args[1].target)
    return tuple(m.src) == tuple(m.dst)


def mark_gathers(gm: fx.GraphModule, params: set, sizes, *, grouped: frozenset = frozenset(),
                 offloaded: frozenset = frozenset()) -> GatherSites:
    """Mark gm's weight gathers and fetches (module docstring).  params: the parameter
    placeholders' names; sizes: the mesh axes' sizes; grouped: the placeholders whose
    gathers may share buckets; offloaded: the placeholders whose stored shard lives off the
    device."""
    order, flat = [], {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not move:
            continue
        src = node.args[0]
        while src.op == "call_function" and src.target is move and _identity(gm, src):
            src = src.args[0]   # (a tied weight's gradient-sum point: forward is the weight)
        if src.op != "placeholder" or src.target not in params:
            continue
        m = getattr(gm, node.args[1].target)
        steps = plan_redistribute(m.src, m.dst, list(sizes))  # local slices too: a prefetch must do all
        collective = [s for s in steps if s.is_collective]
        if not collective or any(s.kind != "all_gather" for s in collective):
            continue
        k = len(order)
        order.append((src.target, m, steps))
        with gm.graph.inserting_before(node):
            gathers = slot(gm, GATHERS)
        node.target = gather
        node.args = (gathers, k) + tuple(node.args)
        back = plan_redistribute(m.grad_src, m.grad_dst, list(sizes))
        if (src.target in grouped and len(steps) == 1 and len(back) == 1 and back[0].kind == "reduce_scatter"
                and (back[0].axis, back[0].dim) == (steps[0].axis, steps[0].dim)):
            flat[k] = (steps[0].axis, steps[0].dim)
    fetches = 0
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):   # readers of an offloaded weight without a gather read a copy
        if node.op != "placeholder" or node.target not in offloaded:
            continue
        sources = [node]   # the weight, and the identity moves of it (a tied weight's gradient-sum point)
        for src in sources:
            sources += [u for u in src.users if u.target is move and _identity(gm, u)]
        for src in sources:
            direct = [u for u in src.users if u.target is not gather and u not in sources]
            if direct:
                with gm.graph.inserting_before(min(direct, key=position.__getitem__)):   # (made when first read)
                    copy = gm.graph.call_function(fetch, (slot(gm, GATHERS), src))
                for u in direct:
                    u.replace_input_with(src, copy)
                fetches += 1
    if order or fetches:
        gm.graph.lint()
        gm.recompile()
    return GatherSites(tuple(order), flat, fetches)
