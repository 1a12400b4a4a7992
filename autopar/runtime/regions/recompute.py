"""Recomputation at run time: the layers the plan recomputes run under activation
checkpointing, and what a step keeps for backward can be measured.

Each recomputed layer is a region of the per-rank graph (autopar/passes/recompute.py) called
through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`:

- "offload" (not recomputation, run by the same regions): the layer runs once under
  saved-tensor hooks that copy what autograd saves to host memory (pinned on a GPU) and
  back in backward.
- "full": forward keeps only the region's inputs; backward runs the region's forward
  again (its collectives, a ZeRO-3 weight's gather, its random ops) and then its backward.
- "selective": the same, except that the operations the plan names (matrix products with
  a weight, attention, experts: plan.recompute.kept) keep their outputs from the first
  pass (a selective-checkpoint policy, torch.utils.checkpoint.create_selective_checkpoint_contexts);
  only the cheap operations between them run again.  "alternate" runs the same way: its
  plan.recompute.kept leaves out every second matrix product of the layer.  Under a pipeline schedule, whose
  backward of a stage can run in two parts (input gradients, then weight gradients) and so
  recompute a region twice, the kept outputs are handed back by the project's own pair
  of dispatch modes (_Keeping, _Replaying), which keep them until the region's graph is
  freed rather than giving each up at its first reuse.

Random ops replay: a region records the forward call count of the random streams
(autopar/runtime/regions/rng.py) when it runs, and runs again under that count, so every dropout mask
recomputed in backward is the one forward drew, even after later microbatches' forwards.
So checkpointing is told not to save and restore the devices' random state itself.

`measure_saved(cm, *args, **kwargs)` runs one training step and returns the bytes kept
for backward on this rank (storages counted once; parameters, buffers and the inputs left
out): what autograd saves, the checkpointed regions' inputs and the outputs the selective
policy keeps.  It is the figure the plan's predicted activation memory is checked against.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.passes.recompute import ALL_KERNELS, keeping
from autopar.report.records import SELECTIVE_MODES


_aten = torch.ops.aten
_STATE = {"probe": None, "region": None}   # region: the recomputed layer whose forward runs


def _keeps(func) -> bool:
    keep = keeping()
    return keep is not None and (keep is ALL_KERNELS or func.overloadpacket in keep)


def _policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if _keeps(func) else CheckpointPolicy.PREFER_RECOMPUTE


class _Recorder(TorchDispatchMode):
    """Under a measurement, the outputs the selective policy keeps in forward."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        probe = _STATE["probe"]
        if probe is not None and _keeps(func):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    probe.note(t)
        return out


def _selective_contexts():
    fwd, again = create_selective_checkpoint_contexts(_policy, allow_cache_entry_mutation=True)
    if _STATE["probe"] is None:
        return fwd, again
    @contextlib.contextmanager
    def recording():
        with fwd, _Recorder():
            yield
    return recording(), again


class _Keeping(TorchDispatchMode):
    """Forward of a selective region that may be recomputed more than once: the outputs of
    the kept kernels are stored in call order (detached: no autograd history kept)."""

    def __init__(self, store: list):
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in _UNCOUNTED and _keeps(func):
            self.store.append((func, torch.utils._pytree.tree_map(_detached, out)))
            probe = _STATE["probe"]
            if probe is not None:
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        probe.note(t)
        return out


class _Replaying(TorchDispatchMode):
    """A recomputation of that region: each kept kernel hands back its stored outputs
    instead of running; every entry stays until the region's graph is freed, so a
    backward run in parts (a pipeline schedule's input-gradient pass, then its
    weight-gradient pass) can recompute the region again."""

    def __init__(self, store: list):
        self.store, self.next = store, 0

    def __enter__(self):
        self.next = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _UNCOUNTED or not _keeps(func):
            return func(*args, **(kwargs or {}))
        if self.next >= len(self.store) or self.store[self.next][0] != func:
            raise RuntimeError(f"selective recomputation replayed {func} where forward ran "
                               f"{self.store[self.next][0] if self.next < len(self.store) else 'nothing'}: the "
                               "region's kept operations ran in a different order in backward")
        out = self.store[self.next][1]
        self.next += 1
        return torch.utils._pytree.tree_map(_detached, out)


# ops checkpointing itself may run a different number of times in forward and in recomputation
_UNCOUNTED = frozenset({_aten.detach.default})


