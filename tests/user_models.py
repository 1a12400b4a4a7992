"""Attention as users write it in their own code, for tests/test_user_models.py: the
nanoGPT way (fused q|k|v projection, heads by `.view`, the output put back with
`.transpose(1, 2).contiguous().view(...)`) and the torchtitan way (complex rotary
embeddings through view_as_complex / view_as_real, key/value heads repeated with
expand + reshape, the same `.contiguous().view`).  Written here from the formulas; each
model returns its loss."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotary_table(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    """e^{i t w_j} for positions t and frequencies w_j = theta^(-2j / head_dim): [length, head_dim / 2] complex."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim] rotated pairwise by the complex table [seq, head_dim / 2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = torch.view_as_real(pairs * table.view(1, pairs.shape[1], 1, pairs.shape[-1])).flatten(3)
    return turned.type_as(x)


def repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[batch, seq, kv_heads, d] -> [batch, seq, kv_heads * times, d], each head repeated in place."""
    if times == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand(b, s, h, times, d).reshape(b, s, h * times, d)


class NanoAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class EinsumAttention(nn.Module):
    """Attention written out with torch.einsum (x-transformers' way): scores, a causal mask
    filled in, softmax, the weighted sum, heads merged back."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (f(x).view(b, n, self.heads, c // self.heads).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * (c // self.heads) ** -0.5
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        attn = sim.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, c))


class TitanAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, max_seq: int, theta: float = 10000.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.register_buffer("freqs_cis", rotary_table(self.head_dim, max_seq, theta), persistent=False)

    def forward(self, x, *unused):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        table = self.freqs_cis[:s]
        q, k = rotate(q, table), rotate(k, table)
        k, v = repeat_heads(k, self.heads // self.kv_heads), repeat_heads(v, self.heads // self.kv_heads)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        y = y.transpose(1, 2).contiguous()
        return self.wo(y.view(b, s, -1))


class GroupedExperts(nn.Module):
    """Experts the way torchtitan-style code writes them: stacked weights, called with the
    rows already sorted by expert and each expert's row count (read with .tolist(), so the
    split sizes are known only when the step runs)."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * dim ** -0.5)

    def forward(self, rows, counts):
        sizes = counts.tolist()
        outs = []
        for e, part in enumerate(torch.split(rows[:sum(sizes)], sizes, dim=0)):
            h = F.silu(part @ self.w1[e].transpose(-2, -1)) * (part @ self.w3[e].transpose(-2, -1))
            outs.append(h @ self.w2[e].transpose(-2, -1))
        return torch.cat(outs, dim=0)


class SortedMoE(nn.Module):
    """Sigmoid router with top-k, rows reordered by expert with argsort, grouped experts on
    the token counts (histc, or bincount with minlength), the outputs weighted and scattered back with scatter_add, plus
    a shared expert."""

    def __init__(self, dim: int, hidden: int = 48, experts: int = 4, k: int = 2, counting: str = "histc"):
        super().__init__()
        self.k, self.experts, self.counting = k, experts, counting
        self.router = nn.Linear(dim, experts, bias=False)
        self.grouped = GroupedExperts(dim, hidden, experts)
        self.shared = nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.SiLU(), nn.Linear(hidden, dim, bias=False))

    def forward(self, x):
        b, s, d = x.shape
        x = x.view(-1, d)
        scores = torch.sigmoid(self.router(x))
        top, chosen = torch.topk(scores, self.k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        if self.counting == "bincount":
            counts = torch.bincount(chosen.view(-1), minlength=self.experts)
        else:
            counts = torch.histc(chosen.view(-1).float(), bins=self.experts, min=0, max=self.experts).long()
        order = torch.argsort(chosen.view(-1), stable=True)
        weights = top.view(-1)[order]
        token = (order // self.k).reshape(-1, 1).expand(-1, d)
        rows = torch.gather(x, 0, token)
        out = self.grouped(rows, counts)
        out = out * weights.reshape(-1, 1)
        y = self.shared(x).scatter_add(0, token, out)
        return y.view(b, s, d)


class CapacityMoE(nn.Module):
    """GShard-style top-1 experts with a fixed capacity per sequence, every shape fixed: each
    token's place in its expert's queue from a cumsum, a [batch, seq, experts, capacity]
    dispatch tensor, the experts as einsums over their queues; a token past its expert's
    capacity is dropped (the residual carries it)."""

    def __init__(self, dim: int, hidden: int = 48, experts: int = 4, capacity_factor: float = 1.25, seq: int = 16):
        super().__init__()
        self.experts, self.capacity = experts, math.ceil(capacity_factor * seq / experts)
        self.record = False
        self.router = nn.Linear(dim, experts, bias=False)
        self.wi = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.wo = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        gate, chosen = probs.max(dim=-1)
        mask = F.one_hot(chosen, self.experts)
        place = torch.cumsum(mask, dim=1) * mask - 1
        kept = ((place < self.capacity) & (mask > 0)).unsqueeze(-1)
        if self.record:   # (for tests, eagerly: which tokens the capacity let through)
            self.kept = kept.detach()
        dispatch = F.one_hot(place.clamp(0, self.capacity - 1), self.capacity).to(x.dtype) * kept
        queues = torch.einsum("bsec,bsd->becd", dispatch, x)
        h = F.gelu(torch.einsum("becd,edh->bech", queues, self.wi))
        y = torch.einsum("bech,ehd->becd", h, self.wo)
        return torch.einsum("bsec,becd->bsd", dispatch * gate[..., None, None], y)


class MatmulMLP(nn.Module):
    """An MLP whose weights are plain matrices applied as `x @ W` (research code's way)."""

    def __init__(self, dim: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(dim, 4 * dim) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(4 * dim, dim) * (4 * dim) ** -0.5)

    def forward(self, x):
        return F.gelu(x @ self.w_in) @ self.w_out


class Block(nn.Module):
    def __init__(self, dim: int, attention: nn.Module, mlp: nn.Module | None = None):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), attention, nn.LayerNorm(dim)
        self.mlp = mlp if mlp is not None else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                             nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SmallLM(nn.Module):
    """Embeddings, two blocks of `kind` attention ("nano", "einsum" or "titan"; "titan-moe":
    titan attention and SortedMoE for the MLP, "titan-moe-bincount" the same counting with
    bincount; "capacity-moe": nano attention and CapacityMoE; "matmul-mlp": nano attention
    and MatmulMLP), a head, the loss."""

    def __init__(self, kind: str, vocab: int = 128, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        make = {"nano": lambda: NanoAttention(dim, heads), "einsum": lambda: EinsumAttention(dim, heads),
                "titan": lambda: TitanAttention(dim, heads, 2, seq),
                "titan-moe": lambda: TitanAttention(dim, heads, 2, seq),
                "titan-moe-bincount": lambda: TitanAttention(dim, heads, 2, seq),
                "capacity-moe": lambda: NanoAttention(dim, heads), "matmul-mlp": lambda: NanoAttention(dim, heads)}[kind]
        mlp = {"titan-moe": lambda: SortedMoE(dim), "capacity-moe": lambda: CapacityMoE(dim, seq=seq),
               "titan-moe-bincount": lambda: SortedMoE(dim, counting="bincount"), "matmul-mlp": lambda: MatmulMLP(dim)}.get(
            kind, lambda: None)
        self.h = nn.ModuleList(Block(dim, make(), mlp()) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Seq2SeqLoss(nn.Module):
    """A Hugging Face encoder-decoder behind a wrapper: (ids, labels) -> its loss.  The
    attention mask is passed, as some families build it only when traced without one."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss


class LabelsLoss(nn.Module):
    """A Hugging Face causal LM behind the wrapper users write: (ids, labels) -> its loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels).loss


def titan_llama(model) -> nn.Module:
    """autopar.models' Llama with every layer's attention replaced by TitanAttention of the
    same shapes (complex rotary embeddings; the model's own real cos/sin tables unused)."""
    config = model.config
    device = model.tok_embeddings.weight.device
    for layer in model.layers:
        titan = TitanAttention(config.dim, config.n_heads, config.n_kv_heads, config.max_seq, config.rope_theta)
        layer.attention = titan.to(device)
    return model


def train_step_on_logits() -> str:
    """(A job on every rank of a pool.)  What train_step says for a model returning logits."""
    import autopar
    import torch.distributed as dist
    from autopar.runtime.process import CompileError

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

        def forward(self, x):
            return self.head(self.emb(x))

    torch.manual_seed(0)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    cm = autopar.compile(Logits(), autopar.Mesh((dist.get_world_size(),), ("dp",), device="cpu"), (x,))
    try:
        cm.train_step(x)
    except CompileError as exc:
        return str(exc)
    return "no error"
