"""Memory tiers: optimizer states and master weights in host memory or on disk, chosen by
the planner within each tier's capacity, run from files under compile's offload_dir, and
trained, checkpointed and resumed exactly as on the device."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import pytest
import torch

import autopar
from autopar.cost import prices as C
from autopar.mesh import PRESETS
from autopar.runtime.state.disk import DiskStore, OffloadError, check_directory, wait
from autopar.runtime.process import CompileError
from autopar.solve.recompute.tiers import TierCapacityError
from rt_cases import build_case, train_and_compare
from tier_cases import disk_capacity, disk_errors, resume_bitwise, saved_by_tier, with_tier

GPT = ("autopar", "gpt-tiny", ())
# a GPT whose weights outweigh its activations (one short sequence): what offload is for
WIDE = ("autopar", "gpt-tiny", (("hidden", 256), ("batch", 1), ("seq", 8)))
MIXED = autopar.MixedPrecision(param_dtype=torch.bfloat16)


def _device(host_memory: float, **extra):
    return dataclasses.replace(PRESETS["cpu"], host_memory=host_memory, **extra)


@functools.lru_cache(maxsize=None)
def _plan(spec, shape, names, budget, host_memory, mixed=False, time_limit=60.0, **extra) -> dict:
    """The planner's plan of `spec` under `budget` bytes per device on a cpu mesh whose
    devices have `host_memory` bytes of host memory each (cached per session); time_limit:
    the ILP's, for a test that needs a valid plan, not the best."""
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, names, device=_device(host_memory, **dict(extra.get("device", ()))))
    return autopar.plan(model, mesh, args, example_kwargs=kwargs or None, memory_budget=budget, recompute="none",
                        solve=autopar.SolveOptions(compare=False, time_limit=time_limit),
                        mixed_precision=MIXED if mixed else None).to_dict()


def _states(spec) -> float:
    model, _, _ = build_case(spec)
    return 16.0 * sum(p.numel() for p in model.parameters())   # fp32 weights, gradients, Adam's two moments


def _tiers(plan_dict) -> dict:
    counts = {"": 0, "host": 0, "disk": 0}
    for state in plan_dict["param_states"].values():
        counts[state["offload"]] += 1
    return counts


def test_presets_state_their_tiers():
    h100 = PRESETS["h100"]
    assert h100.host_memory == pytest.approx(0.9 * 2e12 / 8)          # DGX H100: 2 TB over 8 GPUs, a tenth kept
    assert h100.disk_memory == 3.84e12                                # one 3.84 TB U.2 drive per GPU
    assert h100.disk_read_bandwidth > h100.disk_write_bandwidth > 0
    assert PRESETS["a100-40gb"].disk_read_bandwidth == pytest.approx(h100.disk_read_bandwidth / 2)   # a drive per 2
    assert PRESETS["h100-hbm2e-500w"].disk_memory == 0                # not stated: no disk tier offered
    # a saved description without the tiers loads with none stated
    d = PRESETS["cpu"].to_dict()
    for k in ("host_memory", "disk_memory", "disk_read_bandwidth", "disk_write_bandwidth"):
        d.pop(k)
    assert autopar.DeviceSpec.from_dict(d).disk_memory == 0


def test_disk_costs_the_host_step_plus_reading_and_writing_the_states():
    dev = PRESETS["h100"]
    owned = 10**8
    host = C.offload_seconds("host", owned, 2, True, dev)
    disk = C.offload_seconds("disk", owned, 2, True, dev)
    held = owned * 12   # float32 master and two moments
    assert disk - host == pytest.approx(held / dev.disk_read_bandwidth + held / dev.disk_write_bandwidth)
    # fp32 weights: the host steps its own float32 copy beside the two moments
    assert C.offloaded_bytes(4, False) == 12 and C.offloaded_bytes(2, True) == 12
    assert host == pytest.approx(2 * owned * 2 / dev.host_bandwidth + owned / dev.host_optimizer_rate)


