"""Every edge's seconds for every pair of choices (EdgePrices): the matrices the ILP reads,
computed once per distinct pair of layouts (cost/layout_prices.py) and spread by index
arrays, with the parts the planner takes apart again (forward moves, bucketed reductions,
forward gathers, flat-buffer copies) kept beside them."""
from __future__ import annotations

import math

import numpy as np

from autopar import placements as P
from autopar.cost import prices as C
from autopar.cost.layout_prices import menu, shared_prices
from autopar.solve.problem.gradient_paths import GradientPaths, grad_destination, loss_summed
from autopar.solve.problem.graph import EdgeKey, PNode
from autopar.solve.problem.pricing import Pricing

UNUSABLE = float("inf")  # a choice pair the runtime cannot run as planned: the ILP never picks it


class EdgePrices:
    """costs[e]: seconds of edge class e (between representatives) for every pair of choices
    (rows: e.a's, columns: e.b's), for each key of `edge_classes`.  Beside them, per edge:
    forward (data edges: the forward moves alone), bucketed (parameter gradients: their
    bucketed reductions), gathers (weights read: their forward all-gathers), linear_slack
    (more that linears' weight gradients may hide), copies (bucketed moves: their flat
    buffers' copies) and copies_once (those of them run once per step: gradient buckets).
    choices: the nodes' prices (NodePrices.choices), which the linears' overlap reads."""

    def __init__(self, nodes: list, readers: dict, pricing: Pricing, grouped_gathers: bool, choices: dict,
                 paths: GradientPaths, edge_classes: dict):
        self.nodes, self.readers, self.pricing = nodes, readers, pricing
        self.grouped_gathers, self.choices, self.paths = grouped_gathers, choices, paths
        self.mesh = paths.mesh
        self.prices = shared_prices(self.mesh)   # each pair of layouts priced once for every edge
        # TP collectives beside their GEMMs: where the plan asks for them and the device overlaps
        self.folds_tp = pricing.tp_overlap and self.mesh.device.asynchronous
        self.forward: dict[EdgeKey, np.ndarray] = {}
        self.bucketed: dict[EdgeKey, np.ndarray] = {}
        self.gathers: dict[EdgeKey, np.ndarray] = {}
        self.linear_slack: dict[EdgeKey, np.ndarray] = {}
        self.copies: dict[EdgeKey, np.ndarray] = {}
        self.copies_once: dict[EdgeKey, np.ndarray] = {}
        matrix = {"grad_in": self._grad_in, "grad_out": self._grad_out, "data": self._data}
        self.costs = {key: matrix[key.kind](key, self.nodes[key.a], self.nodes[key.b]) for key in edge_classes}

    def _grad_in(self, e: EdgeKey, a: PNode, b: PNode) -> np.ndarray:
        """Consumer a's gradient (None: none) joins the sum b."""
        shape, item = b.out_shapes[0], b.out_dtypes[0].itemsize
        grads = [s.grads[e.operand] for s in a.strategies]
        has = np.array([g is not None for g in grads])
        src = menu([C.layout_code(g) if g is not None else None for g in grads])
        dst = menu([C.layout_code(s.outputs[0]) for s in b.strategies])
        return np.where(has[:, None], self.prices.seconds(shape, item, src, dst), 0.0)

    def _grad_out(self, e: EdgeKey, a: PNode, b: PNode) -> np.ndarray:
        """The sum a reaches the layout of tensor b[out]."""
        code, once = C.layout_code, self.pricing.once
        shape, item = a.out_shapes[0], a.out_dtypes[0].itemsize
        src = menu([code(s.outputs[0]) for s in a.strategies])
        dst = menu([code(grad_destination(b, s, e.out)) for s in b.strategies])
        m = self.prices.seconds(shape, item, src, dst)
        readers = self.readers.get((e.b, e.out), [])
        if b.kind != "param" and readers and all(self._folds(self.nodes[r], k) for r, k in readers):
            # the linears' weight gradients hide it (their choices are not this edge's): at
            # least what their smallest hide; step_lower_bound also takes off up to their largest
            grads = [self._weight_gradients(self.nodes[r]) for r, _ in readers]
            folds = self.prices.one_reduction(src, dst)
            least = np.where(folds, np.minimum(m, sum(g.min() for g in grads)), 0.0)
            self.linear_slack[e] = np.where(folds, np.minimum(m, sum(g.max() for g in grads)), 0.0) - least
            m = m - least
        if b.kind == "param":
            bucketed = self.prices.bucketed(shape, item, src, dst, _zero2(b)[None, :])
            m = m - bucketed.paid_here - self.pricing.shared_over_micro_steps(bucketed.bucket_seconds)
            self.bucketed[e] = bucketed.bucket_seconds * once
            m = m + self._copies(e, bucketed.copy_bytes)
        elif (e.b, e.out) in self.paths.cones:   # left Partial for the parameters' buckets
            deferred = self.paths.cone_deferred(b, e.out, [s.outputs[0] for s in a.strategies]).T
            bucketed = self.prices.bucketed(shape, item, src, dst, np.zeros((1, 1), bool))
            paid = bucketed.paid_here + self.pricing.shared_over_micro_steps(bucketed.bucket_seconds)
            m = np.where(deferred, m - paid, m)
            self.bucketed[e] = np.where(deferred, bucketed.bucket_seconds * once, 0.0)
            m = m + self._copies(e, np.where(deferred, bucketed.copy_bytes, 0.0))   # (its weights' buckets)
        own = menu([_shape_key(code(s.outputs[0])) for s in a.strategies])
        theirs = menu([_shape_key(code(s.outputs[e.out])) for s in b.strategies])
        return np.where(own.index[:, None] == theirs.index[None, :], m, m + UNUSABLE)

    def _data(self, e: EdgeKey, a: PNode, b: PNode) -> np.ndarray:
        """Tensor a[out] read by b: its forward move, and its gradient's way back when a
        needs one (_backward), a weight's gathers again in backward included."""
        code = C.layout_code
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        p = menu([code(s.outputs[e.out]) for s in a.strategies])
        q = menu([code(s.inputs[e.operand]) for s in b.strategies])
        m = self.prices.seconds(shape, item, p, q)
        if b.kind == "output" and math.prod(shape) == 1:   # the loss, summed with the last bucket
            summed = loss_summed([s.outputs[e.out] for s in a.strategies],
                                 [s.inputs[e.operand] for s in b.strategies])
            bucketed = self.prices.bucketed(shape, item, p, q, np.zeros((1, 1), bool))
            m = np.where(summed, m - bucketed.paid_here, m)
        if a.kind == "op" and a.op == "aten.linear" and self.folds_tp \
                and len(self.readers.get((e.a, e.out), ())) == 1:
            m = m - self._row_parallel_hidden(a, e.out, m, self.prices.one_reduction(p, q))
        self.forward[e] = m
        if not a.requires_grad:
            return m
        has = np.array([s.grads[e.operand] is not None for s in b.strategies])
        m, bwd = self._backward(e, a, b, p, q, m, has)
        return m + np.where(has[None, :], bwd, 0.0)

    def _backward(self, e: EdgeKey, a: PNode, b: PNode, p, q, m: np.ndarray, has: np.ndarray) -> tuple:
        """(forward, backward) seconds of data edge e where a needs a gradient: the gradient's
        move to a's layout (none where it goes through a gradient sum), hidden behind b's
        weight gradient where the runtime folds it, deferred to the buckets for a cone; a
        parameter's bucketed reduction, grouped gathers (which reprice the forward) and its
        gathers again in backward."""
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        grads = [s.grads[e.operand] for s in b.strategies]
        bwd = np.zeros_like(m)
        grouped = None
        if (e.a, e.out) not in self.paths.summed:
            g = menu([C.layout_code(x) if x is not None else None for x in grads])
            dest = menu([C.layout_code(grad_destination(a, s, e.out)) for s in a.strategies])
            bwd = self.prices.seconds(shape, item, dest, g, reverse=True)
            if a.kind != "param" and self._folds(b, e.operand):   # hidden behind b's weight gradient
                hidden = np.minimum(bwd, self._weight_gradients(b)[None, :])
                bwd = bwd - np.where(self.prices.one_reduction(dest, g, reverse=True), hidden, 0.0)
            if (e.a, e.out) in self.paths.cones:   # left Partial for the parameters' buckets
                deferred = self.paths.cone_deferred(a, e.out, grads)
                bucketed = self.prices.bucketed(shape, item, dest, g, np.zeros((1, 1), bool), reverse=True)
                bwd = np.where(deferred, bwd - bucketed.paid_here - self.pricing.shared_over_micro_steps(
                    bucketed.bucket_seconds), bwd)
                self.bucketed[e] = np.where(deferred & has[None, :], bucketed.bucket_seconds * self.pricing.once, 0.0)
                copied, once = np.where(deferred & has[None, :], bucketed.copy_bytes, 0.0), True
            if a.kind == "param":
                m, bwd, copied, once, grouped = self._parameter_gradient(e, a, p, q, dest, g, m, bwd, has)
            if a.kind == "param" or (e.a, e.out) in self.paths.cones:   # (a cone's: its weights' buckets)
                bwd = bwd + self._copies(e, copied, once)
        if a.kind == "param" and (e.b, 0) in self.paths.cones:   # a split weight keeps its cone's reduction
            bwd = bwd + np.array([[sum(st.seconds for st in self.paths.cone_split_steps(a, s, b, t))
                                   for t in b.strategies] for s in a.strategies])
        if a.kind == "param":  # gathered for use, dropped after forward: gather again for backward
            gathered = self.prices.seconds(shape, item, p, q, gathers=True)
            if grouped is not None:   # the whole move is the gather; the reduce-scatter is the bucket's
                gathered = np.where(grouped, m, gathered)
                bwd = bwd + np.where(grouped, self.bucketed[e], 0.0)
            self.gathers[e] = gathered
            bwd = bwd + gathered
        return m, bwd

    def _parameter_gradient(self, e: EdgeKey, a: PNode, p, q, dest, g, m, bwd, has) -> tuple:
        """(forward, backward, bytes copied, whether once per step, grouped or None) of a
        parameter's gradient on data edge e: its bucketed reduction (a ZeRO-2 weight's
        reduce-scatter among them), and where the runtime gathers the weight in buckets
        (EdgeSteps.grouped_pair, for every pair at once) the grouped gathers' forward, the
        reduce-scatter as the bucket and the copies of every micro-step."""
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        bucketed = self.prices.bucketed(shape, item, dest, g, _zero2(a)[:, None], reverse=True)
        bwd = bwd - bucketed.paid_here - self.pricing.shared_over_micro_steps(bucketed.bucket_seconds)
        bucket = bucketed.bucket_seconds * self.pricing.once
        copied = np.where(has[None, :], bucketed.copy_bytes, 0.0)
        once, grouped = True, None
        if self.grouped_gathers:
            plain = np.array([not s.zero and not s.offload for s in a.strategies])
            grouped = (plain[:, None] & has[None, :] & self.prices.flags(p, q, C.Row.ONE_ALL_GATHER)
                       & self.prices.flags(dest, g, C.Row.ONE_REDUCE_SCATTER, reverse=True))
            if not grouped.any():
                grouped = None
            else:
                share = C.bucket_share(math.prod(shape) * item)
                scattered = self.prices.seconds(shape, item, dest, g, reverse=True, share=share)
                bwd = np.where(grouped, 0.0, bwd)
                bucket = np.where(grouped, scattered, bucket)
                # (copied per micro-step: the gathers, in forward and again in backward, and
                # the reduce-scatter; not once per step)
                moved = (self.prices.copy_bytes(shape, item, dest, g, "reduce_scatter", reverse=True)
                         + 2 * self.prices.copy_bytes(shape, item, p, q, "all_gather"))
                copied = np.where(grouped, moved, copied)
                once = ~grouped
                m = np.where(grouped, self.prices.seconds(shape, item, p, q, share=share), m)
                self.forward[e] = m
        self.bucketed[e] = np.where(has[None, :], bucket, 0.0)
        return m, bwd, copied, once, grouped

    def _copies(self, e: EdgeKey, nbytes: np.ndarray, once=True) -> np.ndarray:
        """Seconds the runtime's flat buffers spend copying edge e's bucketed collectives
        (`nbytes` per pair of choices, prices.bucket_copy_bytes), with one op's latency where
        something is copied (the copy back into each tensor); `once` (per pair): where they
        run once per optimizer step (a gradient bucket: at its share of a micro-step,
        Pricing.accumulation), not every micro-step (a ZeRO-3 weight's gathers).  Kept in
        copies (and the once-per-step part in copies_once), which the assembled step counts
        as compute (assemble._Tally.edges)."""
        seconds = np.where(nbytes > 0, C.copy_seconds(nbytes, self.mesh) + self.mesh.device.op_latency, 0.0)
        seconds = seconds * np.where(once, self.pricing.once, 1.0)
        self.copies[e] = self.copies.get(e, 0.0) + seconds
        self.copies_once[e] = self.copies_once.get(e, 0.0) + np.where(once, seconds, 0.0)
        return seconds

    def _folds(self, reader: PNode, operand: int) -> bool:
        """Whether the runtime computes `reader`'s weight gradient while its input gradient's
        collective runs (autopar/passes/fold_linears.py: the input of an aten.linear), on a
        device that overlaps them, where the plan asks for it (Pricing.tp_overlap)."""
        return self.folds_tp and reader.kind == "op" and reader.op == "aten.linear" and operand == 0

    def _row_parallel_hidden(self, a: PNode, out: int, m: np.ndarray, folds: np.ndarray) -> np.ndarray:
        """What a linear's output move hides where the runtime computes the GEMM in pieces and
        reduces each while the next computes (`folds`: the move is one all-reduce or
        reduce-scatter; the linear's local output has a dim to cut, prices.gemm_chunk_dim, taken
        as cut whichever dim it scatters): all but the last piece's share of the lesser of the
        move and the linear's forward, less what the GEMM in pieces costs more than whole
        (pieces_extra), [a's choices, the reader's]."""
        forward = np.array([c.forward_s - sum(c.comm) / 2 for c in self.choices[a.rep]])
        local = [P.local_shape(a.out_shapes[out], s.outputs[out], self.mesh.shape) for s in a.strategies]
        cut = np.array([C.gemm_chunk_dim(x, "all_reduce", None) is not None for x in local])
        extra = forward * np.array([self.pieces_extra(a, s, x) for s, x in zip(a.strategies, local)])
        share = (C.GEMM_CHUNKS - 1) / C.GEMM_CHUNKS
        hidden = np.maximum(np.minimum(m, forward[:, None]) * share - extra[:, None], 0.0)
        return np.where(folds & cut[:, None], hidden, 0.0)

    def pieces_extra(self, a: PNode, s, local_out) -> float:
        """The share of linear a's forward under strategy s that computing its output
        (`local_out`, this rank's) in GEMM_CHUNKS pieces adds (prices.gemm_pieces_extra)."""
        src, i = a.inputs[0]
        k = P.local_shape(self.nodes[src].out_shapes[i], s.inputs[0], self.mesh.shape)[-1]
        return C.gemm_pieces_extra(local_out, int(k), self.mesh)

    def _weight_gradients(self, pn: PNode) -> np.ndarray:
        """Seconds of linear pn's weight (and bias) gradient per choice: its backward less
        its forward (the input gradient's GEMM costs what the forward's does)."""
        return np.array([max(c.compute - 2 * (c.forward_s - sum(c.comm) / 2), 0.0) for c in self.choices[pn.rep]])


def _zero2(param: PNode) -> np.ndarray:
    """Per choice of a parameter: whether it is ZeRO-2 (its gradient reduce-scatters in buckets)."""
    return np.array([s.zero == 2 for s in param.strategies])


def _shape_key(code: tuple) -> tuple:
    """What `same_local_shape` compares: the shard dim per axis, Replicate and Partial alike."""
    return tuple(c if c >= 0 else -1 for c in code)
