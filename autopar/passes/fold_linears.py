"""Tensor-parallel collectives run beside the GEMMs of the linears they belong to.

Input gradients.  A column-parallel linear (Megatron's first GEMM of a block) reads its
input through a move whose forward is nothing (Megatron's f) or an all-gather
(Megatron-SP), and whose backward is one collective: the input gradient each rank computes
is Partial over the tensor-parallel axis and is all-reduced (or, under Megatron-SP,
reduce-scattered along the sequence).  Run as autograd runs it, the linears' backward
computes the input gradient and the weight gradient together, then the collective runs
while the device waits.  Nothing needs the weight gradient until the optimizer step, so
`fold_linear_gradients` rewrites each such move with its readers into one call that
computes the input gradient first, starts its collective asynchronously, computes the
weight and bias gradients while it runs, and waits for it only then (Megatron-LM's
asynchronous tensor-parallel gradient reduction).

    move(x, m, groups) -> linear(., w1, b1), linear(., w2, b2), ...
becomes
    linears_then_gradient(x, m, groups, (w1, b1, w2, b2, ...)) -> getitem 0, 1, ...

Folded: a move with no dim order whose backward is one all-reduce or one reduce-scatter on
one mesh axis (or one all-reduce over several) and all of whose readers are `aten.linear`
reading it as their input, either all or none of them kept by selective recomputation
(plan.recompute.kept).  The folded call names the linears it absorbs (node.meta[ABSORBS]);
where they are kept, recomputation keeps the call's matrix products (runtime/regions/recompute.py),
as it kept the linears'.  A row-parallel linear (below) that selective recomputation keeps
is not folded: its pieces are reduced in place, and the kept products would be reduced
again when the region is recomputed.

Row-parallel outputs.  A row-parallel linear (the block's last GEMM) gives a Partial
output that one all-reduce (or Megatron-SP's reduce-scatter) sums.  Where that move is the
linear's only reader, `linear(h, w, b) -> move` becomes `linear_then_reduce(h, w, b, m,
groups)`: the GEMM runs in GEMM_CHUNKS pieces along the batch (else the sequence,
autopar.cost.prices.gemm_chunk_dim), each piece's collective started before the next piece
computes, the pieces joined after the last wait.  Its backward is the move's, then the
linear's.  (A dropout between the linear and the move, as GPT-2's, keeps them apart.)

The results equal the unfolded graph's up to the order the readers' input gradients are
added in and the GEMM's rows computed in pieces.  The cost model prices what this hides on
asynchronous devices (`_Tally._fold_linears` in autopar/solve/assemble.py,
Prediction.linear_hidden_s; EdgePrices for the ILP)."""
from __future__ import annotations

import operator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from autopar.cost.prices import GEMM_CHUNKS, gemm_chunk_dim
from autopar.passes.collectives import move
from autopar.passes.redistribute import (normalize_placements, plan_redistribute, redistribute_local,
                                         reduce_scatter_rows)

LINEAR = torch.ops.aten.linear.default
ABSORBS = "autopar_absorbs"   # node.meta key of a folded call: the names of the linears it absorbed


def one_reduction(src, dst, sizes, ndim: int):
    """The one step of the move src -> dst when it is one all-reduce or one reduce-scatter,
    else None; sizes: the mesh axes' sizes."""
    src = normalize_placements(src, ndim, "src")
    dst = normalize_placements(dst, ndim, "dst")
    steps = plan_redistribute(src, dst, list(sizes))
    if len(steps) != 1 or steps[0].kind not in ("all_reduce", "reduce_scatter"):
        return None
    return steps[0]


def _sizes(groups) -> list:
    return [groups.size(a) for a in range(groups.ndim)]


