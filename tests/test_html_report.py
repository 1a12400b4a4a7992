"""The HTML report (autopar/report/html.py) rendered in headless Chromium: the charts have
size, the per-module table has one row per collapsed group and one hidden row per node of
a group, the bars are drawn to scale, nothing logs an error, and the page fetches nothing.

Chromium comes from the distribution (`apt-get install chromium`, done by .ci/run) and is
driven by the `playwright` package with executable_path (playwright's own browser
download is not used).  The browser tests skip, saying why, only where neither can be
found or started.  Plans are made once per module on the meta device (llama3-8b on an 8x8
H100 mesh in bf16, and gpt-tiny with a fixed 2-stage 1F1B pipeline), and one browser
serves every test.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest

import autopar
from autopar.cli import main
from autopar.report.html import report_html, write_report
from autopar.models import build
from autopar.report.records import Prediction
from autopar.report.text import collective_groups, table_rows


def chromium_path() -> str | None:
    for name in (os.environ.get("AUTOPAR_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def llama_plan():
    model, example = build("llama3-8b", device="meta")
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    return autopar.plan(model, mesh, example, mixed_precision="bf16")


@pytest.fixture(scope="module")
def pipelined_plan():
    model, example = build("gpt-tiny", device="meta")
    mesh = autopar.Mesh((2, 2), ("pp", "dp"), device="h100")
    return autopar.plan(model, mesh, example, pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="1f1b",
                                                                        microbatches=4))


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module (playwright, the distribution's browser)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed: "
                                                                 "pip install -e '.[test]'")
    exe = chromium_path()
    if exe is None:
        pytest.skip("no Chromium found: apt-get install -y chromium (or set AUTOPAR_CHROMIUM to a Chrome binary)")
    pw = sync_api.sync_playwright().start()
    try:
        try:
            b = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        except Exception as exc:  # a browser that cannot start here (no display libraries, sandbox)
            pytest.skip(f"Chromium at {exe} does not start: {str(exc).splitlines()[0]}")
        yield b
        b.close()
    finally:
        pw.stop()


def open_report(browser, path):
    """(page, errors): the report loaded in a 1280-wide page; errors: console errors,
    uncaught exceptions and every request that is not the file itself."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.on("request", lambda r: errors.append(f"request: {r.url}") if r.url != path.as_uri() else None)
    page.goto(path.as_uri())
    return page, errors