def test_states_go_to_disk_only_beyond_host_memory():
    budget = 1.1 * 2**20
    roomy = _plan(GPT, (2,), ("dp",), budget, 0.0)
    assert _tiers(roomy)["host"] > 0 and _tiers(roomy)["disk"] == 0    # host memory unbounded: never disk
    tight = _plan(GPT, (2,), ("dp",), budget, 0.2 * 2**20)
    plan = autopar.Plan.from_dict(tight)
    tiers = plan.predicted.tiers
    assert _tiers(tight)["disk"] > 0 and 0 < tiers["host"] <= 0.2 * 2**20, tiers   # host filled first, within it
    assert plan.memory_per_device <= budget
    # what each tier holds is what the parameters offloaded there own
    model, args, _ = build_case(GPT)
    shapes = dict(model.named_parameters())
    disk = 0
    for name, st in plan.param_states.items():
        if st.offload == "disk":
            local = shapes[name].numel() // math.prod(plan.mesh.shape[plan.mesh.axis_names.index(a)]
                                                      for a, p in zip(plan.mesh.axis_names, plan.param_placements[name])
                                                      if p.is_shard())
            ways = math.prod(plan.mesh.shape[plan.mesh.axis_names.index(a)] for a in st.axes) if st.stage else 1
            disk += math.ceil(local / ways) * C.offloaded_bytes(4, False)
    assert disk == tiers["disk"]
    # disk reads and writes cost time: the same budget with unbounded host memory is faster
    assert plan.step_s > autopar.Plan.from_dict(roomy).step_s
    text = str(plan)
    assert "offload to disk" in text and "off the device: host" in text
    # the report draws each tier beside the device, with its capacity
    from autopar.report.html import report_html
    from autopar.report.records import format_bytes
    page = report_html(plan)
    assert 'id="tier-chart"' in page
    for tier, label, capacity in (("host", "host memory", 0.2 * 2**20), ("disk", "disk", plan.mesh.device.disk_memory)):
        assert (f"<tr><td>{label}</td><td class=num>{format_bytes(tiers[tier])}</td>"
                f"<td class=num>{format_bytes(capacity)}</td></tr>") in page
    # saved and loaded, the tiers stay; a plan saved before tiers (offload true) reads as host
    again = autopar.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.param_states == plan.param_states
    old = json.loads(json.dumps(tight))
    for st in old["param_states"].values():
        st["offload"] = bool(st["offload"])
    assert {s.offload for s in autopar.Plan.from_dict(old).param_states.values()} <= {"", "host"}


def test_a_disk_too_small_is_named_with_the_bytes_it_lacks():
    model, args, _ = build_case(GPT)
    mesh = autopar.Mesh((2,), ("dp",), device=_device(0.1 * 2**20, disk_memory=0.1 * 2**20))
    with pytest.raises(TierCapacityError, match=r"in disk memory \(offloaded model states\), more than the 102\.40KiB.*disk_memory"):
        autopar.plan(model, mesh, args, memory_budget=1.1 * 2**20, recompute="none",
                     solve=autopar.SolveOptions(compare=False))


def test_the_offload_directory_is_checked_before_anything_is_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CompileError, match="offload_dir=.*AUTOPAR_OFFLOAD_DIR"):
        check_directory(None, 1e6, 1)
    with pytest.raises(CompileError, match="cannot be written"):
        check_directory(blocker / "below", 1e6, 1)
    with pytest.raises(CompileError, match=r"GiB free; the 8 ranks on this machine keep .* Free space"):
        check_directory(tmp_path, 1e18, 8)
    assert check_directory(tmp_path / "new", 1e6, 2) == tmp_path / "new"


def test_the_disk_store_spills_fetches_and_keeps_what_it_could_not_write(tmp_path):
    store = DiskStore(tmp_path, 0)
    a, b = torch.randn(5, 3), torch.arange(7, dtype=torch.bfloat16)
    ref_a, ref_b = a.clone(), b.clone()
    wait(store.spill([("a", a), ("b", b)]))
    assert a.numel() == 0 and b.numel() == 0 and store.disk_bytes == 5 * 3 * 4 + 7 * 2
    assert torch.equal(store.mapped("a", a), ref_a) and torch.equal(store.read("b", b), ref_b)
    with store.resident(lambda: [("a", a)]):
        assert torch.equal(a, ref_a)
        a.add_(1)
    assert a.numel() == 0 and torch.equal(store.read("a", a), ref_a + 1)   # written back
    wait(store.fetch([("a", a), ("b", b)]))
    assert torch.equal(b, ref_b) and store.read_bytes > 0
    # a write that fails leaves the tensor in memory, and says which file and why
    directory = store.directory
    for f in directory.iterdir():
        f.unlink()
    directory.rmdir()
    with pytest.raises(OffloadError, match="stays in host memory"):
        wait(store.spill([("a", a)]))
    assert torch.equal(a, ref_a + 1)
    store.close()
    other = DiskStore(tmp_path, 1)
    wait(other.spill([("c", torch.ones(4))]))
    other.close()
    assert not other.directory.exists()   # the job's files go with it


