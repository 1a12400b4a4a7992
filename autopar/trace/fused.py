"""Fused projections: one weight whose output the model splits into parts, planned as parts.

GPT-2's `c_attn` computes q, k and v with one matmul and splits the result; Phi-3 slices
`qkv_proj`'s output and chunks `gate_up_proj`'s; GPTBigCode splits a multi-query `c_attn`
into 16 query heads and one key/value head.  Sharded as one matrix, the fused output's
columns are cut contiguously, so rank 0 would hold all of q and no v: the split needs the
whole tensor first.  Megatron-LM shards each part instead (rank r holds its slice of q, of
k and of v: a strided shard).

`split_fused` rewrites the traced graph so each part is its own matmul on its own slice
of the weight (and bias): a parameter *part*, a placeholder named after the rows or
columns it holds (`h.0.attn.c_attn.weight[:, 64:128]`).  Every part is then planned like
any parameter (each may shard, or stay whole as a single key/value head does), and the
parts of one weight need not agree.  The model's own parameter stays the unit the user
sees: `full_state_dict()`, `load_state_dict()` and initialisation from a meta model go
through `Parts`, which slices a whole weight into its parts and joins them back.

Only what the split makes exact is rewritten: the weight (and bias) is read by this one
matmul alone, the output reaches the split through views that keep the feature dim last,
and the parts cover the features exactly once.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

log = logging.getLogger("autopar")
aten = torch.ops.aten

# matmul op -> (weight operand, the weight's output-feature dim, bias operand or None)
_MATMULS = {aten.linear.default: (1, 0, 2), aten.addmm.default: (2, 1, 0), aten.mm.default: (1, 1, None)}
# ops between the matmul and the split that keep the features as the last dim, whole
_KEEP_FEATURES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


@dataclass(frozen=True)
class Part:
    """Rows (dim 0) or columns (dim 1) [start, stop) of the model's parameter `whole`."""

    whole: str
    dim: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"{self.whole}[{':, ' * self.dim}{self.start}:{self.stop}]"

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.narrow(self.dim, self.start, self.stop - self.start)

    def __str__(self) -> str:
        return self.name


class Parts:
    """The parameter parts of one traced model: part name -> Part, in the whole's order."""

    def __init__(self, parts: dict | None = None):
        self.parts = dict(parts or {})
        self.of_whole: dict[str, list[Part]] = {}
        for part in self.parts.values():
            self.of_whole.setdefault(part.whole, []).append(part)
        for pieces in self.of_whole.values():
            pieces.sort(key=lambda p: p.start)

    def __bool__(self) -> bool:
        return bool(self.parts)

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def names(self, whole: str) -> list[str]:
        """The names a model parameter is planned under: its parts, or itself."""
        pieces = self.of_whole.get(whole)
        return [p.name for p in pieces] if pieces else [whole]

    def whole_of(self, name: str) -> str:
        part = self.parts.get(name)
        return part.whole if part is not None else name

    def split(self, values: dict) -> dict:
        """name -> tensor with every whole fused weight replaced by its parts (views)."""
        out = {}
        for name, value in values.items():
            pieces = self.of_whole.get(name)
            if pieces is None:
                out[name] = value
            else:
                out.update({p.name: p.of(value) for p in pieces})
        return out

    def join(self, values: dict) -> dict:
        """name -> tensor with the parts of each fused weight concatenated back into it (a
        weight some of whose parts are missing is left out)."""
        out = {}
        for name, value in values.items():
            part = self.parts.get(name)
            if part is None:
                out[name] = value
            elif part.whole not in out:
                pieces = self.of_whole[part.whole]
                if all(p.name in values for p in pieces):
                    out[part.whole] = torch.cat([values[p.name] for p in pieces], dim=part.dim)
        return out

    def named_parameters(self, model: torch.nn.Module) -> dict:
        """model.named_parameters() (tied weights once) with fused weights as their parts."""
        return self.split(dict(model.named_parameters()))


