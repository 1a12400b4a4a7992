"""What the op rules read off an fx node: its tensor operands in argument order, its
output tensors, an argument by position or keyword, the name of its op, a dim argument
as an index."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

RETURNED_SPLIT_BYTES = 256 * 2**20   # a model output this large (and not a scalar) is returned as it lies


def returned_split(node) -> bool:
    """Whether a model output is returned in the layout the plan leaves it, not gathered whole
    to every rank: a tensor of more than one element and at least RETURNED_SPLIT_BYTES whole
    (a causal LM's logits beside its loss: 250 GiB for DeepSeek-V3's 1M tokens).  The planner
    prices no move for it and the runtime returns it as a DTensor (`.full_tensor()` gathers
    it); the loss and small outputs come back whole, as before."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return (isinstance(val, torch.Tensor) and val.numel() > 1
            and val.numel() * val.element_size() >= RETURNED_SPLIT_BYTES)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor operands in argument order, repeats kept (sdpa(q, q, q) has three)."""
    flat: list = []
    _nodes_in((node.args, node.kwargs), flat)
    return [a for a in flat if isinstance(a.meta.get("val"), torch.Tensor)]


def _nodes_in(value, out: list) -> None:
    """The fx nodes in an argument tree, in pytree's order (lists, tuples and dicts in order;
    anything else a leaf): a walk of its own, several times quicker than pytree's."""
    if isinstance(value, fx.Node):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _nodes_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _nodes_in(v, out)


def outputs_of(node: fx.Node) -> list:
    """The node's output tensors (fake), a list even for single-output ops."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def op_arg(node, index, name, default=None):
    """Argument `index` of the node's call, or its keyword `name`, else `default`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def op_name(node: fx.Node) -> str:
    """The name the op table keys the node's op by: "aten.mm" for every overload of
    aten.mm, "autopar.experts" for a custom op, "getitem" for operator.getitem."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return f"aten.{packet.__name__}" if "aten" in str(packet) else str(packet)
    return getattr(target, "__name__", str(target))


def wrap_dim(d, rank):
    """Dim argument `d` (negative: from the end) as an index into `rank` dims; 0 for a scalar."""
    return d % rank if rank else 0
