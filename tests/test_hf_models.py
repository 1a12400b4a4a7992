"""Hugging Face models plan with a rule for every op of their training-IR graphs."""
import warnings

import pytest
import torch

import autopar

transformers = pytest.importorskip("transformers")


def hf_models():
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)
    torch.manual_seed(0)
    yield "GPT2LMHeadModel", GPT2LMHeadModel(GPT2Config(
        vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, use_cache=False))
    yield "LlamaForCausalLM", LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False))
    yield "BertForMaskedLM", BertForMaskedLM(BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))


@pytest.mark.parametrize("name,model", list(hf_models()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_op_has_a_rule(name, model):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(model, mesh, example_kwargs={"input_ids": ids, "labels": ids}, compare=False)
    fell_back = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert plan.fallback_ops == () and fell_back == [], f"{name}: replicated ops {plan.fallback_ops}"
    assert set(plan.param_placements) == {n for n, _ in model.named_parameters()}
    # the step time adds up from the nodes' own time and the collectives
    assert plan.predicted.step_s == pytest.approx(
        sum(n.compute_s + n.comm_s for n in plan.nodes) + sum(
            c.seconds for c in plan.collectives if c.node not in {n.name for n in plan.nodes}), rel=1e-9)
