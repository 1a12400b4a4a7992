"""A model must return its loss: planning warns, and train_step refuses, with the fix, for
one that returns logits (autopar/trace/loss.py); and a forced sequence layout on a model
without a fused attention op says it has nothing to split."""
import logging

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.trace.loss import WRAPPER, describe, pick_loss

MESH = autopar.Mesh((2,), ("dp",), device="cpu")


class Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, x):
        return self.head(self.emb(x))


class LogitsThenLoss(Logits):
    def forward(self, x, y):
        logits = super().forward(x)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class LossThenLogits(Logits):
    def forward(self, x, y):
        logits = super().forward(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()), logits


class Entries(Logits):
    def forward(self, x, y):
        logits = super().forward(x)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())}


class WithLoss(nn.Module):   # the README's wrapper
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.model(x).flatten(0, -2), y.flatten())


def tokens(*shape):
    return torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model,inputs,shown", [
    (Logits(), (tokens(4, 8),), "a tensor of shape (4, 8, 32)"),
    (LogitsThenLoss(), (tokens(4, 8), tokens(4, 8)), "a tuple of 2 (a tensor of shape (4, 8, 32), a tensor of shape ())"),
])
def test_a_model_that_returns_logits_is_told_the_fix_when_planned(model, inputs, shown, caplog):
    # (planned it is: a compiled model may be called for its outputs; train_step refuses it)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        plan = autopar.plan(model, MESH, inputs, solve=autopar.SolveOptions(compare=False))
    said = [r.getMessage() for r in caplog.records if "train_step will refuse" in r.getMessage()]
    assert len(said) == 1 and plan.step_s > 0
    assert f"{type(model).__name__} returned {shown}" in said[0]
    assert "not a scalar" in said[0] and WRAPPER in said[0] and "autopar.compile(WithLoss(model)" in said[0]


def test_train_step_refuses_logits_with_the_fix(pool2):
    from user_models import train_step_on_logits
    message = pool2.run(train_step_on_logits)[0]
    assert message.startswith("train_step needs the model to return a scalar loss: the model returned a tensor of "
                              "shape (4, 8, 32)"), message
    assert WRAPPER in message


@pytest.mark.parametrize("model", [LossThenLogits(), Entries(), WithLoss(Logits())])
def test_a_loss_first_a_loss_entry_or_the_wrapper_plans(model, caplog):
    with caplog.at_level(logging.WARNING, logger="autopar"):
        plan = autopar.plan(model, MESH, (tokens(4, 8), tokens(4, 8)), solve=autopar.SolveOptions(compare=False))
    assert plan.step_s > 0 and plan.param_placements
    assert not [r for r in caplog.records if "train_step will refuse" in r.getMessage()]


def test_the_rule_train_step_uses():
    scalar, logits = torch.tensor(2.0), torch.zeros(2, 3)
    assert pick_loss(scalar)[0] is scalar and pick_loss((scalar, logits))[0] is scalar
    assert pick_loss({"loss": scalar})[0] is scalar
    assert pick_loss(logits) == (None, "the loss it picks is a tensor of shape (2, 3), not a scalar")
    assert pick_loss({"logits": logits})[0] is None and pick_loss(())[0] is None
    assert describe({"logits": logits}) == "a dict with keys ['logits']"


class Manual(nn.Module):
    """Attention written out (minGPT's way): matmuls and a softmax, no fused op."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, 32)

    def forward(self, x, y):
        q, k, v = self.qkv(self.emb(x)).chunk(3, -1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1)
        logits = self.head(att @ v)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("layout", ["ulysses", "context-parallel"])
def test_a_sequence_layout_without_fused_attention_warns(layout, caplog):
    with caplog.at_level(logging.WARNING, logger="autopar"):
        plan = autopar.plan(Manual(), MESH, (tokens(4, 8), tokens(4, 8)),
                            solve=autopar.SolveOptions(layout=layout, compare=False))
    said = [r.getMessage() for r in caplog.records if "has no fused attention op" in r.getMessage()]
    assert len(said) == 1 and f"layout {layout!r}" in said[0] and "trains as data parallelism" in said[0]
    assert plan.step_s > 0
