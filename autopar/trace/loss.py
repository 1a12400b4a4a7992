"""Which output of a model is the loss training differentiates, and what a user is told
when it returns something else (logits, a tuple led by logits, a dict without "loss"):
a warning when the model is planned (a compiled model may still be called for its
outputs, `cm(x)`, so planning it is not an error), and at `train_step` an error with the
same fix.

The rule (pick_loss) is the one `train_step` uses (autopar/runtime/runner.loss_of): the
output itself when it is a tensor, its `.loss` (Hugging Face's ModelOutput), its "loss"
entry, or the first element of a tuple or list; and it must hold one element.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

log = logging.getLogger("autopar")

WRAPPER = """    class WithLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x, y):
            logits = self.model(x)
            return torch.nn.functional.cross_entropy(logits.flatten(0, -2), y.flatten())"""


def pick_loss(out) -> tuple:
    """(the scalar to differentiate, "") or (None, why there is none) for a model's output."""
    if isinstance(out, torch.Tensor):
        loss = out
    elif getattr(out, "loss", None) is not None:
        loss = out.loss
    elif isinstance(out, dict) and "loss" in out:
        loss = out["loss"]
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    else:
        return None, "no tensor, no .loss and no 'loss' entry to train"
    if not isinstance(loss, torch.Tensor):
        return None, f"its loss is a {type(loss).__name__}, not a tensor"
    if loss.numel() != 1:
        return None, f"the loss it picks is a tensor of shape {tuple(loss.shape)}, not a scalar"
    return loss, ""


def describe(out) -> str:
    """A model's output in a few words: shapes of tensors, keys of dicts, lengths of tuples."""
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, dict):
        return f"a {type(out).__name__} with keys {list(out)[:6]}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} (" + ", ".join(describe(x) for x in out[:4]) + (
            ", ..." if len(out) > 4 else "") + ")"
    return f"a {type(out).__name__}"


def not_a_loss(model, out) -> str | None:
    """The message for a model whose output `out` has no scalar loss, or None."""
    loss, why = pick_loss(out)
    if loss is not None:
        return None
    name = model if isinstance(model, str) else type(model).__name__
    return (f"{name} returned {describe(out)}: {why}. autopar trains the loss the "
            f"model returns. Either make forward return it (a scalar; the first value when it "
            f"returns several, or a .loss / 'loss' entry), or wrap the model with its loss and plan "
            f"the wrapper with (inputs, targets) as example inputs:\n\n{WRAPPER}\n\n"
            f"    cm = autopar.compile(WithLoss(model), mesh, example_inputs=(x, y))")


def traced_output(gm: fx.GraphModule, out_spec):
    """The model's output as the trace saw it: the output node's values (fake or meta
    tensors) in the structure `out_spec` gives."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    values = [n.meta.get("val") if isinstance(n, fx.Node) else n for n in flat]
    if out_spec is None:
        return values[0] if len(values) == 1 else tuple(values)
    return pytree.tree_unflatten(list(values), out_spec)


def check_loss_output(model, traced) -> str | None:
    """Warn (logger "autopar", once per plan) when the traced model returns no scalar loss:
    its forward can be planned and called, but train_step will refuse it.  Returns the
    message, or None."""
    try:
        out = traced_output(traced.graph, traced.out_spec)
    except Exception:   # an output structure this cannot rebuild: train_step checks it
        return None
    message = not_a_loss(model, out)
    if message is not None:
        log.warning("cm.train_step will refuse this model: %s", message)
    return message
