"""Compiled regions whose backward runs as two passes: input gradients first, weight
gradients when the schedule says (zero-bubble, ZB-V and DualPipeV under backend="inductor").

A split-backward schedule runs each microbatch's backward as B, the gradients of the
stage's inputs that the previous stage waits for, and W, the weights' gradients, later,
where a bubble would have been.  An Inductor region compiled the usual way has one
backward that returns every gradient at once, so a region runs under such a schedule as
a TwoPassRun instead:

- its forward and backward graphs come from AOTAutograd's joint graph of the region
  (aot_export_joint_simple), cut by the min-cut partitioner as Inductor cuts them (what
  backward recomputes rather than keeps);
- the backward graph is split in two (split_gradients): the nodes the input gradients need
  (B), and the rest, which only the weights' gradients need (W).  W reads backward's
  inputs and the few values of B it shares (a linear's output gradient: the "boundary"),
  which B returns beside the input gradients;
- the three graphs are compiled by Inductor (compile_fx), each on its first call;
- the region's weights (parameters, and what the stage makes of them before the region:
  ZeRO-3's gathers, casts) enter its autograd Function detached.  Backward returns the
  input gradients and hands WeightPasses a deferred W: that pass, when the schedule runs
  it, computes the weights' gradients from the kept boundary and sends them down the
  weights' own autograd edges (one torch.autograd.backward for all of a microbatch's
  regions), so gradient hooks, ZeRO-3's reduce-scatters and mixed precision's float32
  masters see them as they would have in one backward.

torch.distributed.pipelining's stage takes the per-stage WeightPasses as its dw_builder:
after every B it asks for the W of that microbatch (a closure over what that B deferred),
and runs it at the schedule's W action (at once for a full backward).  Weights read
outside compiled regions (eager ops: an experts op's weights; a run too small to compile)
take their gradients in B, as a recomputed layer compiled with its checkpoint does: what
they cost is small beside the products the regions defer."""
from __future__ import annotations

import contextlib
import operator
from functools import partial

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.compile_fx import compile_fx
from torch._subclasses.fake_tensor import FakeTensorMode

WEIGHT = "autopar_weight"   # node.meta: a region input made only from the stage's parameters


class WeightPasses:
    """One stage's deferred weight-gradient passes: each region's backward (B) leaves its W
    here; `builder`, the stage's dw_builder, takes what one microbatch's B left and returns
    the W that runs it."""

    def __init__(self):
        self._pending: list = []
        self.open = False   # inside the stage's own backward (collecting)
        self.deferred = 0   # W passes handed out so far (regions x microbatches)
        self.ran = 0        # ... and run
        self.dropped = 0    # backwards outside the stage's own (their W never runs)

    @contextlib.contextmanager
    def collecting(self):
        """Around the stage's backward of one microbatch (backward_one_chunk): the W passes
        its regions defer are the stage's.  Any other backward through the regions (the
        pipeline's metadata inference on empty tensors asks autograd.grad for the input
        gradients only) wants no weight gradient: what it defers is dropped."""
        self.open = True
        try:
            yield
        finally:
            self.open = False

    def defer(self, edges: list, weight_grads) -> None:
        """edges: the weights' gradient edges; weight_grads(): their gradients, in the same
        order."""
        if not self.open:
            self.dropped += 1
            return
        self._pending.append((edges, weight_grads))
        self.deferred += 1

    def builder(self):
        taken, self._pending = self._pending, []
        return partial(self._run, taken)

    def _run(self, taken: list) -> None:
        edges, grads = [], []
        for es, weight_grads in taken:
            for edge, grad in zip(es, weight_grads()):
                if grad is not None:
                    edges.append(edge)
                    grads.append(grad)
            self.ran += 1
        if edges:
            torch.autograd.backward(edges, grads)


def mark_weights(gm: fx.GraphModule, params: set, outside: set) -> int:
    """Mark (node.meta[WEIGHT]) the nodes of gm that a compiled region may read as weights:
    made only from the placeholders named in `params` (the parameters, their ZeRO-3
    gathers, casts and moves), made outside any compiled region (`outside`: the eager
    nodes and runs left uncompiled; a value one region makes and another reads has its
    gradient in the first one's backward, which runs once, in B), and read by no node
    outside one (an eager reader sends its gradient down the same edge in B, and the edge
    cannot be backwarded again at W).  Returns how many nodes were marked."""
    made: set = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.target in params:
                made.add(node)
        elif node.op == "call_function":
            inputs = [x for x in node.all_input_nodes if x.op != "get_attr"]
            if inputs and all(x in made for x in inputs):
                made.add(node)
    marked = 0
    for node in gm.graph.nodes:
        node.meta.pop(WEIGHT, None)
        if (node in made and (node.op == "placeholder" or node in outside) and node.users
                and not any(u in outside or u.op == "output" for u in node.users)):
            node.meta[WEIGHT] = True
            marked += 1
    return marked


