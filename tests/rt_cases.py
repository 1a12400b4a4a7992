"""Jobs the multi-rank tests send to the worker pool: build a model, compile it with a
plan, train a few AdamW steps and compare with the same model trained on one device."""
from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch

import autopar
from autopar.report.plan import Plan

RTOL, ATOL = 1e-5, 1e-6
# Adam divides by sqrt(v) + eps, so rounding noise in a gradient that is (nearly) zero in
# exact arithmetic (attention key biases, whose gradient cancels) becomes an update of up
# to lr whose sign is the noise's.  eps 1e-6 (not 1e-8) damps such noise, and lr 1e-4 keeps
# what is left below atol, while every real update (~lr = 1e-4 per step) stays 100x above
# it: a missing or doubled update is still caught.
OPTIM = dict(lr=1e-4, eps=1e-6)
EPS = torch.finfo(torch.float32).eps
MODELS_ZERO = {"gpt-tiny": ("autopar", "gpt-tiny", ()), "llama-tiny": ("autopar", "llama-tiny", ())}


def build_case(spec: tuple):
    """spec -> (model, args, kwargs), the same on every call (seed 0)."""
    kind = spec[0]
    if kind == "frozen":  # ("frozen", spec, name prefixes): the model of `spec` with those parameters frozen
        model, args, kwargs = build_case(spec[1])
        for name, p in model.named_parameters():
            if name.startswith(tuple(spec[2])):
                p.requires_grad_(False)
        return model, args, kwargs
    if kind == "bn":  # ("bn",): a Linear-BatchNorm-Linear net (tests/sem_cases.BNNet) on one batch
        from sem_cases import bn_case
        model, x = bn_case()
        return model, (x,), {}
    if kind == "checkpointed":  # ("checkpointed", spec): each of its blocks under reentrant checkpointing
        import functools

        from torch.utils.checkpoint import checkpoint
        model, args, kwargs = build_case(spec[1])
        for name, module in model.named_modules():
            if name.count(".") == 1 and name.split(".")[1].isdigit():
                module.forward = functools.partial(checkpoint, module.forward, use_reentrant=True)
        return model, args, kwargs
    torch.manual_seed(0)
    if kind == "hf-deepseek":  # ("hf-deepseek"[, layers]): DeepSeek-V3's latent attention, grouped router, shared expert
        import transformers as tf
        cfg = tf.DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                  num_hidden_layers=spec[1] if len(spec) > 1 else 2, num_attention_heads=8, num_key_value_heads=8,
                                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=32,
                                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                  first_k_dense_replace=1, n_group=2, topk_group=1, use_cache=False,
                                  max_position_embeddings=64)
        model = tf.DeepseekV3ForCausalLM(cfg)
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        return model, (), {"input_ids": ids, "labels": ids}
    if kind == "hf-switch":  # ("hf-switch",): Switch Transformers (top-1 router with a capacity) behind a wrapper
        import transformers as tf
        from user_models import Seq2SeqLoss
        cfg = tf.SwitchTransformersConfig(vocab_size=128, d_model=64, d_kv=8, d_ff=128, num_layers=2,
                                          num_decoder_layers=2, num_heads=8, num_experts=4, expert_capacity=5,
                                          num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                          dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0,
                                          pad_token_id=0)
        torch.manual_seed(1)   # (an init whose routers reach every expert in all three steps: see test_capacity_experts)
        model = Seq2SeqLoss(tf.SwitchTransformersForConditionalGeneration(cfg))
        g = torch.Generator().manual_seed(1)
        return model, (torch.randint(1, 128, (4, 16), generator=g), torch.randint(1, 128, (4, 16), generator=g)), {}
    if kind == "hf-wrapped":  # ("hf-wrapped",): hf-llama behind a loss wrapper taking (ids, labels)
        from user_models import LabelsLoss
        model, _, kwargs = build_case(("hf-llama",))
        return LabelsLoss(model), (kwargs["input_ids"], kwargs["labels"]), {}
    if kind == "user":  # ("user", "nano" | "titan"): attention as users write it (tests/user_models.py)
        from user_models import SmallLM
        model = SmallLM(spec[1])
        g = torch.Generator().manual_seed(1)
        return model, (torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)), {}
    if kind == "autopar":
        from autopar.models import build
        model, example = build(spec[1], **dict(spec[2]))
        return model, tuple(example), {}
    if kind == "hf-arch":  # ("hf-arch", family[, layers]): tests/hf_archs.py
        from hf_archs import LAYERS, build
        model, kwargs = build(spec[1], layers=spec[2] if len(spec) > 2 else LAYERS)
        return model, (), kwargs
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    if kind == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    elif kind == "hf-llama":   # ("hf-llama"[, layers])
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=spec[1] if len(spec) > 1 else 2,
                          num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        model = LlamaForCausalLM(cfg)
    elif kind == "hf-dropout":  # ("hf-dropout", family): a small model of that family with dropout 0.1 everywhere
        import transformers as tf
        family = spec[1]
        common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, use_cache=False)
        if family == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                                     use_cache=False, resid_pdrop=0.1, embd_pdrop=0.1,
                                                     attn_pdrop=0.1))
        elif family == "bert":
            model = tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=128,
                                                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
        elif family == "llama":
            model = tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, attention_dropout=0.1, **common))
        elif family == "qwen2":
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(num_key_value_heads=2, attention_dropout=0.1, **common))
        else:
            raise ValueError(family)
    else:
        raise ValueError(kind)
    return model, (), {"input_ids": ids, "labels": ids}


