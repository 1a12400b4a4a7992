"""Tracing a deep model through three of its layers: the graph of every layer, repeated.

torch.export spends most of its time per op, and a transformer's ops are its layers': a
405B-shaped Llama has 126 identical layers and takes 11 s to export on a 2-core machine,
once per microbatch size the pipeline search tries.  When a model's layers are one
ModuleList of identically built modules (same classes, attributes, parameter shapes;
an integer attribute equal to the layer's own index, such as Hugging Face's `layer_idx`,
counts as alike), the model is exported with that list cut to three entries (the first
two layers and the last) and the graph of the whole model is written from it:

    prefix | layer 0 | layer 1 | layer n-1 | suffix          (the three-layer export)
    prefix | layer 0 | layer 1 | copies of layer 1 as layers 2 .. n-2 | layer n-1 | suffix

A copy of layer 1 reads what layer 1 reads, with the previous layer's outputs taken from
the copy before it (layer 1 reads layer 0's at the same positions, which is why layers 0
and 1 must trace to the same ops, node for node) and its own parameters and buffers.
Node names are renumbered the way torch.export numbers them (per op name, in graph
order), placeholders named after their parameters, module stacks rewritten to each
copy's path, so the result equals the full export node for node: tests compare the two
graphs' signatures (autopar.trace.export.graph_signature) and module paths on several model
families.  A plan records its graph's signature, and the runtime, which always traces
every layer, refuses a plan whose graph differs.

Lead layers: where the list's first few layers (at most MAX_LEAD) are built differently
from the rest, as DeepSeek-V3's three dense layers before its 58 mixtures of experts, they
stay in the export as they are and count as the prefix; layers 0, 1 and n-1 above are then
the first two alike layers and the last (Layers.first: the first alike one).

Anything this cannot show is the same is traced in full: layers built differently past
the lead (a mixture-of-experts layer among dense ones, sliding-window layers among global ones),
a layer that reads a layer other than the one before it, parameters shared between
layers, fewer than MIN_LAYERS layers, or names torch.export did not number in order.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.trace.paths import layer_of, module_path

try:   # (a GraphModule that writes its Python code when first run or printed)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _PlanningModule
except ImportError:   # pragma: no cover - older torch
    _PlanningModule = fx.GraphModule

MIN_LAYERS = 6     # below this a full export is cheap enough
MAX_LEAD = 8       # lead layers built differently before the alike ones (DeepSeek-V3's three dense)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_NUMBERED = re.compile(r"^(.*)_(\d+)$")


def planning_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """fx.GraphModule(root, graph), its Python code written only when it is run or read:
    planning reads a written graph and never runs it, and writing the code of a
    9,000-node graph takes about half a second."""
    return _PlanningModule(root, graph)


@dataclass(frozen=True)
class Layers:
    """The repeated layers found: `owner.<attr>` is the ModuleList at `path` (a module path
    such as "model.layers") holding `count` layers, alike from layer `first` on (the
    layers before it, built differently, are traced as they are: lead layers)."""

    owner: torch.nn.Module
    attr: str
    path: str
    count: int
    first: int = 0


def repeated_layers(model: torch.nn.Module) -> Layers | None:
    """The ModuleList with the most alike layers, at least MIN_LAYERS of them, from some
    layer to its last, after at most MAX_LEAD lead layers built differently (see the module
    doc), or None."""
    shared = _shared_tensors(model)
    best = None
    for path, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < MIN_LAYERS or not path:
            continue
        layers = list(mod)
        if len({id(m) for m in layers}) != len(layers):
            continue
        n = len(layers)
        index = _index_attributes(layers[n - 2], layers[n - 1], n - 2)
        prints = [_layer_print(m, i, shared, index) for i, m in enumerate(layers)]
        if any(p is None for p in prints):
            continue
        first = n - 1
        while first > 0 and prints[first - 1] == prints[-1]:
            first -= 1
        if first > MAX_LEAD or n - first < MIN_LAYERS:
            continue
        if best is not None and n - first <= best.count - best.first:
            continue
        owner_path, _, attr = path.rpartition(".")
        best = Layers(model.get_submodule(owner_path), attr, path, n, first)
    return best


def _shared_tensors(model: torch.nn.Module) -> set:
    """ids of parameters and buffers reachable under more than one name."""
    seen: dict = {}
    for _, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        seen[id(t)] = seen.get(id(t), 0) + 1
    return {k for k, v in seen.items() if v > 1}


def plain_attributes(mod: torch.nn.Module) -> dict:
    """A module's own attributes that are neither tensors, submodules nor nn.Module's
    bookkeeping: its configuration (sizes, flags, indices)."""
    return {k: v for k, v in vars(mod).items()
            if k not in _MODULE_INTERNALS and not isinstance(v, (torch.Tensor, torch.nn.Module))}


def _index_attributes(first: torch.nn.Module, second: torch.nn.Module, i: int) -> set:
    """(submodule, attribute) pairs holding the layer's own index in two consecutive layers
    (i and i + 1: Hugging Face's `layer_idx`, say)."""
    out = set()
    for (name, a), (_, b) in zip(first.named_modules(remove_duplicate=False), second.named_modules(remove_duplicate=False)):
        va, vb = plain_attributes(a), plain_attributes(b)
        out |= {(name, k) for k, v in va.items() if type(v) is int and v == i and type(vb.get(k)) is int and vb[k] == i + 1}
    return out


def _layer_print(layer: torch.nn.Module, index: int, shared: set, index_attrs: set):
    """What tracing one layer depends on, its own index (in `index_attrs`) written as
    "<index>"; None when the layer shares a tensor with another module."""
    parts = []
    for name, mod in layer.named_modules(remove_duplicate=False):
        attrs = sorted((k, "<index>" if (name, k) in index_attrs and type(v) is int and v == index else repr(v))
                       for k, v in plain_attributes(mod).items())
        parts.append((name, type(mod), mod.training, tuple(attrs)))
    for name, t in list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers(remove_duplicate=False)):
        if id(t) in shared:
            return None
        parts.append((name, tuple(t.shape), t.dtype, str(t.device), t.requires_grad))
    return tuple(parts)


