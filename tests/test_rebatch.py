"""The planning trace at another batch size, written from two exports of the same model
(autopar/trace/rebatch.py), equals the export at that size node for node: names, ops, wiring,
arguments, shapes, strides, dtypes and requires_grad, on autopar's Llama and every Hugging
Face family; a graph whose shapes are not proportional to the batch, or whose ops change
with it, is exported."""
from __future__ import annotations

import logging
import pickle

import hf_archs
import pytest
import torch
import torch.fx as fx

from autopar.models import build
from autopar.trace.rebatch import outline, rebatched
from autopar.solve.forked import forked_map
from autopar.trace.cache import TRACES
from autopar.trace.export import graph_signature, trace

LAYERS = 7   # (enough layers to be unrolled: the search's traces are)


def _facts(traced) -> list:
    def val(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad
        if isinstance(v, (list, tuple)):
            return tuple(val(x) for x in v)
        return repr(v)
    return [(n.op, n.name, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)),
             val(n.meta.get("val"))) for n in traced.graph.graph.nodes]


def _inputs(family, seq: int = 16):
    """(model, rows -> (args, kwargs) at that many rows) of a family."""
    if family == "ours":
        model, inputs = build("llama3-8b", device="meta", batch=8, seq=seq, n_layers=LAYERS + 1, dim=64, n_heads=4,
                              n_kv_heads=2, vocab=128)
        return model, lambda b: (tuple(t[:b] for t in inputs), {})
    model, kwargs = hf_archs.build(family)   # (two layers: exported whole, which is quicker)
    wide = {k: torch.cat([v, v]) for k, v in kwargs.items()}   # 8 rows
    return model, lambda b: ((), {k: v[:b] for k, v in wide.items()})


@pytest.mark.parametrize("family", ["ours"] + hf_archs.FAMILIES + hf_archs.FUSED + hf_archs.MOE)
def test_written_trace_is_the_export(family):
    model, at = _inputs(family)
    export = {b: trace(model, *at(b), cache=False, unroll=True) for b in (8, 2, 4)}
    written = rebatched(export[8], export[2], (8, 2), 4)
    assert written is not None, family
    assert graph_signature(written.graph) == graph_signature(export[4].graph)
    assert _facts(written) == _facts(export[4])
    assert written.params == export[4].params and written.user_inputs == export[4].user_inputs
    # the second trace as another process sends it: its outline, pickled
    sent = rebatched(export[8], pickle.loads(pickle.dumps(outline(export[2]))), (8, 2), 4)
    assert sent is not None and _facts(sent) == _facts(export[4])


def test_planning_traces_are_written_once_two_are_exported(caplog):
    """Through the process's trace cache (autopar/trace/cache.py), as the pipeline search traces its microbatch sizes:
    the third size and later are written, at 1 and 6 rows (outside and between the two
    exported) equal to their exports."""
    model, at = _inputs("ours", seq=24)   # (a sequence length no other test traces: the cache is the process's)
    with caplog.at_level(logging.INFO, logger="autopar"):
        for b in (8, 2, 1, 6):
            trace(model, *at(b), unroll=True, shared=True)
    written = [r.getMessage() for r in caplog.records if "written from the traces" in r.getMessage()]
    assert len(written) == 2 and written[0].startswith("traced at 1 rows"), written
    for b in (1, 6):
        assert _facts(trace(model, *at(b), unroll=True, shared=True)) == \
            _facts(trace(model, *at(b), cache=False, unroll=True))


def test_a_trace_exported_in_another_process_serves_by_its_outline(caplog):
    """As the pipeline search does: this process exports one batch while a forked one exports
    another and sends its outlines back; a third batch is then written here from the two."""
    model, at = _inputs("ours", seq=20)   # (a sequence length no other test traces)

    def export(rows):
        traced = trace(model, *at(rows), unroll=True, shared=True)
        return pickle.dumps(TRACES.exported_outlines(traced)) if rows == 2 else None

    found = forked_map(export, [8, 2], 2)[1]
    TRACES.adopt_outlines(pickle.loads(found))
    with caplog.at_level(logging.INFO, logger="autopar"):
        written = trace(model, *at(4), unroll=True, shared=True)
    assert any("traced at 4 rows" in r.getMessage() and "at 8 and 2 rows" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert _facts(written) == _facts(trace(model, *at(4), cache=False, unroll=True))


class _Padded(torch.nn.Module):
    """A buffer of batch + 3 rows: not proportional to the batch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        pad = torch.zeros(x.shape[0] + 3, 8)
        return self.lin(torch.cat([x, pad])).sum()


class _Branching(torch.nn.Module):
    """An op only for batches over 4."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if x.shape[0] > 4:
            y = torch.relu(y)
        return y.sum()


@pytest.mark.parametrize("cls", [_Padded, _Branching])
def test_shapes_not_proportional_to_the_batch_are_exported(cls):
    model = cls()
    x = torch.randn(8, 8)
    a, b = (trace(model, (x[:n],), cache=False, unroll=True) for n in (8, 2))
    assert rebatched(a, b, (8, 2), 4) is None
