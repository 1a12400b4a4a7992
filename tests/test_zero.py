"""ZeRO-1/2/3, mixed precision and gradient accumulation on 4 gloo ranks: the model states
each rank holds equal the memory model byte for byte, and training equals one device."""
from __future__ import annotations

import pytest

from rt_cases import (
    MODELS_ZERO,
    accumulate_vs_whole_batch,
    build_case,
    check_mixed_precision,
    memory_after_step,
    mixed_precision_vs_reference,
    scheduler_on_sharded_optimizer,
    train_and_compare,
    zero3_regather_counts,
)

import autopar
from autopar.cost.memory import state_bytes_per_param

GPT = ("autopar", "gpt-tiny", (("hidden", 128),))
LAYOUT_OF_STAGE = {0: "data-parallel", 1: "zero1", 2: "zero2", 3: "zero3"}


def _plan(spec, shape, names, layout, **kw):
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, names, device="cpu")
    return autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                        solve=autopar.SolveOptions(compare=False, layout=layout), **kw)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
def test_model_state_bytes_per_rank_equal_the_memory_model(pool4, stage, mixed):
    """After optimizer.step(): parameters, gradients and optimizer states (Adam's moments,
    plus float32 master weights under mixed precision) held by every rank equal the plan's
    prediction exactly, and equal the ZeRO formula (2 + 2 + 12 bytes per parameter split as
    the stage says) with n = 4 (the model's sizes divide by 4)."""
    precision = autopar.MixedPrecision() if mixed else None
    plan = _plan(GPT, (4,), ("dp",), LAYOUT_OF_STAGE[stage], mixed_precision=precision)
    model, _, _ = build_case(GPT)
    n_params = sum(p.numel() for p in model.parameters())
    weight, grad, opt = (2, 2, 12) if mixed else (4, 4, 8)
    expected = n_params * state_bytes_per_param(4, stage, weight, grad, opt)
    for rank, report in enumerate(pool4.run(memory_after_step, plan.to_dict(), GPT)):
        measured, predicted = report["measured"], report["predicted"]
        for kind in ("params", "grads", "optimizer"):
            assert measured[kind] == predicted[kind], (rank, kind, measured, predicted)
        assert measured["params"] + measured["grads"] + measured["optimizer"] == expected, (rank, measured)


@pytest.mark.parametrize("spec_key", ["gpt-tiny", "llama-tiny"])
def test_each_stage_alone_and_with_tensor_parallelism_trains_like_one_device(pool4, spec_key):
    spec = MODELS_ZERO[spec_key]
    plans = [_plan(spec, (4,), ("dp",), LAYOUT_OF_STAGE[s]) for s in (1, 2, 3)]
    plans += [_plan(spec, (2, 2), ("dp", "tp"), f"megatron-tp x zero{s}") for s in (1, 2, 3)]
    failures = []
    for plan in plans:
        result = pool4.run(train_and_compare, spec, plan.to_dict())[0]
        if not result["ok"]:
            failures.append(f"{plan.origin} on {plan.mesh.shape}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("layout", ["data-parallel", "zero2", "megatron-tp x zero2"])
def test_mixed_precision_equals_one_device_under_the_same_policy(pool4, layout):
    spec = MODELS_ZERO["gpt-tiny"]
    shape, names = ((2, 2), ("dp", "tp")) if "megatron" in layout else ((4,), ("dp",))
    plan = _plan(spec, shape, names, layout, mixed_precision=autopar.MixedPrecision())
    result = pool4.run(mixed_precision_vs_reference, spec, plan.to_dict())[0]
    check_mixed_precision(result)


@pytest.mark.parametrize("layout", ["zero1", "zero2"])
def test_gradient_accumulation_under_zero_equals_the_whole_batch(pool4, layout):
    model, example, _ = build_case(("autopar", "gpt-tiny", (("batch", 16),)))
    mesh = autopar.Mesh((4,), ("dp",), device="h100")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout))
    result = pool4.run(accumulate_vs_whole_batch, plan.to_dict())[0]
    assert result["bucketed"] > 0
    assert result["worst"] <= 0, result