@contextlib.contextmanager
def cut_to_three(found: Layers):
    """The model with its layer list holding its lead layers, then layers `first`,
    `first` + 1 and n-1, while the body runs."""
    full = getattr(found.owner, found.attr)
    k = found.first
    setattr(found.owner, found.attr, torch.nn.ModuleList([*full[:k], full[k], full[k + 1], full[len(full) - 1]]))
    try:
        yield
    finally:
        setattr(found.owner, found.attr, full)


@dataclass
class Unrolled:
    """The whole model's graph and its placeholders' model names."""

    graph: fx.Graph
    params: dict    # placeholder -> parameter name
    buffers: dict   # placeholder -> buffer name


def unroll(graph: fx.Graph, params: dict, buffers: dict, found: Layers) -> Unrolled | None:
    """The graph of the model with `found.count` layers from `graph`, the export of it cut
    to three (cut_to_three); None when the three-layer graph does not show its layers alike
    (see the module doc)."""
    path = found.path
    names = {**params, **buffers}
    nodes = list(graph.nodes)
    in_layer = {nd: _layer_index(nd, path, names, found.first) for nd in nodes}
    compute = [nd for nd in nodes if nd.op not in ("placeholder", "output")]
    starts = []
    for want in range(3):
        at = next((k for k, nd in enumerate(compute) if in_layer[nd] == want), None)
        if at is None or (starts and at <= starts[-1]):
            return None
        starts.append(at)
    last = max(k for k, nd in enumerate(compute) if in_layer[nd] == 2)
    prefix, seg0, seg1 = compute[:starts[0]], compute[starts[0]:starts[1]], compute[starts[1]:starts[2]]
    seg2, suffix = compute[starts[2]:last + 1], compute[last + 1:]
    expect = [(prefix, None), (seg0, 0), (seg1, 1), (seg2, 2), (suffix, None)]
    if any(in_layer[nd] not in (None, want) for part, want in expect for nd in part):
        return None
    if any(nd.op != "call_function" for nd in seg0 + seg1 + seg2):
        return None
    place = {nd: (k, i) for i, seg in enumerate((seg0, seg1, seg2)) for k, nd in enumerate(seg)}
    if not _alike(seg0, seg1, place, in_layer, names, path):
        return None
    # what each part may read: a layer the one before it and shared nodes; the suffix the last layer
    for part, allowed, own in ((seg0, {0}, 0), (seg1, {0, 1}, 1), (seg2, {1, 2}, 2), (suffix, {2}, None),
                               (prefix, set(), None)):
        for nd in part:
            for src in nd.all_input_nodes:
                if src in place and place[src][1] not in allowed:
                    return None
                if src.op == "placeholder" and in_layer[src] not in (None, own):
                    return None
    output = nodes[-1]
    if any(src in place and place[src][1] != 2 for src in output.all_input_nodes):
        return None
    numbering = _numbering(compute)
    if numbering is None:
        return None
    return _write(nodes, prefix, seg0, seg1, seg2, suffix, place, in_layer, names, params, found, numbering)