def _loss(out):
    from autopar.runtime.runner import loss_of
    return loss_of(out)


_REFERENCE: dict = {}


OPTIMIZERS = {"adamw": (torch.optim.AdamW, OPTIM), "adafactor": (torch.optim.Adafactor, dict(lr=1e-3)),
              "sgd": (torch.optim.SGD, dict(lr=0.1))}


def reference(spec: tuple, steps: int, clip: float | None = None, optim: str = "adamw"):
    """Single-device run: loss and gradients at every step, parameters at the end; with
    `clip`, gradients clipped to that norm before each step (their norms are in "norms")."""
    key = (spec, steps, clip, optim)
    if key not in _REFERENCE:
        model, args, kwargs = build_case(spec)
        cls, options = OPTIMIZERS[optim]
        opt = cls(model.parameters(), **options)
        losses, grads, norms = [], [], []
        for _ in range(steps):
            loss = _loss(model(*args, **kwargs))
            loss.backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
        _REFERENCE[key] = (losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, norms)
    return _REFERENCE[key]


def excess(a: torch.Tensor, b: torch.Tensor, band: float = 0.0) -> float:
    """How far `a` is outside the tolerance band around `b` (<= 0: inside): atol + rtol |b|,
    widened by `band` (see reduction_band and update_band)."""
    return float(((a - b).abs() - (ATOL + RTOL * b.abs() + band)).max())


def reduction_size(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """How many terms the longest reduction behind a gradient adds: every token of the batch
    (a weight's gradient sums over them) times the widest dimension of any weight (the
    contraction inside each term)."""
    tokens = max([t.numel() if not t.is_floating_point() else math.prod(t.shape[:-1])
                  for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)] or [1])
    width = max([max(p.shape) for p in model.parameters() if p.dim()] or [1])
    return tokens * width


def reduction_band(b: torch.Tensor, reduced: int) -> float:
    """The float32 round-off allowed in a gradient of `reduced` summed terms: a layout splits
    the sums over ranks and adds the parts in another order, and n reordered roundings move
    a sum by about sqrt(n) eps of its terms' size (a random walk; the worst case n eps never
    occurs in practice), bounded here by the tensor's largest entry.  At the families'
    64 tokens x 128 wide that is 90 eps of max |grad|; measured (2026-12-06, Falcon, Gemma-2
    and Qwen2 under megatron-tp and the solver's (2, 2) plan): at most 37."""
    return math.sqrt(reduced) * EPS * float(b.abs().max()) if b.numel() else 0.0


def update_band(steps: int, optim: str) -> float:
    """The round-off allowed in a parameter after `steps` AdamW steps: Adam normalises each
    update to about lr whatever the gradient's size, so gradients within their band move it by
    a small part of lr; 1 % of lr a step, while a missing, doubled or stale update moves it by
    lr (100x more).  SGD's and Adafactor's updates scale with the gradient: no band."""
    return steps * OPTIMIZERS[optim][1]["lr"] / 100 if optim == "adamw" else 0.0