def test_disk_states_train_like_one_device(pool2):
    plan = _plan(GPT, (2,), ("dp",), 1.1 * 2**20, 0.2 * 2**20)
    assert _tiers(plan)["disk"] > 0
    result = pool2.run(train_and_compare, GPT, plan)[0]
    assert result["ok"], result


def test_disk_states_with_tensor_parallelism_train_like_one_device(pool4):
    plan = _plan(GPT, (2, 2), ("dp", "tp"), 0.6 * 2**20, 0.05 * 2**20)
    assert _tiers(plan)["disk"] > 0, plan["param_states"]
    result = pool4.run(train_and_compare, GPT, plan)[0]
    assert result["ok"], result


def test_checkpoints_resume_bit_for_bit_between_disk_and_device(pool2, tmp_path):
    disk = _plan(GPT, (2,), ("dp",), 1.1 * 2**20, 0.2 * 2**20)
    device = with_tier(disk, "")
    for k, (saved, loaded) in enumerate(((disk, device), (device, disk))):
        got = pool2.run(resume_bitwise, GPT, saved, loaded, str(tmp_path / f"ckpt{k}"))
        for r in got:
            assert r["loss"] == 0 and r["param"] == 0, r
        assert (got[0]["disk"][0] > 0) == (saved is disk) and (got[0]["disk"][1] > 0) == (loaded is disk), got[0]


def test_states_four_times_the_budget_train_from_disk(pool2):
    budget = _states(WIDE) / 4
    plan = _plan(WIDE, (2,), ("dp",), budget, 2**20, mixed=True)
    assert _tiers(plan)["disk"] > 0
    got = pool2.run(disk_capacity, WIDE, plan)
    for r in got:
        disk, host = r["disk"], r["host"]
        m = disk["measured"]
        on_device = m["params"] + m["grads"] + m["optimizer"] + disk["saved"]
        assert on_device <= budget, (on_device, budget, m)           # the runtime's own accounting
        assert m["disk"] == pytest.approx(r["predicted"]["disk"], rel=0.01), (m["disk"], r["predicted"])
        assert m["offloaded"] <= 2**20                               # host memory as the device said
        assert disk["files"] and disk["read"] > 0 and disk["written"] > disk["read"] / 2
        assert disk["losses"] == host["losses"] and r["final_loss_disk"] == r["final_loss_host"]   # the same arithmetic


