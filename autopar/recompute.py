"""Activation recomputation as a per-layer choice of the plan.

Each repeated layer (a transformer block) keeps its activations for backward in one of
three ways:

  none       what autograd saves: every op's saved operands and outputs;
  selective  the layer runs under activation checkpointing with a policy that keeps the
             outputs of the expensive operations (matrix products with a weight,
             attention, experts) and recomputes the cheap ones between them (norms,
             activations, dropout, residual adds, rotary embeddings, and with eager
             attention the attention core: QK^T, softmax, dropout, times V, whose
             s^2-sized tensors are Megatron's reason for selective recomputation);
  full       the layer keeps only its inputs and runs its whole forward again in backward.

The cost model prices each: the activation bytes a layer keeps per device and the
forward (compute and the collectives inside the layer) that backward runs again.  Memory
a recomputed layer needs during its own backward (its activations made again, one layer
at a time) is not counted in the steady state.  The ILP chooses per set of identical
layers (problem/layers.py: all alike, or even and odd layers apart), so that under a
tight budget half the layers can recompute and half keep everything.
"""
from __future__ import annotations

MODES = ("none", "selective", "full")

# ops whose outputs "selective" keeps, when one operand is a weight (matrix products) or
# always (attention and experts: the expensive core of a layer)
PRODUCTS = frozenset({"aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.baddbmm",
                      "aten.einsum"})
ALWAYS_KEPT = frozenset({"aten.scaled_dot_product_attention", "autopar.window_attention", "autopar.experts"})


def check_mode(recompute) -> str | None:
    """The `recompute=` argument of autopar.plan: None (the ILP chooses) or one of MODES."""
    if recompute is None or recompute in MODES:
        return recompute
    raise ValueError(f"recompute={recompute!r} is not a recomputation policy; choose one of "
                     f"{', '.join(repr(m) for m in MODES)} (or leave it None to let the planner choose per layer)")


def reads_weight(problem, pn) -> bool:
    """Whether op pn reads a parameter, directly or through views."""
    from .problem import VIEWS
    todo = [src for src, _ in pn.inputs]
    while todo:
        n = problem.nodes[todo.pop()]
        if n.kind == "param":
            return True
        if n.kind == "op" and (n.op in VIEWS):
            todo.extend(src for src, _ in n.inputs)
    return False


def kept_by_selective(problem, pn) -> bool:
    """Whether "selective" keeps op pn's outputs (see the module docstring)."""
    if pn.kind != "op":
        return False
    if pn.op in ALWAYS_KEPT:
        return True
    return pn.op in PRODUCTS and reads_weight(problem, pn)