def _ancestors(outputs: list) -> set:
    seen: set = set()
    stack = [o for o in outputs if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _extract(owner: fx.GraphModule, inputs: list, nodes: list, outputs: list) -> fx.GraphModule:
    """A graph module of `nodes` (in graph order) over placeholders for `inputs`,
    returning the tuple `outputs` (nodes among inputs and nodes, or None)."""
    graph = fx.Graph()
    env: dict = {}
    for x in inputs:
        env[x] = graph.placeholder(x.name)
        env[x].meta = dict(x.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return fx.GraphModule(owner, graph)


def split_gradients(bw: fx.GraphModule, weights: set) -> tuple:
    """The backward graph bw (placeholders: saved values and tangents; outputs: one
    gradient per forward input, None where none) cut in two:

    - inputs_pass(*bw inputs) -> (the gradients of the inputs not in `weights` (indices),
      then the boundary: the values the weight pass reads from it);
    - weights_pass(*its bw inputs, *boundary) -> the gradients of the `weights` inputs;

    Returns (inputs_pass, weights_pass or None where no weight has a gradient, the indices
    of bw's placeholders weights_pass reads, the boundary's size).  A node both passes
    need runs in the inputs pass; so does an item of an op whose result the inputs pass
    computes (a norm's backward returns input and weight gradients together)."""
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    out = list(pytree.tree_leaves(next(iter(bw.graph.find_nodes(op="output"))).args[0], is_leaf=lambda x: x is None))
    inputs_out = [o for i, o in enumerate(out) if i not in weights]
    weights_out = [o for i, o in enumerate(out) if i in weights]
    order = {n: k for k, n in enumerate(bw.graph.nodes)}
    first = _ancestors(inputs_out)
    for n in bw.graph.nodes:   # (an item of a result computed in the inputs pass: taken there too)
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in first:
            first.add(n)
    nodes_first = [n for n in bw.graph.nodes if n in first and n.op != "placeholder"]
    if not any(isinstance(o, fx.Node) for o in weights_out):
        return _extract(bw, placeholders, nodes_first, inputs_out), None, [], 0
    second = _ancestors(weights_out) - first
    boundary = sorted({x for n in second for x in n.all_input_nodes if x in first and x.op != "placeholder"}
                      | {o for o in weights_out if isinstance(o, fx.Node) and o in first and o.op != "placeholder"},
                      key=order.get)
    read = [p for p in placeholders if p in second or any(p in n.all_input_nodes for n in second) or p in weights_out]
    second.difference_update(placeholders)
    inputs_pass = _extract(bw, placeholders, nodes_first, inputs_out + boundary)
    weights_pass = _extract(bw, read + boundary, [n for n in bw.graph.nodes if n in second], weights_out)
    return inputs_pass, weights_pass, [placeholders.index(p) for p in read], len(boundary)


class _Lazy:
    """A graph compiled by Inductor (compile_fx, as an inference graph) on its first call."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.run = None

    def ensure(self, args) -> None:
        if self.run is None:
            with torch.no_grad():
                self.run = compile_fx(self.gm, list(args))

    def __call__(self, *args):
        self.ensure(args)
        return self.run(*args)


class _Graphs:
    """A region's forward and two backward passes for one signature of its inputs."""

    def __init__(self, gm: fx.GraphModule, args: list, weight: list):
        traced = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.enable_grad():   # (which outputs take a gradient)
            outs = gm(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in traced])
        self.n_out = len(outs)
        self.differentiable = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        try:
            joint = aot_export_joint_simple(gm, traced, trace_joint=True)
        except RuntimeError as exc:   # an output aliases an input (a view of it): return copies
            if "alias" not in str(exc):
                raise
            joint = aot_export_joint_simple(_copies_out(gm), traced, trace_joint=True)
        fw, bw = min_cut_rematerialization_partition(joint, None, num_fwd_outputs=self.n_out)
        saved = list(next(iter(fw.graph.find_nodes(op="output"))).args[0])[self.n_out:]
        fw_inputs = [n for n in fw.graph.nodes if n.op == "placeholder"]
        # (a saved forward input is passed as the input itself: ZeRO-3's hooks know its storage)
        self.saved_input = [fw_inputs.index(n) if n in fw_inputs else -1 for n in saved]
        self.forward = _Lazy(fw)
        wanted = {i for i, (w, t) in enumerate(zip(weight, traced)) if w and isinstance(t, torch.Tensor)
                  and t.requires_grad}
        self.weights = sorted(wanted)
        self.inputs = [i for i in range(len(args)) if i not in wanted]
        # (the joint traced each tangent with these strides; autograd may hand a transposed one)
        self.tangent_strides = [n.meta["val"].stride() for n in bw.graph.find_nodes(op="placeholder")
                                if n.name.startswith("tangents")]
        first, second, self.second_reads, self.n_boundary = split_gradients(bw, wanted)
        self.inputs_pass = _Lazy(first)
        self.weights_pass = _Lazy(second) if second is not None else None


def _copies_out(gm: fx.GraphModule) -> fx.GraphModule:
    """gm returning a copy of each output (aot_export_joint_simple takes no output that
    aliases an input: a view of one)."""
    graph = fx.Graph()
    outs = pytree.tree_leaves(graph.graph_copy(gm.graph, {}), is_leaf=lambda x: x is None)
    graph.output(tuple(graph.call_function(torch.ops.aten.clone.default, (o,)) if isinstance(o, fx.Node) else o
                       for o in outs))
    return fx.GraphModule(gm, graph)


# (an input of every two-pass Function that requires grad, so that its outputs do, and its
# backward runs, where only its detached weights would: an embedding's region)
_ANCHOR = torch.empty(0, requires_grad=True)


class _TwoPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, passes: WeightPasses, graphs: _Graphs, edges: list, anchor, *args):
        results = graphs.forward(*args)
        outs, saved = results[:graphs.n_out], results[graphs.n_out:]
        saved = [args[i] if i >= 0 else s for i, s in zip(graphs.saved_input, saved)]
        ctx.save_for_backward(*saved)
        ctx.graphs, ctx.passes, ctx.edges = graphs, passes, edges
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, graphs.differentiable)
                                      if not d and isinstance(o, torch.Tensor)))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        tangents = [g if g.stride() == st else torch.empty_strided(g.shape, st, dtype=g.dtype, device=g.device).copy_(g)
                    for g, st in zip((g for g, d in zip(grads, graphs.differentiable) if d), graphs.tangent_strides)]
        bw_args = [*ctx.saved_tensors, *tangents]
        results = graphs.inputs_pass(*bw_args)
        n_in = len(results) - graphs.n_boundary
        if graphs.weights_pass is not None:
            kept = [bw_args[i] for i in graphs.second_reads] + list(results[n_in:])
            ctx.passes.defer(ctx.edges, partial(graphs.weights_pass, *kept))
        out = [None] * (len(graphs.inputs) + len(graphs.weights))
        for i, g in zip(graphs.inputs, results[:n_in]):
            out[i] = g
        return (None, None, None, None, *out)


