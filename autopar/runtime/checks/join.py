"""Uneven data under `cm.join()`: the flag every step of the block sums over all ranks, so
that when one rank runs out of batches the others stop at the same step (UnevenInputs)
instead of waiting forever in a collective their finished peer never enters.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("autopar")


class UnevenInputs(RuntimeError):
    """Inside `cm.join()`, some rank ran out of batches while this one still had some: every
    rank with batches left stops at the same step with this error (instead of waiting
    forever in a collective its finished peer never enters)."""


class Join:
    """One compiled model's join state: whether a `cm.join()` block is open on this rank and
    how many steps it has run.  device: where the flags are summed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.joined = False
        self.steps = 0

    @contextlib.contextmanager
    def block(self, model):
        """The `cm.join()` block (runtime/model.CompiledModel.join); yields `model`."""
        self.steps = 0
        self.joined = True
        try:
            yield model
        except BaseException:
            self.joined = False
            raise
        self.joined = False
        flag = torch.zeros((), dtype=torch.int64, device=self.device)
        dist.all_reduce(flag)  # pairs with the flag of a peer's next step (0: they are done too)
        if flag.item():
            log.warning("rank %d ran out of batches after %d steps; %d rank(s) had more and stopped",
                        dist.get_rank(), self.steps, flag.item())

    def check(self) -> None:
        """At the start of a step: inside a block, sum this rank's flag (1: it has a batch)
        with its peers'; UnevenInputs on every rank with a batch where some rank has none."""
        if not self.joined:
            return
        flag = torch.ones((), dtype=torch.int64, device=self.device)
        dist.all_reduce(flag)
        if flag.item() < dist.get_world_size():
            self.joined = False
            raise UnevenInputs(f"{dist.get_world_size() - flag.item()} rank(s) ran out of batches before step "
                               f"{self.steps} of this cm.join() block while rank {dist.get_rank()} had "
                               f"more; every rank with batches left stopped here. Catch "
                               f"autopar.runtime.compiled.UnevenInputs to end the epoch, or give every rank the "
                               f"same number of batches (DistributedSampler(..., drop_last=True))")
        self.steps += 1
