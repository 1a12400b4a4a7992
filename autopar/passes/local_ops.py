"""Per-rank implementations of ops whose local form differs from the op itself.

- vocabulary-parallel embedding: this rank holds rows [start, start + rows) of the table;
  other tokens read zeros, so the output is a Partial sum over the vocabulary axes;
- cross-entropy with a split batch (mean over the global count of counted targets) and/or
  split classes (vocabulary-parallel: max, sum of exp and target logit all-reduced);
- means over a split dimension: the local mean scaled to its share of the global one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.trace.attention import window_attention
from autopar.trace.experts_op import expert_parallel, experts

from autopar.passes.attention_ops import ring_attention, ulysses_attention


def shard_offset(global_size: int, placements, dim: int, groups) -> tuple[int, int]:
    """(start, length) along `dim` of this rank's shard, following the nesting of axes."""
    start, length = 0, global_size
    for axis, p in enumerate(placements):
        if getattr(p, "dim", None) == dim and p.is_shard():
            length //= groups.size(axis)
            start += groups.coordinate(axis) * length
    return start, length


def experts_of_this_rank(x, index, weight, gate, up, down, act: str, axis: int, groups, gate_bias=None,
                         up_bias=None, down_bias=None):
    """The experts op with experts split over `axis` and tokens whole: this rank runs the
    rows routed to its experts (their biases too); the output is a Partial sum over the axis."""
    return experts(x, index, weight, gate, up, down, act, groups.coordinate(axis) * gate.shape[0], gate_bias,
                   up_bias, down_bias)


def expert_parallel_on_axis(x, index, weight, gate, up, down, act: str, n_experts: int, axis: int, groups,
                            gate_bias=None, up_bias=None, down_bias=None):
    """The experts op with tokens and experts split over `axis`: all-to-all dispatch and combine."""
    return expert_parallel(x, index, weight, gate, up, down, act, n_experts, groups.group(axis), gate_bias,
                           up_bias, down_bias)


def dim_order(node) -> tuple | None:
    """The dims of a node's traced output (the first, for ops with several) from outermost
    to innermost in memory, or None where the trace holds no tensor."""
    val = node.meta.get("val")
    val = val[0] if isinstance(val, (tuple, list)) else val
    if not isinstance(val, torch.Tensor):
        return None
    stride = val.stride()
    return tuple(sorted(range(val.dim()), key=lambda d: (-stride[d], d)))


def in_dim_order(x: torch.Tensor, order: tuple | None) -> torch.Tensor:
    """x laid out in memory with its dims in `order` (outermost first), as the op it stands
    for laid out its output.  The graph after an attention may `.view` the output's
    transpose, which works only in the layout the traced kernel produced (the traced graph
    drops a `.contiguous()` that was a no-op there): ring and Ulysses attention return
    their result in that layout.  No copy when x is already so."""
    if order is None or x.dim() != len(order):
        return x
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return x.permute(order).contiguous().permute(inverse)


def ring_attention_on_axis(q, k, v, causal: bool, scale, axis: int, groups, window: int | None = None,
                           order: tuple | None = None):
    """Attention with the sequence split over `axis`, context parallel (attention_ops.py);
    window: a causal sliding window (query i sees keys i - window < j <= i); order: the
    traced output's dim order in memory (in_dim_order)."""
    return in_dim_order(ring_attention(q, k, v, causal=causal, scale=scale, group=groups.group(axis), window=window),
                        order)


def ulysses_window_on_axis(q, k, v, window: int, scale: float, gqa: bool, axis: int, groups,
                           order: tuple | None = None):
    """Sliding-window attention with the sequence split over `axis`, heads swapped in."""
    return in_dim_order(ulysses_attention(q, k, v, group=groups.group(axis), local=lambda a, b, c: window_attention(
        a, b, c, window, scale, gqa)), order)


def ulysses_on_axis(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, axis: int, groups,
                    order: tuple | None = None):
    """Attention with the sequence split over `axis`, heads swapped in by all-to-all."""
    return in_dim_order(ulysses_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          group=groups.group(axis)), order)


