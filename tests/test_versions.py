"""The versions autopar supports are stated once (pyproject.toml), shown in the README, pinned
for CI inside them (.ci/constraints.txt), and what is installed lies inside them: a release
outside the tested ranges fails here by name instead of somewhere deep in a sweep."""
from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ci_deps", ROOT / ".ci" / "deps.py")
deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deps)
RANGES = deps.ranges()


def test_every_dependency_has_a_lower_and_an_upper_bound():
    for name, spec in RANGES.items():
        ops = {s.operator for s in SpecifierSet(spec)}
        assert ">=" in ops and "<" in ops, f"{name}{spec}: give a tested lower bound and an upper bound below the next major"


@pytest.mark.parametrize("name", sorted(RANGES))
def test_installed_version_is_inside_its_range(name):
    have = Version(metadata.version(name))
    spec = SpecifierSet(RANGES[name])
    assert spec.contains(Version(have.base_version)), (
        f"{name} {have} is installed, outside the range autopar is tested with ({name}{spec}, pyproject.toml): "
        f"install a release inside it (pip install -c .ci/constraints.txt -e '.[test]'), or test the new release "
        f"and move the range")


def test_readme_table_states_pyproject_ranges():
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| ([a-z0-9_-]+)(?: \(test\))? \| ([^|]+?) \|", readme, re.M))
    assert {deps._norm(k): v for k, v in rows.items() if k != "package"} == RANGES


def test_ci_pins_lie_inside_the_ranges():
    pins = deps.pinned()
    missing = sorted(set(RANGES) - set(pins))
    assert not missing, f"{missing} not pinned in .ci/constraints.txt: run python .ci/deps.py lock"
    outside = {n: pins[n] for n in RANGES if not SpecifierSet(RANGES[n]).contains(Version(pins[n]))}
    assert not outside, f"pins outside pyproject's ranges: {outside}"


def test_oldest_constraints_name_each_lower_bound():
    lines = set(deps.constraints("oldest").read_text().split())
    assert "transformers==5.18.*" in lines and "numpy==1.24.*" in lines and deps.TORCH in lines
    assert not any(line.startswith("torch==2.5") for line in lines)   # torch stays the machine's build
