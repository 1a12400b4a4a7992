"""A model whose tensor sizes depend on the data (a boolean mask, token counts read with
.tolist()) cannot be planned: planning says so at trace time, naming the op, its module and
the fix, instead of failing later with an unrelated error."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.trace.export import TraceError


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return h[h.sum(-1) > 0].pow(2).mean()   # the rows kept depend on the values


class Router(nn.Module):
    def __init__(self, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(8, experts)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, 8)
        choice = self.gate(flat).argmax(-1)
        order = choice.argsort()
        counts = torch.stack([(choice == e).sum() for e in range(len(self.experts))]).tolist()
        parts = flat[order].split(counts)          # token counts per expert, known only at run time
        out = torch.cat([e(p) for e, p in zip(self.experts, parts)])
        return out.pow(2).mean()


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = Router()

    def forward(self, x):
        return self.moe(x)


@pytest.mark.parametrize("model,where", [(Masked, "the model's top level"), (Wrapper, "moe")])
def test_data_dependent_sizes_are_refused_at_trace_time(model, where):
    torch.manual_seed(0)
    with pytest.raises(TraceError) as info:
        autopar.plan(model(), autopar.Mesh((2,), ("dp",), device="cpu"), (torch.randn(4, 6, 8),),
                     solve=autopar.SolveOptions(compare=False))
    text = str(info.value)
    assert "depends on the data" in text and f"in {where} " in text, text
    assert "experts op" in text and "fixed capacity" in text
