"""A loss on float32 logits (`LlamaConfig.float_loss`: the logits upcast before the loss,
as torchtitan's and Hugging Face's training loops do): under bf16 mixed precision the
log-probabilities kept for backward and the loss's gradients are float32, and the plan's
memory says so; trained on 4 gloo ranks with the vocabulary split it matches one device."""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import autopar
from autopar.models import build

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from rt_cases import check_mixed_precision, mixed_precision_vs_reference  # noqa: E402

BATCH, SEQ, VOCAB = 4, 256, 32000


def _peak(float_loss: bool):
    model, example = build("llama-tiny", device="meta", batch=BATCH, seq=SEQ, vocab=VOCAB, max_seq=SEQ,
                           float_loss=float_loss)
    return autopar.plan(model, autopar.Mesh((2,), ("dp",), device="h100"), example,
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                        mixed_precision=autopar.MixedPrecision()).predicted


def test_float_logits_cost_six_bytes_more_per_logit():
    """N logits per rank (tokens x vocabulary): the log-probabilities kept for backward grow
    from 2 to 4 bytes each, and the loss's backward holds two float32 gradients of them
    (the log-probabilities' and the logits') instead of two bf16 ones: 2N + 4N bytes."""
    logits = BATCH // 2 * SEQ * VOCAB
    bf16, fp32 = _peak(False), _peak(True)
    assert fp32.memory["activations"] - bf16.memory["activations"] == pytest.approx(2 * logits, rel=1e-3)
    assert fp32.memory["working"] - bf16.memory["working"] == pytest.approx(4 * logits, rel=1e-3)
    assert fp32.memory_total - bf16.memory_total == pytest.approx(6 * logits, rel=1e-3)
    assert fp32.compute_s > bf16.compute_s   # the loss reads and writes twice the bytes


def test_float_loss_is_the_loss_of_the_upcast_logits():
    torch.manual_seed(0)
    model, (tokens, targets) = build("llama-tiny", float_loss=True)
    model = model.to(torch.bfloat16)
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    expected = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
    loss = model(tokens, targets)
    assert loss.dtype == torch.float32
    assert loss.item() == expected.item()


SPEC = ("autopar", "llama-tiny", (("float_loss", True),))


@pytest.mark.parametrize("layout", ["megatron-tp x dp", "zero3"])
def test_float_loss_trains_like_one_device_in_mixed_precision(pool4, layout):
    model, example = build("llama-tiny", float_loss=True)
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"), example,
                        solve=autopar.SolveOptions(compare=False, layout=layout),
                        mixed_precision=autopar.MixedPrecision())
    check_mixed_precision(pool4.run(mixed_precision_vs_reference, SPEC, plan.to_dict())[0])