def test_compile_names_a_missing_or_unwritable_offload_dir(pool2, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    plan = _plan(GPT, (2,), ("dp",), 1.1 * 2**20, 0.2 * 2**20)
    for r in pool2.run(disk_errors, GPT, plan, str(blocker)):
        assert "offload_dir=" in r["missing"] and "AUTOPAR_OFFLOAD_DIR" in r["missing"], r
        assert "cannot be written" in r["blocked"], r


def test_offloaded_layers_keep_their_activations_in_host_memory(pool2):
    """recompute="offload": every layer's saved tensors copied to host in forward and back
    in backward; the device keeps what is outside the layers, exactly as predicted, the
    host the rest, and training equals one device."""
    model, args, _ = build_case(GPT)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    kept = autopar.plan(model, mesh, args, recompute="none", solve=autopar.SolveOptions(compare=False))
    off = autopar.plan(model, mesh, args, recompute="offload", solve=autopar.SolveOptions(compare=False))
    assert set(off.recompute.layers.values()) == {"offload"}
    host = off.predicted.tiers["host"]
    assert off.predicted.memory["activations"] + host == pytest.approx(kept.predicted.memory["activations"])
    assert "activations offloaded to host memory on 2 layers" in str(off)
    # each layer's saved storages cross the host link twice, each once, and nothing runs again
    assert off.recompute.added_s == pytest.approx(2 * host / mesh.device.host_bandwidth, rel=1e-9)
    assert off.predicted.compute_s - kept.predicted.compute_s == pytest.approx(off.recompute.added_s, rel=1e-6)
    for r, plain in zip(pool2.run(saved_by_tier, GPT, off.to_dict()), pool2.run(saved_by_tier, GPT, kept.to_dict())):
        assert r["device"] == off.predicted.memory["activations"], r
        assert r["host"] == host and plain["host"] == 0, (r, host)
        assert r["device"] + r["host"] == plain["device"], (r, plain)
    result = pool2.run(train_and_compare, GPT, off.to_dict())[0]
    assert result["ok"], result


def test_the_planner_tries_offload_beside_recomputation():
    from autopar.solve.recompute.search import mode_assignments
    slots = [("blocks", (0, 1, 2, 3))]
    tried = [tuple(c.modes.values()) for c in mode_assignments(None, slots, None)]
    assert ("offload",) * 4 in tried and ("offload", "none", "offload", "none") in tried
    assert ("selective", "full", "selective", "full") in tried and len(tried) == 11


def _all_weights_in_host_memory(plan_dict: dict, model) -> dict:
    """`plan_dict` with every parameter's states and weights offloaded to host memory."""
    for name, _ in model.named_parameters():
        plan_dict["param_states"][name] = {"stage": 0, "axes": [], "offload": "host", "weights": True}
    return plan_dict


def _weights(plan_dict) -> dict:
    """Tier -> how many parameters the plan keeps with their weights there."""
    counts: dict = {}
    for state in plan_dict["param_states"].values():
        if state.get("weights"):
            counts[state["offload"]] = counts.get(state["offload"], 0) + 1
    return counts


def test_the_planner_offloads_weights_where_states_alone_do_not_fit():
    """At a sixteenth of the model states per device, ZeRO-3 with every state offloaded
    still leaves more weights and gradients on the device than the budget: the planner
    keeps some parameters' stored shards in host memory too, and prices their crossings."""
    budget = _states(WIDE) / 16
    plan = _plan(WIDE, (2,), ("dp",), budget, 2**30)
    assert _weights(plan).get("host", 0) > 0, plan["param_states"]
    p = autopar.Plan.from_dict(plan)
    assert p.predicted.memory["params"] + p.predicted.memory["grads"] < _states(WIDE) / 16 / 2
    assert "offload with weights" in str(p)
    weights = [n for n, s in p.param_states.items() if s.weights]
    model, _, _ = build_case(WIDE)
    numel = dict(model.named_parameters())[weights[0]].numel() // 2   # (its shard on each of 2 ranks)
    device = p.mesh.device
    with_weights = C.offload_seconds("host", numel, 4, False, device, weights=True)
    states_only = C.offload_seconds("host", numel, 4, False, device)
    assert with_weights - states_only == pytest.approx(numel * 4 / device.host_bandwidth)   # one more crossing


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_weights_train_like_one_device(pool2, tier):
    plan = with_tier(_plan(WIDE, (2,), ("dp",), _states(WIDE) / 16, 2**30), tier)
    assert _weights(plan).get(tier, 0) > 0
    result = pool2.run(train_and_compare, WIDE, plan)[0]
    assert result["ok"], result


def test_weights_on_disk_train_at_a_sixteenth_of_the_states(pool2):
    """Model states 16x the budget per rank (bf16 weights, float32 masters): with some
    stored shards on disk as well as the states, the device holds under the budget by the runtime's own accounting and by what
    the step saved for backward; each use copied the shard in, and the arithmetic is that
    of the same plan in host memory."""
    budget = _states(WIDE) / 16
    plan = with_tier(_plan(WIDE, (2,), ("dp",), budget, 2**30, mixed=True), "disk")
    assert _weights(plan).get("disk", 0) > 0 and plan["precision"] is not None
    for r in pool2.run(disk_capacity, WIDE, plan):
        disk, host = r["disk"], r["host"]
        m = disk["measured"]
        on_device = m["params"] + m["grads"] + m["optimizer"] + disk["saved"]
        assert on_device <= budget, (on_device, budget, m)
        assert disk["counts"]["fetched"] > 0 and disk["counts"]["fetched"] == host["counts"]["fetched"], disk["counts"]
        # what host memory held in the host run is on disk now, but for the weights' gradients
        assert m["disk"] + m["offloaded"] == host["measured"]["offloaded"], (m, host["measured"])
        assert any(f.endswith(".weight") for f in disk["files"]), disk["files"]
        assert disk["losses"] == host["losses"] and r["final_loss_disk"] == r["final_loss_host"]


def test_offloaded_weights_with_tensor_parallelism_train_like_one_device(pool4):
    # (any valid plan that offloads weights will do: the budget-bound ILP on (2, 2) took 80-100 s
    # to prove its optimum, a short limit stops it at a valid one)
    plan = _plan(GPT, (2, 2), ("dp", "tp"), 0.25 * 2**20, 2**30, time_limit=1.0)
    assert _weights(plan).get("host", 0) > 0, plan["param_states"]
    result = pool4.run(train_and_compare, GPT, plan)[0]
    assert result["ok"], result


def test_a_time_limit_too_short_for_any_plan_searches_on_with_a_warning(caplog):
    """Under a binding budget the (2, 2) ILP finds no assignment in 1e-9 deterministic seconds:
    the search runs on with a warning naming time_limit and returns a plan within the budget
    (it raised InfeasibleError, "no plan fits", before 2026-12-06)."""
    budget = 0.25 * 2**20
    with caplog.at_level("WARNING", logger="autopar"):
        plan = _plan(GPT, (2, 2), ("dp", "tp"), budget, 2**30, time_limit=1e-9)
    assert any("found no assignment within time_limit=1e-09" in r.getMessage() for r in caplog.records)
    assert sum(plan["predicted"]["memory"].values()) <= budget, plan["predicted"]


def test_weights_read_as_stored_are_fetched_for_each_use(pool2):
    """Megatron's layout reads its weights as they are stored (no gather): offloaded, each
    reader takes a copy the runtime fetches (again in backward), and training equals one
    device, clipped gradients included."""
    from rt_cases import zero3_regather_counts
    model, args, _ = build_case(GPT)
    plan = autopar.plan(model, autopar.Mesh((2,), ("tp",), device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False, layout="megatron-tp")).to_dict()
    plan = _all_weights_in_host_memory(plan, model)
    result = pool2.run(train_and_compare, GPT, plan, 3, 1.0)[0]
    assert result["ok"], result
    counts = pool2.run(zero3_regather_counts, plan, True)[0]
    assert counts["worst"] <= 1e-5, counts
    # forward copies each weight; backward fetches again what a matmul saved (each linear weight)
    linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert counts["fetched"] >= len(dict(model.named_parameters())) + linear, counts


def test_checkpoints_resume_bit_for_bit_between_disk_weights_and_device(pool2, tmp_path):
    disk = with_tier(_plan(WIDE, (2,), ("dp",), _states(WIDE) / 16, 2**30), "disk")
    assert _weights(disk).get("disk", 0) > 0
    device = with_tier(disk, "")
    for k, (saved, loaded) in enumerate(((disk, device), (device, disk))):
        got = pool2.run(resume_bitwise, WIDE, saved, loaded, str(tmp_path / f"ckpt{k}"))
        for r in got:
            assert r["loss"] == 0 and r["param"] == 0, r
        assert (got[0]["disk"][0] > 0) == (saved is disk) and (got[0]["disk"][1] > 0) == (loaded is disk), got[0]


@pytest.mark.parametrize("kind", ["hf-llama"])
def test_offloaded_weights_in_pipeline_stages_train_like_one_device(pool4, kind):
    """Two 1F1B stages, ZeRO-3 inside each, every weight offloaded with its states (a
    Hugging Face family: rotary tables and the causal mask built per stage)."""
    model, args, kwargs = build_case((kind,))
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("pp", "dp"), device="cpu"), args, example_kwargs=kwargs,
                        solve=autopar.SolveOptions(compare=False, layout="zero3"),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2)).to_dict()
    plan = _all_weights_in_host_memory(plan, model)
    result = pool4.run(train_and_compare, (kind,), plan)[0]
    assert result["ok"], result