def vocab_parallel_embedding(weight, indices, vocab: int, weight_placements, axes: tuple, groups,
                             padding_idx: int | None = None):
    """weight: [vocab / n, dim_local] rows of this rank; indices: global token ids.
    padding_idx: the global row whose gradient stays zero (nn.Embedding's), this rank's
    local row when it holds it; the ids of other ranks' rows read local row 0 and are
    masked out of the output, so their gradient into it is zero too."""
    start, rows = shard_offset(vocab, weight_placements, 0, groups)
    mine = (indices >= start) & (indices < start + rows)
    local = torch.where(mine, indices - start, torch.zeros_like(indices))
    pad = None
    if padding_idx is not None:
        pad = padding_idx % vocab - start
        pad = pad if 0 <= pad < rows else None
    out = F.embedding(local, weight, padding_idx=pad)
    return out * mine.unsqueeze(-1).to(out.dtype)


def _all_reduce_nograd(x, axes, groups, op=dist.ReduceOp.SUM):
    x = x.clone()
    for a in axes:
        dist.all_reduce(x, op=op, group=groups.group(a))
    return x


class _VocabParallelLoss(torch.autograd.Function):
    """Per-row cross-entropy of logits whose classes are split over `groups` (this rank
    holds classes [start, start + length)): the row max, the sum of exponentials and the
    target's logit are all-reduced.  Backward keeps only the softmax of this rank's
    classes, in the logits' dtype (what one device's log-softmax keeps), and the local
    targets; the gradient of a row reaches every rank through one all-reduce, since only
    one coordinate of a class axis carries the loss."""

    @staticmethod
    def forward(ctx, logits, target, start, length, ignore_index, groups):
        x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
        row_max = x.amax(dim=1, keepdim=True)
        for g in groups:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=g)
        x -= row_max
        mine = (target >= start) & (target < start + length)
        local_t = torch.where(mine, target - start, torch.zeros_like(target))
        picked = x.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine.to(x.dtype)
        x.exp_()
        sum_exp = x.sum(dim=1)
        for g in groups:
            dist.all_reduce(sum_exp, group=g)
            dist.all_reduce(picked, group=g)
        valid = target != ignore_index
        per_row = (sum_exp.log() - picked) * valid.to(x.dtype)
        x /= sum_exp.unsqueeze(1)
        ctx.save_for_backward(x.to(logits.dtype), local_t, mine, valid)
        ctx.groups = groups
        return per_row.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, mine, valid = ctx.saved_tensors
        grad = grad * valid.to(grad.dtype)
        for g in ctx.groups:
            dist.all_reduce(grad, group=g)
        out = softmax * grad.unsqueeze(1).to(softmax.dtype)
        picked = (grad * mine.to(grad.dtype)).unsqueeze(1).to(out.dtype)
        out.scatter_add_(1, local_t.unsqueeze(1), -picked)
        return out, None, None, None, None, None


def local_cross_entropy(logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0, *,
                        classes: int, logits_placements, batch_axes: tuple, class_axes: tuple, partial_axes: tuple,
                        groups, all_targets=None):
    """logits [n_local, classes_local, *], target [n_local, *]: the loss as the plan lays it out.

    Over `class_axes` the classes are split (vocabulary-parallel); over `batch_axes` the rows
    are; the result is Partial on `partial_axes` (the axes a reduced letter splits on), where
    only coordinate 0 of a class axis carries the value.  all_targets: the targets whole
    over `batch_axes` when this rank has them (then the mean's count needs no all-reduce).
    """
    if not class_axes:
        per_row = F.cross_entropy(logits, target, weight, reduction="none", ignore_index=ignore_index,
                                  label_smoothing=label_smoothing)
    else:
        if weight is not None or label_smoothing:
            raise NotImplementedError("vocabulary-parallel cross-entropy with class weights or label smoothing")
        start, length = shard_offset(classes, logits_placements, 1, groups)
        per_row = _VocabParallelLoss.apply(logits, target, start, length, ignore_index,
                                           [groups.group(a) for a in class_axes])
    if reduction == 0:
        out = per_row
    else:
        out = per_row.sum()
        if reduction == 1:
            whole = batch_axes and all_targets is not None
            t = all_targets if whole else target
            counted = (t != ignore_index).sum() if weight is None else (
                weight[t.clamp(min=0)] * (t != ignore_index)).sum()
            if batch_axes and not whole:
                counted = _all_reduce_nograd(counted, batch_axes, groups)
            out = out / counted
    for a in class_axes:  # the value is replicated over the class axes: keep one copy
        if a in partial_axes and groups.coordinate(a) != 0:
            out = out * 0
    return out


def scaled_op(op, scale, *args, **kwargs):
    """op(...) * scale: a mean over a dimension split k ways is 1/k of the global mean's sum."""
    return op(*args, **kwargs) * scale
