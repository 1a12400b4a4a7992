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


H, B, S = 64, 8, 16          # the block's sizes: x [B, S, H], fc1 H -> 4H, fc2 4H -> H
X, Y, W = B * S * H, B * S * 4 * H, 4 * H * H   # elements: the block's input (and output), fc1's output, a weight


def _grid_closed_form(form: str, sizes: tuple) -> tuple:
    """(forward, backward) bytes per device, per collective kind, of the block's two grid
    layers: x gathered over j, W over i, 3D's partial output reduce-scattered over l; backward
    gathers both again and reduce-scatters dW, and dx except for the first layer (its input
    takes no gradient); 3D gathers the output's gradient over l first."""
    ni, nj = sizes[0], sizes[1]
    nl = sizes[2] if form == "3d" else 1
    p = ni * nj * (sizes[2] if len(sizes) > 2 else 1)
    fwd, bwd = {}, {}

    def add(table, kind, elements):
        table[kind] = table.get(kind, 0) + 4 * elements
    for x, y, first in ((X, Y, True), (Y, X, False)):
        gx, gw, gy = x / p * (nj - 1), W / (ni * nj * nl) * (ni - 1), y / p * (nl - 1)
        add(fwd, "all_gather", gx + gw)
        add(bwd, "all_gather", gx + (0 if first else gw))
        add(bwd, "reduce_scatter", gw + (0 if first else gx))
        if form == "3d":
            add(fwd, "reduce_scatter", gy)
            add(bwd, "all_gather", gy)
    return fwd, bwd


@pytest.mark.parametrize("shape,layout,form", [((2, 2), "tp-2d", "summa"), ((2, 2, 2), "tp-2.5d", "2.5d"),
                                               ((2, 2, 2), "tp-3d", "3d")])
def test_grid_layers_move_the_bytes_of_their_closed_forms(pool4, pool8, shape, layout, form):
    """Counted at the collective calls of one forward and one training step, per device."""
    from grid_cases import block_plan, grid_bytes
    plan = block_plan(H, B, S, shape, layout)
    assert _forms(plan) == {form}
    fwd, bwd = _grid_closed_form(form, shape)
    step = {k: fwd.get(k, 0) + bwd.get(k, 0) for k in set(fwd) | set(bwd)}
    for got in (pool4 if len(shape) == 2 else pool8).run(grid_bytes, H, B, S, plan):
        assert got["forward"]["grid"] == pytest.approx(fwd, abs=0), got
        assert got["step"]["grid"] == pytest.approx(step, abs=0), got


def test_megatron_block_moves_its_closed_form(pool4):
    """1D Megatron on 4 ranks: the block's forward all-reduces its output once, 2 (p - 1)/p |y|
    per device (ring), where the loss reads it whole."""
    from grid_cases import block_plan, grid_bytes
    plan = block_plan(H, B, S, (4,), "megatron-tp")
    assert [n["strategy"] for n in plan["nodes"] if n["op"] == "aten.linear"] == ["a=col", "a=row"]
    got = pool4.run(grid_bytes, H, B, S, plan)[0]
    assert got["forward"] == {"other": {"all_reduce": 4 * 2 * 3 * X // 4}}, got
