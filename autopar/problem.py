"""The planning problem: every graph node with its strategy menu and costs, every edge with
its resharding costs, identical layers folded into one set of choices.

Built once per (graph, mesh); solved for the best plan and for the hand-written layouts
(the same problem with menus restricted).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from . import cost as C
from .mesh import Mesh
from .ops import (INTERNAL_COMM, NO_OUTPUT, TRIVIAL, Strategy, annotate, enumerate_strategies,
                  op_name, outputs_of, replicated, show_placements, tensor_args)
from .trace import Traced

log = logging.getLogger("autopar")


@dataclass
class PNode:
    """One node to plan.  kind: "param", "input" (user input or buffer), "op" or "output"."""

    index: int
    node: fx.Node
    kind: str
    op: str
    module: str
    inputs: list = field(default_factory=list)   # per tensor operand: (source PNode index, output index)
    out_shapes: list = field(default_factory=list)
    out_dtypes: list = field(default_factory=list)
    requires_grad: bool = False
    param_name: str | None = None
    rep: int = -1           # representative PNode (identical layers share it)
    strategies: list = field(default_factory=list)
    fallback: bool = False  # no sharding rule: replicated
    from_input: bool = False  # depends on a user input (the batch), not only on weights and constants

    @property
    def name(self) -> str:
        return self.node.name


class EdgeKey(NamedTuple):
    """An edge between two planned nodes; the cost matrix has rows for `a`'s choices and
    columns for `b`'s.

    kind "data": tensor a[out] feeds operand `operand` of b (forward resharding, and the
      backward one when a's gradient comes from b alone);
    kind "grad_in": the gradient that consumer a computes for its operand `operand` joins
      the gradient sum b (a "gradsum" node);
    kind "grad_out": the gradient sum a reaches the layout of its tensor b[out]."""

    kind: str
    a: int
    b: int
    out: int
    operand: int


@dataclass
class Choice:
    """Costs of one strategy of one node (seconds, bytes), forward and backward together."""

    compute: float
    comm: tuple            # seconds per mesh axis of collectives inside the op
    memory: dict           # "params", "grads", "optimizer", "activations" -> bytes
    plain_memory: float | None = None  # what the memory tie-break sees (ZeRO savings left out)

    @property
    def time(self) -> float:
        return self.compute + sum(self.comm)


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # torch.export writes L['self'].blocks[0].attn style paths in some versions
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


SHARE_PERIOD = 2  # see Problem._share_layers and reduce_problem(period=...)

_BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def block_of(path: str):
    """'blocks.3.attn.q' -> ('blocks', 3): the repeated layer a node belongs to, if any."""
    m = _BLOCK.match(path)
    if not m:
        return None
    return m.group(1), int(m.group(2))


class Problem:
    def __init__(self, traced: Traced, mesh: Mesh, precision=None):
        """precision: an autopar.MixedPrecision (the graph is then traced from the model cast
        to its param_dtype, see autopar.precision.cast_for_trace), or None."""
        self.traced = traced
        self.mesh = mesh
        self.precision = precision
        self.nodes: list[PNode] = []
        self.warnings: list[str] = []
        self._build_nodes()
        self._add_gradient_sums()
        self._share_layers()
        self._build_menus()
        self._build_costs()

    # --- graph ------------------------------------------------------------------------------
    def _build_nodes(self):
        by_fx: dict[fx.Node, tuple[int, int]] = {}
        param_node: dict[str, int] = {}
        for node in self.traced.graph.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    continue
                is_param = node.target in self.traced.params
                pname = self.traced.params.get(node.target) or self.traced.buffers.get(node.target)
                if is_param:  # tied weights are one parameter with one layout
                    pname = self.traced.tied.get(pname, pname)
                    if pname in param_node:
                        by_fx[node] = (param_node[pname], 0)
                        continue
                    param_node[pname] = len(self.nodes)
                pn = PNode(len(self.nodes), node, "param" if is_param else "input",
                           "parameter" if is_param else "input",
                           (pname.rsplit(".", 1)[0] if pname and "." in pname else ""),
                           from_input=not is_param and node.target in self.traced.user_inputs,
                           out_shapes=[tuple(val.shape)], out_dtypes=[val.dtype],
                           requires_grad=is_param and val.dtype.is_floating_point and val.requires_grad,
                           param_name=pname if is_param else None)
            elif node.op == "call_function":
                if node.target.__class__.__name__ == "builtin_function_or_method" and op_name(node) == "getitem":
                    src, _ = by_fx[node.args[0]]
                    by_fx[node] = (src, node.args[1])
                    continue
                name = op_name(node)
                outs = outputs_of(node)
                if name in NO_OUTPUT or not outs:
                    continue
                ins = [by_fx[a] for a in tensor_args(node) if a in by_fx]
                pn = PNode(len(self.nodes), node, "op", name, module_path(node), inputs=ins,
                           out_shapes=[tuple(o.shape) for o in outs], out_dtypes=[o.dtype for o in outs])
                pn.requires_grad = any(self.nodes[i].requires_grad for i, _ in ins) and any(
                    d.is_floating_point or d.is_complex for d in pn.out_dtypes)
                pn.from_input = any(self.nodes[i].from_input for i, _ in ins)
                if name.startswith("wrap_with"):
                    pn.requires_grad = False
            elif node.op == "output":
                flat = [a for a in torch.utils._pytree.tree_leaves(node.args) if isinstance(a, fx.Node)]
                ins = [by_fx[a] for a in flat if a in by_fx]
                pn = PNode(len(self.nodes), node, "output", "output", "", inputs=ins)
            else:
                continue
            by_fx[node] = (pn.index, 0)
            self.nodes.append(pn)
        self.by_fx = by_fx

    def _add_gradient_sums(self):
        """A tensor read by several ops gets one node for the sum of their gradients.

        Autograd adds the consumers' gradients before the producer sees them, so a
        Replicate tensor read by three column-parallel linears (q, k, v) is all-reduced once
        in backward, not three times.  The sum node's choice is the layout the gradients are
        added in; each consumer's gradient reaches it (free when Partial meets Partial), and
        the sum reaches the producer's layout."""
        self.readers: dict[tuple, list] = {}  # (producer, output) -> [(reader, operand index)]
        readers = self.readers
        for pn in self.nodes:
            for k, (src, out) in enumerate(pn.inputs):
                readers.setdefault((src, out), []).append((pn.index, k))
        self.gradsum_of: dict[tuple, int] = {}
        for (src, out), users in readers.items():
            u = self.nodes[src]
            if len(users) < 2 or not u.requires_grad:
                continue
            gs = PNode(len(self.nodes), u.node, "gradsum", "gradient-sum", u.module,
                       out_shapes=[u.out_shapes[out]], out_dtypes=[u.out_dtypes[out]])
            gs.source = (src, out)
            self.nodes.append(gs)
            self.gradsum_of[(src, out)] = gs.index

    def _share_layers(self):
        """Identical repeated layers (same ops, shapes and wiring) share representatives.

        Layers alternate between SHARE_PERIOD sets of choices (even layers share one set, odd
        layers the other), so the problem does not grow with depth yet alternating layouts,
        such as Megatron's column/row pattern over bare linear layers, stay reachable."""
        blocks: dict[tuple, list[int]] = {}
        for pn in self.nodes:
            key = block_of(pn.module) if pn.kind in ("op", "param") else None
            if key is not None:
                blocks.setdefault(key, []).append(pn.index)
        for pn in self.nodes:
            pn.rep = pn.index
        by_sig: dict[tuple, list[int]] = {}
        for key, members in blocks.items():
            local = {m: k for k, m in enumerate(members)}
            sig = []
            for m in members:
                pn = self.nodes[m]
                rest = pn.module[len(f"{key[0]}.{key[1]}"):]
                wiring = tuple((local[s], o) if s in local else ("ext", self.nodes[s].requires_grad)
                               for s, o in pn.inputs)
                sig.append((pn.kind, pn.op, rest, tuple(pn.out_shapes), tuple(pn.out_dtypes), wiring,
                            _args_signature(pn.node), pn.requires_grad))
            by_sig.setdefault((key[0], tuple(sig)), []).append(key[1])
        self.layer_groups = []
        self.tie: dict[int, int] = {}  # representative of an odd layer -> that of the even layer
        self.block: dict[int, tuple] = {}
        for (prefix, _), indices in by_sig.items():
            indices.sort()
            for i in indices:
                for m in blocks[(prefix, i)]:
                    self.block[m] = (prefix, i)
            for k, i in enumerate(indices[SHARE_PERIOD:], start=SHARE_PERIOD):
                first = blocks[(prefix, indices[k % SHARE_PERIOD])]
                for rep, m in zip(first, blocks[(prefix, i)]):
                    self.nodes[m].rep = rep
            if len(indices) > 1:
                for even, odd in zip(blocks[(prefix, indices[0])], blocks[(prefix, indices[1])]):
                    self.tie[odd] = even
            self.layer_groups.append((prefix, indices))
        for (src, out), gs in self.gradsum_of.items():
            rep_gs = self.gradsum_of.get((self.nodes[src].rep, out))
            if rep_gs is not None and len(self.readers[(src, out)]) == len(self.readers[(self.nodes[src].rep, out)]):
                self.nodes[gs].rep = rep_gs
        for odd, even in list(self.tie.items()):
            gs_odd, gs_even = (self.gradsum_of.get((n, 0)) for n in (odd, even))
            if gs_odd is not None and gs_even is not None and self.nodes[gs_odd].rep == gs_odd:
                self.tie[gs_odd] = gs_even

    # --- menus ------------------------------------------------------------------------------
    def _build_menus(self):
        mesh = self.mesh
        fallback_ops: dict[str, list[str]] = {}
        for pn in self.nodes:
            if pn.rep != pn.index:
                continue
            in_shapes = [self.nodes[s].out_shapes[o] for s, o in pn.inputs]
            needs = [self.nodes[s].requires_grad for s, o in pn.inputs]
            if pn.kind == "param":
                pn.strategies = _param_menu(pn.out_shapes[0], mesh, pn.requires_grad)
            elif pn.kind == "input":
                pn.strategies = [replicated(0, 1, mesh.ndim, [])]
            elif pn.kind == "output":
                pn.strategies = [replicated(len(pn.inputs), 0, mesh.ndim, [False] * len(pn.inputs))]
            elif pn.kind == "gradsum":
                continue  # after the other menus: it lists the layouts they can produce
            elif not pn.requires_grad:
                # masks, positions, token ids: no gradient and no parameter behind them, so
                # they are made whole on every rank and each consumer slices what it needs
                # (free); planning them would only grow the ILP
                pn.strategies = [replicated(len(pn.inputs), len(pn.out_shapes), mesh.ndim, needs)]
            else:
                try:
                    ann = annotate(pn.node, in_shapes, pn.out_shapes)
                except Exception as exc:  # a rule that does not fit this call: replicate, say so
                    log.debug("rule for %s failed on %s: %s", pn.op, pn.name, exc)
                    ann = None
                if ann is None:
                    pn.fallback = True
                    fallback_ops.setdefault(pn.op, []).append(pn.module or pn.name)
                    pn.strategies = [replicated(len(pn.inputs), len(pn.out_shapes), mesh.ndim, needs)]
                else:
                    pn.strategies = enumerate_strategies(ann, in_shapes, pn.out_shapes, mesh.shape,
                                                         mesh.axis_names, needs)
                    internal = [(l, INTERNAL_COMM[(pn.op, l)]) for l in ann.letters() if (pn.op, l) in INTERNAL_COMM]
                    if internal:
                        pn.strategies = [_with_internal(s, internal) for s in pn.strategies]
        for pn in self.nodes:
            if pn.kind == "gradsum" and pn.rep == pn.index:
                pn.strategies = self._gradsum_menu(pn)
        for op, where in fallback_ops.items():
            msg = (f"autopar: no sharding rule for {op} (in {', '.join(sorted(set(where))[:3])}); it runs "
                   f"replicated on every rank. Add a rule in autopar/ops/rules.py to shard it.")
            self.warnings.append(msg)
            warnings.warn(msg, stacklevel=3)
        self.fallback_ops = sorted(fallback_ops)

    def _gradsum_menu(self, gs: PNode) -> list[Strategy]:
        src, out = gs.source
        layouts: dict = {}
        for s in self.nodes[self.nodes[src].rep].strategies:
            layouts.setdefault(tuple(C.grad_target(p) for p in s.outputs[out]), None)
        for v, k in self.readers[(src, out)]:
            for s in self.nodes[self.nodes[v].rep].strategies:
                if s.grads[k] is not None:
                    layouts.setdefault(tuple(s.grads[k]), None)
        return [Strategy(tuple(None for _ in layout), (), (layout,), (), 1, "sum " + show_placements(layout))
                for layout in layouts]

    # --- costs ------------------------------------------------------------------------------
    def _build_costs(self):
        self.choices: dict[int, list[Choice]] = {}
        for pn in self.nodes:
            if pn.rep != pn.index:
                continue
            work = (C.measure_flops(pn.node, [self.nodes[src].requires_grad for src, _ in pn.inputs])
                    if pn.kind == "op" else C.OpWork(0.0, 0.0))
            self.choices[pn.index] = [self._choice(pn, s, work) for s in pn.strategies]
        self.edges: list[EdgeKey] = []   # every concrete edge
        for pn in self.nodes:
            for k, (src, out) in enumerate(pn.inputs):
                self.edges.append(EdgeKey("data", src, pn.index, out, k))
                gs = self.gradsum_of.get((src, out))
                if gs is not None:
                    self.edges.append(EdgeKey("grad_in", pn.index, gs, out, k))
        for (src, out), gs in self.gradsum_of.items():
            self.edges.append(EdgeKey("grad_out", gs, src, out, 0))
        self.edge_classes: dict[EdgeKey, int] = {}
        for e in self.edges:
            key = self.rep_edge(e)
            self.edge_classes[key] = self.edge_classes.get(key, 0) + 1
        self.counts: dict[int, int] = {}
        for pn in self.nodes:
            self.counts[pn.rep] = self.counts.get(pn.rep, 0) + 1
        self.edge_costs = {key: self._edge_matrix(key) for key in self.edge_classes}

    def rep_edge(self, e: EdgeKey) -> EdgeKey:
        return e._replace(a=self.nodes[e.a].rep, b=self.nodes[e.b].rep)

    def _choice(self, pn: PNode, s: Strategy, work: C.OpWork) -> Choice:
        mesh = self.mesh
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        comm = [0.0] * mesh.ndim
        if pn.kind == "param":
            return self._param_choice(pn, s)
        if pn.kind != "op":
            return Choice(0.0, tuple(comm), mem)
        in_bytes = sum(C.local_numel(self.nodes[src].out_shapes[o], p, mesh.shape) *
                       self.nodes[src].out_dtypes[o].itemsize
                       for (src, o), p in zip(pn.inputs, s.inputs))
        out_bytes = sum(C.local_numel(shape, p, mesh.shape) * d.itemsize
                        for shape, d, p in zip(pn.out_shapes, pn.out_dtypes, s.outputs))
        dtype = pn.out_dtypes[0] if pn.out_dtypes else torch.float32
        if pn.op in VIEWS:
            compute = 0.0
        else:
            compute = C.roofline(work.fwd_flops / s.factor, in_bytes + out_bytes, dtype, mesh)
            if pn.requires_grad:
                compute += C.roofline(work.bwd_flops / s.factor, 2 * (in_bytes + out_bytes), dtype, mesh)
        if pn.requires_grad and pn.op not in SAVES_NOTHING:
            # saved for backward: the op's activation operands, in the layout the op reads them
            mem["activations"] = sum(
                C.local_numel(self.nodes[src].out_shapes[o], p, mesh.shape) * self.nodes[src].out_dtypes[o].itemsize
                for (src, o), p in zip(pn.inputs, s.inputs) if self.nodes[src].kind == "op")
        if s.comm:  # per-row collectives of a named strategy, on the rows this rank holds
            rows_shape = self.nodes[pn.inputs[0][0]].out_shapes[pn.inputs[0][1]][:1]
            rows = C.local_numel(rows_shape, [p if isinstance(p, Shard) and p.dim == 0 else Replicate()
                                              for p in s.inputs[0]], mesh.shape)
            for kind, axis, per_row in s.comm:
                comm[axis] += C.collective_time(kind, per_row * 4 * rows, axis, mesh)
        return Choice(compute, tuple(comm), mem)

    def _param_choice(self, pn: PNode, s: Strategy) -> Choice:
        """Model states of a parameter stored in layout s.outputs[0] (ZeRO, Rajbhandari et al.
        2020): weights `item` bytes per local element, gradients `item`, optimizer states
        C.state_bytes (Adam's two moments, plus float32 master weights under mixed
        precision).  ZeRO-1/2 over axes Z of n ranks: each rank keeps ceil(local / n)
        elements of the optimizer state (and, stage 2, of the gradient), and after the
        optimizer step the updated parameter is all-gathered over Z.  Offload moves the
        optimizer state to host memory and pays the host link for the gradient going down
        and the weights coming up, plus the host's optimizer step."""
        mesh = self.mesh
        comm = [0.0] * mesh.ndim
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        layout = s.outputs[0]
        numel = C.local_numel(pn.out_shapes[0], layout, mesh.shape)
        item = pn.out_dtypes[0].itemsize
        mem["params"] = numel * item
        if not pn.requires_grad:
            return Choice(0.0, tuple(comm), mem, numel * item)
        state = C.state_bytes(item, self.precision is not None)
        n = math.prod(mesh.shape[a] for a in s.zero_axes)
        owned = math.ceil(numel / n) if s.zero else numel
        mem["grads"] = (owned if s.zero == 2 else numel) * item
        mem["optimizer"] = 0.0 if s.offload else owned * state
        compute = 0.0
        for st in self.zero_gather_steps(pn, s):
            comm[st.axis] += st.seconds
        if s.offload:
            dev = mesh.device
            compute = 2 * owned * item / dev.host_bandwidth + owned / dev.host_optimizer_rate
        return Choice(compute, tuple(comm), mem, numel * (2 * item + state))

    def zero_gather_steps(self, pn: PNode, s: Strategy) -> tuple:
        """The all-gathers that spread a ZeRO-1/2 parameter's updated chunks after the step."""
        if not s.zero:
            return ()
        layout = s.outputs[0]
        return self._redistribute(pn.out_shapes[0], pn.out_dtypes[0].itemsize, zero_layout(layout, s.zero_axes), layout)

    def grad_destination(self, pn: PNode, s: Strategy, out: int = 0) -> tuple:
        """The layout the gradient of tensor pn[out] must reach when pn takes strategy s:
        its own layout with Partial made Replicate, and for a ZeRO-2 parameter split over
        the ZeRO axes (reduce-scattered, not all-reduced)."""
        target = tuple(C.grad_target(x) for x in s.outputs[out])
        if pn.kind == "param" and s.zero == 2:
            target = zero_layout(target, s.zero_axes)
        return target

    def _redistribute(self, shape, itemsize, src, dst):
        """C.redistribute, remembered per problem (a cache on the method itself would keep
        every problem ever built alive)."""
        cache = self.__dict__.setdefault("_redistributions", {})
        key = (shape, itemsize, src, dst)
        if key not in cache:
            cache[key] = C.redistribute(shape, itemsize, src, dst, self.mesh)
        return cache[key]

    def edge_steps(self, e: EdgeKey, i: int, j: int):
        """Forward and backward collectives on edge `e` (between representatives) when its
        ends take choices i (of e.a) and j (of e.b)."""
        a, b = self.nodes[e.a], self.nodes[e.b]
        if e.kind == "grad_in":   # consumer a's gradient joins the sum b
            g = a.strategies[i].grads[e.operand]
            if g is None:
                return (), ()
            shape, item = b.out_shapes[0], b.out_dtypes[0].itemsize
            return (), self._redistribute(shape, item, tuple(g), b.strategies[j].outputs[0])
        if e.kind == "grad_out":  # the sum a reaches the layout of tensor b[out]
            shape, item = a.out_shapes[0], a.out_dtypes[0].itemsize
            target = self.grad_destination(b, b.strategies[j], e.out)
            return (), self._redistribute(shape, item, a.strategies[i].outputs[0], target)
        p = a.strategies[i].outputs[e.out]
        q = b.strategies[j].inputs[e.operand]
        g = b.strategies[j].grads[e.operand]
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        fwd = self._redistribute(shape, item, p, q)
        bwd = ()
        if a.requires_grad and g is not None:
            if (e.a, e.out) not in self._summed:
                bwd = self._redistribute(shape, item, g, self.grad_destination(a, a.strategies[i], e.out))
            if a.kind == "param":  # gathered for use, dropped after forward: gather again for backward
                bwd = bwd + tuple(st for st in fwd if st.kind == "all_gather")
        return fwd, bwd

    @functools.cached_property
    def _summed(self) -> set:
        """Tensors (by representative) whose gradient goes through a gradient-sum node."""
        return {(self.nodes[src].rep, out) for src, out in self.gradsum_of}

    def _edge_matrix(self, e: EdgeKey) -> np.ndarray:
        """Seconds of edge `e` for every pair of choices (rows: e.a's, columns: e.b's): what
        `edge_steps` prices, computed once per distinct pair of layouts and spread by index
        arrays (a 3-axis mesh gives menus of ~125 choices, so edges of ~15,000 pairs)."""
        a, b = self.nodes[e.a], self.nodes[e.b]
        code = C.layout_code
        if e.kind == "grad_in":   # consumer a's gradient (None: none) joins the sum b
            shape, item = b.out_shapes[0], b.out_dtypes[0].itemsize
            grads = [s.grads[e.operand] for s in a.strategies]
            has = np.array([g is not None for g in grads])
            src = _codes([code(g) if g is not None else None for g in grads])
            dst = _codes([code(s.outputs[0]) for s in b.strategies])
            return np.where(has[:, None], self._seconds_table(shape, item, src, dst), 0.0)
        if e.kind == "grad_out":  # the sum a reaches the layout of tensor b[out]
            shape, item = a.out_shapes[0], a.out_dtypes[0].itemsize
            src = _codes([code(s.outputs[0]) for s in a.strategies])
            dst = _codes([code(self.grad_destination(b, s, e.out)) for s in b.strategies])
            m = self._seconds_table(shape, item, src, dst)
            own = _codes([_shape_key(code(s.outputs[0])) for s in a.strategies])
            theirs = _codes([_shape_key(code(s.outputs[e.out])) for s in b.strategies])
            return np.where(own[1][:, None] == theirs[1][None, :], m, m + UNUSABLE)
        shape, item = a.out_shapes[e.out], a.out_dtypes[e.out].itemsize
        p = _codes([code(s.outputs[e.out]) for s in a.strategies])
        q = _codes([code(s.inputs[e.operand]) for s in b.strategies])
        m = self._seconds_table(shape, item, p, q)
        if not a.requires_grad:
            return m
        grads = [s.grads[e.operand] for s in b.strategies]
        has = np.array([g is not None for g in grads])
        bwd = np.zeros_like(m)
        if (e.a, e.out) not in self._summed:
            g = _codes([code(x) if x is not None else None for x in grads])
            dest = _codes([code(self.grad_destination(a, s, e.out)) for s in a.strategies])
            bwd = self._seconds_table(shape, item, dest, g, reverse=True)
        if a.kind == "param":  # gathered for use, dropped after forward: gather again for backward
            bwd = bwd + self._seconds_table(shape, item, p, q, gathers=True)
        return m + np.where(has[None, :], bwd, 0.0)

    def _seconds_table(self, shape, item, src, dst, reverse=False, gathers=False) -> np.ndarray:
        """[choices of src, choices of dst] seconds of redistributing a tensor of `shape` from
        each row's layout to each column's (`reverse`: from each column's to each row's);
        `gathers`: only the all-gathers among those steps.  src, dst: `_codes` pairs, a None
        code standing for no tensor (0 s).  Each pair of layouts is priced once per problem,
        as a line in the tensor's bytes (cost.redistribute_price), and scaled to this tensor."""
        (su, si), (du, di) = src, dst
        whole = (math.prod(shape) if shape else 1) * item
        if whole == 0:
            return np.zeros((len(si), len(di)))
        rows, cols = self._layout_ids(su), self._layout_ids(du)
        lines = self._prices(cols, rows).transpose(0, 2, 1) if reverse else self._prices(rows, cols)
        fixed, per_byte = (lines[2], lines[3]) if gathers else (lines[0], lines[1])
        return (fixed + per_byte * whole)[np.ix_(si, di)]

    def _layout_ids(self, codes) -> np.ndarray:
        ids = self._price_book["ids"]
        return np.array([ids.setdefault(c, len(ids)) for c in codes], dtype=int)

    def _prices(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """[4, len(src), len(dst)]: redistribute_price between layouts by id, each computed once."""
        book = self._price_book
        table = book["table"]
        size = len(book["ids"])
        if size > table.shape[1]:  # grow, unknown prices NaN
            grown = np.full((4, 2 * size, 2 * size), np.nan)
            grown[:, :table.shape[1], :table.shape[2]] = table
            book["table"] = table = grown
        sub = table[:, src[:, None], dst[None, :]]
        missing = np.isnan(sub[0])
        if missing.any():
            code = list(book["ids"])
            for x, y in zip(*np.nonzero(missing)):
                s, d = code[src[x]], code[dst[y]]
                table[:, src[x], dst[y]] = 0.0 if s is None or d is None else C.redistribute_price(s, d, self.mesh)
            sub = table[:, src[:, None], dst[None, :]]
        return sub

    @functools.cached_property
    def _price_book(self) -> dict:
        """Layout code -> id (None: no tensor, priced 0), and [4, id, id] redistribute_price."""
        return {"ids": {}, "table": np.full((4, 0, 0), np.nan)}

    # --- queries ----------------------------------------------------------------------------
    def node_cost(self, rep: int) -> np.ndarray:
        return np.array([c.time for c in self.choices[rep]])

    def node_memory(self, rep: int) -> np.ndarray:
        return np.array([sum(c.memory.values()) for c in self.choices[rep]])

    def node_plain_memory(self, rep: int) -> np.ndarray:
        return np.array([sum(c.memory.values()) if c.plain_memory is None else c.plain_memory
                         for c in self.choices[rep]])


# Views cost neither time nor memory; linear elementwise ops and views save nothing for backward.
from .ops.rules import ELEMENTWISE as _ELEMENTWISE, LINEAR_ELEMENTWISE as _LINEAR  # noqa: E402

VIEWS = TRIVIAL - _ELEMENTWISE
SAVES_NOTHING = VIEWS | _LINEAR | {"aten.add", "aten.sub", "aten.embedding"}


def _args_signature(node: fx.Node):
    def norm(a):
        if isinstance(a, fx.Node):
            return "node"
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype)):
            return a
        return type(a).__name__
    return norm(node.args), tuple(sorted((k, norm(v)) for k, v in node.kwargs.items()))


