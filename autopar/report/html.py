"""The plan as one self-contained HTML page, for a person deciding whether to trust it.

    autopar report plan.json -o report.html       (or autopar.report.html.write_report(plan, path))

Everything is inline (SVG charts, CSS, a few lines of JavaScript for the collapsible
table); the page fetches nothing, so it opens offline and can be mailed.  Sections, top
to bottom: the headline and summary (model, mesh drawn with its links, prediction, solver);
the plan against the hand-written layouts (step time split into compute and communication
per mesh axis; memory per device against the budget); memory per device by category, and
what the plan keeps in host memory or on disk against each tier's capacity; the
step timeline (and the pipeline's Gantt chart when the plan has stages); the per-module
table, whose repeated layers collapse into one row (autopar.report.text.table_rows, the same
rows the terminal table prints) and expand into their nodes; the collectives grouped by
phase, kind and axis; the terminal text of the plan.

Element classes the browser test reads: svg.chart (every chart), tr.group (one per
collapsed table row, data-count = its nodes), tr.member (one per node of a row of several
nodes, hidden until its group is expanded), tr.coll (one per collective group).
"""
from __future__ import annotations

import html
import math
from collections import Counter, defaultdict
from pathlib import Path

from autopar.report.gantt import gantt_svg_text
from autopar.report.html_mesh import mesh_svg
from autopar.report.html_style import AXIS_COLOURS, COMPUTE_COLOUR, CSS, JS, MEMORY_COLOURS, TIER_COLOURS
from autopar.cost.schedules import group_stages, simulate
from autopar.report.records import Prediction, format_bytes, format_seconds
from autopar.report.text import collective_groups, plan_text, recompute_line, sequence_lines, table_rows

MEMORY_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
                "activations": "activations", "working": "working (largest op)"}
TIER_NAMES = {"host": "host memory", "disk": "disk"}
LABEL_W, BAR_W, ROW_H = 190, 560, 22     # horizontal bar charts: label column, bar area, row height


