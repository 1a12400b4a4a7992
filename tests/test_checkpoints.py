"""Checkpoints that move between plans and meshes, and faults that end cleanly: sharded
state through torch.distributed.checkpoint and autopar.checkpoint, errors naming what does
not fit, the NaN/inf check of train_step."""
from __future__ import annotations

import pytest
from ckpt_cases import (batch_check_window, load_mismatch, mixed_precision_round_trip, non_finite_step,
                        resume_through_plans, rng_round_trip)
from rt_cases import OPTIM, plan_for

import autopar

GPT = ("autopar", "gpt-tiny", (("n_layers", 4),))
DP4 = ((4,), ("dp",))


def test_training_resumes_through_plans_meshes_and_stages(pool4, tmp_path):
    """Data parallel on (4,) -> Megatron x data parallel on (2, 2) -> ZeRO-3 on (4,) -> two
    pipeline stages on (2, 2), one AdamW step under each, model and optimizer passed on by a
    checkpoint (the bare DCP pattern with opt.state_dict(), and autopar.checkpoint, in
    turn): the losses and the final weights equal four uninterrupted steps on one device."""
    piped = plan_for(GPT, "data-parallel", (2, 2), ("pp", "dp"),
                     autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    assert autopar.Plan.from_dict(piped).pipeline.pipelined
    plans = [plan_for(GPT, "data-parallel", *DP4), plan_for(GPT, "megatron-tp x dp", (2, 2), ("dp", "tp")),
             plan_for(GPT, "zero3", *DP4), piped]
    results = pool4.run(resume_through_plans, GPT, plans, str(tmp_path / "ckpt"))
    for r in results:
        assert r["loss"] <= 0 and r["param"] <= 0, r
        assert r["steps_read"] == [2]
    assert len({tuple(r["losses"]) for r in results}) == 1


def test_a_checkpoint_of_another_model_names_the_first_mismatch(pool4, tmp_path):
    """A wider model's checkpoint names the first tensor whose shape differs; a deeper
    model's names the first parameter the loading model lacks; a shallower one, the first
    entry the checkpoint lacks."""
    plan = plan_for(GPT, "zero2", *DP4)
    wider = ("autopar", "gpt-tiny", (("n_layers", 4), ("hidden", 96)))
    msg = pool4.run(load_mismatch, wider, plan_for(wider, "zero2", *DP4), GPT, str(tmp_path / "a"))[0]
    assert "model.wte.weight" in msg and "another size" in msg, msg
    deeper = ("autopar", "gpt-tiny", (("n_layers", 5),))
    msg = pool4.run(load_mismatch, deeper, plan_for(deeper, "zero2", *DP4), GPT, str(tmp_path / "b"))[0]
    assert "blocks.4." in msg and "does not have" in msg, msg
    shallower = ("autopar", "gpt-tiny", (("n_layers", 3),))
    msg = pool4.run(load_mismatch, shallower, plan_for(shallower, "zero2", *DP4), GPT, str(tmp_path / "c"))[0]
    assert "model.blocks.3." in msg and "has no" in msg, msg
    msg = pool4.run(load_mismatch, GPT, plan, GPT, str(tmp_path / "d"), False)[0]
    assert "saved without an optimizer" in msg, msg


def test_checkpoint_keeps_step_extra_plan_and_rng(pool4, tmp_path):
    plan = plan_for(GPT, "megatron-tp x dp", (2, 2), ("dp", "tp"))
    for r in pool4.run(rng_round_trip, GPT, plan, str(tmp_path / "ckpt")):
        assert r == {"same": True, "step": 7, "extra": {"epoch": 3}, "plan_hash": True}


def test_non_finite_loss_or_gradient_stops_every_rank_naming_the_parameter(pool4):
    """An infinite weight in the last block: the third step raises on every rank, naming the
    step and the first parameter whose gradient one device finds non-finite, from train_step
    and from cm.backward's synchronising micro-step alike; with the check off the step
    returns the non-finite loss."""
    for layout, mesh in (("megatron-tp x zero2", ((2, 2), ("dp", "tp"))), ("zero3", DP4), ("data-parallel", DP4)):
        results = pool4.run(non_finite_step, GPT, plan_for(GPT, layout, *mesh), "blocks.3.mlp.fc1.weight")
        first = results[0]["first"]
        assert first is not None
        for r in results:
            assert "step 3" in r["error"] and f"{first!r}" in r["error"], (layout, r)
    for layout in ("zero3", "data-parallel"):   # the same from cm.backward, the accumulation loop's last micro-step
        results = pool4.run(non_finite_step, GPT, plan_for(GPT, layout, *DP4), "blocks.3.mlp.fc1.weight", True,
                            "backward")
        for r in results:
            assert "step 3" in r["error"] and f"{r['first']!r}" in r["error"], (layout, r)
    off = pool4.run(non_finite_step, GPT, plan_for(GPT, "zero3", *DP4), "blocks.3.mlp.fc1.weight", False)
    assert all(r["error"] == "" and r["loss"] != r["loss"] or abs(r["loss"]) == float("inf") for r in off), off


def test_mixed_precision_checkpoint_keeps_master_weights_and_moments(pool4, tmp_path):
    """bf16 with float32 masters: saved under ZeRO-2 on (4,), loaded under Megatron x ZeRO-2
    on (2, 2): masters and AdamW moments bit for bit, compute weights their bf16 casts."""
    a = plan_for(GPT, "zero2", *DP4, mixed_precision="bf16")
    b = plan_for(GPT, "megatron-tp x zero2", (2, 2), ("dp", "tp"), mixed_precision="bf16")
    for r in pool4.run(mixed_precision_round_trip, GPT, a, b, str(tmp_path / "ckpt")):
        assert r == {"masters": 0.0, "moments": 0.0, "compute": 0.0, "dtypes": ["torch.bfloat16"], "moved": True}



def test_the_batch_hash_check_covers_the_calls_asked_for(pool4):
    """compile(check_inputs=n): a rank passing another global batch on call n is caught on
    every rank; on call n + 1 it is not looked for (check_inputs=0: never)."""
    plan = plan_for(GPT, "data-parallel", *DP4)
    caught = pool4.run(batch_check_window, GPT, plan, 5, 5)
    assert all("rank 1 passed a different input" in e for e in caught), caught
    assert pool4.run(batch_check_window, GPT, plan, 4, 5) == [""] * 4
    assert pool4.run(batch_check_window, GPT, plan, 0, 1) == [""] * 4


def test_a_failed_save_never_blocks_a_resume(pool4, tmp_path):
    """The habits of a resumable loop, with saves that fail: a first run's
    load(latest(...)) says there is nothing to resume; an `extra` JSON cannot hold is refused
    on every rank before any shard is written; a full disk while rank 0 writes the record
    fails the save on every rank naming rank 0; latest() passes over a stale `*.partial` with
    a truncated record and a complete save whose record was damaged (warning with its path),
    so the job resumes from the last good one; a flipped byte in a shard is found on load."""
    from ckpt_cases import failed_saves
    plan = plan_for(GPT, "zero2", *DP4)
    results = pool4.run(failed_saves, GPT, plan, str(tmp_path / "ckpt"))
    for r in results:
        assert "nothing to load" in r["first_run"] and "first run" in r["first_run"], r["first_run"]
        assert "extra=" in r["bad_extra"] and "JSON" in r["bad_extra"], r["bad_extra"]
        assert r["left_behind"] == ["step1"], r["left_behind"]
        assert "failed on rank 0" in r["full_disk"] and "No space left" in r["full_disk"], r["full_disk"]
        assert r["latest"] == "step1", r
        assert any("step5" in w and "damaged" in w for w in r["warned"]), r["warned"]
        assert "step5" in r["damaged_record"] and "damaged" in r["damaged_record"], r["damaged_record"]
        assert r["loads"] == 1
        assert ".distcp" in r["flipped"] and "damaged" in r["flipped"], r["flipped"]
    assert len({r["flipped"] for r in results}) == 1   # (every rank names the same shard)


def test_a_stalled_optimizer_step_is_named(pool4):
    """ZeRO's all-gathers after the optimizer's update are named when they stall, as the
    step's own collectives are (before, a bare backend timeout with nothing said of what ran);
    an LR scheduler still wraps the step."""
    from ckpt_cases import stalled_optimizer_step
    for r in pool4.run(stalled_optimizer_step, GPT, plan_for(GPT, "zero2", *DP4)):
        assert r["lr"] == pytest.approx(0.5 * OPTIM["lr"]) and r["warned"] == [], r
        assert "the optimizer step after step 2" in r["error"] and "Timed out" in r["error"], r["error"]
