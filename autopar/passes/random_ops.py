"""random_ops: every random op of the per-rank graph draws from its own numbered stream.

    sites = route_random(gm)

rewrites each node that draws random numbers (dropout, bernoulli, attention with a
dropout probability)

    op(*args, **kwargs)  ->  draw(*args, _autopar_streams=<STREAMS slot>, _autopar_site=k, **kwargs)

numbering the sites k = 0, 1, ... over the whole graph (so it runs before the pipeline
cut), and returns each site's RandomSite: the op and the mesh axes its output is split on
(Shard).  The runtime's RandomStreams (autopar/runtime/regions/rng.py) binds the STREAMS
slot: it seeds each site's draw from the job's seed, the forward call, k and this rank's
coordinates on the site's split axes; the rule is in that module's docstring.  The node
keeps its op in node.meta["aten_target"].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.ops import op_arg
from autopar.passes.slots import STREAMS, slot


@dataclass(frozen=True)
class RandomSite:
    """One random op of the graph: `op` (an ATen op) and the mesh axes its output is split on."""

    op: object
    split: tuple

    def __str__(self) -> str:
        return f"{self.op} (own numbers along mesh axes {list(self.split)})"


def is_random(node: fx.Node) -> bool:
    """Whether a graph node draws random numbers (ATen tags such ops nondeterministic_seeded).
    Attention counts only with a dropout probability that is not a constant 0."""
    if node.op != "call_function" or not hasattr(node.target, "tags"):
        return False
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    if node.target is torch.ops.aten.scaled_dot_product_attention.default:
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return p != 0.0
    return True


def draws_nothing(node: fx.Node):
    """The ATen op of a random node (routed through a stream or not) that draws nothing
    here: a dropout whose probability is the constant 0, or whose `train` flag is the
    constant False (eval mode), returns its input and an all-true mask.  Else None.  The
    op stays routed through its stream (so running it never moves the user's own random
    state), but a compiled region may run it as the plain op, which Inductor reduces to
    its input."""
    op = node.meta.get("aten_target", node.target) if node.op == "call_function" else None
    if op not in (torch.ops.aten.native_dropout.default, torch.ops.aten.dropout.default):
        return None
    p, train = op_arg(node, 1, "p"), op_arg(node, 2, "train")   # (both dropouts: input, p, train)
    if isinstance(p, (int, float)) and p == 0 or train is False:
        return op
    return None


def draw(*args, _autopar_streams, _autopar_site: int, **kwargs):
    """A routed random op: site `_autopar_site` drawn from the bound streams."""
    return _autopar_streams.draw(*args, _autopar_site=_autopar_site, **kwargs)


def plain_op(node: fx.Node) -> None:
    """Turn a routed random node back into its plain op (a copy that runs it where it draws
    nothing: draws_nothing)."""
    node.target = node.meta.get("aten_target", node.target)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("_autopar_site", "_autopar_streams")}


def route_random(gm: fx.GraphModule) -> tuple:
    """Route every random op of gm through its stream (module docstring); its RandomSites."""
    sites = []
    for node in list(gm.graph.nodes):
        if not is_random(node):
            continue
        choice = node.meta.get("autopar")
        outputs = choice.outputs[0] if choice is not None and choice.outputs else ()
        sites.append(RandomSite(node.target, tuple(a for a, p in enumerate(outputs) if isinstance(p, Shard))))
        with gm.graph.inserting_before(node):
            streams = slot(gm, STREAMS)
        node.meta["aten_target"] = node.target
        node.target = draw
        node.kwargs = {**node.kwargs, "_autopar_streams": streams, "_autopar_site": len(sites) - 1}
    if sites:
        gm.recompile()
    return tuple(sites)
