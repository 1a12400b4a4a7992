"""The device mesh drawn for the HTML report (autopar/report/html.py): a grid of devices, a
box around each node, and per axis its size, link speed and latency, as inline SVG.
"""
from __future__ import annotations

from html import escape

from autopar.report.html_style import AXIS_COLOURS, COMPUTE_COLOUR


def mesh_svg(mesh) -> str:
    """The mesh as a grid of devices (rows: the outer axes, columns: the innermost), a dashed
    box around each node, and per axis its size, link speed and latency, and whether it
    runs inside a node or across nodes.  Meshes over 256 devices draw the axes only."""
    inside, n_axes = mesh.inside, len(mesh.shape)
    cols = mesh.shape[-1]
    rows = mesh.size // cols
    per_node = mesh.device.devices_per_node
    draw = mesh.size <= 256
    cell = max(8, min(22, 300 // max(cols, rows))) if draw else 0
    gap = 6                                      # between nodes

    def at(d):                                   # device d's top left corner; nodes hold consecutive devices
        r, c = divmod(d, cols)
        if per_node >= cols:
            return 34 + c * cell, 24 + r * cell + (d // per_node) * gap
        return 34 + c * cell + (c // per_node) * gap, 24 + r * cell + r * gap

    x_end, y_end = (at(mesh.size - 1)[0] + cell, at(mesh.size - 1)[1] + cell) if draw else (0, 0)
    legend_y = y_end + 28
    width = max(x_end + 20, 440)
    height = legend_y + 20 * n_axes + 10
    out = [f'<svg class="chart mesh" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'role="img" aria-label="device mesh">']
    if draw:
        outer = " x ".join(mesh.axis_names[:-1])
        out.append(f'<text x="34" y="14" fill="{_axis_name_colour(mesh, -1)}">{escape(str(mesh.axis_names[-1]))} '
                   f'(columns) &#8594;</text>')
        if outer:
            out.append(f'<text x="0" y="0" transform="translate(20 24) rotate(90)" '
                       f'fill="{_axis_name_colour(mesh, -2)}">{escape(outer)} (rows) &#8594;</text>')
        for d in range(mesh.size):
            x, y = at(d)
            out.append(f'<rect class="device" x="{x + 1}" y="{y + 1}" width="{cell - 2}" height="{cell - 2}" rx="2" '
                       f'fill="{COMPUTE_COLOUR}"><title>device {d}{_coords(d, mesh.shape, mesh.axis_names)}'
                       f'</title></rect>')
        for first in range(0, mesh.size, per_node):
            (x0, y0), (x1, y1) = at(first), at(min(first + per_node, mesh.size) - 1)
            if y1 != y0 and per_node < cols:
                continue                          # a node that wraps a row: left unboxed
            x0, x1 = (34, at(cols - 1)[0]) if y1 != y0 else (x0, x1)
            out.append(f'<rect class="node" x="{x0 - 2}" y="{y0 - 2}" width="{x1 - x0 + cell + 4}" '
                       f'height="{y1 - y0 + cell + 4}" fill="none" stroke="#333" stroke-dasharray="4 2"/>')
        out.append(f'<text x="34" y="{y_end + 18}" class="small">one square per device; dashed: a node of '
                   f'{per_node} devices</text>')
    else:
        out.append(f'<text x="20" y="16">{mesh.size} devices in nodes of {per_node} (too many to draw one by one)'
                   f'</text>')
    for i, (name, size, bw, lat) in enumerate(zip(mesh.axis_names, mesh.shape, mesh.bandwidth, mesh.latency)):
        y = legend_y + 20 * i + 14
        where = "inside a node" if inside[i] else "across nodes"
        out.append(f'<text x="20" y="{y}"><tspan font-weight="bold" fill="{_axis_name_colour(mesh, i)}">'
                   f'{escape(str(name))}</tspan> = {size}: '
                   f'{bw / 1e9:.3g} GB/s, {lat * 1e6:.3g} us per step, {where}</text>')
    out.append("</svg>")
    return "".join(out)


def _axis_name_colour(mesh, index: int) -> str:
    return AXIS_COLOURS[index % len(mesh.shape) % len(AXIS_COLOURS)]


def _coords(d: int, shape, names) -> str:
    coords = []
    for size in reversed(shape):
        d, r = divmod(d, size)
        coords.append(r)
    return ": " + ", ".join(f"{n}={c}" for n, c in zip(names, reversed(coords)))
