"""Strategy menus: what each node of the problem may choose."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import warnings

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.placements import grad_target
from autopar.mesh import Mesh
from autopar.ops import (
    INTERNAL_COMM, Strategy, annotate, enumerate_strategies, op_arg, op_name, replicated, show_placements)
from autopar.ops.attention_rule import ATTENTION_OPS, sequence_strategies
from autopar.ops.grid_rule import NORM_OPS, grid_strategies, matmul_grid_strategies, split_norm_strategies
from autopar.ops.experts_rule import experts_strategies
from autopar.ops.strategy import offload_label
from autopar.solve.problem.graph import PNode

log = logging.getLogger("autopar")

STAGE_MENU_BUDGET = 40_000   # choices: a pipeline stage's problem beyond it keeps pp's remainder for data
PLANNED_WITHOUT_GRAD = 256 * 2**20   # bytes: a tensor without gradient this large is planned, not made whole
HEADS_NOTE = "cannot be split by heads"   # in the note an attention's head count leaves (see _say_why_heads_stay_whole)


def build_menus(nodes: list, readers: dict, mesh: Mesh, data_axes: tuple = ()) -> tuple[list, list]:
    """Every representative node's strategies (ops from their annotation, parameters their
    storage layouts, gradient sums the layouts their gradients arrive in); returns the ops
    without a rule (run replicated) and the warnings said about them.  data_axes: mesh axes
    that only split the batch (keep_data_parallel) where the menus exceed STAGE_MENU_BUDGET."""
    fallback_ops: dict[str, list[str]] = {}
    messages: list[str] = []
    for pn in nodes:
        if pn.rep != pn.index:
            continue
        in_shapes = [nodes[s].out_shapes[o] for s, o in pn.inputs]
        needs = [nodes[s].requires_grad for s, o in pn.inputs]
        if pn.kind == "param":
            pn.strategies = param_menu(pn.out_shapes[0], mesh, pn.requires_grad)
        elif pn.kind == "input":
            pn.strategies = [replicated(0, 1, mesh.ndim, [])]
        elif pn.kind == "output":
            pn.strategies = [replicated(len(pn.inputs), 0, mesh.ndim, [False] * len(pn.inputs))]
        elif pn.kind == "gradsum":
            continue  # after the other menus: it lists the layouts they can produce
        elif not pn.requires_grad and _whole_bytes(pn) < PLANNED_WITHOUT_GRAD:
            # masks, positions, token ids: no gradient and no parameter behind them, so
            # they are made whole on every rank and each consumer slices what it needs
            # (free); planning them would only grow the ILP.  A large one is planned (a
            # router's per-token masks, attention keys made by `empty`): whole, it would
            # hold its full size on every rank while it lives
            pn.strategies = [replicated(len(pn.inputs), len(pn.out_shapes), mesh.ndim, needs)]
        elif pn.op == "autopar.experts":
            pn.strategies = experts_strategies(in_shapes, mesh.shape, mesh.axis_names, needs)
        else:
            try:
                ann = annotate(pn.node, in_shapes, pn.out_shapes)
            except Exception as exc:  # a rule that does not fit this call: replicate, say so
                log.debug("rule for %s failed on %s: %s", pn.op, pn.name, exc)
                ann = None
            if ann is None and not pn.requires_grad:   # (a large mask without a rule: whole, as the small ones)
                pn.strategies = [replicated(len(pn.inputs), len(pn.out_shapes), mesh.ndim, needs)]
            elif ann is None:
                pn.fallback = True
                fallback_ops.setdefault(pn.op, []).append(pn.module or pn.name)
                pn.strategies = [replicated(len(pn.inputs), len(pn.out_shapes), mesh.ndim, needs)]
            else:
                pn.strategies = enumerate_strategies(ann, in_shapes, pn.out_shapes, mesh.shape,
                                                     mesh.axis_names, needs)
                if pn.op in ATTENTION_OPS:
                    _say_why_heads_stay_whole(pn, in_shapes, mesh, messages)
                    pn.strategies = pn.strategies + _sequence_split(pn, in_shapes, mesh, messages)
                if pn.op == "aten.linear":
                    pn.strategies = pn.strategies + grid_strategies(in_shapes, pn.out_shapes[0], mesh.shape,
                                                                    mesh.axis_names, needs)
                elif pn.op == "aten.matmul":
                    pn.strategies = pn.strategies + matmul_grid_strategies(in_shapes, pn.out_shapes[0], mesh.shape,
                                                                           mesh.axis_names, needs)
                elif pn.op in NORM_OPS and len(op_arg(pn.node, 1, "normalized_shape", ())) == 1 \
                        and sum(1 for n in mesh.shape if n > 1) > 1:   # (with the grid's linear layers)
                    pn.strategies = pn.strategies + split_norm_strategies(pn.strategies, in_shapes, mesh.shape,
                                                                          mesh.axis_names, pn.op == "aten.rms_norm")
                internal = [(l, INTERNAL_COMM[(pn.op, l)]) for l in ann.letters() if (pn.op, l) in INTERNAL_COMM]
                if internal:
                    pn.strategies = [with_internal(s, internal) for s in pn.strategies]
    if data_axes and sum(len(pn.strategies) for pn in nodes if pn.rep == pn.index) > STAGE_MENU_BUDGET:
        keep_data_parallel(nodes, data_axes, mesh)
    for pn in nodes:
        if pn.kind == "gradsum" and pn.rep == pn.index:
            pn.strategies = gradsum_menu(nodes, readers, pn)
    for op, where in fallback_ops.items():
        msg = (f"autopar: no sharding rule for {op} (in {', '.join(sorted(set(where))[:3])}); it runs "
               f"replicated on every rank. Add a rule in autopar/ops/rules.py to shard it.")
        messages.append(msg)
        warnings.warn(msg, stacklevel=3)
    return sorted(fallback_ops), messages


def stage_data_axes(mesh: Mesh) -> tuple:
    """The axes a pipeline stage's problem may use for data parallelism alone: what is left
    of the axis named "pp" inside a stage, on a stage mesh of three or more axes.  The user
    named it for pipelining (Megatron-LM's and torchtitan's pp x dp x tp), and on three
    axes every op's menu is the cube of its letters: DeepSeek-V3's stage problems on
    2 x 8 x 8 devices (67,000 choices) were CP-SAT models of a million variables, a minute
    each, dozens of them; with the batch (or the experts) alone on that axis they are a few
    times smaller.  build_menus restricts them only beyond STAGE_MENU_BUDGET choices: the
    405B-shaped Llama's stages (19,000) keep their full menus, which its best plan needs
    (2.49 s a step; 5.45 s restricted)."""
    names = tuple(mesh.axis_names)
    if "pp" not in names or sum(1 for n in mesh.shape if n > 1) < 3 or mesh.shape[names.index("pp")] == 1:
        return ()
    return (names.index("pp"),)


def keep_data_parallel(nodes: list, axes: tuple, mesh: Mesh) -> None:
    """Cut every op's menu to the strategies that are data parallel on `axes`: the
    parameters it reads used whole there (stored whole or ZeRO-3 sharded and gathered) and
    its output split there by its first dim (the batch, as the tokens lead every tensor
    of a transformer) or whole, or, for a scalar (the loss), summed; or, for a mixture of
    experts, expert parallel there (the tokens split, the experts spread, all-to-all
    between: DeepSeek-V3's EP 64 spans nodes).  On the gradient path
    an op that reads the batch must split it.  Parameters keep their whole menu (whole,
    ZeRO-1/2/3, offloaded).  A node none of whose strategies qualifies (a microbatch that
    does not divide) keeps its menu."""
    axes = tuple(a for a in axes if mesh.shape[a] > 1)

    def expert_parallel(pn, s, a) -> bool:   # tokens split, experts spread over the axis (all-to-all)
        return pn.op == "autopar.experts" and s.split[a] == "te"

    def batch_split(s, a, scalar) -> bool:
        p = s.outputs[0][a] if s.outputs else Replicate()
        return (isinstance(p, Shard) and p.dim == 0) or (scalar and isinstance(p, Partial))

    for pn in nodes:
        if pn.rep != pn.index or pn.kind != "op" or len(pn.strategies) < 2 or not axes:
            continue
        params = [k for k, (src, _) in enumerate(pn.inputs) if nodes[src].kind == "param"]
        must = pn.requires_grad and pn.from_input
        scalar = not pn.out_shapes or math.prod(pn.out_shapes[0]) == 1
        def data_parallel(s, a) -> bool:
            return (all(isinstance(s.inputs[k][a], Replicate) for k in params)
                    and (batch_split(s, a, scalar) or (not must and s.split[a] is None)))
        kept = [s for s in pn.strategies if all(expert_parallel(pn, s, a) or data_parallel(s, a) for a in axes)]
        if kept:
            pn.strategies = kept


def _whole_bytes(pn: PNode) -> int:
    """Bytes of the node's outputs, whole."""
    return sum(math.prod(shape) * (dtype.itemsize if isinstance(dtype, torch.dtype) else 4)
               for shape, dtype in zip(pn.out_shapes, pn.out_dtypes))


def _say_why_heads_stay_whole(pn: PNode, in_shapes, mesh: Mesh, messages: list) -> None:
    """One note per head count and mesh axis that cannot split attention heads (the planner
    logs the chosen plan's notes once: a pipeline search builds many problems)."""
    heads = _heads_before_view(pn.node.args[0]) or in_shapes[0][1]
    kv = (_heads_before_view(pn.node.args[1]) or in_shapes[1][1]) if len(in_shapes) > 1 else heads
    for name, n in zip(mesh.axis_names, mesh.shape):
        if n > 1 and (heads % n or kv % n):
            msg = (f"autopar: attention in {pn.module or pn.name} has {heads} query and {kv} key/value heads, "
                   f"which do not divide over mesh axis {name!r} of {n}: its projections {HEADS_NOTE} "
                   f"on that axis (a rank would hold part of a head), so the plan gathers them there, splits "
                   f"the batch, or keeps attention whole. For tensor parallelism over heads use an axis whose "
                   f"size divides {math.gcd(heads, kv)}")
            if msg.split(" has ", 1)[1] not in {m.split(" has ", 1)[-1] for m in messages}:
                messages.append(msg)


def _sequence_split(pn: PNode, in_shapes, mesh: Mesh, messages: list) -> list:
    """Ring and Ulysses strategies of an attention node; why a form is left off goes to the
    plan's notes (once per reason)."""
    node = pn.node
    if pn.op == "autopar.window_attention":
        causal, dropout = True, False
    else:
        causal = bool(op_arg(node, 5, "is_causal", False))
        dropout = float(op_arg(node, 4, "dropout_p", 0.0) or 0.0) != 0.0
    why: list = []
    out = sequence_strategies(pn.strategies, in_shapes, pn.out_shapes[0], mesh.shape, mesh.axis_names,
                              causal=causal, has_mask=len(in_shapes) > 3, dropout=dropout, why=why)
    for reason in why:
        msg = f"autopar: sequence split of attention in {pn.module or pn.name}: {reason}"
        if msg.split(": ", 2)[-1] not in {m.split(": ", 2)[-1] for m in messages}:
            messages.append(msg)
            log.info(msg)
    return out


def _heads_before_view(node, depth: int = 12):
    """The head count where a projection's output [..., heads * head_dim] is viewed as
    [..., heads, head_dim], found walking back from an attention operand through the
    transposes, repeats (grouped-query attention's repeat_kv) and casts; None if not found."""
    for _ in range(depth):
        if not hasattr(node, "args") or not node.args or not hasattr(node.args[0], "meta"):
            return None
        src = node.args[0]
        out, inp = node.meta.get("val"), src.meta.get("val")
        if node.op == "call_function" and op_name(node) in ("aten.view", "aten.reshape", "aten._unsafe_view") \
                and isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dim() == inp.dim() + 1 \
                and out.dim() >= 2 and out.shape[-2] * out.shape[-1] == inp.shape[-1]:
            return int(out.shape[-2])
        node = src
    return None


def gradsum_menu(nodes: list, readers: dict, gs: PNode) -> list[Strategy]:
    """The layouts a gradient sum may add in: those its producer's gradient must reach and
    those its readers' gradients arrive in."""
    src, out = gs.source
    layouts: dict = {}
    for s in nodes[nodes[src].rep].strategies:
        layouts.setdefault(tuple(grad_target(p) for p in s.outputs[out]), None)
    for v, k in readers[(src, out)]:
        for s in nodes[nodes[v].rep].strategies:
            if s.grads[k] is not None:
                layouts.setdefault(tuple(s.grads[k]), None)
    return [Strategy(tuple(None for _ in layout), (), (layout,), (), 1, "sum " + show_placements(layout))
            for layout in layouts]


def zero_layout(layout: tuple, axes: tuple) -> tuple:
    """`layout` split further over the ZeRO `axes` (where it is Replicate): the flat chunks
    each rank owns.  Shard(0) stands for "a 1/n chunk"; only sizes matter to the costs."""
    return tuple(Shard(0) if a in axes else p for a, p in enumerate(layout))


def param_menu(shape, mesh: Mesh, trainable: bool = True) -> list[Strategy]:
    """Storage layouts of a parameter: per axis Replicate or Shard of a dim it divides
    (Shard on an axis whose ops read it whole is ZeRO-3); for a trainable parameter stored
    whole on some axes, also ZeRO-1, ZeRO-2 and ZeRO-2 with its optimizer states offloaded
    (to host memory, and to disk where the device has a disk tier) over those axes; for one
    stored split on every axis, offloaded to either tier, its stored shard with them or not
    (Strategy.offload_weights)."""
    per_axis = []
    for n in mesh.shape:
        opts = [Replicate()]
        if n > 1:
            opts += [Shard(d) for d, size in enumerate(shape)]
        per_axis.append(opts)
    menu = []
    tiers = ("host", "disk") if mesh.device.disk_memory > 0 else ("host",)
    for combo in itertools.product(*per_axis):
        factor = {}
        for p, n in zip(combo, mesh.shape):
            if isinstance(p, Shard):
                factor[p.dim] = factor.get(p.dim, 1) * n
        if any(shape[d] % f for d, f in factor.items()):
            continue
        name = " ".join(f"{ax}=S({p.dim})" for ax, p in zip(mesh.axis_names, combo)
                        if isinstance(p, Shard)) or "replicate"
        base = Strategy(tuple(None for _ in combo), (), (tuple(combo),), (), 1, name)
        menu.append(base)
        if not trainable:
            continue
        whole = tuple(a for a, (p, n) in enumerate(zip(combo, mesh.shape)) if isinstance(p, Replicate) and n > 1)
        over = "+".join(mesh.axis_names[a] for a in whole)
        if whole:
            for stage, offload in ((1, ""), (2, "")) + tuple((2, tier) for tier in tiers):
                menu.append(dataclasses.replace(
                    base, name=", ".join(t for t in (f"{name}, zero-{stage} over {over}", offload_label(offload)) if t),
                    zero=stage, zero_axes=whole, offload=offload))
        else:
            menu += [dataclasses.replace(base, name=f"{name}, {offload_label(tier, weights)}", offload=tier,
                                         offload_weights=weights) for tier in tiers for weights in (False, True)]
    return menu


def with_internal(s: Strategy, internal) -> Strategy:
    """Add the collectives a named strategy runs inside the op (vocabulary-parallel loss)."""
    steps = list(s.comm)
    for axis, letter in enumerate(s.split):
        for l, comms in internal:
            if letter == l:
                for kind, per_row in comms:
                    steps.append((kind, axis, per_row))
    if not steps:
        return s
    return Strategy(s.split, s.inputs, s.outputs, s.grads, s.factor, s.name + " (vocab-parallel)", tuple(steps),
                    reduced=s.reduced)


