"""Faults end cleanly: a collective timeout every process group honours, errors that say
which collective stalled, and the check that a step's loss and gradients are finite.

Timeouts.  `set_timeout(seconds)` gives the default process group and every group made
from it (the device meshes' axes) the same collective timeout.  A rank that stalls (a
hung data loader, a deadlock, a dead host that never closes its sockets) then ends every
other rank after `seconds` with a `CollectiveError` naming the timeout, the collective
and the code that called it, instead of the backend's default (30 minutes for gloo).
torchrun ends the stalled rank when the others exit.

Finite steps.  `check_step(model, loss, step)` costs one scalar all-reduce per step: every
rank reduces its loss and the norms of its gradient pieces (torch._foreach_norm; after a
synchronised step each all-reduced bucket is read whole, GradSync.checked_pieces) into one
flag, all-reduced with MAX so that every rank decides alike.  The all-reduce is left out
only where every rank's own values are provably everyone's (`seen_alike`: the loss and
every gradient summed over all ranks, as in data parallelism); a plan that computes the
same values on several ranks without summing them (the solver's replicated plans, tensor
parallelism's replicated weights) needs it, since a NaN on one replica is that rank's
alone.  When any is NaN or infinite, every rank raises `NonFiniteError` with the step, the
loss, the ranks that saw it and the first parameter (in the model's order) whose gradient
is not finite, found on whichever rank holds it.  The same all-reduce carries the hashes of
a sampled call's inputs (runtime/checks/inputs.InputCheck), so that check costs no collective of
its own on such steps.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from autopar.runtime.grads.norms import local_grads

DEFAULT_TIMEOUT_S = 600.0   # RunOptions(timeout=...)'s default: torch's gloo default is 30 minutes

_TIMED_OUT = ("timed out", "timeout", "deadline exceeded")
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


class CollectiveError(RuntimeError):
    """A collective did not finish: no answer within compile's timeout (another rank stalled
    or died without closing its connections), or a peer rank closed its connection."""


class NonFiniteError(FloatingPointError):
    """A training step produced a NaN or infinite loss or gradient."""


def set_timeout(seconds: float) -> None:
    """Every process group this rank belongs to waits at most `seconds` for a collective."""
    if seconds is None or not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {seconds!r}")
    if not hasattr(c10d, "_set_pg_timeout"):
        return   # (torch < 2.5: the process group keeps the timeout it was made with)
    delta = datetime.timedelta(seconds=float(seconds))
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(delta, group)


def _collective_of(exc: BaseException) -> str:
    """The torch.distributed call the error came out of and the autopar code that made it,
    read from the traceback: 'torch.distributed.all_gather called by all_gather_dim
    (autopar/passes/redistribute.py:117)'."""
    frames = traceback.extract_tb(exc.__traceback__)

    def where(f) -> str:
        return f"{f.name} ({'/'.join(f.filename.replace(os.sep, '/').split('/')[-2:])}:{f.lineno})"

    inside = [k for k, f in enumerate(frames) if "/torch/distributed/" in f.filename.replace(os.sep, "/")]
    if not inside or inside[0] == 0:   # (an asynchronous call's Work.wait(): no Python frame inside torch)
        return f"torch.distributed.Work.wait() on an asynchronous collective in {where(frames[-1])}" if frames \
            else "a collective"
    c10d_calls = [frames[k].name for k in inside if frames[k].filename.endswith("distributed_c10d.py")]
    call = c10d_calls[0] if c10d_calls else frames[inside[-1]].name
    return f"torch.distributed.{call} called by {where(frames[inside[0] - 1])}"


def is_collective_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, getattr(dist, "DistError", ())) or any(s in text for s in _TIMED_OUT + _PEER_GONE)


@contextlib.contextmanager
def collectives_named(what: str, timeout_s: float | None):
    """Re-raise a collective's timeout (or a peer's disconnection) inside the block as a
    CollectiveError that says what was running (`what`: 'step 12 (forward, backward,
    gradient synchronisation)'), which collective, the timeout and what to do."""
    try:
        yield
    except CollectiveError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend error type: we re-raise all others unchanged
        if not is_collective_failure(exc):
            raise
        text = str(exc).lower()
        limit = f"{timeout_s:g} s" if timeout_s else "the process group's timeout"
        if any(s in text for s in _PEER_GONE) and not any(s in text for s in _TIMED_OUT):
            cause = ("another rank closed its connection (it crashed or exited): its own error, or "
                     "torchrun's report of its exit code, says why")
        else:
            cause = (f"no answer within the collective timeout of {limit}: another rank stalled or died. Raise "
                     f"autopar.compile(..., run=autopar.RunOptions(timeout=seconds)) if a rank is legitimately slow "
                     f"(a long checkpoint or evaluation on one rank), else look for the rank that stalled")
        raise CollectiveError(
            f"rank {dist.get_rank()}: {_collective_of(exc)} failed during {what}: {cause}. Every rank of the "
            f"job stops; torchrun --max-restarts starts it again (resume from autopar.checkpoint.latest). "
            f"Backend error: {str(exc).strip()[:300]}") from exc


