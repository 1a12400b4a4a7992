"""The op table: one annotation (or a small function building it from the op's arguments) per ATen op.

Every rule returns an `Annotation` for the node's tensor operands in the order of
`tensor_args(node)`.  Ops that are not here run replicated with one warning naming them.
"""
from __future__ import annotations

import math

import operator

import torch
import torch.fx as fx

from autopar.ops.annotation import Annotation, elementwise, parse, reduction, view

aten = torch.ops.aten


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor operands in argument order, repeats kept (sdpa(q, q, q) has three)."""
    flat: list = []
    _nodes_in((node.args, node.kwargs), flat)
    return [a for a in flat if isinstance(a.meta.get("val"), torch.Tensor)]


def _nodes_in(value, out: list) -> None:
    """The fx nodes in an argument tree, in pytree's order (lists, tuples and dicts in order;
    anything else a leaf): a walk of its own, several times quicker than pytree's."""
    if isinstance(value, fx.Node):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _nodes_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _nodes_in(v, out)


def outputs_of(node: fx.Node) -> list:
    """The node's output tensors (fake), a list even for single-output ops."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def op_arg(node, index, name, default=None):
    """Argument `index` of the node's call, or its keyword `name`, else `default`."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _dim(d, rank):
    return d % rank if rank else 0


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
    name = _packet(node)
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
    dim = _dim(op_arg(node, 2, "dim", -1), rank)
    src = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    out = [l if i != dim else "k^" for i, l in enumerate(src)]
    return parse(f"{' '.join(src)} -> {', '.join(' '.join(out) for _ in outs)}", ins, outs)


# --- views -------------------------------------------------------------------------------

def _view_rule(node, ins, outs):
    return view(ins[0], outs[0])


def _transpose_rule(node, ins, outs):
    rank = len(ins[0])
    if _packet(node) in ("aten.t", "aten.numpy_T"):
        perm = list(range(rank))[::-1]
    elif _packet(node) == "aten.permute":
        perm = [_dim(d, rank) for d in node.args[1]]
    else:
        a, b = _dim(node.args[1], rank), _dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    letters = [f"d{i}" for i in range(rank)]
    return parse(f"{' '.join(letters)} -> {' '.join(letters[p] for p in perm)}", ins, outs, linear=True)


def _complex_view_rule(node, ins, outs):
    """view_as_complex: (..., 2) real pairs -> (...) complex; view_as_real the inverse.  The
    pair dim never splits; the others keep their letters (linear: a Partial passes)."""
    if _packet(node) == "aten.view_as_complex":
        letters = [f"d{i}" for i in range(len(ins[0]) - 1)]
        return parse(f"{' '.join(letters + ['p^'])} -> {' '.join(letters)}", ins, outs, linear=True)
    letters = [f"d{i}" for i in range(len(ins[0]))]
    return parse(f"{' '.join(letters)} -> {' '.join(letters + ['p^'])}", ins, outs, linear=True)


def _unsqueeze_squeeze_rule(node, ins, outs):
    """Keep a letter on every non-unit dim; the unit dims added or removed carry none."""
    src = [f"d{i}" if s != 1 else "1" for i, s in enumerate(ins[0])]
    dst = [f"d{i}" for i, s in enumerate(ins[0]) if s != 1]
    out = []
    it = iter(dst)
    for s in outs[0]:
        out.append(next(it) if s != 1 else "1")
    return parse(f"{' '.join(src)} -> {' '.join(out)}", ins, outs, linear=True)


def _expand_rule(node, ins, outs):
    rank_out, rank_in = len(outs[0]), len(ins[0])
    lead = rank_out - rank_in
    src = [f"d{i + lead}" if s != 1 else "1" for i, s in enumerate(ins[0])]
    dst = [f"d{i}" if (i >= lead and ins[0][i - lead] == s and s != 1) else "1"
           for i, s in enumerate(outs[0])]
    return parse(f"{' '.join(src)} -> {' '.join(dst)}", ins, outs, linear=True)


