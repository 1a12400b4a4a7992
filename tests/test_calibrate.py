"""The measured cost model: `autopar calibrate` on gloo ranks, device profiles that plan,
gradient buckets priced as the runtime runs them, and the communication backward hides."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import autopar
from autopar.cost import collectives as K
from autopar.cost.collective_prices import axis_link
from autopar.cost.prices import BUCKET_BYTES, collective_time
from autopar.mesh import PRESETS, DeviceSpec
from autopar.models import build
import autopar.solve.pipeline.search as pipeline_search
from autopar.runtime.calibrate import links as calibrate_links
from autopar.runtime.calibrate import step as calibrate_step
from autopar.runtime.calibrate.compute import POINTWISE
from autopar.solve.assemble import hidden_gradient_seconds, hidden_prefetch_seconds

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _calibrate_job(cache: str, out: str, offload_dir: str):
    """On every rank: a quick calibration over one axis of all ranks, its disk tier timed in
    `offload_dir`, twice (the second from the cache); the spec, whether the second equals
    it, and the seconds each took."""
    import time

    os.environ["AUTOPAR_CACHE"] = cache
    from autopar.runtime.calibrate.fit import calibrate
    start = time.perf_counter()
    first = calibrate(quick=True, repeats=2, out=out, offload_dir=offload_dir)
    mid = time.perf_counter()
    second = calibrate(quick=True, repeats=2, offload_dir=offload_dir)
    return first.to_dict(), second == first, mid - start, time.perf_counter() - mid


def test_calibrate_measures_every_collective_and_caches(pool2, tmp_path):
    out = str(tmp_path / "profile.json")
    results = pool2.run(_calibrate_job, str(tmp_path / "cache"), out, str(tmp_path / "nvme"))
    spec = DeviceSpec.from_dict(results[0][0])
    assert all(r[0] == results[0][0] for r in results)            # every rank plans with the same numbers
    assert all(r[1] for r in results)                             # the second call read the cache
    assert all(r[3] < r[2] / 3 for r in results), [r[2:] for r in results]
    assert 1e8 < spec.peak_flops(torch.float32) < 1e13            # a CPU core's FLOP rate
    assert 1e8 < spec.peak_flops(torch.float32, attention=True) < 1e13
    assert 1e8 < spec.mem_bandwidth < 1e12 and 0 < spec.op_latency < 1e-3
    per_param, per_element = spec.optimizer
    assert per_param >= 0 and 0 < per_element < 1e-6
    assert not spec.asynchronous                                  # a CPU runs its ops eagerly
    # the memory tiers: this device's share of the host, and the disk timed where it was told
    assert 2**28 < spec.host_memory < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    assert 1e6 < spec.disk_write_bandwidth < 1e11 and 1e6 < spec.disk_read_bandwidth < 1e11, spec
    assert 0 < spec.disk_memory and os.listdir(tmp_path / "nvme") == []   # (its files removed)
    # a CPU's transcendental elementwise ops, each measured per element (DeviceSpec.pointwise)
    assert {k for k, _, _ in spec.pointwise} == set(POINTWISE)
    for key, fwd, bwd in spec.pointwise:
        assert 1e-12 < fwd < 1e-6 and 0 <= bwd < 1e-6, (key, fwd, bwd)
        assert spec.pointwise_seconds(key) == (fwd, bwd)
    links = {(k, where): (bw, lat, launch) for k, where, bw, lat, launch in spec.links}
    assert set(links) == {(k, "intra") for k in KINDS}            # one node: every kind inside it
    for kind, (bw, lat, launch) in links.items():
        assert 1e6 < bw < 1e12 and lat >= 0 and launch >= 0 and lat + launch > 0, (kind, bw, lat, launch)
    # the step check: its GPT steps measured and predicted, the work scale recorded and
    # applied, the per-op cost at least a tiny op's
    rows = json.load(open(out))["points"]["step check (measured s, predicted s, work s, ops)"]
    assert len(rows) == len(calibrate_step.STEP_MODELS[True])
    for measured, predicted, work, ops in rows:
        assert 0 < work < predicted and measured > 0 and ops > 10, (measured, predicted, work, ops)
    assert 0.2 < spec.compute_scale < 5 and "per op from GPT steps" in spec.source
    # the profile written is what DeviceSpec.load reads, and it plans
    assert DeviceSpec.load(out) == spec
    assert json.load(open(out))["cluster"]["world"] == 2
    model, example = build("gpt-tiny")
    plan = autopar.plan(model, autopar.Mesh((2,), ("dp",), device=out), example,
                        solve=autopar.SolveOptions(compare=False))
    assert plan.mesh.device == spec and plan.predicted.step_s > 0


def test_the_step_check_fits_a_work_scale_and_a_cost_per_op():
    """fit_step recovers measured = s work + L ops; where the free fit would price an op
    below a tiny op, L stays at the tiny op's and s alone is fitted."""
    work, ops = [0.15, 0.03, 0.10], [150, 150, 110]
    measured = [1.07 * w + 87e-6 * n for w, n in zip(work, ops)]
    s, per_op = calibrate_step.fit_step(measured, work, ops, 1e-5)
    assert s == pytest.approx(1.07, rel=1e-6) and per_op == pytest.approx(87e-6, rel=1e-6)
    below = [1.2 * w + 2e-6 * n for w, n in zip(work, ops)]
    s, per_op = calibrate_step.fit_step(below, work, ops, 1e-5)
    assert per_op == 1e-5 and 1.1 < s < 1.2
    # one model: the scale alone
    s, per_op = calibrate_step.fit_step([0.2], [0.1], [100], 1e-4)
    assert per_op == 1e-4 and s == pytest.approx(1.9)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_scaled_compute_scales_every_compute_price(name):
    """scaled_compute(spec, s, L) turns a one-device step into s x its work + L x its ops
    exactly (every compute price is work at the spec's rates plus ops at op_latency), and
    leaves the links alone: a 2-rank plan's communication is unchanged."""
    spec = dataclasses.replace(PRESETS["cpu"], optimizer=(5e-5, 5e-9), pointwise=(("aten.gelu:tanh", 2e-9, 3e-9),
                                                                                  ("aten.silu", 1e-9, 2e-9)),
                               attention_flops=(("float32", 1e10),))
    model, example = build(name, batch=2, seq=32)
    step = lambda d, shape=(1,): autopar.plan(model, autopar.Mesh(shape, ("dp",), device=d), example,
                                              solve=autopar.SolveOptions(compare=False,
                                                                         layout="data-parallel")).predicted
    whole, work = step(spec).step_s, step(dataclasses.replace(spec, op_latency=0.0)).step_s
    ops = (whole - work) / spec.op_latency
    scaled = calibrate_step.scaled_compute(spec, 1.3, 5e-5)
    assert scaled.compute_scale == pytest.approx(1.3) and scaled.links == spec.links
    assert step(scaled).step_s == pytest.approx(1.3 * work + 5e-5 * ops, rel=1e-6)
    assert step(scaled, (2,)).comm_s == pytest.approx(step(spec, (2,)).comm_s, rel=1e-9)


