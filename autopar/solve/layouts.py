"""The layouts a person would write by hand, as restrictions of the same strategy menus.

Each is the cheapest plan the cost model finds within the rules of that layout, so the
comparison with autopar's own plan is like for like:

- data-parallel: every parameter whole on every rank and used whole; every op on the
  gradient path splits its work (the batch) on every axis.
- zero1 / zero2: data parallel with every trainable parameter's optimizer state (zero1)
  and gradient (zero2) split over the mesh (ZeRO-1 / ZeRO-2).
- zero3: every parameter stored sharded over every mesh axis (FSDP / ZeRO-3) and
  all-gathered for use; the batch splits.
- megatron-tp x dp: the layers' matrices stored and used sharded along the tensor-parallel
  axis (column or row, Megatron-LM style), and the word embedding and output head split by
  vocabulary where the model's loss names a vocabulary that divides over the ranks (the
  loss then vocabulary-parallel, as Megatron-LM's); biases, norm weights and position
  embeddings as the cost model prefers;
  other axes data parallel.  On a 1-D mesh it is plain "megatron-tp"; on a larger mesh
  "megatron-tp (all axes)" is tensor parallelism over every device.  Mixture-of-experts
  layers split every expert's inner dim on the tensor-parallel axes.
- expert-parallel: mixture-of-experts weights split over the tensor-parallel axis, tokens
  dispatched to them by all-to-all; the rest data parallel.
- megatron-sp: Megatron's tensor parallelism with sequence parallelism (Korthikanti et al.
  2022): the activations of the residual stream between the tensor-parallel matmuls (norms,
  residual adds, dropout) split by sequence on the tensor-parallel axis, so each block's
  all-reduce becomes a reduce-scatter after it and an all-gather before the next.
- context-parallel / ulysses: data parallel, with attention's sequence split over the
  sequence axis (named 'cp', 'sp', 'context' or 'seq', else the tensor-parallel one) by ring
  attention or by Ulysses' all-to-alls; the other ops split what the cost model prefers.
- tp-2d / tp-2.5d / tp-3d: every linear layer inside the repeated layers on a grid of the
  innermost mesh axes (ops/grid_rule.py): SUMMA on two axes, Tesseract's 2.5D (a square
  grid, the batch split over the other axes as its depth), or the 3D matmul on three; the
  other ops as the cost model prefers, parameters on the device (ZeRO-1/2 over the axes a
  weight is whole on where the cost model prefers).  On a mesh whose further
  axes split the batch, 2D and 2.5D are one plan: the name says the grid's shape.
- context-parallel x megatron-tp and context-parallel x zero3 (every=True, 2+ axes): ring
  attention on the sequence axis, with Megatron on the tensor-parallel axis, or with every
  parameter stored sharded over all axes (ZeRO-3) and the batch split elsewhere.  On a 1-D
  mesh, context-parallel x zero3 (every=True) is ring attention on the one axis with every
  parameter stored sharded over it, as FSDP over the context-parallel ranks keeps them.
"""
from __future__ import annotations

import dataclasses
import math
import weakref

from torch.distributed.tensor import Replicate, Shard

from autopar.ops.attention_rule import ATTENTION_OPS
from autopar.ops.grid_rule import form_of, is_grid
from autopar.ops.strategy import crossed_axes, passes_partial
from autopar.ops.rules import VIEWS


def tp_axis(mesh) -> int:
    """The tensor-parallel axis: the one named 'tp' (or 'tensor'), else the innermost."""
    for name in ("tp", "tensor", "model"):
        if name in mesh.axis_names:
            return mesh.axis_names.index(name)
    return mesh.ndim - 1


def per_problem(compute):
    """compute(problem), worked out once per problem: a rule asks it for every strategy of
    every node.  Kept with the problem object itself (weakly), not under its id, which a
    new problem may reuse once the old one is freed."""
    cache = weakref.WeakKeyDictionary()

    def get(problem):
        if problem not in cache:
            cache[problem] = compute(problem)
        return cache[problem]
    return get