class TwoPassRun:
    """A region's compute (graph module gm returning a flat tuple, put back in the region's
    structure by `spec`) run with its backward in two passes: `weight` marks which of its
    inputs are weights (WEIGHT), whose gradients `passes` runs later.  Compiled per input
    signature, on first use; without grad, the region's inference graph compiled alone.
    An input that is a tuple (an op's several results, handed on whole) is taken as its
    items."""

    def __init__(self, gm: fx.GraphModule, spec, weight: list, passes: WeightPasses):
        self.gm = gm
        self.spec = spec
        self.weight = weight
        self.passes = passes
        self.compiled: dict = {}   # signature -> _Graphs
        self.inference: dict = {}  # signature -> _Lazy

    @staticmethod
    def _key(flat, in_spec) -> tuple:
        return (in_spec, tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor)
                               else repr(a) for a in flat))

    @staticmethod
    def _training(flat) -> bool:
        return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)

    def _signature(self, args) -> tuple:
        flat, in_spec = pytree.tree_flatten(list(args))
        return flat, in_spec, self._key(flat, in_spec), self._training(flat)

    def ready(self, args) -> bool:
        _, _, key, training = self._signature(args)
        return key in (self.compiled if training else self.inference)

    def prepare(self, args) -> None:
        flat, in_spec, key, training = self._signature(args)
        gm = self.gm if in_spec == pytree.tree_flatten(list(range(len(args))))[1] else _flat_inputs(self.gm, in_spec, self.spec.num_leaves)
        if training:
            # (a tuple input is an activation's items)
            weight = [w and isinstance(a, torch.Tensor) for a, w in zip(args, self.weight) for _ in pytree.tree_leaves(a)]
            graphs = self.compiled[key] = _Graphs(gm, flat, weight)
            graphs.forward.ensure([a.detach() if isinstance(a, torch.Tensor) else a for a in flat])
        else:
            self.inference[key] = _Lazy(gm)
            self.inference[key].ensure(flat)

    def __call__(self, *args):
        flat, _, key, training = self._signature(args)
        if key not in (self.compiled if training else self.inference):
            self.prepare(args)
        if not training:
            outs = self.inference[key](*flat)
        else:
            graphs = self.compiled[key]
            edges = [torch.autograd.graph.get_gradient_edge(flat[i]) for i in graphs.weights]
            inputs = [a.detach() if i in graphs.weights else a for i, a in enumerate(flat)]
            outs = _TwoPass.apply(self.passes, graphs, edges, _ANCHOR, *inputs)
        return pytree.tree_unflatten(list(outs), self.spec)


def _flat_inputs(gm: fx.GraphModule, in_spec, n_out: int) -> fx.GraphModule:
    """gm (n_out outputs, a flat tuple) taking the leaves of its inputs (in_spec: their
    list's structure) one by one."""
    root = nn.Module()
    root.body = gm
    graph = fx.Graph()
    leaves = [graph.placeholder(f"x{i}") for i in range(in_spec.num_leaves)]
    out = graph.call_module("body", tuple(pytree.tree_unflatten(leaves, in_spec)))
    graph.output(tuple(graph.call_function(operator.getitem, (out, i)) for i in range(n_out)))
    return fx.GraphModule(root, graph)
