"""Gradient synchronisation of parameter shards, bucketed and overlapped with backward.

Most gradient collectives run inside autograd: every move's backward is the dual
collective.  What is left here is what data-parallel training spends most of its
communication on: all-reducing parameter gradients that are Partial on some mesh axes
(a parameter read whole by an op that splits the batch).  As backward produces each such
gradient, it joins a bucket of gradients that need the same axes reduced; a full bucket is
flattened and all-reduced asynchronously while backward goes on; `finish()` flushes the
rest and waits.  Inside `no_sync()` gradients only accumulate, Partial, and the next
synchronised backward reduces the sum (the reduction is linear).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class GradSync:
    FIRST_BUCKET_MB = 1.0  # the first bucket is small so communication starts early in backward

    def __init__(self, module, sync_axes: dict, groups_of, bucket_mb: float):
        """sync_axes: parameter key in module.shards -> mesh axes to all-reduce its gradient over;
        groups_of(axes) -> a process group spanning those mesh axes."""
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.first_bytes = int(min(bucket_mb, self.FIRST_BUCKET_MB) * 2**20)
        self.pending_bytes: dict[tuple, int] = {}
        self.enabled = True
        self.params = {key: module.shards[key] for key in sync_axes}
        self.axes = dict(sync_axes)
        self.groups_of = groups_of
        self.pending: dict[tuple, list] = {}
        self.in_flight: list = []
        self.done: set = set()
        for key, p in self.params.items():
            p.register_post_accumulate_grad_hook(self._hook(key))

    def _hook(self, key):
        def ready(param: torch.Tensor) -> None:
            if not self.enabled or key in self.done:
                return
            self.done.add(key)
            axes = self.axes[key]
            self.pending.setdefault(axes, []).append(param)
            size = self.pending_bytes.get(axes, 0) + param.grad.numel() * param.grad.element_size()
            self.pending_bytes[axes] = size
            if size >= (self.bucket_bytes if self.in_flight else self.first_bytes):
                self._launch(axes)
        return ready

    def _launch(self, axes: tuple) -> None:
        bucket = self.pending.pop(axes, [])
        self.pending_bytes.pop(axes, None)
        if not bucket:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        work = dist.all_reduce(flat, group=self.groups_of(axes), async_op=True)
        self.in_flight.append((work, flat, bucket))

    def finish(self) -> None:
        """After backward: reduce what is left, wait for everything, write the sums back."""
        if not self.enabled:
            return
        missing = [k for k in self.params if k not in self.done and self.params[k].grad is not None]
        for key in missing:  # gradients that never fired a hook (e.g. accumulated under no_sync only)
            self.pending.setdefault(self.axes[key], []).append(self.params[key])
        for axes in list(self.pending):
            self._launch(axes)
        for work, flat, bucket in self.in_flight:
            work.wait()
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self.in_flight.clear()
        self.done.clear()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (gradient accumulation micro-steps)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
