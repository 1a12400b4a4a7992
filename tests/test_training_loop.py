"""The parts of a training loop around train_step give one device's answers: gradient
clipping over sharded gradients, per-rank batches, input checks."""
from __future__ import annotations

import re

import pytest

import autopar
from rt_cases import (plan_for, bad_inputs, build_case, checkpoint_round_trip, compile_other_size, train_and_compare,
                      resume_across_layouts, torch_clip_over_parameters, uneven_batches)

GPT = ("autopar", "gpt-tiny", ())
MESH = ((2, 2), ("dp", "tp"))
LAYOUTS = [None, "data-parallel", "zero1", "zero2", "zero3", "megatron-tp x dp", "megatron-tp x zero2",
           "megatron-tp x zero3"]


_plan = plan_for


def test_clip_grad_norm_equals_one_device(pool4):
    """cm.clip_grad_norm_(0.5) under every layout: the norm torch computes on one device
    (about 2.3 here, so clipping bites), and 3 clipped AdamW steps equal one device."""
    failures = []
    for layout in LAYOUTS:
        r = pool4.run(train_and_compare, GPT, _plan(GPT, layout), 3, 0.5)[0]
        for mine, theirs in r["norms"]:
            if abs(mine - theirs) > 1e-5 * theirs:
                failures.append(f"{layout}: norm {mine} vs one device {theirs}")
        if not r["ok"]:
            failures.append(f"{layout}: loss {r['loss']:.2e} grad {r['grad']} param {r['param']}")
    assert not failures, "\n".join(failures)
    assert r["norms"][0][1] > 0.5