def seen_alike(model) -> bool:
    """Whether every rank's own finite check reads the same values, so that the flag needs no
    all-reduce: the step summed the loss over every mesh axis of more than one rank, and every
    trained gradient is whole here and was all-reduced over all those axes (data parallelism,
    ZeRO-1).  A NaN anywhere then reaches every rank through those sums.  Not so where some
    rank computes a value the others never add in: a plan that runs the whole step on every
    rank with no gradient sum (the solver's choice for small models), gradients reduced
    inside backward over some axes only (the others compute them again, each for itself),
    shards, ZeRO-2 chunks, pipeline stages, or a step under no_sync."""
    sync = model.grad_sync
    if model.runner.pipelined or sync.pieces or not sync.enabled:
        return False
    axes = {a for a in range(model.groups.ndim) if model.groups.size(a) > 1}
    if not axes:
        return True
    if not axes <= set(getattr(model.runner, "loss_axes", ())):
        return False
    return all(key in sync.params and axes <= set(sync.axes[key])
               for key, p in model.shards.items() if p.requires_grad)


def check_step(model, loss: torch.Tensor, step: int, finite: bool = True, sample=None) -> None:
    """After a train step: raise NonFiniteError on every rank when the loss or any gradient
    piece of any rank is NaN or infinite (`finite`; see the module docstring), and compare the
    ranks' inputs of a sampled call (`sample`, runtime/checks/inputs.InputSample: InputError on every
    rank when they differ).  One all-reduce (MAX) at most, made only when one of them needs
    it: the flag alone (one float64) where `seen_alike` is False; on a sampled call the
    input hash slots with the flag carried in them (two float64 without local_inputs, see
    InputCheck.slots).  A non-finite step costs a second one (MIN) that names the first
    parameter with a non-finite gradient on whichever rank holds it, and the ranks that saw
    non-finite values."""
    device = loss.device
    flag = torch.zeros(1, dtype=torch.float64, device=device)
    if finite:
        total = loss.detach().double().reshape(()).clone()
        grads = model.grad_sync.checked_pieces(list(local_grads(model.rank_state)))
        if grads:
            norms = torch._foreach_norm([g.detach() for g in grads])
            total = total + torch.stack([n.double().to(device) for n in norms]).sum()
        flag[0] = (~torch.isfinite(total)).double()   # 1 where this rank saw a non-finite value
    check = model.io.check
    if sample is not None:   # the flag rides in the slots (InputCheck.slots): still one call
        reduced = check.slots(sample, device, carry=flag if finite else None)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        read = check.read(reduced)
        if not read.same_inputs:   # (False, or hidden by the flag: the ranks compare whole)
            check.compare(sample)   # InputError on every rank when they differ: it explains the rest
        bad = read.carried
    elif finite and not seen_alike(model):
        reduced = flag.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        bad = reduced.item() != 0
    else:   # every rank sees the same values: its own check is everyone's, at no collective more than DDP's
        bad = finite and flag.item() != 0
    if not bad:
        return
    # which ranks saw what, and the first parameter (in the model's order) with a non-finite
    # gradient on any rank: one MIN all-reduce of [first, -(loss non-finite), -(any) per rank]
    world, rank = dist.get_world_size(), dist.get_rank()
    order = {name: k for k, name in enumerate(model.parameter_order())}
    mine = [order.get(model.name_of[key], math.inf) for key, g in local_grads(model.rank_state)
            if not bool(torch.isfinite(g).all())]
    told = torch.zeros(1 + 2 * world, dtype=torch.float64, device=device)
    told[0] = min(mine, default=math.inf)
    told[1 + rank] = -float(not bool(torch.isfinite(loss.detach()).all()))
    told[1 + world + rank] = -flag[0].item()
    dist.all_reduce(told, op=dist.ReduceOp.MIN)
    first = told[0].item()
    bad_loss = [r for r in range(world) if told[1 + r].item() < 0]
    seen_on = [r for r in range(world) if told[1 + world + r].item() < 0]
    names = model.parameter_order()
    where = (f"the first parameter with a non-finite gradient is {names[int(first)]!r}" if math.isfinite(first)
             else "every gradient is finite")
    what = f"not finite on rank(s) {_ranks(bad_loss)}" if bad_loss else f"{loss.item():g}"
    raise NonFiniteError(
        f"step {step}: the loss is {what} and {where} (non-finite values seen on rank(s) {_ranks(seen_on)} of "
        f"{world}). The optimizer has not stepped: skip this batch (opt.zero_grad() and go on), lower the learning "
        f"rate or look for the cause (a log of 0, a division by a zero norm, fp16 overflow). "
        f"compile(..., run=RunOptions(check_finite=False)) turns this check off")


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)})"
