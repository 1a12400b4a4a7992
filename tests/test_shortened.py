"""The pipeline search costs its stage candidates on traces cut to four or five alike layers
(autopar/trace/shortened.py), each kept layer standing for several: the costs must be
those of the whole trace, field for field, for an even and an odd count of layers, on our
models and Hugging Face families, and the search must choose what it chose from whole
traces."""
from __future__ import annotations

import dataclasses

import hf_archs
import pytest
import torch

import autopar
import autopar.solve.built as built_module
from autopar.models import build
from autopar.solve.ilp.solved import SolveOptions
from autopar.solve.pipeline.costs import layer_costs, stage_problem
from autopar.trace.export import trace
from autopar.trace.shortened import kept_layers, shortened
from test_unroll import _Skip

MODES = ("none", "selective", "full", "offload")


def _model(family: str, layers: int):
    if family == "ours":
        model, inputs = build("llama3-8b", device="meta", batch=4, seq=16, n_layers=layers, dim=64, n_heads=4,
                              n_kv_heads=2, vocab=128)
        return model, tuple(inputs), None
    if family == "deepseek_v3":   # two dense lead layers before its mixture-of-experts layers, as DeepSeek-V3's three
        model, kwargs = lead_layers(family, layers, 2)
        return model, (), kwargs
    model, kwargs = hf_archs.build(family, layers=layers)
    return model, (), kwargs


def lead_layers(family: str, layers: int, lead: int):
    """(model, kwargs) of a Hugging Face mixture-of-experts family whose first `lead` layers
    are dense (first_k_dense_replace)."""
    _, cls, config = hf_archs._configs(layers)[family]
    cfg = config()
    cfg.first_k_dense_replace = lead
    torch.manual_seed(0)
    ids = torch.randint(0, hf_archs.VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    return cls(cfg), {"input_ids": ids, "labels": ids}


def _costs(model, args, kwargs, short: bool):
    mesh = autopar.Mesh((4, 2), ("dp", "tp"))
    built = stage_problem(model, mesh, args, kwargs, None, (2, 2), 2, short=short)
    assert built.short == short
    return layer_costs(built, model, SolveOptions(compare=False), MODES), len(built.problem.nodes)


@pytest.mark.parametrize("layers", [8, 9])
@pytest.mark.parametrize("family", ["ours", "llama", "gpt2", "mixtral", "deepseek_v3"])
def test_stage_costs_from_the_short_trace_are_the_whole_traces(family, layers):
    model, args, kwargs = _model(family, layers)
    whole, whole_nodes = _costs(model, args, kwargs, False)
    short, short_nodes = _costs(model, args, kwargs, True)
    lead = 2 if family == "deepseek_v3" else 0
    assert short_nodes < whole_nodes * (lead + len(kept_layers(layers - lead)) + 2) / layers
    assert short.layer_indices == whole.layer_indices == tuple(range(lead, layers))
    assert short.boundary == whole.boundary
    assert [v.layout for v in short.variants()] == [v.layout for v in whole.variants()]
    for s, w in zip(short.variants(), whole.variants()):
        assert set(s.by_mode) == set(w.by_mode) == set(MODES)
        for mode in MODES:
            got, want = s.by_mode[mode].members, w.by_mode[mode].members
            assert len(got) == len(want) == layers - lead + 2
            for k, (a, b) in enumerate(zip(got, want)):
                for f in dataclasses.fields(a):
                    assert getattr(a, f.name) == pytest.approx(getattr(b, f.name), rel=1e-9, abs=1e-15), \
                        (family, layers, s.layout, mode, k, f.name)


def test_the_short_trace_keeps_the_layers_it_names_and_their_weights():
    model, args, _ = _model("ours", 10)
    traced = trace(model, args, unroll=True, shared=True)
    assert traced.layers == ("layers", 10, 0)
    short = shortened(traced)
    assert short.weights == {0: 1, 1: 4, 2: 4, 9: 1}
    assert {int(name.split(".")[1]) for name in short.params.values() if name.startswith("layers.")} == {0, 1, 2, 9}
    assert shortened(short) is None   # (not twice)
    assert kept_layers(11) == (0, 1, 2, 3, 10)


def test_a_trace_not_written_from_three_layers_is_not_shortened():
    traced = trace(_Skip(), (torch.randn(4, 16),), unroll=True, shared=True)   # (reads two layers back)
    assert traced.layers == () and shortened(traced) is None


def test_the_search_chooses_what_it_chose_from_whole_traces(monkeypatch):
    model, inputs = build("llama3-8b", device="meta", batch=16, seq=64, n_layers=8, dim=256, n_heads=8,
                          n_kv_heads=4, vocab=512)
    mesh = autopar.Mesh((4, 2), ("dp", "tp"))

    def plan():
        autopar.trace.cache.TRACES.clear()
        return autopar.plan(model, mesh, tuple(inputs), solve=SolveOptions(compare=False, workers=1),
                            pipeline=True)

    short = plan()
    monkeypatch.setattr(built_module, "shortened", lambda traced: None)
    whole = plan()
    assert short.pipeline.summary == whole.pipeline.summary
    assert short.step_s == pytest.approx(whole.step_s, rel=1e-12)
    assert short.memory_per_device == pytest.approx(whole.memory_per_device, rel=1e-12)
