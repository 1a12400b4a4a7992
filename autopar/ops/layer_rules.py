"""Rules of the ops a layer is built around: products (linear, matmul, einsum, addmm,
baddbmm, conv1d, grouped_linear), embedding, norms, attention and losses.  Their summed
letters (`k+`) split into Partial sums and their named letters (`vocab`, `classes`) split
vocabulary-parallel.  Each takes (node, input shapes, output shapes) and returns the
node's Annotation; the op table (autopar/ops/rules.py) keys them by op."""
from __future__ import annotations

from autopar.ops.annotation import elementwise, parse
from autopar.ops.nodes import op_arg


def linear_rule(node, ins, outs):
    spec = "* row+, col row+" + (", col" if len(ins) == 3 else "") + " -> * col"
    return parse(spec, ins, outs, partial_inputs={2}, alias=(("col", "col"), ("row", "row")))


def conv1d_rule(node, ins, outs):
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


def matmul_rule(node, ins, outs):
    a, b = ins[0], ins[1]
    if len(a) == 1 or len(b) == 1:
        sa = "k+" if len(a) == 1 else "* m k+"
        sb = "k+" if len(b) == 1 else "* k+ n"
        so = "* n" if len(a) == 1 else ("* m" if len(b) == 1 else "* m n")
        return parse(f"{sa}, {sb} -> {so}", ins, outs)
    return parse("* m k+, * k+ n -> * m n", ins, outs)


def einsum_rule(node, ins, outs):
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


def addmm_rule(node, ins, outs):
    bias = "n" if len(ins[0]) == 1 else "m n"
    return parse(f"{bias}, m k+, k+ n -> m n", ins, outs, partial_inputs={0})


def baddbmm_rule(node, ins, outs):
    return parse("b m n, b m k+, b k+ n -> b m n", ins, outs, partial_inputs={0})


def embedding_rule(node, ins, outs):
    """weight [vocab, dim], indices [*]: vocabulary-parallel when `vocab` splits (Partial output).
    Under scale_grad_by_freq (each row's gradient divided by its count in the batch) or a
    sparse gradient: no rule, so it runs replicated with a warning (a split batch would
    count locally)."""
    if op_arg(node, 3, "scale_grad_by_freq", False) or op_arg(node, 4, "sparse", False):
        return None
    return parse("vocab+ dim, * -> * dim", ins, outs, lookup={"vocab"})


def layer_norm_rule(node, ins, outs):
    k = len(node.args[1])
    rank = len(ins[0])
    norm = [f"n{i}^" for i in range(k)]
    x = " ".join([f"d{i}" for i in range(rank - k)] + norm)
    params = [" ".join(norm) for _ in ins[1:]]
    return parse(", ".join([x] + params) + f" -> {' '.join([f'd{i}' for i in range(rank - k)] + norm)}",
                 ins, outs)


def sdpa_rule(node, ins, outs):
    """q [b, heads, s, e], k/v [b, kv_heads, t, e]: split batch or heads (grouped-query
    attention splits query and key/value heads together, so both counts must divide).
    The query sequence may split only without a causal mask (its offset is not local)."""
    causal = bool(op_arg(node, 5, "is_causal", False))
    s = "s^" if causal else "s"
    specs = [f"* heads {s} e^", "* heads t^ e^", "* heads t^ ev^"]
    if len(ins) > 3:
        specs.append(f"* heads {s} t^")
    return parse(", ".join(specs[: len(ins)]) + f" -> * heads {s} ev^", ins, outs)


def window_attention_rule(node, ins, outs):
    """autopar::window_attention (q, k, v): causal, so as attention with is_causal."""
    return parse("* heads s^ e^, * heads t^ e^, * heads t^ ev^ -> * heads s^ ev^", ins, outs)


def cross_entropy_rule(node, ins, outs):
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


def nll_rule(node, ins, outs):
    reduction_mode = op_arg(node, 3, "reduction", 1)
    extra = " ".join(f"p{i}" for i in range(len(ins[0]) - 2))
    if reduction_mode == 0:
        return parse(f"n classes+ {extra}, n {extra} -> n {extra}", ins, outs, lookup={"classes"})
    return parse(f"n+ classes+ {extra}, n+ {extra} -> ", ins, outs, lookup={"classes"})


def grouped_linear_rule(node, ins, outs):
    """autopar::grouped_linear(x [rows, in], ids [rows], weight [experts, out, in]): rows are
    independent, so like a linear layer; the experts dim never splits."""
    return parse("rows in+, rows, experts^ out in+ -> rows out", ins, outs)


def pointwise_loss_rule(node, ins, outs):
    """mse_loss, l1_loss, binary_cross_entropy...: elementwise, then a mean or sum over all
    elements (every letter splits, giving a Partial loss) or none."""
    reduction_mode = op_arg(node, 2, "reduction", 1)
    if reduction_mode == 0:
        return elementwise(ins, outs[0])
    rank = max(len(s) for s in ins)
    letters = [f"e{i}+" for i in range(rank)]
    spec = ", ".join(" ".join(letters[rank - len(s):]) for s in ins)
    return parse(f"{spec} -> ", ins, outs)
