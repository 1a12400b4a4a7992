"""compile's run-time settings, checked once and handed to what it builds."""
from __future__ import annotations

from dataclasses import dataclass

from autopar.runtime.checks.faults import DEFAULT_TIMEOUT_S
from autopar.runtime.checks.inputs import CHECKED_CALLS, SAMPLE_EVERY


@dataclass(frozen=True)
class RunOptions:
    """How a compiled model runs, as autopar.compile's keywords say (compiled.check_timeout
    and check_options have checked them): the collective timeout, the finite check, the
    input checks (runtime/inputs.InputCheck), the gradient bucket size (runtime/grad_sync.py),
    whether ZeRO-3 weights are gathered again in backward (runtime/reshard.py), the directory
    of the disk tier (runtime/disk.py) and how the
    rank's graph runs: op by op ("eager") or in Inductor-compiled regions (runtime/inductor.py)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    check_finite: bool = True
    compared_calls: int = CHECKED_CALLS   # compile(check_inputs=...)
    sample_every: int = SAMPLE_EVERY      # compile(check_inputs_every=...)
    bucket_mb: float = 25.0
    reshard_after_forward: bool = True
    backend: str = "eager"                # compile(backend=...): runtime/inductor.py
    offload_dir: str | None = None        # compile(offload_dir=...): where disk-tier states live (runtime/disk.py)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    def __str__(self) -> str:
        return (f"RunOptions(timeout {self.timeout_s:g} s, check_finite={self.check_finite}, inputs compared for "
                f"{self.compared_calls} calls then every {self.sample_every}th, buckets of {self.bucket_mb:g} MiB, "
                f"reshard_after_forward={self.reshard_after_forward}, backend={self.backend})")
