"""Bytes one rank holds of parameters, gradients and optimizer states, beside the plan's
prediction: what `cm.memory_report()` returns.

optimizer: per-element optimizer states (Adam's moments) plus float32 master weights;
optimizer_scalars: bookkeeping such as Adam's step count; offloaded: what of those lives
in host memory (not in "optimizer"), with offloaded weights and their gradients (not in
"params" and "grads"); disk: what the disk tier's files hold (between steps none of it is
in memory).  grads: full local gradients plus the ZeRO-2 chunks.
Measured after optimizer.step() and before zero_grad() it is what the plan predicts.
"""
from __future__ import annotations

import torch

from autopar.runtime.grads.pieces import is_absent


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(state, optimizers, predicted: dict) -> dict:
    """{"measured": bytes by kind (see the module docstring), "predicted": `predicted`}, and
    on CUDA "peak_allocated".  state: the runtime/state/rank_state.RankState; optimizers: those built
    over it (torch optimizers, their `state` keyed by the tensors they update)."""
    params = [p for k, p in state.shards.items() if k not in state.offloaded_weights]
    beyond = [p for k, p in state.shards.items() if k in state.offloaded_weights]

    def grads(ps) -> int:
        return sum(nbytes(p.grad) for p in ps if p.grad is not None and not is_absent(p.grad))

    measured = {
        "params": sum(nbytes(p) for p in params),
        "grads": grads(params) + sum(nbytes(g) for g in state.zero_grads.values()),
        "optimizer": 0, "optimizer_scalars": 0,
        # offloaded weights: in host memory with their gradients, or on disk (counted there)
        "offloaded": grads(beyond) + sum(nbytes(p) for k, p in state.shards.items()
                                         if state.offloaded_weights.get(k) == "host"),
        "disk": state.disk.disk_bytes if state.disk is not None else 0,
    }
    host = {id(m) for k, m in state.masters.items() if m.device.type == "cpu" and
            getattr(state.plan.param_states.get(state.name_of[k]), "offload", "")}
    for m in state.masters.values():
        measured["offloaded" if id(m) in host else "optimizer"] += nbytes(m)
    for opt in optimizers:
        for p, values in opt.state.items():
            for value in values.values():
                if isinstance(value, torch.Tensor):
                    per_element = value.dim() > 0 and value.shape == p.shape
                    key = ("offloaded" if id(p) in host else "optimizer") if per_element else "optimizer_scalars"
                    measured[key] += nbytes(value)
    report = {"measured": measured, "predicted": predicted}
    if state.device_type == "cuda":
        report["peak_allocated"] = torch.cuda.max_memory_allocated()
    return report
