"""Per-rank attention with the sequence split over one mesh axis: ring (context parallel)
and Ulysses (all-to-all).

Both take q [b, h, s / n, e] and k, v [b, kv, s / n, e], the rank's contiguous slice of the
sequence (rank r of the axis holds positions [r s / n, (r + 1) s / n)), and return the output
in that layout, so everything around attention stays in the sequence's natural order: no
position table, mask or label has to be permuted, whatever the model computes them from.

Ring: the keys and values of every rank are gathered (one all-gather each; the result is
consumed block by block and freed with the op) and each rank runs its queries against them
one ring step at a time (the block of rank r - t at step t), merging the partial results
with the online softmax: with (o1, lse1) and (o2, lse2) the outputs and log-sum-exps of two
key blocks, lse = log(e^lse1 + e^lse2) and o = o1 e^(lse1 - lse) + o2 e^(lse2 - lse).
Backward gathers the keys and values again, recomputes each block's probabilities from the
saved log-sum-exp (p = e^(s - lse)), and reduce-scatters the key and value gradients to
their owners.  Only q, k, v, the output and the log-sum-exp are kept for backward, all at
1/n of the sequence.

Causal masks are load-balanced (the zigzag layout): the sequence is cut into 2n chunks and
rank r computes the queries of chunks r and 2n - 1 - r (one from the front, its mirror from
the back), so every rank computes 2n + 1 blocks of scores, where contiguous slices would
give rank r 4r + 3 (3 on the first rank, 4n - 1 on the last).  The queries are exchanged into that order inside the op (half of
them move, one all-to-all) and the output is exchanged back; the backward does the reverse.
A sliding window (autopar::window_attention) skips the key blocks wholly before every
query's window, so a window shorter than a chunk leaves each query chunk two blocks.

Ulysses: one all-to-all per tensor swaps the split from the sequence to the heads (the
query and key/value head counts must divide by n), attention runs on whole sequences for
h / n heads, and one all-to-all swaps the output back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from autopar.trace.attention import window_mask

from autopar.passes.redistribute import all_gather_dim, all_to_all_dims, reduce_scatter_dim

BLOCKS = {"computed": 0}   # score blocks (query chunk x key chunk) computed by ring attention on this rank


def zigzag_chunks(rank: int, n: int) -> tuple[int, int]:
    """The two of 2n sequence chunks whose queries rank `rank` of n computes under a causal mask."""
    return rank, 2 * n - 1 - rank


def _exchange(x: Tensor, dim: int, n: int, rank: int, group, to_zigzag: bool) -> Tensor:
    """Between contiguous slices (rank r holds chunks 2r, 2r + 1 of 2n along `dim`) and the
    zigzag layout (chunks r, 2n - 1 - r), in either direction; one all_to_all_single."""
    owner = [c if c < n else 2 * n - 1 - c for c in range(2 * n)]
    if to_zigzag:
        mine, dest = [2 * rank, 2 * rank + 1], owner
        incoming = sorted(zigzag_chunks(rank, n), key=lambda c: (c // 2, c))
    else:
        mine, dest = list(zigzag_chunks(rank, n)), [c // 2 for c in range(2 * n)]
        incoming = sorted((2 * rank, 2 * rank + 1), key=lambda c: (owner[c], c))
    pieces = dict(zip(mine, x.chunk(2, dim)))
    order = sorted(mine, key=lambda c: (dest[c], c))
    send = torch.cat([pieces[c].movedim(dim, 0) for c in order]).contiguous()
    length = send.size(0) // 2
    send_sizes = [sum(length for c in mine if dest[c] == j) for j in range(n)]
    src = [c // 2 for c in incoming] if to_zigzag else [owner[c] for c in incoming]
    recv_sizes = [sum(length for s in src if s == j) for j in range(n)]
    recv = torch.empty_like(send)
    torch.distributed.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    got = dict(zip(incoming, recv.chunk(2, 0)))
    wanted = list(zigzag_chunks(rank, n)) if to_zigzag else [2 * rank, 2 * rank + 1]
    return torch.cat([got[c] for c in wanted]).movedim(0, dim)


def _blocks(q_chunks, n: int, rank: int, causal: bool, L: int, window):
    """(query chunk position, key chunk, masked) in ring order: the key chunks of rank r - t
    at step t, those no query of the chunk sees left out (causal: later chunks; a sliding
    window: chunks wholly before it); masked when some of the block's scores are hidden."""
    for t in range(n):
        src = (rank - t) % n
        for kc in (2 * src, 2 * src + 1):
            for i, qc in enumerate(q_chunks):
                if not causal:
                    yield i, kc, False
                    continue
                if kc > qc:
                    continue
                nearest, farthest = (qc - kc - 1) * L + 1, (qc - kc + 1) * L - 1  # query minus key position
                if kc < qc and window is not None and nearest >= window:
                    continue
                yield i, kc, kc == qc or (window is not None and farthest >= window)