def write_report(plan, path, title: str | None = None) -> Path:
    """Write report_html(plan) to `path` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(report_html(plan, title), encoding="utf-8")
    return path


def report_html(plan, title: str | None = None) -> str:
    """The whole page as one string."""
    title = title or f"autopar plan: {plan.model} on {_mesh_words(plan.device_mesh())}"
    sections = [_summary(plan), _comparison(plan), _memory(plan), _timeline(plan), _module_table(plan),
                _collectives(plan),
                _section("text", "The plan as text", "What <code>print(plan)</code> shows in a terminal.",
                         f"<details><summary>show</summary><pre>{_e(plan_text(plan))}</pre></details>")]
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_e(title)}</title>\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<style>{CSS}</style>\n</head>\n'
            f'<body>\n<h1>{_e(title)}</h1>\n' + "\n".join(sections) +
            f'\n<footer>autopar plan {plan.hash()}, origin {_e(plan.origin)}</footer>\n'
            f'<script>{JS}</script>\n</body>\n</html>\n')


# --- summary -------------------------------------------------------------------------------

def headline(plan) -> str:
    """One sentence: step, memory against the budget, and how the plan compares with the best
    hand-written layout that fits the budget."""
    p, limit, pp = plan.predicted, _limit(plan), plan.pipeline
    if pp is not None and pp.pipelined:
        return (f"{format_seconds(pp.step_s)} per training step in {len(pp.stages)} pipeline stages over "
                f"{pp.axis} ({pp.schedule}, {pp.microbatches} microbatches; {pp.no_pipeline_step_s / pp.step_s:.2f}x "
                f"the speed of the best plan without stages), up to {format_bytes(max(pp.memory))} per device of "
                f"{format_bytes(limit)}.")
    text = (f"{format_seconds(p.step_s)} per training step, {format_bytes(p.memory_total)} per device "
            f"of {format_bytes(limit)}")
    fitting = {name: b for name, b in plan.baselines.items() if isinstance(b, Prediction) and b.memory_total <= limit}
    if fitting:
        name, best = min(fitting.items(), key=lambda kv: kv[1].step_s)
        text += (f"; {best.step_s / p.step_s:.2f}x the speed of the best hand-written layout that fits "
                 f"({name}, {format_seconds(best.step_s)})")
    elif plan.baselines:
        text += "; no hand-written layout fits the budget"
    return text + "."


def _summary(plan) -> str:
    s, t, p = plan.solver, plan.timing, plan.predicted
    if not s.solved:
        state = f"not solved ({plan.origin})"
    else:
        state = "optimal" if s.optimal else f"feasible, gap {s.gap or 0:.2%}"
    if s.variables is not None:
        state += f"; {s.variables} variables, {s.constraints} constraints after presolve"
    state += f"; {s.graph_nodes} graph nodes, {s.choice_nodes} with a choice"
    mesh, pp = plan.device_mesh(), plan.pipeline
    step = (f"{format_seconds(p.step_s)}: compute {format_seconds(p.compute_s)}, "
            + ", ".join(f"{ax} {format_seconds(v)}" for ax, v in p.comm_s.items())
            + (f", {format_seconds(p.hidden_s)} of it behind compute" if p.hidden_s > 1e-12 else ""))
    limit = f" of {format_bytes(_limit(plan))} ({'budget' if plan.memory_budget else 'device memory'})"
    rows = [("model", plan.model), ("mesh", f"{_mesh_words(mesh)} of {mesh.device.name}")]
    if pp is not None and pp.pipelined:
        rows += [("predicted step", f"{format_seconds(pp.step_s)} with stages (without: "
                                    f"{format_seconds(pp.no_pipeline_step_s)})"),
                 ("memory per device", f"up to {format_bytes(max(pp.memory))}{limit}"),
                 ("one stage, one microbatch", f"on sub-mesh {_mesh_words(plan.mesh)}: {step}; "
                                               f"{format_bytes(p.memory_total)}")]
    else:
        rows += [("predicted step", step), ("memory per device", f"{format_bytes(p.memory_total)}{limit}")]
    rows += [("solver", state),
            ("planned in", f"{t.total_s:.2f}s (trace {t.trace_s:.2f}s, menus and costs {t.costs_s:.2f}s, "
                           f"ILP {t.solve_s:.2f}s" + (f", pipeline search {t.pipeline_search_s:.2f}s"
                                                      if t.pipeline_search_s is not None else "") + ")")]
    if plan.precision is not None:
        d = plan.precision.to_dict()
        rows.append(("precision", f"compute in {d['param_dtype']}, float32 master weights, gradients reduced in "
                                  f"{d['reduce_dtype']}"))
    else:
        rows.append(("precision", "the model's own dtypes"))
    if plan.pipeline is not None:
        rows.append(("pipeline", plan.pipeline.summary))
    rows.append(("recomputation", recompute_line(plan).partition(": ")[2]))
    if plan.fallback_ops:
        rows.append(("replicated (no sharding rule)", ", ".join(plan.fallback_ops)))
    notes = "".join(f"<li>{_e(line)}</li>" for line in sequence_lines(plan))
    table = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    body = (f'<p class="headline">{_e(headline(plan))}</p>\n<div class="row"><table class="kv">{table}</table>\n'
            f'<div>{mesh_svg(mesh)}</div></div>' + (f"<ul class=notes>{notes}</ul>" if notes else ""))
    return _section("summary", "Summary", "", body)


# --- the plan against the hand-written layouts ----------------------------------------------

def _comparison(plan) -> str:
    axes = list(plan.predicted.comm_s)
    legend = [("compute", COMPUTE_COLOUR)] + [(f"communication on {ax}", _axis_colour(plan, ax)) for ax in axes]
    layouts = [("autopar (this plan)", plan.predicted)] + list(plan.baselines.items())
    limit = _limit(plan)
    step_rows, mem_rows = [], []
    for name, p in layouts:
        if isinstance(p, str):
            step_rows.append((name, [], f"not possible: {p}", None))
            mem_rows.append((name, [], "not possible", None))
            continue
        segments = [("compute", p.compute_s, COMPUTE_COLOUR)] + [
            (f"communication on {ax}", v, _axis_colour(plan, ax)) for ax, v in p.comm_s.items()]
        ratio = p.step_s / plan.predicted.step_s if plan.predicted.step_s else float("nan")
        hidden = f", {format_seconds(p.hidden_s)} behind compute" if p.hidden_s > 1e-12 else ""
        step_rows.append((name, segments, f"step {format_seconds(p.step_s)} ({ratio:.2f}x){hidden}", p.step_s))
        fits = "" if p.memory_total <= limit else " does not fit"
        mem_rows.append((name, _memory_segments(p.memory), f"{format_bytes(p.memory_total)}{fits}", None))
    note = ""
    if len(layouts) == 1:
        note = "<p>The plan was made without the hand-written layouts (<code>compare=False</code>, " \
               "<code>--no-compare</code>).</p>"
    elif plan.pipeline is not None and plan.pipeline.pipelined:
        note = (f"<p>This plan is pipelined: the bars compare one stage's plan for one microbatch with the "
                f"hand-written layouts on the same sub-mesh ({_e(_mesh_words(plan.mesh))}), not whole steps.</p>")
    step = hbar_chart("step-chart", step_rows, legend, format_seconds, marker_name="step after overlap")
    memory = hbar_chart("layout-memory-chart", mem_rows, _memory_legend(mem_rows), format_bytes,
                        limit=limit, limit_name=f"budget {format_bytes(limit)}")
    return _section("layouts", "The plan against hand-written layouts",
                    "Every layout is priced by the same cost model on the same mesh.  Shorter is faster; a black "
                    "tick marks the step once the communication that runs behind compute is taken off.  A layout "
                    "whose memory crosses the red line does not fit.",
                    note + "<h3>Step time</h3>" + step + "<h3>Memory per device against the budget</h3>" + memory)


def _memory(plan) -> str:
    limit = _limit(plan)
    worst = plan.predicted.memory
    rows = [("autopar (this plan)", _memory_segments(worst), _of_limit(plan.predicted.memory_total, limit), None)]
    pp = plan.pipeline
    text = ("Bytes per device by what they hold: parameters, gradients and optimizer states (with float32 master "
            "weights under mixed precision) are the model states ZeRO shards; activations are kept for backward "
            "(recomputation shrinks them); working is the most one op needs beyond them while it runs.")
    if pp is not None and pp.pipelined and pp.group_memory:
        rows = []
        for g, m in enumerate(pp.group_memory):
            stages = list(range(g, len(pp.stages), pp.groups))
            label = f"device group {g} (stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))})"
            rows.append((label, _memory_segments(m), _of_limit(sum(m.values()), limit), None))
        worst = max(pp.group_memory, key=lambda m: sum(m.values()))
        text += "  One bar per pipeline device group, with the activations of the microbatches it holds in flight."
    chart = hbar_chart("memory-chart", rows, _memory_legend(rows), format_bytes, limit=limit,
                       limit_name=f"budget {format_bytes(limit)}", label_w=300 if len(rows) > 1 else LABEL_W)
    detail = "".join(f"<tr><td>{_e(MEMORY_NAMES.get(k, k))}</td><td class=num>{format_bytes(v)}</td></tr>"
                     for k, v in worst.items())
    return _section("memory", "Memory per device by category", text,
                    chart + f'<table class="small-table"><tr><th>category</th><th>bytes</th></tr>{detail}</table>'
                    + _tiers(plan))


def _tiers(plan) -> str:
    """Where the plan keeps bytes per device beyond the device (Prediction.tiers): a bar
    per tier beside the device's own, each with its capacity (nothing without tiers)."""
    tiers = plan.predicted.tiers
    if not tiers:
        return ""
    dev = plan.mesh.device
    capacity = {"host": dev.host_memory, "disk": dev.disk_memory}
    rows = [("device", [("device", plan.predicted.memory_total, TIER_COLOURS["device"])],
             _of_limit(plan.predicted.memory_total, _limit(plan)), None)]
    table = []
    for tier in ("host", "disk"):
        if tier not in tiers:
            continue
        cap = capacity[tier]
        label = TIER_NAMES[tier]
        of = f" of {format_bytes(cap)}" if cap > 0 else " (capacity not stated)"
        rows.append((label, [(label, tiers[tier], TIER_COLOURS[tier])], format_bytes(tiers[tier]) + of, None))
        table.append(f"<tr><td>{_e(label)}</td><td class=num>{format_bytes(tiers[tier])}</td>"
                     f"<td class=num>{format_bytes(cap) if cap > 0 else 'not stated'}</td></tr>")
    chart = hbar_chart("tier-chart", rows, [(name, TIER_COLOURS[k]) for k, name in
                                            (("device", "device"), *((t, TIER_NAMES[t]) for t in tiers))],
                       format_bytes)
    return ("<h3>Beyond the device</h3><p>Optimizer states, master weights, offloaded weights with their "
            "gradients and offloaded layers' activations the plan keeps in host memory or on disk, per device, against each tier's capacity in the device "
            "description.</p>" + chart +
            f'<table class="small-table" id="tier-table"><tr><th>tier</th><th>bytes</th><th>capacity</th></tr>'
            f'{"".join(table)}</table>')


