"""Inputs checked at the door of every forward, so a bad batch fails with its name on it.

- Shape and dtype of every tensor input against the example the model was compiled with
  (the local shard's shape with local_inputs=True; a pipelined plan's whole batch).
- Token ids read by an embedding lie in [0, rows): one device raises IndexError for an id
  out of range; a vocabulary-split embedding would silently read zeros for it.
- During the first CHECKED_CALLS forwards, the ranks compare what they were given (one
  small all-gather): without local_inputs every rank must pass the same global batch
  (the DDP habit of one batch per rank, e.g. from a DistributedSampler, is caught and
  pointed to local_inputs=True); with it, every rank's shard must have the same shape.
  The comparison runs before any collective of the step, so every rank raises the same
  error instead of one rank failing and its peers hanging in a collective.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.problem import module_path

CHECKED_CALLS = 3
_PASS_ON = {"aten.view.default", "aten.reshape.default", "aten.unsqueeze.default", "aten.expand.default",
            "aten.clone.default", "aten.contiguous.default", "aten._to_copy.default", "aten.to.dtype",
            "aten.alias.default", "aten.flatten.using_ints", "aten._unsafe_view.default"}


class InputError(ValueError):
    """An input does not fit the compiled model; the message names it and says what to pass."""


@dataclass(frozen=True)
class Expected:
    """One user input: its placeholder name, global shape and dtype, and (token ids) the rows
    of the embeddings it indexes, with their modules."""

    name: str
    shape: tuple | None
    dtype: torch.dtype | None
    rows: tuple = ()   # (rows, module path) of each embedding it feeds


def expected_inputs(gm: fx.GraphModule, user_inputs) -> list[Expected]:
    """Read from the traced graph before the passes rewrite it (global shapes)."""
    user_inputs = set(user_inputs)
    feeds: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or str(node.target) != "aten.embedding.default":
            continue
        src = node.args[1]
        while isinstance(src, fx.Node) and src.op == "call_function" and str(src.target) in _PASS_ON:
            src = src.args[0]
        if isinstance(src, fx.Node) and src.op == "placeholder" and src.target in user_inputs:
            feeds.setdefault(src.target, []).append((node.args[0].meta["val"].shape[0], module_path(node)))
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.target in user_inputs:
            val = node.meta.get("val")
            tensor = isinstance(val, torch.Tensor)
            out.append(Expected(node.target, tuple(val.shape) if tensor else None, val.dtype if tensor else None,
                                tuple(feeds.get(node.target, ()))))
    return out


def local_shape(shape: tuple, layout, groups) -> tuple:
    """The shape of this rank's piece of a tensor of `shape` laid out as `layout`."""
    shape = list(shape)
    for axis, p in enumerate(layout or ()):
        if isinstance(p, Shard):
            shape[p.dim] //= groups.size(axis)
    return tuple(shape)


class InputCheck:
    """The checks of one compiled module (see the module docstring)."""

    def __init__(self, expected: list[Expected], groups, batch_scale: int = 1):
        self.expected = expected
        self.groups = groups
        self.layouts = None          # per input, with local_inputs=True (set by compile)
        self.batch_scale = batch_scale  # a pipelined plan is traced for one of this many microbatches
        self.calls = 0
        self.compared_calls = CHECKED_CALLS   # compile(check_inputs=...): calls whose inputs ranks compare

    def _shape_of(self, k: int, e: Expected) -> tuple:
        shape = e.shape
        if self.layouts is not None and self.layouts[k] is not None:
            shape = local_shape(shape, self.layouts[k], self.groups)
        if self.batch_scale > 1 and shape:
            shape = (shape[0] * self.batch_scale,) + tuple(shape[1:])
        return shape

    def __call__(self, values: list) -> None:
        """values: the user inputs in placeholder order."""
        self.calls += 1
        if self.calls <= self.compared_calls:
            self._compare_ranks(values)
        for k, (e, v) in enumerate(zip(self.expected, values)):
            if e.shape is None or not isinstance(v, torch.Tensor):
                continue
            want = self._shape_of(k, e)
            if tuple(v.shape) != want or v.dtype != e.dtype:
                where = " (this rank's shard: local_inputs=True)" if self.layouts is not None else ""
                raise InputError(f"input {e.name!r} has shape {tuple(v.shape)} {v.dtype}; the model was compiled "
                                 f"for {want} {e.dtype}{where}. Pass inputs of the compiled shape, or compile "
                                 f"again with example inputs of the new shape")
            for rows, module in e.rows:
                if v.numel() and (int(v.min()) < 0 or int(v.max()) >= rows):
                    bad = int(v.min()) if int(v.min()) < 0 else int(v.max())
                    raise IndexError(f"index out of range in self: input {e.name!r} holds id {bad}, outside the "
                                     f"{rows} rows of the embedding in {module or 'the model'!r}")

    def _compare_ranks(self, values: list) -> None:
        mine = []
        for v in values:
            if isinstance(v, torch.Tensor):
                data = v.detach().contiguous().cpu()
                digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
                mine.append((tuple(v.shape), str(v.dtype), digest))
            else:
                mine.append(repr(v))
        coord = [self.groups.coordinate(a) for a in range(self.groups.ndim)]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (coord, mine))
        for k, e in enumerate(self.expected):
            layout = self.layouts[k] if self.layouts is not None else None
            split = [a for a, p in enumerate(layout or ()) if isinstance(p, Shard)]
            first: dict = {}   # the piece a rank holds -> (rank, what rank 0 of that piece passed)
            for rank, (c, theirs) in enumerate(every):
                piece = tuple(c[a] for a in split)
                seen = first.setdefault(piece, (rank, theirs[k]))
                a, b = seen[1], theirs[k]
                if a == b and _shape(b) == _shape(every[0][1][k]):
                    continue
                if self.layouts is None:
                    raise InputError(
                        f"rank {rank} passed a different input {e.name!r} than rank 0 ({_brief(b)} vs "
                        f"{_brief(every[0][1][k])}). autopar takes the same global batch on every rank; to give "
                        f"each rank its own part (the DistributedDataParallel habit), compile with "
                        f"local_inputs=True and pass the rank's piece laid out as cm.input_layouts says "
                        f"(cm.shard_inputs cuts it from a global batch)")
                raise InputError(
                    f"ranks {seen[0]} and {rank} hold the same piece of input {e.name!r} (layout "
                    f"{_layout(layout)}: split only over mesh axes {split}) but passed {_brief(a)} and "
                    f"{_brief(b)}; give the ranks that share a piece the same data, e.g. "
                    f"DistributedSampler(num_replicas=<ranks along the split axes>, rank=<coordinate there>)")


def _brief(entry) -> str:
    if isinstance(entry, tuple):
        shape, dtype, digest = entry
        return f"{shape} {dtype.replace('torch.', '')}, contents {digest[:8]}"
    return entry


def _shape(entry):
    return entry[:2] if isinstance(entry, tuple) else entry


def _layout(layout) -> str:
    return "(" + ", ".join(f"S({p.dim})" if isinstance(p, Shard) else "R" for p in layout or ()) + ")"
