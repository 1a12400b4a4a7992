"""Tracing three layers and writing the rest (autopar/trace/unroll.py) gives the full export's
graph node for node: names, ops, shapes, wiring, module paths and placeholder names, on
autopar's Llama and every Hugging Face family; models whose layers differ are traced in
full."""
from __future__ import annotations

import logging

import hf_archs
import pytest
import torch
import torch.fx as fx

import autopar
from autopar.models import build
from autopar.trace.paths import LayerPath, block_of, layer_of, layer_path, module_path
from autopar.trace.export import graph_signature, trace
from autopar.trace.unroll import MAX_LEAD, MIN_LAYERS, repeated_layers

LAYERS = 7


def _layer_kinds(model) -> int:
    """How many kinds of layer a Hugging Face config declares (`layer_types`, e.g. sliding and
    full attention); 1 where it declares none."""
    return len(set(getattr(getattr(model, "config", None), "layer_types", None) or [None]))


def test_most_families_have_layers_alike_enough_to_unroll():
    """Unrolling is not silently lost as transformers changes: the layers of all but at most
    three of the Hugging Face families are found alike (the candidates for unrolling), and
    none of a config that declares several layer kinds is."""
    families = hf_archs.FAMILIES + hf_archs.FUSED + hf_archs.MOE
    models = {f: hf_archs.build(f, layers=LAYERS)[0] for f in families}
    alike = [f for f, m in models.items() if repeated_layers(m) is not None]
    assert len(alike) >= len(families) - 3, sorted(set(families) - set(alike))
    assert not [f for f in alike if _layer_kinds(models[f]) > 1]


def _wiring(gm: fx.GraphModule) -> list:
    return [(n.op, n.name, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)),
             module_path(n)) for n in gm.graph.nodes]


def _assert_same(model, args, kwargs):
    full = trace(model, args, kwargs, cache=False)
    written = trace(model, args, kwargs, cache=False, unroll=True)
    assert graph_signature(written.graph) == graph_signature(full.graph)
    assert _wiring(written.graph) == _wiring(full.graph)
    assert written.params == full.params and written.buffers == full.buffers
    assert written.user_inputs == full.user_inputs
    return full


@pytest.mark.parametrize("family", ["ours"] + hf_archs.FAMILIES + hf_archs.FUSED + hf_archs.MOE)
def test_unrolled_graph_is_the_full_export(family, caplog):
    if family == "ours":
        model, inputs = build("llama3-8b", device="meta", batch=2, seq=16, n_layers=LAYERS + 1, dim=64, n_heads=4,
                              n_kv_heads=2, vocab=128)
        args, kwargs = tuple(inputs), {}
    else:
        model, kwargs = hf_archs.build(family, layers=LAYERS)
        args = ()
    with caplog.at_level(logging.INFO, logger="autopar"):
        full = _assert_same(model, args, kwargs)
    said = [r.getMessage() for r in caplog.records]
    exported_three = any("3 of its" in m for m in said)
    # Unrolling applies exactly where the model's layers are one list of alike modules that
    # also trace alike: read from the model and the tracer's own log, never from a list of
    # families (which ones qualify changes with the transformers release: Falcon's layers
    # began to trace alike in 5.25).  Where it applies, the written graph is the export's
    # (checked above); where it does not, the tracer says why.
    alike = repeated_layers(model) is not None
    differ = any("do not trace alike" in m for m in said)
    assert exported_three == (alike and not differ), (family, said)
    assert exported_three or family != "ours"   # autopar's own Llama: alike by construction
    if _layer_kinds(model) > 1:   # a config that gives layers different attention (Gemma-2's sliding and global)
        assert not exported_three, family
    if exported_three:
        layers = repeated_layers(model)
        assert layers.count == (LAYERS + 1 if family == "ours" else LAYERS)
        per_layer = sum(1 for n in full.graph.graph.nodes if module_path(n).startswith(f"{layers.path}.1."))
        assert per_layer > 10


