"""collectives: between every producer and consumer whose layouts differ, insert the move.

For an edge producer -> consumer the plan gives the producer's output layout p, the layout
q the consumer reads, and the layout g of the gradient the consumer hands back.  The pass
inserts `move(x, Move(p, q, g, t))`: forward p -> q, backward g -> t, where t is the
layout the producer needs its gradient in (p itself; Replicate for a Partial p).  A move
is inserted even when p == q if the gradient needs work (g != t): that is Megatron's f
operator (identity forward, all-reduce backward), and the data-parallel gradient
all-reduce of a parameter read by a batch-split op.

A tensor read by several ops whose gradients the plan adds in layout w (plan.grad_sums)
gets one move after its producer (forward nothing, backward w -> t), and each reader's
move hands its gradient back in w: autograd adds them, then one reduction runs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.ops import returned_split, tensor_args
from autopar.placements import grad_targets, same_local_shape

from autopar.passes.local_ops import dim_order, in_dim_order
from autopar.passes.redistribute import redistribute
from autopar.passes.slots import GROUPS, get_attr, slot


@dataclass(frozen=True)
class Move:
    """Forward: src -> dst.  Backward: the gradient arrives as grad_src, leaves as grad_dst."""

    src: tuple
    dst: tuple
    grad_src: tuple
    grad_dst: tuple

    @property
    def needed(self) -> bool:
        return self.src != self.dst or self.grad_src != self.grad_dst


def move(x: torch.Tensor, m: Move, groups, order: tuple | None = None) -> torch.Tensor:
    """x moved from layout m.src to m.dst (its gradient from m.grad_src to m.grad_dst).
    order: where the traced tensor was not laid out plainly in memory (an attention kernel's
    output is [batch, heads, seq, dim] stored seq-major), the dims' order to lay the moved
    tensor out in, as the traced one was: the graph may `.view` a transpose of it, which
    works only in that layout (the trace dropped a `.contiguous()` that was a no-op there)."""
    return in_dim_order(redistribute(x, m.src, m.dst, m.grad_src, m.grad_dst, groups), order)


def _move_args(x: fx.Node, spec: fx.Node, groups_node: fx.Node) -> tuple:
    """move's arguments for tensor x: the traced layout's dim order only where it is not the
    plain one (parameters and most activations are plain: no argument, no copy)."""
    order = dim_order(x)
    plain = order is None or order == tuple(range(len(order)))
    return (x, spec, groups_node) if plain else (x, spec, groups_node, order)


def local_input_layouts(gm: fx.GraphModule, user_inputs) -> list:
    """Lay every user input out as its first reader reads it, so callers pass their shard
    (no slicing, no move); returns the layouts in placeholder order."""
    layouts = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.target not in user_inputs:
            continue
        layout = None
        for reader in node.users:
            choice = reader.meta.get("autopar")
            if choice is None or reader.op != "call_function":
                continue
            k = tensor_args(reader).index(node)
            layout = tuple(choice.inputs[k])
            break
        if layout is None:
            layout = layout_of(node)
        node.meta["autopar_input_layout"] = layout
        layouts.append(layout)
    return layouts


def layout_of(node: fx.Node, index: int = 0, ndim: int = 1) -> tuple:
    """The layout of tensor `node[index]` as the plan produces it."""
    if node.op == "call_function" and node.target is operator.getitem:
        return layout_of(node.args[0], node.args[1], ndim)
    alias = node.meta.get("autopar_alias")
    if alias is not None:
        return layout_of(alias, index, ndim)
    if "autopar_input_layout" in node.meta:  # a user input the caller passes already sharded
        return node.meta["autopar_input_layout"]
    choice = node.meta.get("autopar")
    if choice is None or not choice.outputs:
        return tuple(Replicate() for _ in range(ndim))
    return tuple(choice.outputs[index])


def tensor_key(node: fx.Node) -> tuple[fx.Node, int]:
    """(producer, output index) of the tensor a node stands for (through getitem and aliases)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    alias = node.meta.get("autopar_alias")
    return (alias if alias is not None else node), 0


