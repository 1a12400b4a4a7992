"""In-place writes into tensors the forward made itself are traced as their out-of-place
forms (autopar/trace/functional.py); writes that another live view sees are left alone."""
import torch
import torch.nn as nn

from autopar.trace.export import trace


def ops(model, *inputs) -> list:
    traced = trace(model, inputs, cache=False)
    return [str(n.target).split(".")[1] for n in traced.graph.graph.nodes if n.op == "call_function"]


class Filled(nn.Module):
    def forward(self, x):
        mask = torch.zeros_like(x).scatter_(1, x.argmax(1, keepdim=True), 1.0)   # a router's one-hot mask
        keys = x.new_empty(x.shape[0], 2 * x.shape[1])
        keys[:, : x.shape[1]] = x                                                 # assembled in slices
        keys[:, x.shape[1]:] = x * 2
        return (mask.sum(1) + keys.sum(1)).sum()


class LiveView(nn.Module):
    def forward(self, x):
        buf = torch.zeros_like(x)
        left = buf[:, :2]            # a view still read after the write below
        buf[:, 2:] = x[:, 2:]
        return (left + 1).sum() + buf.sum()


def test_writes_into_fresh_tensors_become_scatters_with_the_same_values():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    names = ops(Filled(), x)
    assert "scatter" in names and names.count("slice_scatter") == 2
    assert not {"scatter_", "copy_"} & set(names)
    out = trace(Filled(), (x,), cache=False).graph(x)   # (no parameters: the input is the only placeholder)
    assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, Filled()(x))


def test_a_write_another_live_view_sees_is_left_in_place():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    names = ops(LiveView(), x)
    assert "copy_" in names and "slice_scatter" not in names
    out = trace(LiveView(), (x,), cache=False).graph(x)
    assert torch.equal(out[0] if isinstance(out, (tuple, list)) else out, LiveView()(x))