def train_and_compare(spec: tuple, plan_dict: dict, steps: int = 3, clip: float | None = None,
                      optim: str = "adamw", backend: str = "eager") -> dict:
    """Train `steps` AdamW steps under the plan and on one device; the worst differences.
    clip: both clip gradients to that norm (cm.clip_grad_norm_ against torch's); the
    gradients compared are the clipped ones, the norms in "norms" (compiled, one device).
    backend: compile's (under "inductor", "regions" counts the compiled regions and
    "failed" those that ran eagerly)."""
    plan = Plan.from_dict(plan_dict)
    losses, grads, params, norms = reference(spec, steps, clip, optim)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                         run=autopar.RunOptions(backend=backend))
    cls, options = OPTIMIZERS[optim]
    opt = cm.build_optimizer(cls, **options)
    worst = {"loss": 0.0, "grad": (-1.0, ""), "param": (-1.0, ""), "optimizer": type(opt).__name__}
    worst["norms"] = []
    reduced = reduction_size(model, args, kwargs)
    for step in range(steps):
        loss = cm.train_step(*args, **kwargs)
        if clip is not None:
            worst["norms"].append((float(cm.clip_grad_norm_(clip)), norms[step]))
        worst["loss"] = max(worst["loss"], abs(loss.item() - losses[step]) - (ATOL + RTOL * abs(losses[step])))
        for name, g in cm.full_grads().items():
            e = excess(g, grads[step][name], reduction_band(grads[step][name], reduced))
            if e > worst["grad"][0]:
                worst["grad"] = (e, f"step {step} {name}")
        opt.step()
        opt.zero_grad()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    worst["frozen_moved"] = 0.0  # frozen weights must come back bit-identical
    full = cm.full_state_dict()
    for name in params:
        p = full[name]
        e = excess(p, params[name], update_band(steps, optim))
        if e > worst["param"][0]:
            worst["param"] = (e, name)
        if name in frozen:
            worst["frozen_moved"] = max(worst["frozen_moved"], float((p - params[name]).abs().max()))
    worst["optimized"] = sum(len(g["params"]) for g in opt.param_groups)
    worst["grads_of_frozen"] = sorted(frozen & set(cm.full_grads()))
    worst["ok"] = (worst["loss"] <= 0 and worst["grad"][0] <= 0 and worst["param"][0] <= 0
                   and worst["frozen_moved"] == 0.0 and not worst["grads_of_frozen"])
    worst["all_to_all_moves"] = all_to_all_moves(cm.graphs(), plan.mesh.shape)
    worst["folded_linears"] = folded_linears(cm.graphs())
    worst["synced_by_buckets"] = len(cm.grad_sync.params)
    worst["reduced_during_backward"] = cm.grad_sync.hooked
    regions = cm.runner.regions() if hasattr(cm.runner, "regions") else []
    worst["regions"], worst["failed"] = len(regions), sum(r.failed for r in regions)
    worst["compiled_moves"] = sum(r.moves for r in regions if not r.failed)
    worst["layer_regions"] = sum(bool(r.inside) for r in regions if not r.failed)   # (inside recomputed layers)
    worst["checkpointed_layers"] = sum(r.checkpointed for r in regions if not r.failed)   # (a whole layer each)
    passes = [m.weight_passes for m in getattr(cm.runner, "stage_modules", []) if m.weight_passes is not None]
    # (split-backward schedules under Inductor: W passes deferred and run, backwards outside the stage's dropped)
    worst["weight_passes"] = tuple(sum(getattr(p, k) for p in passes) for k in ("deferred", "ran", "dropped"))
    return worst


def folded_linears(graphs) -> tuple:
    """(moves folded with their linear readers, linears folded with the move of their
    output) in the compiled graphs and the recomputed regions inside them
    (passes/fold_linears.py)."""
    import torch.fx as fx
    from autopar.passes.fold_linears import ABSORBS, linear_then_reduce
    nodes = [n for g in graphs for m in g.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
             if n.op == "call_function" and n.meta.get(ABSORBS)]   # (a kept call's target is wrapped)
    return (sum(n.target is not linear_then_reduce for n in nodes), sum(n.target is linear_then_reduce for n in nodes))


def all_to_all_moves(graphs, sizes: tuple) -> int:
    """How many moves of the compiled graphs (on a mesh of axis `sizes`) run an all-to-all,
    forward or backward."""
    from autopar.passes.collectives import Move
    from autopar.passes.redistribute import plan_redistribute
    moves = {id(m): m for gm in graphs for m in vars(gm).values() if isinstance(m, Move)}
    return sum(any(s.kind == "all_to_all" for s in plan_redistribute(m.src, m.dst, sizes)
                   + plan_redistribute(m.grad_src, m.grad_dst, sizes)) for m in moves.values())


def torch_clip_over_parameters(spec: tuple, plan_dict: dict) -> dict:
    """torch.nn.utils.clip_grad_norm_(cm.parameters(), 0.5) after one train_step: its norm,
    or the error it raised; then one AdamW step and the next loss against one device."""
    plan = Plan.from_dict(plan_dict)
    losses, _, _, norms = reference(spec, 2, 0.5)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    cls, options = OPTIMIZERS["adamw"]
    opt = cm.build_optimizer(cls, **options)
    out = {"one_device": norms[0]}
    cm.train_step(*args, **kwargs)
    try:
        out["norm"] = float(torch.nn.utils.clip_grad_norm_(cm.parameters(), 0.5))
    except Exception as e:  # noqa: BLE001 (the error is the result)
        out["error"] = f"{type(e).__name__}: {e}"
        cm.clip_grad_norm_(0.5)
    opt.step()
    opt.zero_grad()
    out["loss_excess"] = abs(cm.train_step(*args, **kwargs).item() - losses[1]) - (ATOL + RTOL * abs(losses[1]))
    return out


def _moves_run(gm) -> list:
    """(Move, the moved tensor's name, the first node reading the moved tensor) of every move
    the graph runs: its `move` nodes and the moves folded with linears
    (passes/fold_linears.py: an input's move inside linears_then_gradient, a row-parallel
    output's inside linear_then_reduce)."""
    from autopar.passes.collectives import move
    from autopar.passes.fold_linears import linear_then_reduce, linears_then_gradient
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is move:
            out.append((getattr(gm, node.args[1].target), node.args[0].name, next(iter(node.users))))
        elif node.target is linears_then_gradient:   # (x, spec, groups, ...): read by the call itself
            out.append((getattr(gm, node.args[1].target), node.args[0].name, node))
        elif node.target is linear_then_reduce:      # (h, w, b, spec, groups): the linear's output moved
            out.append((getattr(gm, node.args[3].target), node.name, next(iter(node.users))))
    return out


