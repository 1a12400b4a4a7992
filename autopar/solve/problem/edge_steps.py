"""The collectives on one edge for one pair of choices (EdgeSteps): what the assembled plan
lists and the runtime runs, priced step by step; and the finite check's reduction."""
from __future__ import annotations

import functools
import math

from torch.distributed.tensor import Partial, Replicate

from autopar.cost import prices as C
from autopar.cost.redistribution import plan_redistribute
from autopar.ops import Strategy
from autopar.solve.problem.gradient_paths import GradientPaths, bucket_kinds, grad_destination, loss_summed, replicated
from autopar.solve.problem.graph import EdgeKey
from autopar.solve.problem.pricing import Pricing, Remembered


class EdgeSteps:
    """Edges' collectives per pair of choices (between representatives), remembered per
    problem.  grouped_gathers: whether the runtime gathers ZeRO-3 weights in buckets (see
    grouped_pair)."""

    def __init__(self, nodes: list, pricing: Pricing, grouped_gathers: bool, paths: GradientPaths,
                 remembered: Remembered):
        self.nodes, self.pricing, self.grouped_gathers = nodes, pricing, grouped_gathers
        self.paths, self.remembered = paths, remembered
        self.mesh = remembered.mesh

    def of(self, e: EdgeKey, i: int, j: int):
        """Forward and backward collectives on edge `e` (between representatives) when its
        ends take choices i (of e.a) and j (of e.b); remembered per problem (assemble asks
        for the same few pairs on every layer, and once per plan it compares)."""
        return self.remembered("edge steps", (e, i, j), lambda: self._steps(e, i, j))

    def _steps(self, e: EdgeKey, i: int, j: int):
        a, b = self.nodes[e.a], self.nodes[e.b]
        redistribution, once_per_step = self.remembered.redistribution, self.pricing.once_per_step
        if e.kind == "grad_in":   # consumer a's gradient joins the sum b
            g = a.strategies[i].grads[e.operand]
            if g is None:
                return (), ()
            shape, item = b.out_shapes[0], b.out_dtypes[0].itemsize
            return (), redistribution(shape, item, tuple(g), b.strategies[j].outputs[0])
        if e.kind == "grad_out":  # the sum a reaches the layout of tensor b[out]
            shape, item = a.out_shapes[0], a.out_dtypes[0].itemsize
            target = grad_destination(b, b.strategies[j], e.out)
            steps = redistribution(shape, item, a.strategies[i].outputs[0], target)
            if b.kind == "param":
                steps = once_per_step(C.bucketed(steps, math.prod(shape) * item, bucket_kinds(b.strategies[j])))
            elif self.paths.cone_deferred(b, e.out, [a.strategies[i].outputs[0]])[j, 0]:
                steps = once_per_step(C.bucketed(steps, math.prod(shape) * item, ("all_reduce",)))
            return (), steps
        p = a.strategies[i].outputs[e.out]
        q = b.strategies[j].inputs[e.operand]
        g = b.strategies[j].grads[e.operand]
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        fwd = redistribution(shape, item, p, q)
        if b.kind == "output" and math.prod(shape) == 1 and loss_summed([p], [q])[0, 0]:
            fwd = C.bucketed(fwd, item, ("all_reduce",))   # the loss, summed with the last bucket
        bwd = ()
        if a.requires_grad and g is not None:
            if (e.a, e.out) not in self.paths.summed:
                bwd = redistribution(shape, item, g, grad_destination(a, a.strategies[i], e.out))
                if a.kind == "param":
                    bwd = once_per_step(C.bucketed(bwd, math.prod(shape) * item, bucket_kinds(a.strategies[i])))
                elif self.paths.cone_deferred(a, e.out, [g])[i, 0]:   # left Partial for the parameters' buckets
                    bwd = once_per_step(C.bucketed(bwd, math.prod(shape) * item, ("all_reduce",)))
            if a.kind == "param" and (e.b, 0) in self.paths.cones:
                bwd = bwd + self.paths.cone_split_steps(a, a.strategies[i], b, b.strategies[j])
            if a.kind == "param":  # gathered for use, dropped after forward: gather again for backward
                if self.grouped_pair(a.strategies[i], fwd, bwd):
                    whole = math.prod(shape) * item
                    fwd = C.bucketed(fwd, whole, ("all_gather",))
                    bwd = C.bucketed(bwd, whole, ("reduce_scatter",))
                bwd = bwd + tuple(st for st in fwd if st.kind == "all_gather")
        return fwd, bwd

    def reduction(self, e: EdgeKey, i: int, j: int, backward: bool):
        """The one redistribution step (autopar.cost.redistribution.Step, with its dim) of
        edge e's forward or backward move when that move is exactly one all-reduce or one
        reduce-scatter, as the runtime runs it (autopar/passes/fold_linears.py folds those
        beside linears' GEMMs), else None; e between representatives, choices i and j."""
        a, b = self.nodes[e.a], self.nodes[e.b]
        if e.kind == "grad_out" and backward:
            layouts = (a.strategies[i].outputs[0], grad_destination(b, b.strategies[j], e.out))
        elif e.kind == "data" and not backward:
            layouts = (a.strategies[i].outputs[e.out], b.strategies[j].inputs[e.operand])
        elif e.kind == "data" and (e.a, e.out) not in self.paths.summed \
                and b.strategies[j].grads[e.operand] is not None:
            layouts = (b.strategies[j].grads[e.operand], grad_destination(a, a.strategies[i], e.out))
        else:
            return None
        steps = plan_redistribute(tuple(layouts[0]), tuple(layouts[1]), self.mesh.shape)
        return steps[0] if len(steps) == 1 and steps[0].kind in ("all_reduce", "reduce_scatter") else None

    def grouped_pair(self, s: Strategy, fwd: tuple, bwd: tuple) -> bool:
        """Whether a weight stored under s and read through moves fwd (its gradient back
        through bwd) is gathered in buckets (autopar/runtime/regions/reshard.py): plain ZeRO-3, the
        weight sharded on an axis where it is read whole, the move one all-gather and its
        gradient's one reduce-scatter on that axis, nothing else synchronising it.  Its
        gathers, the one again in backward and the reduce-scatter then pay `bucket_share`
        of their calls' fixed cost, and the reduce-scatter runs on the bucket stream."""
        return (self.grouped_gathers and not s.zero and not s.offload and len(fwd) == 1 and len(bwd) == 1
                and fwd[0].kind == "all_gather" and bwd[0].kind == "reduce_scatter" and fwd[0].axis == bwd[0].axis)

    def seen_alike(self, edges: list, choice: dict) -> bool:
        """Whether under `choice` every rank's finite check reads values every rank sees
        (runtime/checks/faults.seen_alike), so the step runs no all-reduce for it: the loss summed
        over every mesh axis of more than one rank, and every trained weight whole there,
        not ZeRO-2/3 or offloaded, its gradient arriving Partial on all those axes (or left
        Partial for its bucket, GradientPaths.cones).  Checked on the whole choice (`edges`:
        every concrete edge), outside the ILP: the check's one scalar all-reduce is the
        assembled step's (assemble.py); the solver does not weigh it."""
        axes = [a for a, n in enumerate(self.mesh.shape) if n > 1]
        if not axes:
            return True

        def strategy(i):
            return self.nodes[self.nodes[i].rep].strategies[choice[i]]

        def partial(lay):
            return lay is not None and all(isinstance(lay[a], Partial) for a in axes)
        for e in edges:
            a, b = self.nodes[e.a], self.nodes[e.b]
            if e.kind == "data" and b.kind == "output" and math.prod(a.out_shapes[e.out]) == 1 \
                    and not partial(strategy(e.a).outputs[e.out]):
                return False
            if a.kind == "param" and a.requires_grad:
                s = strategy(e.a)
                if s.zero >= 2 or s.offload or not all(isinstance(s.outputs[0][x], Replicate) for x in axes):
                    return False
                if e.kind == "data" and (a.rep, e.out) not in self.paths.summed and not partial(
                        strategy(e.b).grads[e.operand]) and not (
                        (e.b, 0) in self.paths.cones and replicated(strategy(e.b))):
                    return False
            if e.kind == "grad_out" and b.kind == "param" and b.requires_grad and not partial(strategy(e.a).outputs[0]):
                return False
        return True

    @functools.cached_property
    def finite_check(self) -> tuple:
        """The steps of the finite check's all-reduce (runtime/checks/faults.check_step: one float64
        flag over every rank), which a step runs where `seen_alike` is False."""
        axes = [a for a, n in enumerate(self.mesh.shape) if n > 1]
        if not axes:
            return ()
        src = tuple(Partial() if a in axes else Replicate() for a in range(self.mesh.ndim))
        return self.remembered.redistribution((), 8, src, tuple(Replicate() for _ in range(self.mesh.ndim)))