def zero_layout(layout: tuple, axes: tuple) -> tuple:
    """`layout` split further over the ZeRO `axes` (where it is Replicate): the flat chunks
    each rank owns.  Shard(0) stands for "a 1/n chunk"; only sizes matter to the costs."""
    return tuple(Shard(0) if a in axes else p for a, p in enumerate(layout))


def _param_menu(shape, mesh: Mesh, trainable: bool = True) -> list[Strategy]:
    """Storage layouts of a parameter: per axis Replicate or Shard of a dim it divides
    (Shard on an axis whose ops read it whole is ZeRO-3); for a trainable parameter stored
    whole on some axes, also ZeRO-1, ZeRO-2 and ZeRO-2 with offload over those axes; for one
    stored split on every axis, offload."""
    import itertools
    per_axis = []
    for n in mesh.shape:
        opts = [Replicate()]
        if n > 1:
            opts += [Shard(d) for d, size in enumerate(shape)]
        per_axis.append(opts)
    menu = []
    for combo in itertools.product(*per_axis):
        factor = {}
        for p, n in zip(combo, mesh.shape):
            if isinstance(p, Shard):
                factor[p.dim] = factor.get(p.dim, 1) * n
        if any(shape[d] % f for d, f in factor.items()):
            continue
        name = " ".join(f"{ax}=S({p.dim})" for ax, p in zip(mesh.axis_names, combo)
                        if isinstance(p, Shard)) or "replicate"
        base = Strategy(tuple(None for _ in combo), (), (tuple(combo),), (), 1, name)
        menu.append(base)
        if not trainable:
            continue
        whole = tuple(a for a, (p, n) in enumerate(zip(combo, mesh.shape)) if isinstance(p, Replicate) and n > 1)
        over = "+".join(mesh.axis_names[a] for a in whole)
        if whole:
            for stage, offload in ((1, False), (2, False), (2, True)):
                menu.append(dataclasses.replace(
                    base, name=f"{name}, zero-{stage} over {over}" + (", offload" if offload else ""),
                    zero=stage, zero_axes=whole, offload=offload))
        else:
            menu.append(dataclasses.replace(base, name=f"{name}, offload", offload=True))
    return menu


