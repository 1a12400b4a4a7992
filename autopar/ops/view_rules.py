"""Rules of the ops that move a tensor's elements without computing on them: views and
reshapes, transposes, unsqueeze and squeeze, expand and repeat, slices and selects, cat,
stack and split, padding.  Each takes (node, input shapes, output shapes) and returns the
node's Annotation; the op table (autopar/ops/rules.py) keys them by op."""
from __future__ import annotations

from autopar.ops.annotation import parse, view
from autopar.ops.nodes import op_arg, op_name, wrap_dim


def view_rule(node, ins, outs):
    return view(ins[0], outs[0])


def transpose_rule(node, ins, outs):
    rank = len(ins[0])
    if op_name(node) in ("aten.t", "aten.numpy_T"):
        perm = list(range(rank))[::-1]
    elif op_name(node) == "aten.permute":
        perm = [wrap_dim(d, rank) for d in node.args[1]]
    else:
        a, b = wrap_dim(node.args[1], rank), wrap_dim(node.args[2], rank)
        perm = list(range(rank))
        perm[a], perm[b] = perm[b], perm[a]
    letters = [f"d{i}" for i in range(rank)]
    return parse(f"{' '.join(letters)} -> {' '.join(letters[p] for p in perm)}", ins, outs, linear=True)


def complex_view_rule(node, ins, outs):
    """view_as_complex: (..., 2) real pairs -> (...) complex; view_as_real the inverse.  The
    pair dim never splits; the others keep their letters (linear: a Partial passes)."""
    if op_name(node) == "aten.view_as_complex":
        letters = [f"d{i}" for i in range(len(ins[0]) - 1)]
        return parse(f"{' '.join(letters + ['p^'])} -> {' '.join(letters)}", ins, outs, linear=True)
    letters = [f"d{i}" for i in range(len(ins[0]))]
    return parse(f"{' '.join(letters)} -> {' '.join(letters + ['p^'])}", ins, outs, linear=True)


def unsqueeze_squeeze_rule(node, ins, outs):
    """Keep a letter on every non-unit dim; the unit dims added or removed carry none."""
    src = [f"d{i}" if s != 1 else "1" for i, s in enumerate(ins[0])]
    dst = [f"d{i}" for i, s in enumerate(ins[0]) if s != 1]
    out = []
    it = iter(dst)
    for s in outs[0]:
        out.append(next(it) if s != 1 else "1")
    return parse(f"{' '.join(src)} -> {' '.join(out)}", ins, outs, linear=True)


def expand_rule(node, ins, outs):
    rank_out, rank_in = len(outs[0]), len(ins[0])
    lead = rank_out - rank_in
    src = [f"d{i + lead}" if s != 1 else "1" for i, s in enumerate(ins[0])]
    dst = [f"d{i}" if (i >= lead and ins[0][i - lead] == s and s != 1) else "1"
           for i, s in enumerate(outs[0])]
    return parse(f"{' '.join(src)} -> {' '.join(dst)}", ins, outs, linear=True)


def repeat_rule(node, ins, outs):
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


def slice_rule(node, ins, outs):
    rank = len(ins[0])
    dim = wrap_dim(op_arg(node, 1, "dim", 0), rank)
    letters = [f"d{i}" for i in range(rank)]
    out = list(letters)
    if ins[0][dim] != outs[0][dim]:
        letters[dim] = "x^"
        out[dim] = "y^"
    return parse(f"{' '.join(letters)} -> {' '.join(out)}", ins, outs, linear=True)


def select_rule(node, ins, outs):
    rank = len(ins[0])
    dim = wrap_dim(node.args[1], rank)
    letters = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    out = [l for i, l in enumerate(letters) if i != dim]
    return parse(f"{' '.join(letters)} -> {' '.join(out)}", ins, outs, linear=True)


def cat_rule(node, ins, outs):
    rank = len(outs[0])
    dim = wrap_dim(op_arg(node, 1, "dim", 0), rank)
    letters = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    specs = []
    for k, shape in enumerate(ins):
        if len(shape) != rank:  # a legacy empty 1-D tensor in the list
            specs.append(" ".join(f"z{k}_{i}^" for i in range(len(shape))))
        else:
            specs.append(" ".join(l if i != dim else f"c{k}^" for i, l in enumerate(letters)))
    return parse(f"{', '.join(specs)} -> {' '.join(letters)}", ins, outs, linear=True)


def stack_rule(node, ins, outs):
    rank = len(outs[0])
    dim = wrap_dim(op_arg(node, 1, "dim", 0), rank)
    letters = [f"d{i}" for i in range(rank) if i != dim]
    out = list(letters)
    out.insert(dim, "x^")
    return parse(f"{', '.join(' '.join(letters) for _ in ins)} -> {' '.join(out)}", ins, outs, linear=True)


def split_rule(node, ins, outs):
    rank = len(ins[0])
    dim = wrap_dim(op_arg(node, 2, "dim", 0), rank)
    if op_name(node) == "aten.unbind":
        dim = wrap_dim(op_arg(node, 1, "dim", 0), rank)
    src = [f"d{i}" if i != dim else "x^" for i in range(rank)]
    if op_name(node) == "aten.unbind":
        out = [l for i, l in enumerate(src) if i != dim]
        return parse(f"{' '.join(src)} -> {', '.join(' '.join(out) for _ in outs)}", ins, outs, linear=True)
    return parse(f"{' '.join(src)} -> {', '.join(' '.join(l if i != dim else f'y{k}^' for i, l in enumerate(src)) for k in range(len(outs)))}",
                 ins, outs, linear=True)


def pad_rule(node, ins, outs):
    rank = len(ins[0])
    pads = list(node.args[1])
    padded = {rank - 1 - i // 2 for i, p in enumerate(pads) if p}
    src = [f"d{i}" if i not in padded else f"x{i}^" for i in range(rank)]
    dst = [f"d{i}" if i not in padded else f"y{i}^" for i in range(rank)]
    return parse(f"{' '.join(src)} -> {' '.join(dst)}", ins, outs)