def _timeline(plan) -> str:
    p = plan.predicted
    axes = list(p.comm_s)
    span = max(p.step_s, p.compute_s + sum(p.comm_s.values()) - p.hidden_s, 1e-12)
    scale = BAR_W / span
    lanes = ["compute"] + [f"communication on {ax}" for ax in axes]
    height = 30 + len(lanes) * (ROW_H + 8) + 40
    out = [f'<svg class="chart timeline" xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + BAR_W + 160}" '
           f'height="{height}" role="img" aria-label="step timeline">']
    start = p.compute_s - p.hidden_s
    y = 20
    out.append(_rect(LABEL_W, y, p.compute_s * scale, COMPUTE_COLOUR, f"compute: {format_seconds(p.compute_s)}"))
    out.append(f'<text x="{LABEL_W - 6}" y="{y + 15}" text-anchor="end">compute</text>')
    cursor = start
    for i, ax in enumerate(axes):
        y = 20 + (i + 1) * (ROW_H + 8)
        v = p.comm_s[ax]
        out.append(_rect(LABEL_W + cursor * scale, y, v * scale, _axis_colour(plan, ax),
                         f"communication on {ax}: {format_seconds(v)}"))
        out.append(f'<text x="{LABEL_W - 6}" y="{y + 15}" text-anchor="end">communication on {_e(ax)}</text>')
        out.append(f'<text x="{LABEL_W + (cursor + v) * scale + 6:.1f}" y="{y + 15}">{format_seconds(v)}</text>')
        cursor += v
    bottom = 20 + len(lanes) * (ROW_H + 8)
    if p.hidden_s > 1e-12:
        out.append(f'<rect class="overlap" x="{LABEL_W + start * scale:.1f}" y="14" width="{p.hidden_s * scale:.1f}" '
                   f'height="{bottom - 14}" fill="url(#hatch)" stroke="#555"><title>'
                   f'{format_seconds(p.hidden_s)} of communication runs behind compute</title></rect>')
        out.insert(1, '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
                      'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#555" '
                      'stroke-width="1.5"/></pattern></defs>')
    step_x = LABEL_W + p.step_s * scale
    out.append(f'<line x1="{step_x:.1f}" y1="10" x2="{step_x:.1f}" y2="{bottom}" stroke="black" stroke-width="2"/>')
    out.append(f'<text x="{step_x:.1f}" y="{bottom + 14}" text-anchor="middle">step {format_seconds(p.step_s)}</text>')
    out += _ticks(span, scale, LABEL_W, bottom + 30, format_seconds)
    out.append("</svg>")
    pipelined = plan.pipeline is not None and plan.pipeline.pipelined
    text = ("Where the step goes: compute, then each mesh axis's communication that compute does not hide "
            "(hatched: the part that runs behind compute, gradient buckets during backward and weight gathers "
            "one layer ahead).  The cost model adds these up; it does not order single ops, so this is the sum "
            "laid end to end, not a trace.")
    if pipelined:
        text += "  For a pipelined plan this is one stage's plan for one microbatch; the Gantt chart below is the step."
    body = "".join(out)
    if pipelined:
        body += "<h3>Pipeline schedule</h3>" + pipeline_gantt(plan)
    return _section("timeline", "Step timeline", text, body)


