"""Pipelined plans run on gloo ranks and train exactly like one device.

Each case plans a tied-embedding model (gpt-tiny or llama-tiny with 4 or 8 layers) with
fixed pipeline constraints, compiles it on every rank of a worker pool, runs 3 AdamW steps
through the plan's torch.distributed.pipelining schedule and compares losses, gradients
(whole, gathered from the device group that holds each weight) and final parameters with
the plain model on one device (rtol 1e-5)."""
from __future__ import annotations

import pytest
from pp_cases import compiled_pipeline_events, pipelined_forward_loss
from rt_cases import (
    build_case,
    check_mixed_precision,
    mixed_precision_vs_reference,
    train_and_compare,
    train_stale_and_compare,
    zero3_regather_counts,
)

import autopar

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev", "chimera"]
TWO_PER_GROUP = ("interleaved-1f1b", "zbv", "dualpipev")   # two stages per device group (zbv, dualpipev: a V)
# name -> (mesh shape, axis names, device groups, intra-stage layout, pool)
LAYOUTS = {
    "2 stages": ((2,), ("pp",), 2, None, "pool2"),
    "4 stages": ((4,), ("pp",), 4, None, "pool4"),
    "2 stages x tp 2": ((2, 2), ("pp", "tp"), 2, "megatron-tp", "pool4"),
    "2 stages x dp 2": ((2, 2), ("pp", "dp"), 2, "data-parallel", "pool4"),
}


def _spec(model: str, layers: int, batch: int | None = None) -> tuple:
    return ("autopar", model, (("n_layers", layers),) + ((("batch", batch),) if batch else ()))


def pipelined_plan(spec, shape, names, groups, schedule, layout=None, microbatches=None, seed=None,
                   mixed_precision=None):
    model, args, kwargs = build_case(spec)
    virtual = 2 if schedule == "interleaved-1f1b" else None
    fixed = autopar.Pipeline(axis=names[0], groups=groups, schedule=schedule, virtual=virtual,
                             microbatches=microbatches, asynchronous=schedule == "pipedream-2bw")
    mesh = autopar.Mesh(shape, names, device="cpu")
    kw = dict(example_kwargs=kwargs or None, solve=autopar.SolveOptions(compare=False, layout=layout), pipeline=fixed,
              mixed_precision=mixed_precision)
    if seed is not None:
        return autopar.random_plans(model, mesh, args, seeds=(seed,), **kw)[0]
    return autopar.plan(model, mesh, args, **kw)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_every_schedule_trains_like_one_device(request, model, layout):
    shape, names, groups, intra, pool_name = LAYOUTS[layout]
    pool = request.getfixturevalue(pool_name)
    failures = []
    for schedule in SCHEDULES:
        # interleaving (and zbv) need two stages per device group: 8 layers for 4 groups
        layers = 8 if schedule in TWO_PER_GROUP and groups == 4 else 4
        # 1F1B-like schedules want at least as many microbatches as groups (the tiny batch has
        # 4 rows); DualPipeV twice as many
        microbatches = (4 if groups == 4 else 2) * (2 if schedule == "dualpipev" else 1)
        dp = 2 if intra == "data-parallel" else 1
        spec = _spec(model, layers, microbatches * dp if microbatches * dp > 4 else None)
        plan = pipelined_plan(spec, shape, names, groups, schedule, intra, microbatches=microbatches)
        pp = plan.pipeline
        assert pp.axis == names[0] and pp.groups == groups and pp.schedule == schedule
        assert len(pp.stages) == groups * (2 if schedule in TWO_PER_GROUP else 1)
        if intra == "megatron-tp":   # the block matrices really are split inside each stage
            assert sum(any(type(p).__name__ == "Shard" for p in pl) for pl in plan.param_placements.values()) >= 8
        results = pool.run(train_and_compare, spec, plan.to_dict())
        if intra == "data-parallel":  # the batch really is split: gradients go through the buckets,
            assert all(r["synced_by_buckets"] > 0 for r in results), results
            if schedule not in ("zero-bubble", "zbv", "dualpipev", "chimera"):  # most while the last backward runs
                assert all(r["reduced_during_backward"] >= r["synced_by_buckets"] // 2 for r in results), results
        bad = [r for r in results if not r["ok"]]
        if bad:
            failures.append(f"{schedule}: {bad[0]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model,schedule,intra", [
    ("gpt-tiny", "1f1b", "megatron-tp x dp"),
    ("gpt-tiny", "interleaved-1f1b", "megatron-tp x zero2"),
])
def test_three_dimensional_layouts_train_like_one_device(pool8, model, schedule, intra):
    """Pipeline x data x tensor parallelism on a (2, 2, 2) mesh: 2 device groups, each a
    2 x 2 sub-mesh running Megatron with data parallelism (or ZeRO-2) inside the stage."""
    spec = ("autopar", model, (("n_layers", 4), ("batch", 8)))
    plan = pipelined_plan(spec, (2, 2, 2), ("pp", "dp", "tp"), 2, schedule, intra, microbatches=2)
    assert plan.mesh.shape == (1, 2, 2)
    results = pool8.run(train_and_compare, spec, plan.to_dict())
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]][:1]
    assert all(r["synced_by_buckets"] > 0 for r in results)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_mixed_precision_pipeline_equals_one_device_under_the_same_policy(pool4, model):
    """bfloat16 stages with float32 master weights (ZeRO-2 inside the stages, gradients
    reduced in float32), 2 stages x dp 2, 1F1B: as one device under the same policy."""
    spec = _spec(model, 4)
    plan = pipelined_plan(spec, (2, 2), ("pp", "dp"), 2, "1f1b", "zero2", microbatches=2,
                          mixed_precision=autopar.MixedPrecision())
    assert plan.precision is not None
    result = pool4.run(mixed_precision_vs_reference, spec, plan.to_dict())[0]
    check_mixed_precision(result)


