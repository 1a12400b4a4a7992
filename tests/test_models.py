"""Tests for the reference models in autopar.models (CPU only, fast)."""

import math

import pytest
import torch

from autopar.models import PRESETS, Llama, build, list_models

# Small builds of every family: (preset name, overrides).
TINY = [
    ("mlp", dict(hidden=32, batch=8)),
    ("gpt-tiny", {}),
    ("llama-tiny", {}),
    ("bert-base", dict(n_layers=1, hidden=64, n_heads=4, vocab=128, seq=16)),
    ("bert-tiny", {}),
]
LANGUAGE_MODELS = {"gpt-tiny", "llama-tiny", "bert-base", "bert-tiny"}


def n_params(model: torch.nn.Module) -> int:
    """Parameter count; `parameters()` yields a tied weight once."""
    return sum(p.numel() for p in model.parameters())


def test_list_models_matches_presets():
    names = list_models()
    assert names == list(PRESETS)
    for name in ["mlp", "gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b", "gpt-tiny",
                 "llama3-8b", "llama3-70b", "llama-tiny", "bert-base"]:
        assert name in names


@pytest.mark.parametrize("name,overrides", TINY, ids=[t[0] for t in TINY])
def test_tiny_loss_and_logits(name, overrides):
    torch.manual_seed(0)
    model, example_inputs = build(name, **overrides)
    loss = model(*example_inputs)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()  # one training step must be possible

    *inputs, targets = example_inputs
    with torch.no_grad():
        out = model(*inputs)
    if name in LANGUAGE_MODELS:
        vocab = model.config.vocab
        # At init the predictions are close to uniform over the vocabulary.
        assert abs(loss.item() - math.log(vocab)) < 0.5
        batch, seq = inputs[0].shape
        assert out.shape == (batch, seq, vocab)
    else:
        assert out.shape == targets.shape


