"""Jobs launched as a user launches them, with torchrun: a rank killed mid-run and a rank
that stalls, each followed by torchrun's restart and a resume from the last checkpoint
(examples/train_resumable.py), on one node and on two torchrun agents sharing a c10d
rendezvous on localhost."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from autopar.models import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_resumable.py")


def _example():
    spec = importlib.util.spec_from_file_location("train_resumable", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(steps: int) -> list:
    """The example's losses trained on one device, uninterrupted."""
    torch.manual_seed(0)
    model, example = build("gpt-tiny", hidden=128, n_heads=4, batch=8, seq=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = model(*_example().batch_of(step, example))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _log(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _check_resumed(rows: list, steps: int, again: int | None) -> None:
    """Every step logged once, but step `again` twice (before the fault and after the
    resume), bit-identical; all within tolerance of one uninterrupted device."""
    reference = _reference(steps)
    by_step: dict = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == list(range(steps)), rows
    assert [len(by_step[s]) for s in range(steps)] == [2 if s == again else 1 for s in range(steps)], rows
    if again is not None:
        assert by_step[again][0]["loss"] == by_step[again][1]["loss"], rows
    for step, seen in by_step.items():
        for r in seen:
            assert abs(r["loss"] - reference[step]) <= 1e-5 * abs(reference[step]) + 1e-6, (step, r, reference)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun restarts need fork and signals")
def test_killed_rank_on_a_second_node_restarts_and_resumes_exactly(tmp_path):
    """Two torchrun agents (--nnodes 2, 2 ranks each, the mesh's outer axis across them);
    rank 3 is killed (SIGKILL) after step 3 of 4 on the first attempt.  The other ranks end
    with an error naming the collective, torchrun restarts both nodes' workers, the job
    resumes from the step-2 checkpoint and finishes; the losses equal an uninterrupted run's."""
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
           "--max-restarts", "1", SCRIPT, "--mesh", "2x2", "--checkpoints", str(tmp_path / "ckpt"),
           "--steps", "4", "--save-every", "2", "--kill-at", "3", "--kill-rank", "3",
           "--loss-log", str(tmp_path / "losses.jsonl")]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                              cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    text = "\n".join(outs)
    assert "resumed from" in text and "step_2" in text, text[-3000:]
    assert "CollectiveError" in text and "torch.distributed." in text, text[-3000:]
    _check_resumed(_log(tmp_path / "losses.jsonl"), 4, 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun restarts need fork and signals")
def test_stalled_rank_ends_every_rank_by_the_timeout_and_the_job_resumes(tmp_path):
    """Four ranks on one node, compile(timeout=TIMEOUT_S): rank 1 sleeps after step 2 of 4.
    Every other rank stops with a CollectiveError naming the timeout and the collective
    within the timeout (plus the time to notice), torchrun ends the sleeper and restarts the
    job (each attempt's ranks meet under their own store prefix), which resumes from the
    step-2 checkpoint.  On a loaded machine (other jobs on the same cores) starting a job
    takes longer: the recovery is bounded by the timeout plus what starting the first
    attempt took in the same run, and the timeout leaves room for ranks that trace and
    plan at different speeds."""
    timeout_s = 15
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "--max-restarts", "1", SCRIPT, "--mesh", "2x2", "--checkpoints", str(tmp_path / "ckpt"),
           "--steps", "4", "--save-every", "1", "--stall-at", "2", "--timeout", str(timeout_s),
           "--loss-log", str(tmp_path / "losses.jsonl")]
    env = _env()
    del env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]   # one node: the shared store, one prefix per attempt
    launched = time.time()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                          timeout=600)
    text = done.stdout
    assert done.returncode == 0, text[-4000:]
    starting = float(re.search(r"attempt 0: ready at ([\d.]+)", text).group(1)) - launched
    stalled = float(re.search(r"stalls after step \d+ at ([\d.]+)", text).group(1))
    resumed = float(re.search(r"attempt 1: resumed from \S+ at step 2 at ([\d.]+)", text).group(1))
    assert f"collective timeout of {timeout_s} s" in text and "CollectiveError" in text, text[-4000:]
    assert re.search(r"torch\.distributed\.\w+ called by \w+", text), text[-4000:]
    # the stall ends every rank after the timeout; the restarted job has then started,
    # compiled and loaded its checkpoint, which takes about what the first attempt's start took
    assert resumed - stalled < timeout_s + 2 * starting + 15, (resumed - stalled, starting)
    print(f"stall to resumed job: {resumed - stalled:.1f} s (timeout {timeout_s} s, first start {starting:.1f} s)")
    rows = _log(tmp_path / "losses.jsonl")
    assert [r["attempt"] for r in rows] == [0, 0, 1, 1], rows
    _check_resumed(rows, 4, None)
