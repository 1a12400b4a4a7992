"""Plans save to JSON and load back equal; the same inputs always give the same plan."""
import json

import autopar
from autopar.models import build


def make_plan():
    model, example = build("gpt-tiny", device="meta")
    return autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device="h100"), example, memory_budget="40GiB")


def test_save_load_round_trip(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan
    assert loaded.param_placements == plan.param_placements
    assert loaded.timing == plan.timing
    assert loaded.to_json() == plan.to_json()
    assert loaded.hash() == plan.hash()
    assert str(loaded) == str(plan)
    assert json.loads(path.read_text())["memory_budget"] == 40 * 2**30


def test_same_inputs_same_plan():
    a, b = make_plan(), make_plan()
    assert a == b and a.hash() == b.hash()
    assert a.identity == b.identity


def test_printed_plan_reads_as_a_table():
    plan = make_plan()
    text = str(plan)
    assert "predicted: step" in text and "hand-written layouts" in text and "collectives per step" in text
    header = [l for l in text.splitlines() if l.startswith("module")][0]
    assert all(col in header for col in ("module", "op", "layout", "time", "memory"))
    # the repeated blocks collapse into one row per op, labelled with their index range
    assert any(l.startswith("blocks.0-1.attn.q ") for l in text.splitlines())
    from autopar.report.records import format_bytes
    assert format_bytes(plan.predicted.memory_total) in text