def as_linear(gm: fx.GraphModule, params: dict) -> int:
    """`x @ W.T` (Falcon's linear layers: a transpose of a weight read by a matmul) as
    `aten.linear(x, W)`, the op it is: planned as one column- or row-parallel matmul on the
    weight, and split into parts when its output is.  Returns how many were rewritten."""
    graph = gm.graph
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.matmul.default, aten.mm.default) \
                or len(node.args) != 2:
            continue
        x, wt = node.args
        if not isinstance(wt, fx.Node) or wt.target not in (aten.t.default, aten.numpy_T.default) \
                or len(wt.users) != 1:
            continue
        w = wt.args[0]
        if not isinstance(w, fx.Node) or w.op != "placeholder" or w.target not in params \
                or w.meta["val"].dim() != 2 or x.meta["val"].dim() < 2:
            continue
        with graph.inserting_before(node):
            lin = graph.create_node("call_function", aten.linear.default, (x, w), {}, name=f"{node.name}_linear")
        lin.meta = dict(node.meta)
        node.replace_all_uses_with(lin)
        graph.erase_node(node)
        graph.erase_node(wt)
        done += 1
    if done:
        graph.lint()
        gm.recompile()
    return done


def split_fused(gm: fx.GraphModule, params: dict, tied: dict, constants: dict | None = None) -> Parts:
    """Rewrite every fused projection of `gm` into one matmul per part (see the module's
    docstring).  params: placeholder -> parameter name, updated in place (the fused
    weight's placeholder is replaced by one per part).  tied: name -> owner name (a tied
    weight is never split).  constants: placeholder -> value of the tensor constants the
    forward reads (an index picking a head).  Returns the parts made."""
    graph = gm.graph
    owners: dict[str, int] = {}
    for name in tied.values():
        owners[name] = owners.get(name, 0) + 1
    made: dict[str, Part] = {}
    for node in list(graph.nodes):
        if node.op == "placeholder" and _param(node, params, tied, owners) is not None:
            made.update(_split_weight(graph, node, params))
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        found = _fused_split(node, params, tied, owners, constants or {})
        if found is None:
            continue
        made.update(_rewrite(graph, node, *found, params))
    if made:
        graph.lint()
        gm.recompile()
        wholes = sorted({p.whole for p in made.values()})
        log.info("fused projections planned as parts: %d weights (e.g. %s into %d parts)", len(wholes), wholes[0],
                 sum(1 for p in made.values() if p.whole == wholes[0]))
    return Parts(made)


def _split_weight(graph: fx.Graph, weight: fx.Node, params: dict) -> dict:
    """A weight split itself (an experts module's stacked gate_up_proj chunked into gate and
    up): each piece becomes a part placeholder."""
    (split,) = weight.users
    val = weight.meta["val"]
    if split.target not in _SPLITS or not isinstance(val, torch.Tensor):
        return {}
    ndim = val.dim()
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % ndim
    found = _split_parts(split, ndim, dim, int(val.shape[dim]), [])
    if found is None:
        return {}
    _, readers, bounds = found
    name = params.pop(weight.target)
    made = {}
    for reader, (lo, hi) in zip(readers, bounds):
        reader.replace_all_uses_with(_part_placeholder(graph, weight, Part(name, dim, lo, hi), params, made))
    for node in list(readers) + [split, weight]:
        graph.erase_node(node)
    return made


def _param(node, params: dict, tied: dict, owners: dict) -> str | None:
    """The parameter a placeholder holds when nothing but one op reads it."""
    if not isinstance(node, fx.Node) or node.op != "placeholder" or node.target not in params:
        return None
    name = params[node.target]
    if owners.get(tied.get(name, name), 1) > 1 or len(node.users) != 1:
        return None
    return name


