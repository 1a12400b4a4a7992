"""Tracing: an nn.Module and example inputs to the ATen training-IR graph, without real weights.

The model is exported with `torch.export.export(strict=False)`.  A model on the meta device
is traced as is; a model on CPU is traced under fake tensors, so even a model whose
weights exist is never run.  Shapes land in `node.meta["val"]`, module paths in
`node.meta["nn_module_stack"]`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.fx as fx

log = logging.getLogger("autopar")


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and the reason."""


@dataclass
class Traced:
    """graph: the training-IR GraphModule.  params / buffers: placeholder name -> model name."""

    graph: fx.GraphModule
    params: dict
    buffers: dict
    user_inputs: list
    tied: dict   # parameter name -> the name `named_parameters()` lists it under (tied weights)
    in_spec: object = None  # pytree structure of (args, kwargs) the graph's user inputs flatten from


def _module_of_error(exc: BaseException, model: torch.nn.Module) -> str:
    """Best guess of the module that raised: the innermost frame whose `self` is a submodule."""
    names = {id(m): n for n, m in model.named_modules()}
    tb = exc.__traceback__
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and id(obj) in names:
            found = names[id(obj)] or type(model).__name__
        tb = tb.tb_next
    return found or type(model).__name__


def trace(model: torch.nn.Module | fx.GraphModule, example_inputs: tuple, example_kwargs: dict | None = None) -> Traced:
    """Export `model(*example_inputs, **example_kwargs)` to ATen training IR on fake tensors.

    A user-made `fx.GraphModule` (e.g. from `torch.fx.symbolic_trace`) is an nn.Module and
    is exported the same way, which lowers its ops to ATen and records its shapes."""
    example_kwargs = example_kwargs or {}
    start = time.perf_counter()
    try:
        ep = torch.export.export(model, tuple(example_inputs), example_kwargs, strict=False)
    except Exception as exc:  # name the module that failed and why
        where = _module_of_error(exc, model)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"could not trace module {where!r} ({type(model).__name__}): {type(exc).__name__}: "
                         f"{reason}. Make its forward traceable by torch.export(strict=False): no "
                         f"data-dependent Python control flow or .item(); Hugging Face models need "
                         f"use_cache=False.") from exc
    sig = ep.graph_signature
    gm = fx.GraphModule(ep.graph_module, ep.graph_module.graph)
    params = dict(sig.inputs_to_parameters)
    buffers = dict(sig.inputs_to_buffers)
    buffers.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    log.info("traced %s in %.2fs: %d nodes", type(model).__name__, time.perf_counter() - start,
             len(gm.graph.nodes))
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied[name] = first.setdefault(id(p), name)
    return Traced(gm, params, buffers, list(sig.user_inputs), tied, ep.call_spec.in_spec)
