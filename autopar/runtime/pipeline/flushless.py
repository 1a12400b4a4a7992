"""PipeDream-2BW: 1F1B over a stream of steps that never flushes, weights one step stale.

The update rule (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
Training"): W(t+1) = W(t) - lr grad f_t(W(t-1)), each step's gradient taken at the weights
one update older than those it updates.  That staleness is what lets the next step's
forwards start before this step's backwards end: they do not need this step's update.

How it runs under `cm.train_step` + `optimizer.step()`.  Rank r of p (stage r; one stage
per device group) runs, for the B >= p microbatches j of step k (global index kB + i),
F(j) and then B(j - (p-r-1)): the steady state of 1F1B, whose backwards trail its
forwards by p-r-1 microbatches.  So step k runs every forward of its own microbatches
(the loss it returns is step k's) and the backwards of step k-1's last p-r-1 microbatches
and of step k's first B-(p-r-1): when it returns, step k-1's gradient is complete on every
stage and is what `.grad` holds for the optimizer step that follows; step k's partial
gradient waits in its weight version.  The first step's `.grad` is None (no step is
complete: torch optimizers skip such parameters); `cm.drain()` runs the backwards still
pending (the last step's) and leaves its gradient in `.grad`, after which the stream
starts again with a warm-up.

Weight versions.  A step's forwards read a copy of the weights taken when the step
starts (the optimizer updates the live ones in place while the step's last backwards are
still to run); its backwards accumulate into that copy's gradients, moved to the live
weights when the step completes.  Between steps the rank holds the live weights and one
version; during a step, two.

Equal to one device?  Not to plain training: the test compares with a one-device
reference of the same rule (tests/test_pipeline_flushless.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from autopar.runtime.process import CompileError
from autopar.runtime.pipeline.two_way import StagePasses


class FlushlessSchedule(StagePasses):
    """Runs this rank's stage (modules[0], stage `group` of n_groups) of a pipedream-2bw
    plan; its messages go along chunk 0's (down) direction."""

    def __init__(self, modules: list, group: int, n_groups: int, n_mb: int, pp_group, device, loss_fn,
                 n_received: list):
        if n_mb < n_groups:
            raise CompileError(f"pipedream-2bw needs at least as many microbatches as device groups ({n_groups}); "
                               f"the plan has {n_mb}: plan again")
        super().__init__(modules, group, n_groups, n_mb, pp_group, device, loss_fn, n_received)
        self.step_index = 0          # the next step's index in the stream
        self.next_backward = 0       # the global microbatch index of this rank's next backward
        self.versions: dict = {}     # step -> {key: weight copy} for steps with backwards to run

    # the order: F(j), then B(j - lag) with lag = p - r - 1
    @property
    def lag(self) -> int:
        return self.n_groups - 1 - self.group

    def _tag_index(self, j: int) -> int:
        return j % (2 * self.n_mb)   # (at most two steps in flight)

    def _version(self) -> dict:
        module = self.modules[0]
        return {key: p.detach().clone().requires_grad_(p.requires_grad) for key, p in module.params.items()}

    def _run_forward(self, j: int, microbatches: list) -> None:
        k, i = divmod(j, self.n_mb)
        with self.modules[0].reading(self.versions[k]):
            self._forward(self._tag_index(j), 0, {self._tag_index(j): microbatches[i]}, True)

    def _run_backward(self, j: int) -> None:
        self._backward(self._tag_index(j), 0)
        self.next_backward = j + 1

    def _complete(self, k: int) -> None:
        """Step k's backwards all ran: its gradients become the live weights' .grad."""
        version = self.versions.pop(k)
        for key, p in self.modules[0].params.items():
            p.grad = version[key].grad

    def step(self, inputs: dict, train: bool = True) -> list:
        """One step of the stream (train) or the forwards of `inputs` at the live weights
        (not train: no backward, nothing pending touched).  Returns this rank's losses."""
        _, microbatches = split_args_kwargs_into_chunks((), inputs, self.n_mb)
        self.losses = []
        if not train:
            return self._evaluate(microbatches)
        k = self.step_index
        self.step_index += 1
        self.versions[k] = self._version()
        for p in self.modules[0].params.values():
            p.grad = None
        for i in range(self.n_mb):
            j = k * self.n_mb + i
            self._run_forward(j, microbatches)
            if j - self.lag >= self.next_backward:
                self._run_backward(j - self.lag)
        # sends whose receiver reads them in the next step stay in flight (waiting here would
        # hold this rank while its neighbour moves on to the loss's all-reduce)
        self.sends = [(work, t) for work, t in self.sends if not work.is_completed()]
        if k - 1 in self.versions:
            self._complete(k - 1)
        return self.losses

    def drain(self) -> None:
        """Run the backwards still pending (the last step's), leave its gradient in .grad
        and start the stream again."""
        end = self.step_index * self.n_mb
        try:
            for j in range(self.next_backward, end):
                self._run_backward(j)
            for work, _ in self.sends:
                work.wait()
        finally:
            self.sends = []
        for p in self.modules[0].params.values():
            p.grad = None
        for k in sorted(self.versions):
            self._complete(k)
        self.step_index = self.next_backward = 0

    @property
    def pending(self) -> bool:
        """Whether this rank has backwards left to run (the last stage never has)."""
        return self.next_backward < self.step_index * self.n_mb

    def any_pending(self) -> bool:
        """Whether any device group has backwards left to run; every rank must call it."""
        flag = torch.tensor([float(self.pending)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pp_group)
        return bool(flag.item())

    def _evaluate(self, microbatches: list) -> list:
        base = 2 * self.n_mb   # (a tag range of its own: training messages may still be in flight)
        held, self.sends = self.sends, []
        with torch.no_grad():
            for i in range(self.n_mb):
                self._forward(base + i, 0, {base + i: microbatches[i]}, False)
        for work, _ in self.sends:
            work.wait()
        self.sends = held
        return self.losses
