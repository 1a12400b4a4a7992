"""Chimera's two pipelines, run by autopar (torch.distributed.pipelining runs one chain of
stages; Chimera runs two in opposite directions over the same device groups).

Placement.  With p device groups (p even) and p stages, group g runs stage g of the down
pipeline (chunk 0) and stage p-1-g of the up pipeline (chunk 1): every stage is held by two
groups, g and p-1-g, whose gradients of it are summed after the step (the runner's tied
weights, autopar/runtime/pipeline/pipelined.py).  Of every p microbatches the first p/2 run down the
groups and the rest up (cost.schedules.chimera_orders, which also gives each rank's order of
forward and backward passes; the same order the simulator prices).

Messages.  A forward pass sends its stage's outputs to the next group of its pipeline: a
header (each tensor's dtype and shape) and the tensors.  A backward pass sends the
gradients of the floating-point tensors its stage received (zeros where a tensor took no
part in the loss) back to the previous group.  Sends are posted without waiting and waited
for at the end of the step; a pass waits only for the messages it needs.  Messages carry a
tag naming (pass, microbatch, chunk, tensor), so the order in which a group receives need
not match the order in which its neighbour sent (gloo); NCCL ignores tags, so there the
schedule is checked at construction to receive from every neighbour in the order it sends
(check_order).

Timing.  With `events` set to a list, each pass appends an Event of its compute (after
its inputs arrived, before its sends): what runtime.pipeline.pass_times reads, as it reads the
passes of torch's schedules.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from autopar.cost.schedules import Event, chimera_orders
from autopar.runtime.process import CompileError

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64)
MAX_DIMS = 8
HEADER = 127   # the tensor index of a message's header in its tag


def peer_of(group: int, chunk: int, direction: int) -> int:
    """The device group one stage further (direction +1) or back (-1) along chunk's
    pipeline: down (chunk 0) goes to group + 1, up (chunk 1) to group - 1."""
    return group + direction * (1 if chunk == 0 else -1)


def stage_of(group: int, chunk: int, n_groups: int) -> int:
    return group if chunk == 0 else n_groups - 1 - group


def _tag(kind: str, m: int, chunk: int, i: int) -> int:
    return (((m * 2 + chunk) * 2 + (kind == "B")) << 7) + i


def check_order(n_groups: int, n_mb: int) -> None:
    """Raise CompileError unless every group receives from each neighbour in the order that
    neighbour sends (what a backend without tags needs)."""
    orders = chimera_orders(n_groups, n_mb)
    sent: dict = {}
    needed: dict = {}
    for g, order in enumerate(orders):
        for kind, m, c in order:
            k = stage_of(g, c, n_groups)
            if kind == "F" and k < n_groups - 1:
                sent.setdefault((g, peer_of(g, c, 1)), []).append(("F", m, c))
            if kind == "B" and k > 0:
                sent.setdefault((g, peer_of(g, c, -1)), []).append(("B", m, c))
            if kind == "F" and k > 0:
                needed.setdefault((peer_of(g, c, -1), g), []).append(("F", m, c))
            if kind == "B" and k < n_groups - 1:
                needed.setdefault((peer_of(g, c, 1), g), []).append(("B", m, c))
    for pair, messages in sent.items():
        if needed.get(pair) != messages:
            raise CompileError(f"chimera on {n_groups} device groups with {n_mb} microbatches: group {pair[1]} "
                               f"receives from group {pair[0]} in another order than it sends, which NCCL (no "
                               f"message tags) cannot match; use another microbatch count or schedule")


class StagePasses:
    """This rank's stage modules (_StageModules of autopar/runtime/pipeline/pipelined.py; chunk c is
    modules[c]) with the passes and messages a schedule autopar runs itself is made of:
    forward and backward of one microbatch on one chunk, the tagged sends between groups.
    loss_fn(output) -> a microbatch's loss, already divided by the microbatch count;
    n_received: per chunk, how many tensors its stage receives."""

    def __init__(self, modules: list, group: int, n_groups: int, n_mb: int, pp_group, device, loss_fn,
                 n_received: list):
        self.modules = modules
        self.group, self.n_groups, self.n_mb = group, n_groups, n_mb
        self.pp_group, self.device, self.loss_fn = pp_group, device, loss_fn
        self.n_received = n_received
        self.events: list | None = None   # a list: each pass's compute appended as a cost.schedules.Event
        self.sends: list = []             # (work, tensor) of sends not yet waited for
        self.saved: dict = {}             # (tag index, chunk) -> (received, outputs) for its backward
        self.losses: list = []

    def _last(self, chunk: int) -> bool:
        return stage_of(self.group, chunk, self.n_groups) == self.n_groups - 1

    def _first(self, chunk: int) -> bool:
        return stage_of(self.group, chunk, self.n_groups) == 0

    # --- messages ------------------------------------------------------------------------------
    def _isend(self, t: torch.Tensor, peer: int, tag: int) -> None:
        t = t.detach().contiguous()
        self.sends.append((dist.isend(t, group=self.pp_group, group_dst=peer, tag=tag), t))

    def _recv(self, buf: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        dist.recv(buf, group=self.pp_group, group_src=peer, tag=tag)
        return buf

    def _send_activations(self, outputs: tuple, m: int, chunk: int) -> None:
        peer = peer_of(self.group, chunk, 1)
        header = torch.zeros(len(outputs), 2 + MAX_DIMS, dtype=torch.int64)
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor):
                raise CompileError(f"stage {stage_of(self.group, chunk, self.n_groups)} passes a {type(t).__name__} "
                                   f"to the next stage; chimera sends tensors only")
            if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
                raise CompileError(f"stage output {i} of shape {tuple(t.shape)} and dtype {t.dtype} cannot be sent "
                                   f"(at most {MAX_DIMS} dimensions, dtypes {DTYPES})")
            header[i, 0], header[i, 1] = DTYPES.index(t.dtype), t.dim()
            header[i, 2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        self._isend(header.to(self.device), peer, _tag("F", m, chunk, HEADER))
        for i, t in enumerate(outputs):
            self._isend(t, peer, _tag("F", m, chunk, i))

    def _recv_activations(self, m: int, chunk: int) -> list:
        peer = peer_of(self.group, chunk, -1)
        header = self._recv(torch.empty(self.n_received[chunk], 2 + MAX_DIMS, dtype=torch.int64, device=self.device),
                            peer, _tag("F", m, chunk, HEADER)).tolist()
        out = []
        for i, (code, ndim, *dims) in enumerate(header):
            t = self._recv(torch.empty(dims[:ndim], dtype=DTYPES[code], device=self.device), peer,
                           _tag("F", m, chunk, i))
            out.append(t.requires_grad_(t.is_floating_point()))
        return out

    # --- passes --------------------------------------------------------------------------------
    def _forward(self, m: int, chunk: int, microbatches: list, train: bool) -> None:
        received = [] if self._first(chunk) else self._recv_activations(m, chunk)
        start = time.perf_counter()
        out = self.modules[chunk](*received, **microbatches[m])
        if self._last(chunk):
            loss = self.loss_fn(out)
            self._record("F", m, chunk, start)
            self.losses.append(loss.detach())
            if train:
                self.saved[m, chunk] = (received, (loss,))
            return
        outputs = out if isinstance(out, tuple) else (out,)
        self._record("F", m, chunk, start)
        self._send_activations(outputs, m, chunk)
        if train:
            self.saved[m, chunk] = (received, outputs)

    def _backward(self, m: int, chunk: int) -> None:
        received, outputs = self.saved.pop((m, chunk))
        if self._last(chunk):
            start = time.perf_counter()
            outputs[0].backward()
        else:
            peer = peer_of(self.group, chunk, 1)
            pairs = []
            for i, t in enumerate(outputs):
                if not t.is_floating_point():
                    continue
                grad = self._recv(torch.empty(t.shape, dtype=t.dtype, device=self.device), peer, _tag("B", m, chunk, i))
                if t.requires_grad:
                    pairs.append((t, grad))
            start = time.perf_counter()
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self._record("B", m, chunk, start)
        if not self._first(chunk):
            peer = peer_of(self.group, chunk, -1)
            for i, t in enumerate(received):
                if t.is_floating_point():
                    self._isend(t.grad if t.grad is not None else torch.zeros_like(t), peer, _tag("B", m, chunk, i))

    def _record(self, kind: str, m: int, chunk: int, start: float) -> None:
        if self.events is not None:
            self.events.append(Event(self.group, kind, m, chunk, start, time.perf_counter()))


class TwoWaySchedule(StagePasses):
    """Runs this rank's chunks of a chimera plan: modules[0] is stage `group` of the down
    pipeline, modules[1] stage n_groups-1-group of the up pipeline."""

    def __init__(self, modules: list, group: int, n_groups: int, n_mb: int, pp_group, device, loss_fn,
                 n_received: list):
        if n_groups % 2 or n_mb % n_groups:
            raise CompileError(f"chimera runs an even number of device groups and a multiple of them as "
                               f"microbatches; the plan has {n_groups} groups and {n_mb} microbatches: plan again")
        if dist.get_backend(pp_group) == "nccl":
            check_order(n_groups, n_mb)
        super().__init__(modules, group, n_groups, n_mb, pp_group, device, loss_fn, n_received)
        self.order = chimera_orders(n_groups, n_mb)[group]

    def step(self, inputs: dict, train: bool = True) -> list:
        """One step over the global batch `inputs` (keyword tensors split into n_mb
        microbatches along dimension 0): this rank's passes in the schedule's order.
        Returns the losses this rank computed (its chunks that end a pipeline)."""
        _, microbatches = split_args_kwargs_into_chunks((), inputs, self.n_mb)
        self.sends: list = []
        self.saved: dict = {}
        self.losses: list = []
        try:
            for kind, m, chunk in self.order:
                if kind == "F":
                    self._forward(m, chunk, microbatches, train)
                elif train:
                    self._backward(m, chunk)
            for work, _ in self.sends:
                work.wait()
        finally:
            self.sends, self.saved = [], {}
        return self.losses
