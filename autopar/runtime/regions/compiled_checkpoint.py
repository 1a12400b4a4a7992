"""A recomputed layer compiled whole (runtime/regions/inductor.py): its body run under
non-reentrant activation checkpointing as a graph of its own, so that Dynamo compiles the
checkpoint into the region and its compiled backward runs the fused forward again.

Recomputed whole, every op is tagged to be recomputed.  Selectively, each kept op (a
product with a weight, attention) runs under an annotation (_tagged) that the
checkpoint's policy (_kept_policy) reads as AOTAutograd traces it, so the compiled forward
saves the kept kernels' outputs and its backward runs only the ops between them again.
"""
from __future__ import annotations

import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def as_checkpointed(body: fx.GraphModule, selective: bool = False) -> fx.GraphModule:
    """`body` run under non-reentrant activation checkpointing, as a graph of its own (one
    call of torch.utils.checkpoint.checkpoint): compiled by Dynamo, the checkpoint becomes
    part of the compiled graph, whose backward runs the fused forward again from the run's
    inputs (every op tagged to be recomputed; selective: except the kept ops' kernels, whose
    outputs the compiled forward saves, _kept_policy).  (A graph module per run, not one
    wrapper class for all: Dynamo compiles per code object, and would stop compiling a
    shared forward after its recompile limit, some eight layers in.)"""
    root = nn.Module()
    root.body = body
    graph = fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i, _ in enumerate(body.graph.find_nodes(op="placeholder"))]
    run = _run_selective if selective else _run_checkpointed
    graph.output(graph.call_function(run, (graph.get_attr("body"), *inputs)))
    return fx.GraphModule(root, graph)


def _run_checkpointed(body, *args):
    return checkpoint(body, *args, use_reentrant=False, context_fn=_all_recomputed)


def _run_selective(body, *args):
    return checkpoint(body, *args, use_reentrant=False, context_fn=_kept_recomputed)


def _recompute_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


def _all_recomputed():
    return create_selective_checkpoint_contexts(_recompute_policy)


KEEP = "autopar_keep"   # the annotation (node.meta["custom"]) of a kept op's nodes: the kernels it keeps


def _tagged(target, kernels):
    """A kept op of a selective layer, as its layer compiled whole runs it: the op under
    torch.fx.traceback.annotate({KEEP: its kernels}), which Dynamo records on the op's
    nodes and AOTAutograd's trace of the checkpoint shows the policy (_kept_policy) as each
    kernel is dispatched; outside a trace (a region that failed to compile runs eagerly)
    the annotation is set just the same while the op runs.  kernels: the ATen packets
    whose outputs are kept (passes/recompute.kernels_of), None for all."""
    code = "*" if kernels is None else ",".join(sorted(str(k) for k in kernels))

    def kept_in_layer(*args, **kwargs):
        with fx_traceback.annotate({KEEP: code}):
            return target(*args, **kwargs)
    kept_in_layer._autopar_tagged = target
    return kept_in_layer


def _kept_policy(ctx, func, *args, **kwargs):
    """The selective policy of a layer compiled whole: a kernel dispatched by a kept op
    (_tagged) whose outputs that op keeps is saved, everything else recomputed."""
    code = (fx_traceback.current_meta.get("custom") or {}).get(KEEP)
    if code is not None and (code == "*" or str(getattr(func, "overloadpacket", func)) in code.split(",")):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _kept_recomputed():
    return create_selective_checkpoint_contexts(_kept_policy)


def with_kept_tagged(body: fx.GraphModule) -> fx.GraphModule:
    """A copy of a selective layer's body whose kept ops (passes/recompute.kept) call
    their ATen op under its annotation (_tagged): compute that a compiled region can run."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(body.graph, {}))
    out = fx.GraphModule(body, graph)
    for node in out.graph.nodes:
        kept = getattr(node.target, "_autopar_kept", None) if node.op == "call_function" else None
        if kept is not None:
            node.target = _tagged(*kept)
    out.recompile()
    return out
