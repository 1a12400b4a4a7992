"""Strategies of the mixture-of-experts op (autopar/trace/experts_op.py).

Operands: x [tokens, hidden], index [tokens, k], weight [tokens, k], gate and up
[experts, inner, hidden], down [experts, hidden, inner]; output [tokens, hidden].  Each mesh
axis does one of:

- "t" tokens: x, index, weight and the output Shard(0); the expert weights whole, their
  gradients Partial (data parallel);
- "e" experts, tokens whole: every rank runs the rows routed to its experts (weights
  Shard(0)); the output, and the gradients of x and weight, are Partial sums;
- "i" the inner dim: gate and up Shard(1), down Shard(2) (Megatron inside every expert);
  output Partial;
- "te" expert parallelism: tokens and experts split on the same axis; each rank sends
  the rows of its tokens to the ranks holding their experts and takes the results back
  (two all-to-alls forward, two backward, each of tokens x k rows of hidden values
  assuming balanced routing: (n - 1) / n of them leave the rank; NodePrices.routing_factor
  then prices the busiest rank).

At most one axis does "e", "i" or "te"; the others split tokens or nothing.

Ungated experts (up None, Switch Transformers') have no up operand: x, index, weight,
gate, down.

With biases (gate_bias and up_bias [experts, inner], down_bias [experts, hidden]) they go
with their experts ("e", "te": Shard(0)); "i" is not offered, as every rank's partial sum
would add the down projection's bias again.
"""
from __future__ import annotations

import itertools
import math

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ops.strategy import Strategy

KINDS = (None, "t", "e", "i", "te")
_R, _P = Replicate(), Partial()


def _axis(kind, biased: bool = False, gated: bool = True):
    """(inputs, outputs, grads) placements of one axis: per operand x, index, weight, gate,
    up (when `gated`), down (and gate_bias, up_bias, down_bias when `biased`)."""
    s0 = Shard(0)
    if kind is None:
        ins, out, grads = (_R,) * 6, (_R,), (_R,) * 6
        bias, bias_grad = _R, _R
    elif kind == "t":
        ins, out, grads = (s0, s0, s0, _R, _R, _R), (s0,), (s0, s0, s0, _P, _P, _P)
        bias, bias_grad = _R, _P
    elif kind == "e":
        ins, out, grads = (_R, _R, _R, s0, s0, s0), (_P,), (_P, _R, _P, s0, s0, s0)
        bias, bias_grad = s0, s0
    elif kind == "i":
        ins, out, grads = (_R, _R, _R, Shard(1), Shard(1), Shard(2)), (_P,), (_P, _R, _P, Shard(1), Shard(1), Shard(2))
        bias, bias_grad = None, None   # (not offered with biases)
    else:  # "te"
        ins, out, grads = (s0,) * 6, (s0,), (s0,) * 6
        bias, bias_grad = s0, s0
    if biased:
        ins, grads = ins + (bias,) * 3, grads + (bias_grad,) * 3
    if not gated:
        ins, grads = ins[:4] + ins[5:], grads[:4] + grads[5:]
    return ins, out, grads


def experts_strategies(in_shapes, mesh_shape, axis_names, needs_grad) -> list[Strategy]:
    tokens, k = in_shapes[1]
    n_experts, inner = in_shapes[3][0], in_shapes[3][1]
    hidden = in_shapes[0][-1]
    biased = len(in_shapes) == 9
    gated = len(in_shapes) != 5
    count = len(in_shapes)
    out = []
    for split in itertools.product(KINDS, repeat=len(mesh_shape)):
        if any(n == 1 and kind is not None for kind, n in zip(split, mesh_shape)):
            continue
        if biased and "i" in split:
            continue
        if sum(1 for kind in split if kind not in (None, "t")) > 1:
            continue
        token_ways = math.prod(n for kind, n in zip(split, mesh_shape) if kind in ("t", "te"))
        expert_ways = math.prod(n for kind, n in zip(split, mesh_shape) if kind in ("e", "te"))
        inner_ways = math.prod(n for kind, n in zip(split, mesh_shape) if kind == "i")
        if tokens % token_ways or n_experts % expert_ways or inner % inner_ways:
            continue
        per_axis = [_axis(kind, biased, gated) for kind in split]
        inputs = tuple(tuple(ax[0][i] for ax in per_axis) for i in range(count))
        outputs = (tuple(ax[1][0] for ax in per_axis),)
        grads = tuple(tuple(ax[2][i] for ax in per_axis) if needs_grad[i] else None for i in range(count))
        # the runtime's calls (trace/experts_op.expert_parallel): forward the row counts (a few
        # elements), the rows' expert ids (k per token, int64: 2k float32 elements' bytes),
        # the rows (k x hidden per token) and their results back; backward the two row moves
        # the other way
        comm = tuple(entry for a, kind in enumerate(split) if kind == "te"
                     for entry in (("all_to_all", a, 0, "forward"), ("all_to_all", a, 2 * k, "forward"),
                                   ("all_to_all", a, k * hidden, "forward"), ("all_to_all", a, k * hidden, "forward"),
                                   ("all_to_all", a, k * hidden, "backward"),
                                   ("all_to_all", a, k * hidden, "backward")))
        reduced = tuple(a for a, kind in enumerate(split) if kind in ("e", "i"))
        name = " ".join(f"{ax}={_NAMES[kind]}" for ax, kind in zip(axis_names, split) if kind) or "replicate"
        factor = math.prod(n for kind, n in zip(split, mesh_shape) if kind)  # balanced routing
        out.append(Strategy(split, inputs, outputs, grads, factor, name, comm, reduced=reduced))
    return out


_NAMES = {"t": "tokens", "e": "experts", "i": "inner", "te": "expert-parallel"}


def kept_tokens_factor(strategy, k: int) -> int:
    """What the op keeps for backward under `strategy`, in units of its own token operand x:
    1 (x itself), except under expert parallelism ("te"), where the rows it received (k per
    token of the rank, balanced) and the rows it sent back, which the combine's weighting
    reads, are kept in x's place (trace/experts_op.expert_parallel): 2k."""
    return 2 * k if "te" in strategy.split else 1
