"""Attention as users write it (tests/user_models.py): nanoGPT's `.contiguous().view` after
attention and torchtitan's complex rotary embeddings train like one device under every
sequence and tensor layout and the solver's own plan, attention written with einsum under
Megatron and the solver's plan, with no op left replicated; and
torchtitan's Llama-3-8B plans like autopar.models' own."""
import warnings

import pytest

import autopar
from autopar.models import build
from rt_cases import plan_for, train_and_compare
from user_models import titan_llama

LAYOUTS = ["ulysses x dp", "context-parallel x dp", "megatron-tp x dp", None]
CASES = [(kind, layout) for kind in ("nano", "titan") for layout in LAYOUTS] + [
    ("einsum", "megatron-tp x dp"), ("einsum", None)]   # (no fused attention: nothing to split by sequence)


@pytest.mark.parametrize("kind, layout", CASES)
def test_user_attention_trains_like_one_device(pool4, kind, layout):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # "no sharding rule for ...": nothing replicated
        plan_dict = plan_for(("user", kind), layout)
    plan = autopar.Plan.from_dict(plan_dict)
    if kind == "titan" and layout is not None:   # the rotation stays split like its q and k (heads, or sequence)
        rotated = [n for n in plan.nodes if n.op in ("aten.view_as_complex", "aten.view_as_real")]
        assert rotated and all(any(s is not None for s in n.split) for n in rotated), rotated
    if kind == "einsum" and layout is not None:   # Megatron splits both einsums by heads
        products = [n for n in plan.nodes if n.op == "aten.einsum"]
        assert len(products) == 4 and all(n.split[1] == "h" for n in products), [n.split for n in products]
    result = pool4.run(train_and_compare, ("user", kind), plan_dict)[0]
    assert result["ok"], result


def test_titan_llama_plans_like_autopars_llama():
    """Llama-3-8B on 8 x 8 H100, 64 sequences of 2,048 tokens: torchtitan's attention (complex
    rotary embeddings, repeated key/value heads) against autopar.models' (real rotations,
    enable_gqa).  Same step within 2 %; memory within 3 % (its rotation keeps float32 copies
    of q and k)."""
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    plans = {}
    for name in ("autopar", "titan"):
        model, example = build("llama3-8b", device="meta", batch=64)
        if name == "titan":
            model = titan_llama(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            plans[name] = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                                       mixed_precision="bf16")
    ours, theirs = plans["autopar"], plans["titan"]
    assert theirs.step_s == pytest.approx(ours.step_s, rel=0.02)
    assert theirs.memory_per_device == pytest.approx(ours.memory_per_device, rel=0.03)
    assert theirs.memory_per_device >= ours.memory_per_device


def test_a_hugging_face_model_behind_a_loss_wrapper_takes_ring_attention(pool2):
    """hf-llama called as `model(input_ids=x, labels=y).loss` inside a module taking (x, y):
    no mask is passed, so the trace keeps attention causal (not a dense mask) and the ring
    splits it by sequence; it trains like one device."""
    spec = ("hf-wrapped",)
    plan_dict = plan_for(spec, "context-parallel", shape=(2,), names=("cp",))
    plan = autopar.Plan.from_dict(plan_dict)
    attention = [n for n in plan.nodes if n.op == "aten.scaled_dot_product_attention"]
    assert attention and all(n.split[0] == "ring" for n in attention), [n.split for n in attention]
    result = pool2.run(train_and_compare, spec, plan_dict)[0]
    assert result["ok"], result


@pytest.mark.parametrize("layout, shape, names", [(None, (2, 2), ("dp", "tp")), ("megatron-tp", (4,), ("tp",))])
def test_deepseek_v3_latent_attention_and_grouped_router(pool4, layout, shape, names):
    """Hugging Face's DeepSeek-V3 (multi-head latent attention, whose keys are assembled by
    writing into slices of a new tensor; a group-limited router, whose mask is built by
    scatter_): the writes are traced as slice_scatter and scatter (autopar/trace/functional.py),
    so nothing runs replicated, and it trains like one device."""
    spec = ("hf-deepseek",)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan_dict = plan_for(spec, layout, shape=shape, names=names)
    plan = autopar.Plan.from_dict(plan_dict)
    ops = {n.op for n in plan.nodes}
    assert {"aten.slice_scatter", "aten.scatter"} <= ops and not {"aten.copy_", "aten.scatter_"} & ops
    result = pool4.run(train_and_compare, spec, plan_dict)[0]
    assert result["ok"], result