def _repeat_rule(node, ins, outs):
    """repeat tiles its input: a dim repeated once keeps its letter (a Partial passes: the
    op is linear); a tiled dim and the new leading dims never split."""
    reps = [int(r) for r in node.args[1]]
    lead = len(outs[0]) - len(ins[0])
    src, dst = [], ["1"] * lead
    for i, s in enumerate(ins[0]):
        if reps[i + lead] == 1:
            src.append(f"d{i}" if s != 1 else "1")
            dst.append(f"d{i}" if s != 1 else "1")
        else:
            src.append(f"x{i}^")
            dst.append(f"y{i}^")
    return parse(f"{' '.join(src)} -> {' '.join(dst)}", ins, outs, linear=True)


def _slice_rule(node, ins, outs):
    rank = len(ins[0])
    dim = _dim(op_arg(node, 1, "dim", 0), rank)
    letters = [f"d{i}" for i in range(rank)]
    out = list(letters)
    if ins[0][dim] != outs[0][dim]:
        letters[dim] = "x^"
        out[dim] = "y^"
    return parse(f"{' '.join(letters)} -> {' '.join(out)}", ins, outs, linear=True)


def _select_rule(node, ins, outs):
    rank = len(ins[0])
    dim = _dim(node.args[1], rank)
    letters = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    out = [l for i, l in enumerate(letters) if i != dim]
    return parse(f"{' '.join(letters)} -> {' '.join(out)}", ins, outs, linear=True)


def _cat_rule(node, ins, outs):
    rank = len(outs[0])
    dim = _dim(op_arg(node, 1, "dim", 0), rank)
    letters = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    specs = []
    for k, shape in enumerate(ins):
        if len(shape) != rank:  # a legacy empty 1-D tensor in the list
            specs.append(" ".join(f"z{k}_{i}^" for i in range(len(shape))))
        else:
            specs.append(" ".join(l if i != dim else f"c{k}^" for i, l in enumerate(letters)))
    return parse(f"{', '.join(specs)} -> {' '.join(letters)}", ins, outs, linear=True)


def _stack_rule(node, ins, outs):
    rank = len(outs[0])
    dim = _dim(op_arg(node, 1, "dim", 0), rank)
    letters = [f"d{i}" for i in range(rank) if i != dim]
    out = list(letters)
    out.insert(dim, "x^")
    return parse(f"{', '.join(' '.join(letters) for _ in ins)} -> {' '.join(out)}", ins, outs, linear=True)


def _split_rule(node, ins, outs):
    rank = len(ins[0])
    dim = _dim(op_arg(node, 2, "dim", 0), rank)
    if _packet(node) == "aten.unbind":
        dim = _dim(op_arg(node, 1, "dim", 0), rank)
    src = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    if _packet(node) == "aten.unbind":
        out = [l for i, l in enumerate(src) if i != dim]
        return parse(f"{' '.join(src)} -> {', '.join(' '.join(out) for _ in outs)}", ins, outs, linear=True)
    return parse(f"{' '.join(src)} -> {', '.join(' '.join(l if i != dim else f'y{k}^' for i, l in enumerate(src)) for k in range(len(outs)))}",
                 ins, outs, linear=True)


def _along_dim_rule(dim_index, dim_name):
    """cumsum, softmax, log_softmax, diff: the op mixes values along one dim, which never splits."""
    def rule(node, ins, outs):
        rank = len(ins[0])
        dim = _dim(op_arg(node, dim_index, dim_name, -1), rank)
        letters = [f"d{i}" if i != dim else "x^" for i in range(rank)]
        out = [f"d{i}" if i != dim else "y^" for i in range(len(outs[0]))]
        specs = []
        for shape in ins:
            specs.append(" ".join(letters[i] if i != dim else f"z{len(specs)}^" for i in range(len(shape))))
        return parse(f"{', '.join(specs)} -> {' '.join(out)}", ins, outs)
    return rule