def _param_operands(problem, pn, strategy):
    for (src, _), placement in zip(pn.inputs, strategy.inputs):
        if problem.nodes[src].kind == "param":
            yield problem.nodes[src], placement


def _splits_on(problem, pn, strategy, axes) -> bool:
    """An op on the gradient path that reads the batch works on its part of the batch on
    every given axis (it is not computed whole on every rank).  Ops that see no batch
    (position embeddings of arange) run whole, as they do under DDP."""
    if pn.kind != "op" or not pn.requires_grad or not pn.from_input:
        return True
    return all(strategy.split[a] is not None for a in axes if problem.mesh.shape[a] > 1)


def _plain(strategy) -> bool:
    """Model states kept as the placement says: no ZeRO-1/2, no offload."""
    return not strategy.zero and not strategy.offload


def data_parallel(problem, pn, strategy) -> bool:
    if pn.kind == "param":
        return all(isinstance(p, Replicate) for p in strategy.outputs[0]) and _plain(strategy)
    return (all(all(isinstance(p, Replicate) for p in pl) for _, pl in _param_operands(problem, pn, strategy))
            and _splits_on(problem, pn, strategy, range(problem.mesh.ndim)))


def zero_stage(stage: int):
    """Data parallel with ZeRO-`stage` (1 or 2) over every axis for trainable parameters."""
    def allowed(problem, pn, strategy) -> bool:
        if pn.kind == "param" and pn.requires_grad and problem.mesh.size > 1:
            return (all(isinstance(p, Replicate) for p in strategy.outputs[0]) and strategy.zero == stage
                    and not strategy.offload)
        return data_parallel(problem, pn, strategy)
    return allowed


def zero3(problem, pn, strategy) -> bool:
    if pn.kind == "param":
        return (all(isinstance(p, Shard) for p, n in zip(strategy.outputs[0], problem.mesh.shape) if n > 1)
                and _plain(strategy))
    return data_parallel(problem, pn, strategy)


def _splits_heads(problem, pn, strategy, axis) -> bool:
    """Whether an activation operand of rank 3 or more is split on `axis` along a dim after
    batch and sequence: attention heads (a per-head norm's weight covers head_dim only, so
    splitting heads splits no weight dim, yet it is Megatron's layout)."""
    for (src, out), placements in zip(pn.inputs, strategy.inputs):
        node = problem.nodes[src]
        p = placements[axis]
        if node.kind != "param" and len(node.out_shapes[out]) >= 3 and isinstance(p, Shard) and p.dim >= 2:
            return True
    return False


def _head_dim(problem) -> int | None:
    """The smallest head dim of the model's attention (the query's last dim), or None."""
    dims = [pn.node.meta["val"].shape[-1] for pn in problem.nodes
            if pn.kind == "op" and pn.op in ATTENTION_OPS]
    return int(min(dims)) if dims else None


def _vocabulary(problem) -> int | None:
    """The classes dim of the model's cross-entropy loss (its vocabulary), or None."""
    for pn in problem.nodes:
        if pn.kind == "op" and pn.op in _CLASS_LOSSES and pn.inputs:
            src, out = pn.inputs[0]
            shape = problem.nodes[src].out_shapes[out]
            return int(shape[1]) if len(shape) >= 2 else None
    return None


_CLASS_LOSSES = frozenset({"aten.cross_entropy_loss", "aten.nll_loss", "aten.nll_loss_nd", "aten.nll_loss_forward"})