@dataclass(frozen=True)
class Inserted:
    """What insert_collectives leaves to the runtime.  grad_sync: parameter name -> mesh axes
    its gradient is still Partial on (the runtime all-reduces it, bucketed); output_reduce:
    output index -> the Move of a Partial scalar (the loss) the runtime sums itself;
    output_layouts: output index -> placements of a large output returned as it lies
    (ops.returned_split: the runtime returns it as a DTensor)."""

    graph: fx.GraphModule
    grad_sync: dict
    output_reduce: dict
    output_layouts: dict = field(default_factory=dict)


def insert_collectives(gm: fx.GraphModule, plan, defer: dict | None = None) -> Inserted:
    """Rewrite gm in place; the moves read their process groups from gm's GROUPS slot,
    which the runtime binds (passes/slots.py).

    defer: placeholder name -> parameter name for parameters whose gradient all-reduce the
    runtime runs itself (bucketed, overlapped with backward).  For those, a move that would
    end the gradient's journey with Partial -> Replicate leaves it Partial instead, and the
    result's grad_sync[parameter] lists the mesh axes still to reduce."""
    graph = gm.graph
    output_reduce: dict = {}
    output_layouts: dict = {}
    writer = _MoveWriter(gm, plan, defer or {})
    for node in list(graph.nodes):
        choice = node.meta.get("autopar")
        if choice is None or node.op not in ("call_function", "output"):
            continue
        operands = tensor_args(node) if node.op == "call_function" else [
            a for a in pytree.tree_leaves(node.args) if isinstance(a, fx.Node)]
        planned = [k for k, x in enumerate(operands) if node.op != "output" or not returned_split(x)]
        if len(planned) != len(choice.inputs):
            raise ValueError(f"{node.name}: plan lists {len(choice.inputs)} operands, graph has {len(planned)}")
        at = {k: j for j, k in enumerate(planned)}
        replacement = []
        for k, x in enumerate(operands):
            src, p, back = writer.source_for(x)
            if k not in at:   # a large output, returned as it lies
                output_layouts[k] = tuple(p)
                replacement.append(src)
                continue
            q = tuple(choice.inputs[at[k]])
            g = choice.grads[at[k]] if at[k] < len(choice.grads) else None
            if g is not None and src is x and (x.op == "placeholder" or x in writer.cones):
                back = writer.deferred(x, tuple(g), back)
            m = Move(p, q, tuple(g) if g is not None else q, back if g is not None else q)
            if not m.needed:
                replacement.append(src)
                continue
            if node.op == "output" and _scalar_sum(x, m):
                # a Partial scalar (the loss) leaves the graph as it is: the runtime sums it
                # asynchronously while backward runs (see Inserted.output_reduce)
                output_reduce[k] = m
                replacement.append(src)
                continue
            with graph.inserting_before(node):
                groups_node = slot(gm, GROUPS)
                moved = graph.call_function(move, _move_args(src, writer.attr(m), groups_node))
            moved.meta["val"] = x.meta.get("val")  # the same global tensor, in another layout
            replacement.append(moved)
        _replace_operands(node, replacement)
    graph.lint()
    gm.recompile()
    return Inserted(gm, writer.grad_sync, output_reduce, output_layouts)


