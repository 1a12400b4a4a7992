"""Sharding strategies of one node, derived from its annotation.

A strategy assigns each mesh axis one index letter to split (or none).  From that follow
the placement every operand must arrive in, the placement of every output, and the
placement of every operand's gradient:

- an operand holding the split letter has a `Shard` gradient;
- an operand without it, when the letter survives to the output, was broadcast to every
  rank of the axis, so its gradient is `Partial` there (Megatron's f operator, and the data
  parallel gradient all-reduce, are this rule);
- an operand that arrived `Partial` has a `Replicate` gradient.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ops.annotation import Annotation

Placements = tuple  # one torch placement per mesh axis

PASS = "+"  # the axis carries Partial values straight through a linear op


def passes_partial(letter) -> bool:
    """The axis carries Partial values through the op: every operand (PASS, a linear op) or
    one operand "+j" with the others whole (x * gate, x / y)."""
    return letter == PASS or (isinstance(letter, str) and letter[:1] == PASS and letter[1:].isdigit())


def crossed_axes(split, letters=("col", "row")) -> tuple | None:
    """(column axis, row axis) of a linear layer whose weight is split by Megatron's column
    split on one mesh axis and its row split on another, else None: 2D weight-stationary
    tensor parallelism (the weight never moves; the output's Partial sums are reduced over
    the row axis, and the next layer, split the other way round, reads them as they lie).
    letters: the rule's letters for the two splits (`x @ W`'s matmul: ("n", "k"))."""
    cols = [a for a, l in enumerate(split) if l == letters[0]]
    rows = [a for a, l in enumerate(split) if l == letters[1]]
    return (cols[0], rows[0]) if len(cols) == 1 and len(rows) == 1 else None


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the mesh.

    split: the letter split along each mesh axis (None: computed redundantly; "+": Partial
    passes through).  inputs / outputs / grads: placements per tensor operand / output /
    operand gradient (None for operands that take no gradient).  factor: how many ways the
    work is divided.  comm: collectives the strategy runs inside the op, as
    (kind, axis index, fraction of the output bytes) triples.

    Parameters only: zero is the ZeRO stage 1 or 2 of a parameter stored whole on the
    mesh axes `zero_axes` (its optimizer state, and at stage 2 its gradient, split over
    them; stage 3 is a Shard placement instead); offload is the memory tier its optimizer
    state and float32 master weights live in beyond the device: "host" or "disk" ("" on
    the device); offload_weights: the parameter's stored shard and its gradient live in that
    tier too (ZeRO-Infinity's parameter offload), copied to the device for each use
    (runtime/regions/reshard.py).
    """

    split: tuple
    inputs: tuple
    outputs: tuple
    grads: tuple
    factor: int
    name: str
    comm: tuple = ()
    zero: int = 0
    zero_axes: tuple = ()
    offload: str = ""
    reduced: tuple = ()   # mesh axes whose split letter does not reach the output (summed over ranks)
    offload_weights: bool = False

    def __str__(self) -> str:
        return self.name


def offload_label(tier: str, weights: bool = False) -> str:
    """How a plan names a parameter's state tier: "offload" (host), "offload to disk", or "";
    weights: the stored weights are there too ("offload with weights", "offload to disk
    with weights")."""
    label = {"host": "offload", "disk": "offload to disk"}.get(tier, "")
    return f"{label} with weights" if label and weights else label


def _placement(letters, letter, contracted: bool, may_be_partial: bool):
    if letter is None:
        return Replicate()
    if letter == PASS:
        return Partial()
    if letter in letters:
        return Shard(letters.index(letter))
    if contracted and may_be_partial:
        return Partial()
    return Replicate()


