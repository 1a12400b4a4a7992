"""Numerics are the contract: a compiled model on 4 gloo ranks trains exactly like the
plain model on one device, for the solver's plan, the hand-written layouts and random
valid plans, on meshes (4,), (2, 2), (1, 4) and (4, 1)."""
from __future__ import annotations

import functools

import pytest
from torch.distributed.tensor import Shard

import autopar
from rt_cases import (build_case, compile_error, forward_collectives, local_inputs_match_global,
                      meta_init_matches_whole, state_dict_round_trip, train_and_compare,
                      accumulate_vs_whole_batch, memory_after_step)

MODELS = {
    "mlp": ("autopar", "mlp", (("hidden", 32), ("batch", 16))),
    "gpt-tiny": ("autopar", "gpt-tiny", ()),
    "llama-tiny": ("autopar", "llama-tiny", ()),
    "hf-gpt2": ("hf-gpt2",),
    "hf-llama": ("hf-llama",),
}
MESHES = {(4,): ("tp",), (2, 2): ("dp", "tp"), (1, 4): ("dp", "tp"), (4, 1): ("dp", "tp")}
RANDOM_PER_MESH = 6  # 24 random plans per model over the four meshes, 120 in all


@functools.lru_cache(maxsize=None)
def plans_for(model_key: str, shape: tuple) -> dict:
    """label -> plan dict: the solver's, each hand-written layout, and random ones."""
    spec = MODELS[model_key]
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, MESHES[shape], device="cpu")
    out = {"ilp": autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                               solve=autopar.SolveOptions(compare=False))}
    for layout in autopar.solve.layouts.layouts(mesh):
        if layout.startswith(autopar.solve.layouts.SEQUENCE_LAYOUTS):
            continue  # tests/test_sequence_parallel.py trains those on these models
        out[layout] = autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                                   solve=autopar.SolveOptions(compare=False, layout=layout))
    seeds = range(RANDOM_PER_MESH * len(MESHES))[list(MESHES).index(shape)::len(MESHES)]
    for p in autopar.random_plans(model, mesh, args, example_kwargs=kwargs or None, seeds=seeds):
        out[p.origin] = p
    return {k: p.to_dict() for k, p in out.items()}


CASES = [(m, s) for m in MODELS for s in MESHES]


@pytest.mark.parametrize("model_key,shape", CASES, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in CASES])
def test_training_matches_one_device(pool4, model_key, shape, record_property):
    failures, random_plans, with_all_to_all = [], 0, 0
    for label, plan in plans_for(model_key, shape).items():
        result = pool4.run(train_and_compare, MODELS[model_key], plan)[0]
        if not result["ok"]:
            failures.append(f"{label}: loss {result['loss']:.2e} grad {result['grad']} param {result['param']}")
        if label.startswith("random:"):
            random_plans += 1
            with_all_to_all += result["all_to_all_moves"] > 0
    # how often the random plans exercise the all-to-all (a shard moving to another dim)
    record_property("random_plans_with_all_to_all", f"{with_all_to_all}/{random_plans}")
    print(f"{model_key} on {shape}: {with_all_to_all} of {random_plans} random plans run an all-to-all")
    assert not failures, "\n".join(failures)


def test_data_parallel_gradients_go_through_buckets(pool4):
    plan = plans_for("gpt-tiny", (4,))["data-parallel"]
    result = pool4.run(train_and_compare, MODELS["gpt-tiny"], plan)[0]
    assert result["ok"]
    n_params = len(plan["param_placements"])
    # every parameter is all-reduced by the bucketed, overlapped gradient sync rather than
    # inside autograd (the tied embedding/head too: autograd adds its two gradients before
    # the hook fires), the position embedding too: its lookup sees no batch and runs whole,
    # and the gradient reaching it stays Partial until its bucket (as DDP reduces it)
    assert result["synced_by_buckets"] == n_params