class _MoveWriter:
    """What insert_collectives keeps while it rewrites one graph: the gradient reductions it
    leaves to the runtime (grad_sync), which parameters and parameter-only tensors may leave
    them (decided, cones), the moves stored on gm so far, and the one gradient-sum move of
    each tensor whose readers' gradients the plan adds first (summed)."""

    def __init__(self, gm: fx.GraphModule, plan, defer: dict):
        self.gm, self.graph, self.plan, self.defer = gm, gm.graph, plan, defer
        self.ndim = plan.mesh.ndim
        self.grad_sync: dict = {}
        self.count = 0
        self.summed: dict = {}
        self.decided = _deferrable(gm, plan, defer, self.ndim)
        self.cones = _deferrable_cones(gm, plan, defer, self.ndim, self.decided)

    def deferred(self, x: fx.Node, back_from: tuple, back_to: tuple) -> tuple:
        """The gradient layout a move should leave for parameter x, or for a replicated
        tensor computed from parameters alone (see `defer` and _deferrable_cones)."""
        if x.op == "placeholder":
            axes = self.decided.get(x.target)
            if axes is None:
                return back_to
            self.grad_sync[self.defer[x.target]] = axes
            # (the axes the move slices stay sliced: summing the slices is slicing the sum)
            return tuple(back_from[a] if a in axes else back_to[a] for a in range(self.ndim))
        cone = self.cones.get(x)
        if cone is None:
            return back_to
        axes, params = cone
        for ph in params:
            self.grad_sync[self.defer[ph]] = axes
        return back_from

    def attr(self, value) -> fx.Node:
        """A get_attr node of `value` (a Move), stored on gm under a fresh name."""
        name = f"_autopar_move_{self.count}"
        self.count += 1
        setattr(self.gm, name, value)
        return get_attr(self.graph, name)

    def source_for(self, x: fx.Node) -> tuple[fx.Node, tuple, tuple]:
        """The node readers should read, the layout it has, and the layout of the gradient
        they must hand back."""
        graph = self.graph
        producer, index = tensor_key(x)
        p = layout_of(x, 0, self.ndim)
        w = self.plan.grad_sums.get(f"{producer.name}:{index}")
        if w is None or not same_local_shape(w, p):
            return x, p, grad_targets(p)
        if x not in self.summed:
            anchor = x
            if x.op == "placeholder":  # keep the placeholders together at the top
                anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(anchor):
                groups_node = slot(self.gm, GROUPS)
            with graph.inserting_after(groups_node):
                spec = self.attr(Move(p, p, tuple(w), self.deferred(x, tuple(w), grad_targets(p))))
            with graph.inserting_after(spec):
                self.summed[x] = graph.call_function(move, _move_args(x, spec, groups_node))
            self.summed[x].meta["val"] = x.meta.get("val")
        return self.summed[x], p, tuple(w)


def _scalar_sum(x: fx.Node, m: Move) -> bool:
    """A one-element output whose move is only Partial -> Replicate on some axes."""
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() != 1:
        return False
    return all(s == d or (isinstance(s, Partial) and isinstance(d, Replicate)) for s, d in zip(m.src, m.dst))


def _deferrable(gm: fx.GraphModule, plan, defer: dict, ndim: int) -> dict:
    """placeholder -> mesh axes whose all-reduce the runtime may take over: every gradient
    conversion of every placeholder of that parameter (tied weights have several) is exactly
    Partial -> Replicate on those axes and, on the others, nothing or a local slice
    (Replicate -> Shard: a row-parallel linear's bias stored split over the tensor-parallel
    axis, its gradient whole there and Partial over the data-parallel one), which the move
    still makes in backward, leaving the slice Partial for the bucket."""
    per_placeholder = {x.target: _reduced_axes(x, plan, ndim, slices=True) for x in gm.graph.nodes
                       if x.op == "placeholder" and x.target in defer}
    by_param: dict = {}
    for ph, axes in per_placeholder.items():
        by_param.setdefault(defer[ph], set()).add(axes)
    return {ph: axes for ph, axes in per_placeholder.items()
            if axes and by_param[defer[ph]] == {axes}}


