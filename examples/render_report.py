"""Regenerate the report screenshots the README shows (docs/figures/):

    python examples/render_report.py [--out docs/figures] [--chromium /usr/bin/chromium]

- report-llama3-8b.png: Llama-3-8B on an 8x8 H100 mesh (dp across nodes, tp inside), bf16
  mixed precision: the top of the report (summary, mesh, the plan against the hand-written
  layouts);
- report-pipeline.png: GPT-2 1.5B on 8 nodes of 8 H100s whose network is 2.5 GB/s, with the
  pipeline search (float32, as tests/test_pipeline_search.py plans it): memory per device
  group, the step timeline and the pipeline's Gantt chart.

Plans on the meta device (no weights; about 20 s on a laptop), writes the HTML reports to a
temporary folder and screenshots them in headless Chromium through playwright
(pip install playwright; the distribution's Chromium: apt-get install chromium).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

import autopar
from autopar.report.html import write_report
from autopar.models import build


def plans():
    model, example = build("llama3-8b", device="meta")
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    yield "report-llama3-8b", autopar.plan(model, mesh, example, mixed_precision="bf16"), "h1", "#modules"
    model, example = build("gpt2-1.5b", device="meta", batch=16)
    mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
    yield "report-pipeline", autopar.plan(model, mesh, example, pipeline=True), "#memory", "#modules"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "figures"))
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as tmp:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        for name, plan, first, stop in plans():
            html = write_report(plan, Path(tmp) / f"{name}.html")
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(html.resolve().as_uri())
            top = page.evaluate(f"document.querySelector('{first}').getBoundingClientRect().top + window.scrollY")
            end = page.evaluate(f"document.querySelector('{stop}').getBoundingClientRect().top + window.scrollY")
            page.screenshot(path=str(out / f"{name}.png"), full_page=True,
                            clip={"x": 0, "y": max(top - 12, 0), "width": 1280, "height": end - top + 40})
            page.close()
            print(f"wrote {out / (name + '.png')}: {plan.model} on {plan.device_mesh()}")
        browser.close()


if __name__ == "__main__":
    main()
