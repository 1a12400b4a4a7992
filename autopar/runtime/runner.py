"""How a compiled model runs its graph: the parts both kinds of plan share, and the runner
of an unpipelined plan.

A CompiledModel (autopar/runtime/model.py) holds what every plan has: this rank's state
(runtime/state/rank_state.RankState: shards, buffers, master weights), the gradient synchronisation,
the feed of the graph.  What differs between a plan without stages and one with them is how a step
runs, and that is a runner's job:

- `GraphRunner` (here) runs the one per-rank graph: forward on the global batch (or this
  rank's shards of it), backward, the loss's all-reduce overlapped with backward.
- `PipelineRunner` (autopar/runtime/pipeline/pipelined.py) runs this rank's stages under the plan's
  schedule, over microbatches, and broadcasts the loss.

Both meet the caller through a `GraphIO`: the check of the inputs' structure, shapes and
values, what each graph placeholder is fed with, the structure of the outputs and which
of them leave the graph as Partial sums.

A runner answers the same questions for the model: forward(args, kwargs),
train_step(args, kwargs), backward(loss), no_sync(), graphs(), gather_counts(),
whole(local) (whole tensors gathered from the device group holding each) and
predicted_memory().
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.passes.collectives import move

from autopar.runtime.regions.inductor import compile_regions
from autopar.runtime.checks.inputs import InputCheck
from autopar.runtime.options import RunOptions
from autopar.runtime.process import CompileError
from autopar.runtime.state.plain_state import as_dtensor
from autopar.runtime.state.rank_state import param_key
from autopar.trace.loss import not_a_loss, pick_loss


class GraphIO:
    """How the traced graph meets the caller: user inputs flattened and checked, each
    placeholder's feed ("param", key) / ("buffer", key) / ("input", None), the outputs'
    structure, and output index -> Move of a Partial scalar (the loss) summed by the runtime."""

    def __init__(self, order: list, placeholders: list, in_spec, out_spec, output_reduce: dict, check: InputCheck,
                 output_layouts: dict | None = None):
        self.order = order
        self.placeholders = placeholders
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.output_reduce = dict(output_reduce)
        self.check = check
        self.output_layouts = dict(output_layouts or {})   # output index -> (placements, global shape)

    def flatten(self, args, kwargs) -> list:
        """The user inputs flattened, after checking their structure, shapes and values."""
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self.in_spec is not None and spec != self.in_spec:
            raise CompileError(f"inputs do not match the example inputs the model was compiled with "
                               f"(expected structure {self.in_spec}, got {spec})")
        self.check(flat)
        return flat

    def input_names(self) -> list:
        """The placeholders fed with user inputs, in the order of the flattened inputs."""
        return [name for (kind, _), name in zip(self.order, self.placeholders) if kind == "input"]

    def feed(self, flat: list, model, device) -> list:
        """Every placeholder's value: `model`'s shards and buffers, the inputs moved to `device`."""
        inputs = iter(t.to(device) if isinstance(t, torch.Tensor) else t for t in flat)
        out = []
        for kind, key in self.order:
            if kind == "param":
                out.append(model.shards[key])
            elif kind == "buffer":
                out.append(model.get_buffer(key))
            else:
                out.append(next(inputs))
        return out

    def structure(self, flat: list):
        if self.out_spec is not None:
            return pytree.tree_unflatten(list(flat), self.out_spec)
        return flat[0] if len(flat) == 1 else tuple(flat)


def graph_io(rewritten, groups, options: RunOptions, batch_scale: int = 1) -> GraphIO:
    """The GraphIO of this rank's graph (runtime/build.RankGraph): each placeholder fed with
    a parameter shard (a tied weight: its owner's), a buffer or a user input, the inputs
    checked as `options` says.  batch_scale: a pipelined plan's microbatches per batch."""
    traced, gm = rewritten.traced, rewritten.graph
    order = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.target in traced.params:
            name = traced.params[node.target]
            order.append(("param", param_key(traced.tied.get(name, name))))
        elif node.target in traced.buffers:
            order.append(("buffer", param_key(traced.buffers[node.target])))
        else:
            order.append(("input", None))
    check = InputCheck(rewritten.inputs, groups, batch_scale, rewritten.input_layouts, options.check_inputs,
                       options.check_inputs_every)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    operands = [a for a in pytree.tree_leaves(out.args) if isinstance(a, fx.Node)]
    layouts = {k: (p, tuple(operands[k].meta["val"].shape)) for k, p in rewritten.output_layouts.items()}
    return GraphIO(order, [n.target for n in gm.graph.nodes if n.op == "placeholder"], traced.in_spec,
                   traced.out_spec, rewritten.output_reduce, check, layouts)


class GraphRunner:
    """Runs the one per-rank graph of a plan without pipeline stages."""

    pipelined = False

    def __init__(self, model, regather=None):
        """model: the CompiledModel whose graph, shards, buffers, io and grad_sync it runs on;
        regather: the runtime.regions.reshard.Regather of the graph's ZeRO-3 gathers (None: none)."""
        self.model = model
        self.graph_module = model.graph_module
        self.regather = regather
        self.compiled: dict = {}   # backend "inductor": training mode -> (split module, its regions)
        self.loss_axes: tuple = ()   # mesh axes the last train_step summed the loss over (checks/faults.seen_alike)

    def graphs(self) -> list:
        return [self.graph_module]

    def run(self, args, kwargs) -> list:
        """The graph's outputs as it returns them (a deferred loss still Partial)."""
        m = self.model
        flat = m.io.flatten(args, kwargs)
        m.grad_sync.begin()
        feed = m.io.feed(flat, m, m.device)
        m.streams.calls += 1
        module = self._module()
        if self.regather:
            with self.regather.forward(dict(zip(m.io.placeholders, feed))):
                out = module(*feed)
        else:
            out = module(*feed)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _module(self):
        """What runs the graph: the graph module itself (eager), or under backend "inductor"
        its compiled regions, cut once per training mode (train() and eval() rewrite the
        graph's flags, autopar/passes/modes.py)."""
        if getattr(self.model, "backend", "eager") == "eager":
            return self.graph_module
        mode = self.model.training
        if mode not in self.compiled:
            self.compiled[mode] = compile_regions(self.graph_module, layer_cuts=self.model.device_type == "cuda")
        return self.compiled[mode][0]

    def regions(self) -> list:
        """The compiled regions (backend "inductor") of every mode run so far."""
        return [r for _, regions in self.compiled.values() for r in regions]

    def forward(self, args, kwargs):
        flat = self.run(args, kwargs)
        groups = self.model.groups
        for k, mv in self.model.io.output_reduce.items():  # Partial scalars summed here (autograd-aware)
            flat[k] = move(flat[k], mv, groups)
        for k, (placements, shape) in self.model.io.output_layouts.items():   # large ones, as they lie
            flat[k] = as_dtensor(flat[k], groups.mesh, placements, shape)
        return self.model.io.structure(flat)

    def train_step(self, args, kwargs) -> torch.Tensor:
        """Forward, backward and gradient synchronisation; the loss, detached.  A loss left
        Partial is summed after backward (which only needs this rank's part), as one more
        element of the last gradient bucket on its axes when one is left."""
        m = self.model
        flat = self.run(args, kwargs)
        loss = loss_of(m.io.structure(flat))
        k = next((i for i, t in enumerate(flat) if t is loss), None)
        mv = m.io.output_reduce.get(k)
        if mv is None:
            self.loss_axes = ()
            self.backward(loss)
            return loss.detach()
        total = loss.detach().clone()
        axes = tuple(a for a, (s, d) in enumerate(zip(mv.src, mv.dst)) if s != d)
        self.loss_axes = axes
        self.backward(loss, (total, axes))   # summed with the last gradient bucket on those axes
        return total

    def backward(self, loss, extra: tuple | None = None) -> None:
        """loss.backward() and the gradient synchronisation; extra: (Partial scalar, axes)
        to sum alongside (GradSync.finish)."""
        loss_of(loss).backward()
        if self.regather:
            self.regather.finish()   # ZeRO-3 buckets' gradients into the shards
        self.model.grad_sync.finish(extra)

    def no_sync(self):
        return self.model.grad_sync.no_sync()

    def gather_counts(self) -> dict:
        return gather_counts_of([self.regather])

    def whole(self, local: dict, dtype=None) -> dict:
        """Whole tensors by name: this rank's are already whole."""
        return dict(local)

    def predicted_memory(self) -> dict:
        parts = dict(self.model.plan.predicted.memory)
        return dict(parts, total=sum(parts.values()))


def gather_counts_of(regathers) -> dict:
    """ZeRO-3 gather counts summed over runtime.regions.reshard.Regathers (None: none)."""
    out = {"sites": 0, "gathered": 0, "prefetched": 0, "regathered": 0, "bucket_gathers": 0, "bucket_reduces": 0,
           "fetched": 0, "regather_prefetched": 0, "recompute_gathered": 0, "recompute_buckets": 0}
    for r in regathers:
        if r is not None:
            out["sites"] += len(r.order)
            for k, v in r.counts.items():
                out[k] += v
    return out


def loss_of(out) -> torch.Tensor:
    """The scalar to differentiate: the output itself, its `.loss` (Hugging Face) or its
    first (autopar.trace.loss.pick_loss; planning warns when there is none)."""
    loss, _ = pick_loss(out)
    if loss is None:
        raise CompileError(f"train_step needs the model to return a scalar loss: {not_a_loss('the model', out)}")
    return loss