def forward_collectives(spec: tuple, plan_dict: dict) -> list:
    """(kind, mesh axis, module of the reading op) of every forward collective the compiled
    graph runs in its moves (folded ones included)."""
    from autopar.trace.paths import module_path
    from autopar.passes.redistribute import plan_redistribute
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.mesh, args, example_kwargs=kwargs or None, plan=plan)
    sizes = tuple(plan.mesh.shape)
    found = []
    for m, _, reader in _moves_run(cm.graph_module):
        where = module_path(reader) if reader.op == "call_function" else "output"
        found.extend((s.kind, s.axes if s.span else s.axis, where)
                     for s in plan_redistribute(m.src, m.dst, sizes) if s.is_collective)
    return found


def collective_moves_per_tensor(spec: tuple, plan_dict: dict) -> dict:
    """tensor name -> how many moves of the compiled graph (folded ones included) run a
    forward collective on it."""
    from autopar.passes.redistribute import plan_redistribute
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.mesh, args, example_kwargs=kwargs or None, plan=plan)
    out: dict = {}
    for m, tensor, _ in _moves_run(cm.graph_module):
        if any(s.is_collective for s in plan_redistribute(m.src, m.dst, tuple(plan.mesh.shape))):
            out[tensor] = out.get(tensor, 0) + 1
    return out


def compile_error(kind: str) -> str:
    """Compile something that must fail fast; return the error message (or '' if none)."""
    import torch.distributed as dist
    from autopar.models import build
    from autopar.runtime.compiled import CompileError
    torch.manual_seed(0)
    model, example = build("gpt-tiny")
    if kind == "world":
        mesh = autopar.Mesh((2,), ("dp",), device="cpu")
        plan = None
    else:
        mesh = autopar.Mesh((4,), ("dp",), device="cpu")
        layout = "data-parallel" if dist.get_rank() == 0 else "megatron-tp"
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout))
    try:
        autopar.compile(model, mesh, example, plan=plan)
    except CompileError as exc:
        return str(exc)
    return ""


def meta_init_matches_whole(name: str, plan_dict: dict, overrides: tuple = ()) -> float:
    """Largest difference between a meta model initialised shard by shard under a plan and
    the same model built whole on CPU from the same seed."""
    from autopar.models import build
    plan = Plan.from_dict(plan_dict)
    torch.manual_seed(0)
    whole, example = build(name, **dict(overrides))
    meta, _ = build(name, device="meta", **dict(overrides))
    cm = autopar.compile(meta, plan.mesh, example, plan=plan, seed=0)
    full = cm.full_state_dict()
    return max(float((full[n] - p.detach()).abs().max()) for n, p in whole.named_parameters())


def local_inputs_match_global(plan_dict: dict) -> tuple:
    """Loss of one step with global inputs and with each rank's own shards."""
    from autopar.models import build
    plan = Plan.from_dict(plan_dict)
    mesh = plan.mesh
    torch.manual_seed(0)
    model, example = build("gpt-tiny")
    a = autopar.compile(copy.deepcopy(model), mesh, example, plan=plan)
    b = autopar.compile(copy.deepcopy(model), mesh, example, plan=plan, run=autopar.RunOptions(local_inputs=True))
    local = b.shard_inputs(*example)[0]
    return a.train_step(*example).item(), b.train_step(*local).item(), [tuple(t.shape) for t in local]


def state_dict_round_trip(plan_dict: dict) -> float:
    """Load a whole state dict into the shards and read it back whole."""
    from autopar.models import build
    plan = Plan.from_dict(plan_dict)
    torch.manual_seed(0)
    model, example = build("gpt-tiny")
    cm = autopar.compile(model, plan.mesh, example, plan=plan)
    torch.manual_seed(5)
    new = {n: torch.randn_like(p) for n, p in cm.full_state_dict().items()}
    cm.load_full_state_dict(new)
    back = cm.full_state_dict()
    assert set(back) == set(new) == set(model.state_dict())  # tied aliases and buffers included
    tied = {n: name for n, name in cm.aliases.items()}  # an alias takes its owner's value
    return max(float((back[n] - new[tied.get(n, n)]).abs().max()) for n in new)