def test_clip_grad_norm_with_pipeline_stages(pool4):
    spec = ("autopar", "gpt-tiny", (("n_layers", 4),))
    plan = _plan(spec, "megatron-tp", (2, 2), ("pp", "tp"),
                 autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    r = pool4.run(train_and_compare, spec, plan, 3, 0.5)[0]
    assert r["ok"], r
    for mine, theirs in r["norms"]:
        assert mine == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("layout,refused", [
    ("data-parallel", None), ("zero1", None),
    ("megatron-tp x dp", r"this rank holds a shard of the gradient of '[\w.]+', split over tp \(S\(\d\)\)"),
    ("zero2", r"'[\w.]+' is reduce-scattered into ZeRO-2 chunks over \['dp', 'tp'\]"),
    ("zero3", r"'[\w.]+', split over dp \(S\(\d\)\)"),
    ("pipeline", r"holds the gradient of '[\w.]+' for its pipeline stages only"),
])
def test_torch_clip_grad_norm_over_parameters(pool4, layout, refused):
    """torch.nn.utils.clip_grad_norm_(cm.parameters()) is one device's norm where every rank's
    gradients are whole (data parallel, ZeRO-1) and raises, pointing to cm.clip_grad_norm_,
    where they are pieces (shards, ZeRO-2 chunks, pipeline stages); training goes on right."""
    spec = GPT
    if layout == "pipeline":
        spec = ("autopar", "gpt-tiny", (("n_layers", 4),))
        plan = _plan(spec, "data-parallel", (2, 2), ("pp", "dp"),
                     autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    else:
        plan = _plan(spec, layout)
    results = pool4.run(torch_clip_over_parameters, spec, plan)
    for r in results:
        assert r["loss_excess"] <= 0, r
        if refused is None:
            assert r["norm"] == pytest.approx(r["one_device"], rel=1e-5)
        else:
            assert r["error"].startswith("GradPieceError"), r
            assert re.search(refused, r["error"]) and "use cm.clip_grad_norm_(max_norm)" in r["error"], r["error"]
    assert results[0]["one_device"] > 0.5


@pytest.mark.parametrize("case,layout,expected", [
    ("per-rank batch", "data-parallel", "InputError: rank 1 passed a different input .*local_inputs=True"),
    ("shape", "megatron-tp x dp", r"InputError: input '\w+' has shape \(2, 16\) torch.int64; the model was "
                                  r"compiled for \(4, 16\)"),
    ("shape on one rank", "data-parallel", "InputError: rank 3 passed a different input"),
    ("token out of range", "megatron-tp (all axes)", "IndexError: index out of range in self: input 'idx' holds "
                                                     "id 1000, outside the 128 rows of the embedding in 'wte'"),
])
def test_bad_inputs_fail_on_every_rank_with_their_name(pool4, case, layout, expected):
    import re
    errors = pool4.run(bad_inputs, GPT, _plan(GPT, layout), case)
    assert all(re.search(expected, e) for e in errors), errors


def test_nan_on_one_rank_is_caught(pool4):
    spec = ("autopar", "mlp", (("hidden", 32), ("batch", 16)))
    errors = pool4.run(bad_inputs, spec, _plan(spec, None), "nan on one rank")
    assert all("rank 1 passed a different input" in e for e in errors), errors


@pytest.mark.parametrize("layout", ["data-parallel", "megatron-tp x dp"])
def test_uneven_batches_end_cleanly_inside_join(pool4, layout):
    import time
    start = time.perf_counter()
    results = pool4.run(uneven_batches, GPT, _plan(GPT, layout))
    assert time.perf_counter() - start < 60
    assert [r["steps"] for r in results] == [2, 2, 2, 2]
    assert [bool(r["error"]) for r in results] == [True, True, True, False]
    assert "1 rank(s) ran out of batches before step 2" in results[0]["error"]
    assert len({r["after"] for r in results}) == 1


def test_plan_files_name_their_problem(tmp_path):
    from autopar.report.plan import PlanFileError
    plan = autopar.Plan.from_dict(_plan(GPT, "megatron-tp x dp"))
    good = tmp_path / "plan.json"
    plan.save(good)
    assert autopar.Plan.load(good) == plan
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(good.read_text()[:-40])
    with pytest.raises(PlanFileError, match=f"plan file {corrupt} is not valid JSON"):
        autopar.Plan.load(corrupt)
    import json
    edited = json.loads(good.read_text())  # a parameter's shard changed by hand
    edited["param_placements"]["blocks.0.attn.q.weight"] = ["R", "S(1)"]
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(PlanFileError, match="was changed after it was saved"):
        autopar.Plan.load(tmp_path / "edited.json")
    del edited["nodes"]
    (tmp_path / "broken.json").write_text(json.dumps(edited))
    with pytest.raises(PlanFileError, match="is not a plan this autopar can read"):
        autopar.Plan.load(tmp_path / "broken.json")


def test_plan_for_another_size_is_refused_before_building(pool4):
    wide = ("autopar", "gpt-tiny", (("hidden", 128),))
    errors = pool4.run(compile_other_size, wide, _plan(wide, "megatron-tp x dp"), GPT)
    assert all(e.startswith("PlanMismatch: the plan was made for another graph") for e in errors), errors


def test_adafactor_runs_on_whole_parameters(pool4):
    """Adafactor factors its second moment over a matrix's rows and columns: on shards or
    ZeRO chunks it would compute something else.  It runs on whole parameters (one owner
    rank each) and 3 steps equal one device under ZeRO-2, ZeRO-3 and Megatron x DP."""
    failures = []
    for layout in ["zero2", "zero3", "megatron-tp x dp", None]:
        r = pool4.run(train_and_compare, GPT, _plan(GPT, layout), 3, None, "adafactor")[0]
        if not r["ok"]:
            failures.append(f"{layout}: loss {r['loss']:.2e} grad {r['grad']} param {r['param']}")
        if layout != None:
            assert r["optimizer"] == "WholeParamOptimizer", layout
    assert not failures, "\n".join(failures)


PAIRS = [("megatron-tp x dp", "zero3"), ("zero3", "megatron-tp x zero3"), ("zero2", "data-parallel"),
         ("megatron-tp (all axes)", "megatron-tp x zero2")]


@pytest.mark.parametrize("saved,loaded", PAIRS)
def test_distributed_checkpoint_round_trips_across_layouts(pool4, tmp_path, saved, loaded):
    """dcp.save(cm.state_dict()) under one layout, dcp.load + cm.load_state_dict under another
    and under the same: every parameter, the tied head and the buffers come back exactly."""
    r = pool4.run(checkpoint_round_trip, GPT, _plan(GPT, saved), _plan(GPT, loaded), str(tmp_path / "ckpt"))[0]
    assert r["keys_equal_plain"]
    assert r["worst"] == 0.0


def test_batch_norm_statistics_survive_checkpoints(pool4, tmp_path):
    from sem_cases import bn_case
    model, x = bn_case()
    mesh = autopar.Mesh(*MESH, device="cpu")
    a = autopar.plan(model, mesh, (x,), solve=autopar.SolveOptions(compare=False, layout="data-parallel")).to_dict()
    b = autopar.plan(model, mesh, (x,), solve=autopar.SolveOptions(compare=False, layout="megatron-tp x dp")).to_dict()
    r = pool4.run(checkpoint_round_trip, ("bn",), a, b, str(tmp_path / "ckpt"))[0]
    assert r["keys_equal_plain"]
    assert r["worst"] == 0.0


@pytest.mark.parametrize("saved,loaded", [("zero2", "megatron-tp x dp"), ("megatron-tp x zero3", "zero1"),
                                          ("data-parallel", "megatron-tp x zero2")])
def test_training_resumes_under_another_layout(pool4, tmp_path, saved, loaded):
    """Model and AdamW state saved with torch.distributed.checkpoint after one step under one
    layout, loaded under another, two more steps: equal to three steps on one device."""
    r = pool4.run(resume_across_layouts, GPT, _plan(GPT, saved), _plan(GPT, loaded), str(tmp_path / "ckpt"))[0]
    assert r["param"] <= 0 and r["loss"] <= 0, r


def test_repeated_planning_does_not_grow_memory():
    """8 plans of one model in one process: what Python holds grows by < 1 MiB per plan
    after the first (each plan's problem, menus and costs are freed)."""
    import gc
    import tracemalloc
    model, args, _ = build_case(GPT)
    mesh = autopar.Mesh(*MESH, device="cpu")
    autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(8):
            autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False))
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown / 8 < 2**20, f"{grown / 8 / 2**10:.0f} KiB per plan"