def test_meta_build_allocates_nothing_llama3_70b():
    model, example_inputs = build("llama3-70b", device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert all(t.is_meta for t in example_inputs)
    assert abs(n_params(model) - 70.6e9) / 70.6e9 < 0.01
    assert model.layers[0].feed_forward.w1.out_features == 28672


def test_param_count_llama3_8b():
    model, _ = build("llama3-8b", device="meta")
    assert isinstance(model, Llama)
    assert abs(n_params(model) - 8.03e9) / 8.03e9 < 0.01
    assert model.layers[0].feed_forward.w1.out_features == 14336


def test_param_count_gpt2_124m():
    model, example_inputs = build("gpt2-124m", device="meta")
    assert model.lm_head.weight is model.wte.weight
    assert abs(n_params(model) - 124.4e6) / 124.4e6 < 0.01
    assert [tuple(t.shape) for t in example_inputs] == [(8, 1024), (8, 1024)]


def test_same_seed_same_weights():
    torch.manual_seed(1234)
    a, inputs_a = build("gpt-tiny")
    torch.manual_seed(1234)
    b, inputs_b = build("gpt-tiny")
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for key in sd_a:
        assert torch.equal(sd_a[key], sd_b[key]), key
    for x, y in zip(inputs_a, inputs_b):
        assert torch.equal(x, y)

    torch.manual_seed(4321)
    c, _ = build("gpt-tiny")
    assert not torch.equal(c.wte.weight, a.wte.weight)


def test_tied_weights_survive_materialization():
    model, _ = build("gpt-tiny")
    assert model.lm_head.weight is model.wte.weight
    model, _ = build("llama-tiny")
    assert model.output.weight is model.tok_embeddings.weight


def test_overrides():
    model, (idx, targets) = build("gpt2-124m", device="meta", n_layers=2, hidden=128,
                                  n_heads=4, batch=2, seq=32)
    assert len(model.blocks) == 2
    assert model.wte.weight.shape == (50257, 128)
    assert idx.shape == (2, 32) and idx.dtype == torch.long


def test_unknown_override_raises():
    with pytest.raises(ValueError, match="n_layer") as info:
        build("gpt-tiny", n_layer=3)
    assert "n_layers" in str(info.value)  # the message lists the valid fields
    with pytest.raises(ValueError, match="seq"):
        build("mlp", seq=16)  # the MLP has no sequence dimension
    with pytest.raises(ValueError):
        build("gpt-tiny", seq=1000)  # longer than max_seq
    with pytest.raises(ValueError):
        build("no-such-model")


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_export_matches_eager(name):
    torch.manual_seed(0)
    model, example_inputs = build(name)
    exported = torch.export.export(model, example_inputs, strict=False)
    eager_loss = model(*example_inputs)
    exported_loss = exported.module()(*example_inputs)
    torch.testing.assert_close(exported_loss, eager_loss)


@pytest.mark.parametrize("name", ["mlp", "gpt2-124m", "llama3-8b", "bert-base"])
def test_export_on_meta(name):
    model, example_inputs = build(name, device="meta", **({} if name == "mlp" else {"n_layers": 2}))
    exported = torch.export.export(model, example_inputs, strict=False)
    (loss,) = exported.graph.output_node().args[0]
    assert loss.meta["val"].shape == ()  # the graph returns the scalar loss


# --- shard-by-shard initialization (init_module) -------------------------------

INIT_MODELS = [
    ("mlp", dict(hidden=32, bias=True)),
    ("gpt-tiny", {}),
    ("llama-tiny", {}),
    ("bert-tiny", {}),
]
TIED = {  # preset -> (owner of the tied weight, module that shares it)
    "gpt-tiny": ("wte", "lm_head"),
    "llama-tiny": ("tok_embeddings", "output"),
    "bert-tiny": ("embeddings.word_embeddings", "head.decoder"),
}


def own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers (persistent or not) `module` holds directly."""
    own = dict(module.named_parameters(recurse=False, remove_duplicate=False))
    own.update(module.named_buffers(recurse=False, remove_duplicate=False))
    return own


def all_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name, tied and non-persistent ones included."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def assert_bit_identical(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, a in actual.items():
        b = expected[key]
        assert a.device == b.device and a.dtype == b.dtype and a.shape == b.shape, key
        # Compare the bytes, so that e.g. -0.0 and 0.0 differ.
        assert torch.equal(a.detach().contiguous().view(torch.uint8),
                           b.detach().contiguous().view(torch.uint8)), key


def materialize_to_empty(module: torch.nn.Module, memo: dict) -> None:
    """Plain `to_empty(recurse=False)`: a tied weight gets a fresh (throwaway) tensor
    in each module that holds it; `init_module` re-ties it."""
    module.to_empty(device="cpu", recurse=False)


def materialize_tie_aware(module: torch.nn.Module, memo: dict) -> None:
    """Allocate each meta tensor once: a module holding a tensor that an earlier
    module already materialized gets that materialized tensor."""
    for key, p in list(module._parameters.items()):
        if p is not None and p.is_meta:
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
            module._parameters[key] = memo[id(p)]
    for key, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            if id(b) not in memo:
                memo[id(b)] = torch.empty_like(b, device="cpu")
            module._buffers[key] = memo[id(b)]


@pytest.mark.parametrize("materialize", [materialize_to_empty, materialize_tie_aware],
                         ids=["to_empty", "tie_aware"])
@pytest.mark.parametrize("name,overrides", INIT_MODELS, ids=[t[0] for t in INIT_MODELS])
def test_init_module_shard_by_shard_matches_whole_model(name, overrides, materialize):
    torch.manual_seed(0)
    reference, _ = build(name, **overrides)
    expected = all_tensors(reference)
    expected_rng = torch.get_rng_state()

    model, _ = build(name, device="meta", **overrides)
    memo: dict = {}
    torch.manual_seed(0)
    for path, module in model.named_modules():
        # Nothing of this module is materialized before its turn.
        assert all(t.is_meta for t in own_tensors(module).values()), path
        materialize(module, memo)
        model.init_module(path, module)
        assert not any(t.is_meta for t in own_tensors(module).values()), path

    assert_bit_identical(all_tensors(model), expected)
    # The RNG was consumed exactly as by the whole-model init.
    assert torch.equal(torch.get_rng_state(), expected_rng)
    if name in TIED:
        owner, sharer = TIED[name]
        assert model.get_submodule(sharer).weight is model.get_submodule(owner).weight
        # named_parameters() lists the tied weight once, under the owner.
        assert f"{owner}.weight" in dict(model.named_parameters())
        assert f"{sharer}.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("name,overrides", INIT_MODELS, ids=[t[0] for t in INIT_MODELS])
def test_init_weights_is_init_module_over_named_modules(name, overrides):
    whole, _ = build(name, **overrides)
    torch.manual_seed(7)
    whole.init_weights()
    expected_rng = torch.get_rng_state()

    by_module, _ = build(name, **overrides)
    torch.manual_seed(7)
    for path, module in by_module.named_modules():
        by_module.init_module(path, module)
    assert_bit_identical(all_tensors(by_module), all_tensors(whole))
    assert torch.equal(torch.get_rng_state(), expected_rng)


@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_weight_drawn_once(name):
    owner, sharer = TIED[name]
    model, _ = build(name)
    sharer_module = model.get_submodule(sharer)
    before = model.get_submodule(owner).weight.clone()
    rng = torch.get_rng_state()
    model.init_module(sharer, sharer_module)
    # The sharer draws nothing and leaves the owner's values alone.
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.get_submodule(owner).weight, before)
    assert sharer_module.weight is model.get_submodule(owner).weight


def test_init_module_rejects_unknown_tensors():
    model, _ = build("gpt-tiny")
    model.blocks[0].attn.extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match="blocks.0.attn"):
        model.init_weights()


def test_llama_rope_tables_initialized_by_model_module():
    reference, _ = build("llama-tiny")
    model, _ = build("llama-tiny", device="meta")
    model.to_empty(device="cpu", recurse=False)  # only the model's own tensors: the RoPE tables
    rng = torch.get_rng_state()
    model.init_module("", model)
    assert torch.equal(torch.get_rng_state(), rng)  # deterministic, no RNG
    assert torch.equal(model.rope_cos, reference.rope_cos)
    assert torch.equal(model.rope_sin, reference.rope_sin)
    assert model.tok_embeddings.weight.is_meta  # nothing else was touched
