"""Gradient synchronisation of parameter shards, bucketed and overlapped with backward.

Most gradient collectives run inside autograd: every move's backward is the dual
collective.  What is left here is what data-parallel training spends most of its
communication on: all-reducing parameter gradients that are Partial on some mesh axes
(a parameter read whole by an op that splits the batch).  As backward produces each such
gradient, it joins a bucket of gradients that need the same axes reduced; a full bucket is
flattened and all-reduced asynchronously while backward goes on; `finish()` flushes the
rest and waits.  Inside `no_sync()` gradients only accumulate, Partial, and the next
synchronised backward reduces the sum (the reduction is linear).

ZeRO-2 parameters (autopar/runtime/grads/zero.py) are reduce-scattered instead: their buckets sum the
gradient over the axes it is Partial on and keep this rank's chunk in `zero_grads` (added
to what is there, so steps without zero_grad accumulate); the full local gradient is then
freed.  Under mixed precision the buckets are summed in reduce_dtype.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autopar.runtime.grads.pieces import drop_absent, is_absent, mark, mark_absent
from autopar.runtime.grads.zero import reduce_scatter_finish, reduce_scatter_start


def copy_from_flat(flat: torch.Tensor, tensors: list) -> int:
    """Copy consecutive pieces of the 1-D `flat` back into `tensors` (what a flat collective
    over torch.cat of them returned); the number of elements read."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return offset


