"""Models drawn from a small grammar, and the training loop the property test runs on them
(tests/test_fuzz.py), on one device and compiled on the worker pool's ranks.

A model is a `Net` built from a `Spec` (a frozen, picklable record): token embedding, an
optional buffer that scales the hidden state, dropout, 1-3 blocks, a final norm and an
output head (tied to the embedding or not).  Blocks are written the ways users write them:

- "mlp": Linear-GELU-Linear; "glu": SiLU(gate) * up, then down (Llama's MLP);
- "attn": separate q, k, v projections, heads by `.view(...).transpose(1, 2)`, causal SDPA,
  `.transpose(1, 2).contiguous().view(...)` back (nanoGPT's habit), or `.reshape` (HF's);
- "attn_fused": one projection for q, k and v, split on its last dimension;
- "parallel": attention and MLP read the same normed input, summed into the residual;
- "moe": a Hugging Face Mixtral sparse-MoE block (top-2 router, stacked experts);
- "moe_dense": a router and stacked experts written by hand, every expert run on every
  token and weighted by the top-k mask.

Each block is pre-norm (norm, then the block, added to the residual) or post-norm (the
norm applied after the residual add), with LayerNorm or RMSNorm, biases or none.

A `Loop` is the training habits of one draw: steps, gradient clipping, accumulation over
two batches under `no_sync`, a look at the model in `eval()` between steps, a checkpoint
saved after the first step and loaded under another plan, pretrained weights loaded
through `cm.load_state_dict(plain.state_dict())` before training.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HEADS = 32, 4
OPTIM = dict(lr=1e-4, eps=1e-6)   # (as tests/rt_cases.py: a key bias's gradient is rounding noise, which Adam scales to lr)
BLOCKS = ("mlp", "glu", "attn", "attn_fused", "parallel", "moe", "moe_dense")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One model of the grammar."""
    blocks: tuple = ("mlp",)
    hidden: int = 16
    norm: str = "layer"          # "layer", "rms"
    post_norm: bool = False
    bias: bool = True
    tied: bool = False
    frozen: str = ""             # a parameter-name prefix to freeze ("" none)
    dropout: float = 0.0
    buffer: bool = False
    view_after_attention: bool = True   # .contiguous().view (else .reshape)
    batch: int = 4
    seq: int = 8

    def __str__(self) -> str:
        return (f"{'+'.join(self.blocks)} h{self.hidden} {self.norm}{' post' if self.post_norm else ''}"
                f"{' bias' if self.bias else ''}{' tied' if self.tied else ''}"
                f"{' frozen=' + self.frozen if self.frozen else ''}{' drop' if self.dropout else ''}"
                f"{' buffer' if self.buffer else ''}{'' if self.view_after_attention else ' reshape'}"
                f" batch {self.batch}x{self.seq}")


@dataclasses.dataclass(frozen=True)
class Loop:
    """The training habits of one draw."""
    steps: int = 2
    clip: float | None = None
    accumulate: bool = False
    eval_between: bool = False
    checkpoint: bool = False      # saved after step 0, loaded under the second plan
    pretrained: bool = False

    def __str__(self) -> str:
        parts = [f"{self.steps} steps"]
        parts += [f"clip {self.clip}"] if self.clip else []
        parts += [name for name in ("accumulate", "eval_between", "checkpoint", "pretrained") if getattr(self, name)]
        return ", ".join(parts)


def _norm(spec: Spec) -> nn.Module:
    return nn.LayerNorm(spec.hidden, bias=spec.bias) if spec.norm == "layer" else nn.RMSNorm(spec.hidden)


class Attention(nn.Module):
    def __init__(self, spec: Spec, fused: bool):
        super().__init__()
        h = spec.hidden
        self.fused, self.view = fused, spec.view_after_attention
        if fused:
            self.qkv = nn.Linear(h, 3 * h, bias=spec.bias)
        else:
            self.q, self.k, self.v = (nn.Linear(h, h, bias=spec.bias) for _ in range(3))
        self.out = nn.Linear(h, h, bias=spec.bias)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, s, h) if self.view else y.transpose(1, 2).reshape(b, s, h)
        return self.drop(self.out(y))


class MLP(nn.Module):
    def __init__(self, spec: Spec, glu: bool):
        super().__init__()
        h = spec.hidden
        self.glu = glu
        self.up = nn.Linear(h, 2 * h, bias=spec.bias)
        if glu:
            self.gate = nn.Linear(h, 2 * h, bias=spec.bias)
        self.down = nn.Linear(2 * h, h, bias=spec.bias)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x):
        inner = F.silu(self.gate(x)) * self.up(x) if self.glu else F.gelu(self.up(x))
        return self.drop(self.down(inner))