def pipeline_gantt(plan) -> str:
    """The Gantt chart of the plan's pipeline schedule (autopar.report.gantt), simulated from
    its stage times with backward taken as twice forward (the plan keeps each stage's
    forward + backward, not the split) and the sends between stages as the search priced
    them (on an asynchronous device a send delays its receiver; elsewhere it is inside the
    stage times), as inline SVG."""
    pp = plan.pipeline
    fwd = [s / 3 for s in pp.stage_s]
    comm = pp.send_s if pp.sends_overlap else 0.0
    if pp.virtual > 1:
        groups = [group_stages(g, pp.groups, len(pp.stages), pp.schedule) for g in range(pp.groups)]
        tl = simulate(pp.schedule, pp.groups, pp.microbatches, [sum(fwd[s] for s in mine) for mine in groups],
                      n_virtual=pp.virtual, comm_time=comm)
    else:
        tl = simulate(pp.schedule, len(pp.stages), pp.microbatches, fwd, comm_time=comm)
    svg = gantt_svg_text(tl, title=f"{pp.schedule}, simulated from the stage times (seconds)")
    return ('<div class="scroll">' + svg.replace("<svg ", '<svg class="chart gantt" ', 1) + "</div>"
            f'<p class="small">One row per device group ("rank"), one block per forward (F) and backward (B) pass '
            f'of a microbatch, one line per send between groups (from where the pass that made it ends to where '
            f'it arrives: {format_seconds(pp.send_s)} each); blank is the bubble.  Drawn with backward twice '
            f'forward, so its bubble ({tl.bubble_fraction:.1%}) can differ from the search\'s ({pp.bubble:.1%}), '
            f'which prices the measured split.  Stage times: '
            + ", ".join(format_seconds(s) for s in pp.stage_s) + " (forward + backward per microbatch).</p>")