def accumulate_vs_whole_batch(plan_dict: dict, micro: int = 4, priced: bool = False) -> dict:
    """Gradients of `micro` micro-batches accumulated under no_sync versus one step on the
    whole batch (the loss is a mean, so each micro-batch's loss is divided by `micro`).
    priced: the micro-steps' plan made with autopar.plan(accumulation=micro)."""
    from autopar.models import build
    plan = Plan.from_dict(plan_dict)
    mesh = plan.mesh
    torch.manual_seed(0)
    model, (idx, targets) = build("gpt-tiny", batch=16)
    whole = autopar.compile(copy.deepcopy(model), mesh, (idx, targets), plan=plan)
    whole.train_step(idx, targets)
    torch.manual_seed(0)
    model_small, small = build("gpt-tiny", batch=16 // micro)
    micro_plan = autopar.plan(model_small, mesh, small,
                              solve=autopar.SolveOptions(compare=False, layout=plan.origin.split(":", 1)[1]),
                              pricing=autopar.Pricing(accumulation=micro if priced else 1))
    acc = autopar.compile(copy.deepcopy(model), mesh, small, plan=micro_plan)
    chunks = list(zip(idx.chunk(micro), targets.chunk(micro)))
    for i, (x, y) in enumerate(chunks):
        if i < micro - 1:
            with acc.no_sync():
                acc.backward(acc(x, y) / micro)
        else:
            acc.backward(acc(x, y) / micro)
    a, b = whole.full_grads(), acc.full_grads()
    return {"worst": max(excess(b[n], a[n]) for n in a), "bucketed": len(acc.grad_sync.params),
            "accumulation": micro_plan.accumulation}


def memory_after_step(plan_dict: dict, spec=("autopar", "gpt-tiny", (("hidden", 128),))) -> dict:
    plan = Plan.from_dict(plan_dict)
    model, example, _ = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), example, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)
    cm.train_step(*example)
    opt.step()
    return cm.memory_report()


def mixed_precision_vs_reference(spec: tuple, plan_dict: dict, steps: int = 3) -> dict:
    """A plan made with MixedPrecision(bfloat16, float32) against one device under the same
    policy: the model cast to bfloat16 computes, AdamW updates float32 master weights that
    are copied back after every step.  Returns the worst relative loss difference and the
    worst master-weight difference."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    compute = copy.deepcopy(model).to(torch.bfloat16)
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(masters.values(), **OPTIM)
    losses = []
    for _ in range(steps):
        loss = _loss(compute(*args, **kwargs))
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for n, p in compute.named_parameters():
                masters[n].grad = p.grad.float()
            opt.step()
            opt.zero_grad()
            for n, p in compute.named_parameters():
                p.copy_(masters[n])
                p.grad = None
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    copt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    worst_loss = 0.0
    for step in range(steps):
        loss = cm.train_step(*args, **kwargs)
        worst_loss = max(worst_loss, abs(loss.item() - losses[step]) / abs(losses[step]))
        copt.step()
        copt.zero_grad()
    got = cm.full_state_dict(master=True)
    # Adam turns bf16 rounding noise in near-zero gradients into sign flips of whole
    # updates, so compare the runs by the norm of their difference against the norm of the
    # change the steps made, over all master weights
    diff = math.sqrt(sum(float((got[n] - masters[n].detach()).pow(2).sum()) for n in masters))
    moved = math.sqrt(sum(float((masters[n].detach() - p.detach()).pow(2).sum()) for n, p in model.named_parameters()))
    worst_param = diff / moved
    dtypes = {str(p.dtype) for p in cm.shards.values()}
    return {"loss": worst_loss, "param": worst_param, "moved": moved, "dtypes": sorted(dtypes),
            "memory": cm.memory_report()}


def check_mixed_precision(result: dict) -> None:
    """The assertions on a mixed_precision_vs_reference result."""
    assert result["dtypes"] == ["torch.bfloat16"]
    assert result["loss"] < 2e-2, result     # a few bf16 roundings (2^-8 each) of the loss
    assert result["moved"] > 1e-3             # the steps changed the weights (norm) ...
    assert result["param"] < 0.1, result      # ... and the two runs alike (relative norm)


def zero3_regather_counts(plan_dict: dict, reshard: bool, spec: tuple = ("autopar", "gpt-tiny", ()),
                          bucket_mb: float = 25.0) -> dict:
    """One training step of a ZeRO-3 plan: how many weights were gathered in forward,
    prefetched, and gathered again in backward, the grouped buckets' sizes and collective
    calls; and whether the gradients match one device."""
    plan = Plan.from_dict(plan_dict)
    model, args, _ = build_case(spec)
    _, grads, _, _ = reference(spec, 1)
    cm = autopar.compile(model, plan.device_mesh(), args, plan=plan,
                         run=autopar.RunOptions(reshard_after_forward=reshard, bucket_mb=bucket_mb))
    cm.train_step(*args)
    worst = max(excess(g, grads[0][n]) for n, g in cm.full_grads().items())
    counts = cm.gather_counts()
    regather = getattr(cm.runner, "regather", None)   # (a pipelined runner has one per stage)
    buckets = [len(b) for b in regather.buckets or []] if regather is not None else []
    regions = cm.runner.regions() if hasattr(cm.runner, "regions") else []   # (backend "inductor")
    return dict(counts, gathers=counts["sites"], worst=worst, buckets=buckets, regions=len(regions))


def scheduler_on_sharded_optimizer(plan_dict: dict) -> dict:
    """A torch LR scheduler drives the optimizer build_optimizer returns under ZeRO."""
    plan = Plan.from_dict(plan_dict)
    model, args, _ = build_case(("autopar", "gpt-tiny", ()))
    cm = autopar.compile(model, plan.mesh, args, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):
        cm.train_step(*args)
        opt.step()
        opt.zero_grad()
        sched.step()
    return {"lr": opt.param_groups[0]["lr"], "is_optimizer": isinstance(opt, torch.optim.Optimizer),
            "states": len(opt.state_dict()["state"])}


def bad_inputs(spec: tuple, plan_dict: dict, case: str) -> str:
    """Compile, then feed inputs broken as `case` says; the error this rank raised ('' if none)."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    rank = torch.distributed.get_rank()
    ids, rest = args[0], args[1:]
    if case == "per-rank batch":           # the DDP habit: each rank its own batch
        ids = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(10 + rank))
    elif case == "shape":                   # a batch other than the compiled one
        ids = ids[:2]
    elif case == "shape on one rank":
        ids = ids[:2] if rank == 3 else ids
    elif case == "token out of range":
        ids = ids.clone()
        ids[0, 0] = 1000
    elif case == "nan on one rank":         # a float input (the mlp's x) poisoned on rank 1
        ids = ids.clone()
        if rank == 1:
            ids[0, 0] = float("nan")
    try:
        cm.train_step(ids, *rest)
    except Exception as exc:  # noqa: BLE001 (the test reads the message)
        return f"{type(exc).__name__}: {exc}"
    return ""


