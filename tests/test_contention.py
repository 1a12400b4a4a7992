"""Contention: a gradient bucket or a prefetched weight gather runs on its own stream, but
it shares links with the device's own collectives.  Where both use the same links (the
network where a group spans nodes, else NVLink) the transfer waits while the device's
collective runs, so the pair takes their sum; on different links both run at once."""
from __future__ import annotations

import json

import pytest

import autopar
import autopar.solve.assemble as assemble
from autopar.models import build
from autopar.report.plan import Plan
from autopar.solve.assemble import hidden_gradient_seconds, hidden_prefetch_seconds


def test_a_bucket_waits_while_the_device_holds_its_link():
    """Backward runs op 3 (1 s of compute), op 2 (1 s of its own collective on the
    network), op 1 (1 s of compute); a 1.5 s bucket is ready after op 3."""
    ops = {3: (1.0, {}), 2: (0.0, {"network": 1.0}), 1: (1.0, {})}
    # on the network it waits out op 2's collective, runs 1 s under op 1: 0.5 s left over
    assert hidden_gradient_seconds(ops, {3: {"network": 1.5}}) == pytest.approx(1.0)
    # on NVLink it runs beside the network collective: all hidden
    assert hidden_gradient_seconds(ops, {3: {"nvlink": 1.5}}) == pytest.approx(1.5)
    # on no named link (plain seconds) nothing contends, as before links were priced
    assert hidden_gradient_seconds(ops, {3: 1.5}) == pytest.approx(1.5)
    # the stream is in order: an NVLink bucket queued behind a waiting network one waits too
    assert hidden_gradient_seconds(ops, {3: {"network": 0.5, "nvlink": 0.5}}) == pytest.approx(0.5 + 0.5)
    ops_first = {3: (0.0, {"network": 1.0}), 2: (1.0, {}), 1: (0.0, {"network": 1.0})}
    # ready after op 3; 1 s of compute, then op 1's collective holds the network: 0.5 s left
    assert hidden_gradient_seconds(ops_first, {3: {"network": 1.5}}) == pytest.approx(1.0)


def test_a_prefetched_gather_waits_while_the_device_holds_its_link():
    """Forward runs ops 1-3; op 3's gather starts when op 1 reads its own, and runs while
    op 1 computes (1 s) and op 2 runs a 1 s collective."""
    ops = {1: (1.0, {}), 2: (0.0, {"network": 1.0}), 3: (1.0, {})}
    gathers = {1: {"network": 0.5}, 3: {"network": 1.5}}
    # the first gather waits in full; op 3's progresses 1 s under op 1, waits out op 2
    assert hidden_prefetch_seconds(ops, gathers) == pytest.approx(1.0)
    assert hidden_prefetch_seconds(ops, {1: {"network": 0.5}, 3: {"nvlink": 1.5}}) == pytest.approx(1.5)
    # plain numbers: compute alone, as before
    assert hidden_prefetch_seconds({1: 1.0, 2: 1.0, 3: 1.0}, {1: 0.5, 3: 1.5}) == pytest.approx(1.5)


def _llama():
    return build("llama3-8b", device="meta", batch=8, seq=2048, n_layers=2)


def _unlinked(monkeypatch, model, example, mesh, layout):
    monkeypatch.setattr(assemble, "link", lambda mesh, axis: None)
    try:
        return autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout),
                            mixed_precision=autopar.MixedPrecision()).predicted
    finally:
        monkeypatch.undo()


def test_tensor_parallel_across_nodes_contends_with_the_data_parallel_buckets(monkeypatch):
    """Megatron TP and data parallelism on 2 x 2 H100.  One GPU per node: the TP
    all-reduces of backward and the gradient buckets share the NICs, and the plan hides
    less; two per node: TP runs on NVLink, the buckets on the network, nothing waits."""
    model, example = _llama()
    for per_node, shared in ((1, True), (2, False)):
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="h100", devices_per_node=per_node)
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp x dp"),
                            mixed_precision=autopar.MixedPrecision())
        p = plan.predicted
        free = _unlinked(monkeypatch, model, example, mesh, "megatron-tp x dp")
        assert p.step_s == pytest.approx(p.compute_s + sum(p.comm_s.values()) - p.hidden_s)
        assert p.hidden_s + p.contended_s == pytest.approx(free.hidden_s, rel=1e-9)
        assert p.step_s == pytest.approx(free.step_s + p.contended_s, rel=1e-9)
        if shared:
            # well over a millisecond of buckets waits behind the TP all-reduces
            assert p.contended_s > 0.1 * p.hidden_s > 0
            assert "hold the same links" in str(p)
            again = Plan.from_dict(json.loads(plan.to_json())).predicted
            assert again.contended_s == pytest.approx(p.contended_s)
        else:
            assert p.contended_s == 0.0 and p.hidden_s > 0
            assert "same links" not in str(p)


def test_cpu_ranks_price_no_contention():
    """gloo reduces on the cores the compute uses: nothing overlaps, nothing contends."""
    model, example = build("gpt-tiny")
    p = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"), example,
                     solve=autopar.SolveOptions(compare=False, layout="megatron-tp x dp")).predicted
    assert p.hidden_s == 0.0 and p.contended_s == 0.0
    assert assemble.link(autopar.Mesh((2,), ("dp",), device="cpu"), 0) is None
