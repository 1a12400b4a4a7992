"""Memory of model states per device under ZeRO (Rajbhandari et al., 2020).

Per parameter, with mixed-precision Adam: 2 bytes of weights, 2 of gradients and 12 of
optimizer states (float32 master weights, momentum and variance).  On N data-parallel
devices:

    stage 0 (plain data parallel)   2 + 2 + 12          = 16 bytes
    stage 1 (optimizer states)      2 + 2 + 12 / N
    stage 2 (+ gradients)           2 + (2 + 12) / N
    stage 3 (+ weights)             (2 + 2 + 12) / N

Activations of one transformer layer (Korthikanti et al., 2022)
----------------------------------------------------------------
`layer_activation_bytes` counts what one GPT-style layer (pre-LayerNorm attention and a
4*hidden feed-forward with GELU and dropout) keeps in memory from its forward pass for its
backward, at 16-bit precision: every kept tensor costs 2 bytes per element, except a dropout
mask, 1 byte.  With s the sequence length, b the micro-batch size, h the hidden size and a the
number of attention heads, the tensors are

    attention    q and k, read by the scores q k^T                  2 * 2sbh  =  4sbh
                 v, read by probs @ v                                           2sbh
                 the input of the q, k, v projections (one tensor)              2sbh
                 the input of the output projection                             2sbh
                 the dropout mask after the output projection                    sbh
                                                                               -----
                                                                               11sbh
                 the softmax output, read by its own backward                 2as^2b
                 the dropout mask on the attention probabilities               as^2b
                 the dropout output, read by probs @ v                        2as^2b
                                                                               -----
                                                                               5as^2b
    feed-forward the input of the first linear                                  2sbh
                 the input of GELU, [s, b, 4h]                                  8sbh
                 the input of the second linear, [s, b, 4h]                     8sbh
                 the dropout mask after the second linear                        sbh
                                                                               -----
                                                                               19sbh
    layer norms  the inputs of the two LayerNorms                    2 * 2sbh  =  4sbh

so a layer keeps sbh * (34 + 5as/h) bytes: 34 for the tensors the size of the residual
stream (or four times it), 5as/h for the [b, a, s, s] attention matrices, which grow with
the square of the sequence.  Biases, LayerNorm statistics ([s, b] floats) and the causal
mask are left out: they are small next to these when h and s are in the hundreds or more.

Megatron tensor parallelism on t ranks splits the heads and the feed-forward's inner dim,
so the tensors between a column-parallel and its row-parallel linear shrink by t: q, k, v,
the output projection's input, GELU's input and the second linear's input (24sbh), and all
5as^2b of the attention matrices.  The rest stays whole on every rank: the LayerNorm
inputs (4sbh), the inputs of the q, k, v projections and of the first linear (4sbh) and
the two dropout masks (2sbh), 10sbh in all:

    tensor parallel                          sbh * (10 + 24/t + 5as/(ht))

Sequence parallelism splits those 10sbh along the sequence on the same t ranks, so
everything shrinks by t:

    tensor + sequence parallel               sbh/t * (34 + 5as/h)

Selective recomputation keeps none of the attention core's 5as^2b (the softmax, its
dropout and their outputs are recomputed from q, k and v, which are kept anyway):

    selective, tensor parallel               sbh * (10 + 24/t)
    selective, tensor + sequence parallel    sbh * 34/t

Full recomputation keeps only the layer's input, 2sbh (the paper's table writes 2sbh; with
sequence parallelism that input is split along the sequence, 2sbh/t) and reruns the whole
forward of the layer in backward.
"""
from __future__ import annotations

from autopar.mesh import parse_bytes


def state_bytes_per_param(n_devices: int, zero_stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                          optimizer_bytes: float = 12) -> float:
    """Bytes one parameter costs each device at a ZeRO stage."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage!r} is not one of 0, 1, 2, 3")
    if n_devices < 1:
        raise ValueError(f"n_devices must be at least 1, got {n_devices}")
    n = n_devices
    p = param_bytes / n if zero_stage >= 3 else param_bytes
    g = grad_bytes / n if zero_stage >= 2 else grad_bytes
    o = optimizer_bytes / n if zero_stage >= 1 else optimizer_bytes
    return p + g + o


def max_trainable_params(device_memory_bytes, n_devices: int, zero_stage: int, param_bytes: float = 2,
                         grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """The most parameters whose model states fit in `device_memory_bytes` per device
    ('80GB' works), activations and buffers not counted."""
    memory = parse_bytes(device_memory_bytes, "device_memory_bytes")
    return memory / state_bytes_per_param(n_devices, zero_stage, param_bytes, grad_bytes, optimizer_bytes)


RECOMPUTE = ("none", "selective", "full")  # the values `layer_activation_bytes` takes for `recompute`


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none") -> int:
    """Bytes of activations one transformer layer keeps for backward on each rank, at 16-bit
    precision (Korthikanti et al. 2022; the terms are in the module docstring).

    seq, batch:         the micro-batch's input is [batch, seq] tokens
    hidden, heads:      the layer's width h and attention heads a (h a multiple of a)
    tp:                 Megatron tensor-parallel ranks t (a divisor of heads)
    sequence_parallel:  the layer norms, dropouts and residual adds split by sequence on
                        the same t ranks (Megatron-SP)
    recompute:          "none", "selective" (the attention core is recomputed in backward)
                        or "full" (only the layer's input is kept)

    The result is exact: with `heads` a multiple of `tp` every term divides evenly.
    """
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is not one of {', '.join(map(repr, RECOMPUTE))}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}: each head has hidden / heads "
                         f"channels; choose heads among the divisors of {hidden}")
    if heads % tp:
        raise ValueError(f"heads {heads} is not divisible by tp={tp}: tensor parallelism splits whole heads; "
                         f"choose tp among the divisors of {heads}")
    sbh = seq * batch * hidden
    attention = 5 * heads * seq * seq * batch  # the [b, a, s, s] matrices: 2 + 1 + 2 bytes
    if recompute == "full":
        return 2 * sbh // tp if sequence_parallel else 2 * sbh
    if recompute == "selective":
        attention = 0
    if sequence_parallel:
        return (34 * sbh + attention) // tp
    return 10 * sbh + (24 * sbh + attention) // tp