def test_random_plans_include_zero_states_and_train_like_one_device(pool4):
    """Random valid plans draw ZeRO-1/2 and offload for some parameters too."""
    spec = MODELS_ZERO["gpt-tiny"]
    model, args, _ = build_case(spec)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    plans = autopar.random_plans(model, mesh, args, seeds=range(7, 10))
    stages = {s.stage for p in plans for s in p.param_states.values()}
    assert stages >= {1, 2}
    assert any(s.offload for p in plans for s in p.param_states.values())
    for plan in plans:
        result = pool4.run(train_and_compare, spec, plan.to_dict())[0]
        assert result["ok"], (plan.origin, result)


@pytest.mark.parametrize("bucket_mb", [25.0, 0.02])
def test_zero3_recomputed_layers_gather_again_by_bucket(pool4, bucket_mb):
    """ZeRO-3 under full recomputation: backward's recomputation of a layer gathers the
    layer's weights again a bucket at a time (the weights of the bucket that recomputed
    layers gathered in forward, in one flat call, the next earlier bucket started while
    this one recomputes), not in one blocking call per weight; gradients equal one device."""
    plan = _plan(("autopar", "gpt-tiny", ()), (4,), ("dp",), "zero3", recompute="full")
    counts = pool4.run(zero3_regather_counts, plan.to_dict(), True, bucket_mb=bucket_mb)[0]
    again, calls = counts["recompute_gathered"], counts["recompute_buckets"]
    assert counts["gathered"] == counts["gathers"] + again and again > 0, counts
    assert 1 <= calls <= len(counts["buckets"]), counts
    if bucket_mb == 25.0:
        assert calls <= 2 < again, counts   # (many weights a call)
    else:
        assert 2 < calls <= again, counts   # (a bucket per weight, or per weight and bias)
    assert counts["worst"] <= 0, counts


@pytest.mark.parametrize("reshard,bucket_mb", [(True, 25.0), (False, 25.0), (True, 0.02)])
def test_zero3_gathers_in_buckets_prefetches_and_regathers(pool4, reshard, bucket_mb):
    """ZeRO-3: every weight is gathered once in forward, in buckets of consecutive weights
    (one flat all-gather each; a bucket after the first is prefetched while the one before
    computes); with reshard_after_forward the weights backward needs are gathered again, one
    call per bucket, each after the first started while the bucket after it (in forward
    order) computes its backward, without it never; the gradients are reduce-scattered one call per
    bucket (more when backward returns to a bucket); gradients equal one device."""
    plan = _plan(("autopar", "gpt-tiny", ()), (4,), ("dp",), "zero3")
    counts = pool4.run(zero3_regather_counts, plan.to_dict(), reshard, bucket_mb=bucket_mb)[0]
    buckets = counts["buckets"]
    assert counts["gathered"] == counts["gathers"] > 0, counts
    assert sum(buckets) >= counts["gathers"] - 2, counts   # (a tied head's gather stays alone)
    assert counts["prefetched"] >= sum(buckets[1:]), counts
    assert (len(buckets) <= 2) == (bucket_mb == 25.0), counts
    forward_calls = len(buckets)
    if reshard:
        assert counts["regathered"] >= counts["gathers"] // 2, counts
        assert forward_calls < counts["bucket_gathers"] <= 2 * forward_calls, counts
        # every backward gather after the first was started ahead, while the bucket before computed
        assert counts["regather_prefetched"] == counts["bucket_gathers"] - forward_calls - 1, counts
    else:
        assert counts["regathered"] == counts["regather_prefetched"] == 0
        assert counts["bucket_gathers"] == forward_calls, counts
    assert len(buckets) <= counts["bucket_reduces"] <= 2 * len(buckets), counts
    assert counts["worst"] <= 0, counts


def test_lr_schedulers_drive_the_sharded_optimizer(pool4):
    plan = _plan(("autopar", "gpt-tiny", ()), (4,), ("dp",), "zero2")
    for result in pool4.run(scheduler_on_sharded_optimizer, plan.to_dict()):
        assert result["is_optimizer"]
        assert result["lr"] == pytest.approx(1e-3 * 0.5**3)
        assert result["states"] == len(plan.param_placements)  # one Adam state per owned chunk