# --- the per-module table and the collectives ------------------------------------------------

def _module_table(plan) -> str:
    by_node = defaultdict(list)
    for c in plan.collectives:
        by_node[c.node].append(c)
    rows = table_rows(plan)
    out = ['<div class="tools"><input id="filter" type="search" placeholder="filter modules and ops" '
           'aria-label="filter modules and ops"> <button type="button" id="expand-all">expand all</button> '
           '<button type="button" id="collapse-all">collapse all</button></div>',
           '<table id="modules" class="data"><thead><tr><th>module</th><th>op</th><th>layout</th>'
           '<th class=num>time</th><th class=num>of it comm.</th><th class=num>memory</th><th>collectives</th></tr>'
           '</thead><tbody>']
    for i, r in enumerate(rows):
        colls = [c for n in r.nodes for c in by_node.get(n.name, ())]
        toggle = f'<button type="button" class="toggle" data-group="g{i}" aria-expanded="false">+</button> ' \
            if r.count > 1 else '<span class="toggle-space"></span>'
        out.append(f'<tr class="group" id="g{i}" data-count="{r.count}"><td>{toggle}{_e(r.label)}</td>'
                   f'<td>{_e(_op(r.op))}</td><td>{_e((r.strategy + " " + r.layout).strip())}</td>'
                   f'<td class=num>{format_seconds(r.seconds)}</td><td class=num>{format_seconds(r.comm_s)}</td>'
                   f'<td class=num>{format_bytes(r.memory)}</td><td>{_e(_collective_words(colls))}</td></tr>')
        if r.count > 1:
            for n in r.nodes:
                out.append(f'<tr class="member g{i}" hidden><td class="indent">{_e(n.module or "(model)")} '
                           f'<span class="small">{_e(n.name)}</span></td><td>{_e(_op(n.op))}</td>'
                           f'<td>{_e((n.strategy + " " + r.layout).strip())}</td>'
                           f'<td class=num>{format_seconds(n.compute_s + n.comm_s)}</td>'
                           f'<td class=num>{format_seconds(n.comm_s)}</td><td class=num>{format_bytes(n.memory)}</td>'
                           f'<td>{_e(_collective_words(by_node.get(n.name, ())))}</td></tr>')
    out.append("</tbody></table>")
    nodes = sum(r.count for r in rows)
    return _section("modules", "Per module",
                    f"{nodes} graph nodes in {len(rows)} rows: the nodes of identical repeated layers that make the "
                    f"same choice share a row (<code>layers.0-31.attention.wq x32</code>); + opens it.  Layout: the "
                    f"strategy per mesh axis, then the output's placement per axis (S(d): split on dim d, R: "
                    f"replicated, P: partial sums).  Time is compute plus the communication the node implies, "
                    f"forward and backward; collectives are counted per phase and axis.", "".join(out))


