"""What each node costs under each of its strategies (NodePrices): an op's seconds and the
bytes it keeps and works in, a parameter's model states, optimizer step and ZeRO gathers."""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar import placements as P
from autopar.cost import kernels as K
from autopar.cost import prices as C
from autopar.mesh import Mesh
from autopar.ops import Strategy, op_arg
from autopar.ops.attention_rule import ATTENTION_OPS
from autopar.ops.rules import VIEWS
from autopar.solve.problem import fusion
from autopar.solve.problem.graph import Choice, PNode
from autopar.solve.problem.menus import zero_layout
from autopar.solve.problem.pricing import Pricing, Remembered
from autopar.solve.problem.saved_memory import SavedMemory


class NodePrices:
    """choices[rep]: one Choice per strategy of each representative node (identical layers
    share them), priced on `mesh` for `pricing`; chains: the backend's fused chains
    (fusion.fused_chains); saved: what the ops keep for backward; mixed: whether the model
    trains under mixed precision (float32 master weights in the optimizer state)."""

    def __init__(self, nodes: list, mesh: Mesh, pricing: Pricing, mixed: bool, chains: dict,
                 saved: SavedMemory, remembered: Remembered):
        self.nodes, self.mesh, self.pricing, self.mixed = nodes, mesh, pricing, mixed
        self.chains, self.saved, self.remembered = chains, saved, remembered
        self.choices: dict[int, list[Choice]] = {}
        for pn in nodes:
            if pn.rep != pn.index:
                continue
            work = (C.measure_flops(pn.node, [nodes[src].requires_grad for src, _ in pn.inputs])
                    if pn.kind == "op" else C.OpWork(0.0, 0.0))
            self.choices[pn.index] = [self._choice(pn, s, work) for s in pn.strategies]

    def launches(self, pn: PNode) -> bool:
        """Whether op pn launches a kernel of its own (fusion.launches)."""
        return fusion.launches(pn, self.pricing.backend, self.chains)

    def _choice(self, pn: PNode, s: Strategy, work: C.OpWork) -> Choice:
        mesh = self.mesh
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        comm = [0.0] * mesh.ndim
        if pn.kind == "param":
            return self._param_choice(pn, s)
        if pn.kind != "op":
            return Choice(0.0, tuple(comm), mem)
        read = [P.local_numel(self.nodes[src].out_shapes[o], p, mesh.shape) * self.nodes[src].out_dtypes[o].itemsize
                for (src, o), p in zip(pn.inputs, s.inputs)]
        in_bytes = sum(read)
        out_bytes = sum(P.local_numel(shape, p, mesh.shape) * d.itemsize
                        for shape, d, p in zip(pn.out_shapes, pn.out_dtypes, s.outputs))
        dtype = pn.out_dtypes[0] if pn.out_dtypes else torch.float32
        forward = 0.0
        fused_in, kept, _ = self.chains.get(pn.index, ((), False, True))
        moved = sum(b for k, b in enumerate(read) if k not in fused_in) + (0.0 if kept else out_bytes)
        head = self.launches(pn)
        if pn.op in VIEWS:
            compute = 0.0
        else:
            compute = forward = self._op_seconds(pn, s, work.fwd_flops / s.factor, moved, dtype, launches=head)
            if pn.requires_grad:
                compute += self._op_seconds(pn, s, work.bwd_flops / s.factor, 2 * moved, dtype, backward=True,
                                            launches=head)
        # kept for backward (SavedMemory): a storage several ops keep is stored once, so
        # each holder carries its share
        saved = self.saved
        mem["activations"] = sum(saved.held_bytes(pn, s, it) / (saved.savers[it[0]] if it[0] is not None else 1)
                                 for it in saved.kept_holdings.get(pn.index, ()))
        for kind, axis, nbytes, _ in self.internal_collectives(pn, s):   # a named strategy's own
            comm[axis] += C.collective_time(kind, nbytes, axis, mesh)
        if pn.op == "autopar.experts":  # experts split: the step waits for the busiest rank
            uneven = self.routing_factor(pn, s)
            compute, forward = compute * uneven, forward * uneven
            comm = [t * uneven for t in comm]
        # working memory: while the op runs backward, the gradients of its outputs, of its
        # inputs and of the tensors it makes and keeps (a composite's inner results, such as
        # a cross entropy's log-probabilities) are live beside what was saved; a view
        # allocates nothing; a fused cross-entropy kernel (KernelEfficiency.cross_entropy)
        # writes the logits' gradient alone
        inner = 0.0 if self._fused_loss(pn) else sum(
            saved.held_bytes(pn, s, it) for it in saved.holdings.get(pn.index, ()) if it[1] == "new")
        work = 0.0 if pn.op in VIEWS else in_bytes + out_bytes + inner
        return Choice(compute, tuple(comm), mem, forward_s=forward + sum(comm) / 2, work=work)

    def _fused_loss(self, pn: PNode) -> bool:
        """Whether `pn` is a cross entropy the device's kernels run fused."""
        kernels = self.mesh.device.kernels
        return pn.op == "aten.cross_entropy_loss" and kernels is not None and kernels.cross_entropy == "fused"

    def internal_collectives(self, pn: PNode, s: Strategy) -> list:
        """(kind, axis, bytes, phase) of each collective a named strategy runs inside the op
        (ring and Ulysses attention, expert parallelism, the vocabulary-parallel loss): its
        per-row entries (kind, axis, elements per row[, phase]) on the rows this rank holds."""
        if not s.comm:
            return []
        first = self.nodes[pn.inputs[0][0]]
        rows_shape = first.out_shapes[pn.inputs[0][1]][:1]
        item = first.out_dtypes[pn.inputs[0][1]].itemsize
        rows = P.local_numel(rows_shape, [p if isinstance(p, Shard) and p.dim == 0 else Replicate()
                                          for p in s.inputs[0]], self.mesh.shape)
        return [(kind, axis, per_row * item * rows, rest[0] if rest else "forward")
                for kind, axis, per_row, *rest in s.comm]

    def _op_seconds(self, pn: PNode, s: Strategy, flops: float, nbytes: float, dtype, backward: bool = False,
                    launches: bool = True) -> float:
        """Seconds of one op's forward (or backward: two kernels) under strategy s: by its
        kernel's shape on a device that describes its kernels (cost.kernels), else a
        roofline.  launches: False for an op fused into its chain's kernel (no launch)."""
        mesh = self.mesh
        count = (2 if backward else 1) if launches else 0
        if mesh.device.kernels is None:
            seconds = C.roofline(flops, nbytes, dtype, mesh, kernels=count, attention=pn.op in ATTENTION_OPS)
        else:
            shapes = [P.local_shape_ceil(self.nodes[src].out_shapes[o], p, mesh.shape)
                      for (src, o), p in zip(pn.inputs, s.inputs)]
            seconds = K.seconds(K.kernel_of(pn.op, pn.node, shapes), flops, nbytes, dtype, mesh, backward=backward,
                                count=count)
        key = K.pointwise_key(pn.op, pn.node)
        if key == "aten.gelu:tanh" and self.pricing.backend == "inductor" \
                and mesh.device.pointwise_seconds("aten.sigmoid"):
            key = "aten.sigmoid"   # (compiled as x * sigmoid(2 z) on CPU: runtime/regions/inductor.with_sigmoid_gelus)
        measured = mesh.device.pointwise_seconds(key) if mesh.device.pointwise else None
        if measured is None:
            return seconds
        # evaluated per element of its first operand (the rank's share), below the bandwidth
        # where the device measured it so (DeviceSpec.pointwise: a CPU's)
        (src, o), placement = pn.inputs[0], s.inputs[0]
        elements = P.local_numel(self.nodes[src].out_shapes[o], placement, mesh.shape)
        return max(seconds, elements * measured[1 if backward else 0] + count * mesh.device.op_latency)

    def routing_factor(self, pn: PNode, s: Strategy) -> float:
        """How much longer than balanced routing a mixture-of-experts op runs under strategy
        s: its busiest expert-holding rank's load over the mean (1 where experts are whole)."""
        ways = math.prod(self.mesh.shape[a] for a, kind in enumerate(s.split) if kind in ("e", "te"))
        if ways <= 1:
            return 1.0
        imbalance = self.pricing.moe_imbalance
        if isinstance(imbalance, dict) and ways in imbalance:   # measured
            factor = float(imbalance[ways])
        elif imbalance is not None and not isinstance(imbalance, dict):
            factor = float(imbalance)
        else:
            src, o = pn.inputs[1]
            factor = C.routing_imbalance(math.prod(self.nodes[src].out_shapes[o]), ways)
        capacity = float(op_arg(pn.node, 11, "capacity", 0.0) or 0.0) if pn.node is not None else 0.0   # a router that caps every expert caps every rank
        return max(1.0, min(factor, capacity)) if capacity > 0 else factor

    def _param_choice(self, pn: PNode, s: Strategy) -> Choice:
        """Model states of a parameter stored in layout s.outputs[0] (ZeRO, Rajbhandari et al.
        2020): weights `item` bytes per local element, gradients `item`, optimizer states
        C.state_bytes (Adam's two moments, plus float32 master weights under mixed
        precision).  ZeRO-1/2 over axes Z of n ranks: each rank keeps ceil(local / n)
        elements of the optimizer state (and, stage 2, of the gradient), steps only those
        (cost.optimizer_seconds), and after the optimizer step the updated parameter is
        all-gathered over Z.  Offload moves the
        optimizer state to host memory or disk (s.offload) and pays the host link for the
        gradient going down and the weights coming up, the host's optimizer step, and on
        disk the states' reads and writes (C.offload_seconds).  Offloaded weights
        (s.offload_weights) take no device bytes between uses, their gradient none either
        (it accumulates in host memory), and cross the host link at each use."""
        mesh, mixed = self.mesh, self.mixed
        comm = [0.0] * mesh.ndim
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        layout = s.outputs[0]
        numel = P.local_numel(pn.out_shapes[0], layout, mesh.shape)
        item = pn.out_dtypes[0].itemsize
        mem["params"] = 0.0 if s.offload_weights else numel * item
        if not pn.requires_grad:
            return Choice(0.0, tuple(comm), mem, numel * item)
        state = C.state_bytes(item, mixed)
        n = math.prod(mesh.shape[a] for a in s.zero_axes)
        owned = math.ceil(numel / n) if s.zero else numel
        # (accumulating, a ZeRO-2 rank keeps the whole local gradient until the last micro-step)
        mem["grads"] = 0.0 if s.offload_weights else (owned if s.zero == 2 and self.pricing.accumulation == 1
                                                      else numel) * item
        mem["optimizer"] = 0.0 if s.offload else owned * state
        compute = C.optimizer_seconds(owned, item, mixed, mesh,
                                      fused=self.pricing.backend == "inductor") if not s.offload else 0.0
        for st in self.zero_gather_steps(pn, s):
            comm[st.axis] += st.seconds
        if s.offload:
            compute = C.offload_seconds(s.offload, owned, item, mixed, mesh.device, s.offload_weights)
        compute += self._step_copies(pn, s, 0.0 if s.offload_weights else (owned if s.zero == 2 else numel) * item)
        compute *= self.pricing.once
        step = 0.0 if s.offload else owned * C.step_temporary_bytes(item, mixed, self._foreach_step)
        return Choice(compute, tuple(comm), mem, numel * (2 * item + state), step_memory=step)

    def _step_copies(self, pn: PNode, s: Strategy, grad_bytes: float) -> float:
        """Seconds of a parameter's memory passes around its optimizer step besides the
        step itself: the finite check reading its gradient (runtime/checks/faults.check_step: one
        read of `grad_bytes`, this rank's gradient after synchronisation) and, for ZeRO-1/2,
        the flat buffer's copies of the updated chunks' all-gather (zero.all_gather_chunks,
        prices.bucket_copy_bytes), one price per pair of layouts."""
        nbytes = grad_bytes
        if s.zero:
            layout = s.outputs[0]
            whole = math.prod(pn.out_shapes[0]) * pn.out_dtypes[0].itemsize
            pair = (C.layout_code(zero_layout(layout, s.zero_axes)), C.layout_code(layout))
            per_byte = self.remembered("gather copies", pair,
                                       lambda: C.redistribute_price(*pair, self.mesh)[C.Row.COPY_GATHER, 0])
            nbytes += per_byte * whole
        return C.copy_seconds(nbytes, self.mesh)

    def zero_gather_steps(self, pn: PNode, s: Strategy) -> tuple:
        """The all-gathers that spread a ZeRO-1/2 parameter's updated chunks after the step."""
        if not s.zero:
            return ()
        layout = s.outputs[0]
        shape, item = pn.out_shapes[0], pn.out_dtypes[0].itemsize
        steps = self.remembered.redistribution(shape, item, zero_layout(layout, s.zero_axes), layout)
        return self.pricing.once_per_step(C.bucketed(steps, math.prod(shape) * item, ("all_gather",)))

    @property
    def _foreach_step(self) -> bool:
        """Whether the optimizer step runs torch's multi-tensor kernels, whose temporaries
        span the parameters stepped together: on a GPU, unless the backend "inductor" runs
        the fused kernel (runtime/state/optimizer.fused_options)."""
        return self.mesh.device.asynchronous and self.pricing.backend != "inductor"

    def step_memory(self, choice: dict) -> float:
        """The optimizer step's temporaries under a solved choice (cost.prices.step_temporary_total)."""
        return C.step_temporary_total((self.choices[pn.rep][choice[pn.index]].step_memory for pn in self.nodes
                                       if pn.kind == "param"), self.mixed, self._foreach_step)