def _layer_index(node: fx.Node, path: str, names: dict, first: int = 0):
    """0, 1 or 2: the alike layer of the three-layer graph a node belongs to (a placeholder
    by its model name, an op by its module), else None (a lead layer's too: `first` of them)."""
    where = names.get(node.name) if node.op == "placeholder" else module_path(node)
    at = layer_of(where, path) if where else None
    return None if at is None or at < first else at - first


def _alike(seg0: list, seg1: list, place: dict, in_layer: dict, names: dict, path: str) -> bool:
    """Layers 0 and 1 trace to the same ops at the same positions, reading the same shared
    nodes, their own parameters under the same names, and their own ops at the same
    positions (layer 1 reads layer 0's outputs where layer 0 reads the prefix's)."""
    if len(seg0) != len(seg1):
        return False

    def role(src: fx.Node, layer: int):
        if src in place:
            k, i = place[src]
            return ("own", k) if i == layer else ("before", k)
        if in_layer.get(src) is not None:
            return ("param", names[src.name][len(path) + 1:].split(".", 1)[-1])
        return ("shared", src)

    for a, b in zip(seg0, seg1):
        if a.target != b.target or len(a.all_input_nodes) != len(b.all_input_nodes):
            return False
        if _shape(a) != _shape(b):
            return False
        for x, y in zip(a.all_input_nodes, b.all_input_nodes):
            rx, ry = role(x, 0), role(y, 1)
            if rx != ry and not (rx[0] == "shared" and ry[0] == "before"):
                return False
        if _constants(a) != _constants(b):
            return False
    return True


def _shape(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape), val.dtype
    if isinstance(val, (tuple, list)):
        return tuple(_shape_of(v) for v in val)
    return None


def _shape_of(v):
    return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(type(v))


def _constants(node: fx.Node):
    """The node's arguments with every node taken out."""
    return repr(fx.node.map_arg((node.args, node.kwargs), lambda _: None))


def _numbering(compute: list):
    """op name -> the number its first node carries, when torch.export numbered the nodes
    of each op name 0 (no suffix) or 1, 2, ... in graph order; else None."""
    first, seen = {}, {}
    for nd in compute:
        base, num = _split_name(nd.name)
        if base not in first:
            first[base] = num
            seen[base] = num
        elif num != seen[base] + 1:
            return None
        seen[base] = num
    if any(v not in (0, 1) for v in first.values()):
        return None
    return first


def _split_name(name: str):
    m = _NUMBERED.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _write(nodes, prefix, seg0, seg1, seg2, suffix, place, in_layer, names, params, found,
           numbering) -> Unrolled | None:
    """The full graph: placeholders (layer 1's repeated as layers 2 .. n-2 right after its
    own, layer 2's renamed to n-1), then prefix, layers 0 and 1, the copies, the last layer
    and the suffix, each op named by its op name's running number."""
    n, path, lead = found.count - found.first, found.path, found.first   # (layers counted from the first alike one)
    out = fx.Graph()
    new: dict = {}      # (node of the three-layer graph, layer it is written as) -> new node
    counts = dict(numbering)
    placeholders = [nd for nd in nodes if nd.op == "placeholder"]
    for nd in placeholders:
        if in_layer[nd] is not None and _placeholder_name(nd.name in params, names[nd.name]) != nd.name:
            return None
    out_params, out_buffers = _write_placeholders(out, new, placeholders, in_layer, names, params, found)

    def emit(nd: fx.Node, layer):
        base, _ = _split_name(nd.name)
        num = counts[base]
        counts[base] = num + 1
        read = _reader(new, place, seg1, in_layer, n, layer)
        made = out.create_node(nd.op, nd.target, fx.node.map_arg(nd.args, read), fx.node.map_arg(nd.kwargs, read),
                               name=base if num == 0 else f"{base}_{num}")
        made.meta = dict(nd.meta)
        if layer is not None and layer not in (0, 1) and "nn_module_stack" in nd.meta:
            made.meta["nn_module_stack"] = _restack(nd.meta["nn_module_stack"], path,
                                                    lead + (2 if layer == n - 1 else 1), lead + layer)
        new[(nd, layer)] = made

    for nd in prefix:
        emit(nd, None)
    for nd in seg0:
        emit(nd, 0)
    for j in range(1, n - 1):
        for nd in seg1:
            emit(nd, j)
    for nd in seg2:
        emit(nd, n - 1)
    for nd in suffix:
        emit(nd, None)
    output = nodes[-1]
    result = out.output(fx.node.map_arg(output.args[0], _reader(new, place, seg1, in_layer, n, None)))
    result.meta = dict(output.meta)
    return Unrolled(out, out_params, out_buffers)