class DenseMoE(nn.Module):
    """Top-2 of 4 experts, every expert computed on every token (no data-dependent shapes)."""

    def __init__(self, spec: Spec, experts: int = 4, k: int = 2):
        super().__init__()
        h = spec.hidden
        self.k = k
        self.router = nn.Linear(h, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, h, 2 * h) / math.sqrt(h))
        self.w_out = nn.Parameter(torch.randn(experts, 2 * h, h) / math.sqrt(2 * h))

    def forward(self, x):
        probs = self.router(x).softmax(dim=-1)
        top, index = probs.topk(self.k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, index, top / top.sum(dim=-1, keepdim=True))
        inner = F.silu(torch.einsum("bsh,ehf->bsef", x, self.w_in))
        out = torch.einsum("bsef,efh->bseh", inner, self.w_out)
        return (out * weights.unsqueeze(-1)).sum(dim=2)


def _hf_moe(spec: Spec) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=spec.hidden, intermediate_size=2 * spec.hidden, num_local_experts=4,
                        num_experts_per_tok=2, num_attention_heads=HEADS, num_key_value_heads=HEADS)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():   # (standalone, the block's stacked experts are left uninitialised)
        for p in block.parameters():
            p.normal_(0.0, spec.hidden ** -0.5)
    return block


class Block(nn.Module):
    def __init__(self, kind: str, spec: Spec):
        super().__init__()
        self.kind, self.post = kind, spec.post_norm
        self.norm = _norm(spec)
        if kind in ("attn", "attn_fused"):
            self.inner = Attention(spec, fused=kind == "attn_fused")
        elif kind in ("mlp", "glu"):
            self.inner = MLP(spec, glu=kind == "glu")
        elif kind == "parallel":
            self.inner = Attention(spec, fused=False)
            self.mlp = MLP(spec, glu=False)
        elif kind == "moe":
            self.inner = _hf_moe(spec)
        elif kind == "moe_dense":
            self.inner = DenseMoE(spec)
        else:
            raise ValueError(f"unknown block {kind!r}; one of {BLOCKS}")

    def forward(self, x):
        if self.kind == "parallel":
            y = self.norm(x)
            return x + self.inner(y) + self.mlp(y)
        if self.post:
            return self.norm(x + self.inner(x))
        return x + self.inner(self.norm(x))