def uneven_batches(spec: tuple, plan_dict: dict) -> dict:
    """Rank 3 has 2 batches, the others 3, inside cm.join(): what each rank saw."""
    from autopar.runtime.compiled import UnevenInputs
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    n = 2 if torch.distributed.get_rank() == 3 else 3
    done, error = 0, ""
    try:
        with cm.join():
            for _ in range(n):
                cm.train_step(*args, **kwargs)
                opt.step()
                opt.zero_grad()
                done += 1
    except UnevenInputs as exc:
        error = str(exc)
    # the job goes on afterwards: one more step together (nobody is stuck in a collective)
    after = cm.train_step(*args, **kwargs).item()
    return {"steps": done, "error": error, "after": after}


def compile_other_size(spec_planned: tuple, plan_dict: dict, spec_model: tuple) -> str:
    """Compile the model of `spec_model` with a plan made for `spec_planned`; the error."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec_model)
    try:
        autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return ""


def checkpoint_round_trip(spec: tuple, plan_dict: dict, other_dict: dict, path: str) -> dict:
    """Train one step under `plan_dict`, save cm.state_dict() with torch.distributed.checkpoint,
    load it into the same model compiled under `other_dict` (another layout) and under the
    same plan again; full state dicts compared with what was saved, and with the plain
    model's keys."""
    import torch.distributed.checkpoint as dcp
    plan, other = Plan.from_dict(plan_dict), Plan.from_dict(other_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.SGD, lr=0.1)
    cm.train_step(*args, **kwargs)
    opt.step()
    saved = cm.full_state_dict()
    dcp.save(cm.state_dict(), checkpoint_id=path)
    out = {"keys_equal_plain": sorted(saved) == sorted(model.state_dict()), "worst": 0.0}
    for target in (other, plan):
        fresh, _, _ = build_case(spec)
        cm2 = autopar.compile(fresh, target.device_mesh(), args, example_kwargs=kwargs or None, plan=target)
        state = cm2.state_dict()
        dcp.load(state, checkpoint_id=path)
        cm2.load_state_dict(state)
        back = cm2.full_state_dict()
        out["worst"] = max([out["worst"]] + [float((back[n].float() - saved[n].float()).abs().max()) for n in saved])
    fresh, _, _ = build_case(spec)
    fresh.load_state_dict(saved, strict=True)  # the whole state dict fits the plain model
    return out


def resume_across_layouts(spec: tuple, plan_dict: dict, other_dict: dict, path: str, steps: int = 3) -> dict:
    """One AdamW step under `plan_dict`, model and optimizer saved with
    torch.distributed.checkpoint, loaded under `other_dict`, the remaining steps there;
    the worst difference from `steps` uninterrupted steps on one device."""
    import torch.distributed.checkpoint as dcp
    plan, other = Plan.from_dict(plan_dict), Plan.from_dict(other_dict)
    losses, _, params, _ = reference(spec, steps)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    seen = [cm.train_step(*args, **kwargs).item()]
    opt.step()
    opt.zero_grad()
    dcp.save({"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt)}, checkpoint_id=path)
    fresh, _, _ = build_case(spec)
    cm2 = autopar.compile(fresh, other.device_mesh(), args, example_kwargs=kwargs or None, plan=other)
    opt2 = cm2.build_optimizer(torch.optim.AdamW, **OPTIM)
    state = {"model": cm2.state_dict(), "optim": cm2.optimizer_state_dict(opt2)}
    dcp.load(state, checkpoint_id=path)
    cm2.load_state_dict(state["model"])
    cm2.load_optimizer_state_dict(opt2, state["optim"])
    for _ in range(steps - 1):
        seen.append(cm2.train_step(*args, **kwargs).item())
        opt2.step()
        opt2.zero_grad()
    full = cm2.full_state_dict()
    return {"param": max(excess(full[n], params[n]) for n in params),
            "loss": max(abs(a - b) - (ATOL + RTOL * abs(b)) for a, b in zip(seen, losses))}


@functools.lru_cache(maxsize=None)
def plan_for(spec: tuple, layout: str | None, shape=(2, 2), names=("dp", "tp"), pipeline=None,
             mixed_precision=None) -> dict:
    """The plan (as a dict) of the model of `spec` on a cpu mesh: the solver's (layout None)
    or a hand-written layout's, optionally with pipeline stages or mixed precision; cached
    per test session."""
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, names, device="cpu")
    return autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                        solve=autopar.SolveOptions(compare=False, layout=layout), pipeline=pipeline or False,
                        mixed_precision=mixed_precision).to_dict()