def _write_placeholders(out: fx.Graph, new: dict, placeholders: list, in_layer: dict, names: dict, params: dict,
                        found: Layers) -> tuple[dict, dict]:
    """The placeholders written into `out` (and entered in `new`) in the three-layer graph's
    order, layer 1's repeated as layers 2 .. n-2 right after its own last parameter (and
    buffer), layer 2's renamed to n-1: (placeholder -> parameter name, placeholder -> buffer
    name) of the written graph."""
    n, path, lead = found.count - found.first, found.path, found.first
    out_params, out_buffers = {}, {}

    def renamed(model_name: str, layer: int) -> str:
        rest = model_name[len(path) + 1:].split(".", 1)
        return f"{path}.{lead + layer}.{rest[1]}" if len(rest) == 2 else f"{path}.{lead + layer}"

    def add_placeholder(nd: fx.Node, layer):
        is_param = nd.name in params
        model_name = names.get(nd.name) if layer is None else renamed(names[nd.name], layer)
        ph = out.placeholder(nd.name if layer is None else _placeholder_name(is_param, model_name))
        ph.meta = dict(nd.meta)
        if model_name is not None:
            (out_params if is_param else out_buffers)[ph.name] = model_name
        new[(nd, layer)] = ph

    last_of_layer1 = {}
    for nd in placeholders:
        if in_layer[nd] == 1:
            last_of_layer1[nd.name in params] = nd
    for nd in placeholders:
        layer = in_layer[nd]
        add_placeholder(nd, n - 1 if layer == 2 else layer)
        if nd is last_of_layer1.get(nd.name in params):
            group = [p for p in placeholders if in_layer[p] == 1 and (p.name in params) == (nd.name in params)]
            for j in range(2, n - 1):
                for p in group:
                    add_placeholder(p, j)
    return out_params, out_buffers


def _reader(new: dict, place: dict, seg1: list, in_layer: dict, n: int, layer):
    """How an op written as `layer` (None: prefix or suffix) finds its inputs among the
    nodes written so far (`new`): a copy j of layer 1 (2 <= j <= n-2) reads copy j-1 where
    layer 1 reads layer 0, and the last layer reads copy n-2 where the three-layer graph's
    last reads layer 1."""
    def read(src: fx.Node):
        if src in place:
            k, i = place[src]
            if i == 2:
                return new[(src, n - 1)]
            if i == 0:
                return new[(src, 0)] if layer in (0, 1) else new[(seg1[k], layer - 1)]
            if layer == n - 1:
                return new[(seg1[k], n - 2)]
            return new[(src, layer)]
        if src.op == "placeholder" and in_layer[src] is not None:
            lay = in_layer[src]
            return new[(src, n - 1 if lay == 2 else (layer if lay == 1 else lay))]
        return new[(src, None)]
    return read


def _placeholder_name(is_param: bool, model_name: str) -> str:
    """How torch.export names the placeholder of a parameter ("p_") or buffer ("b_")."""
    return ("p_" if is_param else "b_") + model_name.replace(".", "_")


def _restack(stack: dict, path: str, src: int, dst: int) -> dict:
    """A module stack with layer `src` of the list at `path` written as layer `dst`."""
    old, rep = f"{path}.{src}", f"{path}.{dst}"
    pattern = re.compile(rf"{re.escape(old)}(?=\.|$|\W)")
    out = {}
    for key, (fqn, cls) in stack.items():
        out[pattern.sub(rep, key)] = (pattern.sub(rep, fqn) if isinstance(fqn, str) else fqn, cls)
    return out