def test_profiles_round_trip_through_files_and_plans(tmp_path):
    spec = dataclasses.replace(
        PRESETS["cpu"], name="measured", links=(("all_reduce", "intra", 3e9, 4e-4, 1e-4),
                                                ("reduce_scatter", "intra", 1.5e9, 4e-4, 1e-4)),
        optimizer=(5e-5, 5e-9), attention_flops=(("float32", 1e10),), pointwise=(("aten.gelu", 1e-9, 2e-9),),
        source="a test")
    path = tmp_path / "dev.json"
    spec.save(path)
    assert DeviceSpec.load(path) == spec
    model, example = build("mlp")
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device=str(path)), example,
                        solve=autopar.SolveOptions(compare=False))
    plan.save(tmp_path / "plan.json")
    assert autopar.Plan.load(tmp_path / "plan.json").mesh.device == spec
    with pytest.raises(ValueError, match="autopar calibrate"):
        DeviceSpec.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"device": {**spec.to_dict(), "speed": 1}}))
    with pytest.raises(ValueError, match="unknown fields \\['speed'\\]"):
        DeviceSpec.load(tmp_path / "bad.json")


def test_collectives_are_timed_after_compute_on_a_cpu(monkeypatch):
    """A CPU step calls each collective after a stretch of compute: in_step times the call
    after the chain and takes the chain off, never below the call back to back; on CUDA
    (no chain) the calls run back to back."""
    seen = []

    def timed(fn, device_type, repeats, group=None, what="comm"):
        fn()
        seen.append(what)
        return {"compute": 0.0065, "comm": 0.002}[what]

    monkeypatch.setattr(calibrate_links, "timed", timed)
    calls = []
    chain = (lambda: calls.append("chain"), 0.004)
    assert calibrate_links.in_step(lambda: calls.append("call"), chain, "cpu", 3, None) == pytest.approx(0.0025)
    assert calls == ["call", "chain", "call"] and seen == ["comm", "compute"]
    assert calibrate_links.in_step(lambda: calls.append("call"), None, "cuda", 3, None) == pytest.approx(0.002)
    assert seen[-1] == "comm"
    # the chain's noise outweighing the call: what it takes back to back, never 0 or below
    slow = (lambda: None, 0.0060)
    assert calibrate_links.in_step(lambda: None, slow, "cpu", 3, None) == pytest.approx(0.002)
    assert calibrate_links.step_chain(None, "cuda", 3) is None


