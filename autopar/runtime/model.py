"""CompiledModel: one rank's part of a compiled model, an nn.Module that trains like the plain one.

It holds what every plan shares: this rank's parameter shards and buffers, the feed of the
graph's placeholders (runtime/runner.GraphIO) and the gradient synchronisation
(autopar/runtime/grad_sync.py).  How a step runs is its runner's: runtime/runner.GraphRunner runs
the per-rank graph that autopar/runtime/build.py made (forward on the global batch, or on this
rank's shards with local_inputs=True), runtime/pipelined.PipelineRunner this rank's
pipeline stages under the plan's schedule.  The model itself builds optimizers over what
this rank owns (autopar/runtime/zero.py, autopar/runtime/whole_params.py), measures gradient norms over
every shard once, and gives the model's state whole or as DTensors for
torch.distributed.checkpoint.
"""
from __future__ import annotations

import contextlib
import logging
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils import _pytree as pytree

from autopar.passes.redistribute import redistribute_local
from autopar.passes.shard_params import shard_of
from autopar.plan.plan import Plan
from autopar.cost.precision import MixedPrecision

from autopar.runtime.build import Rewritten
from autopar.runtime.checkpoint import give_sharded_state, load_optimizer_state_dict, optimizer_state_dict
from autopar.runtime.faults import DEFAULT_TIMEOUT_S, check_step, collectives_named
from autopar.runtime.grad_pieces import is_absent
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.inputs import InputCheck, ShardedInputs, unpack_sharded
from autopar.runtime.plain_state import load_state, sharded_state, state_names
from autopar.runtime.runner import GraphIO
from autopar.runtime.process import CompileError, device_of
from autopar.runtime.whole_params import ELEMENTWISE, WholeParamOptimizer
from autopar.runtime.zero import ShardedOptimizer, all_gather_chunks, zero_layout

log = logging.getLogger("autopar")


class UnevenInputs(RuntimeError):
    """Inside `cm.join()`, some rank ran out of batches while this one still had some: every
    rank with batches left stops at the same step with this error (instead of waiting
    forever in a collective its finished peer never enters)."""