def _fused_split(mm: fx.Node, params: dict, tied: dict, owners: dict, constants: dict):
    """(chain of views, reader per part, [(start, stop)] features per part, head width)
    when the matmul's output is split into parts along its features (or along the heads of
    a [..., heads, head_dim] view of them), else None."""
    w_at, _, b_at = _MATMULS[mm.target]
    if len(mm.args) <= w_at or _param(mm.args[w_at], params, tied, owners) is None:
        return None
    bias = mm.args[b_at] if b_at is not None and len(mm.args) > b_at else None
    if bias is not None and _param(bias, params, tied, owners) is None:
        return None
    val = mm.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    features = int(val.shape[-1])
    chain, cur = [], mm
    while len(cur.users) == 1:
        (user,) = cur.users
        out = user.meta.get("val")
        if user.target not in _KEEP_FEATURES or not isinstance(out, torch.Tensor) or out.dim() == 0 \
                or int(out.shape[-1]) != features:
            break
        chain.append(user)
        cur = user
    unit = 1  # features per index of the split dim: a head's width after a heads view
    if len(cur.users) == 1:
        (user,) = cur.users
        out, inp = user.meta.get("val"), cur.meta["val"]
        if user.target in _KEEP_FEATURES and user.target != aten.unsqueeze.default and isinstance(out, torch.Tensor) \
                and out.dim() == inp.dim() + 1 and int(out.shape[-2]) * int(out.shape[-1]) == features:
            chain.append(user)  # [..., heads * head_dim] viewed as [..., heads, head_dim]: split by heads
            cur, unit = user, int(out.shape[-1])
    ndim = cur.meta["val"].dim()
    at = ndim - 1 if unit == 1 else ndim - 2
    groups = features // unit
    users = list(cur.users)
    if len(users) == 1 and users[0].target in _SPLITS:
        found = _split_parts(users[0], ndim, at, groups, chain)
    elif users and all(u.target in (aten.slice.Tensor, aten.index.Tensor) for u in users):
        bounds = []
        for u in users:
            b = _slice_bounds(u, ndim, at, groups) if u.target == aten.slice.Tensor \
                else _index_bounds(u, at, groups, constants)
            if b is None:
                return None
            bounds.append(b)
        found = _partition(chain, users, bounds, groups)
    else:
        return None
    if found is None:
        return None
    chain, readers, bounds = found
    return chain, readers, [(lo * unit, hi * unit) for lo, hi in bounds], unit


def _slice_bounds(u: fx.Node, ndim: int, at: int, n: int):
    dim = u.args[1] if len(u.args) > 1 else 0
    start = u.args[2] if len(u.args) > 2 else None
    end = u.args[3] if len(u.args) > 3 else None
    step = u.args[4] if len(u.args) > 4 else 1
    if dim % ndim != at or step != 1:
        return None
    return _clamp(0 if start is None else start, n), _clamp(n if end is None else end, n)


def _index_bounds(u: fx.Node, at: int, n: int, constants: dict):
    """x[..., [i], :] with a constant one-element index (Falcon picks its key and value head so)."""
    indices = list(u.args[1])
    if len(indices) != at + 1 or any(i is not None for i in indices[:at]):
        return None
    idx = indices[at]
    while isinstance(idx, fx.Node) and idx.target == aten.lift_fresh_copy.default:
        idx = idx.args[0]
    value = constants.get(getattr(idx, "target", None))
    if value is None or value.numel() != 1 or value.dtype.is_floating_point:
        return None
    i = _clamp(int(value.reshape(())), n) if int(value.reshape(())) >= 0 else int(value.reshape(())) + n
    return i, i + 1


def _clamp(i: int, n: int) -> int:
    i = i + n if i < 0 else i
    return max(0, min(i, n))