def megatron(axes_tp):
    """Megatron on the axes in `axes_tp`, data parallel on the others."""
    head_dim = per_problem(_head_dim)
    vocabulary = per_problem(_vocabulary)

    def outside_layers(problem, pn) -> bool:
        return bool(problem.layer_groups) and pn.index not in problem.block

    def matrix(problem, pn) -> bool:
        """A weight Megatron shards: a matrix inside the repeated layers, or any matrix if
        the model has no layers; outside the layers, the vocabulary's matrices (the word
        embedding and the output head, [vocabulary, width]: split by vocabulary as Megatron
        splits them, the loss then vocabulary-parallel) where the model's loss names its
        vocabulary and it divides over the tensor-parallel ranks; the other weights outside
        the layers (position embeddings, final norms) are left to the cost model.  A
        key/value projection with fewer heads than the tensor-parallel ranks (multi-query
        attention: one head of head_dim rows) is not one: Megatron keeps it whole."""
        shape = pn.out_shapes[0]
        if len(shape) < 2:
            return False
        tp = math.prod(problem.mesh.shape[a] for a in axes_tp)
        if problem.layer_groups and pn.index not in problem.block:
            vocab = vocabulary(problem)
            return len(shape) == 2 and vocab is not None and shape[0] == vocab and vocab % tp == 0
        hd = head_dim(problem)
        return hd is None or len(shape) > 2 or min(shape) >= tp * hd

    def allowed(problem, pn, strategy) -> bool:
        n = problem.mesh.shape
        if pn.kind == "param":
            if not _plain(strategy):
                return False
            out = strategy.outputs[0]
            for a, p in enumerate(out):
                if n[a] == 1:
                    continue
                if a in axes_tp and matrix(problem, pn) and not isinstance(p, Shard):
                    return False
                if a in axes_tp and not isinstance(p, Replicate) and outside_layers(problem, pn) \
                        and matrix(problem, pn) and p.dim != 0:
                    return False   # (the vocabulary's matrices split by vocabulary)
                if a not in axes_tp and not isinstance(p, Replicate):
                    return False
            return True
        if is_grid(strategy):   # (Megatron's matmuls are 1D: the grid forms have layouts of their own)
            return False
        if pn.op == "autopar.experts":  # tensor parallelism inside every expert, tokens split elsewhere
            return all(kind == ("i" if a in axes_tp else "t") for a, kind in enumerate(strategy.split) if n[a] > 1)
        if not _splits_on(problem, pn, strategy, [a for a in range(len(n)) if a not in axes_tp]):
            return False
        for src, pl in _param_operands(problem, pn, strategy):
            for a, p in enumerate(pl):
                if n[a] == 1:
                    continue
                if a not in axes_tp and not isinstance(p, Replicate):
                    return False
                if a in axes_tp and matrix(problem, src) and isinstance(p, Replicate):
                    return False
        if any(True for _ in _param_operands(problem, pn, strategy)):
            for a in axes_tp:  # a layer with weights splits a weight dim or heads on tp, never the batch
                letter = strategy.split[a]
                if letter is not None and not passes_partial(letter) and not any(
                        isinstance(p[a], Shard) for _, p in _param_operands(problem, pn, strategy)) \
                        and not _splits_heads(problem, pn, strategy, a):
                    return False
        return True
    return allowed


def megatron_zero(tp: int, stage: int):
    """Megatron on axis `tp`, ZeRO-`stage` over the other axes: the layouts torchtitan and
    Megatron-LM users write for large models (TP inside a node, sharded data parallel)."""
    tensor_parallel = megatron({tp})

    def allowed(problem, pn, strategy) -> bool:
        if pn.kind != "param" or not pn.requires_grad:
            return tensor_parallel(problem, pn, strategy)
        placement = strategy.outputs[0]
        if stage == 3:
            plain = dataclasses.replace(strategy, outputs=(tuple(
                p if a == tp else Replicate() for a, p in enumerate(placement)),))
            return _plain(strategy) and tensor_parallel(problem, pn, plain) and all(
                isinstance(p, Shard) for a, (p, n) in enumerate(zip(placement, problem.mesh.shape)) if a != tp and n > 1)
        plain = dataclasses.replace(strategy, zero=0, zero_axes=(), offload=False)
        return (tensor_parallel(problem, pn, plain) and strategy.zero == stage and not strategy.offload
                and problem.mesh.size > problem.mesh.shape[tp])
    return allowed


