"""A step's peak memory has two moments: backward's start (activations and the largest op's
working memory, no gradient yet) and the optimizer step (every gradient and the step's
temporaries).  The predictions are checked against the peaks one H100 measured for
Llama-3-8B-wide layers (docs/gpu/2026-11-26-h100-gpu_memory.json)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

import autopar
from autopar.models import build
from autopar.plan.records import peak_bytes

MEASURED = pathlib.Path(__file__).resolve().parent.parent / "docs" / "gpu" / "2026-11-26-h100-gpu_memory.json"


def test_the_peak_is_the_larger_of_its_two_moments():
    parts = dict(params=2.0, grads=2.0, optimizer=12.0, activations=30.0, working=4.0)
    assert peak_bytes(parts, 16.0) == 2 + 12 + 34          # backward's start holds no gradient
    assert peak_bytes(dict(parts, activations=10.0), 16.0) == 2 + 12 + 2 + 16   # the step's is larger
    assert peak_bytes(parts) == 48


@pytest.mark.parametrize("device,precision,per_element", [
    ("h100", torch.bfloat16, 8.0),   # float32 copy of each gradient + one foreach temporary
    ("h100", None, 4.0),             # the foreach temporary in the parameters' float32
    ("cpu", torch.bfloat16, 4.0),    # Adam steps tensor by tensor: only the gradients' copies
])
def test_the_optimizer_steps_temporaries_per_stepped_element(device, precision, per_element):
    model, example = build("gpt-tiny", device="meta")
    plan = autopar.plan(model, autopar.Mesh((1,), ("dp",), device=device), example, compare=False,
                        mixed_precision=precision)
    elements = sum(p.numel() for p in model.parameters())
    pred = plan.predicted
    assert pred.step_memory == pytest.approx(per_element * elements)
    m = pred.memory
    assert pred.memory_total == pytest.approx(
        m["params"] + m["optimizer"] + max(m["activations"] + m["working"], m["grads"] + pred.step_memory))


def test_zero1_steps_only_the_ranks_chunk():
    model, example = build("gpt-tiny", device="meta")
    mesh = autopar.Mesh((2,), ("dp",), device="h100")
    plan = autopar.plan(model, mesh, example, compare=False, mixed_precision=torch.bfloat16, layout="zero1")
    elements = sum(p.numel() for p in model.parameters())
    assert plan.predicted.step_memory == pytest.approx(8.0 * elements / 2, rel=0.01)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_predicted_peaks_match_the_h100s_measured_ones(recompute):
    runs = {r["recompute"]: r for r in json.loads(MEASURED.read_text()) if r["allocator"] == "default"}
    run = runs[recompute]
    model, example = build("llama3-8b", device="meta", dim=4096, n_layers=run["layers"], n_heads=32, n_kv_heads=8,
                           multiple_of=1024, batch=1, seq=run["seq"])
    plan = autopar.plan(model, autopar.Mesh((1,), ("dp",), device="h100"), example, compare=False,
                        mixed_precision=torch.bfloat16, recompute=recompute)
    pred = plan.predicted
    m = pred.memory
    states = m["params"] + m["optimizer"]
    backward, step = (a for a, _ in (run["phases"]["forward and backward"], run["phases"]["optimizer step"]))
    assert states + m["activations"] + m["working"] == pytest.approx(backward, rel=0.02)
    assert states + m["grads"] + pred.step_memory == pytest.approx(step, rel=0.02)
    assert pred.memory_total == pytest.approx(max(backward, step), rel=0.02)