class CompiledModel(nn.Module):
    """One rank's part of the model.  Parameters are this rank's shards, named as in the
    original model (dots become '__' in the module's own attribute names)."""

    def __init__(self, rewritten: Rewritten, plan: Plan, groups, shards: dict, model: nn.Module, device_type: str,
                 bucket_mb: float, precision: MixedPrecision | None, runner):
        """runner: makes the runner from this model (autopar/runtime/runner.py: GraphRunner, or
        autopar/runtime/pipelined.py's PipelineRunner), called once the shared parts are built."""
        super().__init__()
        gm, traced = rewritten.graph, rewritten.traced
        self.modes = rewritten.modes
        self.streams = rewritten.streams
        self.precision = precision
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.plan = plan
        self.groups = groups
        self.input_layouts = rewritten.input_layouts  # compile(local_inputs=True): each input's layout
        self._optimizers: list = []
        self.steps = 0                       # train_step calls so far (errors name the step)
        self.check_finite = True             # compile(check_finite=...): runtime/faults.check_step
        self.timeout_s = DEFAULT_TIMEOUT_S   # compile(timeout=...): the collective timeout errors name
        self.device_type = device_type
        self.device = device_of(device_type)
        self.graph_module = gm.to(self.device)
        self.name_of = {param_key(k): k for k in shards}
        self.parts = traced.parts  # fused weights planned as parts: the shards hold parts, the user sees wholes
        trainable = {n: p.requires_grad for n, p in self.parts.named_parameters(model).items()}
        self.trained = {n for n, p in model.named_parameters() if p.requires_grad}  # the model's trained parameters
        sync = {param_key(name): axes for name, axes in rewritten.grad_sync.items() if name in shards and trainable[name]}
        self.zero_layouts = {}   # key -> ZeroLayout of ZeRO-1/2 parameters
        self.masters = {}        # key -> float32 master (or offloaded copy) the optimizer updates
        for name, state in plan.param_states.items():
            if state.stage and name in shards and trainable[name]:  # (a stage holds some of the parameters)
                k = param_key(name)
                axes = tuple(plan.mesh.axis_names.index(a) for a in state.axes)
                self.zero_layouts[k] = zero_layout(state.stage, axes, sync.get(k, ()), shards[name].numel(), groups,
                                                   state.offload)
        for name, value in shards.items():
            k = param_key(name)
            state = plan.param_states.get(name)
            offload = state is not None and state.offload
            if trainable.get(name, False) and value.is_floating_point() and (precision is not None or offload):
                lay = self.zero_layouts.get(k)
                part = value.detach().reshape(-1)[lay.start: lay.end] if lay is not None else value.detach()
                home = torch.device("cpu") if offload else self.device
                dtype = torch.float32 if precision is not None else value.dtype
                self.masters[k] = nn.Parameter(part.to(home, dtype, copy=True))
        self.shards = nn.ParameterDict({param_key(k): nn.Parameter(self._compute_dtype(v).to(self.device),
                                                              requires_grad=trainable[k])
                                        for k, v in shards.items()})
        buffers = dict(model.named_buffers())
        order = []  # what each placeholder is fed with
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.target in traced.params:
                name = traced.tied.get(traced.params[node.target], traced.params[node.target])
                order.append(("param", param_key(name)))
            elif node.target in traced.buffers:
                name = traced.buffers[node.target]
                buf = buffers.get(name, traced.constants.get(name))  # (a constant the forward creates)
                if buf is None or buf.is_meta:
                    raise CompileError(f"buffer {name} has no value; initialise it before compiling")
                self.register_buffer(param_key(name), self._compute_dtype(buf).to(self.device), persistent=False)
                order.append(("buffer", param_key(name)))
            else:
                order.append(("input", None))
        # names the plain model's state_dict() has: tied aliases and persistent buffers (those the
        # graph does not read are kept as they are, so a state dict is complete)
        self.aliases = {n: traced.tied[n] for n, _ in model.named_parameters(remove_duplicate=False)
                        if traced.tied.get(n, n) != n}
        persistent = set(model.state_dict(keep_vars=True))
        self.buffer_names = {}
        for name, buf in model.named_buffers():
            if name not in persistent:
                continue
            if not hasattr(self, param_key(name)):
                if buf.is_meta:
                    continue
                self.register_buffer(param_key(name), buf.detach().clone().to(self.device), persistent=False)
            self.buffer_names[name] = param_key(name)
        check = InputCheck(rewritten.inputs, groups)
        check.layouts = rewritten.input_layouts
        self.io = GraphIO(order, [n.target for n in gm.graph.nodes if n.op == "placeholder"], traced.in_spec,
                          traced.out_spec, rewritten.output_reduce, check)
        self.grad_sync = GradSync(self, sync, groups, bucket_mb, self.zero_layouts,
                                  precision.reduce_dtype if precision is not None else None)
        self.grad_sync.pieces = self._grad_pieces()
        self.runner = runner(self)

    def _grad_pieces(self) -> dict:
        """key -> why this rank's gradient of it is only a piece of the whole (autopar/runtime/grad_pieces.py):
        parameters split over some mesh axis and ZeRO-2 ones; replicated ones are whole."""
        axes = self.plan.mesh.axis_names
        out = {}
        for key, p in self.shards.items():
            if not p.requires_grad:
                continue
            name = self.name_of[key]
            split = [f"{axes[a]} ({pl})" for a, pl in enumerate(self.plan.param_placements[name])
                     if isinstance(pl, Shard)]
            lay = self.zero_layouts.get(key)
            if lay is not None and lay.stage == 2:
                out[key] = (f"the gradient of {name!r} is reduce-scattered into ZeRO-2 chunks over "
                            f"{[axes[a] for a in lay.reduce_axes + lay.rest_axes]}")
            elif split:
                out[key] = f"this rank holds a shard of the gradient of {name!r}, split over {', '.join(split)}"
        return out

    def compute_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter or buffer of `dtype` computes in (param_dtype under mixed precision)."""
        return self.precision.param_dtype if self.precision is not None and dtype == torch.float32 else dtype

    def _compute_dtype(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(self.compute_dtype_of(t.dtype))

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
        rank's shards when compiled with local_inputs=True.  A pipelined plan returns the
        batch's loss on every rank (its stages' forward passes only).  Also takes what
        `shard_inputs` returns, whole or star-unpacked (runtime/inputs.ShardedInputs)."""
        args, kwargs = unpack_sharded(args, kwargs)
        with collectives_named("forward", self.timeout_s):
            return self.runner.forward(args, kwargs)

    def gather_counts(self) -> dict:
        """ZeRO-3 weight gathers: "sites", the gathers one forward runs; since compile,
        "gathered" in forward, of which "prefetched", and "regathered" in backward
        (reshard_after_forward); the collective calls of grouped buckets, "bucket_gathers"
        and "bucket_reduces" (autopar/runtime/reshard.py).  Pipelined: over this rank's stages, per
        microbatch."""
        return self.runner.gather_counts()

    def shard_inputs(self, *args, **kwargs):
        """This rank's shards of global inputs, for a module compiled with local_inputs=True:
        a ShardedInputs (autopar/runtime/inputs.py), the pair `args, kwargs` of the shards, which
        train_step and forward also take as it is (`cm.train_step(*cm.shard_inputs(*batch))`)."""
        if self.input_layouts is None:
            raise CompileError("shard_inputs is for modules compiled with local_inputs=True; this one takes "
                               "the global batch as it is")
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = iter(self.input_layouts)
        out = [redistribute_local(t, tuple(Replicate() for _ in layout), layout, self.groups)
               if isinstance(t, torch.Tensor) and (layout := next(tensors)) is not None else t for t in flat]
        return ShardedInputs.of(*pytree.tree_unflatten(out, spec))

    # --- uneven data ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def join(self):
        """For loops whose ranks may have different numbers of batches:

            with cm.join():
                for batch in loader:         # some ranks may run out first
                    cm.train_step(*batch); opt.step(); opt.zero_grad()

        Inside, every train_step first sums one flag over all ranks.  A rank that leaves the
        loop answers its peers' next flag with 0; the ranks that still have batches then
        raise UnevenInputs at that step, all of them, and the finished ranks end cleanly.
        (Every rank computes part of every step, so a rank without data cannot stand in for
        one; give all ranks the same number of batches, e.g. drop_last=True, to use them all.)"""
        self._steps_in_join = 0
        self._joined = True
        try:
            yield self
        except BaseException:
            self._joined = False
            raise
        self._joined = False
        flag = torch.zeros((), dtype=torch.int64, device=device_of(self.device_type))
        dist.all_reduce(flag)  # pairs with the flag of a peer's next step (0: they are done too)
        if flag.item():
            log.warning("rank %d ran out of batches after %d steps; %d rank(s) had more and stopped",
                        dist.get_rank(), self._steps_in_join, flag.item())

    def _check_joined(self) -> None:
        if not getattr(self, "_joined", False):
            return
        flag = torch.ones((), dtype=torch.int64, device=device_of(self.device_type))
        dist.all_reduce(flag)
        if flag.item() < dist.get_world_size():
            self._joined = False
            raise UnevenInputs(f"{dist.get_world_size() - flag.item()} rank(s) ran out of batches before step "
                               f"{self._steps_in_join} of this cm.join() block while rank {dist.get_rank()} had "
                               f"more; every rank with batches left stopped here. Catch "
                               f"autopar.runtime.compiled.UnevenInputs to end the epoch, or give every rank the "
                               f"same number of batches (DistributedSampler(..., drop_last=True))")
        self._steps_in_join += 1

    def train_step(self, *args, **kwargs) -> torch.Tensor:
        """Forward, backward and gradient synchronisation; returns the loss (detached).
        A pipelined plan runs one step of its schedule on the global batch.  With
        check_finite (compile's default) a NaN or infinite loss or gradient on any rank
        raises NonFiniteError on every rank (autopar/runtime/faults.py); a collective that does not
        finish within compile's timeout raises CollectiveError.  Also takes what shard_inputs
        returns, whole or star-unpacked (runtime/inputs.ShardedInputs)."""
        args, kwargs = unpack_sharded(args, kwargs)
        self.steps += 1
        with collectives_named(f"step {self.steps} (forward, backward, gradient synchronisation)", self.timeout_s):
            self._check_joined()
            with self.io.check.folded():   # a sampled call's input hashes wait for check_step's all-reduce
                loss = self.runner.train_step(args, kwargs)
            check_step(self, loss, self.steps, self.check_finite, self.io.check.take_pending())
        return loss

    def parameter_order(self) -> list:
        """Every parameter's name in the model's order (the same on every rank, whichever
        pipeline stages it holds)."""
        return list(self.plan.param_placements)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() and the gradient synchronisation that train_step runs after it.

        Gradient accumulation over k micro-batches:
            for micro in batches[:-1]:
                with cm.no_sync():
                    cm.backward(cm(*micro) / k)
            cm.backward(cm(*batches[-1]) / k)     # reduces the accumulated sum once
        """
        with collectives_named("backward and gradient synchronisation", self.timeout_s):
            self.runner.backward(loss)

    # --- gradient norms ------------------------------------------------------------------------
    def local_grads(self):
        """(key, this rank's reduced gradient piece) of every trainable parameter that has one:
        the local gradient, or the ZeRO-2 chunk."""
        for key, p in self.shards.items():
            if p.requires_grad:
                g = self.grad_sync.zero_grads.get(key)
                g = p.grad if g is None else g
                if g is not None:
                    yield key, g

    def _copies(self, key: str) -> int:
        """How many ranks hold the same piece of parameter `key`'s gradient as this rank: the
        sizes of the mesh axes it is whole on, less those a ZeRO-2 chunk splits, times the
        device groups holding a copy (a tied weight read by two pipeline groups)."""
        lay = self.zero_layouts.get(key)
        chunked = set(lay.reduce_axes + lay.rest_axes) if lay is not None and lay.stage == 2 else set()
        placements = self.plan.param_placements[self.name_of[key]]
        return math.prod(self.groups.size(a) for a, p in enumerate(placements)
                         if not isinstance(p, Shard) and a not in chunked) * self.runner.groups_holding(key)

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole model's gradient, as torch.nn.utils.get_total_norm computes
        it on one device: every shard counted once (pieces held by several ranks divided by
        their number of copies), one all-reduce over all ranks.  Call after train_step."""
        norm_type = float(norm_type)
        device = device_of(self.device_type)
        grads = list(self.local_grads())
        if math.isinf(norm_type):
            local = torch.stack([g.detach().abs().max().double() for _, g in grads]).max() if grads else \
                torch.zeros((), dtype=torch.float64)
            local = local.to(device)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            return local.float()
        local = torch.zeros((), dtype=torch.float64, device=device)
        for key, g in grads:
            local += g.detach().double().norm(norm_type).pow(norm_type).to(device) / self._copies(key)
        dist.all_reduce(local)
        return local.pow(1.0 / norm_type).float()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the compiled model: the whole gradient's norm
        (grad_norm), and every gradient piece scaled by min(1, max_norm / (norm + 1e-6)).
        Returns the norm before clipping.  (torch's own function over cm.parameters() sees
        only this rank's shards: its norm is not the model's.)"""
        total = self.grad_norm(norm_type)
        scale = (float(max_norm) / (total.item() + 1e-6))
        if scale < 1.0:
            for _, g in self.local_grads():
                g.mul_(scale)
        return total

    def no_sync(self):
        """Micro-steps inside `with cm.no_sync():` accumulate gradients without reducing them;
        the next `train_step` outside reduces the sum."""
        return self.runner.no_sync()

    def build_optimizer(self, cls=torch.optim.AdamW, elementwise: bool | None = None, **kwargs):
        """Any torch optimizer over what this rank owns of the parameters.  An elementwise
        one (runtime/whole_params.ELEMENTWISE, or elementwise=True) runs on this rank's
        shards, their ZeRO-1/2 chunks or their float32 master weights (autopar/runtime/zero.py) and
        computes exactly what it computes on the whole model.  Any other (Adafactor, ...)
        runs on whole parameters, each on one owner rank (autopar/runtime/whole_params.py), unless
        every parameter is whole here anyway.  The result has step, zero_grad, param_groups,
        state_dict and load_state_dict; for an elementwise optimizer its state_dict() is
        cm.optimizer_state_dict(opt) (parameter names, DTensors) and loads into any plan or
        mesh, as torch.distributed.checkpoint expects."""
        if elementwise is None:
            elementwise = cls in ELEMENTWISE
        pieces = bool(self.zero_layouts) or any(
            isinstance(p, Shard) for k, q in self.shards.items() if q.requires_grad
            for p in self.plan.param_placements[self.name_of[k]])
        if not elementwise and pieces:
            if self.masters or self.runner.pipelined:
                raise CompileError(f"{cls.__name__} reads whole parameters (it is not in autopar's list of "
                                   f"elementwise optimizers), and this plan splits them; running it on whole "
                                   f"parameters is not supported with mixed precision, offload or pipeline "
                                   f"stages yet. Use an elementwise optimizer (e.g. AdamW), a plan that keeps "
                                   f"weights whole, or pass elementwise=True if {cls.__name__} is elementwise")
            optimizer = WholeParamOptimizer(self, cls, **kwargs)
            self._optimizers.append(weakref.ref(optimizer))
            log.info("%s runs on whole parameters (%s)", cls.__name__, optimizer)
            return optimizer
        if not self.zero_layouts and not self.masters:
            trained = [p for p in self.shards.values() if p.requires_grad]
            if not trained:
                raise CompileError("every parameter of the model is frozen (requires_grad=False): there is "
                                   "nothing to optimise")
            optimizer = cls(trained, **kwargs)
        else:
            optimizer = ShardedOptimizer(self, cls, self.bucket_bytes, **kwargs)
        give_sharded_state(self, optimizer)  # state_dict() under parameter names, DTensors (autopar/runtime/checkpoint.py)
        self._optimizers.append(weakref.ref(optimizer))
        return optimizer

    def memory_report(self) -> dict:
        """Bytes this rank holds of parameters, gradients and optimizer states, next to the
        plan's prediction ("predicted"); on CUDA also the peak allocated memory.

        optimizer: per-element optimizer states (Adam's moments) plus float32 master weights;
        optimizer_scalars: bookkeeping such as Adam's step count; offloaded: what of those
        lives in host memory (not in "optimizer").  grads: full local gradients plus the
        ZeRO-2 chunks.  Measured after optimizer.step() and before zero_grad() it is what
        the plan predicts."""
        params = [p for p in self.shards.values()]
        measured = {
            "params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None and not is_absent(p.grad))
                     + sum(nbytes(g) for g in self.grad_sync.zero_grads.values()),
            "optimizer": 0, "optimizer_scalars": 0, "offloaded": 0,
        }
        host = {id(m) for k, m in self.masters.items() if m.device.type == "cpu" and
                self.plan.param_states.get(self.name_of[k]) is not None and self.plan.param_states[self.name_of[k]].offload}
        for m in self.masters.values():
            measured["offloaded" if id(m) in host else "optimizer"] += nbytes(m)
        for ref in self._optimizers:
            opt = ref()
            if opt is None:
                continue
            for p, state in opt.state.items():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        per_element = value.dim() > 0 and value.shape == p.shape
                        key = ("offloaded" if id(p) in host else "optimizer") if per_element else "optimizer_scalars"
                        measured[key] += nbytes(value)
        report = {"measured": measured, "predicted": self.predicted_memory()}
        if self.device_type == "cuda":
            report["peak_allocated"] = torch.cuda.max_memory_allocated()
        return report

    @property
    def zero_grad_chunks(self) -> dict:
        """key -> this rank's chunk of a ZeRO-2 parameter's summed gradient (autopar/runtime/grad_sync.py)."""
        return self.grad_sync.zero_grads

    def predicted_memory(self) -> dict:
        """The plan's bytes per device of this rank: params, grads, optimizer, activations, total
        (pipelined: its device group's, from the pipeline search)."""
        return self.runner.predicted_memory()

    # --- whole tensors ----------------------------------------------------------------------
    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        placements = self.plan.param_placements[name]
        return redistribute_local(local.detach(), tuple(placements), tuple(Replicate() for _ in placements),
                                  self.groups)

    def full_shape(self, key: str) -> tuple:
        """The whole shape of parameter `key` (a key of self.shards)."""
        shape = list(self.shards[key].shape)
        for axis, p in enumerate(self.plan.param_placements[self.name_of[key]]):
            if isinstance(p, Shard):
                shape[p.dim] *= self.groups.size(axis)
        return tuple(shape)

    def whole_value(self, key: str, master: bool = False) -> torch.Tensor:
        """Parameter `key` whole on every rank (collectives on every rank).  master=True: the
        float32 master weights where the optimizer keeps them, gathered from their chunks."""
        return self._full(self.name_of[key], self.local_value(key, master))

    def local_value(self, key: str, master: bool = False) -> torch.Tensor:
        """This rank's shard of parameter `key`; master=True: of its float32 master weights
        where the optimizer keeps them (a ZeRO chunk gathered back into the shard's shape,
        collectives over the ZeRO axes)."""
        p = self.shards[key]
        if not (master and key in self.masters):
            return p
        lay = self.zero_layouts.get(key)
        m = self.masters[key].detach().to(p.device)
        if lay is None:
            return m.view(p.shape)
        local = torch.zeros(p.shape, dtype=m.dtype, device=p.device)
        local.view(-1)[lay.start: lay.end] = m
        all_gather_chunks([local], [lay], self.groups)
        return local

    def whole_grad(self, key: str) -> torch.Tensor | None:
        """Parameter `key`'s reduced gradient whole on every rank (ZeRO-2 chunks gathered);
        None before any backward."""
        p = self.shards[key]
        grad = p.grad
        chunk = self.grad_sync.zero_grads.get(key)
        if chunk is not None:
            lay = self.zero_layouts[key]
            grad = torch.zeros_like(p, dtype=chunk.dtype)
            grad.view(-1)[lay.start: lay.end] = chunk
            all_gather_chunks([grad], [lay], self.groups)
        return None if grad is None else self._full(self.name_of[key], grad)

    def full_state_dict(self, master: bool = False) -> dict[str, torch.Tensor]:
        """The plain model's state_dict(), whole, on every rank: every parameter (tied ones
        under each of their names) and the persistent buffers (batch-norm statistics ...).
        master=True: the float32 master weights where the optimizer keeps them (mixed
        precision, offload), gathered from their ZeRO chunks."""
        mine = {self.name_of[k]: self.whole_value(k, master) for k in self.shards}
        out = self.parts.join(self.runner.whole(mine, torch.float32 if master and self.masters else None))
        return self._with_aliases_and_buffers({n: t.cpu() for n, t in out.items()})

    def _with_aliases_and_buffers(self, params: dict) -> dict:
        out = dict(params)
        out.update({alias: params[name] for alias, name in self.aliases.items() if name in params})
        out.update({name: getattr(self, key).detach().cpu() for name, key in self.buffer_names.items()})
        return out

    # --- sharded state (torch.distributed.checkpoint) -------------------------------------------
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
        the dim that joins them costs one collective over those axes (autopar/runtime/plain_state.py).
        """
        self._sharded_state_supported()
        return sharded_state(self)

    def state_dict_names(self) -> list:
        """Every key state_dict() gives on some rank (a pipelined rank gives those of its
        stages): the plain model's parameter names, tied aliases and persistent buffers."""
        return state_names(self)

    def optimizer_state_dict(self, optimizer) -> dict:
        """The state of an optimizer from build_optimizer under parameter names, per-element
        state as DTensors (autopar/runtime/checkpoint.py): saved with torch.distributed.checkpoint
        beside state(), it loads into another plan or mesh with load_optimizer_state_dict."""
        self._sharded_state_supported()
        return optimizer_state_dict(self, optimizer)

    def load_optimizer_state_dict(self, optimizer, state: dict) -> None:
        self._sharded_state_supported()
        load_optimizer_state_dict(self, optimizer, state)

    def _sharded_state_supported(self) -> None:
        error = self.runner.sharded_state_error()
        if error:
            raise CompileError(error)

    def load_state_dict(self, state: dict, strict: bool = True, assign: bool = False):
        """Load a state dict under the plain model's names: the plain model's own
        state_dict() (a pretrained model's), full_state_dict(), or DTensors from state_dict() and
        torch.distributed.checkpoint (any plan or mesh); a fused weight whole (or as the parts
        of an older checkpoint), a tied weight under either of its names.  strict: every
        parameter and buffer must be there and nothing else (KeyError naming them);
        strict=False loads what fits and returns the missing and unexpected keys, as torch
        does."""
        return load_state(self, state, strict)

    def load_param(self, key: str, value) -> None:
        """Parameter `key` set from a DTensor or a whole tensor (its master weights too)."""
        p = self.shards[key]
        placements = tuple(self.plan.param_placements[self.name_of[key]])
        if isinstance(value, DTensor) and value.device_mesh == self.groups.mesh:
            local = value.redistribute(self.groups.mesh, placements).to_local()
        elif isinstance(value, DTensor):
            local = shard_of(value.full_tensor().to(p.device), placements, self.groups)
        else:
            local = shard_of(value.to(p.device), placements, self.groups)
        if local.data_ptr() != p.data_ptr():
            p.copy_(local.to(p.device, p.dtype))
        if key in self.masters:
            m = self.masters[key]
            lay = self.zero_layouts.get(key)
            src = local.detach().reshape(-1)[lay.start: lay.end] if lay is not None else local.detach()
            m.copy_(src.to(m.device, m.dtype).view_as(m))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient whole (ZeRO-2 chunks gathered), on every rank."""
        mine = {}
        for k in self.shards:
            grad = self.whole_grad(k)
            if grad is not None:
                mine[self.name_of[k]] = grad
        if not mine:  # no backward yet (the same on every rank)
            return {}
        return {n: g.cpu() for n, g in self.parts.join(self.runner.whole(mine)).items() if n in self.trained}

    def load_full_state_dict(self, state: dict) -> None:
        """Load whole tensors (full_state_dict(), the plain model's state_dict()) into the
        shards, master weights and buffers; KeyError if a parameter is missing."""
        result = self.load_state_dict(state, strict=False)
        missing = [n for n in result.missing_keys if n not in self.buffer_names]
        if missing:
            raise KeyError(f"state dict lacks parameters {sorted(missing)[:5]}")

def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def param_key(name: str) -> str:
    """A parameter's attribute name in the compiled module (dots become '__')."""
    return name.replace(".", "__")
