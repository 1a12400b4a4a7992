"""Where gradients go on their way back (GradientPaths): which tensors' gradients meet in a
gradient-sum node, which are left Partial for the parameters' bucketed all-reduce (the
deferrable cones), and the layout each gradient must reach."""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
from torch.distributed.tensor import Partial, Replicate

from autopar import placements as P
from autopar.cost import prices as C
from autopar.ops import Strategy
from autopar.solve.problem.graph import PNode
from autopar.solve.problem.menus import zero_layout
from autopar.solve.problem.pricing import Remembered


class GradientPaths:
    """The gradient facts every edge price reads, each computed once per problem."""

    def __init__(self, nodes: list, readers: dict, gradsum_of: dict, remembered: Remembered):
        self.nodes, self.readers, self.gradsum_of = nodes, readers, gradsum_of
        self.remembered = remembered
        self.mesh = remembered.mesh

    @functools.cached_property
    def summed(self) -> set:
        """Tensors (by representative) whose gradient goes through a gradient-sum node."""
        return {(self.nodes[src].rep, out) for src, out in self.gradsum_of}

    @functools.cached_property
    def cones(self) -> set:
        """Tensors (node index, output) computed from parameters and constants alone whose
        gradient the runtime may leave Partial for the parameters' bucketed all-reduce
        (passes/collectives._deferrable_cones: a position embedding looked up by positions
        the graph makes, added to batch-split activations): an op's output that reads no
        user input, every other op of its cone (its ancestors up to parameters and
        constants) read only inside the cone, its parameters read only there too."""
        return {(x.index, 0) for x in self.nodes
                if x.kind == "op" and x.requires_grad and not x.from_input and len(x.out_shapes) == 1
                and self._deferrable(x)}

    def _deferrable(self, x: PNode) -> bool:
        """Whether op x heads a cone of `cones`."""
        cone, todo = {x.index}, [x.index]
        while todo:
            for src, _ in self.nodes[todo.pop()].inputs:
                n = self.nodes[src]
                if src in cone or (n.kind == "input" and not n.requires_grad):
                    continue
                if n.kind not in ("op", "param") or n.from_input:
                    return False
                cone.add(src)
                if n.kind == "op":
                    todo.append(src)
        params = [c for c in cone if self.nodes[c].kind == "param"]
        return bool(params) and all(
            r in cone for c in cone - {x.index} for k in range(len(self.nodes[c].out_shapes))
            for r, _ in self.readers.get((c, k), ())) \
            and all(r == x.index for c in params for r, _ in self.readers.get((c, 0), ()))

    def cone_deferred(self, pn: PNode, out: int, layouts) -> np.ndarray:
        """[pn's choices, `layouts`]: where the gradient of cone tensor pn[out] (`cones`)
        arriving in each of `layouts` (None: none) stays Partial for the bucketed all-reduce,
        as the runtime defers it: pn's choice whole on every axis, the gradient only Partial
        or Replicate.  (The cone's other nodes and its parameters are taken as whole there
        too, which is what reading them whole at pn mostly means.)"""
        if (pn.index, out) not in self.cones:
            return np.zeros((len(pn.strategies), len(layouts)), bool)
        whole = np.array([replicated(s) for s in pn.strategies])
        partial = np.array([g is not None and summable(g) for g in layouts])
        return whole[:, None] & partial[None, :]

    def cone_split_steps(self, param: PNode, s: Strategy, root: PNode, t: Strategy) -> tuple:
        """What a cone root's deferred gradient costs more than its bucketed price where its
        parameter (read by the root alone, `cones`) is stored split on some axes: the
        runtime defers only over axes where the weight is whole, so there the gradient is
        all-reduced inside backward, whole (its blocking price less the bucketed one the
        root's edge already counts).  () where nothing is added."""
        if (root.index, 0) not in self.cones or not replicated(t):
            return ()
        axes = [a for a, (p, n) in enumerate(zip(s.outputs[0], self.mesh.shape))
                if n > 1 and not isinstance(p, Replicate)]
        if not axes:
            return ()
        shape, item = root.out_shapes[0], root.out_dtypes[0].itemsize
        src = tuple(Partial() if a in axes else Replicate() for a in range(self.mesh.ndim))
        blocking = self.remembered.redistribution(shape, item, src, tuple(Replicate() for _ in range(self.mesh.ndim)))
        shared = C.bucketed(blocking, math.prod(shape) * item, ("all_reduce",))
        return tuple(replace(b, seconds=b.seconds - c.seconds, fixed=b.fixed - c.fixed)
                     for b, c in zip(blocking, shared))


def grad_destination(pn: PNode, s: Strategy, out: int = 0) -> tuple:
    """The layout the gradient of tensor pn[out] must reach when pn takes strategy s: its own
    layout with Partial made Replicate, and for a ZeRO-2 parameter split over the ZeRO axes
    (reduce-scattered, not all-reduced)."""
    target = tuple(P.grad_target(x) for x in s.outputs[out])
    if pn.kind == "param" and s.zero == 2:
        target = zero_layout(target, s.zero_axes)
    return target


def replicated(s: Strategy) -> bool:
    """Whether strategy s keeps every operand, output and gradient whole (Replicate)."""
    return all(isinstance(p, Replicate) for lay in (*s.inputs, *s.outputs, *(g for g in s.grads if g is not None))
               for p in lay)


def summable(layout) -> bool:
    """Whether `layout` is Partial on some axis and whole on the rest: one all-reduce (or a
    bucket's share of one) makes it whole."""
    return all(isinstance(p, (Partial, Replicate)) for p in layout) and any(isinstance(p, Partial) for p in layout)


def loss_summed(src: list, dst: list) -> np.ndarray:
    """[src, dst]: where a one-element graph output (the loss) moving from layout src to dst
    is only summed (Partial -> Replicate), which the runtime runs as one more element of the
    last gradient bucket (passes/collectives._scalar_sum, Inserted.output_reduce)."""
    partial = np.array([summable(x) for x in src])
    whole = np.array([all(isinstance(p, Replicate) for p in y) for y in dst])
    return partial[:, None] & whole[None, :]


def bucket_kinds(s: Strategy) -> tuple:
    """The reductions of a parameter's gradient the runtime runs in buckets under strategy s:
    all-reduces, and a ZeRO-2 parameter's reduce-scatters (a ZeRO-3 weight's reduce-scatter
    joins a bucket where its moves are grouped: EdgeSteps.grouped_pair)."""
    return ("all_reduce", "reduce_scatter") if s.zero == 2 else ("all_reduce",)
