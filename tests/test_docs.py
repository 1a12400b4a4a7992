"""The docs in three kinds (README front page, docs/PERFORMANCE.md's current numbers, the
dated docs/log/), held to their budgets, their links resolving, and the facts a test can
count stated as the code has them."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200 and len(text.split()) <= 1500, (len(text.splitlines()), len(text.split()))
    assert not DATE.findall(text), "README: dated facts belong in docs/PERFORMANCE.md or docs/log/"


def test_performance_page_holds_current_numbers_only():
    assert len((ROOT / "docs" / "PERFORMANCE.md").read_text().splitlines()) <= 600
    assert (ROOT / "docs" / "log" / "README.md").exists()


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target, _ in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_status_counts_the_families_the_tests_build():
    """STATUS's summary row counts the families tests/hf_archs.py builds, and its closed-form
    sweep the families that sweep runs."""
    import hf_archs
    status = (ROOT / "docs" / "STATUS.md").read_text()
    row = re.search(r"\| \[Hugging Face architectures\]\S* \| done, (\d+) families", status)
    sweep = re.search(r"The (\d+) families of the table below", status)
    assert row and int(row.group(1)) == len(hf_archs._configs())
    assert sweep and int(sweep.group(1)) == len(hf_archs.FAMILIES + hf_archs.FUSED + hf_archs.MOE)
