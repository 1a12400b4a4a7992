"""The op table: one annotation (or a small function building it from the op's arguments) per ATen op.

Every rule returns an `Annotation` for the node's tensor operands in the order of
`tensor_args(node)`.  Ops that are not here run replicated with one warning naming them.
The rules of views and reshapes are in autopar/ops/view_rules.py, those of products,
embedding, norms, attention and losses in autopar/ops/layer_rules.py; elementwise ops,
reductions, indexing and factories here, with the table and the op sets the later stages
read (VIEWS, TRIVIAL, PRODUCTS, ...).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.ops.annotation import Annotation, elementwise, parse, reduction
from autopar.ops.layer_rules import (
    addmm_rule, baddbmm_rule, conv1d_rule, cross_entropy_rule, einsum_rule, embedding_rule, grouped_linear_rule,
    layer_norm_rule, linear_rule, matmul_rule, nll_rule, pointwise_loss_rule, sdpa_rule, window_attention_rule)
from autopar.ops.nodes import op_arg, op_name, wrap_dim
from autopar.ops.view_rules import (
    cat_rule, complex_view_rule, expand_rule, pad_rule, repeat_rule, select_rule, slice_rule, split_rule,
    stack_rule, transpose_rule, unsqueeze_squeeze_rule, view_rule)

aten = torch.ops.aten


# --- elementwise ---------------------------------------------------------------------------

# Ops whose output is linear in their tensor inputs: Partial values pass through.
LINEAR_ELEMENTWISE = {
    "aten.neg", "aten.clone", "aten.alias", "aten.detach", "aten.contiguous", "aten.to",
    "aten._to_copy", "aten.type_as", "aten.lift_fresh_copy", "aten.positive",
}
ELEMENTWISE = LINEAR_ELEMENTWISE | {
    "aten.relu", "aten.gelu", "aten.silu", "aten.sigmoid", "aten.tanh", "aten.exp", "aten.log",
    "aten.rsqrt", "aten.sqrt", "aten.pow", "aten.abs", "aten.sin", "aten.cos", "aten.erf",
    "aten.reciprocal", "aten.dropout", "aten.native_dropout", "aten.sign", "aten.square",
    "aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.log1p", "aten.expm1", "aten.softplus",
    "aten.add", "aten.sub", "aten.mul", "aten.div", "aten.rsub", "aten.where", "aten.masked_fill",
    "aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt", "aten.ge", "aten.__and__",
    "aten.__or__", "aten.logical_and", "aten.logical_or", "aten.logical_not", "aten.bitwise_and",
    "aten.bitwise_or", "aten.bitwise_not", "aten.maximum", "aten.minimum", "aten.isnan",
    "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.lerp",
    "aten.addcmul", "aten.addcdiv", "aten.leaky_relu", "aten.hardtanh", "aten.elu", "aten.mish",
    "aten.floor", "aten.ceil", "aten.round", "aten.trunc", "aten.fmod", "aten.remainder",
    "aten.floor_divide", "aten.tril", "aten.triu", "aten.polar", "aten.real", "aten.imag", "aten.conj",
    "aten.conj_physical", "aten.resolve_conj", "aten.angle", "aten.fill",
}


def _is_linear_elementwise(name: str, node: fx.Node, n_tensors: int) -> bool:
    """x + y, x - y (both tensors) and x * c, x / c (c a number) are linear; x + c is affine."""
    if name in LINEAR_ELEMENTWISE:
        return True
    if name in ("aten.add", "aten.sub"):
        return n_tensors == 2
    if name in ("aten.mul", "aten.div"):
        return n_tensors == 1
    if name in ("aten.dropout", "aten.native_dropout"):  # p = 0 (or not training): the identity
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p == 0 or train is False
    return False


def _elementwise_rule(node, ins, outs):
    name = op_name(node)
    if name.endswith("_") and not name.endswith("__"):  # in-place (x.div_(y)): as out of place
        if not _written_then_unread(node):
            return None
        name = name[:-1]
    if name in ("aten.tril", "aten.triu"):
        rank = len(ins[0])
        letters = [f"e{i}" for i in range(rank - 2)] + ["r^", "c^"]
        return parse(f"{' '.join(letters)} -> {' '.join(letters)}", ins, outs)
    return elementwise(ins, outs[0], linear=_is_linear_elementwise(name, node, len(ins)),
                       partial_through=_scaled_operands(name, ins, outs[0]))


def _scaled_operands(name: str, ins, out) -> tuple:
    """Operands of x * g (and x / g) that a Partial may pass through alone: x, when the
    other operand is a smaller tensor broadcast over it (a per-token gate or statistic)."""
    if len(ins) != 2 or name not in ("aten.mul", "aten.div"):
        return ()
    size = math.prod(out)
    return tuple(j for j in ((0, 1) if name == "aten.mul" else (0,)) if math.prod(ins[1 - j]) < size)


def _written_then_unread(node) -> bool:
    """An in-place op may run on a moved copy of the tensor it writes when nothing reads that
    tensor after it (later ops read the op's result): the write is then seen by all it must be."""
    target = node.args[0]
    later = set()
    n = node.next
    while n.op != "root":
        later.add(n)
        n = n.next
    return not any(u in later for u in target.users if u is not node)


def _topk_rule(node, ins, outs):
    """values and indices of the k largest along `dim`: that dim never splits, the others may."""
    rank = len(ins[0])
    dim = wrap_dim(op_arg(node, 2, "dim", -1), rank)
    src = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    out = [l if i != dim else "k^" for i, l in enumerate(src)]
    return parse(f"{' '.join(src)} -> {', '.join(' '.join(out) for _ in outs)}", ins, outs)


# --- along one dim, and reductions ---------------------------------------------------------

def _along_dim_rule(dim_index, dim_name):
    """cumsum, softmax, log_softmax, diff: the op mixes values along one dim, which never splits."""
    def rule(node, ins, outs):
        rank = len(ins[0])
        dim = wrap_dim(op_arg(node, dim_index, dim_name, -1), rank)
        letters = [f"d{i}" if i != dim else "x^" for i in range(rank)]
        out = [f"d{i}" if i != dim else "y^" for i in range(len(outs[0]))]
        specs = []
        for shape in ins:
            specs.append(" ".join(letters[i] if i != dim else f"z{len(specs)}^" for i in range(len(shape))))
        return parse(f"{', '.join(specs)} -> {' '.join(out)}", ins, outs)
    return rule


def _reduction_rule(partial):
    def rule(node, ins, outs):
        dims = op_arg(node, 1, "dim", None)
        if isinstance(dims, int):
            dims = [dims]
        keepdim = bool(op_arg(node, 2, "keepdim", False))
        if dims is not None and len(outs[0]) == len(ins[0]):
            keepdim = True
        return reduction(ins[0], outs[0], dims, keepdim, partial=partial)
    return rule


def _vector_norm_rule(node, ins, outs):
    """linalg_vector_norm(x, ord, dim, keepdim): a reduction over `dim` (every dim when None)
    that is not a sum, so the reduced dims never split."""
    dims = op_arg(node, 2, "dim", None)
    if isinstance(dims, int):
        dims = [dims]
    keepdim = bool(op_arg(node, 3, "keepdim", False)) or (dims is not None and len(outs[0]) == len(ins[0]))
    return reduction(ins[0], outs[0], dims, keepdim, partial=False)


def _multi_reduction_rule(node, ins, outs):
    """max.dim / min.dim / sort-like: values and indices, the reduced dim never splits."""
    rank = len(ins[0])
    dim = wrap_dim(op_arg(node, 1, "dim", 0), rank)
    keep = len(outs[0]) == rank
    src = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    out = [l if i != dim else "1" for i, l in enumerate(src) if i != dim or keep]
    return parse(f"{' '.join(src)} -> {', '.join(' '.join(out) for _ in outs)}", ins, outs)


# --- indexing, broadcasts and factories ---------------------------------------------------

def _index_rule(node, ins, outs):
    """x[:, ..., i0, i1, ...] with index tensors on adjacent dims after `p` whole ones (None
    entries): the indexed dims never split; the dims before and after them and the broadcast
    dims of the indices pass to the output, which puts the indices' dims where the indexed
    dims were."""
    indices = list(node.args[1])
    x = ins[0]
    p = 0
    while p < len(indices) and indices[p] is None:
        p += 1
    if p == len(indices) or any(i is None for i in indices[p:]):
        return None
    k = len(indices) - p
    idx_rank = len(outs[0]) - (len(x) - k)
    before = [f"t{i}" for i in range(p)]
    after = [f"t{i}" for i in range(p + k, len(x))]
    src = before + [f"x{i}^" for i in range(p, p + k)] + after
    lead = [f"i{i}" for i in range(idx_rank)]
    specs = [" ".join(src)]
    for shape in ins[1:]:
        specs.append(" ".join(lead[idx_rank - len(shape):]))
    return parse(f"{', '.join(specs)} -> {' '.join(before + lead + after)}", ins, outs)


def _gather_rule(node, ins, outs):
    x, idx = ins[0], ins[1]
    dim = wrap_dim(node.args[1], len(x))
    src = [f"d{i}" if i != dim and x[i] == idx[i] else f"x{i}^" for i in range(len(x))]
    ids = [f"d{i}" if i != dim and x[i] == idx[i] else f"y{i}^" for i in range(len(idx))]
    return parse(f"{' '.join(src)}, {' '.join(ids)} -> {' '.join(ids)}", ins, outs)


def _scatter_rule(node, ins, outs):
    """scatter, scatter_add, index_add (self, dim, index, value or src): the output is
    self's shape; `dim` never splits, the other dims split alike in self, index (and src)
    where their sizes agree."""
    x = ins[0]
    dim = wrap_dim(node.args[1], len(x))

    def letters(shape, tag):
        return " ".join(f"d{i}" if i != dim and i < len(x) and x[i] == shape[i] else f"{tag}{i}^"
                        for i in range(len(shape)))
    operands = [letters(x, "x")] + [letters(shape, t) for shape, t in zip(ins[1:], "ys")]
    return parse(f"{', '.join(operands)} -> {operands[0]}", ins, outs)


def _slice_scatter_rule(node, ins, outs):
    """slice_scatter(self, src, dim, ...): src written into a slice of self along `dim`,
    which never splits; the other dims split alike."""
    x = ins[0]
    dim = wrap_dim(op_arg(node, 2, "dim", 0), len(x))
    src = " ".join(f"d{i}" if i != dim else "y^" for i in range(len(x)))
    dst = " ".join(f"d{i}" if i != dim else "x^" for i in range(len(x)))
    return parse(f"{dst}, {src} -> {dst}", ins, outs)


def _broadcast_tensors_rule(node, ins, outs):
    shape = outs[0]
    letters = [f"e{i}" for i in range(len(shape))]
    spec = ", ".join(" ".join(letters[len(shape) - len(s):]) for s in ins)
    return parse(f"{spec} -> {', '.join(' '.join(letters) for _ in outs)}", ins, outs, linear=True)


def _factory_rule(node, ins, outs):
    """arange, random draws, tensors made from tensors: made whole on every rank (a later
    slice is free)."""
    return Annotation(tuple(tuple(None for _ in s) for s in ins), tuple(tuple(None for _ in s) for s in outs))


def _made_rule(node, ins, outs):
    """empty, zeros, ones, full of a size (no tensor operand): every value alike, so each rank
    may make only its piece, split on any dim (localize gives the local size).  Made whole,
    a large one costs its full size on every rank (multi-head latent attention's keys)."""
    if ins:
        return _factory_rule(node, ins, outs)
    return Annotation((), tuple(tuple(f"m{d}" for d in range(len(s))) for s in outs))


RULES = {
    "aten.linear": linear_rule,
    "aten.mm": lambda n, i, o: parse("m k+, k+ n -> m n", i, o),
    "aten.bmm": lambda n, i, o: parse("b m k+, b k+ n -> b m n", i, o),
    "aten.matmul": matmul_rule,
    "aten.addmm": addmm_rule,
    "aten.baddbmm": baddbmm_rule,
    "aten.embedding": embedding_rule,
    "aten.layer_norm": layer_norm_rule,
    "aten.rms_norm": layer_norm_rule,
    "aten.scaled_dot_product_attention": sdpa_rule,
    "autopar.window_attention": window_attention_rule,
    "aten.cross_entropy_loss": cross_entropy_rule,
    "aten.nll_loss": nll_rule,
    "aten.nll_loss_nd": nll_rule,
    "aten.nll_loss_forward": nll_rule,
    "aten.view": view_rule, "aten.reshape": view_rule, "aten._unsafe_view": view_rule,
    "aten.flatten": view_rule, "aten.unflatten": view_rule,
    "aten.transpose": transpose_rule, "aten.permute": transpose_rule, "aten.t": transpose_rule,
    "aten.numpy_T": transpose_rule,
    "aten.unsqueeze": unsqueeze_squeeze_rule, "aten.squeeze": unsqueeze_squeeze_rule,
    "aten.expand": expand_rule, "aten.repeat": repeat_rule, "aten.conv1d": conv1d_rule,
    "aten.view_as_complex": complex_view_rule, "aten.view_as_real": complex_view_rule,
    "aten.einsum": einsum_rule,
    "aten.slice": slice_rule, "aten.select": select_rule, "aten.narrow": slice_rule,
    "aten.cat": cat_rule, "aten.concat": cat_rule, "aten.stack": stack_rule,
    "aten.split": split_rule, "aten.split_with_sizes": split_rule, "aten.chunk": split_rule,
    "aten.unbind": split_rule, "aten.tensor_split": split_rule,
    "aten.softmax": _along_dim_rule(1, "dim"), "aten._softmax": _along_dim_rule(1, "dim"),
    "aten.log_softmax": _along_dim_rule(1, "dim"), "aten._log_softmax": _along_dim_rule(1, "dim"),
    "aten.cumsum": _along_dim_rule(1, "dim"), "aten.cumprod": _along_dim_rule(1, "dim"),
    "aten.diff": _along_dim_rule(2, "dim"),
    "aten.pad": pad_rule, "aten.constant_pad_nd": pad_rule,
    "aten.sum": _reduction_rule(True), "aten.mean": _reduction_rule(True),
    "aten.amax": _reduction_rule(False), "aten.amin": _reduction_rule(False),
    "aten.var": _reduction_rule(False), "aten.std": _reduction_rule(False),
    "aten.linalg_vector_norm": _vector_norm_rule,
    "aten.argmax": _reduction_rule(False), "aten.argmin": _reduction_rule(False),
    "aten.all": _reduction_rule(False), "aten.any": _reduction_rule(False),
    "aten.max": _multi_reduction_rule, "aten.min": _multi_reduction_rule, "aten.topk": _topk_rule,
    "aten.mse_loss": pointwise_loss_rule, "aten.l1_loss": pointwise_loss_rule,
    "aten.smooth_l1_loss": pointwise_loss_rule, "aten.huber_loss": pointwise_loss_rule,
    "aten.binary_cross_entropy": pointwise_loss_rule,
    "aten.binary_cross_entropy_with_logits": pointwise_loss_rule,
    "aten.broadcast_tensors": _broadcast_tensors_rule,
    "aten.index": _index_rule, "aten.gather": _gather_rule, "autopar.grouped_linear": grouped_linear_rule,
    "aten.scatter": _scatter_rule, "aten.scatter_add": _scatter_rule, "aten.index_add": _scatter_rule,
    "aten.slice_scatter": _slice_scatter_rule,
    "aten.arange": _factory_rule, "aten.ones": _made_rule, "aten.zeros": _made_rule,
    "aten.full": _made_rule, "aten.empty": _made_rule, "aten.new_ones": _factory_rule,
    "aten.new_zeros": _factory_rule, "aten.new_full": _factory_rule, "aten.new_empty": _factory_rule,
    "aten.scalar_tensor": _factory_rule, "aten.randn": _factory_rule, "aten.rand": _factory_rule,
    # A no-grad region (Hugging Face's rotary tables): small, computed whole on every rank.
    "wrap_with_set_grad_enabled": _factory_rule,
    "wrap_with_autocast": _factory_rule,
}
# Random ops shaped like their input (noise, jitter: PhiMoE's router draws rand_like, uniform_
# and exponential_): elementwise in shape; each piece draws from its own stream where the
# output is split (autopar/runtime/regions/rng.py), so splitting them is valid.
for _name in ("aten.rand_like", "aten.randn_like", "aten.uniform", "aten.uniform_", "aten.exponential",
              "aten.exponential_", "aten.normal_", "aten.bernoulli_"):
    RULES.setdefault(_name, _elementwise_rule)
for _name in ELEMENTWISE:
    RULES.setdefault(_name, _elementwise_rule)
    RULES.setdefault(_name + "_", _elementwise_rule)  # in-place forms, when nothing reads the old value after

# Ops with no output tensors: they do nothing to plan.
NO_OUTPUT = {"aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range_for_size",
             "aten._assert_async", "aten.sym_constrain_range"}

# Views and unary elementwise ops: cheap, so they take the layout their producer offers.
TRIVIAL = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.transpose", "aten.permute",
           "aten.t", "aten.numpy_T", "aten.unsqueeze", "aten.squeeze", "aten.expand", "aten.flatten",
           "aten.unflatten", "aten.view_as_complex", "aten.view_as_real"} | ELEMENTWISE
