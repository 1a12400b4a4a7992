"""The process's tracing cache: traces by what they depend on, and the outlines that let a
trace at another batch size be written instead of exported (autopar/trace/rebatch.py).

Planning and compiling one model, or compiling it with several plans, traces once; the
pipeline search, which plans one microbatch size per candidate, exports two sizes and
writes the others, exchanging outlines between the processes it forks.  TRACES is the
one cache of the process (autopar.trace.export.trace reads and fills it).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from autopar.trace.rebatch import outline, rebatched
from autopar.trace.unroll import plain_attributes

log = logging.getLogger("autopar")

_UNROLLED = "|unrolled"   # key suffix of planning traces (autopar/trace/unroll.py)


def fingerprint(model: torch.nn.Module, example_inputs, example_kwargs) -> str:
    """Everything the traced graph depends on that can be read without running the model:
    module types and their plain attributes (configs, flags, sizes, training mode), the
    names, shapes, dtypes, devices and ties of parameters and buffers, and the inputs'
    structure, shapes and dtypes."""
    parts = []
    for name, mod in model.named_modules(remove_duplicate=False):
        attrs = sorted((k, repr(v)) for k, v in plain_attributes(mod).items())
        parts.append((name, type(mod).__module__, type(mod).__qualname__, mod.training, attrs))
    first: dict[int, str] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        parts.append((name, first.setdefault(id(t), name), tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad))
    flat, spec = torch.utils._pytree.tree_flatten((tuple(example_inputs), example_kwargs))
    parts.append(str(spec))
    parts.extend((tuple(x.shape), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor) else repr(x) for x in flat)
    return repr(parts)


@dataclass(frozen=True)
class BatchFamily:
    """The traces of one model and inputs that differ only in the inputs' leading dim:
    `fingerprint` is theirs with that dim left out, `batch` the dim of this one."""

    fingerprint: str
    batch: int

    def __str__(self) -> str:
        return f"batch {self.batch} of model {self.fingerprint[:12]}..."


def batch_family(model: torch.nn.Module, example_inputs, example_kwargs) -> BatchFamily | None:
    """The BatchFamily of model and inputs when every tensor input has a leading dim and
    they agree; else None."""
    flat = torch.utils._pytree.tree_leaves((tuple(example_inputs), example_kwargs))
    sizes = {x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        return None
    rows = torch.utils._pytree.tree_map(
        lambda x: x.new_empty((0, *x.shape[1:])) if isinstance(x, torch.Tensor) and x.dim() > 0 else x,
        (tuple(example_inputs), example_kwargs))
    return BatchFamily(fingerprint(model, rows[0], rows[1]), sizes.pop())


class TraceCache:
    """Traces (autopar.trace.export.Traced) by fingerprint, the batch sizes each model was
    exported at, and the outlines (rebatch.Outline) of exports here and in other processes.

    A trace the cache hands out (`find`, `written`; autopar.trace.export.trace with
    shared=True) is shared: the same object goes to every later caller with the same model
    and inputs, and traces written at other batch sizes keep its graph module as their root
    and its unchanged shape tensors.  A holder of a shared trace may read everything in it:
    walk its graph, read nodes' meta (shapes in "val", "nn_module_stack"), its params,
    buffers, tied and constants; keep references to its nodes (as planning's PNodes do).  It
    must not change any of it: no node added, erased, renamed or re-wired, no meta key set or
    removed, no tensor in meta changed in place (requires_grad_ included), no recompile, no
    attribute of the Traced or entry of its dicts and lists set.  A caller that rewrites the
    graph (the runtime's passes) asks for a copy (trace(shared=False), Traced.copy): its own
    graph and containers, which it may change freely; the tensors in the copy's meta and
    constants are still shared and read only.  tests/test_trace_cache.py checks that a
    whole plan() leaves the shared trace as it found it."""

    def __init__(self):
        self._traces: dict = {}     # fingerprint (+ _UNROLLED for planning traces) -> Traced
        self._exports: dict = {}    # BatchFamily.fingerprint -> {batch: key in _traces of its export}
        self._outlines: dict = {}   # BatchFamily.fingerprint -> {batch: Outline}, exported here or adopted
        self._cast: dict = {}       # (model fingerprint, dtype) of the model last cast for tracing -> its copy
        self._told: set = set()     # (what, id of the model) of the once-per-model notices already logged

    def __len__(self) -> int:
        return len(self._traces)

    def find(self, key: str, unroll: bool):
        """The trace cached for fingerprint `key` (shared: see the class doc), or None.  A full
        trace serves a planning (unrolled) one too."""
        found = self._traces.get(key)
        if found is None and unroll:
            found = self._traces.get(key + _UNROLLED)
        return found

    def store(self, key: str, traced, unroll: bool, exported: BatchFamily | None = None) -> None:
        """Keep `traced`, the trace of fingerprint `key` (a planning trace when unroll);
        exported: its batch family when it was exported (not written), so that other batch
        sizes can be written from it."""
        full = key + _UNROLLED if unroll else key
        self._traces[full] = traced
        if exported is not None:
            self._exports.setdefault(exported.fingerprint, {})[exported.batch] = full

    def written(self, family: BatchFamily):
        """The planning trace at family's batch written from two traces of the same model at
        other batches (autopar/trace/rebatch.py): an export cached here, and another export
        cached here or one outlined by another process (adopt_outlines); else None.  Not
        stored: the caller stores it under its own key."""
        exports = [(b, key) for b, key in self._exports.get(family.fingerprint, {}).items()
                   if key in self._traces and b != family.batch]
        if not exports:
            return None
        a, key_a = exports[0]
        others = [b for b, _ in exports[1:]] + [b for b in self._outlines.get(family.fingerprint, {})
                                                  if b != a]   # (an outline at the batch asked for serves)
        if not others:
            return None
        b = others[0]
        start = time.perf_counter()
        traced = rebatched(self._traces[key_a], self._outline(family.fingerprint, b), (a, b), family.batch)
        if traced is not None:
            log.info("traced at %d rows in %.2fs: written from the traces at %d and %d rows (autopar/trace/rebatch.py)",
                     family.batch, time.perf_counter() - start, a, b)
        return traced

    def exported_outlines(self, traced) -> dict:
        """{fingerprint: {batch: Outline}} of the exported planning traces of the model and
        inputs `traced` (a planning trace this cache handed out, shared) is one of, for
        another process to write other batches from (adopt_outlines); {} when it is not an
        export of this cache.  Picklable."""
        for family, keys in self._exports.items():
            if any(self._traces.get(key) is traced for key in keys.values()):
                return {family: {b: self._outline(family, b) for b, key in keys.items() if key in self._traces}}
        return {}

    def adopt_outlines(self, found: dict) -> None:
        """Take exported_outlines() of another process's cache: traces at other batches are
        then written from one exported here and one of those.  Outlines held already stay."""
        for family, outlines in found.items():
            mine = self._outlines.setdefault(family, {})
            for b, o in outlines.items():
                mine.setdefault(b, o)

    def cast(self, model: torch.nn.Module, dtype: torch.dtype, make):
        """`make(model, dtype)` (a copy of the model in `dtype`, to trace what runs under mixed
        precision), remembered for the last model and dtype while the model's fingerprint
        (structure, attributes, shapes) is unchanged: the pipeline search traces one model
        at every microbatch size (a copy of llama3-8b takes 0.03 s).  The copy is shared and
        read only, as a shared trace is."""
        key = (fingerprint(model, (), {}), dtype)
        if key not in self._cast:
            self._cast.clear()
            self._cast[key] = make(model, dtype)
        return self._cast[key]

    def first_time(self, what: str, model) -> bool:
        """True the first time `what` is asked about this model object (a notice tracing logs
        once per model, not once per trace)."""
        key = (what, id(model))
        if key in self._told:
            return False
        self._told.add(key)
        return True

    def clear(self) -> None:
        """Forget every trace, export, outline, cast copy and notice given."""
        self._traces.clear()
        self._exports.clear()
        self._outlines.clear()
        self._cast.clear()
        self._told.clear()

    def _outline(self, family: str, batch: int):
        """The Outline of the family's trace at `batch` (adopted, or made once from the export)."""
        outlines = self._outlines.setdefault(family, {})
        if batch not in outlines:
            outlines[batch] = outline(self._traces[self._exports[family][batch]])
        return outlines[batch]


TRACES = TraceCache()   # the process's cache (the only module-level tracing state)
