"""slots: the run-time objects a rewritten graph reads, named by the passes and bound by the runtime.

The passes make the whole per-rank graph and hold nothing of a running job: no process
group, no random stream, no gathered weight.  Where a node needs one at run time (a
move's collectives, a random op's stream, a ZeRO-3 gather's buckets), it reads a named
slot of its GraphModule through a get_attr node:

    GROUPS   "_autopar_groups"    the AxisGroups the collectives run over
    STREAMS  "_autopar_streams"   the RandomStreams random ops draw from
    GATHERS  "_autopar_gathers"   the Regather of the graph's ZeRO-3 gathers and host fetches

The pass that first reads a slot declares it (`slot`): the GraphModule holds an
`Unbound` there, which says what is missing if the graph runs before the runtime binds
the slot (autopar/runtime/build.py).  `bind` sets a slot on a graph and on every graph
module below it (a recomputed layer's body reads the slots of the graph it was cut from).
"""
from __future__ import annotations

import warnings

import torch.fx as fx

GROUPS = "_autopar_groups"
STREAMS = "_autopar_streams"
GATHERS = "_autopar_gathers"
SLOTS = (GROUPS, STREAMS, GATHERS)


class SlotError(RuntimeError):
    """A rewritten graph ran before the runtime bound one of its slots."""


class Unbound:
    """What a declared slot holds until the runtime binds it."""

    def __init__(self, name: str):
        self._slot = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise SlotError(f"the graph's slot {self._slot!r} is not bound (asked for .{attr}): a rewritten graph "
                        f"runs only after the runtime binds its run-time objects (autopar.compile does; "
                        f"see autopar/runtime/build.bind_rank)")

    def __repr__(self) -> str:
        return f"Unbound({self._slot!r})"


def get_attr(graph: fx.Graph, name: str) -> fx.Node:
    """A get_attr node for a plain (non-tensor, non-module) attribute of the GraphModule;
    fx warns about those, but they work and keep the generated code readable."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return graph.get_attr(name)


def slot(gm: fx.GraphModule, name: str) -> fx.Node:
    """A get_attr node of slot `name` at the graph's insertion point, the slot declared on
    gm (Unbound) if it is not yet."""
    if name not in SLOTS:
        raise ValueError(f"unknown graph slot {name!r}; the slots are {SLOTS}")
    if not hasattr(gm, name):
        setattr(gm, name, Unbound(name))
    return get_attr(gm.graph, name)


def declared(gm: fx.GraphModule) -> set:
    """The slots gm or a graph module below it reads and nobody bound yet."""
    return {name for mod in gm.modules() for name in SLOTS
            if isinstance(getattr(mod, name, None), Unbound)}


def bind(gm: fx.GraphModule, name: str, value) -> int:
    """Set slot `name` to `value` on gm and every module below it that declares it;
    returns on how many modules."""
    if name not in SLOTS:
        raise ValueError(f"unknown graph slot {name!r}; the slots are {SLOTS}")
    count = 0
    for mod in gm.modules():
        if name in vars(mod):   # (declared by `slot`, or copied into a region body cut from it)
            setattr(mod, name, value)
            count += 1
    return count