def test_measured_pointwise_ops_price_by_their_elements():
    """A calibrated CPU prices gelu and the cross entropy by their elements at the measured
    seconds per element (forward and backward), not as memory traffic; a device without
    such numbers (every GPU preset) keeps the roofline."""
    model, example = build("gpt-tiny", hidden=64, n_heads=4, n_layers=2, batch=4, seq=32)
    base = dataclasses.replace(PRESETS["cpu"], op_latency=0.0)
    # GPT-2's GELU is the tanh form, a key of its own (the exact one is "aten.gelu")
    measured = dataclasses.replace(base, pointwise=(("aten.gelu", 1e-7, 1e-7), ("aten.gelu:tanh", 2e-9, 3e-9),
                                                    ("aten.log_softmax", 1e-9, 1e-9)))
    nodes = {}
    for spec in (base, measured):
        plan = autopar.plan(model, autopar.Mesh((2,), ("dp",), device=spec), example,
                            solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
        nodes[spec is measured] = {n.op: n for n in plan.nodes}
    gelu_elements = 4 * 32 * 4 * 64 / 2              # tokens x the MLP's width, half the batch per rank
    assert nodes[True]["aten.gelu"].compute_s == pytest.approx(gelu_elements * 5e-9, rel=1e-6)
    assert nodes[False]["aten.gelu"].compute_s < gelu_elements * 5e-9 / 5
    loss, plain = nodes[True]["aten.cross_entropy_loss"], nodes[False]["aten.cross_entropy_loss"]
    vocab = model.lm_head.weight.shape[0]
    assert loss.compute_s == pytest.approx(4 * 32 * vocab / 2 * 2e-9, rel=1e-6)   # its logits' elements
    assert loss.compute_s > plain.compute_s
    # under Inductor the tanh GELU runs as x * sigmoid(2 z) (runtime/regions/sigmoid_gelu.with_sigmoid_gelus):
    # priced at the measured sigmoid's rate
    both = dataclasses.replace(measured, pointwise=measured.pointwise + (("aten.sigmoid", 5e-10, 5e-10),))
    compiled = autopar.plan(model, autopar.Mesh((2,), ("dp",), device=both), example,
                            solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                            pricing=autopar.Pricing(backend="inductor"))
    gelu = {n.op: n for n in compiled.nodes}["aten.gelu"]
    # (at least; a pass whose memory traffic takes longer is priced by its traffic)
    assert gelu_elements * 1e-9 * (1 - 1e-6) <= gelu.compute_s < gelu_elements * 1e-9 * 1.1


def test_measured_links_price_each_kind_by_its_own_line():
    """gloo's reduce-scatter is an all-reduce underneath: a calibrated device says so with
    its own reduce-scatter line, and the model prices it by that line, not the all-reduce's."""
    spec = dataclasses.replace(PRESETS["cpu"], links=(("all_reduce", "intra", 3e9, 4e-4, 1e-4),
                                                      ("reduce_scatter", "intra", 1.5e9, 2e-4, 3e-4)))
    mesh = autopar.Mesh((4,), ("dp",), device=spec)
    m = 8e6
    assert collective_time("reduce_scatter", m, 0, mesh) == pytest.approx(3e-4 + 3 * 2e-4 + 0.75 * m / 1.5e9)
    assert collective_time("all_reduce", m, 0, mesh) == pytest.approx(1e-4 + 6 * 4e-4 + 1.5 * m / 3e9)
    # kinds not measured keep the device's numbers; a mesh's own bandwidth scales the measured
    assert axis_link("all_gather", 0, mesh) == (spec.intra_bandwidth, spec.intra_latency, spec.launch_latency)
    faster = autopar.Mesh((4,), ("dp",), device=spec, bandwidth=2 * spec.intra_bandwidth)
    assert axis_link("reduce_scatter", 0, faster)[0] == pytest.approx(3e9)


def test_a_gradient_pays_its_share_of_its_bucket():
    """Data parallel on a slow-latency mesh: each weight's gradient all-reduce costs its
    bytes' share of one call's fixed cost plus its own bandwidth term."""
    mesh = autopar.Mesh((4,), ("dp",), device="cpu")
    model, example = build("gpt-tiny")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    bw, lat, launch = axis_link("all_reduce", 0, mesh)
    fixed, per_byte = K.line("all_reduce", "ring", 4, bw, lat, launch)
    grads = [c for c in plan.collectives if c.phase == "backward" and c.kind == "all_reduce"
             and c.tensor.endswith("weight")]
    assert grads
    for c in grads:
        assert c.seconds == pytest.approx(fixed * min(1.0, c.nbytes / BUCKET_BYTES) + per_byte * c.nbytes), c
        assert c.seconds < fixed   # one call per parameter would cost at least the fixed cost


def test_backward_hides_what_buckets_overlap():
    """Two streams: backward ops in reverse order, and bucket reductions once ready."""
    ops = {3: (1.0, 0.0), 2: (1.0, 0.0), 1: (1.0, 0.0)}
    assert hidden_gradient_seconds(ops, {3: 0.5}) == pytest.approx(0.5)   # done while 2 and 1 run
    assert hidden_gradient_seconds(ops, {1: 2.0}) == pytest.approx(0.0)   # ready only at the end
    assert hidden_gradient_seconds(ops, {3: 5.0}) == pytest.approx(2.0)   # 3 s past the last op
    assert hidden_gradient_seconds(ops, {3: 1.5, 2: 1.5}) == pytest.approx(2.0)  # queued: ends at 4, 1 s past


def test_forward_hides_weight_gathers_started_one_ahead():
    """The first gather waits; each gather starts the next, which runs while the ops up to
    its reader compute."""
    ops = {1: 1.0, 2: 1.0, 3: 1.0}
    assert hidden_prefetch_seconds(ops, {1: 0.5}) == pytest.approx(0.0)             # nothing before it
    assert hidden_prefetch_seconds(ops, {1: 0.5, 2: 0.5, 3: 0.5}) == pytest.approx(1.0)  # all but the first
    assert hidden_prefetch_seconds(ops, {1: 0.5, 3: 0.5}) == pytest.approx(0.5)     # runs during ops 1 and 2
    # a gather longer than the compute it overlaps: 2 s under op 1's 1 s, 1 s exposed
    assert hidden_prefetch_seconds(ops, {1: 0.5, 2: 2.0}) == pytest.approx(1.0)


def test_zero3_plan_says_what_forward_hides():
    model, example = build("gpt-tiny", batch=64)
    for device in ("h100", "cpu"):
        p = autopar.plan(model, autopar.Mesh((8,), ("dp",), device=device), example,
                         solve=autopar.SolveOptions(compare=False, layout="zero3")).predicted
        assert p.step_s == pytest.approx(p.compute_s + sum(p.comm_s.values()) - p.hidden_s)
        if device == "h100":
            assert 0 < p.prefetch_hidden_s <= p.prefetchable_s < sum(p.comm_s.values())
            assert "weight gathers behind forward" in str(p)
        else:
            assert p.prefetch_hidden_s == 0 < p.prefetchable_s


def test_pipeline_sends_overlap_only_on_asynchronous_devices(monkeypatch):
    """A send delays its receiver only (GPU); on CPU ranks it adds to both stages: 1 ms
    more per send costs 1F1B on 2 stages x 4 microbatches 4 ms (the chain through the cut:
    a forward and a backward each way at fill and drain) against 8 ms."""
    model, example = build("gpt-tiny", batch=16, n_layers=4)
    fixed = autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=4)
    grew = {}
    for asynchronous in (True, False):
        mesh = autopar.Mesh((2, 2), ("pp", "dp"), device=dataclasses.replace(PRESETS["h100"],
                                                                             asynchronous=asynchronous))
        steps = []
        for seconds in (0.0, 1e-3):
            monkeypatch.setattr(pipeline_search, "send_time", lambda *a, s=seconds: s)
            c = pipeline_search.search(model, mesh, example, fixed=fixed, recompute="none")
            assert c.sends_overlap is asynchronous and c.send_s == seconds
            steps.append(c.step_s)
        grew[asynchronous] = (steps[1] - steps[0]) / 1e-3
    assert grew[True] == pytest.approx(4.0, abs=0.1)
    assert grew[False] > 7.5


