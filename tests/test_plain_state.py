"""The compiled model speaks the plain model's state dict: a pretrained model's
`state_dict()` loads into it under every layout (fused projections, tied weights, ZeRO-3,
pipeline stages, mixed precision), and its checkpoints load into the plain model through
torch.distributed.checkpoint, with or without a process group, and through
autopar.checkpoint.to_state_dict / export."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rt_cases import ATOL, OPTIM, RTOL, _loss, build_case, plan_for

import autopar
import autopar.checkpoint
from autopar.report.plan import Plan

DP4 = ((4,), ("dp",))
TP = ((2, 2), ("dp", "tp"))
PIPE = autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2)
GPT2, PHI3, BIGCODE = ("hf-arch", "gpt2"), ("hf-arch", "phi3"), ("hf-arch", "gpt_bigcode")
GPT_FUSED = ("autopar", "gpt-tiny", (("n_layers", 2), ("fused_qkv", True)))   # tied head and fused qkv


def pretrained(spec: tuple) -> torch.nn.Module:
    """The model of `spec` with every parameter redrawn from seed 1 (around its seed-0 value,
    at its scale): a "pretrained" copy none of whose values the compiled copy starts with."""
    model, _, _ = build_case(spec)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # a tied weight once: the tie is kept
            p.mul_(1 + 0.5 * torch.randn(p.shape, generator=g)).add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def _compiled(spec: tuple, plan_dict: dict):
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    return cm, args, kwargs


def _differ(a: dict, b: dict) -> list:
    """Names whose tensors are not bit-identical (or missing from `a`)."""
    return [n for n in b if n not in a or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


def test_a_fused_weight_is_placed_off_the_dim_that_joins_its_parts():
    """GPT-2's c_attn weight [64, 192] joins q, k and v along dim 1.  Megatron splits each
    part's columns on tp: the whole splits its rows there instead (the larger other dim).
    ZeRO-3's rows on dp stay; parts that disagree (a whole key head beside split queries)
    split the rows too; a bias has no other dim and is replicated where its parts split."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.state.plain_state import placements_off_dim
    R, S0, S1 = Replicate(), Shard(0), Shard(1)
    assert placements_off_dim([(R, S1)] * 3, 1, (64, 192)) == (R, S0)
    assert placements_off_dim([(S0, S1)] * 3, 1, (64, 192)) == (S0, S0)
    assert placements_off_dim([(S0,)] * 3, 1, (64, 192)) == (S0,)
    assert placements_off_dim([(R, S1), (R, R), (R, R)], 1, (64, 80)) == (R, S0)
    assert placements_off_dim([(R, S0)] * 3, 0, (192,)) == (R, R)
    assert placements_off_dim([(S1, R)] * 2, 2, (4, 64, 256)) == (S1, R)   # stacked experts' gate_up, split by hidden
    assert placements_off_dim([(R, S0), (R, S0)], 0, (256, 64)) == (R, S1)  # Phi-3's gate_up rows on tp


def fine_tune(spec: tuple, plan_dict: dict) -> dict:
    """Compile `spec`'s model under the plan, load the pretrained copy's state_dict() with
    strict=True: the keys it reports, what full_state_dict() and state_dict() (DTensors
    gathered) hold against the pretrained values, and the first step's loss against the
    pretrained model's on one device."""
    cm, args, kwargs = _compiled(spec, plan_dict)
    pre = pretrained(spec)
    ref = pre.state_dict()
    result = cm.load_state_dict(ref, strict=True)
    master = bool(cm.masters)   # mixed precision: the float32 masters are the loaded values
    sharded = {n: (v.full_tensor() if hasattr(v, "full_tensor") else v) for n, v in cm.state_dict().items()}
    out = {"reported": (list(result.missing_keys), list(result.unexpected_keys)),
           "full_differs": _differ(cm.full_state_dict(master=master), ref),
           "sharded_differs": _differ(sharded, {n: ref[n] for n in sharded}),
           "sharded_keys": sorted(sharded), "plain_keys": sorted(ref)}
    loss = cm.train_step(*args, **kwargs).item()
    with torch.no_grad():
        one = _loss(pre(*args, **kwargs)).item()
    out["loss"], out["one_device"] = loss, one
    return out


@pytest.mark.parametrize("spec,layout,mesh,extra", [
    (GPT2, "data-parallel", DP4, {}),
    (GPT2, "megatron-tp x dp", TP, {}),
    (GPT2, "zero3", DP4, {}),
    (GPT2, "megatron-tp x zero3", TP, {}),
    (GPT2, None, TP, {}),                                              # the solver's plan
    (GPT2, "data-parallel", ((2, 2), ("pp", "dp")), {"pipeline": PIPE}),
    (GPT2, "megatron-tp x zero2", TP, {"mixed_precision": "bf16"}),
    (PHI3, "megatron-tp x dp", TP, {}),                               # fused qkv and gate_up
    (PHI3, "zero3", DP4, {}),
    (BIGCODE, "megatron-tp x dp", TP, {}),                            # a whole key/value head beside split queries
], ids=["gpt2-dp", "gpt2-tp", "gpt2-zero3", "gpt2-tp-zero3", "gpt2-solver", "gpt2-pipeline", "gpt2-bf16",
        "phi3-tp", "phi3-zero3", "bigcode-tp"])