# ops that only view an expert weight on its way to the experts op (GPT-OSS's interleaved
# gate and up columns, transposed weights): they keep the expert dim first
_WEIGHT_VIEWS = frozenset({"aten.slice", "aten.transpose", "aten.t", "aten.permute", "aten.view", "aten.reshape",
                           "aten.unsqueeze", "aten.squeeze"})


def _expert_weights(problem) -> tuple:
    """(indices of the parameters a mixture-of-experts op reads as expert weights or biases,
    indices of the view ops between such a parameter and the op)."""
    params, between = set(), set()
    for pn in problem.nodes:
        if pn.kind != "op" or pn.op != "autopar.experts":
            continue
        for src, _ in pn.inputs[3:]:
            node, path = problem.nodes[src], []
            while node.kind == "op" and node.op in _WEIGHT_VIEWS and len(node.inputs) == 1:
                path.append(node.index)
                node = problem.nodes[node.inputs[0][0]]
            if node.kind == "param":
                params.add(node.index)
                between.update(path)
    return params, between


def expert_parallel(mesh):
    """Experts split over the tensor-parallel axis with their tokens dispatched by all-to-all
    (each rank holds E / n experts), tokens split on every axis; everything else data
    parallel (DeepSpeed-MoE and torchtitan's expert parallelism without tensor parallelism)."""
    ep = tp_axis(mesh)
    weights = per_problem(_expert_weights)

    def by_expert(placements, n) -> bool:
        return all((isinstance(p, Shard) and p.dim == 0) if a == ep else isinstance(p, Replicate)
                   for a, p in enumerate(placements) if n[a] > 1)

    def allowed(problem, pn, strategy) -> bool:
        n = problem.mesh.shape
        params, between = weights(problem)
        if pn.kind == "param" and pn.index in params:
            return _plain(strategy) and by_expert(strategy.outputs[0], n)
        if pn.index in between:
            return by_expert(strategy.inputs[0], n) and by_expert(strategy.outputs[0], n)
        if pn.kind == "op" and pn.op == "autopar.experts":
            return all(kind == ("te" if a == ep else "t") for a, kind in enumerate(strategy.split) if n[a] > 1)
        return data_parallel(problem, pn, strategy)
    return allowed


def _residual_shape(problem):
    """The residual stream's shape [batch, seq, hidden]: the first embedding's output, if 3-D."""
    for pn in problem.nodes:
        if pn.kind == "op" and pn.op == "aten.embedding" and len(pn.out_shapes[0]) == 3:
            return tuple(pn.out_shapes[0])
    return None


def megatron_sp(axes_tp):
    """Megatron on `axes_tp` with the residual stream split by sequence there (Megatron-SP):
    every op on the gradient path without a weight matrix whose output has the residual
    stream's shape (norms, residual adds, dropout; views follow their neighbours) outputs
    Shard(1) on the tensor-parallel axes, its norm weights whole, the other axes data
    parallel; matmuls and embeddings as Megatron has them."""
    tensor_parallel = megatron(axes_tp)
    residual = per_problem(_residual_shape)

    def allowed(problem, pn, strategy) -> bool:
        n = problem.mesh.shape
        weights = list(_param_operands(problem, pn, strategy))
        if (pn.kind != "op" or not pn.requires_grad or not pn.out_shapes or pn.op in VIEWS
                or tuple(pn.out_shapes[0]) != residual(problem)
                or any(len(src.out_shapes[0]) >= 2 for src, _ in weights)):
            return tensor_parallel(problem, pn, strategy)
        out = strategy.outputs[0]
        return (all(isinstance(out[a], Shard) and out[a].dim == 1 for a in axes_tp if n[a] > 1)
                and all(isinstance(p[a], Replicate) for _, p in weights for a in range(len(n)) if n[a] > 1)
                and _splits_on(problem, pn, strategy, [a for a in range(len(n)) if a not in axes_tp]))
    return allowed


