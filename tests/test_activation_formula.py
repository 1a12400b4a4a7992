"""The per-layer activation memory of Korthikanti et al. 2022 (autopar.cost.memory), and the
planner's activation bytes for GPT with eager attention measured against it.

The planner's figure for one layer is the difference between the plans of a 3-layer and a
2-layer model: the embeddings, the final norm and the loss cancel.  Planning runs on meta
tensors, so no device and no process group is needed.
"""
import pytest
import torch

import autopar
from autopar.cost.memory import layer_activation_bytes
from autopar.models import build

# GPT-3 175B: s = 2048, h = 12288, a = 96, micro-batch 1, so sbh = 2048 * 12288 = 25_165_824
# and 5as/h = 5 * 96 * 2048 / 12288 = 80.
GPT3 = dict(seq=2048, batch=1, hidden=12288, heads=96)
GPT3_SBH = 25_165_824


@pytest.mark.parametrize("kwargs,expected", [
    # no parallelism: sbh * (34 + 80) = 114 sbh = 2_868_903_936
    (dict(), 114 * GPT3_SBH),
    # t = 8: sbh * (10 + 24/8 + 80/8) = 23 sbh = 578_813_952
    (dict(tp=8), 23 * GPT3_SBH),
    # t = 8 with sequence parallelism: sbh/8 * (34 + 80) = 14.25 sbh = 358_612_992
    (dict(tp=8, sequence_parallel=True), 358_612_992),
    # selective, t = 8: sbh * (10 + 3) = 13 sbh = 327_155_712
    (dict(tp=8, recompute="selective"), 13 * GPT3_SBH),
    # selective, t = 8 with sequence parallelism: sbh * 34/8 = 4.25 sbh = 106_954_752
    (dict(tp=8, sequence_parallel=True, recompute="selective"), 106_954_752),
    # full: the layer input only, 2 sbh = 50_331_648; split by 8 with sequence parallelism
    (dict(tp=8, recompute="full"), 2 * GPT3_SBH),
    (dict(tp=8, sequence_parallel=True, recompute="full"), 6_291_456),
], ids=["none", "tp8", "tp8-sp", "selective-tp8", "selective-tp8-sp", "full-tp8", "full-tp8-sp"])
def test_formula_gpt3_175b_layer(kwargs, expected):
    """GPT-3 175B, one layer, micro-batch 1, worked by hand in the comments above."""
    assert layer_activation_bytes(**GPT3, **kwargs) == expected


def test_formula_small_case_by_hand():
    """s = 4, b = 2, h = 8, a = 2: sbh = 64, the attention matrices as^2b = 2 * 16 * 2 = 64.

    Per layer 34 * 64 + 5 * 64 = 2496 bytes; on t = 2 ranks 10 * 64 + 24 * 64 / 2 + 5 * 64 / 2
    = 640 + 768 + 160 = 1568; with sequence parallelism 2496 / 2 = 1248."""
    assert layer_activation_bytes(4, 2, 8, 2) == 2496
    assert layer_activation_bytes(4, 2, 8, 2, tp=2) == 1568
    assert layer_activation_bytes(4, 2, 8, 2, tp=2, sequence_parallel=True) == 1248
    # tp=1 with or without sequence parallelism is the same layer
    assert layer_activation_bytes(4, 2, 8, 2, sequence_parallel=True) == 2496


@pytest.mark.parametrize("kwargs,match", [
    (dict(recompute="attention"), r"recompute 'attention' is not one of 'none', 'selective', 'full'"),
    (dict(tp=5), r"heads 96 is not divisible by tp=5"),
    (dict(tp=0), r"tp must be a positive int"),
    (dict(sequence_parallel="yes"), r"sequence_parallel must be True or False"),
    (dict(hidden=12290), r"hidden 12290 is not a multiple of heads 96"),
], ids=["recompute", "tp-not-dividing-heads", "tp-zero", "sequence_parallel", "hidden-not-dividing"])
def test_formula_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layer_activation_bytes(**{**GPT3, **kwargs})


# --- GPT with eager attention ------------------------------------------------------------


def test_eager_attention_matches_sdpa():
    """Same weights, dropout 0: the explicit softmax(q k^T / sqrt(d)) v gives SDPA's loss and
    gradients."""
    torch.manual_seed(0)
    sdpa, (tokens, targets) = build("gpt-tiny", seq=32)
    eager, _ = build("gpt-tiny", seq=32, attention="eager")
    eager.load_state_dict(sdpa.state_dict())  # strict: the causal mask is not in the state dict
    losses, grads = [], []
    for model in (sdpa, eager):
        loss = model(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_attention_must_be_sdpa_or_eager():
    with pytest.raises(ValueError, match=r"GPTConfig.attention is 'flash'; choose one of 'sdpa', 'eager'"):
        build("gpt-tiny", attention="flash")


# s = 256, h = 256, a = 4, b = 2: biases and the [s, s] causal mask are below 1 % of a layer.
SHAPE = dict(seq=256, batch=2, hidden=256, n_heads=4, max_seq=256, vocab=512)


def planned_layer_bytes(mesh: autopar.Mesh, layout: str | None) -> float:
    """The planner's activation bytes per device of one layer: 3 layers minus 2."""
    activations = {}
    for n_layers in (2, 3):
        model, example = build("gpt-tiny", device="meta", attention="eager", dropout=0.1, n_layers=n_layers,
                               **SHAPE)
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout),
                            mixed_precision="bf16")
        activations[n_layers] = plan.predicted.memory["activations"]
    return activations[3] - activations[2]


@pytest.mark.parametrize("shape,axes,layout,tp", [
    ((1,), ("dp",), None, 1),
    ((4,), ("tp",), "megatron-tp", 4),
], ids=["1-device", "megatron-tp4"])
def test_planner_layer_activations_match_formula(shape, axes, layout, tp):
    """On one device a layer keeps sbh * (34 + 5as/h) = 54 sbh = 7_077_888 bytes; under
    Megatron tensor parallelism on 4 ranks sbh * (10 + 24/4 + 20/4) = 21 sbh = 2_752_512."""
    mesh = autopar.Mesh(shape, axes, device="h100")
    expected = layer_activation_bytes(SHAPE["seq"], SHAPE["batch"], SHAPE["hidden"], SHAPE["n_heads"], tp=tp)
    got = planned_layer_bytes(mesh, layout)
    print(f"{layout or 'single device'}: planner {got:.0f} B, formula {expected} B, ratio {got / expected:.4f}")
    assert got == pytest.approx(expected, rel=0.05)
