"""Module paths of traced nodes, and the repeated layer a path belongs to.

torch.export records in `node.meta["nn_module_stack"]` the modules a node ran in; the
innermost one's path ("model.layers.3.self_attn.q_proj") is where the planner, the report
and the passes look up its layer.  A layer is a numbered child of a module list: the
component after the list's path is a whole number ("model.layers.3", index 3).  Every
stage reads the index through `layer_path` here, so they agree on what counts as a layer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.fx as fx


def module_path(node: fx.Node) -> str:
    """The path of the innermost module a node of an export ran in ("layers.3.attention")."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # torch.export writes L['self'].blocks[0].attn style paths in some versions
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


@dataclass(frozen=True)
class LayerPath:
    """A module path read as `<prefix>.<index>[.<rest>]`: "model.layers.3.mlp.up" is layer 3
    of the list "model.layers", at "mlp.up" inside it (rest "" for the layer itself)."""

    prefix: str
    index: int
    rest: str

    def __str__(self) -> str:
        return f"{self.prefix}.{self.index}" + (f".{self.rest}" if self.rest else "")


_FIRST = re.compile(r"^(?P<prefix>.*?)\.(?P<index>\d+)(?:\.|$)")   # (shortest prefix: the first number)
_AFTER = re.compile(r"(?P<index>\d+)(?:\.|$)")


def _match(path: str, prefix: str | None):
    """The one parse behind layer_path, layer_of and block_of (called per node of a
    10,000-node graph, so it builds no record): a match whose group "index" is the layer
    index (and "prefix" the list's path when `prefix` is None), or None."""
    if prefix is None:
        return _FIRST.match(path)
    return _AFTER.match(path, len(prefix) + 1) if path.startswith(prefix + ".") else None


def layer_path(path: str, prefix: str | None = None) -> LayerPath | None:
    """The layer `path` is in, or None.

    prefix None: the first numbered component after the first one ("blocks.3.attn.q" ->
    blocks, 3; "model.layers.3.mlp.experts.5" -> model.layers, 3; "3.mlp" -> None, a
    path's first component is a child of the model, not a layer of a list).
    prefix "model.layers": only a path that starts with "model.layers." and continues with
    a number counts ("model.layers.3.mlp" -> 3, "model.layers.3" -> 3; "model.layersX.3",
    "encoder.model.layers.3" and "model.layers.norm" -> None)."""
    m = _match(path, prefix)
    if m is None:
        return None
    return LayerPath(m["prefix"] if prefix is None else prefix, int(m["index"]), path[m.end("index") + 1:])


def layer_of(path: str, prefix: str | None = None) -> int | None:
    """The index of the layer `path` is in (see layer_path): "model.layers.3.mlp" -> 3."""
    m = _match(path, prefix)
    return None if m is None else int(m["index"])


def block_of(path: str) -> tuple[str, int] | None:
    """'blocks.3.attn.q' -> ('blocks', 3): the repeated layer a node belongs to, if any (the
    key identical layers are grouped by, autopar/solve/problem/layers.py)."""
    m = _match(path, None)
    return None if m is None else (m["prefix"], int(m["index"]))
