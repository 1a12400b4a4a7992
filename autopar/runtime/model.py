"""CompiledModel: one rank's part of a compiled model, an nn.Module that trains like the plain one.

The model runs steps: forward, train_step, backward, no_sync and join.  What it runs on is
this rank's state (runtime/state/rank_state.RankState: parameter shards, float32 masters, ZeRO
layouts, buffers, names, process groups), the feed of the graph's placeholders
(runtime/runner.GraphIO) and the gradient synchronisation (runtime/grads/sync.GradSync),
all built before the model and handed to it whole.  How a step runs is its runner's:
runtime/runner.GraphRunner runs the per-rank graph that runtime/build.py made (forward on
the global batch, or on this rank's shards with run=RunOptions(local_inputs=True)),
runtime/pipelined.PipelineRunner this rank's pipeline stages under the plan's schedule.

The rest of its public methods are one-line doors to the modules that own each concern,
all taking the RankState: the optimizer (runtime/state/optimizer.py), gradient norms
(runtime/grads/norms.py), state dicts under the plain model's names (runtime/state/plain_state.py)
and the memory report (runtime/state/memory_report.py).
"""
from __future__ import annotations

import functools
import types
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate
from torch.utils import _pytree as pytree

from autopar.passes.redistribute import redistribute_local

from autopar.runtime.build import RankGraph
from autopar.runtime.checks.faults import check_step, collectives_named
from autopar.runtime.grads.norms import clip_grad_norm_, grad_norm
from autopar.runtime.grads.pieces import pieces_of
from autopar.runtime.grads.sync import GradSync
from autopar.runtime.checks.inputs import ShardedInputs, unpack_sharded
from autopar.runtime.checks.join import Join
from autopar.runtime.state.memory_report import memory_report
from autopar.runtime.state.optimizer import build_optimizer, load_state_dict_into, state_dict_of
from autopar.runtime.options import RunOptions
from autopar.runtime.state.plain_state import (
    full_grads, full_state, load_full_state, load_state, sharded_state, state_names)
from autopar.runtime.process import CompileError
from autopar.runtime.runner import graph_io
from autopar.runtime.state.rank_state import RankState


