"""The process's tracing cache (autopar/trace/cache.py): a trace it hands out is shared and
read only (a whole plan() leaves it as it found it, node for node and entry for entry), a
copy is the caller's own to rewrite, and the outline exchange between two caches lets one
write a batch size it never exported, equal to the export at that size."""
from __future__ import annotations

import pickle

import torch

import autopar
from autopar.models import build
from autopar.trace.cache import TRACES, TraceCache, batch_family, fingerprint
from autopar.trace.export import graph_signature, trace
from test_rebatch import _facts as facts   # (per node: op, name, target, wiring, tensor facts)


def _llama(batch: int, seq: int):
    """autopar's Llama with 8 layers (enough to be unrolled), its inputs at `batch` rows."""
    model, inputs = build("llama3-8b", device="meta", batch=batch, seq=seq, n_layers=8, dim=64, n_heads=4,
                          n_kv_heads=2, vocab=128)
    return model, tuple(inputs)


def _snapshot(traced) -> tuple:
    """Everything a holder of a shared trace could change: the nodes themselves (by
    identity), their facts, meta keys and module stacks, the graph's code, and the Traced's
    dicts and lists."""
    nodes = list(traced.graph.graph.nodes)
    return ([id(n) for n in nodes], facts(traced), [sorted(n.meta) for n in nodes],
            [repr(n.meta.get("nn_module_stack")) for n in nodes], id(traced.graph), id(traced.graph.graph),
            dict(traced.params), dict(traced.buffers), list(traced.user_inputs), dict(traced.tied),
            {k: (tuple(v.shape), v.dtype) for k, v in traced.constants.items()}, sorted(traced.parts.parts))


def test_a_plan_reads_the_shared_trace_and_leaves_it_as_it_was():
    """Planning twice traces once: both plans read the one cached trace (the cache holds no
    more entries after them), and after each the trace is the same object with the same
    nodes, facts, meta and dicts; its signature is the plans' and a fresh export's."""
    model, inputs = _llama(batch=4, seq=28)   # (a sequence length no other test traces)
    shared = trace(model, inputs, unroll=True, shared=True)
    assert trace(model, inputs, unroll=True, shared=True) is shared
    before, entries = _snapshot(shared), len(TRACES)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"))
    plans = [autopar.plan(model, mesh, inputs) for _ in range(2)]
    assert len(TRACES) == entries
    assert trace(model, inputs, unroll=True, shared=True) is shared
    assert _snapshot(shared) == before
    signature = graph_signature(trace(model, inputs, cache=False).graph)
    assert plans[0].graph == plans[1].graph == graph_signature(shared.graph) == signature
    assert plans[0] == plans[1]


def test_a_copy_is_the_callers_to_rewrite():
    """trace(shared=False) gives a copy: its own graph and dicts, rewritten here (a node
    added, one renamed, a parameter dropped) without the cached trace seeing any of it."""
    model, inputs = _llama(batch=2, seq=28)
    shared = trace(model, inputs, unroll=True, shared=True)
    before = _snapshot(shared)
    mine = trace(model, inputs, unroll=True)
    assert mine is not shared and mine.graph is not shared.graph
    assert facts(mine) == facts(shared)
    graph = mine.graph.graph
    first = next(n for n in graph.nodes if n.op == "call_function")
    with graph.inserting_after(first):
        doubled = graph.call_function(torch.ops.aten.mul.Tensor, (first, 2))
    doubled.meta["val"] = first.meta["val"]
    first.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    first.name = "renamed"
    mine.graph.recompile()
    mine.params.pop(next(iter(mine.params)))
    assert len(mine.graph.graph.nodes) == len(shared.graph.graph.nodes) + 1
    assert graph_signature(mine.graph) != graph_signature(shared.graph)
    assert len(mine.params) == len(shared.params) - 1
    assert _snapshot(shared) == before
    assert trace(model, inputs, unroll=True, shared=True) is shared


def _export(cache: TraceCache, model, inputs):
    """Export the planning trace of model(*inputs) and keep it in `cache` as trace() does."""
    traced = trace(model, inputs, cache=False, unroll=True)
    cache.store(fingerprint(model, inputs, {}), traced, unroll=True, exported=batch_family(model, inputs, {}))
    return traced


def test_outlines_adopted_from_another_cache_write_a_batch_equal_to_its_export():
    """As the pipeline search's processes do: cache `there` exports 2 rows and sends its
    outlines (pickled); cache `here` exports 8 rows, adopts them, and writes 4 rows from the
    two, equal to the export at 4 rows.  Without the adopted outline it cannot."""
    model, inputs = _llama(batch=8, seq=24)
    at = {b: tuple(t[:b] for t in inputs) for b in (8, 4, 2)}
    family = {b: batch_family(model, at[b], {}) for b in at}
    assert family[8].fingerprint == family[2].fingerprint and family[4].batch == 4

    there = TraceCache()
    two = _export(there, model, at[2])
    sent = pickle.dumps(there.exported_outlines(two))
    assert there.exported_outlines(two.copy()) == {}   # (only the cached object is known)

    here = TraceCache()
    _export(here, model, at[8])
    assert here.written(family[4]) is None   # (one export alone does not show the batch's role)
    found = pickle.loads(sent)
    assert list(found) == [family[2].fingerprint] and list(found[family[2].fingerprint]) == [2]
    here.adopt_outlines(found)
    written = here.written(family[4])
    assert written is not None and len(here) == 1
    assert facts(written) == facts(trace(model, at[4], cache=False, unroll=True))

    here.clear()
    assert len(here) == 0 and here.written(family[4]) is None
    assert here.find(fingerprint(model, at[8], {}), unroll=True) is None
    assert there.find(fingerprint(model, at[2], {}), unroll=True) is two