class Net(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(VOCAB, spec.hidden)
        if spec.buffer:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, spec.hidden))
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(kind, spec) for kind in spec.blocks)
        self.norm = _norm(spec)
        self.head = nn.Linear(spec.hidden, VOCAB, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        x = self.embed(ids)
        if self.spec.buffer:
            x = x * self.scale
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def build(spec: Spec, seed: int = 0) -> Net:
    """The model of `spec`, the same for a seed; `spec.frozen`'s parameters frozen."""
    torch.manual_seed(seed)
    model = Net(spec)
    for name, p in model.named_parameters():
        if spec.frozen and name.startswith(spec.frozen):
            p.requires_grad_(False)
    return model


def batches(spec: Spec, count: int) -> list:
    """`count` (ids, labels) batches, the same on every rank."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (spec.batch, spec.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _batches_needed(loop: Loop) -> int:
    return loop.steps * (2 if loop.accumulate else 1)


def train(model_or_cm, loop: Loop, data: list, optimizer, *, clip_fn, no_sync, backward, evaluate,
          after_first_step=None) -> dict:
    """The loop both sides run: per step one or two (accumulated) batches, optional
    clipping, the optimizer's step; optional eval between steps.  Returns losses, clip
    norms and eval losses, in order."""
    out = {"losses": [], "norms": [], "evals": []}
    it = iter(data)
    for step in range(loop.steps):
        if loop.accumulate:
            with no_sync():
                first = backward(*next(it))
            second = backward(*next(it))
            out["losses"].append((first + second) / 2)
        else:
            out["losses"].append(backward(*next(it)))
        if loop.clip:
            out["norms"].append(float(clip_fn(loop.clip)))
        optimizer.step()
        optimizer.zero_grad()
        if loop.eval_between:
            out["evals"].append(evaluate(*data[0]))
        if step == 0 and after_first_step is not None:
            model_or_cm, optimizer = after_first_step(model_or_cm, optimizer)
            backward, clip_fn, no_sync, evaluate = _handles(model_or_cm)
    return out


def _handles(cm):
    def backward(ids, labels):
        loss = cm(ids, labels)
        cm.backward(loss)
        return loss.item()

    def evaluate(ids, labels):
        cm.eval()
        with torch.no_grad():
            value = cm(ids, labels).item()
        cm.train()
        return value

    return backward, cm.clip_grad_norm_, cm.no_sync, evaluate


def reference(spec: Spec, loop: Loop) -> dict:
    """The loop on one device: losses, norms, evals and the parameters after it."""
    model = build(spec, seed=1 if loop.pretrained else 0)
    if spec.dropout:
        model.eval()   # (dropout is compared off: masks drawn per shard differ from one device's)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **OPTIM)

    def backward(ids, labels):
        loss = model(ids, labels)
        loss.backward()
        return loss.item()

    def evaluate(ids, labels):
        was = model.training
        model.eval()
        with torch.no_grad():
            value = model(ids, labels).item()
        model.train(was)
        return value

    import contextlib
    out = train(model, loop, batches(spec, _batches_needed(loop)), opt,
                clip_fn=lambda c: torch.nn.utils.clip_grad_norm_([p for p in model.parameters()
                                                                  if p.requires_grad], c),
                no_sync=contextlib.nullcontext, backward=backward, evaluate=evaluate)
    out["params"] = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return out


def compiled(spec: Spec, loop: Loop, plan_dict: dict, other_dict: dict | None, path: str | None) -> dict | None:
    """On every rank: the loop compiled under `plan_dict` (and, with loop.checkpoint, saved
    after step 0 and continued under `other_dict`).  Rank 0 returns what `reference` does."""
    import torch.distributed as dist

    import autopar
    import autopar.checkpoint
    from autopar.report.plan import Plan

    plan = Plan.from_dict(plan_dict)
    data = batches(spec, _batches_needed(loop))
    model = build(spec, seed=0)
    cm = autopar.compile(model, plan.device_mesh(), data[0], plan=plan)
    if loop.pretrained:
        missing = cm.load_state_dict(build(spec, seed=1).state_dict(), strict=True)
        assert not getattr(missing, "missing_keys", None) and not getattr(missing, "unexpected_keys", None), missing
    if spec.dropout:
        cm.eval()
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)

    def resume(cm, opt):
        if not loop.checkpoint:
            return cm, opt
        autopar.checkpoint.save(path, cm, opt, step=0)
        other = Plan.from_dict(other_dict)
        cm2 = autopar.compile(build(spec, seed=2), other.device_mesh(), data[0], plan=other)
        if spec.dropout:
            cm2.eval()
        opt2 = cm2.build_optimizer(torch.optim.AdamW, **OPTIM)
        autopar.checkpoint.load(path, cm2, opt2)
        return cm2, opt2

    holder = {}

    def after_first_step(cm_, opt_):
        holder["cm"], opt2 = resume(cm_, opt_)
        return holder["cm"], opt2

    backward, clip_fn, no_sync, evaluate = _handles(cm)
    if spec.dropout:   # (evaluate puts the model back in train mode; dropout stays off here)
        def evaluate(ids, labels, cm=cm):
            with torch.no_grad():
                return holder.get("cm", cm)(ids, labels).item()
    out = train(cm, loop, data, opt, clip_fn=clip_fn, no_sync=no_sync, backward=backward, evaluate=evaluate,
                after_first_step=after_first_step)
    final = holder.get("cm", cm)
    params = final.full_state_dict()
    return {**out, "params": params} if dist.get_rank() == 0 else None


def compare(got: dict, want: dict, rtol: float = 1e-4, atol: float = 1e-5) -> list:
    """What differs between a compiled run and the reference (empty: nothing)."""
    problems = []
    for key in ("losses", "norms", "evals"):
        if len(got[key]) != len(want[key]):
            problems.append(f"{key}: {len(got[key])} values against {len(want[key])}")
            continue
        for k, (a, b) in enumerate(zip(got[key], want[key])):
            if not abs(a - b) <= atol + rtol * abs(b):
                problems.append(f"{key}[{k}]: {a!r} against {b!r}")
    if sorted(got["params"]) != sorted(want["params"]):
        problems.append(f"state keys differ: {sorted(set(got['params']) ^ set(want['params']))}")
    for name in sorted(set(got["params"]) & set(want["params"])):
        a, b = got["params"][name].float(), want["params"][name].float()
        if a.shape != b.shape:
            problems.append(f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}")
        elif not torch.allclose(a, b, rtol=rtol, atol=atol):
            problems.append(f"{name}: differs by {float((a - b).abs().max()):.3g}")
    return problems
