"""The HTML report's look (autopar/report/html.py): its colours (compute, mesh axes, memory
categories, memory tiers), its style sheet, and the few lines of script that open and
close the per-module table's rows and filter them.
"""
from __future__ import annotations

COMPUTE_COLOUR = "#4c78a8"
AXIS_COLOURS = ("#f58518", "#54a24b", "#e45756", "#b279a2", "#72b7b2", "#9d755d")
MEMORY_COLOURS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b", "activations": "#e45756",
                  "working": "#b279a2"}
TIER_COLOURS = {"device": "#4c78a8", "host": "#72b7b2", "disk": "#9d755d"}

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1180px;
       padding: 16px 24px; color: #222; background: #fff; }
h1 { font-size: 1.5em; margin-bottom: 4px; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 32px; }
h3 { font-size: 1em; margin: 16px 0 4px; }
p { max-width: 900px; line-height: 1.4; }
.headline { font-size: 1.15em; font-weight: 600; background: #f3f6fa; padding: 10px 14px; border-left: 4px solid
            #4c78a8; max-width: none; }
.row { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
table.kv th { text-align: left; padding: 3px 12px 3px 0; vertical-align: top; white-space: nowrap; color: #555; }
table.kv td { padding: 3px 0; max-width: 520px; }
#modules td:first-child { white-space: nowrap; }
table.data { border-collapse: collapse; font-size: 13px; width: 100%; }
table.data th, table.data td { border-bottom: 1px solid #eee; padding: 3px 6px; text-align: left; vertical-align: top; }
table.data th { position: sticky; top: 0; background: #fafafa; }
table.small-table { font-size: 13px; margin-top: 8px; }
table.small-table td, table.small-table th { padding: 2px 10px 2px 0; text-align: left; }
td.num, th.num { text-align: right !important; white-space: nowrap; font-variant-numeric: tabular-nums; }
tr.member td { background: #fbfbfd; color: #444; }
td.indent { padding-left: 30px !important; }
button.toggle { width: 22px; padding: 0; font-family: monospace; cursor: pointer; }
.toggle-space { display: inline-block; width: 26px; }
.small { font-size: 11px; color: #666; }
svg text { font-size: 12px; }
svg text:not([fill]) { fill: #222; }
svg text.small { font-size: 10px; fill: #666; }
.scroll { overflow-x: auto; }
.tools { margin: 8px 0; }
ul.notes { font-size: 13px; color: #555; }
pre { font-size: 12px; overflow-x: auto; background: #f7f7f7; padding: 8px; }
footer { margin-top: 40px; font-size: 11px; color: #888; }
"""

JS = """
(function () {
  function show(id, open) {
    var rows = document.querySelectorAll('tr.member.' + id);
    for (var i = 0; i < rows.length; i++) { rows[i].hidden = !open; }
    var b = document.querySelector('button.toggle[data-group="' + id + '"]');
    if (b) { b.textContent = open ? '-' : '+'; b.setAttribute('aria-expanded', open ? 'true' : 'false'); }
  }
  var toggles = document.querySelectorAll('button.toggle');
  for (var i = 0; i < toggles.length; i++) {
    toggles[i].addEventListener('click', function (ev) {
      var id = ev.currentTarget.getAttribute('data-group');
      show(id, ev.currentTarget.getAttribute('aria-expanded') !== 'true');
    });
  }
  function all(open) { for (var i = 0; i < toggles.length; i++) { show(toggles[i].getAttribute('data-group'), open); } }
  var ea = document.getElementById('expand-all'), ca = document.getElementById('collapse-all');
  if (ea) { ea.addEventListener('click', function () { all(true); }); }
  if (ca) { ca.addEventListener('click', function () { all(false); }); }
  var filter = document.getElementById('filter');
  if (filter) {
    filter.addEventListener('input', function () {
      var q = filter.value.toLowerCase();
      var groups = document.querySelectorAll('tr.group');
      for (var i = 0; i < groups.length; i++) {
        groups[i].style.display = !q || groups[i].textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
      }
    });
  }
})();
"""
