"""Fused projections (autopar/trace/fused.py): a weight whose output the model splits is planned
as one matmul per part, each part its own parameter placeholder, so Megatron's layout
shards q, k and v (or gate and up) separately; the user still sees the model's own
weights whole (initialisation, full_state_dict, load_state_dict, checkpoints)."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.trace.fused import Parts
from autopar.trace.export import trace

transformers = pytest.importorskip("transformers")

from hf_archs import HIDDEN, build  # noqa: E402
from rt_cases import checkpoint_round_trip, meta_init_matches_whole, plan_for, resume_across_layouts  # noqa: E402

TP4 = autopar.Mesh((4,), ("tp",), device="cpu")
KV = HIDDEN // 2  # 4 key/value heads of head_dim 8


def _parts(family: str) -> Parts:
    model, kwargs = build(family)
    return trace(model, (), kwargs).parts


@pytest.mark.parametrize("family,weight,bounds", [
    ("gpt2", "transformer.h.0.attn.c_attn.weight", [":, 0:64", ":, 64:128", ":, 128:192"]),   # split, Conv1D
    ("gpt2", "transformer.h.0.attn.c_attn.bias", ["0:64", "64:128", "128:192"]),
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight", [f"0:{HIDDEN}", f"{HIDDEN}:{HIDDEN + KV}",
                                                         f"{HIDDEN + KV}:{HIDDEN + 2 * KV}"]),  # GQA slices
    ("phi3", "model.layers.0.mlp.gate_up_proj.weight", ["0:128", "128:256"]),                 # chunk
    ("gpt_bigcode", "transformer.h.0.attn.c_attn.weight", ["0:64", "64:72", "72:80"]),        # multi-query
    ("falcon", "transformer.h.0.self_attention.query_key_value.weight", ["0:64", "64:72", "72:80"]),  # by head
    ("gpt_fused", "blocks.0.attn.qkv.weight", ["0:64", "64:128", "128:192"]),
])
def test_fused_weight_is_planned_as_its_parts(family, weight, bounds):
    parts = _parts(family)
    assert parts.names(weight) == [f"{weight}[{b}]" for b in bounds]


def test_parts_cut_and_join_back_exactly():
    model, _ = build("phi3")
    parts = _parts("phi3")
    whole = dict(model.named_parameters())
    cut = parts.split(whole)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert name not in cut and [tuple(cut[n].shape) for n in parts.names(name)] == [(64, 64), (32, 64), (32, 64)]
    back = parts.join(cut)
    assert set(back) == set(whole) and all(torch.equal(back[n], whole[n]) for n in whole)
    del cut[parts.names(name)[1]]  # a weight missing a part is not made up
    assert name not in parts.join(cut)


class _ReadWhole(nn.Module):
    """A fused output also read whole: the split is not exact, the weight stays one."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        y = self.proj(x)
        a, b = y.chunk(2, dim=-1)
        return (a * b).sum() + y.sum()


class _Overlap(nn.Module):
    """Slices that overlap are not parts."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x):
        y = self.proj(x)
        return (y[..., :10] * y[..., 6:]).sum()


@pytest.mark.parametrize("cls", [_ReadWhole, _Overlap])
def test_inexact_splits_keep_the_weight_whole(cls):
    traced = trace(cls(), (torch.randn(4, 8),))
    assert not traced.parts and set(traced.params.values()) == {"proj.weight", "proj.bias"}


@pytest.mark.parametrize("family", ["gpt2", "phi3", "gpt_bigcode"])
def test_megatron_shards_every_part_with_heads_to_split(family):
    """Column-parallel q, k, v (and gate, up) parts; a multi-query key/value head (fewer
    heads than ranks) stays whole on every rank, as Megatron-LM keeps it."""
    model, kwargs = build(family)
    plan = autopar.plan(model, TP4, example_kwargs=kwargs,
                        solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))
    fused = {n: p for n, p in plan.param_placements.items() if "[" in n and n.endswith("]") and ".0." in n}
    assert fused
    for name, (p,) in fused.items():
        rows = name.rsplit("[", 1)[1].rstrip("]").split(":")
        width = int(rows[-1]) - int(rows[-2].lstrip(", "))
        if family == "gpt_bigcode" and width == HIDDEN // 8:
            assert p == Replicate(), name  # the one key or value head
        elif ".bias[" in name and plan.param_placements.get(name.replace(".bias[", ".weight[")) == (Shard(1),):
            # a row-parallel part (8 query heads do not split over 4 ranks by heads): its bias is
            # added after the sum, whole (Megatron's form) or split and gathered: equal cost
            assert p in (Replicate(), Shard(0)), name
        else:
            assert isinstance(p, Shard), name


@pytest.mark.parametrize("overrides", [(("fused_qkv", True),)])
def test_fused_weights_initialise_shard_by_shard(pool4, overrides):
    """A meta model with a fused projection, initialised part by part under Megatron's
    layout, equals the model built whole from the same seed."""
    from autopar.models import build as build_preset
    model, example = build_preset("gpt-tiny", **dict(overrides))
    plan = autopar.plan(model, TP4, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))
    assert any("attn.qkv.weight[" in n for n in plan.param_placements)
    assert pool4.run(meta_init_matches_whole, "gpt-tiny", plan.to_dict(), overrides) == [0.0] * 4


def test_fused_checkpoints_move_between_layouts(pool4, tmp_path):
    """state_dict() saves the parts as DTensors under Megatron's layout; loaded under
    data-parallel (2, 2) they give back the saved weights; full_state_dict has the plain
    model's keys (the fused weights whole)."""
    spec = ("hf-arch", "gpt2")
    megatron = plan_for(spec, "megatron-tp", (4,), ("tp",))
    other = plan_for(spec, "zero3")
    r = pool4.run(checkpoint_round_trip, spec, megatron, other, str(tmp_path / "ckpt"))[0]
    assert r["keys_equal_plain"] and r["worst"] == 0.0, r


def test_fused_training_resumes_under_another_layout(pool4, tmp_path):
    """One AdamW step of Phi-3 under Megatron (parts sharded), model and optimizer saved,
    two more under ZeRO-3 on (2, 2): equal to three steps on one device."""
    spec = ("hf-arch", "phi3")
    r = pool4.run(resume_across_layouts, spec, plan_for(spec, "megatron-tp", (4,), ("tp",)),
                  plan_for(spec, "zero3"), str(tmp_path / "ckpt"))[0]
    assert r["param"] <= 0 and r["loss"] <= 0, r