def test_megatron_gpt_has_two_forward_all_reduces_per_block(pool4):
    """L blocks of Megatron on a 1-D mesh: two forward all-reduces in every block (of the
    attention and MLP row-parallel outputs; with dropout 0 the Partial sum passes the
    dropout and the residual add and is reduced once where the residual stream is read
    next), one more where the first block reads the vocabulary-parallel embedding's sum
    (the word embedding, tied to the head, is split by vocabulary as Megatron-LM splits
    it), and one all-gather of the vocabulary-split logits for the loss (at this size the
    cost model prefers it to the vocabulary-parallel loss's three all-reduces); no other
    forward collective."""
    layers = 3
    spec = ("autopar", "gpt-tiny", (("n_layers", layers), ("hidden", 128)))
    model, args, _ = build_case(spec)
    mesh = autopar.Mesh(4, "tp", device="h100")
    plan = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))
    assert plan.param_placements["wte.weight"] == (Shard(0),)
    found = pool4.run(forward_collectives, spec, plan.to_dict())[0]
    assert [k for k, _, _ in found] == ["all_reduce"] * (2 * layers + 1) + ["all_gather"], found
    in_blocks = [(kind, where) for kind, _, where in found if where.startswith("blocks.")]
    for i in range(layers):  # one after attention, one after the MLP, in every block
        mine = [w for _, w in in_blocks if w == f"blocks.{i}" or w.startswith(f"blocks.{i}.")]
        assert len(mine) == 2 + (i == 0), in_blocks
    assert found[-1][2] == "", found   # the loss, outside every module


def test_wrong_world_size_fails_fast(pool4):
    messages = pool4.run(compile_error, "world")
    assert all("needs 2 ranks but the process group has 4" in m for m in messages), messages


def test_ranks_with_different_plans_fail_fast(pool4):
    messages = pool4.run(compile_error, "plans")
    assert all("ranks hold different plans" in m for m in messages), messages


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_meta_model_initialised_shard_by_shard_equals_whole(pool4, name):
    """Each rank materialises one module at a time and keeps only its shards, yet the
    values are those of the whole model built from the same seed, bit for bit."""
    from autopar.models import build
    model, example = build(name, device="meta")
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plan = autopar.plan(model, mesh, example,
                        solve=autopar.SolveOptions(compare=False, layout="megatron-tp (all axes)"))
    assert any(any(p.is_shard() for p in pl) for pl in plan.param_placements.values())
    assert pool4.run(meta_init_matches_whole, name, plan.to_dict()) == [0.0] * 4


def test_inputs_already_local_to_each_rank(pool4):
    model, example, _ = build_case(MODELS["gpt-tiny"])
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    results = pool4.run(local_inputs_match_global, plan.to_dict())
    for global_loss, local_loss, shapes in results:
        assert local_loss == pytest.approx(global_loss, rel=1e-6)
        assert shapes[0] == (1, 16)  # token ids: batch 4 split over both axes
    assert len({tuple(r[2]) for r in results}) == 1


def test_full_state_dict_round_trip(pool4):
    model, example, _ = build_case(MODELS["gpt-tiny"])
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100")
    plan = autopar.plan(model, mesh, example,
                        solve=autopar.SolveOptions(compare=False, layout="megatron-tp (all axes)"))
    assert pool4.run(state_dict_round_trip, plan.to_dict()) == [0.0] * 4


def test_gradient_accumulation_equals_one_large_batch(pool4):
    model, example, _ = build_case(("autopar", "gpt-tiny", (("batch", 16),)))
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    result = pool4.run(accumulate_vs_whole_batch, plan.to_dict())[0]
    assert result["bucketed"] > 0  # the micro-steps really skipped the gradient all-reduce
    assert result["worst"] <= 0, result


@pytest.mark.parametrize("layout", ["data-parallel", "zero3", "megatron-tp"])
def test_model_state_bytes_held_equal_the_plan(pool4, layout):
    """Parameters, gradients and Adam's per-element states that each rank really holds
    equal the plan's memory model, byte for byte."""
    model, example, _ = build_case(("autopar", "gpt-tiny", (("hidden", 128),)))
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout))
    for report in pool4.run(memory_after_step, plan.to_dict()):
        measured, predicted = report["measured"], report["predicted"]
        for kind in ("params", "grads", "optimizer"):
            assert measured[kind] == predicted[kind], (kind, measured, predicted)


@pytest.mark.parametrize("model_key", ["gpt-tiny", "llama-tiny"])
def test_training_matches_one_device_on_two_ranks(pool2, model_key):
    spec = MODELS[model_key]
    model, args, _ = build_case(spec)
    mesh = autopar.Mesh((2,), ("tp",), device="cpu")
    plans = [autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout=layout))
             for layout in ("data-parallel", "megatron-tp", "zero3")]
    plans += autopar.random_plans(model, mesh, args, seeds=range(100, 104))
    failures = []
    for plan in plans:
        result = pool2.run(train_and_compare, spec, plan.to_dict())[0]
        if not result["ok"]:
            failures.append(f"{plan.origin}: {result}")
    assert not failures, "\n".join(failures)