@pytest.mark.parametrize("lead", [1, 3])
def test_lead_layers_built_differently_are_traced_as_they_are_and_the_rest_written(lead, caplog):
    """DeepSeek-V3's first three layers are dense, its other 58 mixtures of experts: the
    layers alike from the first mixture on are written from two of them and the last, the
    dense ones exported as they are; the result is the full export, node for node."""
    count = lead + MIN_LAYERS + 1
    _, cls, config = hf_archs._configs(count)["deepseek_v3"]
    cfg = config()
    cfg.first_k_dense_replace = lead
    torch.manual_seed(0)
    model = cls(cfg)
    ids = torch.randint(0, hf_archs.VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    found = repeated_layers(model)
    assert (found.path, found.count, found.first) == ("model.layers", count, lead)
    with caplog.at_level(logging.INFO, logger="autopar"):
        _assert_same(model, (), {"input_ids": ids, "labels": ids})
    assert any(f"({lead + 3} of its {count} layers exported)" in r.getMessage() for r in caplog.records)
    written = trace(model, (), {"input_ids": ids, "labels": ids}, cache=False, unroll=True)
    assert written.layers == ("model.layers", count, lead)


class _Alternating(torch.nn.Module):
    """Alike layers, but the forward gives every other layer an extra op: the three-layer
    graph shows layers 0 and 1 differ, so the model is traced in full."""

    def __init__(self, n=8, width=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i % 2:
                x = torch.relu(x)
        return x.sum()


class _Skip(torch.nn.Module):
    """Each layer reads the output of the layer two before it."""

    def __init__(self, n=8, width=16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        before, x = x, self.layers[0](x)
        for layer in self.layers[1:]:
            before, x = x, layer(x) + before
        return x.sum()


@pytest.mark.parametrize("cls", [_Alternating, _Skip])
def test_layers_that_differ_in_the_forward_are_traced_in_full(cls, caplog):
    model = cls()
    assert repeated_layers(model) is not None   # built alike: only their graph tells them apart
    with caplog.at_level(logging.INFO, logger="autopar"):
        _assert_same(model, (torch.randn(4, 16),), {})
    assert any("do not trace alike" in r.getMessage() for r in caplog.records)


def test_layers_built_differently_or_few_are_not_unrolled():
    model = _Skip()
    model.layers[3] = torch.nn.Linear(16, 16, bias=False)
    assert repeated_layers(model) is None   # (a layer among the alike ones: not a lead layer)
    lead = _Skip(n=MAX_LEAD + MIN_LAYERS)
    lead.layers[MAX_LEAD - 1] = torch.nn.Linear(16, 16, bias=False)
    assert repeated_layers(lead).first == MAX_LEAD
    lead.layers[MAX_LEAD] = torch.nn.Linear(16, 16, bias=False)
    assert repeated_layers(lead) is None   # (more lead layers than MAX_LEAD)
    assert repeated_layers(_Skip(n=MIN_LAYERS - 1)) is None
    tied = _Skip()
    tied.layers[2].weight = tied.layers[1].weight
    assert repeated_layers(tied) is None


def test_a_plan_from_an_unrolled_trace_compiles_against_the_full_graph():
    """The plan records the signature of the graph it planned; the runtime's full trace has
    the same one."""
    model, inputs = build("llama3-8b", device="meta", batch=4, seq=16, n_layers=8, dim=64, n_heads=4, n_kv_heads=2,
                          vocab=128)
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp")), tuple(inputs),
                        solve=autopar.SolveOptions(compare=False))
    assert plan.graph == graph_signature(trace(model, tuple(inputs), cache=False).graph)


def test_layer_of_reads_the_number_after_the_prefix():
    """One parser of a layer index (autopar/trace/paths.py): without a prefix the first
    numbered component after the first; with one, only the component right after it."""
    assert layer_of("model.layers.3.mlp") == 3 and layer_of("model.layers.12") == 12
    assert layer_of("model.layers.3.mlp.experts.5") == 3 and layer_of("3.mlp") is None
    assert layer_of("model.layers.x3.mlp") is None and layer_of("") is None
    assert layer_of("model.layers.3.mlp", "model.layers") == 3
    assert layer_of("model.layers.3", "model.layers") == 3
    assert layer_of("encoder.model.layers.3", "model.layers") is None
    assert layer_of("model.layersX.3", "model.layers") is None
    assert layer_of("model.layers.norm.3", "model.layers") is None
    assert layer_of("blocks.1.experts.5", "blocks.1.experts") == 5
    assert layer_path("model.layers.3.mlp.up") == LayerPath("model.layers", 3, "mlp.up")
    assert str(layer_path("model.layers.03")) == "model.layers.3"
    assert block_of("blocks.3.attn.q") == ("blocks", 3) and block_of("lm_head") is None
