"""The published-runs replay (benchmarks/published_runs.py): the data file's rows carry their
sources and the fixed fit/held-out split, and one row replays into the numbers the script
reports (predicted tokens/s/GPU from the forced plan's step, against the source's)."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

import autopar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import published_runs as R  # noqa: E402

RUNS = json.loads(R.DATA.read_text())["runs"]


def test_rows_name_their_source_and_the_split_follows_the_fixed_rule():
    ids = [r["id"] for r in RUNS]
    assert len(ids) == len(set(ids)) >= 25
    assert all(r["reference"] and r["source"] for r in RUNS)
    for k, r in enumerate(sorted(RUNS, key=lambda r: r["id"])):   # decided before anything was predicted
        assert r["split"] == ("held_out" if k % 3 == 2 else "fit"), r["id"]
    assert all(r["fp8"] == (r["precision"] == "fp8") for r in RUNS)
    sources = {r["source"] for r in RUNS if not r["fp8"]}
    assert len([s for s in sources if sum(r["source"] == s and not r["fp8"] for r in RUNS) >= 4]) >= 4


def test_measured_throughput_is_read_in_the_sources_own_terms():
    nar = next(r for r in RUNS if r["id"] == "nar21-a100-gpt39b-512gpu-tp8-pp2")
    value, how = R.measured_tokens_per_s(nar)
    assert value == pytest.approx(nar["derived"]["tokens_per_s_per_gpu_from_paper_flops"]) and "paper" in how
    meg = next(r for r in RUNS if r["source"] == "megatron-lm-readme")
    value, _ = R.measured_tokens_per_s(meg)
    m, s = meg["model"], meg["seq_len"]
    per_token = 72 * m["n_layers"] * m["hidden"] ** 2 * (1 + s / (6 * m["hidden"])) + 6 * m["vocab"] * m["hidden"]
    assert value == pytest.approx(meg["measured"]["tflops_per_gpu"] * 1e12 / per_token)


def test_one_row_replays_into_predicted_over_measured():
    run = next(r for r in RUNS if r["id"] == "kor22-a100-gpt22b-8gpu-tp8-pp1-sp-selective")
    row = R.replay(run, free=False)
    tokens = run["global_batch_sequences"] * run["seq_len"]
    assert row["layout"] == "megatron-sp" and row["measured"] == pytest.approx(tokens / (run["measured"]["step_s"] * 8))
    assert row["predicted"] == pytest.approx(tokens / (row["step_s"] * 8))
    assert row["ratio"] == pytest.approx(row["predicted"] / row["measured"])
    assert 0.5 < row["ratio"] < 2.0   # a sanity band, not the accuracy target (see the script's summary)


def test_an_accumulating_run_and_autopars_own_plan_are_priced_for_its_micro_steps():
    """Megatron-LM's 7.1B GPT on 96 H100 accumulates 4 micro-steps a step: both its forced
    layout and autopar's own plan are planned with accumulation=4 and the whole step is 4
    micro-steps less the overlaps the run states.  Priced per single micro-step, the own plan
    came out 0.98x the published layout; priced for the 4, no more than 1 % below it (and
    above it since autopar's runtime runs tensor-parallel collectives beside their GEMMs,
    part of what Megatron-LM's --tp-comm-overlap hides)."""
    run = next(r for r in RUNS if r["id"] == "meg24-h100-gpt7.1b-96gpu-tp2-pp1")
    assert R.forced(run)[1]["pricing"].accumulation == R.accumulation(run) == 4
    row = R.replay(run)
    assert row["accumulation"] == 4
    assert row["speedup"] > 0.99, row
    if row["speedup"] < 0.995:   # the replay names what decides beyond half a percent
        assert "the run's own overlaps" in row["free"], row


def test_a_fused_loss_kernel_keeps_the_logits_gradient_alone():
    """llm-foundry's MPT runs use a fused cross-entropy (the data file's loss_kernel): its
    backward writes the logits' gradient alone, where F.cross_entropy's also holds the
    log-probabilities' gradient, one logits-sized tensor more. MPT-350M at 18 x 2,048 tokens
    a GPU then fits an A100-40GB, as it ran."""
    run = next(r for r in RUNS if r["id"] == "mosaic-a100-40gb-mpt350m-s2048-16gpu-bf16")
    assert run["loss_kernel"] == "fused"
    model, example = R.build_model(run)
    mesh, kw = R.forced(run)
    assert mesh.device.kernels.cross_entropy == "fused"
    torch_mesh = autopar.Mesh(mesh.shape, mesh.axis_names, device=dataclasses.replace(
        mesh.device, kernels=mesh.device.kernels.with_cross_entropy("torch")))
    fused, plain = (autopar.plan(model, m, example, **kw).predicted for m in (mesh, torch_mesh))
    logits = 18 * 2048 * run["model"]["vocab"] * 2   # bf16, one GPU's micro-batch
    # the largest op's backward: the loss's, two logits-sized gradients under F.cross_entropy;
    # fused, one (the next largest op, the head's backward, comes close)
    assert plain.memory["working"] == pytest.approx(2 * logits, rel=0.01)
    assert logits <= fused.memory["working"] < 1.1 * logits
    assert fused.memory["activations"] == plain.memory["activations"]
    assert fused.memory_total <= mesh.device.memory < plain.memory_total
    row = R.replay(run, free=False)
    assert not row["over_memory"], row


def test_a_run_without_stated_tensor_parallel_overlap_is_priced_without_autopars():
    """torchtitan's 8B on 64 H100 under FSDP x TP, run with and without async TP: the
    vanilla row is planned with autopar.plan(tp_overlap=False), its TP collectives whole,
    the async row with autopar's folds standing for async TP; the vanilla step is at least
    the async one's plus what the folds hide (4 micro-steps' worth where the run
    accumulates; the ILP solves the two prices apart).  autopar's own footing takes the
    folding plan for both rows, and a plan priced for the other footing is refused."""
    rows = {}
    for name in ("vanilla-tp", "async-tp"):
        run = next(r for r in RUNS if r["id"] == f"tt25-asynctp-8b-64gpu-fsdp8-tp8-bf16-{name}")
        model, example = R.build_model(run)
        mesh, kw = R.forced(run)
        assert kw["pricing"].tp_overlap == (name == "async-tp")
        rows[name] = (run, autopar.plan(model, mesh, example, **kw))
    (vanilla, whole), (fast, folded) = rows["vanilla-tp"], rows["async-tp"]
    assert whole.predicted.linear_hidden_s == {} and not whole.tp_overlap
    hidden = sum(folded.predicted.linear_hidden_s.values())
    assert hidden > 0.01 * folded.predicted.step_s
    assert R.step_seconds(whole, vanilla) - R.step_seconds(folded, fast) >= folded.accumulation * hidden * (1 - 1e-9)
    assert R.step_seconds(folded, vanilla, "autopar") == pytest.approx(R.step_seconds(folded, fast, "autopar"),
                                                                       rel=1e-12)
    assert R.step_seconds(folded, fast, "autopar") == pytest.approx(folded.accumulation * folded.predicted.step_s,
                                                                    rel=1e-12)
    with pytest.raises(ValueError, match="plan it with tp_overlap=True"):
        R.step_seconds(whole, vanilla, "autopar")
    with pytest.raises(ValueError, match="plan it with tp_overlap=False"):
        R.step_seconds(folded, vanilla)
    with pytest.raises(ValueError, match="runtime 'own'"):
        R.step_seconds(folded, vanilla, "own")


def test_the_allocators_reserve_is_fitted_on_fitting_rows_and_predicts_the_held_out_ones():
    """torchtitan reports the caching allocator's reserved peak (measured.memory_kind); the
    replay converts its predicted allocated peak with one ratio, fitted on the fitting bf16
    rows alone, and the held-out bf16 rows' reserved peaks come within issue 39's 5 %.  A
    held-out row's own measurement moves nothing in the fit."""
    ids = ("tt24-t1-8b-8gpu-fsdp", "tt24-t3-8b-128gpu-fsdp-compile",     # fitting
           "tt24-t1-8b-8gpu-fsdp-compile", "tt24-t3-8b-128gpu-fsdp")      # held out
    runs = {r["id"]: r for r in RUNS}
    assert all(runs[i]["measured"]["memory_kind"] == "reserved" and not runs[i]["fp8"] for i in ids)
    rows = [R.replay(runs[i], free=False) for i in ids]
    assert [r["split"] for r in rows] == ["fit", "fit", "held_out", "held_out"]
    reserve = R.allocator_reserve(rows)
    fitting = sorted(r["measured_memory_gib"] / r["memory_gib"] for r in rows[:2])
    assert reserve == pytest.approx(sum(fitting) / 2)   # the median of the two fitting rows
    assert 1.0 < reserve < 1.4   # a reserved peak above the allocated one, in the published range
    moved = [dict(rows[2], measured_memory_gib=2 * rows[2]["measured_memory_gib"])] + rows[:2]
    assert R.allocator_reserve(moved) == reserve
    for r in rows[2:]:
        assert R.memory_predicted(r, reserve) == pytest.approx(r["memory_gib"] * reserve)
        assert abs(R.memory_predicted(r, reserve) / r["measured_memory_gib"] - 1) <= 0.05, r["id"]
    allocated = dict(rows[2], memory_kind="allocated")
    assert R.memory_predicted(allocated, reserve) == rows[2]["memory_gib"]
    assert R.allocator_reserve([dict(r, split="held_out") for r in rows]) is None


def test_fsdp_over_the_context_parallel_ranks_shards_the_states_there():
    """torchtitan's FSDP 1 x CP 8 stores the parameters sharded over the 8 context-parallel
    ranks: forced as context-parallel x zero3 on the one axis, its states are an eighth and
    it fits where it ran (replicated states, 160 GiB, did not)."""
    run = next(r for r in RUNS if r["id"] == "tt24-t2-8b-8gpu-fsdp1-cp8-s256k")
    assert R.forced(run)[1]["solve"].layout == "context-parallel x zero3"
    row = R.replay(run, free=False)
    assert not row["over_memory"] and row["memory_gib"] < run["measured"]["memory_gib"]
