"""Multi-dimensional tensor parallelism (ops/grid_rule.py, passes/grid_ops.py): linear layers
on a grid of mesh axes (SUMMA 2D, Tesseract 2.5D, the 3D matmul) and the split norms
between them train like one device, move the bytes their closed forms say, and are what the
planner picks where they win."""
import pytest

from rt_cases import plan_for, train_and_compare

GPT = ("autopar", "gpt-tiny", ())
LLAMA = ("autopar", "llama-tiny", ())
HF_LLAMA = ("hf-llama",)


def _forms(plan_dict) -> set:
    return {n["strategy"].split(" ", 1)[0] for n in plan_dict["nodes"] if n["op"] == "aten.linear"}


@pytest.mark.parametrize("spec", [GPT, LLAMA, HF_LLAMA], ids=["gpt", "llama", "hf-llama"])
def test_tp_2d_trains_like_one_device(pool4, spec):
    plan = plan_for(spec, "tp-2d", (2, 2), ("a", "b"))
    assert "summa" in _forms(plan)
    result = pool4.run(train_and_compare, spec, plan)[0]
    assert result["ok"], result


@pytest.mark.parametrize("layout", ["tp-2.5d", "tp-3d"])
@pytest.mark.parametrize("spec", [GPT, LLAMA, HF_LLAMA], ids=["gpt", "llama", "hf-llama"])
def test_three_axis_grids_train_like_one_device(pool8, spec, layout):
    plan = plan_for(spec, layout, (2, 2, 2), ("a", "b", "c"))
    assert _forms(plan) & {"2.5d", "3d"} == {layout[3:]}
    result = pool8.run(train_and_compare, spec, plan)[0]
    assert result["ok"], result
