"""Mixture-of-experts layers as one planned op: `autopar::experts`.

A Hugging Face experts module (transformers 5: stacked weights `gate_up_proj
[experts, 2 * inner, hidden]` and `down_proj [experts, hidden, inner]`, called with the
router's choices) traces to a sort, a histogram and grouped matmuls whose row counts
depend on the routing: no sharding rule can say which rows a rank holds.  While tracing,
autopar calls such a module through one op instead:

    experts(x [tokens, hidden], index [tokens, k], weight [tokens, k],
            gate [E, inner, hidden], up [E, inner, hidden], down [E, hidden, inner], act)
        -> [tokens, hidden]:  sum_s weight[t, s] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])),
                              e = index[t, s]

Experts with biases (GPT-OSS: gate_up_proj_bias, down_proj_bias) pass them as three more
operands, gate_bias and up_bias [E, inner] and down_bias [E, hidden], added after each
product; act "swiglu_oai:<alpha>:<limit>" is GPT-OSS's gate: (clamp(up, -limit, limit) + 1)
* g * sigmoid(alpha * g), g = clamp(gate, max=limit).

Ungated experts (Switch Transformers': down[e] @ act(gate[e] @ x[t])) pass up=None.

Every token reaches all k experts it picked, except the slots a router dropped for capacity:
their index is E (no expert) and they contribute zero.  The op never drops rows itself;
`capacity` only tells the planner that the router caps every expert (the capacity factor:
the most rows one expert takes over the mean, 0 where nothing caps it), so a split op is
priced at no more than that (NodePrices.routing_factor).
The op's strategies (autopar/ops/experts_rule.py) split tokens (data parallel), experts
with tokens whole (each rank its experts' share, a Partial sum), the inner dim (tensor
parallelism inside every expert, a Partial sum) or tokens and experts on one axis
(expert parallelism: each rank sends its tokens' rows to the ranks holding their experts
with an all-to-all and takes the results back with another; see `expert_parallel`).

The op's own implementation is the one-device reference: a loop over experts, exact.
Which modules run as the op while tracing, and how: autopar/trace/experts.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "relu": F.relu}


def _gated(act: str):
    """(g, u) -> the gated activation of one expert's gate and up products."""
    if act.startswith("swiglu_oai:"):
        alpha, limit = (float(v) for v in act.split(":")[1:])

        def oai(g, u):
            g = g.clamp(max=limit)
            return (u.clamp(min=-limit, max=limit) + 1) * (g * torch.sigmoid(g * alpha))
        return oai
    f = ACTIVATIONS[act]
    return lambda g, u: f(g) * u


def experts_math(x, index, weight, gate, up, down, act: str, first: int = 0, gate_bias=None, up_bias=None,
                 down_bias=None):
    """The experts' output (differentiable): experts [first, first + gate.shape[0]) of the
    model's, given as local weights (and biases); rows routed to other experts contribute
    zero.  up None: ungated experts, act applied to the gate product alone."""
    tokens, k = index.shape
    flat = index.reshape(-1)
    out = x.new_zeros(tokens * k, x.shape[-1])
    f = _gated(act) if up is not None else ACTIVATIONS[act]
    for e in range(gate.shape[0]):
        rows = (flat == first + e).nonzero().squeeze(-1)
        if rows.numel() == 0:
            continue
        h = x[rows // k]
        if up is None:
            y = f(h @ gate[e].T) @ down[e].T
        else:
            g, u = h @ gate[e].T, h @ up[e].T
            if gate_bias is not None:
                g, u = g + gate_bias[e], u + up_bias[e]
            y = f(g, u) @ down[e].T
        if down_bias is not None:
            y = y + down_bias[e]
        out = out.index_put((rows,), y)
    return _combine(out, weight, tokens, k, x.dtype)


def _combine(rows, weight, tokens: int, k: int, dtype):
    """Each token's k expert outputs weighted and summed in slot order (the router's weights
    keep their own dtype in the product, as the model's experts compute it).  rows may be
    empty (a rank of an expert-parallel axis whose experts no token picked): the feature
    size is given, as a view cannot infer it from zero elements."""
    return (rows * weight.reshape(-1, 1)).view(tokens, k, rows.shape[-1]).sum(1).to(dtype)


@torch.library.custom_op("autopar::experts", mutates_args=())
def experts(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor,
            up: torch.Tensor | None, down: torch.Tensor, act: str, first: int = 0,
            gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
            down_bias: torch.Tensor | None = None, capacity: float = 0.0) -> torch.Tensor:
    """first: the model's index of the first expert whose weights are given (a rank holding
    some of the experts: rows routed elsewhere contribute zero).  The biases: all three or
    none.  capacity: for the planner only (see the module's docstring)."""
    return experts_math(x, index, weight, gate, up, down, act, first, gate_bias, up_bias, down_bias)


@experts.register_fake
def _(x, index, weight, gate, up, down, act, first=0, gate_bias=None, up_bias=None, down_bias=None, capacity=0.0):
    return x.new_empty(x.shape)


def _recomputed_grads(grad, x, index, weight, gate, up, down, act, first, biases=(None, None, None)):
    """Gradients of x, weight, gate, up, down and the biases (None for each operand not
    given): the forward run again under autograd."""
    operands = (x, weight, gate, up, down, *biases)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) if t is not None else None for t in operands]
        lx, lw, lg, lu, ld, *lb = leaves
        out = experts_math(lx, index, lw, lg, lu, ld, act, first, *lb)
        given = [t for t in leaves if t is not None]
        grads = iter(torch.autograd.grad(out, given, grad, allow_unused=True))
    return tuple(None if t is None else (lambda g: g if g is not None else torch.zeros_like(t))(next(grads))
                 for t in leaves)