def start_reduction(grad: torch.Tensor, step, groups):
    """Start step's collective on `grad` (this rank's Partial values, a buffer of ours);
    returns a function that waits for it and gives the reduced tensor."""
    if step.kind == "all_reduce":
        group = groups.group_of(step.axes) if step.span else groups.group(step.axis)
        buf = grad.contiguous()
        work = dist.all_reduce(buf, group=group, async_op=True)
        return lambda: (work.wait(), buf)[1]
    n, d, c = groups.size(step.axis), step.dim, groups.coordinate(step.axis)
    if grad.size(d) % n:
        raise ValueError(f"cannot reduce-scatter dim {d} of the input gradient {tuple(grad.shape)} evenly over "
                         f"mesh axis {step.axis} of size {n}")
    inp = grad.movedim(d, 0).contiguous()
    work, row = reduce_scatter_rows(inp.view(n, -1), groups.group(step.axis), c, async_op=True)

    def finish():
        if work is not None:
            work.wait()
        r = row.clone() if row.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr() else row
        return r.view((inp.size(0) // n,) + tuple(inp.shape[1:])).movedim(0, d).contiguous()
    return finish


class LinearsThenGradient(torch.autograd.Function):
    """outs[i] = linear(move(x), w_i, b_i); backward: the input gradient, its collective
    started, the weight and bias gradients, then the wait (module docstring)."""

    @staticmethod
    def forward(ctx, x, m, groups, biased, *params):
        xm = redistribute_local(x, m.src, m.dst, groups)
        weights, biases, k = [], [], 0
        for has_bias in biased:
            weights.append(params[k])
            biases.append(params[k + 1] if has_bias else None)
            k += 2 if has_bias else 1
        ctx.m, ctx.groups, ctx.biased = m, groups, biased
        ctx.save_for_backward(xm, *weights)
        return tuple(F.linear(xm, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        xm, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        finish = None
        if ctx.needs_input_grad[0]:
            dx = None
            for g, w in zip(grads, weights):
                if g is not None:
                    part = g.matmul(w)
                    dx = part if dx is None else dx + part
            if dx is None:
                dx = torch.zeros_like(xm)
            step = one_reduction(ctx.m.grad_src, ctx.m.grad_dst, _sizes(ctx.groups), dx.dim())
            finish = start_reduction(dx, step, ctx.groups)
        flat_x = xm.reshape(-1, xm.size(-1))
        out, k = [], 0
        for g, w, has_bias in zip(grads, weights, ctx.biased):
            flat_g = g.reshape(-1, g.size(-1)) if g is not None else None
            out.append(flat_g.t().mm(flat_x) if needs[k] and flat_g is not None else None)
            if has_bias:
                out.append(flat_g.sum(0) if needs[k + 1] and flat_g is not None else None)
            k += 2 if has_bias else 1
        return (finish() if finish is not None else None), None, None, None, *out


class LinearThenReduce(torch.autograd.Function):
    """move(linear(h, w, b)) where the move's forward is one all-reduce or reduce-scatter of
    the Partial output (Megatron's row-parallel GEMM): the output computed in GEMM_CHUNKS
    pieces along `gemm_chunk_dim` (autopar/cost/prices.py), each piece's collective
    started before the next piece computes, the pieces joined after the last wait.  Backward: the move's backward, then the linear's."""

    @staticmethod
    def forward(ctx, h, w, b, m, groups):
        ctx.m, ctx.groups, ctx.biased = m, groups, b is not None
        ctx.save_for_backward(h, w)
        step = one_reduction(m.src, m.dst, _sizes(groups), h.dim())
        c = gemm_chunk_dim(tuple(h.shape), step.kind, step.dim)
        pieces = h.tensor_split(GEMM_CHUNKS, c) if c is not None else (h,)
        waits = [start_reduction(F.linear(piece, w, b), step, groups) for piece in pieces]
        done = [wait() for wait in waits]
        return done[0] if len(done) == 1 else torch.cat(done, c)

    @staticmethod
    def backward(ctx, grad):
        h, w = ctx.saved_tensors
        g = redistribute_local(grad, ctx.m.grad_src, ctx.m.grad_dst, ctx.groups)
        dh = g.matmul(w) if ctx.needs_input_grad[0] else None
        flat_g = g.reshape(-1, g.size(-1))
        dw = flat_g.t().mm(h.reshape(-1, h.size(-1))) if ctx.needs_input_grad[1] else None
        db = flat_g.sum(0) if ctx.biased and ctx.needs_input_grad[2] else None
        return dh, dw, db, None, None


def linear_then_reduce(h, w, b, m, groups):
    """The folded row-parallel call (LinearThenReduce.apply)."""
    return LinearThenReduce.apply(h, w, b, m, groups)


def linears_then_gradient(x, m, groups, biased: tuple, *params):
    """The folded call (LinearsThenGradient.apply): a tuple of the linears' outputs."""
    return LinearsThenGradient.apply(x, m, groups, biased, *params)


def _place(gm: fx.GraphModule, node: fx.Node, readers: list, params: list):
    """Where the folded call goes: before the first reader, once a later reader's weight
    made after it (a ZeRO-3 gather of a parameter) is moved up there; else after every
    tensor it reads, if that is before anything reads a reader's output; None where no
    such place is (a weight moved up stays there: it reads only parameters)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min(readers, key=order.__getitem__)
    for a in params:
        if isinstance(a, fx.Node) and order[a] > order[first] and a.op == "call_function" and all(
                i.op in ("placeholder", "get_attr") for i in a.all_input_nodes):
            for i in a.all_input_nodes:
                if i.op == "get_attr" and order[i] > order[first]:
                    first.prepend(i)
            first.prepend(a)   # (it reads only parameters and constants)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    made = [a for a in params if isinstance(a, fx.Node)]
    last = max(made, key=order.__getitem__, default=node)
    used = [u for r in readers for u in r.users]
    if used and min(order[u] for u in used) <= order[last]:
        return None
    return gm.graph.inserting_before(last.next if order[last] > order[first] else first)


def kept_nodes(plan) -> frozenset:
    """The node names selective recomputation keeps."""
    return frozenset(plan.recompute.kept) if plan.recompute is not None else frozenset()


def fold_linear_gradients(gm: fx.GraphModule, sizes, keep: frozenset = frozenset()) -> int:
    """Fold every move that qualifies (module docstring) with its linear readers; sizes:
    the mesh axes' sizes the graph runs on; `keep`: the node names selective recomputation
    keeps (a move whose readers are kept and not kept is left alone: one call keeps all of
    its products or none).  Returns how many."""
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not move or len(node.args) != 3 or not node.users:
            continue
        x, spec, groups_node = node.args
        readers = list(node.users)
        if any(r.op != "call_function" or r.target is not LINEAR or r.args[0] is not node
               or node in r.args[1:] or r.kwargs for r in readers) or len({r.name in keep for r in readers}) > 1:
            continue
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        m = getattr(gm, spec.target)
        if one_reduction(m.grad_src, m.grad_dst, sizes, val.dim()) is None:
            continue
        biased = tuple(len(r.args) > 2 and r.args[2] is not None for r in readers)
        params = [a for r in readers for a in (r.args[1:3] if len(r.args) > 2 and r.args[2] is not None
                                                else r.args[1:2])]
        where = _place(gm, node, readers, params)
        if where is None:
            continue
        with where:
            fused = gm.graph.call_function(linears_then_gradient, (x, spec, groups_node, biased, *params))
            fused.meta.update({k: v for k, v in readers[0].meta.items() if k != "val"})
            fused.meta[ABSORBS] = tuple(r.name for r in readers)
            for i, r in enumerate(readers):
                item = gm.graph.call_function(operator.getitem, (fused, i))
                item.meta.update(r.meta)
                r.replace_all_uses_with(item)
        for r in readers:
            gm.graph.erase_node(r)
        gm.graph.erase_node(node)
        folded += 1
    folded += _fold_row_parallel(gm, sizes, keep)
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _fold_row_parallel(gm: fx.GraphModule, sizes, keep: frozenset) -> int:
    """Fold each aten.linear whose only reader is a move whose forward is one all-reduce or
    reduce-scatter (module docstring) into linear_then_reduce, unless selective
    recomputation keeps it (`keep`: the pieces are reduced in place, and a kept product
    would be reduced again when its region is recomputed); returns how many."""
    folded = 0
    for node in list(gm.graph.nodes):
        if (node.op != "call_function" or node.target is not LINEAR or node.kwargs or node.name in keep
                or len(node.users) != 1):
            continue
        (mv,) = node.users
        if mv.op != "call_function" or mv.target is not move or len(mv.args) != 3 or mv.args[0] is not node:
            continue
        val = node.meta.get("val")
        m = getattr(gm, mv.args[1].target)
        if not isinstance(val, torch.Tensor) or one_reduction(m.src, m.dst, sizes, val.dim()) is None:
            continue
        h, w, b = (tuple(node.args) + (None,))[:3]
        with gm.graph.inserting_before(mv):
            fused = gm.graph.call_function(linear_then_reduce, (h, w, b, mv.args[1], mv.args[2]))
        fused.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        fused.meta[ABSORBS] = (node.name,)
        if "val" in mv.meta:
            fused.meta["val"] = mv.meta["val"]
        mv.replace_all_uses_with(fused)
        gm.graph.erase_node(mv)
        gm.graph.erase_node(node)
        folded += 1
    return folded