def sp_axis(mesh) -> int:
    """The sequence axis: the one named 'cp', 'sp', 'context' or 'seq', else the tensor-parallel one."""
    for name in ("cp", "sp", "context", "seq"):
        if name in mesh.axis_names:
            return mesh.axis_names.index(name)
    return tp_axis(mesh)


def _attention(pn) -> bool:
    return pn.kind == "op" and pn.op in ATTENTION_OPS


def sequence_split(kind: str, axis: int, inner=None):
    """Attention split by sequence with `kind` ("ring" or "ulysses") on `axis`; the other ops
    data parallel, or within `inner` (a layout on the other axes, e.g. Megatron) when given."""
    def allowed(problem, pn, strategy) -> bool:
        if problem.mesh.shape[axis] > 1 and _attention(pn) and strategy.split[axis] != kind:
            return False
        if inner is not None:
            return inner(problem, pn, strategy)
        return data_parallel(problem, pn, strategy)

    def check(problem) -> str | None:
        """Why the layout cannot be had (an attention node without the strategy), or None."""
        if problem.mesh.shape[axis] == 1:
            return None
        for pn in problem.nodes:
            if _attention(pn) and not any(s.split[axis] == kind for s in problem.nodes[pn.rep].strategies):
                name = problem.mesh.axis_names[axis]
                reasons = [w for w in problem.warnings if f"{kind} on {name!r}" in w and (pn.module or pn.name) in w]
                return (reasons[0].split(": ", 2)[-1] if reasons
                        else f"attention in {pn.module or pn.name} has no {kind} strategy on {name!r}")
        return None
    allowed.check = check
    return allowed


SEQUENCE_LAYOUTS = ("megatron-sp", "context-parallel", "ulysses")


def relevant(name: str, problem) -> bool:
    """Whether a layout is worth comparing with: the sequence layouts only for models with
    attention (elsewhere they are data parallelism or Megatron again)."""
    if name.startswith(SEQUENCE_LAYOUTS):
        return any(_attention(pn) for pn in problem.nodes)
    return True


def unavailable(rule, problem) -> str | None:
    """Why a layout's rule cannot be met on this problem (rules that say), or None."""
    check = getattr(rule, "check", None)
    return check(problem) if check is not None else None


GRID_LAYOUTS = {"tp-2d": ("summa", "2.5d"), "tp-2.5d": ("2.5d",), "tp-3d": ("3d",), "tp-2d-ws": ()}


def grid_misfit(layout: str, mesh) -> str | None:
    """Why a grid layout cannot be had on this mesh's shape, or None."""
    big = [a for a, n in enumerate(mesh.shape) if n > 1]
    need = 3 if layout in ("tp-3d", "tp-2.5d") else 2
    if len(big) < need:
        return (f"{layout} needs {need} mesh axes of size > 1"
                + (" (a q x q grid and a depth)" if layout == "tp-2.5d" else "") + f"; the mesh has {len(big)}")
    if layout == "tp-2.5d" and mesh.shape[big[-1]] != mesh.shape[big[-2]]:
        return "tp-2.5d needs a square grid on the two innermost axes of size > 1"
    return None


