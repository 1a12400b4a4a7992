"""Llama 3: a decoder-only transformer with RoPE, grouped-query attention,
RMSNorm and a SwiGLU feed-forward (module names follow torchtitan).

Read top to bottom:

    LlamaConfig       the hyper-parameters
    RMSNorm           root-mean-square LayerNorm without a bias
    rope_tables       precomputed cos/sin tables for rotary position embeddings
    apply_rope        rotate q and k by their position
    Attention         grouped-query attention: wq, wk, wv, wo (no biases)
    FeedForward       SwiGLU: w2(silu(w1(x)) * w3(x))
    TransformerBlock  pre-norm residual block: attention, then feed-forward
    Llama             tok_embeddings, a stack of TransformerBlocks, norm, output

The data flow of Llama.forward:

    tokens [batch, seq] ──► tok_embeddings ──► TransformerBlock × n_layers
                        ──► norm ──► output ──► logits [batch, seq, vocab]

Shapes in comments use `batch`, `seq`, `dim`, `heads` (query heads),
`kv_heads` (key/value heads; each serves heads // kv_heads query heads),
`head_dim` (`dim == heads * head_dim`), `ffn_dim` and `vocab`.

Rotary embeddings use the "rotate half" formulation on real tensors (as in
Hugging Face transformers): dimension i of a head is paired with dimension
i + head_dim/2. Meta's reference code pairs neighbouring dimensions (2i, 2i+1)
with complex numbers instead; the two differ only by a fixed permutation of
the wq/wk output rows, so the model family is the same.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models import initialise
from autopar.models.checks import check_config, check_divides


@dataclass
class LlamaConfig:
    dim: int = 4096  # model width
    n_layers: int = 32
    n_heads: int = 32  # query heads
    n_kv_heads: int = 8  # key/value heads (grouped-query attention)
    vocab: int = 128256  # Llama 3 tiktoken vocabulary size
    multiple_of: int = 1024  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq: int = 8192  # longest sequence the RoPE tables cover
    tie_embeddings: bool = False  # output shares its weight with tok_embeddings
    float_loss: bool = False  # the loss on float32 logits (upcast first, as many training loops do)

    def __post_init__(self):
        check_config(self, counts=("dim", "n_layers", "n_heads", "n_kv_heads", "vocab", "multiple_of", "max_seq"),
                     nonnegative=("norm_eps",), positive=("rope_theta", "ffn_dim_multiplier"))
        check_divides(self, "dim", "n_heads")
        check_divides(self, "n_heads", "n_kv_heads")


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU hidden size of Llama 3.

    Start from 4*dim, keep 2/3 of it (SwiGLU has three matrices instead of two,
    so this keeps the parameter count of a 4*dim GELU MLP), scale by
    `ffn_dim_multiplier`, and round up to a multiple of `multiple_of`.
    For Llama 3 8B: 16384 -> 10922 -> 14198 -> 14336.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the rms taken over the last dimension.

    Unlike LayerNorm there is no mean subtraction and no bias.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]"""
        # Normalize in float32 so the result is accurate for bf16/fp16 inputs too.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings, each [max_seq, head_dim].

    Pair (i, i + head_dim/2) of a head at position p is rotated by the angle
    p * theta^(-2i/head_dim); the first and second halves of a row of the table
    hold the same angles.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    positions = torch.arange(max_seq, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [max_seq, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [max_seq, head_dim]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """
    x:        [batch, seq, n, head_dim] (n is heads or kv_heads)
    cos, sin: [seq, head_dim]
    returns x rotated by position: [batch, seq, n, head_dim]
    """
    cos = cos[None, :, None, :]  # [1, seq, 1, head_dim], broadcasts over batch and heads
    sin = sin[None, :, None, :]
    return (x * cos + rotate_half(x) * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config.dim % config.n_heads != 0:
            raise ValueError(f"dim ({config.dim}) must be divisible by n_heads ({config.n_heads})")
        if config.n_heads % config.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({config.n_heads}) must be divisible by n_kv_heads ({config.n_kv_heads})"
            )
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """
        x:        [batch, seq, dim]
        cos, sin: [seq, head_dim]
        returns   [batch, seq, dim]
        """
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # -> [batch, heads or kv_heads, seq, head_dim]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # enable_gqa lets each group of heads // kv_heads query heads share one
        # key/value head without materializing repeated k and v.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) * w3(x)).

    w1 is the gate projection, w3 the up projection and w2 the down projection.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, dim] -> [batch, seq, ffn_dim] -> [batch, seq, dim]"""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(attention_norm(x)), then x + feed_forward(ffn_norm(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(
            config.dim, ffn_hidden_dim(config.dim, config.multiple_of, config.ffn_dim_multiplier)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, dim], cos/sin: [seq, head_dim] -> [batch, seq, dim]"""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        # RoPE tables: derived from the config, so not saved in the state dict.
        head_dim = config.dim // config.n_heads
        cos, sin = rope_tables(head_dim, config.max_seq, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the same Parameter as `tok_embeddings.weight` (if `tie_embeddings`).

        `init_weights` re-ties: `to_empty()` gives each module a fresh Parameter.
        """
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init.

        Linear and embedding weights ~ normal(0, 0.02), RMSNorm weights one.
        The projections that write into the residual stream (`attention.wo`,
        `feed_forward.w2`) get std 0.02 / sqrt(2 * n_layers). A tied
        `output.weight` is `tok_embeddings.weight` and is drawn once, as
        `tok_embeddings.weight`. The RoPE tables are recomputed.
        """
        initialise.init_weights(self)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """`initialise.init_module` with Llama's rules, plus the model itself (""), which owns
        the non-persistent RoPE tables: computed, no RNG. A tied `output` re-ties, no draw."""
        if module is self:
            head_dim = self.config.dim // self.config.n_heads
            cos, sin = rope_tables(head_dim, self.config.max_seq, self.config.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
            return
        initialise.init_module(
            name,
            module,
            model=self,
            tied=self.output if self.config.tie_embeddings else None,
            residual=("attention.wo", "feed_forward.w2"),
            n_layers=self.config.n_layers,
            norms=(RMSNorm,),
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """
        tokens:  [batch, seq] token ids, seq <= max_seq
        targets: [batch, seq] next-token ids (optional)
        returns the scalar cross-entropy loss if `targets` is given,
        else logits: [batch, seq, vocab]
        """
        batch, seq = tokens.shape
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]  # [seq, head_dim]
        x = self.tok_embeddings(tokens)  # [batch, seq, dim]
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        logits = self.output(x)  # [batch, seq, vocab]
        if targets is None:
            return logits
        if self.config.float_loss:
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, self.config.vocab), targets.view(-1))
