"""The graph side of the planning problem: one node per tensor-producing op, parameter and
input (PNode), the edges between them (EdgeKey), the costs of one choice (Choice), and one
gradient-sum node for every tensor several ops read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx

from autopar.ops import NO_OUTPUT, op_name, outputs_of, returned_split, tensor_args
from autopar.ops.rules import LINEAR_ELEMENTWISE, VIEWS
from autopar.trace.export import Traced
from autopar.trace.paths import module_path

# Views (ops.rules.VIEWS) cost neither time nor memory (an alias is where a tensor's readers
# share one move, trace.share_reads); linear elementwise ops and views save nothing for backward.
SAVES_NOTHING = VIEWS | LINEAR_ELEMENTWISE | {"aten.add", "aten.sub", "aten.embedding"}


@dataclass
class PNode:
    """One node to plan.  kind: "param", "input" (user input or buffer), "op" or "output"."""

    index: int
    node: fx.Node
    kind: str
    op: str
    module: str
    inputs: list = field(default_factory=list)   # per tensor operand: (source PNode index, output index)
    out_shapes: list = field(default_factory=list)
    out_dtypes: list = field(default_factory=list)
    requires_grad: bool = False
    param_name: str | None = None
    rep: int = -1           # representative PNode (identical layers share it)
    strategies: list = field(default_factory=list)
    fallback: bool = False  # no sharding rule: replicated
    from_input: bool = False  # depends on a user input (the batch), not only on weights and constants

    @property
    def name(self) -> str:
        return self.node.name


class EdgeKey(NamedTuple):
    """An edge between two planned nodes; the cost matrix has rows for `a`'s choices and
    columns for `b`'s.

    kind "data": tensor a[out] feeds operand `operand` of b (forward resharding, and the
      backward one when a's gradient comes from b alone);
    kind "grad_in": the gradient that consumer a computes for its operand `operand` joins
      the gradient sum b (a "gradsum" node);
    kind "grad_out": the gradient sum a reaches the layout of its tensor b[out]."""

    kind: str
    a: int
    b: int
    out: int
    operand: int


@dataclass
class Choice:
    """Costs of one strategy of one node (seconds, bytes), forward and backward together."""

    compute: float
    comm: tuple            # seconds per mesh axis of collectives inside the op
    memory: dict           # "params", "grads", "optimizer", "activations" -> bytes
    plain_memory: float | None = None  # what the memory tie-break sees (ZeRO savings left out)
    forward_s: float = 0.0             # the forward alone (what recomputation runs again)
    work: float = 0.0                  # bytes live beyond the saved ones while it runs (see NodePrices)
    step_memory: float = 0.0           # bytes the optimizer step allocates while it updates this parameter

    @property
    def time(self) -> float:
        return self.compute + sum(self.comm)


def build_nodes(traced: Traced) -> tuple[list, dict]:
    """One PNode per tensor-producing node of the traced graph (tied weights: one node),
    and fx node -> (PNode index, output index)."""
    nodes: list[PNode] = []
    by_fx: dict[fx.Node, tuple[int, int]] = {}
    param_node: dict[str, int] = {}
    for node in traced.graph.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            is_param = node.target in traced.params
            pname = traced.params.get(node.target) or traced.buffers.get(node.target)
            if is_param:  # tied weights are one parameter with one layout
                pname = traced.tied.get(pname, pname)
                if pname in param_node:
                    by_fx[node] = (param_node[pname], 0)
                    continue
                param_node[pname] = len(nodes)
            pn = PNode(len(nodes), node, "param" if is_param else "input",
                       "parameter" if is_param else "input",
                       (pname.rsplit(".", 1)[0] if pname and "." in pname else ""),
                       from_input=not is_param and node.target in traced.user_inputs,
                       out_shapes=[tuple(val.shape)], out_dtypes=[val.dtype],
                       requires_grad=is_param and val.dtype.is_floating_point and val.requires_grad,
                       param_name=pname if is_param else None)
        elif node.op == "call_function":
            if node.target.__class__.__name__ == "builtin_function_or_method" and op_name(node) == "getitem":
                src, _ = by_fx[node.args[0]]
                by_fx[node] = (src, node.args[1])
                continue
            name = op_name(node)
            outs = outputs_of(node)
            if name in NO_OUTPUT or not outs:
                continue
            ins = [by_fx[a] for a in tensor_args(node) if a in by_fx]
            pn = PNode(len(nodes), node, "op", name, module_path(node), inputs=ins,
                       out_shapes=[tuple(o.shape) for o in outs], out_dtypes=[o.dtype for o in outs])
            pn.requires_grad = any(nodes[i].requires_grad for i, _ in ins) and any(
                d.is_floating_point or d.is_complex for d in pn.out_dtypes)
            pn.from_input = any(nodes[i].from_input for i, _ in ins)
            if name.startswith("wrap_with"):
                pn.requires_grad = False
        elif node.op == "output":
            flat = [a for a in torch.utils._pytree.tree_leaves(node.args) if isinstance(a, fx.Node)]
            ins = [by_fx[a] for a in flat if a in by_fx and not returned_split(a)]   # (those: as they lie)
            pn = PNode(len(nodes), node, "output", "output", "", inputs=ins)
        else:
            continue
        by_fx[node] = (pn.index, 0)
        nodes.append(pn)
    return nodes, by_fx



def add_gradient_sums(nodes: list) -> tuple[dict, dict]:
    """A tensor read by several ops gets one node for the sum of their gradients.

    Autograd adds the consumers' gradients before the producer sees them, so a
    Replicate tensor read by three column-parallel linears (q, k, v) is all-reduced once
    in backward, not three times.  The sum node's choice is the layout the gradients are
    added in; each consumer's gradient reaches it (free when Partial meets Partial), and
    the sum reaches the producer's layout."""
    readers: dict[tuple, list] = {}  # (producer, output) -> [(reader, operand index)]
    for pn in nodes:
        for k, (src, out) in enumerate(pn.inputs):
            readers.setdefault((src, out), []).append((pn.index, k))
    gradsum_of: dict[tuple, int] = {}
    for (src, out), users in readers.items():
        u = nodes[src]
        if len(users) < 2 or not u.requires_grad:
            continue
        gs = PNode(len(nodes), u.node, "gradsum", "gradient-sum", u.module,
                   out_shapes=[u.out_shapes[out]], out_dtypes=[u.out_dtypes[out]])
        gs.source = (src, out)
        nodes.append(gs)
        gradsum_of[(src, out)] = gs.index
    return readers, gradsum_of


def concrete_edges(nodes: list, gradsum_of: dict) -> list:
    """Every edge of the graph (EdgeKey): each operand read ("data"), each consumer's
    gradient joining a gradient sum ("grad_in"), each sum reaching its tensor ("grad_out")."""
    edges = []
    for pn in nodes:
        for k, (src, out) in enumerate(pn.inputs):
            edges.append(EdgeKey("data", src, pn.index, out, k))
            gs = gradsum_of.get((src, out))
            if gs is not None:
                edges.append(EdgeKey("grad_in", pn.index, gs, out, k))
    for (src, out), gs in gradsum_of.items():
        edges.append(EdgeKey("grad_out", gs, src, out, 0))
    return edges


def draws_random(node) -> bool:
    """Whether a traced op draws random numbers when it runs (a dropout of probability 0,
    or in eval mode, draws nothing; so does attention without dropout)."""
    target = getattr(node, "target", None)
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    args = list(node.args)
    if target in (torch.ops.aten.native_dropout.default, torch.ops.aten.dropout.default):
        p, train = (args[1:3] + [node.kwargs.get("p"), node.kwargs.get("train")])[:2]
        return not (isinstance(p, (int, float)) and p == 0 or train is False)
    if target is torch.ops.aten.scaled_dot_product_attention.default:
        p = node.kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return p != 0.0
    return True


def compiles(pn) -> bool:
    """Whether backend "inductor" runs op pn inside a compiled region: an ATen op that draws
    no random numbers (the runtime's is_compute; others run eagerly between regions)."""
    return pn.kind == "op" and pn.op.startswith("aten.") and not draws_random(pn.node)