UNUSABLE = float("inf")  # a choice pair the runtime cannot run as planned: the ILP never picks it


def same_local_shape(a, b) -> bool:
    """Whether layouts a and b give every rank a local tensor of the same shape (they differ
    at most in Replicate versus Partial).  Gradients are summed by autograd, which needs the
    sum's layout to have the tensor's own local shape."""
    return all((isinstance(x, Shard) and isinstance(y, Shard) and x.dim == y.dim)
               or (not isinstance(x, Shard) and not isinstance(y, Shard)) for x, y in zip(a, b))


def _codes(keys: list):
    """(distinct keys in first-seen order, index of each key among them): a menu's layouts
    grouped so a cost is computed once per distinct layout."""
    distinct: dict = {}
    ids = np.array([distinct.setdefault(k, len(distinct)) for k in keys], dtype=int)
    return list(distinct), ids


def _shape_key(code: tuple) -> tuple:
    """What `same_local_shape` compares: the shard dim per axis, Replicate and Partial alike."""
    return tuple(c if c >= 0 else -1 for c in code)


def _pass_through(src: PNode, src_map, out: int, pn: PNode, operand: int, mask):
    """For each choice of the producer's root, the follower strategy that takes the producer's
    layout unchanged; None when some producer layout has no such strategy (then the node is
    planned on its own: a view cannot take a Partial tensor's layout greedily)."""
    by_input = {}
    for t, s in enumerate(pn.strategies):
        if mask[t]:
            by_input.setdefault(s.inputs[operand], t)
    result = np.zeros(len(src_map), dtype=int)
    for k, s_src in enumerate(src_map):
        t = by_input.get(src.strategies[s_src].outputs[out])
        if t is None:
            return None
        result[k] = t
    return result


