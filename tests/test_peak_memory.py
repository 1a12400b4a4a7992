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
from autopar.report.records import peak_bytes

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
    plan = autopar.plan(model, autopar.Mesh((1,), ("dp",), device=device), example,
                        solve=autopar.SolveOptions(compare=False), mixed_precision=precision)
    elements = sum(p.numel() for p in model.parameters())
    pred = plan.predicted
    assert pred.step_memory == pytest.approx(per_element * elements)
    m = pred.memory
    assert pred.memory_total == pytest.approx(
        m["params"] + m["optimizer"] + max(m["activations"] + m["working"], m["grads"] + pred.step_memory))


def test_zero1_steps_only_the_ranks_chunk():
    model, example = build("gpt-tiny", device="meta")
    mesh = autopar.Mesh((2,), ("dp",), device="h100")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="zero1"),
                        mixed_precision=torch.bfloat16)
    elements = sum(p.numel() for p in model.parameters())
    assert plan.predicted.step_memory == pytest.approx(8.0 * elements / 2, rel=0.01)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_predicted_peaks_match_the_h100s_measured_ones(recompute):
    runs = {r["recompute"]: r for r in json.loads(MEASURED.read_text()) if r["allocator"] == "default"}
    run = runs[recompute]
    model, example = build("llama3-8b", device="meta", dim=4096, n_layers=run["layers"], n_heads=32, n_kv_heads=8,
                           multiple_of=1024, batch=1, seq=run["seq"])
    plan = autopar.plan(model, autopar.Mesh((1,), ("dp",), device="h100"), example,
                        solve=autopar.SolveOptions(compare=False), mixed_precision=torch.bfloat16, recompute=recompute)
    pred = plan.predicted
    m = pred.memory
    states = m["params"] + m["optimizer"]
    backward, step = (a for a, _ in (run["phases"]["forward and backward"], run["phases"]["optimizer step"]))
    assert states + m["activations"] + m["working"] == pytest.approx(backward, rel=0.02)
    assert states + m["grads"] + pred.step_memory == pytest.approx(step, rel=0.02)
    assert pred.memory_total == pytest.approx(max(backward, step), rel=0.02)


def _optimizer(chunk_bytes, masters: bool, disk=None):
    """A ShardedOptimizer over three bf16 weights of one rank (float32 masters where
    `masters`; kept in runtime.state.disk.DiskStore `disk` between steps where given), with
    gradients as backward leaves them."""
    from types import SimpleNamespace

    from autopar.runtime.state.disk import wait
    from autopar.runtime.state.sharded_optimizer import ShardedOptimizer

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if masters else torch.float32
    shards = {k: torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype))
              for k, n in (("a", 300), ("b", 40), ("c", 500))}
    state = SimpleNamespace(shards=shards, zero_layouts={}, zero_grads={}, groups=None,
                            masters={k: torch.nn.Parameter(p.detach().float()) for k, p in shards.items()}
                            if masters else {}, disk=disk, disk_keys=frozenset(shards) if disk else frozenset(),
                            master_file=lambda k: f"{k}.master")
    if disk is not None:
        wait(disk.spill((f"{k}.master", m) for k, m in state.masters.items()))
    opt = ShardedOptimizer(state, torch.optim.AdamW, 1 << 20, chunk_bytes, lr=0.1, weight_decay=0.1)
    return opt, shards, gen


@pytest.mark.parametrize("masters", [True, False])
def test_stepping_in_runs_equals_one_step(masters, monkeypatch):
    """Stepped in runs of at most 1,600 bytes (three runs: a + b, then c alone, larger than a
    run), every weight, master and moment equals the step over all at once, and the
    gradients backward left are still there after the step."""
    seen = []
    results = []
    for chunk in (None, 1600):
        opt, shards, gen = _optimizer(chunk, masters)
        inner_step = opt.optimizer.step
        monkeypatch.setattr(opt.optimizer, "step", lambda *a, _s=inner_step, _o=opt: (
            seen.append((chunk, sum(1 for g in _o.optimizer.param_groups for p in g["params"]
                                    if p.grad is not None))), _s(*a))[1])
        for _ in range(3):
            for p in shards.values():
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            grads = {k: p.grad for k, p in shards.items()}
            opt.step()
            assert all(shards[k].grad is grads[k] for k in shards)
            opt.zero_grad()
        results.append(({k: p.detach().clone() for k, p in shards.items()},
                        [{n: v.clone() for n, v in s.items()} for s in opt.optimizer.state.values()]))
    (w0, s0), (w1, s1) = results
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    for a, b in zip(s0, s1):
        for n in a:
            assert torch.equal(a[n], b[n]), n
    assert [n for c, n in seen if c is None] == [3, 3, 3]
    assert [n for c, n in seen if c == 1600] == [2, 1] * 3


def test_states_on_disk_step_in_runs_like_states_in_memory(tmp_path):
    """Masters and moments kept on disk between steps, read back run by run (the next run
    read while this one steps) and written out after: the weights, masters and moments
    equal those of the same optimizer with everything in memory, and between steps the
    store holds every master and moment while memory holds none of them."""
    from autopar.runtime.state.disk import DiskStore, wait
    store = DiskStore(tmp_path, 0)
    runs = []
    for disk in (None, store):
        opt, shards, gen = _optimizer(1600, True, disk)
        for _ in range(3):
            for p in shards.values():
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
            opt.zero_grad()
        if disk is not None:
            assert all(m.numel() == 0 for m in opt.rank_state.masters.values())
            assert store.disk_bytes == (300 + 40 + 500) * 4 * 3   # float32 master, exp_avg, exp_avg_sq
            wait(store.fetch(opt._on_disk(opt.entries)))
        runs.append(({k: p.detach().clone() for k, p in shards.items()},
                     {k: m.detach().clone() for k, m in opt.rank_state.masters.items()},
                     [{n: v.clone() for n, v in s.items()} for s in opt.optimizer.state.values()]))
    (w0, m0, s0), (w1, m1, s1) = runs
    assert all(torch.equal(w0[k], w1[k]) and torch.equal(m0[k], m1[k]) for k in w0)
    for a, b in zip(s0, s1):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert store.read_bytes > 0 and store.written_bytes >= store.read_bytes
    store.close()