def png_size(path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_is_one_file_that_fetches_nothing(llama_plan):
    text = report_html(llama_plan)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", text))
    assert urls == {"http://www.w3.org/2000/svg"}            # the SVG namespace only
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\((?!#)", text)
    assert text.count("<svg") == 5                           # mesh, step, layout memory, memory, timeline


def test_llama_report_in_chromium(llama_plan, browser, tmp_path):
    path = write_report(llama_plan, tmp_path / "llama.html")
    page, errors = open_report(browser, path)
    shot = tmp_path / "llama.png"
    page.screenshot(path=str(shot), full_page=True)
    width, height = png_size(shot)
    assert width == 1280 and height > 3000

    charts = page.eval_on_selector_all("svg.chart", "els => els.map(e => { const r = e.getBoundingClientRect(); "
                                                   "return [e.id || e.getAttribute('class'), r.width, r.height]; })")
    assert len(charts) == 5
    assert all(w > 100 and h > 50 for _, w, h in charts), charts
    # one device square per device of the 8x8 mesh, one dashed box per node of 8
    assert page.locator("svg.mesh rect.device").count() == 64
    assert page.locator("svg.mesh rect.node").count() == 8

    # the step chart: one segment per (compute, mesh axis) of every layout that is possible,
    # drawn to scale: each bar's width over the plan's equals compute + communication over the plan's
    layouts = {"autopar (this plan)": llama_plan.predicted, **llama_plan.baselines}
    possible = {k: p for k, p in layouts.items() if isinstance(p, Prediction)}
    assert page.locator("#step-chart rect.seg").count() == sum(1 + len(p.comm_s) for p in possible.values())
    widths = page.eval_on_selector_all("#step-chart rect.seg", "els => els.map(e => e.getBoundingClientRect().width)")
    per_bar, i = [], 0
    for p in possible.values():
        per_bar.append(sum(widths[i:i + 1 + len(p.comm_s)]))
        i += 1 + len(p.comm_s)
    totals = [p.compute_s + sum(p.comm_s.values()) for p in possible.values()]
    for w, t in zip(per_bar, totals):
        assert w / per_bar[0] == pytest.approx(t / totals[0], rel=0.01, abs=0.6 / per_bar[0])
    # memory: the budget line sits at the device's memory on the same scale as the bars
    assert page.locator("#memory-chart line.limit").count() == 1
    assert page.locator("#layout-memory-chart rect.seg").count() == sum(len(p.memory) for p in possible.values())

    # the table: one row per collapsed group, data-count its nodes, all nodes but inputs and outputs
    rows = table_rows(llama_plan)
    shown = [n for n in llama_plan.nodes if n.op not in ("input", "output")]
    assert page.locator("tr.group").count() == len(rows) < len(shown) / 20   # 32 layers collapse
    counts = page.eval_on_selector_all("tr.group", "els => els.map(e => +e.dataset.count)")
    assert counts == [r.count for r in rows] and sum(counts) == len(shown)
    assert page.locator("tr.member").count() == sum(r.count for r in rows if r.count > 1)
    assert page.locator("tr.member:visible").count() == 0
    first = next(i for i, r in enumerate(rows) if r.count > 1)
    page.click(f'button.toggle[data-group="g{first}"]')
    assert page.locator("tr.member:visible").count() == rows[first].count == 32   # one per layer
    page.click(f'button.toggle[data-group="g{first}"]')
    assert page.locator("tr.member:visible").count() == 0
    page.fill("#filter", "feed_forward.w2")
    visible = page.eval_on_selector_all("tr.group", "els => els.filter(e => e.offsetParent !== null).length")
    assert visible == sum(1 for r in rows if "feed_forward.w2" in r.label)

    # collectives: one row per (phase, kind, axes), their counts adding up to the plan's
    groups = collective_groups(llama_plan)
    assert page.locator("tr.coll").count() == len(groups)
    coll_counts = page.eval_on_selector_all("tr.coll td:nth-child(4)", "els => els.map(e => +e.textContent)")
    assert coll_counts == [len(cs) for _, cs in groups] and sum(coll_counts) == len(llama_plan.collectives)
    assert errors == []
    page.close()


def test_pipelined_report_draws_the_schedule(pipelined_plan, browser, tmp_path):
    pp = pipelined_plan.pipeline
    assert pp.pipelined and len(pp.stages) == 2
    path = write_report(pipelined_plan, tmp_path / "pp.html")
    page, errors = open_report(browser, path)
    gantt = page.locator("svg.gantt")
    assert gantt.count() == 1
    box = gantt.bounding_box()
    assert box["width"] > 500 and box["height"] > 100
    # 1F1B: one forward and one backward block per stage and microbatch
    assert page.locator("svg.gantt rect.event").count() == 2 * 2 * 4
    # memory: one bar per device group, each with its categories
    labels = page.eval_on_selector_all("#memory-chart text", "els => els.map(e => e.textContent)")
    assert sum(t.startswith("device group") for t in labels) == 2
    assert page.locator("#memory-chart rect.seg").count() == sum(len(m) for m in pp.group_memory)
    assert "2 pipeline stages over pp" in page.text_content(".headline")
    assert errors == []
    page.close()


def test_a_plan_saved_by_an_older_autopar(llama_plan, tmp_path, capsys):
    """Fields added since format 2 (recomputation, notes, frozen parameters, timing) may be
    missing from an older file, which then renders; a file without a field every version
    wrote, or of another format, is refused with one line naming the file and what to do."""
    saved = tmp_path / "plan.json"
    llama_plan.save(saved)
    d = json.loads(saved.read_text())
    old = {k: v for k, v in d.items() if k not in ("recompute", "notes", "frozen", "timing", "graph", "checksum")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["-q", "report", str(tmp_path / "old.json"), "-o", str(tmp_path / "old.html")]) == 0
    html = (tmp_path / "old.html").read_text()
    assert html.count('class="group"') == len(table_rows(llama_plan))
    assert "every layer keeps its activations" in html          # no recompute record: none

    broken = {k: v for k, v in d.items() if k not in ("nodes", "checksum")}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    capsys.readouterr()
    assert main(["-q", "report", str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "broken.json" in err and "'nodes'" in err and "plan again" in err
    assert not (tmp_path / "broken.html").exists()

    (tmp_path / "v1.json").write_text(json.dumps(dict(old, format=1)))
    assert main(["-q", "report", str(tmp_path / "v1.json")]) == 2
    err = capsys.readouterr().err
    assert "plan format 1 is not this autopar's format 2" in err and "v1.json" in err