def enumerate_strategies(ann: Annotation, in_shapes, out_shapes, mesh_shape, axis_names,
                         needs_grad) -> list[Strategy]:
    """Every valid split of the annotation's letters over the mesh axes.

    A letter splits only when each operand dim carrying it divides evenly by the product of
    the axis sizes given to it (never an uneven shard by accident).
    """
    out_letters = {l for o in ann.outputs for l in o if l is not None}
    sizes: dict[str, list[int]] = {}
    for letters, shape in zip(ann.inputs + ann.outputs, list(in_shapes) + list(out_shapes)):
        for letter, size in zip(letters, shape):
            if letter is not None:
                sizes.setdefault(letter, []).append(int(size))
    candidates = []
    for letter in ann.letters():
        if letter in ann.fixed:
            continue
        contracted = letter not in out_letters
        if contracted:
            if letter not in ann.reducible:
                continue
            if letter not in ann.lookup and any(
                    letter not in ins and i not in ann.partial_inputs for i, ins in enumerate(ann.inputs)):
                continue
        candidates.append(letter)
    menu = [None] + candidates + ([PASS] if ann.linear else []) + [f"{PASS}{j}" for j in ann.partial_through]
    alias = dict(ann.alias)
    # a placement depends on one operand and one letter only: work each out once per letter
    operand_of = [{letter: _operand_placement(ann, i, letters, letter, out_letters) for letter in menu}
                  for i, letters in enumerate(ann.inputs)]
    output_of = [{letter: Partial() if (letter == PASS or (letter is not None and letter not in out_letters))
                  else _placement(letters, letter, False, False) for letter in menu} for letters in ann.outputs]
    result = []
    for split in itertools.product(menu, repeat=len(mesh_shape)):
        if any(n == 1 and l is not None for l, n in zip(split, mesh_shape)):
            continue  # a size-1 axis never splits: one strategy stands for all its choices
        factors: dict[str, int] = {}
        for letter, n in zip(split, mesh_shape):
            if letter is not None and n > 1:
                factors[letter] = factors.get(letter, 1) * n
        if any(not passes_partial(l) and any(s % f for s in sizes.get(l, [1])) for l, f in factors.items()):
            continue
        inputs = tuple(tuple(table[l][0] for l in split) for table in operand_of)
        grads = tuple(tuple(table[l][1] for l in split) if needs_grad[i] else None
                      for i, table in enumerate(operand_of))
        outputs = tuple(tuple(table[l] for l in split) for table in output_of)
        name = " ".join(f"{ax}={alias.get(l, l)}" for ax, l in zip(axis_names, split)
                        if l is not None) or "replicate"
        reduced = tuple(a for a, l in enumerate(split) if l is not None and not passes_partial(l)
                        and l not in out_letters)
        result.append(Strategy(tuple(split), inputs, outputs, grads,
                               math.prod(factors.get(l, 1) for l in factors if not passes_partial(l)), name,
                               reduced=reduced))
    return result


def _operand_placement(ann: Annotation, i: int, letters, letter, out_letters):
    """(placement, gradient placement) of operand i on an axis that splits `letter`."""
    if passes_partial(letter) and letter != PASS:  # "+j": operand j Partial, the others whole
        return (Partial(), Replicate()) if i == int(letter[1:]) else (Replicate(), Partial())
    contracted = letter is not None and letter != PASS and letter not in out_letters
    lookup = letter in ann.lookup
    p = _placement(letters, letter, contracted and not lookup, i in ann.partial_inputs)
    if isinstance(p, Shard):
        return p, p
    if isinstance(p, Partial) or letter is None or lookup:
        return p, Replicate()
    return p, Partial()  # broadcast along a split: gradient sums over ranks


def replicated(n_inputs: int, n_outputs: int, ndim: int, needs_grad) -> Strategy:
    """The strategy every op has: all operands whole on every rank."""
    rep = tuple(Replicate() for _ in range(ndim))
    return Strategy(tuple(None for _ in range(ndim)), tuple(rep for _ in range(n_inputs)),
                    tuple(rep for _ in range(n_outputs)),
                    tuple(rep if g else None for g in needs_grad), 1, "replicate")