def test_a_pretrained_state_dict_loads_under_every_layout(pool4, spec, layout, mesh, extra):
    """cm.load_state_dict(pretrained.state_dict()) with strict=True: nothing reported, every
    entry of the plain state dict (fused weights whole, the tied head, float32 masters under
    bf16) comes back bit for bit from full_state_dict() and from state_dict()'s DTensors,
    whose keys are the plain model's (a pipelined rank's: its stages'), and the first step's
    loss is the pretrained model's on one device."""
    results = pool4.run(fine_tune, spec, plan_for(spec, layout, *mesh, **extra))
    bf16 = extra.get("mixed_precision") == "bf16"
    for r in results:
        assert r["reported"] == ([], []), r["reported"]
        assert r["full_differs"] == [] and r["sharded_differs"] == [], r
        tolerance = 2e-2 if bf16 else ATOL + RTOL * abs(r["one_device"])   # bf16: a few roundings of 2^-8
        assert abs(r["loss"] - r["one_device"]) <= tolerance, r
    plain = results[0]["plain_keys"]
    union = sorted({k for r in results for k in r["sharded_keys"]})
    assert union == plain
    if "pipeline" not in extra:
        assert all(r["sharded_keys"] == plain for r in results)


def wrong_keys(spec: tuple, plan_dict: dict, drop: str) -> dict:
    """The pretrained state dict without `drop` and with an entry the model lacks: the
    error of strict=True; what strict=False returns, next to what the plain model's
    load_state_dict(strict=False) returns; which weights strict=False loaded."""
    cm, _, _ = _compiled(spec, plan_dict)
    before = cm.full_state_dict()
    state = dict(pretrained(spec).state_dict())
    del state[drop]
    state["lm_head.extra_weight"] = torch.zeros(3)
    out = {}
    try:
        cm.load_state_dict(state, strict=True)
        out["error"] = ""
    except KeyError as exc:
        out["error"] = str(exc)
    got = cm.load_state_dict(state, strict=False)
    plain = build_case(spec)[0].load_state_dict(state, strict=False)
    out["compiled"] = (sorted(got.missing_keys), sorted(got.unexpected_keys))
    out["plain"] = (sorted(plain.missing_keys), sorted(plain.unexpected_keys))
    full = cm.full_state_dict()
    out["loaded_differs"] = _differ(full, {n: v for n, v in state.items() if n in full})
    out["dropped_kept"] = bool(torch.equal(full[drop], before[drop]))
    try:
        cm.load_state_dict({**state, drop: before[drop][:, :-8]}, strict=False)
        out["size_error"] = ""
    except RuntimeError as exc:
        out["size_error"] = str(exc)
    return out


def test_a_missing_or_unknown_key_is_named_as_torch_names_it(pool4):
    """A pretrained GPT-2 state dict without one fused c_attn weight and with a key the model
    lacks, under Megatron x data parallel: strict=True raises naming both; strict=False
    reports exactly what the plain model reports, loads every other entry (the rest of each
    fused weight included) and leaves the missing weight as it was.  A fused weight of
    another shape is named with both shapes, as torch names it."""
    drop = "transformer.h.1.attn.c_attn.weight"
    for r in pool4.run(wrong_keys, GPT2, plan_for(GPT2, "megatron-tp x dp", *TP), drop):
        assert drop in r["error"] and "lm_head.extra_weight" in r["error"], r["error"]
        assert r["compiled"] == r["plain"] == ([drop], ["lm_head.extra_weight"]), r
        assert r["loaded_differs"] == [] and r["dropped_kept"], r
        assert f"{drop}: (64, 184) in the state dict, (64, 192) in the model" in r["size_error"], r["size_error"]