class GradSync:
    FIRST_BUCKET_MB = 1.0  # the first bucket is small so communication starts early in backward

    def __init__(self, shards, sync_axes: dict, groups, bucket_mb: float, zero_layouts=None, reduce_dtype=None,
                 zero_grads: dict | None = None, pieces: dict | None = None, hold=frozenset()):
        """shards: parameter key -> this rank's shard (runtime/state/rank_state.RankState.shards);
        sync_axes: key -> mesh axes to all-reduce its gradient over; groups: the MeshGroups;
        zero_layouts: key -> ZeroLayout of ZeRO-1/2 parameters (stage-2 ones are
        reduce-scattered over their layout's reduce axes instead); zero_grads: the dict that
        receives ZeRO-2 chunks (RankState.zero_grads); pieces: key -> why its gradient here is
        only a piece (runtime/grads/pieces.py); hold: keys whose hooks never launch, reduced by
        finish() (a weight two of a rank's pipeline stages read)."""
        self.hold = frozenset(hold)
        self.hooked = 0
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.first_bytes = int(min(bucket_mb, self.FIRST_BUCKET_MB) * 2**20)
        self.pending_bytes: dict[tuple, int] = {}
        self.enabled = True
        self.layouts = {k: lay for k, lay in (zero_layouts or {}).items() if lay.stage == 2}
        self.shards = shards
        self.params = {key: shards[key] for key in list(sync_axes) + list(self.layouts)}
        self.axes = {k: ("rs",) + self.layouts[k].geometry if k in self.layouts else tuple(v)
                     for k, v in {**sync_axes, **dict.fromkeys(self.layouts)}.items()}
        self.groups = groups
        self.groups_of = groups.group_of
        self.reduce_dtype = reduce_dtype
        self.zero_grads: dict = {} if zero_grads is None else zero_grads  # ZeRO-2 key -> this rank's chunk
        self.pending: dict[tuple, list] = {}
        self.in_flight: list = []
        self.flats: dict = {}   # (bucket's parameters, dtype) -> its flat buffer, reused every step
        # the last finish()'s all-reduced buckets whose flat buffer holds exactly their members'
        # gradients (same dtype): (flat, keys), which the finite check reads whole (checked_pieces)
        self.reduced: list = []
        self.done: set = set()
        self.key_of = {id(p): key for key, p in self.params.items()}
        self.pieces: dict = dict(pieces or {})
        for key, p in self.params.items():
            p.register_post_accumulate_grad_hook(self._hook(key))

    def _hook(self, key):
        def ready(param: torch.Tensor) -> None:
            if not self.enabled or key in self.done or key in self.hold:
                return
            self.done.add(key)
            axes = self.axes[key]
            self.pending.setdefault(axes, []).append(param)
            size = self.pending_bytes.get(axes, 0) + param.grad.numel() * param.grad.element_size()
            self.pending_bytes[axes] = size
            if size >= (self.bucket_bytes if self.in_flight else self.first_bytes):
                self._launch(axes)
        return ready

    def _launch(self, axes: tuple, extra: torch.Tensor | None = None) -> None:
        """All-reduce the bucket pending on `axes` (ZeRO-2: reduce-scatter); `extra`, a
        Partial scalar of the same dtype (the loss), rides along as one more element."""
        bucket = self.pending.pop(axes, [])
        self.pending_bytes.pop(axes, None)
        if not bucket:
            return
        if axes[:1] == ("rs",):
            keys = [self.key_of[id(p)] for p in bucket]
            handle = reduce_scatter_start([p.grad for p in bucket], [self.layouts[k] for k in keys], self.groups,
                                          self.reduce_dtype)
            self.in_flight.append(("rs", handle, keys, None))
            return
        dtype = self.reduce_dtype or bucket[0].grad.dtype
        flat = self.flats.get((tuple(map(id, bucket)), dtype, extra is not None))
        total = sum(p.grad.numel() for p in bucket) + (extra is not None)
        if flat is None or flat.numel() != total:
            # one buffer per bucket, kept across steps: a fresh large one each step pays its
            # pages again (on CPU, tens of ms per step for a few MB)
            flat = bucket[0].grad.new_empty(total, dtype=dtype)
            self.flats[(tuple(map(id, bucket)), dtype, extra is not None)] = flat
        parts = [p.grad.reshape(-1).to(dtype) for p in bucket] + ([extra.reshape(1)] if extra is not None else [])
        torch.cat(parts, out=flat)
        work = dist.all_reduce(flat, group=self.groups_of(axes), async_op=True)
        self.in_flight.append((work, flat, bucket, extra))

    def _foldable(self, extra) -> bool:
        tensor, axes = extra
        return bool(self.pending.get(axes)) and tensor.numel() == 1 and \
            tensor.dtype == (self.reduce_dtype or self.pending[axes][0].grad.dtype)

    def finish(self, extra: tuple | None = None) -> None:
        """After backward: reduce what is left, wait for everything, write the sums back.
        extra: (scalar tensor, mesh axes) summed in place over those axes, in the last
        bucket on them when one is left (the loss: one collective fewer per step, as DDP
        makes), else by itself."""
        if not self.enabled:
            if extra is not None:
                dist.all_reduce(extra[0], group=self.groups_of(extra[1]))
            return
        self.hooked = len(self.done)  # gradients whose reduction started during backward
        missing = [k for k in self.params if k not in self.done and self.params[k].grad is not None
                   and not is_absent(self.params[k].grad)]
        for key in missing:  # gradients that never fired a hook (e.g. accumulated under no_sync only)
            self.pending.setdefault(self.axes[key], []).append(self.params[key])
        self.reduced = []
        ride = extra is not None and self._foldable(extra)
        for axes in list(self.pending):
            self._launch(axes, extra[0] if ride and axes == extra[1] else None)
        if extra is not None and not ride:
            self.in_flight.append((dist.all_reduce(extra[0], group=self.groups_of(extra[1]), async_op=True),
                                   None, [], None))
        for work, flat, bucket, summed in self.in_flight:
            if work == "rs":
                for key, chunk in zip(bucket, reduce_scatter_finish(flat)):
                    held = self.zero_grads.get(key)
                    self.zero_grads[key] = chunk if held is None else held.add_(chunk)
                    self.params[key].grad = None
                    if key in self.pieces:
                        mark_absent(self.params[key], self.pieces[key])
                continue
            work.wait()
            offset = copy_from_flat(flat, [p.grad for p in bucket])
            if bucket and all(p.grad.dtype == flat.dtype for p in bucket):   # (not the loss's own call)
                self.reduced.append((flat, [self.key_of[id(p)] for p in bucket]))
            if summed is not None:
                summed.copy_(flat[offset:].view_as(summed))
        self.in_flight.clear()
        self.done.clear()
        for key, what in self.pieces.items():
            mark(self.shards[key], what)

    def checked_pieces(self, grads: list) -> list:
        """The tensors that hold `grads` ((key, gradient) of the rank's trained parameters) as
        the last synchronised step left them: each bucket all-reduced whole, as its flat
        buffer (which the loss may ride at its end), and every other gradient itself; the
        finite check reads these (one kernel per bucket, not per parameter: on CPU ranks
        torch's foreach norm runs one per tensor).  Outside a synchronised step, the
        gradients themselves."""
        if not self.enabled or not self.reduced:
            return [g for _, g in grads]
        covered = {key for _, keys in self.reduced for key in keys}
        return [flat for flat, _ in self.reduced] + [g for key, g in grads if key not in covered]

    def begin(self) -> None:
        """Before a forward: ZeRO-2 stand-in gradients go, so backward accumulates afresh."""
        drop_absent(self.params[k] for k in self.layouts)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (gradient accumulation micro-steps)."""
        self.enabled = False
        self.reduced = []   # (the buckets no longer hold the gradients)
        try:
            yield
        finally:
            self.enabled = True
