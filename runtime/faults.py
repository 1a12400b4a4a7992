"""Faults end cleanly: a collective timeout every process group honours, errors that say
which collective stalled, and the check that a step's loss and gradients are finite.

Timeouts.  `set_timeout(seconds)` gives the default process group and every group made
from it (the device meshes' axes) the same collective timeout.  A rank that stalls (a
hung data loader, a deadlock, a dead host that never closes its sockets) then ends every
other rank after `seconds` with a `CollectiveError` naming the timeout, the collective
and the code that called it, instead of the backend's default (30 minutes for gloo).
torchrun ends the stalled rank when the others exit.

Finite steps.  `check_finite(model, loss, step)` costs one scalar all-reduce per step: every
rank reduces its loss and the norms of its gradient pieces (torch._foreach_norm) into one
flag (none where every gradient is whole and already all-reduced, as in data parallelism:
every rank then sees the same values).  When any is NaN or infinite, every rank raises `NonFiniteError` with the step, the
loss and the first parameter (in the model's order) whose gradient is not finite, found on
whichever rank holds it.
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

DEFAULT_TIMEOUT_S = 600.0   # compile(timeout=...)'s default: torch's gloo default is 30 minutes

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
    (passes/redistribute.py:117)'."""
    frames = traceback.extract_tb(exc.__traceback__)

    def where(f) -> str:
        return f"{f.name} ({'/'.join(f.filename.replace(os.sep, '/').split('/')[-2:])}:{f.lineno})"

    inside = [k for k, f in enumerate(frames) if "/torch/distributed/" in f.filename.replace(os.sep, "/")]
    if not inside or inside[0] == 0:
        return where(frames[-1]) if frames else "a collective"
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
                     f"autopar.compile(..., timeout=seconds) if a rank is legitimately slow (a long "
                     f"checkpoint or evaluation on one rank), else look for the rank that stalled")
        raise CollectiveError(
            f"rank {dist.get_rank()}: {_collective_of(exc)} failed during {what}: {cause}. Every rank of the "
            f"job stops; torchrun --max-restarts starts it again (resume from autopar.checkpoint.latest). "
            f"Backend error: {str(exc).strip()[:300]}") from exc


def check_finite(model, loss: torch.Tensor, step: int) -> None:
    """Raise NonFiniteError on every rank when the loss or any gradient piece of any rank is
    NaN or infinite (see the module docstring).  One all-reduce of one scalar."""
    grads = [g for _, g in model.local_grads()]
    device = loss.device
    total = loss.detach().float().reshape(()).clone()
    if grads:
        norms = torch._foreach_norm([g.detach() for g in grads])
        total = total + torch.stack([n.float().to(device) for n in norms]).sum()
    flag = (~torch.isfinite(total)).to(torch.float32)   # 1 where this rank saw a non-finite value
    if model.grad_sync.pieces or model.runner.pipelined:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    # (else every gradient is whole and all-reduced, the loss summed: every rank sees the same
    # values, so its own check is everyone's and the step needs no collective more than DDP's)
    if flag.item() == 0:
        return
    order = {name: k for k, name in enumerate(model.parameter_order())}
    mine = [order.get(model.name_of[key], math.inf) for key, g in model.local_grads()
            if not bool(torch.isfinite(g).all())]
    first = torch.tensor([min(mine, default=math.inf)], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    names = model.parameter_order()
    where = (f"the first parameter with a non-finite gradient is {names[int(first.item())]!r}"
             if math.isfinite(first.item()) else "every gradient is finite")
    raise NonFiniteError(
        f"step {step}: the loss is {loss.item():g} and {where}. The optimizer has not stepped: skip this "
        f"batch (opt.zero_grad() and go on), lower the learning rate or look for the cause (a log of 0, a "
        f"division by a zero norm, fp16 overflow). compile(..., check_finite=False) turns this check off")
