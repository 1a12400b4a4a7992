"""Gantt chart of a pipeline timeline as a hand-written SVG file (no plotting library).

One row per rank, one block per pass (forward, backward and weight-gradient passes in
three colours, odd chunks of interleaved schedules paler), the microbatch number inside
each block, idle time left blank, a time axis below and the bubble fraction in the title.
A simulated timeline's sends (activations after a forward, gradients after a backward) are
lines from the sending rank's row, where the pass ended, to the receiving rank's row, where
the message arrived.
"""
from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from autopar.cost.schedules import KINDS, Timeline

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
LEFT, WIDTH, TOP, ROW, GAP = 70, 900, 60, 28, 6


def gantt_svg(timeline_or_events, path, title: str | None = None) -> Path:
    """Write `gantt_svg_text` of a Timeline or of measured passes to `path` and return the path."""
    path = Path(path)
    path.write_text(gantt_svg_text(timeline_or_events, title))
    return path


def gantt_svg_text(timeline_or_events, title: str | None = None) -> str:
    """The Gantt chart of a Timeline, or of measured passes (Events or dicts with rank,
    kind, microbatch, start, end in seconds, any origin; see Timeline.from_events), as SVG
    text.

    The SVG holds exactly 1 + len(events) + (kinds present) <rect>s: the background
    (class "background"), one per event (class "event F", "event B" or "event W"), and
    one legend swatch per kind present (class "legend"); each Send of the timeline is one
    <line class="send F"> (an activation) or <line class="send B"> (a gradient).
    """
    tl = timeline_or_events if isinstance(timeline_or_events, Timeline) else \
        Timeline.from_events(timeline_or_events)
    t0, span = min(e.start for e in tl.events), tl.span or 1.0
    scale = WIDTH / span
    height = TOP + tl.n_stages * (ROW + GAP) + 50
    heading = (f"{title or tl.schedule}: {tl.n_stages} ranks, {tl.n_microbatches} microbatches, "
               f"bubble {tl.bubble_fraction:.1%}"
               + (f" (steady state; {tl.batches} steps drawn)" if tl.period is not None else ""))
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
            'font-family="sans-serif" font-size="12">'),
           '<rect class="background" width="100%" height="100%" fill="white"/>',
           f'<text x="{LEFT}" y="20" font-size="15">{escape(heading)}</text>']
    kinds = [k for k in KINDS if any(e.kind == k for e in tl.events)]
    for i, k in enumerate(kinds):
        x = LEFT + 160 * i
        out += [f'<rect class="legend" x="{x}" y="32" width="12" height="12" fill="{COLOURS[k]}"/>',
                f'<text x="{x + 16}" y="42">{k}: {NAMES[k]}</text>']
    notes = (["paler: odd chunks"] if tl.n_virtual > 1 else []) + (["lines: sends"] if tl.sends else [])
    if notes:
        out.append(f'<text x="{LEFT + 160 * len(kinds)}" y="42">{"; ".join(notes)}</text>')
    for r in range(tl.n_stages):
        out.append(f'<text x="8" y="{_row_y(r) + ROW / 2 + 4}">rank {r}</text>')
    for e in tl.events:
        x, w, y = LEFT + (e.start - t0) * scale, max(e.duration * scale, 0.5), _row_y(e.rank)
        opacity = 0.6 if e.chunk % 2 else 1.0
        tip = f"{e.label} on rank {e.rank}: {e.start - t0:.4g} to {e.end - t0:.4g}"
        out.append(f'<rect class="event {e.kind}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" '
                   f'fill="{COLOURS[e.kind]}" fill-opacity="{opacity}" stroke="white" stroke-width="0.5">'
                   f'<title>{escape(tip)}</title></rect>')
        if w >= 7 * len(str(e.microbatch)):
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + ROW / 2 + 4}" text-anchor="middle" '
                       f'fill="white">{e.microbatch}</text>')
    for m in tl.sends:
        down = m.dst > m.src
        y1 = _row_y(m.src) + (ROW if down else 0)
        y2 = _row_y(m.dst) + (0 if down else ROW)
        tip = (f"{'activation' if m.kind == 'F' else 'gradient'} of microbatch {m.microbatch}, rank {m.src} to "
               f"{m.dst}: {m.start - t0:.4g} to {m.end - t0:.4g}")
        out.append(f'<line class="send {m.kind}" x1="{LEFT + (m.start - t0) * scale:.2f}" y1="{y1}" '
                   f'x2="{LEFT + (m.end - t0) * scale:.2f}" y2="{y2}" stroke="{COLOURS[m.kind]}" '
                   f'stroke-width="0.8" stroke-opacity="0.7"><title>{escape(tip)}</title></line>')
    out += _axis(span, scale, _row_y(tl.n_stages))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _row_y(rank: int) -> int:
    return TOP + rank * (ROW + GAP)


def _axis(span: float, scale: float, y: float) -> list:
    """A time axis from 0 to `span` with about ten ticks at 1, 2 or 5 x 10^k."""
    raw = span / 10
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{LEFT + span * scale:.2f}" y2="{y}" stroke="black"/>']
    for i in range(int(span / step + 1e-9) + 1):
        x = LEFT + i * step * scale
        out += [f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 5}" stroke="black"/>',
                f'<text x="{x:.2f}" y="{y + 18}" text-anchor="middle">{i * step:.4g}</text>']
    out.append(f'<text x="{LEFT + span * scale:.2f}" y="{y + 34}" text-anchor="end">time</text>')
    return out