def _split_parts(split: fx.Node, ndim: int, at: int, features: int, chain: list):
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim % ndim != at:
        return None
    if split.target == aten.split_with_sizes.default:
        sizes = list(split.args[1])
    elif split.target == aten.split.Tensor:
        size = split.args[1]
        sizes = [min(size, features - s) for s in range(0, features, size)]
    else:
        n = split.args[1]
        size = -(-features // n)
        sizes = [min(size, features - s) for s in range(0, features, size)]
    readers = {}
    for u in split.users:
        if u.target is not operator.getitem:
            return None
        readers[u.args[1]] = u
    if sorted(readers) != list(range(len(sizes))):
        return None  # a part nothing reads: keep the weight whole
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return _partition(chain, [readers[i] for i in range(len(sizes))],
                      [(s, s + n) for s, n in zip(starts, sizes)], features)


def _partition(chain, readers, bounds, features):
    """The parts when `bounds` cover [0, features) once, in two or more pieces."""
    order = sorted(range(len(bounds)), key=lambda i: bounds[i])
    edge = 0
    for i in order:
        lo, hi = bounds[i]
        if lo != edge or hi <= lo:
            return None
        edge = hi
    if edge != features or len(bounds) < 2:
        return None
    return chain, readers, bounds


def _rewrite(graph: fx.Graph, mm: fx.Node, chain: list, readers: list, bounds: list, unit: int,
             params: dict) -> dict:
    """One matmul (and its views) per part, each on placeholders holding the part's slice
    of the weight and bias; every reader reads its part's last view."""
    w_at, w_dim, b_at = _MATMULS[mm.target]
    weight = mm.args[w_at]
    bias = mm.args[b_at] if b_at is not None and len(mm.args) > b_at else None
    made = {}
    w_name = params.pop(weight.target)
    b_name = params.pop(bias.target) if bias is not None else None
    for reader, (lo, hi) in zip(readers, bounds):
        args = list(mm.args)
        args[w_at] = _part_placeholder(graph, weight, Part(w_name, w_dim, lo, hi), params, made)
        if bias is not None:
            args[b_at] = _part_placeholder(graph, bias, Part(b_name, 0, lo, hi), params, made)
        prev = _copy(graph, mm, tuple(args), mm.kwargs, reader, f"{lo}_{hi}")
        for k, view in enumerate(chain):
            rest = list(view.args[1:])
            if view.target != aten.unsqueeze.default:  # a shape: its last entry is the features
                shape = list(rest[0])
                if unit > 1 and k == len(chain) - 1:  # the heads view: [..., heads, head_dim]
                    shape[-2] = (hi - lo) // unit
                else:
                    shape[-1] = hi - lo
                rest[0] = shape
            prev = _copy(graph, view, (prev, *rest), view.kwargs, reader, f"{lo}_{hi}")
        reader.replace_all_uses_with(prev)
    split = next(iter(readers[0].args))  # the split node, or the last view the slices read
    dead = list(readers) + ([split] if split not in chain and split is not mm else []) + chain[::-1] + [mm]
    for node in dead:
        index = node.args[1] if node.target == aten.index.Tensor else ()
        graph.erase_node(node)
        for i in index:  # the constant's copy an index read
            if isinstance(i, fx.Node) and not i.users and i.op == "call_function":
                graph.erase_node(i)
    graph.erase_node(weight)
    if bias is not None:
        graph.erase_node(bias)
    return made


def _part_placeholder(graph: fx.Graph, whole: fx.Node, part: Part, params: dict, made: dict) -> fx.Node:
    with graph.inserting_after(whole):
        node = graph.placeholder(f"{whole.target}_{part.start}_{part.stop}")
    val = whole.meta["val"]
    shape = list(val.shape)
    shape[part.dim] = part.stop - part.start
    node.meta = {k: v for k, v in whole.meta.items() if k != "val"}
    node.meta["val"] = val.new_empty(shape).requires_grad_(val.requires_grad)
    params[node.target] = part.name
    made[part.name] = part
    return node


def _copy(graph: fx.Graph, like: fx.Node, args: tuple, kwargs: dict, before: fx.Node, suffix: str) -> fx.Node:
    """A node running `like`'s op on `args`, its shape worked out on the operands' fake values."""
    with graph.inserting_before(before):
        node = graph.create_node("call_function", like.target, args, dict(kwargs), name=f"{like.name}_{suffix}")
    node.meta = {k: v for k, v in like.meta.items() if k != "val"}
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    node.meta["val"] = like.target(*fake_args, **kwargs)
    return node
