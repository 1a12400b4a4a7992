"""In-place writes into fresh tensors, rewritten as the out-of-place ops they stand for, so
they can be sharded like any other op.

Routers and attention code build a tensor and fill it in place: a group mask made by
`torch.zeros_like(scores).scatter_(1, idx, 1)` (DeepSeek-V3's group-limited top-k), keys
assembled with `k = q.new_empty(...); k[..., :n] = k_pass; k[..., n:] = k_rot` (multi-head
latent attention: `copy_` into slices).  An in-place op has no sharding rule (the op's
value is seen through its target, which a plan may have moved), so these ran replicated.
Where the target is a tensor the forward made itself (a factory, a clone, or an earlier
rewritten write), the write becomes `scatter` / `slice_scatter` / `index_put` and every
later reader of the target reads the new value instead: the same values, a graph without
aliasing.  A write into a view that some other live view also sees, or into an input,
parameter or buffer, is left as it is (it runs replicated, correctly).
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._ops import OpOverload

aten = torch.ops.aten

# ops whose output is a new tensor no other tensor aliases
FRESH = {"zeros_like", "empty_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_full", "new_ones",
         "zeros", "empty", "full", "ones", "clone", "scatter", "slice_scatter", "index_put", "masked_fill"}
# views: a write through one is seen through its base
VIEWS = {"slice", "view", "select", "narrow", "expand", "unsqueeze", "squeeze", "transpose", "permute", "t",
         "reshape", "alias", "as_strided", "unflatten", "flatten", "split", "chunk", "unbind", "getitem"}
# in-place write -> its out-of-place form, with the same arguments
WRITES = {"scatter_": aten.scatter, "index_put_": aten.index_put, "masked_fill_": aten.masked_fill,
          "fill_": aten.fill}


def _packet(node) -> str:
    target = node.target
    if isinstance(target, OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _fresh(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and _packet(node) in FRESH


def _views_live_after(base: fx.Node, write: fx.Node, order: dict, allowed: set) -> bool:
    """Whether a view of `base` (other than `allowed`) made before `write` is read after it."""
    for user in base.users:
        if user in allowed or order[user] > order[write] or _packet(user) not in VIEWS:
            continue
        stack = [user]
        while stack:
            v = stack.pop()
            for u in v.users:
                if order[u] > order[write]:
                    return True
                if _packet(u) in VIEWS:
                    stack.append(u)
    return False


def functionalize_writes(gm: fx.GraphModule) -> int:
    """Rewrite the in-place writes the module docstring describes; returns how many."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        name = _packet(node)
        if name in WRITES and _fresh(node.args[0]):
            base, view = node.args[0], None
            overload = getattr(WRITES[name], node.target._overloadname, None)
            if overload is None:
                continue
            args = node.args
        elif (name == "copy_" and isinstance(node.args[0], fx.Node) and _packet(node.args[0]) == "slice"
              and _fresh(node.args[0].args[0]) and len(node.args[0].users) == 1):
            view = node.args[0]
            base = view.args[0]
            dim, start, end = (list(view.args[1:]) + [0, None, None])[:3]
            step = view.args[4] if len(view.args) > 4 else 1
            src = node.args[1]
            if tuple(src.meta["val"].shape) != tuple(view.meta["val"].shape) or \
                    src.meta["val"].dtype != view.meta["val"].dtype:
                continue   # (a broadcasting or casting copy: left alone)
            overload = aten.slice_scatter.default
            args = (base, src, dim, start, end, step)
        else:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}   # (only where a write was found: rare)
        if _views_live_after(base, node, order, {view} if view is not None else set()):
            continue
        with graph.inserting_after(node):
            new = graph.call_function(overload, tuple(args), dict(node.kwargs))
        new.meta = dict(node.meta)
        new.meta["val"] = node.meta.get("val") if view is None else base.meta.get("val")
        later = [u for u in list(base.users) if u is not node and u is not view and order.get(u, -1) > order[node]]
        for u in later:
            u.replace_input_with(base, new)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if view is not None and not view.users:
            graph.erase_node(view)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


# x.new_empty(size) and its kin -> the factory that takes no tensor: x lends only its dtype and device
UNTIED = {"new_empty": aten.empty.memory_format, "new_zeros": aten.zeros.default, "new_ones": aten.ones.default,
          "new_full": aten.full.default}


def untie_factories(gm: fx.GraphModule) -> int:
    """Rewrite `x.new_empty(size)` (new_zeros, new_ones, new_full) as `torch.empty(size,
    dtype=x.dtype, device=x.device)`: the tensor operand lends only its dtype and device, and
    as an operand it would tie the made tensor's layout to x's.  Without it the planner may
    make the tensor already split (each rank only its piece: ops/rules.py `_made_rule`)
    instead of whole on every rank; multi-head latent attention's keys made by `new_empty`
    are 48 GiB whole for DeepSeek-V3 at 256 x 4096 tokens.  Returns how many."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _packet(node) not in UNTIED or not isinstance(node.args[0], fx.Node):
            continue
        like = node.args[0].meta.get("val")
        if not isinstance(like, torch.Tensor):
            continue
        kwargs = {"dtype": like.dtype, "device": like.device, **{k: v for k, v in node.kwargs.items()
                                                                   if v is not None}}
        kwargs.setdefault("layout", torch.strided)
        kwargs.setdefault("pin_memory", False)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(UNTIED[_packet(node)], tuple(node.args[1:]), kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