def _scores(q, k, scale, masked: bool, qc: int, kc: int, L: int, window):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if masked:
        q_pos = torch.arange(qc * L, (qc + 1) * L, device=s.device)
        k_pos = torch.arange(kc * L, (kc + 1) * L, device=s.device)
        reach = window if window is not None else (qc + 1) * L + 1  # no window: every earlier key
        s = s.masked_fill(~window_mask(q_pos, k_pos, reach), float("-inf"))
    return s


def _finite(lse: Tensor) -> Tensor:
    """A log-sum-exp with the rows that saw no key (-inf) at 0, to subtract without NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _expand(x: Tensor, groups: int) -> Tensor:
    """Key/value heads repeated for the query heads they serve (head i reads kv head i // g)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, group, n: int, rank: int, window):
        groups = q.size(1) // k.size(1)
        keys = all_gather_dim(k, 2, group, n)
        values = all_gather_dim(v, 2, group, n)
        qz = _exchange(q, 2, n, rank, group, True) if causal else q
        q_chunks = zigzag_chunks(rank, n) if causal else (2 * rank, 2 * rank + 1)
        L = q.size(2) // 2
        acc = torch.promote_types(q.dtype, torch.float32)  # scores and sums in float32 at least
        ctx.acc = acc
        qs = [c.to(acc) for c in qz.chunk(2, 2)]
        out = [None, None]
        lse = [None, None]
        for i, kc, masked in _blocks(q_chunks, n, rank, causal, L, window):
            kb = _expand(keys.narrow(2, kc * L, L), groups).to(acc)
            vb = _expand(values.narrow(2, kc * L, L), groups).to(acc)
            s = _scores(qs[i], kb, scale, masked, q_chunks[i], kc, L, window)
            l_blk = torch.logsumexp(s, dim=-1)  # -inf on a row the block hides entirely (a window)
            o_blk = torch.matmul(torch.exp(s - _finite(l_blk).unsqueeze(-1)), vb)
            BLOCKS["computed"] += 1
            if out[i] is None:
                out[i], lse[i] = o_blk, l_blk
            else:
                new = _finite(torch.logaddexp(lse[i], l_blk))
                out[i] = out[i] * torch.exp(lse[i] - new).unsqueeze(-1) + o_blk * torch.exp(l_blk - new).unsqueeze(-1)
                lse[i] = torch.logaddexp(lse[i], l_blk)
        oz = torch.cat(out, dim=2).to(q.dtype)
        lse_z = torch.cat(lse, dim=2)
        ctx.save_for_backward(qz, k, v, oz, lse_z)
        ctx.args = (causal, scale, group, n, rank, q_chunks, window)
        return _exchange(oz, 2, n, rank, group, False) if causal else oz

    @staticmethod
    def backward(ctx, grad):
        qz, k, v, oz, lse_z = ctx.saved_tensors
        causal, scale, group, n, rank, q_chunks, window = ctx.args
        groups = qz.size(1) // k.size(1)
        keys = all_gather_dim(k, 2, group, n)
        values = all_gather_dim(v, 2, group, n)
        acc = ctx.acc
        dz = (_exchange(grad, 2, n, rank, group, True) if causal else grad).to(acc)
        L = qz.size(2) // 2
        qs, dos, os_, ls = (t.to(acc).chunk(2, 2) for t in (qz, dz, oz, lse_z))
        deltas = [(do * o).sum(-1) for do, o in zip(dos, os_)]
        dq = [torch.zeros_like(c) for c in qs]
        dkeys = torch.zeros(keys.shape, dtype=acc, device=keys.device)
        dvalues = torch.zeros_like(dkeys)
        b, kv, e = k.size(0), k.size(1), k.size(3)
        for i, kc, masked in _blocks(q_chunks, n, rank, causal, L, window):
            kb = _expand(keys.narrow(2, kc * L, L), groups).to(acc)
            vb = _expand(values.narrow(2, kc * L, L), groups).to(acc)
            p = torch.exp(_scores(qs[i], kb, scale, masked, q_chunks[i], kc, L, window) - ls[i].unsqueeze(-1))
            dv = torch.matmul(p.transpose(-1, -2), dos[i])
            ds = p * (torch.matmul(dos[i], vb.transpose(-1, -2)) - deltas[i].unsqueeze(-1))
            dq[i] += torch.matmul(ds, kb) * scale
            dk = torch.matmul(ds.transpose(-1, -2), qs[i]) * scale
            if groups > 1:
                dk = dk.view(b, kv, groups, L, e).sum(2)
                dv = dv.view(b, kv, groups, L, dv.size(-1)).sum(2)
            dkeys.narrow(2, kc * L, L).add_(dk)
            dvalues.narrow(2, kc * L, L).add_(dv)
        dqz = torch.cat(dq, dim=2).to(qz.dtype)
        dq_out = _exchange(dqz, 2, n, rank, group, False) if causal else dqz
        axis = None  # for messages only: the divisibility was checked when planning
        dk_out = reduce_scatter_dim(dkeys, 2, group, n, rank, axis).to(k.dtype)
        dv_out = reduce_scatter_dim(dvalues, 2, group, n, rank, axis).to(v.dtype)
        return dq_out, dk_out, dv_out, None, None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None, group,
                   window: int | None = None) -> Tensor:
    """Attention of this rank's queries (q [b, h, s / n, e], contiguous slice r of n) against
    the whole sequence's keys and values (k, v [b, kv, s / n, e], slice r), on `group`;
    window (causal only): query i sees keys i - window < j <= i."""
    n = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    if scale is None:
        scale = q.size(-1) ** -0.5
    return _Ring.apply(q, k, v, causal, float(scale), group, n, rank, window)


class _SeqToHeads(torch.autograd.Function):
    """x [b, h, s / n, e] (sequence split) -> [b, h / n, s, e] (heads split), or back with
    back=True; the gradient takes the other direction."""

    @staticmethod
    def forward(ctx, x, group, n: int, back: bool):
        ctx.args = (group, n, back)
        return _swap(x, group, n, back)

    @staticmethod
    def backward(ctx, grad):
        group, n, back = ctx.args
        return _swap(grad, group, n, not back), None, None, None


def _swap(x, group, n, back):
    if back:
        return all_to_all_dims(x, 1, 2, group, n, None)
    return all_to_all_dims(x, 2, 1, group, n, None)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask=None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale=None, enable_gqa: bool = False, *, group, local=None) -> Tensor:
    """q [b, h, s / n, e], k, v [b, kv, s / n, e] (contiguous sequence slices) -> [b, h, s / n, ev].
    local: the attention to run on whole sequences (default scaled_dot_product_attention
    with the arguments given)."""
    n = torch.distributed.get_world_size(group)
    qh, kh, vh = (_SeqToHeads.apply(t, group, n, False) for t in (q, k, v))
    if local is not None:
        out = local(qh, kh, vh)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _SeqToHeads.apply(out, group, n, True)
