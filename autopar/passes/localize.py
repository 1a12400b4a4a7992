"""localize: rewrite what the graph says about global shapes into per-rank terms.

- view / reshape / expand / unflatten sizes become the local output shape;
- a mean (or a loss with reduction="mean") over a dimension the plan splits is scaled to
  its share of the global mean;
- embedding with a split vocabulary and cross-entropy with split rows or classes become
  their per-rank forms in local_ops.py.
Runs after `annotate` (it reads node.meta["autopar"]) and after `insert_collectives`.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.ops import op_arg, op_name, outputs_of, tensor_args
from autopar.ops.attention_rule import ATTENTION_OPS
from autopar.ops.grid_rule import NORM, NORM_OPS, ROLES
from autopar.ops.strategy import passes_partial
from autopar.placements import local_shape_even as local_shape

from autopar.passes import grid_ops, local_ops
from autopar.passes.collectives import move
from autopar.passes.slots import GROUPS, slot

SIZE_ARG = {"aten.view": 1, "aten.reshape": 1, "aten._unsafe_view": 1, "aten.expand": 1,
            "aten.empty": 0, "aten.zeros": 0, "aten.ones": 0, "aten.full": 0}   # (made split: ops/rules.py)
MEANS = {"aten.mean"}
MEAN_LOSSES = {"aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.huber_loss",
               "aten.binary_cross_entropy", "aten.binary_cross_entropy_with_logits"}


def place_on(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Ops that make tensors (arange, ones, ...) carry the device they were traced on (meta
    for a model planned on the meta device, cpu for one traced on CPU); run them where the
    rank runs."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": device}
    gm.recompile()
    return gm


def localize(gm: fx.GraphModule, plan) -> fx.GraphModule:
    mesh_shape = plan.mesh.shape
    graph = gm.graph
    for node in list(graph.nodes):
        choice = node.meta.get("autopar")
        if choice is None or node.op != "call_function":
            continue
        name = op_name(node)
        outs = outputs_of(node)
        if name in SIZE_ARG and outs:
            size = local_shape(outs[0].shape, choice.outputs[0], mesh_shape)
            args = list(node.args)
            args[SIZE_ARG[name]] = size
            node.args = tuple(args)
        elif name == "aten.unflatten" and outs:
            dim, sizes = node.args[1], node.args[2]
            size = local_shape(outs[0].shape, choice.outputs[0], mesh_shape)
            d = dim % len(node.args[0].meta["val"].shape)
            node.args = (node.args[0], dim, size[d:d + len(sizes)])
        elif name == "aten.conv1d" and outs:
            _to_local_groups(node, choice, mesh_shape)
        split_reduced = tuple(choice.reduced)
        _out_of_place_on_moves(node)
        if name == "autopar.experts":
            _to_local_experts(node, choice)
        elif name in ATTENTION_OPS and any(l in ("ring", "ulysses") for l in choice.split):
            _to_sequence_parallel_attention(node, choice)
        elif name in ("aten.linear", "aten.matmul") and any(l in ROLES for l in choice.split if isinstance(l, str)):
            _to_grid_linear(node, choice)
        elif name in NORM_OPS and NORM in choice.split:
            _to_split_norm(node, choice)
        elif name == "aten.embedding" and split_reduced:
            _to_vocab_parallel_embedding(node, choice, split_reduced)
        elif name in ("aten.cross_entropy_loss",):
            _to_local_cross_entropy(gm, node, choice, split_reduced)
        elif split_reduced and (name in MEANS or (name in MEAN_LOSSES and op_arg(node, 2, "reduction", 1) == 1)):
            share = 1.0 / math.prod(mesh_shape[a] for a in split_reduced)
            node.args = (node.target, share) + tuple(node.args)
            node.target = local_ops.scaled_op
        elif split_reduced and name in ("aten.nll_loss", "aten.nll_loss_nd", "aten.nll_loss_forward"):
            raise NotImplementedError(f"{node.name}: {name} with split rows or classes; use cross_entropy")
    graph.lint()
    gm.recompile()
    return gm


def _to_local_groups(node, choice, mesh_shape) -> None:
    """A depthwise conv1d (groups = channels) whose channels are split: one group per
    channel this rank holds (ops/layer_rules.conv1d_rule splits no other grouped conv)."""
    groups = int(op_arg(node, 6, "groups", 1))
    weight = node.args[1].meta["val"].shape
    if groups <= 1 or groups != weight[0]:
        return
    local = local_shape(weight, choice.inputs[1], mesh_shape)[0]
    if local != groups and len(node.args) > 6:
        node.args = node.args[:6] + (local,) + node.args[7:]
    elif local != groups:
        node.kwargs = {**node.kwargs, "groups": local}


def _out_of_place_on_moves(node) -> None:
    """An in-place op (a router's div_) whose operand was moved writes into the move's
    result, which autograd forbids; the rule admits such an op only when nothing reads the
    written tensor afterwards, so its out-of-place form computes the same."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args or not isinstance(node.args[0], fx.Node) \
            or node.args[0].target is not move:
        return
    packet = target.overloadpacket.__name__
    if not packet.endswith("_") or packet.startswith("_"):
        return
    plain = getattr(getattr(torch.ops.aten, packet[:-1], None), target._overloadname, None)
    if plain is not None:
        node.target = plain


def _to_local_experts(node, choice):
    """Experts split over an axis ("e": this rank's share of the experts, tokens whole; "te":
    expert parallelism with all-to-all dispatch); tokens or the inner dim split need nothing."""
    n_experts = _global_shape(node, 3)[0]
    axes = {kind: axis for axis, kind in enumerate(choice.split) if kind in ("e", "te")}
    names = ("gate_bias", "up_bias", "down_bias")
    biases = {n: node.kwargs[n] if n in node.kwargs else (node.args[8 + i] if len(node.args) > 8 + i else None)
              for i, n in enumerate(names)}
    biases = {n: b for n, b in biases.items() if b is not None}
    if "e" in axes:
        node.target = local_ops.experts_of_this_rank
        node.args = tuple(node.args[:7]) + (axes["e"], _groups_node(node))
        node.kwargs = biases
    elif "te" in axes:
        node.target = local_ops.expert_parallel_on_axis
        node.args = tuple(node.args[:7]) + (n_experts, axes["te"], _groups_node(node))
        node.kwargs = biases


def _to_sequence_parallel_attention(node, choice):
    """Ring or Ulysses attention over the axis whose split is named so (attention_ops.py)."""
    (axis, kind), = [(a, l) for a, l in enumerate(choice.split) if l in ("ring", "ulysses")]
    q, k, v = node.args[:3]
    order = local_ops.dim_order(node)
    if op_name(node) == "autopar.window_attention":  # (q, k, v, window, scale, gqa): causal
        window, scale, gqa = node.args[3:6]
        node.target = local_ops.ring_attention_on_axis if kind == "ring" else local_ops.ulysses_window_on_axis
        node.args = ((q, k, v, True, scale, axis, _groups_node(node), window, order) if kind == "ring"
                     else (q, k, v, window, scale, gqa, axis, _groups_node(node), order))
        node.kwargs = {}
        return
    mask, dropout_p = op_arg(node, 3, "attn_mask"), op_arg(node, 4, "dropout_p", 0.0)
    causal, scale = bool(op_arg(node, 5, "is_causal", False)), node.kwargs.get("scale")
    if kind == "ring":
        node.target = local_ops.ring_attention_on_axis
        node.args = (q, k, v, causal, scale, axis, _groups_node(node), None, order)
    else:
        node.target = local_ops.ulysses_on_axis
        node.args = (q, k, v, mask, dropout_p, causal, scale, bool(node.kwargs.get("enable_gqa", False)), axis,
                     _groups_node(node), order)
    node.kwargs = {}


def _to_grid_linear(node, choice):
    """A linear layer (or `x @ W`) on a grid of axes (2D, 2.5D, 3D: passes/grid_ops.py); the
    dims each collective works along are read from the strategy's placements."""
    role = {l: a for a, l in enumerate(choice.split) if l in ROLES}
    i, j, l = role["grid-i"], role["grid-j"], role.get("grid-l")
    x, w = node.args[0], node.args[1]
    b = op_arg(node, 2, "bias") if op_name(node) == "aten.linear" else None
    x_dim, w_dim = getattr(choice.inputs[0][j], "dim", None), choice.inputs[1][i].dim
    if op_name(node) == "aten.matmul":   # x @ W, W [k, n]: linear's weight is its transpose
        with node.graph.inserting_before(node):
            w = node.graph.call_function(torch.ops.aten.t.default, (w,))
        w_dim = 1 - w_dim
    y_dim = choice.outputs[0][l].dim if l is not None else -1
    node.target = grid_ops.grid_linear
    node.args = (x, w, b, i, j, l, x_dim, w_dim, y_dim, _groups_node(node))
    node.kwargs = {}


def _to_split_norm(node, choice):
    """layer_norm / rms_norm with the normalized dim split over the axis marked "norm"."""
    axis = choice.split.index(NORM)
    rms = op_name(node) == "aten.rms_norm"
    x, shape = node.args[0], node.args[1]
    if len(shape) != 1:
        raise NotImplementedError(f"{node.name}: a split norm over {len(shape)} dims")
    w = op_arg(node, 2, "weight")
    b = None if rms else op_arg(node, 3, "bias")
    eps = op_arg(node, 3, "eps") if rms else op_arg(node, 4, "eps", 1e-5)
    node.target = grid_ops.split_norm
    node.args = (x, w, b, eps, int(shape[0]), rms, axis, _groups_node(node))
    node.kwargs = {}


def _to_vocab_parallel_embedding(node, choice, axes):
    weight, indices = node.args[0], node.args[1]
    vocab = _global_shape(node, 0)[0]
    padding_idx = op_arg(node, 2, "padding_idx", -1)
    node.target = local_ops.vocab_parallel_embedding
    node.args = (weight, indices, vocab, tuple(choice.inputs[0]), axes, _groups_node(node),
                 None if padding_idx is None or padding_idx < 0 else int(padding_idx))
    node.kwargs = {}


def _to_local_cross_entropy(gm, node, choice, split_reduced):
    letters = choice.split
    class_axes = tuple(a for a, l in enumerate(letters) if l == "classes")
    batch_axes = tuple(a for a, l in enumerate(letters) if l not in (None, "classes") and not passes_partial(l))
    if not class_axes and not batch_axes:
        return
    args = list(node.args) + [None] * (6 - len(node.args))
    logits, target, weight = args[0], args[1], node.kwargs.get("weight", args[2])
    reduction = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
    ignore_index = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    smoothing = node.kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
    classes = _global_shape(node, 0)[1]
    node.target = local_ops.local_cross_entropy
    node.args = (logits, target, weight, reduction, ignore_index, smoothing)
    node.kwargs = {"classes": classes, "logits_placements": tuple(choice.inputs[0]), "batch_axes": batch_axes,
                   "class_axes": class_axes, "partial_axes": split_reduced, "groups": _groups_node(node),
                   "all_targets": _whole_before_move(gm, target, batch_axes)}


def _whole_before_move(gm, node, axes):
    """The tensor a move sliced `node` from, when that tensor is whole on every rank
    (targets arrive whole and are sliced), else None: the mean's global count of counted
    targets can then be read locally instead of all-reduced over `axes`."""

    if node.op == "call_function" and node.target is move:
        m = getattr(gm, node.args[1].target)
        if axes and all(isinstance(p, Replicate) for p in m.src):
            return node.args[0]
    return None


def _global_shape(node, k):
    """Global shape of the node's k-th tensor operand (moves carry the global value's meta)."""
    return tuple(tensor_args(node)[k].meta["val"].shape)


def _groups_node(node):
    with node.graph.inserting_before(node):
        return slot(node.graph.owning_module, GROUPS)