def _collectives(plan) -> str:
    groups = collective_groups(plan)
    out = ['<table id="collectives" class="data"><thead><tr><th>phase</th><th>kind</th><th>axes</th>'
           '<th class=num>count</th><th class=num>bytes per device</th><th class=num>seconds</th>'
           '<th>priced as</th></tr></thead><tbody>']
    for (phase, kind, axes), cs in groups:
        algs = ", ".join(f"{n} {a}" for a, n in sorted(Counter(c.algorithm for c in cs).items()))
        tensors = Counter(c.tensor for c in cs)
        largest = ", ".join(f"{t} ({n}x)" if n > 1 else t for t, n in tensors.most_common(6))
        more = f" and {len(tensors) - 6} more" if len(tensors) > 6 else ""
        out.append(f'<tr class="coll"><td>{_e(phase)}</td><td>{_e(kind)}</td><td>{_e(axes)}</td>'
                   f'<td class=num>{len(cs)}</td><td class=num>{format_bytes(sum(c.nbytes for c in cs))}</td>'
                   f'<td class=num>{format_seconds(sum(c.seconds for c in cs))}</td><td>{_e(algs)}</td></tr>'
                   f'<tr class="coll-detail"><td></td><td colspan=6 class="small">of {_e(largest + more)}</td></tr>')
    out.append("</tbody></table>")
    if not groups:
        out = ["<p>None: every device computes its part without exchanging data.</p>"]
    total = sum(c.seconds for c in plan.collectives)
    return _section("collectives", "Collectives per step",
                    f"{len(plan.collectives)} collectives, {format_seconds(total)} if none overlapped, grouped by "
                    f"phase (forward, backward, optimizer step), kind and mesh axis; below each, the tensors they "
                    f"move.", "".join(out))


# --- charts ------------------------------------------------------------------------------------

def hbar_chart(chart_id: str, rows, legend, fmt, *, limit=None, limit_name="", marker_name="",
               label_w: int = LABEL_W) -> str:
    """Horizontal stacked bars as SVG.  rows: (label, [(segment name, value, colour)], text
    after the bar, marker value or None); legend: [(name, colour)]; fmt: value -> text;
    limit: a value drawn as a red dashed line (a budget)."""
    top = 26
    peak = max([sum(v for _, v, _ in segs) for _, segs, _, _ in rows] + [m or 0 for *_, m in rows] + [limit or 0])
    peak = peak or 1.0
    scale = BAR_W / (peak * 1.02)
    height = top + len(rows) * (ROW_H + 8) + 40
    out = [f'<svg class="chart bars" id="{chart_id}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{label_w + BAR_W + 230}" height="{height}" role="img">']
    x = label_w
    for name, colour in legend:
        out.append(f'<rect class="legend" x="{x}" y="4" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{x + 16}" y="14">{_e(name)}</text>')
        x += 28 + 7 * len(name)
    if marker_name:
        out.append(f'<line x1="{x}" y1="2" x2="{x}" y2="18" stroke="black" stroke-width="2"/>'
                   f'<text x="{x + 6}" y="14">{_e(marker_name)}</text>')
    for i, (label, segs, text, marker) in enumerate(rows):
        y = top + i * (ROW_H + 8)
        out.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{_e(label)}</text>')
        x = label_w
        for seg, value, colour in segs:
            out.append(_rect(x, y, value * scale, colour, f"{label}: {seg} {fmt(value)}"))
            x += value * scale
        if marker is not None:
            mx = label_w + marker * scale
            out.append(f'<line class="marker" x1="{mx:.1f}" y1="{y - 3}" x2="{mx:.1f}" y2="{y + ROW_H + 3}" '
                       f'stroke="black" stroke-width="2"/>')
            x = max(x, mx)
        colour = "#888" if not segs else "#222"
        out.append(f'<text x="{x + 6:.1f}" y="{y + 15}" fill="{colour}">{_e(text)}</text>')
    bottom = top + len(rows) * (ROW_H + 8)
    if limit:
        lx = label_w + limit * scale
        out.append(f'<line class="limit" x1="{lx:.1f}" y1="{top - 4}" x2="{lx:.1f}" y2="{bottom}" stroke="#d62728" '
                   f'stroke-width="2" stroke-dasharray="6 3"/><text x="{lx:.1f}" y="{bottom + 34}" '
                   f'text-anchor="middle" fill="#d62728">{_e(limit_name)}</text>')
    out += _ticks(peak * 1.02, scale, label_w, bottom + 4, fmt)
    out.append("</svg>")
    return '<div class="scroll">' + "".join(out) + "</div>"


