"""Gradients that are only a piece of the model's gradient, marked so that norms refuse them.

After a synchronised backward, `p.grad` of a compiled parameter is this rank's piece of the
whole gradient: a shard (the parameter is `Shard` on some mesh axis, ZeRO-3 included), or
one pipeline stage's part of the model.  torch's own `clip_grad_norm_(cm.parameters())`
would sum the squares of the pieces on each rank and report a norm that is no rank's and
not the model's, then clip by it: a silent wrong answer.  So those gradients are handed out
as `GradPiece`, a plain tensor everywhere (optimizers, in-place scaling, collectives) except
in the norm functions, which raise `GradPieceError` pointing to `cm.clip_grad_norm_`.

A ZeRO-2 parameter keeps no local gradient at all (it lives in the reduce-scattered chunk);
its `p.grad` is an `absent` GradPiece that holds no memory and raises on any use other than
reading its shape, so that a norm or optimizer over `cm.parameters()` fails instead of
seeing no gradient.  The runtime drops the markers before the next forward.

Gradients that are the whole gradient on every rank (replicated parameters, ZeRO-1) stay
plain tensors: torch's own clip_grad_norm_ is right for them.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.linalg.matrix_norm, torch.norm, torch.Tensor.norm,
         torch._foreach_norm}
FIX = ("use cm.clip_grad_norm_(max_norm) or cm.grad_norm() for the model's gradient norm (every piece counted "
       "once), cm.full_grads() for whole gradients, or p.grad.as_subclass(torch.Tensor) for this rank's piece as "
       "a plain tensor")


class GradPieceError(RuntimeError):
    """A norm (or, for a ZeRO-2 gradient, any use) of a gradient that is only this rank's piece."""


class GradPiece(torch.Tensor):
    """This rank's piece of a parameter's gradient.  `_autopar_what` says which parameter and
    why it is a piece; `_autopar_absent` marks a ZeRO-2 parameter's empty stand-in."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        piece = _first_piece(args, kwargs)
        if piece is not None:
            if func in NORMS:
                raise GradPieceError(f"{getattr(func, '__name__', func)} over gradients of the compiled model: "
                                     f"{piece._autopar_what}, so the norm of this rank's pieces is not the "
                                     f"model's; {FIX}")
            if getattr(piece, "_autopar_absent", False) and getattr(func, "__name__", "") != "__get__" \
                    and func not in (torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__repr__):
                raise GradPieceError(f"{getattr(func, '__name__', func)} on p.grad of a ZeRO-2 parameter: "
                                     f"{piece._autopar_what}, and p.grad holds nothing; the optimizer from "
                                     f"cm.build_optimizer reads the chunks. Otherwise {FIX}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _first_piece(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, GradPiece):
            return a
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, GradPiece):
                    return t
    return None


def mark(param: torch.Tensor, what: str) -> None:
    """Hand param's gradient out as a GradPiece (the same storage; nothing copied)."""
    g = param.grad
    if g is None or isinstance(g, GradPiece):
        return
    piece = g.as_subclass(GradPiece)
    piece._autopar_what = what
    param.grad = piece


def mark_absent(param: torch.Tensor, what: str) -> None:
    """Stand in for a gradient that was reduce-scattered away (ZeRO-2): one element, expanded."""
    stand_in = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape).as_subclass(GradPiece)
    stand_in._autopar_what = what
    stand_in._autopar_absent = True
    param.grad = stand_in


def is_absent(g) -> bool:
    return g is not None and getattr(g, "_autopar_absent", False)


def drop_absent(params) -> None:
    """Before a forward: remove ZeRO-2 stand-ins so the next backward accumulates afresh."""
    for p in params:
        if is_absent(p.grad):
            p.grad = None


def pieces_of(state) -> dict:
    """key -> why this rank's gradient of it is only a piece of the whole, for `state`
    (runtime/state/rank_state.RankState): parameters split over some mesh axis and ZeRO-2 ones;
    replicated ones are whole."""
    axes = state.plan.mesh.axis_names
    out = {}
    for key, p in state.shards.items():
        if not p.requires_grad:
            continue
        name = state.name_of[key]
        split = [f"{axes[a]} ({pl})" for a, pl in enumerate(state.plan.param_placements[name])
                 if isinstance(pl, Shard)]
        lay = state.zero_layouts.get(key)
        if lay is not None and lay.stage == 2:
            out[key] = (f"the gradient of {name!r} is reduce-scattered into ZeRO-2 chunks over "
                        f"{[axes[a] for a in lay.reduce_axes + lay.rest_axes]}")
        elif split:
            out[key] = f"this rank holds a shard of the gradient of {name!r}, split over {', '.join(split)}"
    return out
