"""GPT-2: a decoder-only transformer with learned position embeddings.

Read top to bottom:

    GPTConfig            the hyper-parameters
    CausalSelfAttention  multi-head attention: separate q, k, v projections, or one fused (fused_qkv);
                         one SDPA call, or (attention="eager") the explicit softmax(q k^T / sqrt(d)) v
    FeedForward          hidden -> 4*hidden -> hidden with GELU
    Block                pre-LayerNorm residual block: attention, then feed-forward
    GPT                  embeddings, a stack of Blocks, final LayerNorm, LM head

The data flow of GPT.forward:

    idx [batch, seq] ──► wte + wpe ──► Block × n_layers
                     ──► ln_f ──► lm_head ──► logits [batch, seq, vocab]

Shapes in comments use `batch`, `seq`, `hidden`, `heads`, `head_dim`
(`hidden == heads * head_dim`) and `vocab`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models import initialise
from autopar.models.checks import check_config, check_divides


ATTENTION_IMPLS = ("sdpa", "eager")  # the values of GPTConfig.attention


@dataclass
class GPTConfig:
    vocab: int = 50257  # GPT-2 BPE vocabulary size
    max_seq: int = 1024  # longest sequence the position embedding covers
    hidden: int = 768  # model width
    n_layers: int = 12
    n_heads: int = 12
    bias: bool = True  # biases in the linear layers and LayerNorms
    dropout: float = 0.0
    tie_embeddings: bool = True  # lm_head shares its weight with wte
    fused_qkv: bool = False  # one [3 * hidden, hidden] projection chunked into q, k, v (as GPT-2 ships it)
    # "sdpa": F.scaled_dot_product_attention; "eager": scores, mask, softmax, dropout and the
    # product with v as separate ops, as GPT-2 and Megatron-LM compute them
    attention: str = "sdpa"

    def __post_init__(self):
        check_config(self, counts=("vocab", "max_seq", "hidden", "n_layers", "n_heads"), probabilities=("dropout",))
        check_divides(self, "hidden", "n_heads")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(
                f"GPTConfig.attention is {self.attention!r}; choose one of "
                f"{', '.join(map(repr, ATTENTION_IMPLS))}"
            )


def causal_mask(max_seq: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[max_seq, max_seq] bool, True where query i may see key j (j <= i)."""
    return torch.ones(max_seq, max_seq, dtype=torch.bool, device=device).tril()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.hidden % config.n_heads != 0:
            raise ValueError(
                f"hidden ({config.hidden}) must be divisible by n_heads ({config.n_heads})"
            )
        self.n_heads = config.n_heads
        self.head_dim = config.hidden // config.n_heads
        self.dropout = config.dropout
        if config.fused_qkv:
            self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        else:
            self.q = nn.Linear(config.hidden, config.hidden, bias=config.bias)
            self.k = nn.Linear(config.hidden, config.hidden, bias=config.bias)
            self.v = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.o = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.eager = config.attention == "eager"
        if self.eager:
            self.attn_dropout = nn.Dropout(config.dropout)
            # Derived from the config, so not saved in the state dict; sliced to seq in forward.
            self.register_buffer("causal_mask", causal_mask(config.max_seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]"""
        batch, seq, hidden = x.shape
        # [batch, seq, hidden] -> [batch, seq, heads, head_dim] -> [batch, heads, seq, head_dim]
        q, k, v = self.qkv(x).chunk(3, dim=-1) if hasattr(self, "qkv") else (self.q(x), self.k(x), self.v(x))
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        if self.eager:
            y = self.eager_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )  # [batch, heads, seq, head_dim]
        # Put the heads side by side again: -> [batch, seq, hidden]
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        return self.resid_dropout(self.o(y))

    def eager_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [batch, heads, seq, head_dim] -> [batch, heads, seq, head_dim]

        Autograd keeps the tensors Korthikanti et al. 2022 count (autopar/cost/memory.py): q and
        k for the scores, the softmax output, the dropout mask, the dropout output and v;
        besides them only the [seq, seq] bool mask of hidden keys. The softmax keeps the
        input dtype (no float32 upcast).
        """
        seq = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # [batch, heads, seq, seq]
        scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        return probs @ v


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, 4 * config.hidden, bias=config.bias)
        self.act = nn.GELU(approximate="tanh")  # the GELU variant GPT-2 used
        self.fc2 = nn.Linear(4 * config.hidden, config.hidden, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, 4*hidden] -> [batch, seq, hidden]"""
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]"""
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.hidden)  # token embedding
        self.wpe = nn.Embedding(config.max_seq, config.hidden)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make `lm_head.weight` the same Parameter as `wte.weight` (if `tie_embeddings`).

        `init_weights` re-ties: `to_empty()` gives each module a fresh Parameter.
        """
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init.

        Linear and embedding weights ~ normal(0, 0.02), biases zero, LayerNorms
        weight one / bias zero. The two projections that write into the residual
        stream (`attn.o`, `mlp.fc2`) get std 0.02 / sqrt(2 * n_layers), so the
        residual stream does not grow with depth. The tied `lm_head.weight` is
        `wte.weight` and is drawn once, as `wte.weight`.
        """
        initialise.init_weights(self)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """`initialise.init_module` with GPT's rules; a tied `lm_head` draws nothing, it re-ties.
        An eager attention's causal mask (a non-persistent buffer) is recomputed, no RNG."""
        if isinstance(module, CausalSelfAttention) and module.eager:
            module.causal_mask.copy_(causal_mask(self.config.max_seq))
            return
        initialise.init_module(
            name,
            module,
            model=self,
            tied=self.lm_head if self.config.tie_embeddings else None,
            residual=("attn.o", "mlp.fc2"),
            n_layers=self.config.n_layers,
            norms=(nn.LayerNorm,),
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """
        idx:     [batch, seq] token ids, seq <= max_seq
        targets: [batch, seq] next-token ids (optional)
        returns the scalar cross-entropy loss if `targets` is given,
        else logits: [batch, seq, vocab]
        """
        batch, seq = idx.shape
        pos = torch.arange(seq, device=idx.device)  # [seq]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [batch, seq, hidden]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.lm_head(x)  # [batch, seq, vocab]
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, self.config.vocab), targets.view(-1))