def _pad_rule(node, ins, outs):
    rank = len(ins[0])
    pads = list(node.args[1])
    padded = {rank - 1 - i // 2 for i, p in enumerate(pads) if p}
    src = [f"d{i}" if i not in padded else f"x{i}^" for i in range(rank)]
    dst = [f"d{i}" if i not in padded else f"y{i}^" for i in range(rank)]
    return parse(f"{' '.join(src)} -> {' '.join(dst)}", ins, outs)


# --- reductions ----------------------------------------------------------------------------

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
    dim = _dim(op_arg(node, 1, "dim", 0), rank)
    keep = len(outs[0]) == rank
    src = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    out = [l if i != dim else "1" for i, l in enumerate(src) if i != dim or keep]
    return parse(f"{' '.join(src)} -> {', '.join(' '.join(out) for _ in outs)}", ins, outs)


# --- contractions and named strategies ---------------------------------------------------

def _linear_rule(node, ins, outs):
    spec = "* row+, col row+" + (", col" if len(ins) == 3 else "") + " -> * col"
    return parse(spec, ins, outs, partial_inputs={2}, alias=(("col", "col"), ("row", "row")))


def _conv1d_rule(node, ins, outs):
    """conv1d over [batch, channels, length]: the batch splits; so do the output channels,
    with their filters (weight dim 0) and bias, where each reads its own input channel
    (depthwise, groups = channels: Mamba's) or every input channel (groups = 1, the input
    then whole); the length never splits (each output reads a window of inputs)."""
    if len(ins[0]) != 3:
        return None
    groups = int(op_arg(node, 6, "groups", 1))
    channels, filters = ins[0][1], ins[1][0]
    if groups == channels == filters and ins[1][1] == 1:
        x, w, out, b = "n c l^", "c 1 k^", "n c m^", "c"
    elif groups == 1:
        x, w, out, b = "n i^ l^", "c i^ k^", "n c m^", "c"
    else:
        x, w, out, b = "n i^ l^", "c^ j^ k^", "n c^ m^", "c^"
    spec = f"{x}, {w}" + (f", {b}" if len(ins) == 3 else "") + f" -> {out}"
    return parse(spec, ins, outs)


def _matmul_rule(node, ins, outs):
    a, b = ins[0], ins[1]
    if len(a) == 1 or len(b) == 1:
        sa = "k+" if len(a) == 1 else "* m k+"
        sb = "k+" if len(b) == 1 else "* k+ n"
        so = "* n" if len(a) == 1 else ("* m" if len(b) == 1 else "* m n")
        return parse(f"{sa}, {sb} -> {so}", ins, outs)
    return parse("* m k+, * k+ n -> * m n", ins, outs)


def _einsum_rule(node, ins, outs):
    """torch.einsum as the GEMMs it is: each subscript a letter, those summed over (in an
    input, not in the output) split into Partial sums, "..." leading every operand as `*`.
    None (replicated) for a repeated subscript in one operand (a diagonal), an ellipsis
    elsewhere, or a subscript whose sizes differ between operands (broadcast)."""
    equation = str(node.args[0]).replace(" ", "")
    if "->" not in equation:
        return None
    lhs, rhs = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != len(ins):
        return None
    sizes: dict = {}
    specs = []
    for term, shape in zip(terms + [rhs], list(ins) + [outs[0]]):
        star = term.startswith("...")
        letters = term[3:] if star else term
        if "." in letters or len(set(letters)) != len(letters) or not letters.isalpha():
            return None
        for c, n in zip(letters, shape[len(shape) - len(letters):]):
            if sizes.setdefault(c, n) != n:
                return None
        specs.append((star, letters))
    kept = set(specs[-1][1])
    text = [" ".join((["*"] if star else []) + [c + ("+" if c not in kept else "") for c in letters])
            for star, letters in specs]
    return parse(f"{', '.join(text[:-1])} -> {text[-1]}", ins, outs)


def _addmm_rule(node, ins, outs):
    bias = "n" if len(ins[0]) == 1 else "m n"
    return parse(f"{bias}, m k+, k+ n -> m n", ins, outs, partial_inputs={0})


def _baddbmm_rule(node, ins, outs):
    return parse("b m n, b m k+, b k+ n -> b m n", ins, outs, partial_inputs={0})


def _embedding_rule(node, ins, outs):
    """weight [vocab, dim], indices [*]: vocabulary-parallel when `vocab` splits (Partial output).
    Under scale_grad_by_freq (each row's gradient divided by its count in the batch) or a
    sparse gradient: no rule, so it runs replicated with a warning (a split batch would
    count locally)."""
    if op_arg(node, 3, "scale_grad_by_freq", False) or op_arg(node, 4, "sparse", False):
        return None
    return parse("vocab+ dim, * -> * dim", ins, outs, lookup={"vocab"})


def _layer_norm_rule(node, ins, outs):
    k = len(node.args[1])
    rank = len(ins[0])
    norm = [f"n{i}^" for i in range(k)]
    x = " ".join([f"d{i}" for i in range(rank - k)] + norm)
    params = [" ".join(norm) for _ in ins[1:]]
    return parse(", ".join([x] + params) + f" -> {' '.join([f'd{i}' for i in range(rank - k)] + norm)}",
                 ins, outs)


def _sdpa_rule(node, ins, outs):
    """q [b, heads, s, e], k/v [b, kv_heads, t, e]: split batch or heads (grouped-query
    attention splits query and key/value heads together, so both counts must divide).
    The query sequence may split only without a causal mask (its offset is not local)."""
    causal = bool(op_arg(node, 5, "is_causal", False))
    s = "s^" if causal else "s"
    specs = [f"* heads {s} e^", "* heads t^ e^", "* heads t^ ev^"]
    if len(ins) > 3:
        specs.append(f"* heads {s} t^")
    return parse(", ".join(specs[: len(ins)]) + f" -> * heads {s} ev^", ins, outs)


def _window_attention_rule(node, ins, outs):
    """autopar::window_attention (q, k, v): causal, so as attention with is_causal."""
    return parse("* heads s^ e^, * heads t^ e^, * heads t^ ev^ -> * heads s^ ev^", ins, outs)


def _cross_entropy_rule(node, ins, outs):
    """logits [n, classes, *], target [n, *]: batch splits give Partial (summed) losses;
    `classes` splits vocabulary-parallel (target stays Replicate; max and sum-exp are
    all-reduced inside, see INTERNAL_COMM)."""
    reduction_mode = op_arg(node, 3, "reduction", 1)
    extra = " ".join(f"p{i}" for i in range(len(ins[0]) - 2))
    if reduction_mode == 0:
        spec = f"n classes+ {extra}, n {extra} -> n {extra}"
    else:
        spec = f"n+ classes+ {extra}, n+ {extra} -> "
    in_specs = spec.split("->")[0].split(",")
    if len(ins) == 3:  # class weights
        spec = f"{in_specs[0]}, {in_specs[1]}, classes+ -> {spec.split('->')[1]}"
    return parse(spec, ins, outs, lookup={"classes"})


def _nll_rule(node, ins, outs):
    reduction_mode = op_arg(node, 3, "reduction", 1)
    extra = " ".join(f"p{i}" for i in range(len(ins[0]) - 2))
    if reduction_mode == 0:
        return parse(f"n classes+ {extra}, n {extra} -> n {extra}", ins, outs, lookup={"classes"})
    return parse(f"n+ classes+ {extra}, n+ {extra} -> ", ins, outs, lookup={"classes"})


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


def _grouped_linear_rule(node, ins, outs):
    """autopar::grouped_linear(x [rows, in], ids [rows], weight [experts, out, in]): rows are
    independent, so like a linear layer; the experts dim never splits."""
    return parse("rows in+, rows, experts^ out in+ -> rows out", ins, outs)


def _gather_rule(node, ins, outs):
    x, idx = ins[0], ins[1]
    dim = _dim(node.args[1], len(x))
    src = [f"d{i}" if i != dim and x[i] == idx[i] else f"x{i}^" for i in range(len(x))]
    ids = [f"d{i}" if i != dim and x[i] == idx[i] else f"y{i}^" for i in range(len(idx))]
    return parse(f"{' '.join(src)}, {' '.join(ids)} -> {' '.join(ids)}", ins, outs)


def _scatter_rule(node, ins, outs):
    """scatter, scatter_add, index_add (self, dim, index, value or src): the output is
    self's shape; `dim` never splits, the other dims split alike in self, index (and src)
    where their sizes agree."""
    x = ins[0]
    dim = _dim(node.args[1], len(x))

    def letters(shape, tag):
        return " ".join(f"d{i}" if i != dim and i < len(x) and x[i] == shape[i] else f"{tag}{i}^"
                        for i in range(len(shape)))
    operands = [letters(x, "x")] + [letters(shape, t) for shape, t in zip(ins[1:], "ys")]
    return parse(f"{', '.join(operands)} -> {operands[0]}", ins, outs)


def _slice_scatter_rule(node, ins, outs):
    """slice_scatter(self, src, dim, ...): src written into a slice of self along `dim`,
    which never splits; the other dims split alike."""
    x = ins[0]
    dim = _dim(op_arg(node, 2, "dim", 0), len(x))
    src = " ".join(f"d{i}" if i != dim else "y^" for i in range(len(x)))
    dst = " ".join(f"d{i}" if i != dim else "x^" for i in range(len(x)))
    return parse(f"{dst}, {src} -> {dst}", ins, outs)


def _pointwise_loss_rule(node, ins, outs):
    """mse_loss, l1_loss, binary_cross_entropy...: elementwise, then a mean or sum over all
    elements (every letter splits, giving a Partial loss) or none."""
    reduction_mode = op_arg(node, 2, "reduction", 1)
    if reduction_mode == 0:
        return elementwise(ins, outs[0])
    rank = max(len(s) for s in ins)
    letters = [f"e{i}+" for i in range(rank)]
    spec = ", ".join(" ".join(letters[rank - len(s):]) for s in ins)
    return parse(f"{spec} -> ", ins, outs)


def _broadcast_tensors_rule(node, ins, outs):
    shape = outs[0]
    letters = [f"e{i}" for i in range(len(shape))]
    spec = ", ".join(" ".join(letters[len(shape) - len(s):]) for s in ins)
    return parse(f"{spec} -> {', '.join(' '.join(letters) for _ in outs)}", ins, outs, linear=True)


def _factory_rule(node, ins, outs):
    """arange, ones, zeros, full: made whole on every rank (a later slice is free)."""
    return Annotation(tuple(tuple(None for _ in s) for s in ins), tuple(tuple(None for _ in s) for s in outs))


def _packet(node: fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return f"aten.{packet.__name__}" if "aten" in str(packet) else str(packet)
    return getattr(target, "__name__", str(target))


RULES = {
    "aten.linear": _linear_rule,
    "aten.mm": lambda n, i, o: parse("m k+, k+ n -> m n", i, o),
    "aten.bmm": lambda n, i, o: parse("b m k+, b k+ n -> b m n", i, o),
    "aten.matmul": _matmul_rule,
    "aten.addmm": _addmm_rule,
    "aten.baddbmm": _baddbmm_rule,
    "aten.embedding": _embedding_rule,
    "aten.layer_norm": _layer_norm_rule,
    "aten.rms_norm": _layer_norm_rule,
    "aten.scaled_dot_product_attention": _sdpa_rule,
    "autopar.window_attention": _window_attention_rule,
    "aten.cross_entropy_loss": _cross_entropy_rule,
    "aten.nll_loss": _nll_rule,
    "aten.nll_loss_nd": _nll_rule,
    "aten.nll_loss_forward": _nll_rule,
    "aten.view": _view_rule, "aten.reshape": _view_rule, "aten._unsafe_view": _view_rule,
    "aten.flatten": _view_rule, "aten.unflatten": _view_rule,
    "aten.transpose": _transpose_rule, "aten.permute": _transpose_rule, "aten.t": _transpose_rule,
    "aten.numpy_T": _transpose_rule,
    "aten.unsqueeze": _unsqueeze_squeeze_rule, "aten.squeeze": _unsqueeze_squeeze_rule,
    "aten.expand": _expand_rule, "aten.repeat": _repeat_rule, "aten.conv1d": _conv1d_rule,
    "aten.view_as_complex": _complex_view_rule, "aten.view_as_real": _complex_view_rule,
    "aten.einsum": _einsum_rule,
    "aten.slice": _slice_rule, "aten.select": _select_rule, "aten.narrow": _slice_rule,
    "aten.cat": _cat_rule, "aten.concat": _cat_rule, "aten.stack": _stack_rule,
    "aten.split": _split_rule, "aten.split_with_sizes": _split_rule, "aten.chunk": _split_rule,
    "aten.unbind": _split_rule, "aten.tensor_split": _split_rule,
    "aten.softmax": _along_dim_rule(1, "dim"), "aten._softmax": _along_dim_rule(1, "dim"),
    "aten.log_softmax": _along_dim_rule(1, "dim"), "aten._log_softmax": _along_dim_rule(1, "dim"),
    "aten.cumsum": _along_dim_rule(1, "dim"), "aten.cumprod": _along_dim_rule(1, "dim"),
    "aten.diff": _along_dim_rule(2, "dim"),
    "aten.pad": _pad_rule, "aten.constant_pad_nd": _pad_rule,
    "aten.sum": _reduction_rule(True), "aten.mean": _reduction_rule(True),
    "aten.amax": _reduction_rule(False), "aten.amin": _reduction_rule(False),
    "aten.var": _reduction_rule(False), "aten.std": _reduction_rule(False),
    "aten.linalg_vector_norm": _vector_norm_rule,
    "aten.argmax": _reduction_rule(False), "aten.argmin": _reduction_rule(False),
    "aten.all": _reduction_rule(False), "aten.any": _reduction_rule(False),
    "aten.max": _multi_reduction_rule, "aten.min": _multi_reduction_rule, "aten.topk": _topk_rule,
    "aten.mse_loss": _pointwise_loss_rule, "aten.l1_loss": _pointwise_loss_rule,
    "aten.smooth_l1_loss": _pointwise_loss_rule, "aten.huber_loss": _pointwise_loss_rule,
    "aten.binary_cross_entropy": _pointwise_loss_rule,
    "aten.binary_cross_entropy_with_logits": _pointwise_loss_rule,
    "aten.broadcast_tensors": _broadcast_tensors_rule,
    "aten.index": _index_rule, "aten.gather": _gather_rule, "autopar.grouped_linear": _grouped_linear_rule,
    "aten.scatter": _scatter_rule, "aten.scatter_add": _scatter_rule, "aten.index_add": _scatter_rule,
    "aten.slice_scatter": _slice_scatter_rule,
    "aten.arange": _factory_rule, "aten.ones": _factory_rule, "aten.zeros": _factory_rule,
    "aten.full": _factory_rule, "aten.empty": _factory_rule, "aten.new_ones": _factory_rule,
    "aten.new_zeros": _factory_rule, "aten.new_full": _factory_rule, "aten.new_empty": _factory_rule,
    "aten.scalar_tensor": _factory_rule, "aten.randn": _factory_rule, "aten.rand": _factory_rule,
    # A no-grad region (Hugging Face's rotary tables): small, computed whole on every rank.
    "wrap_with_set_grad_enabled": _factory_rule,
    "wrap_with_autocast": _factory_rule,
}
# Random ops shaped like their input (noise, jitter: PhiMoE's router draws rand_like, uniform_
# and exponential_): elementwise in shape; each piece draws from its own stream where the
# output is split (autopar/runtime/rng.py), so splitting them is valid.
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


def op_name(node: fx.Node) -> str:
    return _packet(node)


def annotate(node: fx.Node, in_shapes, out_shapes) -> Annotation | None:
    """The node's annotation, or None when no rule covers it (it then runs replicated)."""
    rule = RULES.get(_packet(node))
    if rule is None:
        return None
    return rule(node, in_shapes, out_shapes)