def _with_internal(s: Strategy, internal) -> Strategy:
    """Add the collectives a named strategy runs inside the op (vocabulary-parallel loss)."""
    steps = list(s.comm)
    for axis, letter in enumerate(s.split):
        for l, comms in internal:
            if letter == l:
                for kind, per_row in comms:
                    steps.append((kind, axis, per_row))
    if not steps:
        return s
    return Strategy(s.split, s.inputs, s.outputs, s.grads, s.factor, s.name + " (vocab-parallel)", tuple(steps),
                    reduced=s.reduced)


@dataclass
class Reduced:
    """The ILP view of a Problem: one variable node per root, follower maps to recover the rest."""

    roots: list            # rep index per ILP node
    costs: list            # np arrays, totals over all instances
    memory: list
    plain_memory: list     # memory as the tie-break sees it (Choice.plain_memory)
    edges: list            # (ilp u, ilp v, matrix)
    allowed: list
    root_of: dict          # rep -> rep of its root
    follow: dict           # rep -> np array: rep's choice for each root choice
    canon: object          # rep -> the rep whose choice it takes (period 1 ties odd layers to even)


def reduce_problem(problem: Problem, allowed_fn=None, period: int = SHARE_PERIOD) -> Reduced:
    """Fold followers (views and unary elementwise ops take the layout their producer offers)
    into their producers and multiply every cost by the number of layers sharing it.

    period 1 ties odd layers to even ones too (every identical layer the same choice):
    half the variables; period 2 lets layouts alternate from layer to layer."""
    nodes = problem.nodes

    def canon(r):
        return problem.tie.get(r, r) if period == 1 else r

    reps = sorted({canon(pn.rep) for pn in nodes})
    counts: dict[int, int] = {}
    for pn in nodes:
        counts[canon(pn.rep)] = counts.get(canon(pn.rep), 0) + 1
    edge_classes: dict[EdgeKey, int] = {}
    edge_costs: dict[EdgeKey, np.ndarray] = {}
    for e in problem.edges:
        rep = problem.rep_edge(e)
        key = rep._replace(a=canon(rep.a), b=canon(rep.b))
        edge_classes[key] = edge_classes.get(key, 0) + 1
        edge_costs.setdefault(key, problem.edge_costs[rep])
    mask = {}
    for r in reps:
        pn = nodes[r]
        m = np.array([True if allowed_fn is None else bool(allowed_fn(problem, pn, s)) for s in pn.strategies])
        if not m.any():
            m[:] = True  # the restriction does not speak to this node
        mask[r] = m
    incoming: dict[int, list] = {}
    for key in edge_classes:
        if key.kind == "data":
            incoming.setdefault(key.b, []).append(key)
    cost = {r: problem.node_cost(r) * counts[r] for r in reps}
    mem = {r: problem.node_memory(r) * counts[r] for r in reps}
    plain = {r: problem.node_plain_memory(r) * counts[r] for r in reps}
    root_of, follow = {}, {}
    used_edges = set()
    for r in reps:
        pn = nodes[r]
        keys = incoming.get(r, [])
        this_map = None
        if (pn.kind == "op" and pn.op in TRIVIAL and len(keys) == 1 and len(pn.strategies) > 1
                and edge_classes[keys[0]] == counts[r] and keys[0].a != r
                and len(nodes[keys[0].a].strategies) > 1):
            key = keys[0]
            src = key.a
            this_map = _pass_through(nodes[src], follow[src], key.out, pn, key.operand, mask[r])
        if this_map is not None:
            root = root_of[src]
            edge = edge_costs[key] * edge_classes[key]
            for s_root, (s_src, t) in enumerate(zip(follow[src], this_map)):
                cost[root][s_root] += edge[s_src, t] + cost[r][t]
                mem[root][s_root] += mem[r][t]
                plain[root][s_root] += plain[r][t]
            root_of[r], follow[r] = root, this_map
            used_edges.add(key)
        else:
            root_of[r], follow[r] = r, np.arange(len(pn.strategies))
    roots = [r for r in reps if root_of[r] == r]
    index = {r: i for i, r in enumerate(roots)}
    edges = []
    for key, count in edge_classes.items():
        if key in used_edges:
            continue
        m = edge_costs[key] * count
        m = m[np.ix_(follow[key.a], follow[key.b])]
        edges.append((index[root_of[key.a]], index[root_of[key.b]], m))
    allowed = [mask[r] for r in roots]
    costs = [cost[r] for r in roots]
    return Reduced(roots, costs, [mem[r] for r in roots], [plain[r] for r in roots], edges, allowed, root_of,
                   follow, canon)
