"""BERT: a bidirectional transformer encoder trained with masked language modelling.

Read top to bottom:

    BertConfig     the hyper-parameters
    Embeddings     word + position + token-type embeddings, then LayerNorm
    SelfAttention  multi-head attention (not causal) with separate q, k, v projections
    FeedForward    hidden -> 4*hidden -> hidden with GELU
    EncoderLayer   post-LayerNorm residual block: LN(x + attn(x)), then LN(x + mlp(x))
    MLMHead        dense + GELU + LayerNorm, then a decoder tied to the word embeddings
    Bert           Embeddings, a stack of EncoderLayers, MLMHead

The data flow of Bert.forward:

    input_ids [batch, seq] ──► embeddings ──► EncoderLayer × n_layers
                           ──► head ──► logits [batch, seq, vocab]

The masked-LM loss is cross-entropy over all positions, where `targets` holds
the original token id at masked positions and -100 (ignored) everywhere else.
There is no padding mask (every example is a full sequence) and no pooler /
next-sentence head, which masked-LM training does not need.

Shapes in comments use `batch`, `seq`, `hidden`, `heads`, `head_dim`
(`hidden == heads * head_dim`) and `vocab`.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models import initialise
from autopar.models.checks import check_config, check_divides

IGNORE_INDEX = -100  # target value of the positions that do not count in the loss


@dataclass
class BertConfig:
    vocab: int = 30522  # WordPiece vocabulary of bert-base-uncased
    max_seq: int = 512  # number of learned position embeddings
    type_vocab: int = 2  # number of token types (segment A / segment B)
    hidden: int = 768
    n_layers: int = 12
    n_heads: int = 12
    dropout: float = 0.0  # the original BERT used 0.1; 0.0 keeps runs deterministic
    layer_norm_eps: float = 1e-12
    tie_embeddings: bool = True  # the MLM decoder shares its weight with the word embeddings

    def __post_init__(self):
        check_config(self, counts=("vocab", "max_seq", "type_vocab", "hidden", "n_layers", "n_heads"),
                     probabilities=("dropout",), nonnegative=("layer_norm_eps",))
        check_divides(self, "hidden", "n_heads")


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_seq, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab, config.hidden)
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """input_ids, token_type_ids: [batch, seq] -> [batch, seq, hidden]"""
        seq = input_ids.shape[1]
        pos = torch.arange(seq, device=input_ids.device)  # [seq]
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.ln(x))


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        if config.hidden % config.n_heads != 0:
            raise ValueError(
                f"hidden ({config.hidden}) must be divisible by n_heads ({config.n_heads})"
            )
        self.n_heads = config.n_heads
        self.head_dim = config.hidden // config.n_heads
        self.dropout = config.dropout
        self.q = nn.Linear(config.hidden, config.hidden)
        self.k = nn.Linear(config.hidden, config.hidden)
        self.v = nn.Linear(config.hidden, config.hidden)
        self.o = nn.Linear(config.hidden, config.hidden)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]"""
        batch, seq, hidden = x.shape
        # [batch, seq, hidden] -> [batch, seq, heads, head_dim] -> [batch, heads, seq, head_dim]
        q = self.q(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        # Every position attends to every position: no causal mask.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0
        )  # [batch, heads, seq, head_dim]
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        return self.resid_dropout(self.o(y))


class FeedForward(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, 4 * config.hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, 4*hidden] -> [batch, seq, hidden]"""
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class EncoderLayer(nn.Module):
    """Post-LayerNorm block: LayerNorm is applied after each residual addition."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = SelfAttention(config)
        self.attn_ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.mlp = FeedForward(config)
        self.mlp_ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> [batch, seq, hidden]"""
        x = self.attn_ln(x + self.attn(x))
        x = self.mlp_ln(x + self.mlp(x))
        return x


class MLMHead(nn.Module):
    """Predicts the token at every position: dense + GELU + LayerNorm, then a vocab projection."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden, config.hidden)
        self.act = nn.GELU()
        self.ln = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        # The decoder weight is tied to the word embeddings (see Bert.init_weights);
        # its bias is its own.
        self.decoder = nn.Linear(config.hidden, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, seq, hidden] -> logits [batch, seq, vocab]"""
        return self.decoder(self.ln(self.act(self.dense(x))))


class Bert(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.head = MLMHead(config)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make `head.decoder.weight` the same Parameter as `embeddings.word_embeddings.weight`
        (if `tie_embeddings`).

        `init_weights` re-ties: `to_empty()` gives each module a fresh Parameter.
        """
        if self.config.tie_embeddings:
            self.head.decoder.weight = self.embeddings.word_embeddings.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT/GPT-2 style init.

        Linear and embedding weights ~ normal(0, 0.02), biases zero, LayerNorms
        weight one / bias zero. Post-LN keeps the residual stream normalized,
        so no depth scaling is needed. The tied `head.decoder.weight` is
        `embeddings.word_embeddings.weight` and is drawn once, as the latter.
        """
        initialise.init_weights(self)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """`initialise.init_module` with BERT's rules; a tied `head.decoder` re-ties its weight
        (no draw) and zeroes its bias."""
        initialise.init_module(
            name,
            module,
            model=self,
            tied=self.head.decoder if self.config.tie_embeddings else None,
            norms=(nn.LayerNorm,),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        input_ids:      [batch, seq] token ids (masked positions hold the [MASK] id), seq <= max_seq
        targets:        [batch, seq] original ids at masked positions, -100 elsewhere (optional)
        token_type_ids: [batch, seq] segment ids (optional; all zeros if omitted)
        returns the scalar masked-LM loss if `targets` is given, else logits: [batch, seq, vocab]
        """
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)  # [batch, seq, hidden]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)  # [batch, seq, vocab]
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.view(-1, self.config.vocab), targets.view(-1), ignore_index=IGNORE_INDEX
        )
