"""The traced graph at another batch size, written from two traces of the same model.

The pipeline search plans one microbatch per candidate, and each microbatch size is a
trace: torch.export runs the model again though only the sizes change.  Two traces of one
model at batches a and b show which numbers depend on the batch: a dimension, stride or
integer argument equal in both does not; one that differs is taken as proportional to
the batch (x_b * a == x_a * b, else nothing is written) and is scaled to the batch asked
for (an integer there, else nothing is written).  The two graphs must match node for node
(op, name, target, argument structure), and the tensors the forward creates must not
depend on the batch.  Planning traces only (autopar.trace.export.trace with unroll=True): the
runtime always exports its own graph, and a plan records the signature of the graph it
planned (autopar.trace.export.graph_signature), which the runtime checks.  Tests compare written
graphs with exported ones, shapes, strides and arguments, on several model families.

The second trace is read only through its `Outline`: names, ops, arguments and tensor
shapes, no graph and no tensors, so that a trace exported in another process (the pipeline
search exports one beside the whole batch's) comes back cheaply pickled.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.trace.unroll import planning_module


class _Differs(Exception):
    """The two traces differ in a way a batch size does not explain."""


@dataclass(frozen=True)
class _Ref:
    """A node an argument names (in an Outline)."""
    name: str


@dataclass(frozen=True)
class _Shape:
    """A tensor's shape, strides and dtype (in an Outline)."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class Outline:
    """What rebatched reads of its second trace, picklable: per node (op, name, target as
    text, args, kwargs, meta "val"), nodes named by _Ref and tensors by _Shape; the
    placeholders' parameter and buffer names, the created constants' shapes."""
    nodes: list
    params: dict
    buffers: dict
    constants: dict


def outline(traced) -> Outline:
    """The Outline of a Traced (autopar.trace.export)."""
    return Outline([(n.op, n.name, str(n.target), _outlined(n.args), _outlined(n.kwargs),
                     _outlined(n.meta.get("val"))) for n in traced.graph.graph.nodes],
                   dict(traced.params), dict(traced.buffers),
                   {k: tuple(v.shape) for k, v in traced.constants.items()})


def _outlined(x):
    if isinstance(x, fx.Node):
        return _Ref(x.name)
    if isinstance(x, torch.Tensor):
        return _Shape(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, tuple):
        return tuple(_outlined(v) for v in x)
    if isinstance(x, list):
        return [_outlined(v) for v in x]
    if isinstance(x, dict):
        return {k: _outlined(v) for k, v in x.items()}
    return x


def rebatched(first, second, batches: tuple, batch: int):
    """A Traced (autopar.trace.export) equal to the trace at `batch` rows, written from `first` and
    `second` (a Traced or its Outline), the traces at batches[0] and batches[1] rows; None
    when the two do not show how the graph depends on the batch (see the module docstring)."""
    a, b = batches
    if a == b or batch < 1:
        return None
    second = second if isinstance(second, Outline) else outline(second)
    nodes_a = list(first.graph.graph.nodes)
    if len(nodes_a) != len(second.nodes) or first.params != second.params or first.buffers != second.buffers:
        return None
    if {k: tuple(v.shape) for k, v in first.constants.items()} != second.constants:
        return None
    graph = fx.Graph()
    scale = _Scale(a, b, batch)
    try:
        for x, (op, name, target, args, kwargs, val) in zip(nodes_a, second.nodes):
            if (x.op, x.name, str(x.target)) != (op, name, target):
                raise _Differs(x.name)
            node = graph.create_node(x.op, x.target, scale.value(x.args, args), scale.value(x.kwargs, kwargs),
                                     x.name, x.type)
            node.meta = dict(x.meta)
            node.meta.pop("tensor_meta", None)
            if "val" in x.meta:
                node.meta["val"] = scale.value(x.meta["val"], val)
            scale.nodes[x] = node
    except _Differs:
        return None
    gm = planning_module(first.graph, graph)
    return type(first)(gm, dict(first.params), dict(first.buffers), list(first.user_inputs), dict(first.tied),
                       first.in_spec, first.out_spec, dict(first.constants), first.parts, first.layers,
                       dict(first.weights))


class _Scale:
    """Values of the trace at `a` rows (and their outlined counterparts at `b` rows) at
    `batch` rows; `nodes`: the first trace's nodes -> the written graph's."""

    def __init__(self, a: int, b: int, batch: int):
        self.a, self.b, self.batch = a, b, batch
        self.nodes: dict = {}

    def number(self, x: int, y: int) -> int:
        if x == y:
            return x
        if x * self.b != y * self.a or (x * self.batch) % self.a:
            raise _Differs(f"{x} at {self.a} rows, {y} at {self.b}")
        return x * self.batch // self.a

    def value(self, x, y):
        if isinstance(x, fx.Node):
            if not isinstance(y, _Ref) or x.name != y.name:
                raise _Differs(x.name)
            return self.nodes[x]
        if isinstance(x, bool) or x is None or isinstance(x, (str, float, torch.dtype, torch.device, torch.layout,
                                                               torch.memory_format)):
            if x != y or type(x) is not type(y):
                raise _Differs(repr(x))
            return x
        if isinstance(x, int):
            if type(y) is not int:
                raise _Differs(repr(x))
            return self.number(x, y)
        if isinstance(x, torch.Tensor):
            if not isinstance(y, _Shape) or x.dim() != len(y.shape) or x.dtype != y.dtype:
                raise _Differs("tensor")
            shape = [self.number(p, q) for p, q in zip(x.shape, y.shape)]
            stride = [self.number(p, q) for p, q in zip(x.stride(), y.stride)]
            if shape == list(x.shape) and stride == list(x.stride()):
                return x   # (shared with the first trace: planning only reads them)
            # a meta tensor (planning reads shapes, strides, dtypes and requires_grad; a fake
            # tensor costs a hundred times more to make)
            out = torch.empty_strided(shape, stride, dtype=x.dtype, device="meta")
            return out.requires_grad_(True) if x.requires_grad else out
        if isinstance(x, (list, tuple)):
            if not isinstance(y, (list, tuple)) or isinstance(x, tuple) != isinstance(y, tuple) or len(x) != len(y):
                raise _Differs("structure")
            items = [self.value(p, q) for p, q in zip(x, y)]
            return type(x)(*items) if hasattr(x, "_fields") else (tuple(items) if isinstance(x, tuple) else items)
        if isinstance(x, dict):
            if not isinstance(y, dict) or x.keys() != y.keys():
                raise _Differs("structure")
            return {k: self.value(x[k], y[k]) for k in x}
        if x != y:
            raise _Differs(repr(x))
        return x