def eval_train_eval(spec: tuple, plan_dict: dict, backend: str = "eager") -> dict:
    """eval() forward against the plain model's in eval mode (dropout off); then train() and
    a training step (dropout on; no optimizer step, so the weights stay); then eval() again:
    its forward against the same plain one.  The worst difference, and the compiled regions."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    plain = copy.deepcopy(model).eval()
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                         run=autopar.RunOptions(backend=backend))
    with torch.no_grad():
        want = float(_loss(plain(*args, **kwargs)))
    worst = 0.0
    for _ in range(2):
        cm.eval()
        with torch.no_grad():
            worst = max(worst, abs(float(_loss(cm(*args, **kwargs))) - want))
        cm.train()
        trained = float(cm.train_step(*args, **kwargs))
        cm.zero_grad()
    regions = cm.runner.regions() if hasattr(cm.runner, "regions") else []
    return {"eval": worst, "eval_loss": want, "train_loss": trained, "regions": len(regions),
            "failed": sum(r.failed for r in regions)}


def compile_error_of(spec: tuple, plan_dict: dict, backend: str) -> str:
    """What autopar.compile raises for this plan and backend ("" if it compiles)."""
    from autopar.runtime.process import CompileError
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    try:
        autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                        run=autopar.RunOptions(backend=backend))
    except CompileError as exc:
        return str(exc)
    return ""


def backend_chosen(spec: tuple, plan_dict: dict) -> str:
    """The backend autopar.compile runs when given none (its "auto")."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    return autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan).backend


def optimizer_fused(spec: tuple, plan_dict: dict, backend: str, asks: list) -> list:
    """For each (optimizer class name, build_optimizer's keyword arguments) in `asks`, the
    `fused` default of the optimizer cm.build_optimizer builds under `backend` ("absent"
    where the class has no such option)."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                         run=autopar.RunOptions(backend=backend))
    return [cm.build_optimizer(getattr(torch.optim, name), lr=1e-3, **options).optimizer.defaults.get("fused", "absent")
            for name, options in asks]


def under_backend(backend: str, job, *args):
    """Run `job(*args)` with autopar.compile defaulting to `backend`: the runtime's jobs
    above, unchanged, under another backend."""
    original = autopar.compile

    def compile_with(*a, run=None, **kw):
        run = run or autopar.RunOptions()
        return original(*a, run=dataclasses.replace(run, backend=backend) if run.backend == "auto" else run, **kw)
    return _run_with(autopar, "compile", compile_with, job, *args)


def _run_with(owner, name: str, value, job, *args):
    """`job(*args)` with owner.name set to value, and put back after."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        return job(*args)
    finally:
        setattr(owner, name, original)


