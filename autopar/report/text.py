"""The plan as text a person reads in a terminal: a summary (prediction, solver, budget,
pipeline, precision, model states, hand-written layouts, collectives) and a per-module
table whose identical repeated layers collapse into one row."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from autopar.ops.attention_rule import ATTENTION_OPS
from autopar.ops.grid_rule import GRID_FORMS
from autopar.ops.strategy import crossed_axes, offload_label
from autopar.placements import show_placements as show
from autopar.report.records import format_bytes, format_seconds
from autopar.trace.paths import layer_path


def sequence_lines(plan) -> list:
    """How the plan splits the sequence: the attention strategies (ring, Ulysses) and
    Megatron-SP (a tensor-parallel axis whose Partial sums are reduce-scattered into
    sequence shards, and gathered back before the next column-parallel matmul), then the
    notes saying why a form was left off."""
    lines = []
    kinds = Counter(f"{ax}={k}" for n in plan.nodes if n.op in ATTENTION_OPS
                    for ax, k in zip(plan.mesh.axis_names, n.split) if k in ("ring", "ulysses"))
    if kinds:
        lines.append("sequence split in attention: " + ", ".join(f"{k} ({v} nodes)" for k, v in sorted(kinds.items())))
    if any(k.endswith("=ring") for k in kinds):
        lines.append("ring attention balances causal masks in the zigzag layout: of 2n chunks, rank r computes the "
                     "queries of chunks r and 2n-1-r (exchanged into that order inside the op and back)")
    grids = Counter(n.strategy.split(" [", 1)[0] + " on " + n.strategy.split(" [", 1)[1].rstrip("]")
                    for n in plan.nodes if n.op in ("aten.linear", "aten.matmul")
                    and n.strategy.split(" ", 1)[0] in GRID_FORMS)
    if grids:
        lines.append("grid tensor parallelism: " + ", ".join(f"{k} ({v} linear layers)" for k, v in sorted(grids.items()))
                     + "; activations and weights split over the grid's axes, each layer gathering its blocks")
    crossed = Counter(" x ".join(sorted(plan.mesh.axis_names[a] for a in pair))
                      for n in plan.nodes if n.op == "aten.linear" and (pair := crossed_axes(n.split)))
    if crossed:
        lines.append("2D tensor parallelism (weight-stationary): " + ", ".join(
            f"{k} ({v} linear layers)" for k, v in sorted(crossed.items()))
            + "; each weight split by columns on one axis and by rows on the other, never moved; each layer's "
              "partial sums reduced over its row axis")
    for ax in megatron_sp_axes(plan):
        lines.append(f"sequence parallel (Megatron-SP) on {ax}: activations between the tensor-parallel matmuls are "
                     f"split by sequence; reduce-scatter after each block and all-gather before it replace its all-reduce")
    for note in plan.notes:
        lines.append(f"note: {note}")
    return lines


def megatron_sp_axes(plan) -> list:
    """Axes on which forward Partial sums are reduce-scattered (not all-reduced) and the
    same axis all-gathers before matmuls: Megatron-SP."""
    tally = Counter((c.kind, c.axes) for c in plan.collectives if c.phase == "forward")
    return [ax for ax in plan.mesh.axis_names
            if tally[("reduce_scatter", (ax,))] and tally[("all_gather", (ax,))]
            and tally[("reduce_scatter", (ax,))] >= tally[("all_reduce", (ax,))]]


def recompute_line(plan) -> str:
    """Which layers recompute in backward, how, what it saves and what it costs."""
    r = plan.recompute
    how = "" if r is None or r.forced is None else f" (forced: recompute={r.forced!r})"
    if r is None or not r.layers:
        return "recompute: none, every layer keeps its activations" + how
    by_mode = defaultdict(list)
    for path, mode in r.layers.items():
        by_mode[mode].append(path)
    parts = []
    for mode, paths in sorted(by_mode.items()):
        what = "activations offloaded to host memory" if mode == "offload" else mode
        parts.append(f"{what} on {len(paths)} layers ({_span(paths)})")
    text = (f"recompute: {'; '.join(parts)}{how}; saves {format_bytes(r.saved_bytes)} of activations per device, "
            f"adds {format_seconds(r.added_s)} per step")
    return text + (f"; {r.note}" if r.note else "")


def _span(paths: list) -> str:
    """'blocks.0, blocks.2, ... blocks.30' style: the first two and the last."""
    return ", ".join(paths) if len(paths) <= 3 else f"{paths[0]}, {paths[1]}, ... {paths[-1]}"


def plan_text(plan) -> str:
    """The printed plan: prediction, solver, budget, pipeline, precision, model states, the
    hand-written layouts beside it, the collectives per step and the per-module table."""
    axes = plan.mesh.axis_names
    shape = plan.mesh.shape
    lines = [f"autopar plan ({plan.origin}) for {plan.model} on mesh "
             + " x ".join(f"{a}={s}" for a, s in zip(axes, shape))
             + f" ({plan.mesh.device.name})",
             f"predicted: {plan.predicted}"]
    s = plan.solver
    if not s.solved:
        state = "not solved (" + plan.origin + ")"
    else:
        state = "optimal" if s.optimal else f"feasible (gap {s.gap or 0:.2%})"
    t = plan.timing
    size = f", {s.variables} variables, {s.constraints} constraints" if s.variables is not None else ""
    lines.append(f"solver: {state}{size}; planned in {t.total_s:.2f}s (trace {t.trace_s:.2f}s, "
                 f"menus and costs {t.costs_s:.2f}s, ILP {t.solve_s:.2f}s)")
    if not plan.tp_overlap:
        lines.append("tensor-parallel collectives run whole, not beside their GEMMs (tp_overlap=False)")
    staged = plan.pipeline is not None and plan.pipeline.pipelined
    if plan.accumulation > 1 and staged:
        lines.append(f"a stage accumulates its gradients over the step's {plan.accumulation} microbatches: the step "
                     f"above is one microbatch's, with the optimizer step, the gradient reductions and ZeRO-1/2's "
                     f"gathers shared over the {plan.accumulation}")
    elif plan.accumulation > 1:
        lines.append(f"priced for gradient accumulation over {plan.accumulation} micro-steps (cm.no_sync() around "
                     f"all but the last): the step above is one micro-step's, with the optimizer step, the "
                     f"gradient reductions and ZeRO-1/2's gathers shared over the {plan.accumulation}")
    if plan.backend != "eager":
        lines.append(f"priced for backend {plan.backend}: chains of memory-bound ops as one fused kernel each "
                     f"(compile with backend={plan.backend!r})")
    if plan.memory_budget:
        lines.append(f"memory budget: {format_bytes(plan.memory_budget)} per device")
    if plan.pipeline is not None:
        lines.append(plan.pipeline.summary + ("; the table below is one stage's plan for one microbatch"
                                              if plan.pipeline.pipelined else ""))
    if plan.precision is not None:
        p = plan.precision.to_dict()
        lines.append(f"precision: compute {p['param_dtype']}, float32 master weights, "
                     f"gradients reduced in {p['reduce_dtype']}")
    states = Counter()
    for name in plan.param_placements:
        st = plan.param_states.get(name)
        label = f"zero-{plan.zero_stage(name)}" + (f", {offload_label(st.offload, st.weights)}"
                                                    if st is not None and st.offload else "")
        states[label] += 1
    if states:
        lines.append("model states: " + "; ".join(f"{k}: {v} parameters" for k, v in sorted(states.items())))
    if plan.fallback_ops:
        lines.append(f"replicated (no sharding rule): {', '.join(plan.fallback_ops)}")
    experts = sorted({n.strategy for n in plan.nodes if n.op == "autopar.experts"})
    if experts:
        lines.append(f"mixture of experts ({', '.join(experts)}): an op whose experts are split runs as long as "
                     f"its busiest rank (the note below says what routing was priced)")
    lines.extend(sequence_lines(plan))
    lines.append(recompute_line(plan))
    lines.extend(_baseline_lines(plan))
    lines.append("")
    lines.append("collectives per step:")
    groups = collective_groups(plan)
    for key, cs in groups:
        how = ", ".join(f"{n} {a}" for a, n in sorted(Counter(c.algorithm for c in cs).items()))
        lines.append(f"  {key[0]:<9}{key[1]:<15} on {key[2]:<8}{len(cs):>6} x, {format_bytes(sum(c.nbytes for c in cs))} total"
                     f" (priced as {how})")
    if not groups:
        lines.append("  none")
    lines.append("")
    lines.append(plan_table(plan))
    return "\n".join(lines)


def _baseline_lines(plan) -> list:
    """The hand-written layouts beside the plan (none where it was made without them)."""
    if not plan.baselines:
        return []
    lines = ["", "hand-written layouts on the same mesh (predicted):",
             f"  {'layout':<22}{'step':>12}{'memory':>12}{'vs plan':>10}",
             f"  {'autopar':<22}{format_seconds(plan.predicted.step_s):>12}{format_bytes(plan.predicted.memory_total):>12}{'1.00x':>10}"]
    limit = plan.memory_budget or plan.mesh.device.memory
    for name, p in plan.baselines.items():
        if not isinstance(p, str):
            ratio = p.step_s / plan.predicted.step_s if plan.predicted.step_s else float("nan")
            fits = "" if p.memory_total <= limit else f"  does not fit {format_bytes(limit)}"
            lines.append(f"  {name:<22}{format_seconds(p.step_s):>12}{format_bytes(p.memory_total):>12}{ratio:>9.2f}x{fits}")
        else:
            lines.append(f"  {name:<22}  not possible: {p}")
    return lines


@dataclass(frozen=True)
class TableRow:
    """One row of the per-module table: the nodes of identical repeated layers that share
    module (with the layer index as "{}"), op, strategy and output layout, in graph order.
    label: "layers.0-31.attention.wq x32" style; seconds: compute and communication."""

    label: str
    op: str
    strategy: str
    layout: str
    nodes: tuple

    @property
    def count(self) -> int:
        return len(self.nodes)

    @property
    def seconds(self) -> float:
        return sum(n.compute_s + n.comm_s for n in self.nodes)

    @property
    def comm_s(self) -> float:
        return sum(n.comm_s for n in self.nodes)

    @property
    def memory(self) -> float:
        return sum(n.memory for n in self.nodes)


def table_rows(plan) -> list:
    """The per-module table as TableRows: every node but inputs and outputs, in graph order,
    identical repeated layers collapsed into one row (the terminal and the HTML report)."""
    groups: dict = {}
    for n in plan.nodes:
        if n.op in _HIDDEN_OPS:
            continue
        generic, idx = _generic(n.module, plan.layers)
        groups.setdefault((generic, n.op, n.strategy, node_layout(n)), []).append((idx, n))
    rows = []
    for (generic, op, strategy, layout), members in groups.items():
        idxs = {i for i, _ in members}
        label = generic
        if idxs != {None}:
            ix = sorted(i for i in idxs if i is not None)
            span = f"{ix[0]}-{ix[-1]}" if len(ix) > 1 else str(ix[0])
            label = generic.replace("{}", span, 1)
        if len(members) > 1:
            label += f" x{len(members)}"
        rows.append(TableRow(label, op, strategy, layout, tuple(n for _, n in members)))
    return rows


def collective_groups(plan) -> list:
    """The plan's collectives per (phase, kind, axes joined by '+'), sorted:
    [(key, [Collective, ...]), ...]."""
    groups = defaultdict(list)
    for c in plan.collectives:
        groups[(c.phase, c.kind, "+".join(c.axes))].append(c)
    return sorted(groups.items())


def plan_table(plan) -> str:
    """One row per parameter and compute node; identical repeated layers collapse to one row."""
    header = f"{'module':<40} {'op':<30} {'layout':<34} {'time':>10} {'memory':>10}"
    rows = [header, "-" * len(header)]
    for r in table_rows(plan):
        rows.append(f"{r.label[:40]:<40} {r.op.replace('aten.', '')[:30]:<30} {(r.strategy + ' ' + r.layout)[:34]:<34} "
                    f"{format_seconds(r.seconds):>10} {format_bytes(r.memory):>10}")
    return "\n".join(rows)


_HIDDEN_OPS = {"input", "output"}


def node_layout(n) -> str:
    """A node's output placements per tensor, "-> (S(0), R)"; empty for a parameter."""
    if n.op == "parameter":
        return ""
    return "-> " + " ".join(show(p) for p in n.outputs)


def _generic(module: str, layers) -> tuple[str, int | None]:
    for prefix, indices in layers:
        found = layer_path(module, prefix)
        if found is not None and found.index in indices:
            return f"{prefix}.{{}}" + (f".{found.rest}" if found.rest else ""), found.index
    return module or "(model)", None
