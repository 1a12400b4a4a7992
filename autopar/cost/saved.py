"""What each op keeps for backward, found by running it.

The activation memory of a plan is the storage autograd keeps between forward and
backward.  Which tensors an op keeps is the op's own business (a matrix product keeps both
operands, a GELU its input, softmax its output, a scaling by a constant nothing, dropout
a mask, layer norm its input and two per-row statistics), so it is not written down here
but observed: each distinct op signature runs once on meta tensors of its traced shapes
under `torch.autograd.graph.saved_tensors_hooks`, and every tensor packed is recognised
by its storage as one of the op's inputs, one of its outputs, or a new tensor (its bytes).

Two ops behave otherwise on the devices than on meta, where they take composite paths:
fused attention keeps q, k, v, its output and the log-sum-exp per query row (float32),
never the s x s probabilities (unless dropout runs on a CPU, which falls back to the
explicit path); dropout keeps a one-byte mask on a GPU and the input-sized noise on a CPU.

Views are free and keep their source alive: a tensor an op saves is charged as the
storage it lives in (`storage_root`), and a storage several ops keep counts once.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.fx as fx

from autopar.cost.prices import arg_signature
from autopar.ops import op_name


class Saved(NamedTuple):
    """One tensor an op keeps: kind "in" (operand `index`), "out" (output `index`) or "new"
    (`nbytes` of a tensor the op makes, at the op's whole global shapes; index SCALAR: a
    one-element tensor, the same size on every rank however the op is split, as a
    loss's total weight)."""

    kind: str
    index: int
    nbytes: float = 0.0


FUSED_ATTENTION = "aten.scaled_dot_product_attention"
SCALAR = -1   # Saved.index of a "new" one-element tensor


def saved_by(node: fx.Node, requires_grad: list, gpu: bool) -> tuple | None:
    """What op `node` keeps for backward when its tensor operands (in tensor_args order)
    require grad as `requires_grad` says; None when the op cannot run on meta tensors."""
    name = op_name(node)
    if name == FUSED_ATTENTION:
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        if gpu or not p:
            q = node.args[0].meta["val"]
            lse = q.shape[0] * q.shape[1] * q.shape[2] * 4
            return (Saved("in", 0), Saved("in", 1), Saved("in", 2), Saved("out", 0), Saved("new", 0, lse))
    if name == "aten.dropout":
        val = node.meta.get("val")
        p, train = (list(node.args[1:3]) + [0.0, True])[:2]
        if not p or not train:
            return ()   # the identity
        if isinstance(val, torch.Tensor):
            return (Saved("new", 0, val.numel() * (1 if gpu else val.element_size())),)
    return _probe(node.target, arg_signature(node.args), arg_signature(node.kwargs), tuple(requires_grad))


def _materialise(sig, tensors: list, requires_grad: tuple = ()):
    """Arguments from their arg_signature: meta tensors of those shapes, strides and dtypes
    (appended to `tensors`; the k-th requires grad when requires_grad[k] says so)."""
    tag = sig[0]
    if tag == "T":
        _, shape, stride, dtype = sig
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        k = len(tensors)
        if k < len(requires_grad) and requires_grad[k] and (dtype.is_floating_point or dtype.is_complex):
            t.requires_grad_()
        tensors.append(t)
        return t
    if tag in ("V", "C"):
        return sig[1]
    if tag == "dict":
        return {k: _materialise(v, tensors, requires_grad) for k, v in sig[1]}
    return (list if tag == "list" else tuple)(_materialise(v, tensors, requires_grad) for v in sig[1])


def _sid(t: torch.Tensor) -> int:
    """The storage a (meta) tensor lives in."""
    return t.untyped_storage()._cdata


@functools.lru_cache(maxsize=4096)
def _probe(target, args_sig, kwargs_sig, requires_grad):
    tensors: list = []
    try:
        args, kwargs = _materialise(args_sig, tensors, requires_grad), _materialise(kwargs_sig, tensors, requires_grad)
    except Exception:
        return None
    if not any(t.requires_grad for t in tensors):
        return ()
    packed = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = target(*args, **kwargs)
    except Exception:
        return None
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    ins, made = {}, {}
    for k, t in enumerate(tensors):
        ins.setdefault(_sid(t), k)
    for j, o in enumerate(outs):
        made.setdefault(_sid(o), j)
    result, seen = [], set()
    for t in packed:
        s = _sid(t)
        if s in seen:
            continue
        seen.add(s)
        if s in ins:
            result.append(Saved("in", ins[s]))
        elif s in made:
            result.append(Saved("out", made[s]))
        else:
            result.append(Saved("new", SCALAR if t.numel() == 1 else 0, t.untyped_storage().nbytes()))
    return tuple(result)


@functools.lru_cache(maxsize=4096)
def _is_alias(target, args_sig, kwargs_sig) -> bool:
    tensors: list = []
    try:
        out = target(*_materialise(args_sig, tensors), **_materialise(kwargs_sig, tensors))
    except Exception:
        return False
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return bool(tensors) and bool(outs) and all(_sid(o) == _sid(tensors[0]) for o in outs)


def is_alias(node: fx.Node) -> bool:
    """Whether an op's output shares its first operand's storage: its schema returns an
    alias (views, slices, reshapes) and running it on meta shows it does (a reshape of a
    non-contiguous tensor copies)."""
    if node.op != "call_function":
        return False
    if op_name(node) == "aten.alias":
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return False   # its schema says it makes a new tensor
    return _is_alias(node.target, arg_signature(node.args), arg_signature(node.kwargs))
