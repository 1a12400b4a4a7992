"""Multi-dimensional tensor parallelism: linear layers on a grid of mesh axes, and the norms
that keep the grid's layout between them.

Every form splits both the activation and the weight over two or three mesh axes and keeps
them so between layers; run by autopar/passes/grid_ops.py.  y = x W^T with x [.., k],
W [n, k]:

- "summa a x b" (2D, Optimus' SUMMA form): on axes i, j the activation is split by rows
  (a leading dim m) on i and by features (k) on j, the weight by k on i and by n on j.
  Forward gathers x's row of blocks over j and W's column of blocks over i (SUMMA's panel
  broadcasts over a row and a column move exactly these bytes) and multiplies; the output
  is [m / a, n / b], the next layer's input layout.  Backward gathers both again and
  reduce-scatters dx over j and dW over i.  Per device and layer: (b - 1)/(ab) |x| +
  (a - 1)/(ab) |W| each way, against Megatron's 2 (p - 1)/p |x| per pair of layers.
- "2.5d q x q x d" (Tesseract): the same on a q x q grid with a third group of d ranks (the
  depth) splitting the batch, the weight replicated over it; its gradient is summed over the
  depth like a data-parallel one.
- "3d a x b x c" (Agarwal's 3D matmul, as in Bian et al. 2021): on axes i, j, l the
  activation [B, S, k] is split B on i, S on j, k on l; the weight n on j, k on l and once
  more over i.  Forward gathers x over j and W over i, multiplies (a partial sum over l) and
  reduce-scatters the output over l along the sequence: [B / a, S / c, n / b].  The next
  layer then takes l's role for j and j's for l, so layers alternate and no activation moves
  between them.  Per device: |x| (b-1)/p + |W| (a-1)/p + |y| (c-1)/p forward, each about
  |.| / p^(2/3) on a cube.
- `x @ W` (aten.matmul with a 2-D W [k, n]) takes the same forms with W's dims swapped.
- split norms: layer_norm / rms_norm with the normalized (hidden) dim split over an axis,
  whose row statistics are all-reduced inside the op (one or two values per row), so a
  grid's hidden split survives the norms between its layers.

Strategy.split names each axis's role: "grid-i" (rows; the weight gathered over it),
"grid-j" (features; the activation gathered over it), "grid-l" (3D: the contraction's
partial sums, reduce-scattered over it), "grid-b" (batch on a further axis: depth or data
parallel), "norm" (a norm's hidden dim split there).  Collectives are per local batch row,
as the cost model reads a named strategy's `comm` (ops/attention_rule.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ops.strategy import Strategy

ROLES = frozenset({"grid-i", "grid-j", "grid-l", "grid-b"})
NORM = "norm"
NORM_OPS = ("aten.layer_norm", "aten.rms_norm")
GRID_FORMS = ("summa", "2.5d", "3d")   # the first word of a grid strategy's name


def is_grid(strategy: Strategy) -> bool:
    return any(isinstance(l, str) and l in ROLES for l in strategy.split)


def is_split_norm(strategy: Strategy) -> bool:
    return NORM in strategy.split


def form_of(strategy: Strategy) -> str | None:
    """"summa", "2.5d" or "3d" for a grid strategy, else None."""
    if not is_grid(strategy):
        return None
    return strategy.name.split(" ", 1)[0]


def grid_strategies(in_shapes, out_shape, mesh_shape, axis_names, needs_grad) -> list[Strategy]:
    """The 2D, 2.5D and 3D strategies of aten.linear(x, W[, b]) on this mesh (none on a mesh
    with fewer than two axes of size > 1, or where no split divides)."""
    big = [a for a, n in enumerate(mesh_shape) if n > 1]
    if len(big) < 2 or len(in_shapes[0]) < 2 or len(in_shapes[1]) != 2:
        return []
    out = []
    rank = len(in_shapes[0])
    for i, j in itertools.permutations(big, 2):
        for m in range(min(2, rank - 1)):
            rest = [a for a in big if a not in (i, j)]
            for batch in _batch_choices(rest):
                for gathered in (False, True):
                    s = _summa(in_shapes, out_shape, mesh_shape, axis_names, needs_grad, i, j, m, batch, gathered)
                    if s is not None:
                        out.append(s)
    if rank >= 3:
        for i, j, l in itertools.permutations(big, 3):
            rest = [a for a in big if a not in (i, j, l)]
            for nest in (1, 0):
                for batch in _batch_choices(rest):
                    for gathered in (False, True):
                        s = _cube(in_shapes, out_shape, mesh_shape, axis_names, needs_grad, i, j, l, nest, batch,
                                  gathered)
                        if s is not None:
                            out.append(s)
    return out


def matmul_grid_strategies(in_shapes, out_shape, mesh_shape, axis_names, needs_grad) -> list[Strategy]:
    """The grid strategies of aten.matmul(x, W) with a 2-D right operand W [k, n] (a weight
    used as `x @ W`): linear's with W's dims swapped, as x @ W = linear(x, W^T)."""
    if len(in_shapes) != 2 or len(in_shapes[1]) != 2:
        return []
    k, n = in_shapes[1]

    def swapped(placements):
        if placements is None:
            return None
        return tuple(Shard(1 - p.dim) if isinstance(p, Shard) else p for p in placements)
    out = []
    for s in grid_strategies((in_shapes[0], (n, k)), out_shape, mesh_shape, axis_names, needs_grad):
        out.append(dataclasses.replace(s, inputs=(s.inputs[0], swapped(s.inputs[1])),
                                       grads=(s.grads[0], swapped(s.grads[1]))))
    return out


def _batch_choices(rest):
    """The further axes that split the batch: all of them, or none (computed alike there)."""
    return [tuple(rest), ()] if rest else [()]


def _placements(ndim, table) -> tuple:
    return tuple(table.get(a, Replicate()) for a in range(ndim))


def _divides(size, *ns) -> bool:
    return size % math.prod(ns) == 0


def _name(form, sizes, axes, axis_names) -> str:
    return f"{form} {'x'.join(str(n) for n in sizes)} [{','.join(axis_names[a] for a in axes)}]"


def _strategy(x_pl, w_pl, b_pl, y_pl, w_grad, b_grad, split, factor, name, comm, needs_grad, has_bias,
              x_grad=None):
    inputs = (x_pl, w_pl) + ((b_pl,) if has_bias else ())
    grads = (x_grad or x_pl, w_grad) + ((b_grad,) if has_bias else ())
    grads = tuple(g if needs_grad[k] else None for k, g in enumerate(grads))
    return Strategy(split, inputs, (y_pl,), grads, factor, name, comm)


def _summa(in_shapes, out_shape, mesh_shape, axis_names, needs_grad, i, j, m, batch, gathered):
    """gathered: x arrives gathered over j already (a move its readers share: q, k and v
    projections of one input gather it once), its gradient handed back Partial over j."""
    x, w = in_shapes[0], in_shapes[1]
    ndim, rank = len(mesh_shape), len(x)
    ni, nj = mesh_shape[i], mesh_shape[j]
    nb = math.prod(mesh_shape[a] for a in batch)
    n, k = w
    rows_split = nb * (ni if m == 0 else 1)
    if not (_divides(x[m], ni, nb if m == 0 else 1) and _divides(x[0], nb) and _divides(k, nj) and _divides(k, ni)
            and _divides(n, nj)):
        return None
    x_pl = _placements(ndim, {i: Shard(m), j: Replicate() if gathered else Shard(rank - 1),
                              **{a: Shard(0) for a in batch}})
    x_grad = _placements(ndim, {i: Shard(m), j: Partial(), **{a: Shard(0) for a in batch}}) if gathered else x_pl
    y_pl = _placements(ndim, {i: Shard(m), j: Shard(rank - 1), **{a: Shard(0) for a in batch}})
    w_pl = _placements(ndim, {i: Shard(1), j: Shard(0)})
    w_grad = _placements(ndim, {i: Shard(1), j: Shard(0), **{a: Partial() for a in batch}})
    b_pl = _placements(ndim, {j: Shard(0)})
    b_grad = _placements(ndim, {j: Shard(0), i: Partial(), **{a: Partial() for a in batch}})
    split = tuple("grid-i" if a == i else "grid-j" if a == j else "grid-b" if a in batch else None
                  for a in range(ndim))
    rows = x[0] / rows_split
    x_local = math.prod(x) / (ni * nj * nb)
    w_local = n * k / (ni * nj)
    gx, gw = x_local * nj / rows, w_local * ni / rows   # gathered elements per local batch row
    comm = _comm([("all_gather", j, gx, "forward"), ("all_gather", i, gw, "forward")], needs_grad, i, j, gx, gw,
                 gathered)
    depth = nb if batch and ni == nj else 0
    name = (_name("2.5d", (ni, nj, depth), (i, j) + tuple(batch), axis_names) if depth
            else _name("summa", (ni, nj), (i, j), axis_names))
    return _strategy(x_pl, w_pl, b_pl, y_pl, w_grad, b_grad, split, ni * nj * nb, name, tuple(comm),
                     needs_grad, len(in_shapes) > 2, x_grad)


def _comm(forward, needs_grad, i, j, gx, gw, gathered) -> tuple:
    """The collectives of a grid layer: `forward`'s, then backward's regathers of x (for dW)
    and of W (for dx) and the reduce-scatters of dW and dx; an x that arrives gathered is
    neither gathered nor its gradient reduced inside."""
    comm = list(forward)
    if gathered:
        comm = [c for c in comm if not (c[0] == "all_gather" and c[1] == j)]
    if needs_grad[1]:
        comm += ([] if gathered else [("all_gather", j, gx, "backward")]) + [("reduce_scatter", i, gw, "backward")]
    if needs_grad[0]:
        comm += [("all_gather", i, gw, "backward")] + ([] if gathered else [("reduce_scatter", j, gx, "backward")])
    return tuple(comm)


def _cube(in_shapes, out_shape, mesh_shape, axis_names, needs_grad, i, j, l, nest, batch, gathered):
    """3D on axes (i, j, l); nest: the weight dim split a second time over i (1: k, nested
    inside l; 0: n, inside j), which must be the inner of the two axes splitting it;
    gathered: as for _summa."""
    x, w = in_shapes[0], in_shapes[1]
    ndim, rank = len(mesh_shape), len(x)
    if (l if nest == 1 else j) > i:
        return None
    ni, nj, nl = mesh_shape[i], mesh_shape[j], mesh_shape[l]
    nb = math.prod(mesh_shape[a] for a in batch)
    n, k = w
    if not (_divides(x[0], ni, nb) and _divides(x[1], nj) and _divides(x[1], nl) and _divides(k, nl)
            and _divides(n, nj) and _divides(w[nest], ni, nj if nest == 0 else nl)):
        return None
    x_pl = _placements(ndim, {i: Shard(0), j: Replicate() if gathered else Shard(1), l: Shard(rank - 1),
                              **{a: Shard(0) for a in batch}})
    x_grad = (_placements(ndim, {i: Shard(0), j: Partial(), l: Shard(rank - 1), **{a: Shard(0) for a in batch}})
              if gathered else x_pl)
    y_pl = _placements(ndim, {i: Shard(0), j: Shard(rank - 1), l: Shard(1), **{a: Shard(0) for a in batch}})
    w_pl = _placements(ndim, {i: Shard(nest), j: Shard(0), l: Shard(1)})
    w_grad = _placements(ndim, {i: Shard(nest), j: Shard(0), l: Shard(1), **{a: Partial() for a in batch}})
    b_pl = _placements(ndim, {j: Shard(0)})
    b_grad = _placements(ndim, {j: Shard(0), i: Partial(), l: Partial(), **{a: Partial() for a in batch}})
    split = tuple({i: "grid-i", j: "grid-j", l: "grid-l"}.get(a, "grid-b" if a in batch else None)
                  for a in range(ndim))
    p = ni * nj * nl * nb
    rows = x[0] / (ni * nb)
    gx = math.prod(x) / p * nj / rows
    gw = n * k / (ni * nj * nl) * ni / rows
    gy = math.prod(out_shape) / p * nl / rows    # the partial output before its reduce-scatter
    comm = _comm([("all_gather", j, gx, "forward"), ("all_gather", i, gw, "forward"),
                  ("reduce_scatter", l, gy, "forward"), ("all_gather", l, gy, "backward")],
                 needs_grad, i, j, gx, gw, gathered)
    name = _name("3d", (ni, nj, nl), (i, j, l), axis_names)
    return _strategy(x_pl, w_pl, b_pl, y_pl, w_grad, b_grad, split, p, name, comm, needs_grad,
                     len(in_shapes) > 2, x_grad)


def split_norm_strategies(base: list, in_shapes, mesh_shape, axis_names, rms: bool) -> list[Strategy]:
    """For each strategy of a layer_norm / rms_norm over the last dim that leaves an axis of
    size > 1 whole, the same with the normalized dim split over that axis: the row
    statistics all-reduced there (forward: the mean, then the variance; rms: the mean
    square; backward: two row sums, rms one)."""
    x = in_shapes[0]
    out = []
    for s in base:
        if any(isinstance(p, Shard) and p.dim == len(x) - 1 for p in s.inputs[0]):
            continue
        for a, n in enumerate(mesh_shape):
            if n == 1 or s.split[a] is not None or x[-1] % n:
                continue

            def on(placements, dim):
                return tuple(Shard(dim) if b == a else p for b, p in enumerate(placements))
            inputs = (on(s.inputs[0], len(x) - 1),) + tuple(on(p, 0) for p in s.inputs[1:])
            grads = tuple(None if g is None else on(g, len(x) - 1 if k == 0 else 0) for k, g in enumerate(s.grads))
            outputs = (on(s.outputs[0], len(x) - 1),)
            # statistics per local batch row: the local sizes of the dims between batch and hidden
            per_row = math.prod(size / math.prod(mesh_shape[b] for b, p in enumerate(inputs[0])
                                                 if isinstance(p, Shard) and p.dim == d)
                                for d, size in enumerate(x[:-1]) if d > 0)
            # one value per local row: forward's mean (and variance), backward's row sums
            forward = (("all_reduce", a, per_row, "forward"),) * (1 if rms else 2)
            backward = (("all_reduce", a, per_row * (1 if rms else 2), "backward"),)
            split = tuple(NORM if b == a else l for b, l in enumerate(s.split))
            name = (s.name + " " if s.name != "replicate" else "") + f"{axis_names[a]}=norm-split"
            out.append(Strategy(split, inputs, outputs, grads, s.factor, name, forward + backward,
                                reduced=s.reduced))
    return out