def grid(layout: str, mesh):
    """Linear layers in the repeated layers on the grid of `layout` (GRID_LAYOUTS) over the
    innermost axes of size > 1 (two, or three for 3D); the further axes split the batch.
    "tp-2d-ws" is the weight-stationary 2D form: each such layer splits its weight by
    columns on one of the two axes and by rows on the other (which one, per layer, is the
    ILP's choice: alternating them lets each layer read the last one's output as it lies)."""
    forms = GRID_LAYOUTS[layout]
    big = [a for a, n in enumerate(mesh.shape) if n > 1]
    axes = frozenset(big[-3:] if layout == "tp-3d" else big[-2:])

    def layer_matrix(problem, pn) -> bool:
        if pn.kind != "op" or pn.op not in ("aten.linear", "aten.matmul") or not pn.requires_grad:
            return False
        if problem.layer_groups and pn.index not in problem.block:
            return False
        return any(problem.nodes[src].kind == "param" and len(problem.nodes[src].out_shapes[0]) == 2
                   for src, _ in pn.inputs[1:2])

    def fits(strategy, op) -> bool:
        if layout == "tp-2d-ws":
            crossed = crossed_axes(strategy.split, ("n", "k") if op == "aten.matmul" else ("col", "row"))
            return (crossed is not None and set(crossed) == axes
                    and all(str(strategy.split[a]).startswith("b") for a in big if a not in axes))
        return (form_of(strategy) in forms
                and {a for a, l in enumerate(strategy.split) if l in ("grid-i", "grid-j", "grid-l")} == axes
                and all(strategy.split[a] == "grid-b" for a in big if a not in axes))

    def allowed(problem, pn, strategy) -> bool:
        if pn.kind == "param":   # (ZeRO-1/2 over the axes a weight is whole on: the depth, data parallel)
            return not strategy.offload
        if layer_matrix(problem, pn):
            return fits(strategy, pn.op)
        return True

    def check(problem) -> str | None:
        if grid_misfit(layout, mesh):
            return grid_misfit(layout, mesh)
        for pn in problem.nodes:
            if layer_matrix(problem, pn) and not any(fits(s, pn.op) for s in problem.nodes[pn.rep].strategies):
                shapes = [problem.nodes[src].out_shapes[o] for src, o in pn.inputs[:2]]
                return (f"the linear layer {pn.module or pn.name} (input {tuple(shapes[0])}, weight "
                        f"{tuple(shapes[1])}) does not divide over the grid "
                        f"{'x'.join(str(mesh.shape[a]) for a in sorted(axes))}")
        return None
    allowed.check = check
    return allowed


def layouts(mesh, every: bool = False) -> dict:
    """name -> restriction for the hand-written layouts that make sense on this mesh: those
    a plan is compared with, and with every=True also Megatron combined with ZeRO-1/2/3
    ("megatron-tp x zero2", ...) on meshes of two or more axes."""
    tp = tp_axis(mesh)
    out = {"data-parallel": data_parallel, "zero1": zero_stage(1), "zero2": zero_stage(2), "zero3": zero3}
    if every:
        out["expert-parallel"] = expert_parallel(mesh)
    sp = sp_axis(mesh)
    if sum(1 for s in mesh.shape if s > 1) > 1:
        out["megatron-tp (all axes)"] = megatron(set(range(mesh.ndim)))
        out["megatron-tp x dp"] = megatron({tp})
        out["megatron-sp x dp"] = megatron_sp({tp})
        out["context-parallel x dp"] = sequence_split("ring", sp)
        out["ulysses x dp"] = sequence_split("ulysses", sp)
        if every:
            for stage in (1, 2, 3):
                out[f"megatron-tp x zero{stage}"] = megatron_zero(tp, stage)
            if sp != tp:
                out["context-parallel x megatron-tp"] = sequence_split("ring", sp, megatron({tp}))
    else:
        out["megatron-tp"] = megatron(set(range(mesh.ndim)))
        out["megatron-sp"] = megatron_sp(set(range(mesh.ndim)))
        out["context-parallel"] = sequence_split("ring", sp)
        out["ulysses"] = sequence_split("ulysses", sp)
    if every:   # (on one axis too: it splits the sequence and stores the parameters, FSDP over it)
        out["context-parallel x zero3"] = sequence_split("ring", sp, zero3)
        for name in GRID_LAYOUTS:
            if grid_misfit(name, mesh) is None:
                out[name] = grid(name, mesh)
    return out