def _detached(x):
    """x as a new tensor on the same storage with no autograd history, made below the
    autograd layer's view tracking (a view op's cached output is handed back as a fresh
    output, not as a view of the stored one)."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _replayable_contexts():
    store: list = []
    return _Keeping(store), _Replaying(store)


class Region(nn.Module):
    """One recomputed layer: its graph module, run under non-reentrant checkpointing."""

    def __init__(self, path: str, mode: str, graph_module: fx.GraphModule, streams, replays: bool = False):
        super().__init__()
        self.path, self.mode, self.replays = path, mode, replays
        self.body = graph_module
        self.streams = streams

    def _run(self, calls, *inputs):
        streams = self.streams
        if streams is None:
            return self.body(*inputs)
        now, streams.calls = streams.calls, calls
        try:
            return self.body(*inputs)
        finally:
            streams.calls = now

    def forward(self, *inputs):
        if self.mode == "offload":
            return self._offloaded(*inputs)
        probe = _STATE["probe"]
        if probe is not None and torch.is_grad_enabled():
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    probe.note(t)
        calls = self.streams.calls if self.streams is not None else 0
        if not torch.is_grad_enabled():
            return self._run(calls, *inputs)
        contexts = _replayable_contexts if self.replays else _selective_contexts
        extra = {"context_fn": contexts} if self.mode in SELECTIVE_MODES else {}
        # every random op of the graph draws from its own stream, seeded by the forward call
        # count the region replays (autopar/runtime/regions/rng.py): checkpointing's own saving and
        # restoring of the devices' random state is redundant there, and on a GPU it cost
        # 7 ms of GPT-2 124M's 61 ms step with every layer recomputed (one H100,
        # docs/gpu/2026-11-26-h100-recompute-rng-probe.txt)
        outer, _STATE["region"] = _STATE.get("region"), self   # (reshard.py: gathers made in a recomputed layer)
        try:
            return checkpoint(self._run, calls, *inputs, use_reentrant=False,
                              preserve_rng_state=self.streams is None, **extra)
        finally:
            _STATE["region"] = outer


    def _offloaded(self, *inputs):
        """The layer run once, what autograd saves copied to host memory as it is saved
        and back to the device in backward (on a GPU into pinned host buffers)."""
        calls = self.streams.calls if self.streams is not None else 0
        if not torch.is_grad_enabled():
            return self._run(calls, *inputs)
        copies = _HostCopies()
        with torch.autograd.graph.saved_tensors_hooks(copies.pack, _from_host):
            try:
                return self._run(calls, *inputs)
            finally:
                copies.sources.clear()


class _HostCopies:
    """The saved-tensor pack of one offloaded layer's forward: each storage autograd saves
    copied to host memory once (several saved views of it share the copy; the sources are
    held while the forward runs, so no storage is freed and its address reused meanwhile)."""

    def __init__(self):
        self.copies: dict = {}    # device storage address -> its host copy (bytes)
        self.sources: list = []

    def pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if t.layout != torch.strided or t.device.type == "meta" or isinstance(base, nn.Parameter) or (
                base.is_leaf and base.requires_grad):
            return t   # (a weight, or a view of one, stays where it is: it is held anyway)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        host = self.copies.get(key)
        if host is None:
            pinned = t.device.type == "cuda"
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pinned)
            host.copy_(whole, non_blocking=pinned)
            self.copies[key] = host
            self.sources.append(t)
            probe = _STATE["probe"]
            if probe is not None:
                probe.host += storage.nbytes()
        return t.device, t.dtype, host, t.storage_offset(), t.size(), t.stride()


def _from_host(packed):
    """The saved-tensor unpack of an offloaded layer: its storage back on the device, viewed as saved."""
    if isinstance(packed, torch.Tensor):
        return packed
    device, dtype, host, offset, size, stride = packed
    back = host.to(device, non_blocking=host.is_pinned())
    return torch.empty(0, dtype=dtype, device=device).set_(back.untyped_storage(), offset, size, stride)


def wrap_regions(gm: fx.GraphModule, sites, streams, replays: bool = False) -> list:
    """Run each region body the pass cut out of gm (autopar/passes/recompute.outline_recompute:
    its RegionSites) as a checkpointed Region; the Regions, in order."""
    regions = []
    for site in sites:
        region = Region(site.path, site.mode, gm.get_submodule(site.name), streams, replays=replays)
        gm.add_submodule(site.name, region)
        regions.append(region)
    return regions


class SavedProbe:
    """Storages kept for backward during one forward (see measure_saved)."""

    def __init__(self, ignore: set):
        self.ignore = ignore
        self.storages: dict = {}
        self.host = 0   # bytes offloaded layers copied to host memory

    def note(self, t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        if torch._C._current_graph_task_id() != -1:
            return   # (packed while backward runs, as an op whose backward runs its forward again under
            #          autograd (the experts'): held within that op's backward only, not since forward)
        s = t.untyped_storage()
        if s.data_ptr() not in self.ignore:
            self.storages[s.data_ptr()] = s.nbytes()

    @property
    def bytes(self) -> int:
        return int(sum(self.storages.values()))


def in_recomputed_forward() -> bool:
    """Whether a recomputed layer's first forward is running (its recomputation in backward
    is not: checkpointing calls the layer's body then, not Region.forward)."""
    return _STATE["region"] is not None


def note_saved(t: torch.Tensor) -> None:
    """For the runtime's own saved-tensor hooks (ZeRO-3's): a tensor they keep as it is."""
    probe = _STATE["probe"]
    if probe is not None:
        probe.note(t)


def measure_saved(cm, *args, **kwargs) -> int:
    """Bytes kept for backward on this rank by one `cm.train_step(*args, **kwargs)` (see the
    module docstring); the step runs as usual (gradients accumulate as in train_step)."""
    return measure_saved_by_tier(cm, *args, **kwargs)["device"]


def measure_saved_by_tier(cm, *args, **kwargs) -> dict:
    """measure_saved's bytes kept on the device ("device") and the bytes offloaded layers
    copied to host memory ("host")."""
    ignore = {p.untyped_storage().data_ptr() for p in cm.parameters()}
    ignore |= {b.untyped_storage().data_ptr() for b in cm.buffers()}
    for t in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            ignore.add(t.untyped_storage().data_ptr())
    probe = SavedProbe(ignore)

    def pack(t):
        probe.note(t)
        return t

    _STATE["probe"] = probe
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cm.train_step(*args, **kwargs)
    finally:
        _STATE["probe"] = None
    return {"device": probe.bytes, "host": probe.host}