DEEP = ("autopar", "gpt-tiny", (("hidden", 256), ("batch", 1), ("seq", 8), ("n_layers", 4)))


def _offloaded(plan: autopar.Plan) -> int:
    return sum(1 for s in plan.param_states.values() if s.offload)


def test_the_budget_left_takes_back_a_fraction_of_identical_parameters(monkeypatch):
    """The ILP gives the four identical layers one choice each; what the budget leaves is
    filled by taking some layers' states back to the device (solve/recompute/tiers.fill_device): a
    faster plan within the same budget, with identical parameters split between tiers."""
    import autopar.solve.planner as planner
    model, args, _ = build_case(DEEP)
    budget = _states(DEEP) / 3.0   # (at / 2.8 the ILP's own choice already fills the budget)
    mesh = autopar.Mesh((2,), ("dp",), device=_device(2**30))
    filled = autopar.plan(model, mesh, args, memory_budget=budget, recompute="none",
                          solve=autopar.SolveOptions(compare=False))
    monkeypatch.setattr(planner, "fill_device", lambda problem, best, rule, budget: best)
    whole = autopar.plan(model, mesh, args, memory_budget=budget, recompute="none",
                         solve=autopar.SolveOptions(compare=False))
    assert filled.predicted.memory_total <= budget and whole.predicted.memory_total <= budget
    assert _offloaded(filled) < _offloaded(whole), (_offloaded(filled), _offloaded(whole))
    assert filled.predicted.step_s < whole.predicted.step_s
    split = [f"blocks.{{}}.{suffix}" for suffix in ("ln_1.weight", "ln_1.bias", "attn.q.weight", "attn.q.bias",
                                                     "attn.k.weight", "attn.v.weight", "attn.o.weight",
                                                     "ln_2.weight", "ln_2.bias", "mlp.fc1.weight", "mlp.fc2.weight")]
    tiers = [{getattr(filled.param_states.get(name.format(i)), "offload", "") for i in range(4)} for name in split]
    assert any(len(t) > 1 for t in tiers), tiers   # some set of identical parameters is split between tiers


