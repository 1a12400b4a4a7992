"""ZeRO-3 at run time: gathered weights are not kept between forward and backward.

A parameter stored Shard on an axis where its op reads it whole is all-gathered just
before use (a move inserted by passes.collectives; its backward reduce-scatters the
gradient).  Autograd would keep the gathered weight alive until backward because the op
saves it; with reshard_after_forward the saved weight is packed as "gather this shard
again" instead (torch.autograd.graph.saved_tensors_hooks) and re-gathered when backward
unpacks it, so between forward and backward a rank holds only its shards, as the cost
model assumes (it charges the second all-gather in backward).  (Within one forward the
gathered weights are held until it ends: saved tensors are recognised by their storage,
which must not be recycled for another tensor meanwhile.)

The gathers of the next parameters are prefetched: when the k-th gather of a forward runs,
the (k+1)-th is started asynchronously, so it overlaps with the compute in between
(moves that are exactly one all-gather; others run when reached).

Offloaded weights.  A parameter whose stored shard lives in host memory or on disk
(ParamState.weights: ZeRO-Infinity's parameter offload) is copied to the device at each
use and nowhere kept there: its gathers copy the shard first (a bucket's shards, a
prefetch's), the gradient comes back to the host shard, and a reader that takes it
without a gather reads a copy made by a `fetch` node the constructor puts before it.  The
copy is registered like a gathered weight, so under reshard_after_forward autograd keeps
"fetch it again" instead of the copy, and backward copies it again.  A disk shard is a
mapping of its file; the next one's pages are asked for ahead (`DiskStore.advise`).

Grouped gathers.  Weights whose gradient nothing else synchronises (pure ZeRO-3: sharded
on every axis it is not split by the plan) and whose move is one all-gather on one axis
(its backward one reduce-scatter there) are gathered in buckets of consecutive gathers up
to `bucket_bytes` (a transformer layer's weights, typically): one flat all-gather per
bucket in forward, the next bucket prefetched while the current one computes; in backward
the bucket's saved weights are gathered again in one call when the first is needed, and
their gradients are reduce-scattered in one flat call per bucket, launched asynchronously
when backward moves on to another bucket and added into the shards' gradients by
`finish()` (the shard's gradient is zero until then).  One collective per bucket and
direction instead of one per weight, as FSDP does per wrapped module.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from autopar.passes.collectives import move
from autopar.passes.redistribute import redistribute_local, reduce_scatter_rows

from autopar.runtime.regions.gathered import Fetched, Gathered, GroupGathered, Recipe
from autopar.runtime.regions.recompute import in_recomputed_forward, note_saved
from autopar.runtime.state.rank_state import param_key


def offloaded_weights(plan, placeholders: dict, tied: dict) -> dict:
    """Regather's `offloaded`: placeholder -> the disk store's file name of its shard ("" in
    host memory), for the parameters `placeholders` (placeholder -> parameter name; a tied
    name is read as the name it is planned under) whose plan offloads their weights."""
    out = {}
    for ph, name in placeholders.items():
        name = tied.get(name, name)
        state = plan.param_states.get(name)
        if state is not None and state.weights:
            out[ph] = f"{param_key(name)}.weight" if state.offload == "disk" else ""
    return out


def _bucketed(order: list, flat: dict, feed: dict, groups, bucket_bytes: int) -> tuple[list, dict]:
    """Regather's buckets: consecutive groupable gathers (`flat`: gather index -> (mesh
    axis, dim)) on one mesh axis, up to bucket_bytes gathered, read from the shards `feed`
    holds for this forward; (lists of gather indices, gather index -> its bucket)."""
    buckets: list = []
    bucket_of: dict = {}
    size, axis = 0, None
    for k in range(len(order)):
        x = feed.get(order[k][0])
        if k not in flat or x is None:
            size, axis = 0, None
            continue
        full = x.numel() * x.element_size() * groups.size(flat[k][0])
        if axis != flat[k][0] or size + full > bucket_bytes or not buckets:
            buckets.append([])
            size, axis = 0, flat[k][0]
        buckets[-1].append(k)
        bucket_of[k] = len(buckets) - 1
        size += full
    return buckets, bucket_of


def _split_rows(flat: dict, members: list, shards: list, buf: torch.Tensor) -> dict:
    """Each member's whole weight from a bucket's gathered rows (its own storage)."""
    out, offset = {}, 0
    for k, t in zip(members, shards):
        dim = flat[k][1]
        n = t.numel()
        out[k] = torch.cat([row[offset: offset + n].view(t.shape) for row in buf], dim=dim)
        offset += n
    return out


class Regather:
    """Per compiled graph: what its ZeRO-3 gathers and host fetches do at run time (the
    module docstring).  The pass autopar/passes/gathers.py marks them in the graph
    (`gather(<slot>, k, param, m, groups)`, `fetch(<slot>, param)`) and returns their
    GatherSites; the runtime binds this object to the graph's GATHERS slot."""

    def __init__(self, sites, reshard_after_forward: bool, groups, bucket_bytes: int = 25 * 2**20,
                 offloaded: dict | None = None, device=None, disk=None):
        """sites: the graph's GatherSites; bucket_bytes: the most gathered bytes a bucket
        holds; offloaded: placeholder -> disk file name ("" for host memory) of the
        parameters whose stored shard lives off `device` (disk: the runtime.state.disk.DiskStore
        of those files)."""
        self.reshard = reshard_after_forward
        self.offloaded = dict(offloaded or {})
        self.device = device
        self.disk = disk
        self.off_ids: set = set()            # ids of this forward's offloaded shards (copied at each use)
        self.fetches = sites.fetches          # fetch nodes in the graph
        self.groups = groups
        self.sources: dict[int, tuple] = {}   # storage pointer of a gathered weight -> how to gather it
        self.order: list = list(sites.order)  # (placeholder name, Move, steps) of the gathers, in graph order
        self.pending: dict[int, tuple] = {}   # k -> (work, buffer) of a prefetched gather
        self.feed: dict = {}                  # placeholder name -> this forward's shard tensor
        self.active = False                   # inside forward (a recomputed layer gathers in backward too)
        # since compile: weights gathered in forward, of which prefetched, gathered again in
        # backward; collective calls of the grouped buckets (gathers, reduce-scatters)
        # (recompute_: weights a recomputed layer's backward gathered again, and the bucket
        # calls that did)
        self.counts = {"gathered": 0, "prefetched": 0, "regathered": 0, "bucket_gathers": 0, "bucket_reduces": 0,
                       "fetched": 0, "regather_prefetched": 0, "recompute_gathered": 0, "recompute_buckets": 0}
        self.flat: dict[int, tuple] = dict(sites.flat)   # k -> (mesh axis, dim) of a groupable gather
        self.bucket_bytes = bucket_bytes
        self.buckets: list | None = None     # lists of gather indices, made on the first forward
        self.bucket_of: dict[int, int] = {}
        self.ready: dict[int, torch.Tensor] = {}    # k -> its gathered weight, not yet handed out
        self.next_bucket = None                     # (bucket, work, buffer) of a prefetched bucket
        self.cached: dict[int, list] = {}           # k -> [weight gathered again in backward, uses left]
        self.packed: dict[int, list] = {}           # bucket -> [(k, shard)] the last forward saved
        self.regathered: set = set()                # buckets gathered again in this backward
        self.next_regather = None                   # (bucket, members, uses, shards, work, buffer) started ahead
        self.again: dict[int, torch.Tensor] = {}    # k -> shard of a bucketed weight a recomputed layer gathered
        self.again_ready: dict[int, torch.Tensor] = {}   # k -> that weight gathered for its recomputation
        self.again_done: set = set()                # buckets gathered for recomputation in this backward
        self.next_again = None                      # (bucket, members, shards, work, buffer) started ahead
        self.grads: list = []                       # (bucket, k, shard, full gradient) to reduce
        self.reducing: list = []                    # (work, row, [(k, shard)]) launched

    def __bool__(self) -> bool:
        return bool(self.order) or bool(self.fetches)

    # --- offloaded weights --------------------------------------------------------------------
    def device_copy(self, x: torch.Tensor, offloaded: bool = False) -> torch.Tensor:
        """x detached, on the device: an offloaded shard (one fed to this forward, or any x
        where `offloaded`) copied there (a new tensor)."""
        if offloaded or id(x) in self.off_ids:
            self.counts["fetched"] += 1
            return x.detach().to(self.device, copy=True, non_blocking=True)
        return x.detach()

    def _ahead(self, k: int) -> None:
        """Ask for the pages of the next gather's disk shard."""
        if self.disk is not None and k < len(self.order):
            name = self.offloaded.get(self.order[k][0])
            if name:
                self.disk.advise(name)

    def fetch(self, x: torch.Tensor) -> torch.Tensor:
        """An offloaded weight for a reader that takes it as stored: a copy on the device,
        fetched again in backward where forward's copies are dropped."""
        out = Fetched.apply(x, None, self.groups, self)
        if self.reshard and self.active:
            self.sources[out.untyped_storage().data_ptr()] = (x, None, out, None)
        return out

    # --- grouped buckets ----------------------------------------------------------------------
    def _launch_bucket(self, members: list, shards: list):
        """Start one flat all-gather of `shards` (the bucket's members'); (work, buffer)."""
        axis = self.flat[members[0]][0]
        flat = torch.cat([self.device_copy(t).reshape(-1) for t in shards])
        n = self.groups.size(axis)
        buf = flat.new_empty(n * flat.numel())
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = fn(buf, flat, group=self.groups.group(axis), async_op=True)
        self.counts["bucket_gathers"] += 1
        return work, buf.view(n, flat.numel())

    def _gather_bucket(self, b: int) -> None:
        members = self.buckets[b]
        shards = [self.feed[self.order[k][0]] for k in members]
        got = self.next_bucket
        self.next_bucket = None
        if got is not None and got[0] == b:
            got[1].wait()
            buf = got[2]
            self.counts["prefetched"] += len(members)
        else:
            if got is not None:
                got[1].wait()
            work, buf = self._launch_bucket(members, shards)
            work.wait()
        self.ready.update(_split_rows(self.flat, members, shards, buf))
        if self.active and b + 1 < len(self.buckets):  # the next bucket while this one computes
            nxt = self.buckets[b + 1]
            self.next_bucket = (b + 1, *self._launch_bucket(nxt, [self.feed[self.order[k][0]] for k in nxt]))

    def leaf(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """The tensor fed to gather k's placeholder (x may be an identity move of it, or a
        copy of an offloaded one): where regathers read and bucket gradients go."""
        return self.feed.get(self.order[k][0], x)

    def _grouped(self, k: int, x: torch.Tensor) -> torch.Tensor:
        if k not in self.ready:
            self._gather_bucket(self.bucket_of[k])
        self.counts["gathered"] += 1
        return GroupGathered.apply(x, self, k)

    def take(self, k: int) -> torch.Tensor:
        return self.ready.pop(k)

    def add_grad(self, k: int, x: torch.Tensor, grad: torch.Tensor) -> None:
        """A grouped weight's whole gradient; reduced with its bucket's (see finish)."""
        b = self.bucket_of[k]
        if self.grads and self.grads[-1][0] != b:
            self._reduce_waiting()
        self.grads.append((b, k, x, grad))

    def _reduce_waiting(self) -> None:
        """One flat reduce-scatter of the gradients waiting, launched asynchronously."""
        if not self.grads:
            return
        items, self.grads = self.grads, []
        axis = self.flat[items[0][1]][0]
        n = self.groups.size(axis)
        rows = [torch.cat([g.detach().chunk(n, dim=self.flat[k][1])[r].reshape(-1) for _, k, _, g in items])
                for r in range(n)]
        table = torch.stack(rows)
        work, row = reduce_scatter_rows(table, self.groups.group(axis), self.groups.coordinate(axis),
                                        async_op=True)
        self.counts["bucket_reduces"] += 1
        self.reducing.append((work, row, [(k, x) for _, k, x, _ in items]))

    @torch.no_grad()
    def finish(self) -> None:
        """After backward: every grouped gradient reduced and added to its shard's gradient."""
        self.end_backward()
        self._reduce_waiting()
        for work, row, members in self.reducing:
            if work is not None:
                work.wait()
            offset = 0
            for k, x in members:
                piece = row[offset: offset + x.numel()].view(x.shape)
                offset += x.numel()
                if x.grad is None:
                    x.grad = piece.to(x.device, x.dtype, copy=True)
                else:
                    x.grad.add_(piece.to(x.grad.device, x.grad.dtype))
        self.reducing.clear()
        self.cached.clear()

    # --- forward ----------------------------------------------------------------------------
    def gather(self, k: int, x: torch.Tensor, m, groups) -> torch.Tensor:
        """The k-th gathered weight of forward.  Outside any dispatch mode: a layer that
        selective recomputation runs again in backward is replayed op for op by its
        saved-tensor policy (runtime/regions/recompute.py), and a weight prefetched in forward is
        gathered on the spot when recomputed; the gather is not the layer's to replay."""
        with _disable_current_modes():
            return self._gather(k, x, m, groups)

    def _gather(self, k: int, x: torch.Tensor, m, groups) -> torch.Tensor:
        if self.buckets is None and self.active:
            self.buckets, bucket_of = _bucketed(self.order, self.flat, self.feed, self.groups, self.bucket_bytes)
            self.bucket_of.update(bucket_of)
        if not self.active and k in self.again:   # a recomputed layer's weight, gathered again in backward
            return self._gathered_again(k, x)
        if k in self.bucket_of and (self.active or k in self.ready):
            if self.active and in_recomputed_forward():
                self.again[k] = self.leaf(k, x)
            out = self._grouped(k, x)
            if self.reshard and self.active:
                self.sources[out.untyped_storage().data_ptr()] = (self.leaf(k, x), m, out, k)
            return out
        prefetched = self.pending.pop(k, None)
        self._prefetch(k + 1)
        self._ahead(k + 2)
        self.counts["gathered"] += 1
        if prefetched is not None:
            self.counts["prefetched"] += 1
            out = Gathered.apply(x, m, groups, prefetched)
        elif self.order[k][0] in self.offloaded:
            out = Fetched.apply(x, m, groups, self)
        else:
            out = move(x, m, groups)
        if self.reshard and self.active:  # the entry holds `out` so its memory is not reused for another
            self.sources[out.untyped_storage().data_ptr()] = (self.leaf(k, x), m, out, None)  # tensor before
            # forward ends
        return out

    def _gathered_again(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Weight k for a recomputed layer's forward run again in backward: the first of its
        bucket gathers every weight of the bucket that recomputed layers gathered in forward,
        in one call, and starts the gather of the bucket backward reaches next (the nearest
        earlier one), which runs while this layer recomputes and computes its backward.
        (Gathered one by one, in blocking calls, eager ZeRO-3 under full recomputation
        stepped at about twice its data-parallel time.)"""
        if k not in self.again_ready:
            b = self.bucket_of[k]
            pending, self.next_again = self.next_again, None
            if pending is not None and pending[0] == b:
                _, members, shards, work, buf = pending
            else:
                if pending is not None:
                    pending[3].wait()   # (started on every rank; a backward that skipped it drops it)
                members, shards = self._again_members(b)
                work, buf = self._launch_bucket(members, shards)
            self.counts["recompute_buckets"] += 1
            work.wait()
            self.again_ready.update(_split_rows(self.flat, members, shards, buf))
            self.again_done.add(b)
            earlier = {self.bucket_of[j] for j in self.again} - self.again_done
            earlier = [c for c in earlier if c < b]
            if earlier:
                nxt = max(earlier)
                members, shards = self._again_members(nxt)
                self.next_again = (nxt, members, shards, *self._launch_bucket(members, shards))
                self.counts["regather_prefetched"] += 1
        self.counts["gathered"] += 1
        self.counts["recompute_gathered"] += 1
        self.ready[k] = self.again_ready.pop(k)
        return GroupGathered.apply(x, self, k)

    def _again_members(self, b: int) -> tuple:
        members = [j for j in self.buckets[b] if j in self.again]
        return members, [self.again[j] for j in members]

    def _prefetch(self, k: int) -> None:
        if k >= len(self.order) or k in self.pending:
            return
        name, m, steps = self.order[k]
        x = self.feed.get(name)
        if x is None or len(steps) != 1:
            return
        step = steps[0]
        group = self.groups.group(step.axis)
        n = self.groups.size(step.axis)
        inp = self.device_copy(x).movedim(step.dim, 0).contiguous()
        buf = inp.new_empty((n * inp.shape[0],) + tuple(inp.shape[1:]))
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = fn(buf, inp, group=group, async_op=True)
        self.pending[k] = (work, buf, step.dim)

    @contextlib.contextmanager
    def forward(self, feed: dict):
        """Around one forward: `feed` maps placeholder names to the tensors fed to them."""
        self.feed = feed
        self.active = True
        self.off_ids = {id(feed[name]) for name in self.offloaded if name in feed}
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack) if self.reshard \
            else contextlib.nullcontext()
        self.end_backward()   # (a regather started ahead by a backward that ended early)
        self.cached.clear()
        self.again.clear()
        self.packed = {}
        try:
            with hooks:
                yield
        finally:
            for work, _, _ in self.pending.values():
                work.wait()
            if self.next_bucket is not None:
                self.next_bucket[1].wait()
                self.next_bucket = None
            self.pending.clear()
            self.ready.clear()
            self.sources.clear()
            self.feed = {}
            self.active = False

    # --- saved tensors ----------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        source = self.sources.get(t.untyped_storage().data_ptr())
        if source is None:
            note_saved(t)
            return t
        x, m, _, k = source
        if k is not None:
            self.packed.setdefault(self.bucket_of[k], []).append((k, x))
        return Recipe(x, m, self.groups, t.size(), t.stride(), t.storage_offset(), k)

    def _unpack(self, packed):
        if not isinstance(packed, Recipe):
            return packed
        self.counts["regathered"] += 1
        if packed.m is None:   # an offloaded weight fetched as stored
            full = self.device_copy(packed.x)
        elif packed.k is None:
            full = redistribute_local(self.device_copy(packed.x), packed.m.src, packed.m.dst, packed.groups)
        else:
            full = self._regathered(packed.k)
        return full.as_strided(packed.size, packed.stride, packed.offset)

    def _regathered(self, k: int) -> torch.Tensor:
        """Weight k gathered again in backward: the first of its bucket to be unpacked
        gathers every weight of the bucket that forward saved, in one call, and starts the
        gather of the bucket backward reaches next (the nearest earlier one forward saved),
        which runs while this one's backward computes."""
        if k not in self.cached:
            b = self.bucket_of[k]
            pending, self.next_regather = self.next_regather, None
            if pending is not None:   # prefetched: this bucket's, or one backward skipped (kept for its turn)
                self._cache_bucket(*pending)
            if k not in self.cached:
                self._cache_bucket(b, *self._launch_regather(b))
            earlier = [j for j in self.packed if j < b and j not in self.regathered]
            if earlier:
                nxt = max(earlier)
                self.next_regather = (nxt, *self._launch_regather(nxt))
                self.counts["regather_prefetched"] += 1
        entry = self.cached[k]
        entry[1] -= 1
        if entry[1] <= 0:
            del self.cached[k]
        return entry[0]

    def _launch_regather(self, b: int) -> tuple:
        """Start the gather of every weight of bucket b that forward saved; (members, uses,
        shards, work, buffer)."""
        saved = self.packed.get(b, [])
        members = list(dict.fromkeys(j for j, _ in saved))
        shard = dict(saved)
        uses = {j: sum(1 for i, _ in saved if i == j) for j in members}
        self.regathered.add(b)
        return (members, uses, [shard[j] for j in members], *self._launch_bucket(members, [shard[j] for j in members]))

    def _cache_bucket(self, b: int, members: list, uses: dict, shards: list, work, buf) -> None:
        """Wait for bucket b's regather and keep each weight for its uses."""
        work.wait()
        for j, t in _split_rows(self.flat, members, shards, buf).items():
            self.cached[j] = [t, uses[j]]

    def end_backward(self) -> None:
        """After backward: a regather started for a bucket backward never reached is waited
        for (every rank issued it) and dropped."""
        if self.next_regather is not None:
            self.next_regather[4].wait()
            self.next_regather = None
        self.regathered.clear()
        if self.next_again is not None:
            self.next_again[3].wait()
            self.next_again = None
        self.again_ready.clear()
        self.again_done.clear()
