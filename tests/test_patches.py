"""Process-wide replacements made while tracing (autopar/trace/patches.py) live in one
context manager: inside it the library functions are replaced, after it (and after a trace
that fails) every one is torch's own again, and two threads never trace at once."""
import threading

import pytest
import torch
import torch.utils.checkpoint

from autopar.trace.export import TraceError, trace
from autopar.trace.patches import while_tracing


def _originals():
    return {"Module.to": torch.nn.Module.to, "bincount": torch.bincount, "Tensor.bincount": torch.Tensor.bincount,
            "Tensor.tolist": torch.Tensor.__dict__.get("tolist"),
            "checkpoint": torch.utils.checkpoint.CheckpointFunction.__dict__.get("apply")}


class _Broken(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:   # data-dependent control flow: export fails
            return x
        return -x


def test_replacements_hold_inside_and_are_undone_after_even_a_failed_trace():
    before = _originals()
    with while_tracing(torch.nn.Linear(2, 2)):
        inside = _originals()
    assert all(inside[k] is not before[k] for k in ("Module.to", "bincount", "Tensor.bincount", "Tensor.tolist",
                                                   "checkpoint"))
    assert _originals() == before
    trace(torch.nn.Linear(4, 4), (torch.randn(2, 4),), cache=False)
    assert _originals() == before
    with pytest.raises(TraceError):
        trace(_Broken(), (torch.randn(2, 4),), cache=False)
    assert _originals() == before


def test_a_second_thread_waits_for_the_first_trace():
    order = []
    entered = threading.Event()

    def other():
        entered.wait()
        with while_tracing(torch.nn.Linear(2, 2)):
            order.append("second")

    t = threading.Thread(target=other)
    with while_tracing(torch.nn.Linear(2, 2)):
        t.start()
        entered.set()
        t.join(timeout=0.5)   # blocked on the lock: it cannot have entered yet
        order.append("first")
    t.join()
    assert order == ["first", "second"]