def save_for_plain(spec: tuple, plan_dict: dict, path: str) -> dict:
    """One AdamW step under the plan, then the model saved four ways: autopar.checkpoint.save,
    the bare dcp.save({"model": cm.state_dict(), "optim": ...}), dcp.save(cm.state_dict()),
    and as autopar wrote it before (format 1: fused weights as parts, the tied head once).
    On every rank, with the process group, the plain model loads the first through dcp.load;
    the format-1 one loads back into the compiled model after another step moved it.  Rank 0
    returns the saved state."""
    from autopar.runtime.state.plain_state import sharded_state
    cm, args, kwargs = _compiled(spec, plan_dict)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    cm.train_step(*args, **kwargs)
    opt.step()
    opt.zero_grad()
    full = cm.full_state_dict()
    autopar.checkpoint.save(f"{path}/autopar", cm, opt, step=1)
    dcp.save({"model": cm.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{path}/bare")
    dcp.save(cm.state_dict(), checkpoint_id=f"{path}/top")
    old = f"{path}/format1"
    dcp.save({"model": sharded_state(cm.rank_state, fused_whole=False, aliases=False)}, checkpoint_id=old)
    if dist.get_rank() == 0:
        with open(f"{path}/autopar/autopar.json") as f:
            record = json.load(f)
        with open(f"{old}/autopar.json", "w") as f:
            json.dump(dict({k: v for k, v in record.items() if k != "checksums"}, format=1, optimizer=False), f)
    dist.barrier()
    plain = build_case(spec)[0]
    dcp.load({"model": plain.state_dict()}, checkpoint_id=f"{path}/autopar")
    out = {"plain_on_ranks_differs": _differ(plain.state_dict(), full)}
    cm.train_step(*args, **kwargs)
    opt.step()
    moved = _differ(cm.full_state_dict(), full)
    autopar.checkpoint.load(old, cm)
    out.update(moved=bool(moved), format1_differs=_differ(cm.full_state_dict(), full),
               old_keys=sorted(sharded_state(cm.rank_state, fused_whole=False, aliases=False)))
    out["full"] = full if dist.get_rank() == 0 else None
    return out


@pytest.mark.parametrize("layout,mesh,extra", [("megatron-tp x dp", TP, {}), ("zero3", DP4, {}),
                                               ("data-parallel", ((2, 2), ("pp", "dp")), {"pipeline": PIPE})],
                         ids=["tp", "zero3", "pipeline"])
def test_a_checkpoint_loads_into_the_plain_model(pool4, tmp_path, layout, mesh, extra):
    """gpt-tiny with a tied head and fused qkv, one AdamW step on 4 ranks (Megatron x data
    parallel, ZeRO-3, or two pipeline stages that both hold the tied weight), saved: the plain
    model reads the checkpoint through dcp.load on the ranks and in this process (no process
    group), for autopar.checkpoint.save and for the bare dcp.save pattern; to_state_dict (of
    those, and with key=None of dcp.save(cm.state_dict())) and export (torch.save,
    safetensors) give its state_dict(), keys and values; all equal cm.full_state_dict() bit
    for bit.  A checkpoint in autopar's format 1 still loads, and converts."""
    results = pool4.run(save_for_plain, GPT_FUSED, plan_for(GPT_FUSED, layout, *mesh, **extra), str(tmp_path))
    full = results[0]["full"]
    plain_keys = sorted(build_case(GPT_FUSED)[0].state_dict())
    assert sorted(full) == plain_keys and "lm_head.weight" in full and "blocks.0.attn.qkv.weight" in full
    for r in results:
        assert r["plain_on_ranks_differs"] == [] and r["moved"] and r["format1_differs"] == [], r
    assert not dist.is_initialized()
    for kind in ("autopar", "bare"):
        plain = build_case(GPT_FUSED)[0]
        dcp.load({"model": plain.state_dict()}, checkpoint_id=str(tmp_path / kind))
        assert _differ(plain.state_dict(), full) == [], kind
        state = autopar.checkpoint.to_state_dict(tmp_path / kind)
        assert sorted(state) == plain_keys and _differ(state, full) == [], kind
    top = autopar.checkpoint.to_state_dict(tmp_path / "top", key=None)
    assert sorted(top) == plain_keys and _differ(top, full) == []
    pt = autopar.checkpoint.export(tmp_path / "autopar", tmp_path / "model.pt")
    assert _differ(torch.load(pt), full) == []
    safetensors = pytest.importorskip("safetensors.torch")
    st = autopar.checkpoint.export(tmp_path / "autopar", tmp_path / "model.safetensors")
    assert _differ(safetensors.load_file(st), full) == []
    old = autopar.checkpoint.to_state_dict(tmp_path / "format1")   # parts joined, the tied head once
    assert any("[" in k for k in results[0]["old_keys"])
    assert set(plain_keys) - set(old) in ({"wte.weight"}, {"lm_head.weight"})
    assert _differ(old, {n: full[n] for n in old}) == []


def held_copies(spec: tuple, plan_dict: dict) -> dict:
    """full_state_dict() and full_grads() before a step against the same after it: the
    first must not have moved with the live weights."""
    cm, args, kwargs = _compiled(spec, plan_dict)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    cm.train_step(*args, **kwargs)
    held = cm.full_state_dict()
    kept = {n: t.clone() for n, t in held.items()}
    opt.step()
    moved = cm.full_state_dict()
    return {"held_moved": _differ(held, kept), "weights_moved": bool(_differ(moved, kept))}


@pytest.mark.parametrize("layout, mesh", [("data-parallel", ((4,), ("dp",))), ("zero3", ((4,), ("dp",))),
                                          ("megatron-tp x dp", ((2, 2), ("dp", "tp")))])
def test_full_state_dict_is_a_copy_later_steps_leave_alone(pool4, layout, mesh):
    """A state dict taken for evaluation or export keeps its values after the optimizer
    steps (under data parallel it used to be the live weights themselves)."""
    for r in pool4.run(held_copies, GPT_FUSED, plan_for(GPT_FUSED, layout, *mesh)):
        assert r["weights_moved"] and r["held_moved"] == [], r
