"""One annotation per op: which index letters each operand carries, and how they may split.

An annotation reads like an einsum with markers, e.g. linear is

    "* row+, col row+, col -> * col"

- a letter that survives to the output may be split along a mesh axis: the output is
  `Shard` on that axis, operands without the letter are `Replicate` (they are broadcast);
- a contracted letter marked `+` may be split: operands holding it are `Shard`, the output
  is `Partial` (a sum over ranks), and an operand without it must come in `Partial` too
  (the bias above) unless the letter is a lookup (embedding's vocabulary: indices stay
  `Replicate`);
- a letter marked `^` never splits (softmax's reduced dim, layer_norm's normalised dims);
- `*` stands for the leading dims, aligned from the right as in broadcasting; a size-1
  dim facing a larger one carries no letter.

From the same annotation follow the gradient placements (see strategy.py).
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

Letters = tuple  # tuple[str | None, ...]: one letter (or None) per dim


@dataclass(frozen=True)
class Annotation:
    """inputs: letters per tensor operand (in the order of `tensor_args`); outputs: per output."""

    inputs: tuple[Letters, ...]
    outputs: tuple[Letters, ...]
    reducible: frozenset = frozenset()
    fixed: frozenset = frozenset()
    partial_inputs: frozenset = frozenset()   # operand indices that may come in Partial
    lookup: frozenset = frozenset()           # reducible letters whose other operands stay Replicate
    linear: bool = False                      # all-Partial inputs give a Partial output
    partial_through: tuple = ()               # operands a Partial may pass alone, the others whole (x * gate)
    alias: tuple[tuple[str, str], ...] = field(default=())  # letter -> name shown in plans

    def letters(self) -> list[str]:
        seen: dict[str, None] = {}
        for operand in self.inputs + self.outputs:
            for letter in operand:
                if letter is not None:
                    seen.setdefault(letter, None)
        return list(seen)

    def __str__(self) -> str:
        def show(op):
            return " ".join(l if l is not None else "1" for l in op) or "()"
        return f"{', '.join(show(o) for o in self.inputs)} -> {', '.join(show(o) for o in self.outputs)}"


def parse(spec: str, in_shapes, out_shapes, *, partial_inputs=(), lookup=(), linear=False,
          alias=()) -> Annotation:
    """Turn an annotation string into letters for the given concrete shapes.

    in_shapes / out_shapes: tuples of shapes, one per tensor operand.  The spec's operand
    count must match; `*` expands to the leading dims.
    """
    lhs, rhs = spec.split("->")
    in_specs = [s.split() for s in lhs.split(",")] if lhs.strip() else []
    out_specs = [s.split() for s in rhs.split(",")] if rhs.strip() else [[]]
    if len(in_specs) != len(in_shapes) or len(out_specs) != len(out_shapes):
        raise ValueError(f"annotation {spec!r} has {len(in_specs)} inputs and {len(out_specs)} "
                         f"outputs, the node has {len(in_shapes)} and {len(out_shapes)}")
    reducible, fixed = set(), set()

    def clean(tok):
        base = tok.rstrip("+^")
        if tok.endswith("+"):
            reducible.add(base)
        if tok.endswith("^"):
            fixed.add(base)
        return base

    specs = [[clean(t) for t in s] for s in in_specs + out_specs]
    shapes = [tuple(s) for s in list(in_shapes) + list(out_shapes)]
    star = [len(shape) - (len(s) - 1) if "*" in s else 0 for s, shape in zip(specs, shapes)]
    longest = max(star, default=0)
    expanded = []
    for s, shape, n in zip(specs, shapes, star):
        out = []
        for tok in s:
            if tok == "*":
                out.extend(f"b{longest - n + i}" for i in range(n))
            elif tok == "1":
                out.append(None)
            else:
                out.append(tok)
        if len(out) != len(shape):
            raise ValueError(f"annotation {spec!r} does not fit shape {shape}")
        expanded.append(out)
    # A size-1 dim facing a larger size of the same letter is a broadcast: no letter there.
    biggest: dict[str, int] = {}
    for letters, shape in zip(expanded, shapes):
        for letter, size in zip(letters, shape):
            if letter is not None:
                biggest[letter] = max(biggest.get(letter, 1), int(size))
    for letters, shape in zip(expanded, shapes):
        for i, (letter, size) in enumerate(zip(letters, shape)):
            if letter is not None and size == 1 and biggest[letter] > 1:
                letters[i] = None
    n_in = len(in_shapes)
    return Annotation(tuple(tuple(x) for x in expanded[:n_in]), tuple(tuple(x) for x in expanded[n_in:]),
                      frozenset(reducible), frozenset(fixed), frozenset(partial_inputs),
                      frozenset(lookup), linear, tuple(alias))


def elementwise(in_shapes, out_shape, *, linear=False, partial_through=()) -> Annotation:
    """Broadcasting elementwise op: every output dim is a letter, aligned from the right."""
    letters = [f"e{i}" for i in range(len(out_shape))]
    spec = ", ".join(" ".join(letters[len(out_shape) - len(s):]) if len(s) else "" for s in in_shapes)
    ann = parse(f"{spec} -> {' '.join(letters)}", in_shapes, (out_shape,), linear=linear)
    return dataclasses.replace(ann, partial_through=tuple(partial_through)) if partial_through else ann


def reduction(in_shape, out_shape, dims, keepdim, *, partial: bool) -> Annotation:
    """sum/mean (`partial`: the reduced dims may split, giving Partial) or max-like (they never split)."""
    rank = len(in_shape)
    dims = {d % rank for d in dims} if dims else set(range(rank))
    mark = "+" if partial else "^"
    ins, outs = [], []
    for d in range(rank):
        if d in dims:
            ins.append(f"r{d}{mark}")
            if keepdim:
                outs.append("1")
        else:
            ins.append(f"k{d}")
            outs.append(f"k{d}")
    return parse(f"{' '.join(ins)} -> {' '.join(outs)}", (in_shape,), (out_shape,), linear=partial)


def view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product.

    [b, s, h*d] -> [b, s, h, d] gives ([0],[0]), ([1],[1]), ([2],[2, 3]).  Size-1 dims
    form their own groups (with an empty partner) so they never block a split.
    """
    groups, i, j = [], 0, 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        if i < n and in_shape[i] == 1 and not (j < m and out_shape[j] == 1):
            groups.append(([i], [])); i += 1; continue
        if j < m and out_shape[j] == 1 and not (i < n and in_shape[i] == 1):
            groups.append(([], [j])); j += 1; continue
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        i += 1; j += 1
        while pi != pj:
            if pi < pj:
                pi *= in_shape[i]; gi.append(i); i += 1
            else:
                pj *= out_shape[j]; gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


def view(in_shape, out_shape) -> Annotation:
    """A reshape splits along a merged group only through the group's outermost dim."""
    ins: list = [None] * len(in_shape)
    outs: list = [None] * len(out_shape)
    for k, (gi, gj) in enumerate(view_groups(tuple(in_shape), tuple(out_shape))):
        if gi and gj:
            ins[gi[0]] = outs[gj[0]] = f"v{k}"
    return Annotation((tuple(ins),), (tuple(outs),), linear=True)