def first_step_losses(spec: tuple, plan_dict: dict) -> dict:
    """The compiled model's first two training losses (an SGD step between) and the plain
    model's, for models that draw random numbers while training (their draws differ)."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    plain = copy.deepcopy(model)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt, ref_opt = cm.build_optimizer(torch.optim.SGD, lr=0.1), torch.optim.SGD(plain.parameters(), lr=0.1)
    got, want = [], []
    for _ in range(2):
        got.append(float(cm.train_step(*args, **kwargs)))
        opt.step()
        opt.zero_grad()
        loss = _loss(plain(*args, **kwargs))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(loss))
    return {"compiled": got, "plain": want}


def stale_reference(spec: tuple, steps: int):
    """One device under PipeDream-2BW's rule, W(t+1) = W(t) - lr grad f(W(t-1)): step k's
    gradient is taken at the weights of its forward and applied after step k+1's forward
    (the first update applies nothing; a last update applies the last step's).  Losses,
    the gradient each update applies, and the final weights."""
    model, args, kwargs = build_case(spec)
    cls, options = OPTIMIZERS["adamw"]
    opt = cls(model.parameters(), **options)
    losses, applied, pending = [], [], None
    for _ in range(steps + 1):
        if len(losses) < steps:
            loss = _loss(model(*args, **kwargs))
            loss.backward()
            losses.append(loss.item())
            fresh = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.zero_grad()
        else:
            fresh = None
        if pending is not None:
            for n, p in model.named_parameters():
                p.grad = pending.get(n)
            applied.append(pending)
            opt.step()
            opt.zero_grad()
        pending = fresh
    return losses, applied, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_stale_and_compare(spec: tuple, plan_dict: dict, steps: int = 3) -> dict:
    """`steps` train_steps of a pipedream-2bw plan with an AdamW step after each, then
    cm.drain() and a last AdamW step, against stale_reference: losses, the
    gradients each update applies (.grad is None after the first train_step) and the final
    weights; also how far the final weights are from plain synchronous training."""
    plan = Plan.from_dict(plan_dict)
    losses, applied, params = stale_reference(spec, steps)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    cls, options = OPTIMIZERS["adamw"]
    opt = cm.build_optimizer(cls, **options)
    worst = {"loss": 0.0, "grad": (-1.0, ""), "param": (-1.0, ""), "first_grads": None}
    updates = []
    for step in range(steps + 1):
        if step < steps:
            loss = cm.train_step(*args, **kwargs)
            worst["loss"] = max(worst["loss"], abs(loss.item() - losses[step]) - (ATOL + RTOL * abs(losses[step])))
        else:
            cm.drain()
        if step == 0:
            worst["first_grads"] = sum(p.grad is not None for p in cm.parameters())
        else:
            updates.append(cm.full_grads())
        opt.step()
        opt.zero_grad()
    reduced = reduction_size(model, args, kwargs)
    for k, (got, want) in enumerate(zip(updates, applied)):
        for name, g in want.items():
            e = excess(got[name], g, reduction_band(g, reduced))
            if e > worst["grad"][0]:
                worst["grad"] = (e, f"update {k + 1} {name}")
    full = cm.full_state_dict()
    for name in params:
        e = excess(full[name], params[name], update_band(steps, "adamw"))
        if e > worst["param"][0]:
            worst["param"] = (e, name)
    synchronous = reference(spec, steps)[2]
    worst["from_synchronous"] = max(float((full[n] - synchronous[n]).abs().max()) for n in params)
    worst["updates"] = len(updates)
    worst["ok"] = (worst["loss"] <= 0 and worst["grad"][0] <= 0 and worst["param"][0] <= 0
                   and worst["first_grads"] == 0 and len(updates) == len(applied) == steps)
    return worst


def stale_checkpoint(spec: tuple, plan_dict: dict, path: str) -> dict:
    """Two steps of a pipedream-2bw plan, a save refused while backwards are pending, then
    cm.drain(), the optimizer step and a save that works and loads back."""
    import autopar.checkpoint
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(*OPTIMIZERS["adamw"][:1], **OPTIMIZERS["adamw"][1])
    out = {}
    for _ in range(2):
        cm.train_step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
    try:
        autopar.checkpoint.save(path, cm, opt, step=2)
        out["refused"] = None
    except autopar.checkpoint.CheckpointError as exc:
        out["refused"] = str(exc)
    cm.drain()
    opt.step()
    opt.zero_grad()
    autopar.checkpoint.save(path, cm, opt, step=2)
    before = {k: v.clone() for k, v in cm.full_state_dict().items()}
    info = autopar.checkpoint.load(path, cm, opt)
    after = cm.full_state_dict()
    out["step"] = info["step"]
    out["same"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def with_layer_cuts(job, *args):
    """Run `job(*args)` with the Inductor backend's regions cut at every layer, as on CUDA
    (runtime/regions/inductor.LAYER_CUTS)."""
    import autopar.runtime.regions.inductor as inductor
    return _run_with(inductor, "LAYER_CUTS", True, job, *args)


def buckets_before_first_layer(spec: tuple, plan_dict: dict) -> dict:
    """One step under backend "inductor" (its regions cut at every layer: run it
    with_layer_cuts), gradient buckets of about one gradient each: the compiled regions,
    and how many gradient all-reduces had been launched when backward reached the first
    layer (its region's output gradient) and by the step's end."""
    import torch.distributed as dist
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    launched, at_first = [0], []
    original = dist.all_reduce

    def counting(*a, **kw):
        launched[0] += bool(kw.get("async_op"))
        return original(*a, **kw)
    try:
        cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                             run=autopar.RunOptions(backend="inductor", bucket_mb=0.02))
        cm.train_step(*args, **kwargs)   # (compiles the regions)
        regions = cm.runner.regions()
        first = regions[1]   # (in graph order: the embedding's, then the first layer's)
        forward = first.forward

        def hooked(*a):
            out = forward(*a)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: at_first.append(launched[0]))
            return out
        first.forward = hooked
        dist.all_reduce = counting
        cm.train_step(*args, **kwargs)
    finally:
        dist.all_reduce = original
    return {"regions": len(regions), "first": first.label, "at_first_layer": at_first[:1], "launched": launched[0]}