def test_a_plan_split_between_tiers_trains_like_one_device(pool2):
    model, args, _ = build_case(WIDE)
    plan = autopar.plan(model, autopar.Mesh((2,), ("dp",), device=_device(2**30)), args,
                        memory_budget=_states(WIDE) / 5, recompute="none", solve=autopar.SolveOptions(compare=False))
    tiers = {suffix: {getattr(plan.param_states.get(f"blocks.{i}.{suffix}"), "offload", "") for i in range(2)}
             for suffix in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "mlp.fc1.weight")}
    assert any(len(t) > 1 for t in tiers.values()), tiers   # a layer's weight offloaded, the other's kept
    result = pool2.run(train_and_compare, WIDE, plan.to_dict())[0]
    assert result["ok"], result


def test_pipeline_stages_offload_their_activations_like_one_device(pool2):
    """recompute="offload" inside two 1F1B stages: each stage's layers copy what they save to
    host memory per microbatch and back for its backward; training equals one device."""
    model, args, _ = build_case(GPT)
    plan = autopar.plan(model, autopar.Mesh((2,), ("pp",), device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False), recompute="offload",
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    assert set(plan.recompute.layers.values()) == {"offload"}
    assert "activations offloaded to host memory" in plan.pipeline.summary
    result = pool2.run(train_and_compare, GPT, plan.to_dict())[0]
    assert result["ok"], result


def test_a_tied_weight_offloaded_under_zero3_trains_like_one_device(pool2):
    """gpt-tiny's head is tied to its embedding: under ZeRO-3 the weight is gathered in
    buckets through its gradient-sum point and read by the head as well; offloaded with
    every other weight, its two gradients both reach the host shard (clipped, as one
    device clips them)."""
    model, args, _ = build_case(GPT)
    assert model.lm_head.weight is model.wte.weight
    plan = autopar.plan(model, autopar.Mesh((2,), ("dp",), device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False, layout="zero3")).to_dict()
    plan = _all_weights_in_host_memory(plan, model)
    result = pool2.run(train_and_compare, GPT, plan, 3, 0.05)[0]
    assert result["ok"], result


def test_the_host_memory_the_disk_tier_needs_is_named():
    """Weights kept on disk still have their gradients in host memory while the optimizer
    steps: where host memory cannot hold them, the error says that the disk tier needs it
    and how much (issue 78: it said only that host memory was over)."""
    model, args, _ = build_case(GPT)
    mesh = autopar.Mesh((2,), ("dp",), device=_device(0.02 * 2**20, disk_memory=2**30))
    with pytest.raises(TierCapacityError) as got:
        autopar.plan(model, mesh, args, memory_budget=0.5 * 2**20, recompute="none",
                     solve=autopar.SolveOptions(compare=False))
    text = str(got.value)
    need = re.search(r"with the disk tier this plan needs at least ([0-9.]+)KiB of host memory", text)
    held = re.search(r"keeps ([0-9.]+)KiB per device in host memory", text)
    assert need and held and "more than the 20.48KiB" in text, text
    assert 20.48 < float(need.group(1)) <= float(held.group(1)), text