class CompiledModel(nn.Module):
    """One rank's part of the model.  Parameters are this rank's shards, named as in the
    original model (dots become '__' in the module's own attribute names).

    plan, groups, device, device_type, name_of, parts, aliases, buffer_names, masters,
    zero_layouts and zero_grad_chunks (its zero_grads: key -> this rank's chunk of a ZeRO-2
    parameter's summed gradient, runtime/grads/sync.py) are the RankState's (`rank_state`),
    named here for callers."""

    def __init__(self, rewritten: RankGraph, state: RankState, options: RunOptions, runner, *,
                 batch_scale: int = 1, pieces: dict | None = None, hold=frozenset()):
        """runner: makes the runner from this model (runtime/runner.GraphRunner, or
        runtime/pipeline/pipelined.PipelineRunner), called once the rest is built.  batch_scale,
        pieces, hold: a pipelined plan's microbatches per batch, the gradients its device
        group holds only for its stages (key -> why) and the weights two of this rank's
        stages read (runtime/grads/sync.GradSync reduces them after the schedule)."""
        super().__init__()
        self.rank_state = state
        self.shards = state.shards
        for key, buf in state.buffers.items():
            self.register_buffer(key, buf, persistent=False)
        self.plan, self.groups, self.device, self.device_type = state.plan, state.groups, state.device, state.device_type
        self.name_of, self.parts, self.aliases, self.buffer_names = state.name_of, state.parts, state.aliases, \
            state.buffer_names
        self.masters, self.zero_layouts = state.masters, state.zero_layouts
        self.zero_grad_chunks = state.zero_grads
        self.modes = rewritten.modes
        self.streams = rewritten.streams
        self.input_layouts = rewritten.input_layouts  # RunOptions(local_inputs=True): each input's layout
        self.graph_module = rewritten.graph.to(state.device)
        self.bucket_bytes = options.bucket_bytes
        self.timeout_s = options.timeout        # the collective timeout errors name
        self.check_finite = options.check_finite  # runtime/checks/faults.check_step (the user may switch it)
        self.backend = options.backend            # how the runner runs the graph (runtime/regions/inductor.py)
        self.steps = 0                            # train_step calls so far (errors name the step)
        self._optimizers: list = []
        self.joining = Join(state.device)          # cm.join()'s flags (runtime/checks/join.py)
        self.io = graph_io(rewritten, state.groups, options, batch_scale)
        precision = state.precision
        self.grad_sync = GradSync(state.shards, state.sync_axes, state.groups, options.bucket_mb, state.zero_layouts,
                                  precision.reduce_dtype if precision is not None else None, state.zero_grads,
                                  {**(pieces or {}), **pieces_of(state)}, hold)
        self.runner = runner(self)

    # --- running (the runner's) ----------------------------------------------------------------
    def graphs(self) -> list:
        """The graph modules this rank runs (one, or one per pipeline stage held here)."""
        return self.runner.graphs()

    def train(self, mode: bool = True):
        """Switch dropout, batch norm and the other mode-dependent ops of the compiled graph
        as `model.train(mode)` / `model.eval()` switch the plain model (autopar/passes/modes.py)."""
        if mode != self.training or not hasattr(self, "_mode_applied"):
            for gm in self.graphs():
                self.modes.apply(gm, mode)
            self._mode_applied = True
        return super().train(mode)

    def forward(self, *args, **kwargs):
        """Forward on the global batch (every rank passes the same full inputs), or on this
        rank's shards when compiled with run=RunOptions(local_inputs=True).  A pipelined plan returns the
        batch's loss on every rank (its stages' forward passes only).  Also takes what
        `shard_inputs` returns, whole or star-unpacked (runtime/checks/inputs.ShardedInputs)."""
        args, kwargs = unpack_sharded(args, kwargs)
        with collectives_named("forward", self.timeout_s):
            return self.runner.forward(args, kwargs)

    def gather_counts(self) -> dict:
        """ZeRO-3 weight gathers: "sites", the gathers one forward runs; since compile,
        "gathered" in forward, of which "prefetched", and "regathered" in backward
        (reshard_after_forward); the collective calls of grouped buckets, "bucket_gathers"
        and "bucket_reduces"; "fetched": copies of offloaded weights made for a use
        (autopar/runtime/regions/reshard.py).  Pipelined: over this rank's stages, per microbatch."""
        return self.runner.gather_counts()

    def shard_inputs(self, *args, **kwargs):
        """This rank's shards of global inputs, for a module compiled with
        run=RunOptions(local_inputs=True): a ShardedInputs (autopar/runtime/checks/inputs.py), the
        pair `args, kwargs` of the shards, which
        train_step and forward also take as it is (`cm.train_step(*cm.shard_inputs(*batch))`)."""
        if self.input_layouts is None:
            raise CompileError("shard_inputs is for modules compiled with run=RunOptions(local_inputs=True); this "
                               "one takes the global batch as it is")
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = iter(self.input_layouts)
        out = [redistribute_local(t, tuple(Replicate() for _ in layout), layout, self.groups)
               if isinstance(t, torch.Tensor) and (layout := next(tensors)) is not None else t for t in flat]
        return ShardedInputs.of(*pytree.tree_unflatten(out, spec))

    # --- uneven data ----------------------------------------------------------------------------
    def join(self):
        """For loops whose ranks may have different numbers of batches:

            with cm.join():
                for batch in loader:         # some ranks may run out first
                    cm.train_step(*batch); opt.step(); opt.zero_grad()

        Inside, every train_step first sums one flag over all ranks.  A rank that leaves the
        loop answers its peers' next flag with 0; the ranks that still have batches then
        raise UnevenInputs at that step, all of them, and the finished ranks end cleanly.
        (Every rank computes part of every step, so a rank without data cannot stand in for
        one; give all ranks the same number of batches, e.g. drop_last=True, to use them all.)
        (runtime/checks/join.py)"""
        return self.joining.block(self)

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward, backward and gradient synchronisation; returns the loss (detached).
        A pipelined plan runs one step of its schedule on the global batch.  With
        check_finite (compile's default) a NaN or infinite loss or gradient on any rank
        raises NonFiniteError on every rank (autopar/runtime/checks/faults.py); a collective that does not
        finish within compile's timeout raises CollectiveError.  Also takes what shard_inputs
        returns, whole or star-unpacked (runtime/checks/inputs.ShardedInputs)."""
        args, kwargs = unpack_sharded(args, kwargs)
        self.steps += 1
        with collectives_named(f"step {self.steps} (forward, backward, gradient synchronisation)", self.timeout_s):
            self.joining.check()
            with self.io.check.folded():   # a sampled call's input hashes wait for check_step's all-reduce
                loss = self.runner.train_step(args, kwargs)
            check_step(self, loss, self.steps, self.check_finite, self.io.check.take_pending())
        return loss

    def parameter_order(self) -> list:
        """Every parameter's name in the model's order (the same on every rank, whichever
        pipeline stages it holds)."""
        return list(self.plan.param_placements)

    def drain(self) -> None:
        """Under an asynchronous pipeline (schedule "pipedream-2bw"), each train_step leaves
        the last backwards of its microbatches to the next step and .grad holds the step
        before's gradient: drain() runs what is pending so that .grad holds the last step's
        (take the optimizer step after it; do so before saving or evaluating for good).
        Nothing to do for any other plan."""
        drain = getattr(self.runner, "drain", None)
        if drain is not None:
            with collectives_named("draining the pipeline", self.timeout_s):
                drain()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() and the gradient synchronisation that train_step runs after it.

        Gradient accumulation over k micro-batches:
            for micro in batches[:-1]:
                with cm.no_sync():
                    cm.backward(cm(*micro) / k)
            cm.backward(cm(*batches[-1]) / k)     # reduces the accumulated sum once

        A backward that synchronises (not under no_sync) is a step: with check_finite a NaN
        or infinite loss or gradient on any rank raises NonFiniteError on every rank, as
        train_step's does (runtime/checks/faults.check_step)."""
        syncs = bool(getattr(self.grad_sync, "enabled", True))   # (False inside no_sync)
        if syncs:
            self.steps += 1
        with collectives_named(f"step {self.steps} (backward, gradient synchronisation)" if syncs else
                               "backward (no_sync: gradients accumulated)", self.timeout_s):
            self.runner.backward(loss)
            if syncs:
                local = loss.to_local() if hasattr(loss, "to_local") else loss
                check_step(self, local.detach(), self.steps, self.check_finite, None)

    def no_sync(self):
        """Micro-steps inside `with cm.no_sync():` accumulate gradients without reducing them;
        the next `train_step` outside reduces the sum."""
        return self.runner.no_sync()

    # --- doors to the modules that own each concern --------------------------------------------
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole model's gradient, as torch.nn.utils.get_total_norm computes
        it on one device: every shard counted once, one all-reduce over all ranks
        (runtime/grads/norms.py).  Call after train_step."""
        return grad_norm(self.rank_state, norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the compiled model: the whole gradient's norm
        (grad_norm), and every gradient piece scaled by min(1, max_norm / (norm + 1e-6)).
        Returns the norm before clipping.  (torch's own function over cm.parameters() sees
        only this rank's shards: its norm is not the model's.)"""
        return clip_grad_norm_(self.rank_state, max_norm, norm_type)

    def build_optimizer(self, cls=torch.optim.AdamW, elementwise: bool | None = None, **kwargs):
        """Any torch optimizer over what this rank owns of the parameters (runtime/state/optimizer.py).
        An elementwise one (runtime/state/whole_params.ELEMENTWISE, or elementwise=True) runs on
        this rank's shards, their ZeRO-1/2 chunks or their float32 master weights and
        computes exactly what it computes on the whole model; any other (Adafactor, ...) runs
        on whole parameters, each on one owner rank, unless every parameter is whole here
        anyway.  The result is a torch.optim.Optimizer wrapping one of class `cls` (step,
        zero_grad, param_groups, LR schedulers); for an elementwise optimizer its
        state_dict() is under parameter names with DTensors and loads into any plan or mesh,
        as torch.distributed.checkpoint expects.  Under backend "inductor" an optimizer
        with a fused update (Adam, AdamW, SGD, Adagrad) runs it (fused=True) unless the
        call says `fused` or `foreach`: the step is compiled like the rest, and priced so."""
        optimizer = build_optimizer(self.rank_state, cls, elementwise, pipelined=self.runner.pipelined,
                                    bucket_bytes=self.bucket_bytes, fuse=self.backend == "inductor", **kwargs)
        self._optimizers.append(weakref.ref(optimizer))
        optimizer.step = types.MethodType(_named_step(type(optimizer).step, self), optimizer)
        return optimizer

    def memory_report(self) -> dict:
        """Bytes this rank holds of parameters, gradients and optimizer states, next to the
        plan's prediction ("predicted"); on CUDA also the peak allocated memory
        (runtime/state/memory_report.py).  Measured after optimizer.step() and before zero_grad()
        it is what the plan predicts."""
        optimizers = [opt for opt in (ref() for ref in self._optimizers) if opt is not None]
        return memory_report(self.rank_state, optimizers, self.predicted_memory())

    def predicted_memory(self) -> dict:
        """The plan's bytes per device of this rank: params, grads, optimizer, activations, total
        (pipelined: its device group's, from the pipeline search)."""
        return self.runner.predicted_memory()

    # --- state under the plain model's names (runtime/state/plain_state.py) ------------------------------
    def full_state_dict(self, master: bool = False) -> dict[str, torch.Tensor]:
        """The plain model's state_dict(), whole, on every rank: every parameter (tied ones
        under each of their names) and the persistent buffers (batch-norm statistics ...).
        master=True: the float32 master weights where the optimizer keeps them (mixed
        precision, offload), gathered from their ZeRO chunks."""
        return full_state(self.rank_state, self.runner.whole, master)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient whole (ZeRO-2 chunks gathered), on every rank."""
        return full_grads(self.rank_state, self.runner.whole)

    def load_full_state_dict(self, state: dict) -> None:
        """Load whole tensors (full_state_dict(), the plain model's state_dict()) into the
        shards, master weights and buffers; KeyError if a parameter is missing."""
        load_full_state(self.rank_state, state)

    def state_dict(self, *args, **kwargs) -> dict:
        """This rank's state under the plain model's state_dict() names, for
        torch.distributed.checkpoint: parameters as DTensors (this rank's shard, the plan's
        placements on the mesh; a fused weight whole, a tied weight under each of its names),
        persistent buffers as tensors (replicated).  The usual pattern works, a checkpoint
        saved under one plan or mesh loads under another, and into the plain model
        (`dcp.load({"model": model.state_dict()}, ...)`, with or without a process group):

            dcp.save({"model": cm.state_dict()}, checkpoint_id=path)
            state = {"model": cm.state_dict()}; dcp.load(state, checkpoint_id=path)
            cm.load_state_dict(state["model"])

        Under mixed precision or offload a parameter's value is its float32 master weights
        (what the optimizer updates), so a checkpoint loses nothing and loads into a plan
        with or without mixed precision.  A fused weight whose parts this plan splits along
        the dim that joins them costs one collective over those axes (autopar/runtime/state/plain_state.py).
        """
        return sharded_state(self.rank_state)

    def state_dict_names(self) -> list:
        """Every key state_dict() gives on some rank (a pipelined rank gives those of its
        stages): the plain model's parameter names, tied aliases and persistent buffers."""
        return state_names(self.rank_state)

    def load_state_dict(self, state: dict, strict: bool = True, assign: bool = False):
        """Load a state dict under the plain model's names: the plain model's own
        state_dict() (a pretrained model's), full_state_dict(), or DTensors from state_dict() and
        torch.distributed.checkpoint (any plan or mesh); a fused weight whole (or as the parts
        of an older checkpoint), a tied weight under either of its names.  strict: every
        parameter and buffer must be there and nothing else (KeyError naming them);
        strict=False loads what fits and returns the missing and unexpected keys, as torch
        does."""
        return load_state(self.rank_state, state, strict)

    def optimizer_state_dict(self, optimizer) -> dict:
        """The state of an optimizer over this model's shards under parameter names, per-element
        state as DTensors (runtime/state/sharded_optimizer.py): saved with torch.distributed.checkpoint
        beside state_dict(), it loads into another plan or mesh with load_optimizer_state_dict.
        (An optimizer from build_optimizer gives the same from its own state_dict().)"""
        return state_dict_of(self.rank_state, optimizer)

    def load_optimizer_state_dict(self, optimizer, state: dict) -> None:
        load_state_dict_into(self.rank_state, optimizer, state)


def _named_step(step, cm):
    """An optimizer's step whose collectives (ZeRO-1/2's all-gathers of the updated chunks,
    a whole-parameter optimizer's gathers and broadcasts) are named when one stalls: "the
    optimizer step after step N", not a bare backend timeout.  A bound method still
    (LR schedulers wrap optimizer.step through its __func__)."""
    @functools.wraps(step)
    def named(optimizer, *args, **kwargs):
        with collectives_named(f"the optimizer step after step {cm.steps} (ZeRO chunks or whole parameters "
                               f"gathered after the update)", cm.timeout_s):
            return step(optimizer, *args, **kwargs)
    return named