@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_the_step_subtracts_the_hidden_communication(device):
    """On a GPU (NCCL on its own stream) gradient buckets overlap backward and the plan says
    how much; a CPU rank's collectives reduce on its compute cores: nothing hidden."""
    model, example = build("gpt-tiny", batch=64)
    plan = autopar.plan(model, autopar.Mesh((8,), ("dp",), device=device), example,
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    p = plan.predicted
    assert p.step_s == pytest.approx(p.compute_s + sum(p.comm_s.values()) - p.hidden_s)
    if device == "h100":
        assert 0 < p.hidden_s <= sum(p.comm_s.values())
        assert "behind backward" in str(plan)
    else:
        assert p.hidden_s == 0


def test_plan_command_reads_a_profile_and_defaults_to_bf16_on_gpus(tmp_path):
    path = tmp_path / "dev.json"
    dataclasses.replace(PRESETS["cpu"], name="cpu-measured").save(path)
    run = lambda *a: subprocess.run([sys.executable, "-m", "autopar", "-q", "plan", "--model", "gpt-tiny",
                                     "--mesh", "2", "--no-compare", "--save", str(tmp_path / "p.json"), *a],
                                    capture_output=True, text=True, timeout=300)
    got = run("--device", str(path))
    assert got.returncode == 0, got.stderr
    cpu = autopar.Plan.load(tmp_path / "p.json")
    assert cpu.mesh.device.name == "cpu-measured" and cpu.precision is None
    assert run("--device", "h100").returncode == 0
    gpu = autopar.Plan.load(tmp_path / "p.json")
    assert gpu.precision is not None and gpu.precision.param_dtype == torch.bfloat16
    assert gpu.predicted.memory["params"] == pytest.approx(cpu.predicted.memory["params"] / 2)
    assert run("--device", "h100", "--precision", "fp32").returncode == 0
    assert autopar.Plan.load(tmp_path / "p.json").precision is None
    bad = run("--device", str(tmp_path / "none.json"))
    assert bad.returncode == 2 and "autopar calibrate" in bad.stderr
    assert math.isfinite(gpu.predicted.step_s)
