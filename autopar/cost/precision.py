"""Mixed precision: low-precision compute, float32 master weights, float32 gradient reduction."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """The policy of a compiled model.

    param_dtype: the dtype the model computes in: it runs as `model.to(param_dtype)` would
    (float32 parameters, buffers and activations become param_dtype).
    reduce_dtype: the dtype gradients are summed across ranks in.
    The optimizer updates float32 master weights (sharded with its state under ZeRO-1/2)
    and copies them back into the param_dtype weights after each step."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(f"MixedPrecision.{name} must be a floating torch dtype, got {value!r}")

    def to_dict(self) -> dict:
        return {"param_dtype": str(self.param_dtype).replace("torch.", ""),
                "reduce_dtype": str(self.reduce_dtype).replace("torch.", "")}

    @classmethod
    def of(cls, value) -> "MixedPrecision | None":
        """A policy from what a user passes: None, a MixedPrecision, a dtype or its name
        ("bf16", "bfloat16", "fp16", "float16")."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, torch.dtype):
            return cls(value)
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
        if isinstance(value, str) and value.lower() in names:
            return cls(names[value.lower()])
        raise ValueError(f"mixed_precision={value!r}: pass autopar.MixedPrecision(...), a torch dtype, or one of "
                         f"{sorted(names)}")

    @classmethod
    def from_dict(cls, d: dict | None) -> "MixedPrecision | None":
        if d is None:
            return None
        return cls(getattr(torch, d["param_dtype"]), getattr(torch, d["reduce_dtype"]))

    def __str__(self) -> str:
        d = self.to_dict()
        return f"mixed precision: compute {d['param_dtype']}, float32 master weights, reduce {d['reduce_dtype']}"


def cast_for_trace(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` on the meta device whose float32 parameters and buffers are `dtype`:
    what the model computes like under the policy, traced without touching its weights
    (shared weights stay shared)."""
    import copy

    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        new_dtype = dtype if t.dtype == torch.float32 else t.dtype
        fake = torch.empty(t.shape, dtype=new_dtype, device="meta")
        memo[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def meta_inputs(tree):
    """Example inputs moved to the meta device (shapes and dtypes kept)."""
    from torch.utils import _pytree as pytree
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, tree)
