"""Which versions CI installs: the supported ranges live in pyproject.toml; this script turns
them into a pip constraints file for one of three runs.

    python .ci/deps.py constraints pinned    # .ci/constraints.txt: every package CI installs, exact (reproducible)
    python .ci/deps.py constraints newest    # the newest releases inside the ranges (torch stays the machine's)
    python .ci/deps.py constraints oldest    # each direct dependency at its range's lower bound
    python .ci/deps.py drift                 # what is installed that differs from .ci/constraints.txt
    python .ci/deps.py lock                  # rewrite .ci/constraints.txt from pip's resolution today

`constraints` prints the path of the file to pass to `pip install -c`.  Standard library only:
it runs before anything is installed."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = ROOT / ".ci" / "constraints.txt"
TORCH = "torch==2.13.0"   # the CPU build on the CI machine's disk; any other torch is a multi-GB download
EXTRAS = ("test",)
_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$")


def _pyproject_requirements() -> list[str]:
    """The dependency and test-extra strings of pyproject.toml, as written."""
    text = (ROOT / "pyproject.toml").read_text()
    found = []
    for key in ("dependencies",) + EXTRAS:
        m = re.search(rf"^{key}\s*=\s*\[(.*?)\]", text, re.M | re.S)
        if m is None:
            raise SystemExit(f"pyproject.toml has no '{key} = [...]' list")
        found += re.findall(r'"([^"]+)"', m.group(1))
    return found


def ranges() -> dict[str, str]:
    """{normalised name: specifier} of every direct dependency, e.g. {"numpy": ">=1.24,<3"}."""
    out = {}
    for req in _pyproject_requirements():
        name, spec = _REQ.match(req).groups()
        out[_norm(name)] = spec.replace(" ", "")
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lower(spec: str) -> str | None:
    m = re.search(r">=\s*([0-9][^,]*)", spec)
    return m.group(1) if m else None


def constraints(kind: str) -> Path:
    if kind == "pinned":
        return PINNED
    lines = [TORCH]
    if kind == "oldest":
        for name, spec in ranges().items():
            low = _lower(spec)
            if name != "torch" and low is not None:
                lines.append(f"{name}=={low}.*")   # the lower bound's release, its last patch
    elif kind != "newest":
        raise SystemExit(f"constraints: unknown kind {kind!r}; give pinned, newest or oldest")
    out = Path(tempfile.gettempdir()) / f"autopar-constraints-{kind}.txt"
    out.write_text("\n".join(lines) + "\n")
    return out


def pinned() -> dict[str, str]:
    out = {}
    for line in PINNED.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[_norm(name)] = version
    return out


def drift() -> list[str]:
    """One line per pinned package whose installed version differs from the pin."""
    lines = []
    for name, want in sorted(pinned().items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have.split("+")[0] != want.split("+")[0]:
            lines.append(f"{name}: {have} (pinned {want})")
    return lines


def lock() -> None:
    """Resolve torch==2.13.0 and autopar[test] afresh and write every package of the
    resolution to .ci/constraints.txt."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), TORCH, "-e", f"{ROOT}[{','.join(EXTRAS)}]"], check=True)
        found = json.loads(report.read_text())["install"]
    rows = sorted((_norm(i["metadata"]["name"]), i["metadata"]["version"].split("+")[0]) for i in found)
    body = [f"{n}=={v}" for n, v in rows if n not in ("autopar", "setuptools")]
    PINNED.write_text("# Every package CI installs, exact: written by `python .ci/deps.py lock`; the ranges we\n"
                      "# support are pyproject.toml's (tests/test_versions.py holds these pins inside them).\n"
                      + "\n".join(body) + "\n")
    print(f"wrote {len(body)} pins to {PINNED}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["constraints"] and len(argv) == 2:
        print(constraints(argv[1]))
    elif argv == ["drift"]:
        print("\n".join(drift()) or "no drift: every pinned package is installed at its pin")
    elif argv == ["lock"]:
        lock()
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