@pytest.mark.parametrize("kind", ["hf-gpt2", "hf-llama"])
def test_hugging_face_models_pipeline_like_one_device(pool2, kind):
    """Hugging Face GPT-2 (lm_head tied to wte) and Llama (rotary tables and causal mask
    built from the inputs, recomputed per stage), inputs as keyword arguments, 2 stages."""
    model, args, kwargs = build_case((kind,))
    plan = autopar.plan(model, autopar.Mesh((2,), ("pp",), device="cpu"), args, example_kwargs=kwargs,
                        solve=autopar.SolveOptions(compare=False),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    assert plan.pipeline.layer_prefix in ("transformer.h", "model.layers")
    result = pool2.run(train_and_compare, (kind,), plan.to_dict())[0]
    assert result["ok"], result


@pytest.mark.parametrize("kind", ["hf-llama", "hf-deepseek"])
def test_newer_schedules_on_hugging_face_families(pool4, kind):
    """ZB-V, DualPipeV (4 stages on 2 device groups, Megatron inside each), Chimera (2
    stages, each on both groups; data parallelism inside) and PipeDream-2BW (against the
    one-device reference of its stale update rule) on Hugging Face Llama and on
    DeepSeek-V3 (latent attention, routed and shared experts; its first layer dense, so 5
    layers give 4 alike to cut), (2, 2) mesh: 3 AdamW steps equal to one device."""
    spec = (kind, 5 if kind == "hf-deepseek" else 4)
    model, args, kwargs = build_case(spec)
    failures = []
    for schedule, intra, microbatches in (("zbv", "megatron-tp", 2), ("dualpipev", "megatron-tp", 4),
                                          ("chimera", "data-parallel", 2), ("pipedream-2bw", "megatron-tp", 2)):
        inside = "dp" if intra == "data-parallel" else "tp"
        plan = autopar.plan(model, autopar.Mesh((2, 2), ("pp", inside), device="cpu"), args, example_kwargs=kwargs,
                            solve=autopar.SolveOptions(compare=False, layout=intra),
                            pipeline=autopar.Pipeline(axis="pp", groups=2, schedule=schedule,
                                                      microbatches=microbatches, asynchronous=schedule == "pipedream-2bw"))
        assert plan.pipeline.schedule == schedule
        assert len(plan.pipeline.stages) == (4 if schedule in TWO_PER_GROUP else 2)
        job = train_stale_and_compare if schedule == "pipedream-2bw" else train_and_compare   # (2BW: its own rule)
        bad = [r for r in pool4.run(job, spec, plan.to_dict()) if not r["ok"]]
        if bad:
            failures.append(f"{schedule} x {intra}: {bad[0]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kind", ["nano", "titan"])
@pytest.mark.parametrize("schedule", ["chimera", "pipedream-2bw"])
def test_own_schedules_on_attention_as_users_write_it(pool2, kind, schedule):
    """Chimera (equal to one device) and PipeDream-2BW (equal to its stale rule's one-device
    reference) on nanoGPT-style attention and torchtitan-style complex RoPE
    (tests/user_models.py), 2 stages."""
    spec = ("user", kind)
    model, args, kwargs = build_case(spec)
    plan = autopar.plan(model, autopar.Mesh((2,), ("pp",), device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule=schedule, microbatches=2,
                                                  asynchronous=schedule == "pipedream-2bw"))
    assert plan.pipeline.schedule == schedule
    job = train_stale_and_compare if schedule == "pipedream-2bw" else train_and_compare
    results = pool2.run(job, spec, plan.to_dict())
    assert all(r["ok"] for r in results), results[0]


@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_inside_stages_prefetches_and_regathers_per_microbatch(pool4, reshard):
    """ZeRO-3 over dp inside 2 stages (1F1B, 2 microbatches): every weight of a rank's
    stage is gathered once per microbatch's forward, all but the first of each forward by a
    prefetch; with reshard_after_forward the weights backward needs are gathered again,
    without it never; gradients equal one device."""
    spec = ("autopar", "gpt-tiny", ())
    plan = pipelined_plan(spec, (2, 2), ("pp", "dp"), 2, "1f1b", "zero3", microbatches=2)
    for counts in pool4.run(zero3_regather_counts, plan.to_dict(), reshard, spec):
        # forwards: 2 microbatches, plus the schedule's metadata forward on its first step
        forwards = counts["gathered"] // max(counts["gathers"], 1)
        assert counts["gathers"] > 0 and counts["gathered"] == forwards * counts["gathers"], counts
        assert forwards in (2, 3), counts
        assert counts["prefetched"] == forwards * (counts["gathers"] - 1), counts
        if reshard:
            assert counts["regathered"] >= counts["gathers"], counts
        else:
            assert counts["regathered"] == 0, counts
        assert counts["worst"] <= 0, counts


def test_random_stage_plans_train_like_one_device(pool4):
    """Random valid per-stage plans (every node's strategy drawn from its menu, ZeRO
    included) inside 2 pipelined stages on a (2, 2) mesh go through the same check."""
    failures = []
    for seed, schedule in zip(range(5), ["1f1b", "gpipe", "zero-bubble", "chimera", "pipedream-2bw"]):
        spec = _spec("llama-tiny" if seed % 2 else "gpt-tiny", 4)
        plan = pipelined_plan(spec, (2, 2), ("pp", "dp"), 2, schedule, microbatches=2, seed=seed)
        job = train_stale_and_compare if schedule == "pipedream-2bw" else train_and_compare
        result = pool4.run(job, spec, plan.to_dict())[0]
        if not result["ok"]:
            failures.append(f"seed {seed} {schedule}: {result}")
    assert not failures, "\n".join(failures)


def test_measured_gantt_of_a_compiled_pipeline(pool4, tmp_path):
    """A compiled 4-stage 1F1B run records every forward and backward pass of every rank;
    the passes of each rank follow the 1F1B order and the Gantt picture is written."""
    from autopar.report.gantt import gantt_svg
    from autopar.cost.schedules import simulate
    spec = _spec("gpt-tiny", 4)
    plan = pipelined_plan(spec, (4,), ("pp",), 4, "1f1b", microbatches=4)
    timeline = pool4.run(compiled_pipeline_events, spec, plan.to_dict())[0]
    for rank in range(4):
        kinds = [(e.kind, e.microbatch) for e in sorted(timeline.on(rank), key=lambda e: e.start)]
        expected = [(e.kind, e.microbatch) for e in sorted(simulate("1f1b", 4, 4).on(rank), key=lambda e: e.start)]
        assert kinds == expected, (rank, kinds)
    path = gantt_svg(timeline, tmp_path / "compiled-1f1b.svg")
    assert path.read_text().count("<rect") >= 32


def test_pipelined_plans_save_load_and_refuse_bad_input(pool2, tmp_path):
    spec = _spec("gpt-tiny", 4)
    plan = pipelined_plan(spec, (2,), ("pp",), 2, "gpipe", microbatches=2)
    plan.save(tmp_path / "pp.json")
    again = autopar.Plan.load(tmp_path / "pp.json")
    assert again.pipeline == plan.pipeline and again.device_mesh().shape == (2,)
    assert "2 stages over pp" in str(again)
    with pytest.raises(ValueError, match="schedule"):
        autopar.Pipeline(schedule="looped").check(autopar.Mesh((2,), ("pp",)))
    with pytest.raises(ValueError, match="groups=3"):
        pipelined_plan(spec, (2,), ("pp",), 3, "gpipe")
    result = pool2.run(train_and_compare, spec, again.to_dict())[0]
    assert result["ok"], result
    for got, expected in pool2.run(pipelined_forward_loss, spec, again.to_dict()):  # forward alone: the loss
        assert abs(got - expected) <= 1e-6 + 1e-5 * abs(expected), (got, expected)


def test_memory_report_has_one_shape(pool4):
    """memory_report() of a pipelined model has the keys of an unpipelined one; its
    prediction is this device group's (the search's categories sum to its total), and the
    parameter bytes each rank holds are the ones predicted for its group."""
    from rt_cases import memory_after_step, plan_for
    spec = ("autopar", "gpt-tiny", (("n_layers", 4),))
    flat = pool4.run(memory_after_step, plan_for(spec, "data-parallel", (4,), ("dp",)), spec)
    piped = pool4.run(memory_after_step, plan_for(spec, "data-parallel", (2, 2), ("pp", "dp"),
                                                  autopar.Pipeline(axis="pp", groups=2, schedule="1f1b",
                                                                   microbatches=2)), spec)
    for report in flat + piped:
        assert set(report) == set(flat[0]) and set(report["measured"]) == set(flat[0]["measured"])
        predicted = report["predicted"]
        assert set(predicted) == {"params", "grads", "optimizer", "activations", "working", "total"}
        assert sum(v for k, v in predicted.items() if k != "total") == pytest.approx(predicted["total"])
    for report in piped:
        assert report["measured"]["params"] == report["predicted"]["params"], report