def _reduced_axes(x: fx.Node, plan, ndim: int, slices: bool = False) -> tuple | None:
    """The mesh axes on which every gradient layout x's readers hand back (or the one its
    gradient sum is in) is Partial where x's own layout is Replicate, and which are the
    only difference (slices: besides axes where every one is Replicate and x's layout
    Shard, a local slice); None when the conversions differ, do more, or do nothing."""
    producer, index = tensor_key(x)
    p = layout_of(x, 0, ndim)
    target = grad_targets(p)
    w = plan.grad_sums.get(f"{producer.name}:{index}")
    if w is not None and same_local_shape(w, p):
        conversions = [tuple(w)]
    else:
        conversions = []
        for reader in x.users:
            choice = reader.meta.get("autopar")
            if choice is None or reader.op != "call_function":
                continue
            for k, a in enumerate(tensor_args(reader)):
                if a is x and k < len(choice.grads) and choice.grads[k] is not None:
                    conversions.append(tuple(choice.grads[k]))
    seen = {tuple(a for a in range(ndim) if g[a] != target[a]) for g in conversions}
    if len(seen) != 1:
        return None
    axes = seen.pop()
    if slices:
        axes = tuple(a for a in axes if not all(isinstance(g[a], Replicate) and isinstance(target[a], Shard)
                                                for g in conversions))
    if not axes or any(not (isinstance(g[a], Partial) and isinstance(target[a], Replicate))
                       for g in conversions for a in axes):
        return None
    return axes


def _deferrable_cones(gm: fx.GraphModule, plan, defer: dict, ndim: int, decided: dict) -> dict:
    """node -> (mesh axes, parameter placeholders) for a tensor computed from parameters
    alone whose readers hand its gradient back Partial on those axes (a position embedding
    looked up by positions the graph makes, added to batch-split activations): every node
    of its cone (its ancestors up to placeholders) is Replicate on the axes, in and out and
    in its gradients, and no cone node feeds anything outside the cone but this tensor's
    readers.  Backward is linear in the gradient and the forward values agree on those
    axes, so the Partial gradient may flow back to the parameters unreduced and join their
    bucketed all-reduce (grad_sync), as DistributedDataParallel does, instead of one more
    all-reduce inside backward."""
    out = {}

    def replicate_on(layout, axes) -> bool:
        return all(isinstance(layout[a], Replicate) for a in axes)

    for x in gm.graph.nodes:
        if x.op != "call_function" or x.meta.get("autopar") is None:
            continue
        axes = _reduced_axes(x, plan, ndim)
        if axes is None:
            continue
        cone, params, ok = {x}, set(), True
        todo = [x]
        while todo and ok:
            n = todo.pop()
            for a in n.all_input_nodes:
                if a in cone:
                    continue
                if a.op == "placeholder":
                    if a.target in defer:
                        params.add(a)
                    continue
                if a.op == "get_attr":
                    continue
                choice = a.meta.get("autopar")
                if a.op != "call_function" or choice is None:
                    ok = False
                    break
                cone.add(a)
                todo.append(a)
        for n in cone if ok else ():
            choice = n.meta["autopar"]
            layouts = [layout_of(n, 0, ndim), *map(tuple, choice.inputs),
                       *(tuple(g) for g in choice.grads if g is not None)]
            if not all(replicate_on(lay, axes) for lay in layouts):
                ok = False
                break
            if n is not x and any(u not in cone for u in n.users):
                ok = False
                break
        for ph in params if ok else ():
            if ph.target in decided or any(u not in cone for u in ph.users) \
                    or not replicate_on(layout_of(ph, 0, ndim), axes) \
                    or any(q is not ph and defer.get(q.target) == defer[ph.target] for q in gm.graph.nodes
                           if q.op == "placeholder"):
                ok = False
                break
        if ok and params:
            out[x] = (axes, sorted(ph.target for ph in params))
    return out


def _replace_operands(node: fx.Node, replacement: list) -> None:
    """Put the k-th tensor operand's replacement in the k-th tensor position of args/kwargs."""
    it = iter(replacement)

    def swap(a):
        if isinstance(a, fx.Node) and (node.op == "output" or isinstance(a.meta.get("val"), torch.Tensor)):
            return next(it)
        return a

    node.args, node.kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