@torch.library.custom_op("autopar::experts_backward", mutates_args=())
def experts_backward(grad: torch.Tensor, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                     gate: torch.Tensor, up: torch.Tensor | None, down: torch.Tensor, act: str,
                     first: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward as one op, for shapes and the FLOP count on meta tensors (the real
    backward recomputes under autograd, see _backward).  Ungated (up None): its fourth
    result is empty."""
    raise NotImplementedError("autopar::experts_backward runs on meta tensors only")


@experts_backward.register_fake
def _(grad, x, index, weight, gate, up, down, act, first=0):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape), gate.new_empty(gate.shape),
            up.new_empty(up.shape) if up is not None else gate.new_empty(0), down.new_empty(down.shape))


def _setup(ctx, inputs, output):
    x, index, weight, gate, up, down, act, first, gate_bias, up_bias, down_bias, _ = inputs
    ctx.biased, ctx.gated = gate_bias is not None, up is not None
    ctx.save_for_backward(x, index, weight, gate, *((up,) if ctx.gated else ()), down,
                          *((gate_bias, up_bias, down_bias) if ctx.biased else ()))
    ctx.act, ctx.first = act, first


def _backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    if not ctx.gated:
        saved.insert(4, None)
    x, index, weight, gate, up, down, *biases = saved
    if x.device.type == "meta":
        gx, gw, gg, gu, gd = experts_backward(grad, x, index, weight, gate, up, down, ctx.act, ctx.first)
        gu = gu if ctx.gated else None
        gb = tuple(b.new_empty(b.shape) for b in biases)
    else:
        got = _recomputed_grads(grad, x, index, weight, gate, up, down, ctx.act, ctx.first,
                                tuple(biases) if biases else (None, None, None))
        gx, gw, gg, gu, gd = got[:5]
        gb = got[5:]
    gb = tuple(gb) if ctx.biased else (None, None, None)
    return (gx, None, gw, gg, gu, gd, None, None, *gb, None)


experts.register_autograd(_backward, setup_context=_setup)


def _flops(x_shape, index_shape, gate_shape, gated: bool = True) -> int:
    """Three matmuls (two, ungated) of inner x hidden per routed row (tokens x k rows)."""
    rows = index_shape[0] * index_shape[1]
    return 2 * rows * gate_shape[1] * gate_shape[2] * (3 if gated else 2)


try:  # the FLOP counter the cost model reads
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.autopar.experts)
    def _experts_flops(x_shape, index_shape, weight_shape, gate_shape, up_shape, down_shape, *args, out_shape=None,
                       **kwargs) -> int:
        return _flops(x_shape, index_shape, gate_shape, up_shape is not None)

    @register_flop_formula(torch.ops.autopar.experts_backward)
    def _experts_backward_flops(grad_shape, x_shape, index_shape, weight_shape, gate_shape, up_shape, *args,
                                out_shape=None, **kwargs) -> int:
        # the forward again, then twice its work
        return 3 * _flops(x_shape, index_shape, gate_shape, up_shape is not None)
except (ImportError, TypeError):  # pragma: no cover - an older torch without custom formulas
    pass


class _AllToAll(torch.autograd.Function):
    """Rows exchanged between the ranks of `group`: `send[j]` rows to rank j, `recv[j]` rows
    from it.  The gradient travels the reverse way."""

    @staticmethod
    def forward(ctx, rows, recv: list, send: list, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


def expert_parallel(x, index, weight, gate, up, down, act: str, n_experts: int, group, gate_bias=None,
                    up_bias=None, down_bias=None):
    """The op on one rank of an expert-parallel axis (`group`, n ranks): x [tokens / n, hidden]
    this rank's tokens; gate, up, down the weights of experts [r * E / n, (r + 1) * E / n).

    Dispatch: the (token, slot) rows, ordered by expert, go to the rank holding their expert
    (one all-to-all of the row counts, one of the rows and one of their expert ids); each
    rank runs its experts on what it received; combine: the results travel back the same
    way (the reverse all-to-all).  Both all-to-alls are differentiable: their backward is
    the all-to-all the other way round."""
    n = dist.get_world_size(group)
    local = n_experts // n
    tokens, k = index.shape
    flat = index.reshape(-1)
    first = dist.get_rank(group) * local
    # a slot with no expert (dropped for capacity, or padding) stays on this rank: zero
    key = torch.where((flat >= 0) & (flat < n_experts), flat, torch.full_like(flat, first))
    order = torch.argsort(key, stable=True)
    owner = key[order] // local
    send = torch.bincount(owner, minlength=n)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    rows = x[order // k]
    ids = flat[order].contiguous()
    got_ids = ids.new_empty(sum(recv_sizes))
    dist.all_to_all_single(got_ids, ids, recv_sizes, send_sizes, group=group)
    got = _AllToAll.apply(rows, recv_sizes, send_sizes, group)
    ones = torch.ones(got.shape[0], 1, dtype=got.dtype, device=got.device)
    done = experts(got, got_ids.unsqueeze(-1), ones, gate, up, down, act, first, gate_bias, up_bias, down_bias)
    back = _AllToAll.apply(done, send_sizes, recv_sizes, group)
    # rows in (token, slot) order again: read through the inverse permutation, whose backward
    # keeps only the indices (index_copy into a new tensor kept a copy of the rows as well)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    out = back[inverse]
    return _combine(out, weight, tokens, k, x.dtype)