# ... of which the views and reshapes (the elementwise ops left out), and aliases
VIEWS = (TRIVIAL - ELEMENTWISE) | {"aten.alias"}

# matrix products: the outputs selective recomputation keeps when one operand is a weight
PRODUCTS = frozenset({"aten.linear", "aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.baddbmm",
                      "aten.einsum"})
# the expensive core of a layer, whose outputs selective recomputation always keeps
ALWAYS_KEPT = frozenset({"aten.scaled_dot_product_attention", "autopar.window_attention", "autopar.experts",
                         "autopar.grouped_linear"})

# Collectives a named strategy runs inside the op when a letter splits:
# (kind, bytes as a fraction of the output's first-dim count times 4 bytes).
INTERNAL_COMM = {
    # vocabulary-parallel cross-entropy all-reduces the row max, the row sum of exp and the
    # target logit: three float32 values per row.
    ("aten.cross_entropy_loss", "classes"): (("all_reduce", 3),),
    ("aten.nll_loss", "classes"): (("all_reduce", 1),),
    ("aten.nll_loss_nd", "classes"): (("all_reduce", 1),),
    ("aten.nll_loss_forward", "classes"): (("all_reduce", 1),),
}


def annotate(node: fx.Node, in_shapes, out_shapes) -> Annotation | None:
    """The node's annotation, or None when no rule covers it (it then runs replicated)."""
    rule = RULES.get(op_name(node))
    if rule is None:
        return None
    return rule(node, in_shapes, out_shapes)