def _ticks(span: float, scale: float, x0: float, y: float, fmt) -> list:
    """An axis from 0 to `span` with about five ticks at 1, 2 or 5 x 10^k of the unit `fmt`
    writes (seconds, or bytes in KiB, MiB or GiB)."""
    unit = 1.0
    if fmt is format_bytes:
        unit = next((u for u in (1024**3, 1024**2, 1024) if span >= 2 * u), 1.0)
    raw = span / unit / 5
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw) * unit
    out = [f'<line x1="{x0}" y1="{y}" x2="{x0 + span * scale:.1f}" y2="{y}" stroke="#999"/>']
    for i in range(int(span / step + 1e-9) + 1):
        x = x0 + i * step * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle" class="small">{fmt(i * step) if i else 0}'
                   f'</text>')
    return out


def _rect(x, y, w, colour, tip) -> str:
    return (f'<rect class="seg" x="{x:.1f}" y="{y}" width="{max(w, 0.0):.1f}" height="{ROW_H}" fill="{colour}">'
            f'<title>{_e(tip)}</title></rect>')


def _memory_segments(memory: dict) -> list:
    return [(MEMORY_NAMES.get(k, k), v, _memory_colour(k)) for k, v in memory.items()]


def _memory_legend(rows) -> list:
    seen = {}
    for _, segs, _, _ in rows:
        for name, _, colour in segs:
            seen.setdefault(name, colour)
    return list(seen.items())


def _memory_colour(kind: str) -> str:
    if kind in MEMORY_COLOURS:
        return MEMORY_COLOURS[kind]
    return AXIS_COLOURS[sum(map(ord, kind)) % len(AXIS_COLOURS)]   # a category added later keeps one colour



def _axis_colour(plan, axis: str) -> str:
    names = list(plan.device_mesh().axis_names)
    return AXIS_COLOURS[names.index(axis) % len(AXIS_COLOURS)] if axis in names else "#999"


# --- small helpers -----------------------------------------------------------------------------

def _of_limit(nbytes: float, limit: float) -> str:
    return f"{format_bytes(nbytes)} ({nbytes / limit:.0%} of {format_bytes(limit)})"


def _limit(plan) -> float:
    return plan.memory_budget or plan.mesh.device.memory


def _mesh_words(mesh) -> str:
    return " x ".join(f"{a}={s}" for a, s in zip(mesh.axis_names, mesh.shape))



def _op(op: str) -> str:
    return op.replace("aten.", "")


def _collective_words(colls) -> str:
    tally = Counter((c.phase, c.kind, "+".join(c.axes)) for c in colls)
    return "; ".join(f"{phase} {kind} on {axes}" + (f" x{n}" if n > 1 else "")
                     for (phase, kind, axes), n in sorted(tally.items()))


def _section(anchor: str, heading: str, text: str, body: str) -> str:
    intro = f"<p>{text}</p>" if text else ""
    return f'<section id="{anchor}"><h2>{_e(heading)}</h2>{intro}{body}</section>'


def _e(text) -> str:
    return html.escape(str(text), quote=True)
