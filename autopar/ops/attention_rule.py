"""Sequence-parallel strategies of attention (aten.scaled_dot_product_attention).

The annotation (rules._sdpa_rule) splits the batch and the heads.  On top of each of its
strategies, one mesh axis that it leaves whole may split the sequence of q, k, v and the
output (all Shard(2)) in one of two named ways, run by autopar/passes/attention_ops.py:

- "ring" (context parallel): every rank keeps its slice of the queries and meets every
  key/value block; forward gathers k and v over the axis, backward gathers them again and
  reduce-scatters their gradients.  Causal masks are load-balanced: half the queries are
  exchanged into the zigzag layout and the output back (one all-to-all each way, and the
  same for the gradients).  Not with an explicit attention mask or attention dropout.
- "ulysses": q, k, v are swapped from sequence to heads by one all-to-all each, attention
  runs on whole sequences for 1/n of the heads, the output is swapped back; backward the
  same four.  Needs the query and key/value heads left on the rank to divide by n; an
  explicit mask must be broadcast over heads.

Collectives are given per batch row (elements of one row of the rank's batch), as the
cost model reads a named strategy's `comm`: one entry per collective the runtime calls, with
its phase.
"""
from __future__ import annotations

import math

from torch.distributed.tensor import Replicate, Shard

from autopar.ops.strategy import Strategy
from autopar.placements import local_shape

SEQ = 2  # q, k, v and the output are [b, heads, seq, head_dim]
ATTENTION_OPS = ("aten.scaled_dot_product_attention", "autopar.window_attention")


def sequence_strategies(base: list, in_shapes, out_shape, mesh_shape, axis_names, *, causal: bool,
                        has_mask: bool, dropout: bool, why: list) -> list:
    """Strategies splitting the sequence over one axis, ring or Ulysses, for each strategy of
    `base` that leaves that axis whole; `why` collects the reasons a form is left off."""
    q, k = in_shapes[0], in_shapes[1]
    seq = q[SEQ]
    if k[SEQ] != seq:
        why.append(f"the key sequence ({k[SEQ]}) differs from the query sequence ({seq}): cross-attention "
                   f"keeps its sequence whole")
        return []
    if dropout:
        why.append("attention dropout is on: the sequence stays whole in attention (its random mask would "
                   "differ from one device's)")
        return []
    out = []
    reasons: dict = {}
    for s in base:
        if any(isinstance(p, Shard) and p.dim == SEQ for p in s.inputs[0]):
            continue  # the annotation already splits queries (no causal mask)
        for a, n in enumerate(mesh_shape):
            if n == 1 or s.split[a] is not None:
                continue
            q_local = local_shape(q, s.inputs[0], mesh_shape)
            k_local = local_shape(k, s.inputs[1], mesh_shape)
            for kind in ("ring", "ulysses"):
                reason = _unfit(kind, n, seq, q_local[1], k_local[1], has_mask,
                                in_shapes[3] if has_mask else None, causal)
                if reason:
                    reasons.setdefault((kind, axis_names[a]), reason)
                    continue
                out.append(_variant(s, a, n, kind, q_local, k_local, out_shape, mesh_shape, axis_names, causal))
    for (kind, axis), reason in reasons.items():
        why.append(f"{kind} on {axis!r}: {reason}")
    return out


def _unfit(kind, n, seq, heads, kv_heads, has_mask, mask_shape, causal) -> str | None:
    if kind == "ring":
        if has_mask:
            return ("an explicit attention mask (the ring takes a causal mask or none: a decoder passes "
                    "is_causal=True instead of a dense causal mask, and a Hugging Face model called without "
                    "attention_mask or position_ids is traced so; a bidirectional encoder with no padding "
                    "passes no mask at all)")
        if seq % (2 * n):
            return f"sequence {seq} does not divide into {2 * n} chunks (2 x the axis size), pad it to a multiple"
        return None
    if seq % n:
        return f"sequence {seq} does not divide by {n}, pad it to a multiple"
    if heads % n or kv_heads % n:
        return f"{heads} query and {kv_heads} key/value heads on the rank do not divide by {n}"
    if has_mask and (len(mask_shape) < 4 or mask_shape[1] != 1):
        return f"the attention mask {tuple(mask_shape)} is not broadcast over heads"
    return None


def _variant(s: Strategy, a: int, n: int, kind: str, q_local, k_local, out_shape, mesh_shape, axis_names,
             causal: bool) -> Strategy:
    def with_seq(placements):
        return tuple(Shard(SEQ) if i == a else p for i, p in enumerate(placements))

    def whole(placements):
        return tuple(Replicate() if i == a else p for i, p in enumerate(placements))

    inputs = tuple(with_seq(p) if i < 3 else whole(p) for i, p in enumerate(s.inputs))
    grads = tuple(None if g is None else (with_seq(g) if i < 3 else whole(g)) for i, g in enumerate(s.grads))
    outputs = (with_seq(s.outputs[0]),) + tuple(s.outputs[1:])
    split = tuple(kind if i == a else l for i, l in enumerate(s.split))
    # elements per local batch row, after the split
    rows = max(q_local[0], 1)
    qe = math.prod(q_local) / n / rows
    ke = math.prod(k_local) / n / rows
    oe = math.prod(local_shape(out_shape, s.outputs[0], mesh_shape)) / n / rows
    # one entry per collective the runtime calls (autopar/passes/attention_ops.py), each
    # priced with its own latency: (kind, axis, elements per row, phase)
    if kind == "ring":
        # gather k and v forward and again backward (all-gather output: the whole sequence),
        # reduce-scatter their gradients; causal: queries and output exchanged into and out
        # of the zigzag layout forward, their gradients backward
        comm = (("all_gather", a, n * ke, "forward"), ("all_gather", a, n * ke, "forward"),
                ("all_gather", a, n * ke, "backward"), ("all_gather", a, n * ke, "backward"),
                ("reduce_scatter", a, n * ke, "backward"), ("reduce_scatter", a, n * ke, "backward"))
        if causal:
            comm += (("all_to_all", a, qe, "forward"), ("all_to_all", a, oe, "forward"),
                     ("all_to_all", a, oe, "backward"), ("all_to_all", a, qe, "backward"))
    else:   # q, k, v to heads and the output back; backward the four gradients the other way
        comm = tuple(("all_to_all", a, e, phase) for phase in ("forward", "backward") for e in (qe, ke, ke, oe))
    name = (s.name + " " if s.name != "replicate" else "") + f"{axis_names[a]}={kind}"
    return Strategy(split, inputs, outputs, grads, s.factor * n, name, comm, reduced=s.reduced)


def private_holdings(strategy: Strategy, causal: bool):
    """Which of an attention op's kept tensors ("in", k) / ("out", 0) live in buffers of
    its own under a sequence-split strategy, rather than in its operands or the output it
    returns: Ulysses keeps the head-split copies of q, k, v and of its output; the causal
    ring keeps q and its output in the zigzag order (k and v as given).  None: not a
    sequence-split strategy (every kept tensor is its own, as for any op that
    communicates inside)."""
    if "ulysses" in strategy.split:
        return frozenset({("in", 0), ("in", 1), ("in", 2), ("out", 0)})
    if "ring" in strategy.split:
        return frozenset({("in", 0), ("out", 0)}) if causal else frozenset()
    return None
