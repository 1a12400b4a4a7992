"""How a compiled model runs (autopar.compile(run=RunOptions(...))), each value checked where
the record is made, and handed whole to what compile builds."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from autopar.report.records import check_backend
from autopar.runtime.checks.faults import DEFAULT_TIMEOUT_S
from autopar.runtime.checks.inputs import CHECKED_CALLS, SAMPLE_EVERY

# timeout's least value.  The timeout bounds every wait of a collective for its slowest
# peer, compile's own included: setting up the gloo or NCCL groups of the mesh, and
# waiting at compile's first collective for the ranks that trace the model more slowly,
# take seconds.  Below a second nothing but a mistaken unit (milliseconds) is plausible.
MIN_TIMEOUT_S = 1.0

AUTO = "auto"   # RunOptions(backend=...)'s default: compiled.auto_backend chooses


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a compiled model runs (autopar.compile(run=...)).

    timeout: seconds any collective may wait (every process group of the job, compile's
    own included): a stalled rank ends every rank with a CollectiveError naming the
    collective (autopar/runtime/checks/faults.py).  At least MIN_TIMEOUT_S (1 s); a minute or more
    leaves room for ranks that load data or evaluate at different speeds.
    check_finite: train_step raises NonFiniteError on every rank when the loss or a
    gradient is NaN or infinite (one scalar all-reduce per step; cm.check_finite switches
    it later).
    check_inputs: during the first this many calls the ranks compare a hash of their inputs
    (autopar/runtime/checks/inputs.py): without local_inputs every rank must pass the same global
    batch (0 turns it off).  check_inputs_every: after those, every this many-th call's
    inputs are compared by a hash that rides in the step's NaN-check all-reduce (0: off).
    local_inputs: the compiled module takes each rank's own shard of every input (laid out
    as `cm.input_layouts` says, see `cm.shard_inputs`) instead of the global batch.
    bucket_mb: the gradient bucket size (runtime/grads/sync.py; 25 is DDP's default).
    reshard_after_forward: ZeRO-3 weights gathered for forward are dropped and gathered
    again in backward (False: kept from forward to backward, one gather fewer).
    backend: "eager" runs the rank's graph op by op; "inductor" compiles its compute
    between collectives with torch.compile (autopar/runtime/regions/inductor.py: results match
    eager to float rounding, not bit for bit); "auto" (the default) takes Inductor on GPUs
    and eager on CPU ranks and for split-backward schedules (compiled.auto_backend).
    offload_dir: a directory on a local disk (NVMe) where a plan that keeps optimizer
    states on disk writes them (autopar/runtime/state/disk.py); None: $AUTOPAR_OFFLOAD_DIR."""

    timeout: float = DEFAULT_TIMEOUT_S
    check_finite: bool = True
    check_inputs: int = CHECKED_CALLS
    check_inputs_every: int = SAMPLE_EVERY
    local_inputs: bool = False
    bucket_mb: float = 25.0
    reshard_after_forward: bool = True
    backend: str = AUTO
    offload_dir: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "timeout", _checked_timeout(self.timeout))
        check_backend(self.backend, auto=True, where="autopar.RunOptions")
        bucket = self.bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, numbers.Real) or not math.isfinite(bucket) or bucket <= 0:
            raise ValueError(f"autopar.RunOptions(bucket_mb={bucket!r}): the gradient bucket size must be a positive "
                             f"number of MiB (25 is DDP's default; larger buckets mean fewer, later all-reduces)")
        for name, what in (("check_inputs", "how many first calls compare every input's hash"),
                           ("check_inputs_every", "after those, every how many calls one is compared")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"autopar.RunOptions({name}={value!r}): {what}; a whole number of at least 0 "
                                 f"(0 turns it off)")
        for name in ("check_finite", "local_inputs", "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"autopar.RunOptions({name}={getattr(self, name)!r}): True or False")
        if self.offload_dir is not None:
            object.__setattr__(self, "offload_dir", str(self.offload_dir))

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def __str__(self) -> str:
        return (f"RunOptions(timeout {self.timeout:g} s, check_finite={self.check_finite}, inputs compared for "
                f"{self.check_inputs} calls then every {self.check_inputs_every}th, buckets of {self.bucket_mb:g} "
                f"MiB, reshard_after_forward={self.reshard_after_forward}, backend={self.backend})")


def _checked_timeout(timeout) -> float:
    """RunOptions.timeout in seconds, or ValueError saying what it bounds and what to give."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout):
        problem = "not a finite number of seconds"
    elif timeout < MIN_TIMEOUT_S:
        problem = f"under the least timeout, {MIN_TIMEOUT_S:g} s"
    else:
        return float(timeout)
    raise ValueError(f"autopar.RunOptions(timeout={timeout!r}): {problem}. The timeout bounds how long every "
                     f"collective waits for the slowest rank, compile's own included (setting up the gloo or NCCL "
                     f"process groups and waiting for ranks that trace the model more slowly take seconds); give "
                     f"timeout=60 or more (the default is {DEFAULT_TIMEOUT_S:g})")
