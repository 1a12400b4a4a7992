"""Multi-dimensional tensor parallelism (ops/grid_rule.py, passes/grid_ops.py): linear layers
on a grid of mesh axes (SUMMA 2D, Tesseract 2.5D, the 3D matmul, 2D weight-stationary) and
the split norms between them train like one device and move the bytes their closed forms
say; the planner picks a 2D form over 1D where it wins."""
import autopar
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


@pytest.mark.parametrize("spec,layout", [(GPT, "tp-2.5d"), (GPT, "tp-3d"), (LLAMA, "tp-3d"), (HF_LLAMA, "tp-2.5d"),
                                         (HF_LLAMA, "tp-3d")],
                         ids=["gpt-2.5d", "gpt-3d", "llama-3d", "hf-llama-2.5d", "hf-llama-3d"])
def test_three_axis_grids_train_like_one_device(pool8, spec, layout):
    plan = plan_for(spec, layout, (2, 2, 2), ("a", "b", "c"))
    assert _forms(plan) & {"2.5d", "3d"} == {layout[3:]}
    result = pool8.run(train_and_compare, spec, plan)[0]
    assert result["ok"], result


def _crossed(plan_dict, prefixes=("blocks.", "model.layers.", "layers.")) -> list:
    """(column axis, row axis) of each linear layer whose module starts with one of
    `prefixes` (the repeated layers; "" for every one), None where it is not 2D."""
    from autopar.ops.strategy import crossed_axes
    return [crossed_axes(n["split"]) for n in plan_dict["nodes"]
            if n["op"] == "aten.linear" and n["module"].startswith(prefixes)]


@pytest.mark.parametrize("layout", ["tp-2d", "tp-2d-ws"])
def test_weights_used_as_x_at_w_take_the_2d_forms(pool4, layout):
    """An MLP whose weights are plain matrices applied as `x @ W` (aten.matmul, W [k, n])
    takes SUMMA and 2D weight-stationary like nn.Linear, and trains like one device."""
    spec = ("user", "matmul-mlp")
    plan = plan_for(spec, layout, (2, 2), ("a", "b"))
    matmuls = [n for n in plan["nodes"] if n["op"] == "aten.matmul" and ".mlp" in n["module"]]
    assert len(matmuls) == 4, [n["module"] for n in matmuls]
    if layout == "tp-2d":
        assert {n["strategy"].split(" ", 1)[0] for n in matmuls} == {"summa"}, matmuls
    else:
        from autopar.ops.strategy import crossed_axes
        assert all(crossed_axes(n["split"], ("n", "k")) for n in matmuls), matmuls
    result = pool4.run(train_and_compare, spec, plan)[0]
    assert result["ok"], result


@pytest.mark.parametrize("spec", [GPT, LLAMA, HF_LLAMA], ids=["gpt", "llama", "hf-llama"])
def test_tp_2d_weight_stationary_trains_like_one_device(pool4, spec):
    """2D weight-stationary: every layer's weight split by columns on one axis and rows on
    the other; consecutive layers cross the other way round (q, k, v one way, o the other)."""
    plan = plan_for(spec, "tp-2d-ws", (2, 2), ("a", "b"))
    crossed = _crossed(plan)
    assert crossed and None not in crossed and set(crossed) == {(0, 1), (1, 0)}, crossed
    result = pool4.run(train_and_compare, spec, plan)[0]
    assert result["ok"], result


H, B, S = 64, 8, 16          # the block's sizes: x [B, S, H], fc1 H -> 4H, fc2 4H -> H
X, Y, W = B * S * H, B * S * 4 * H, 4 * H * H   # elements: the block's input (and output), fc1's output, a weight


def _grid_closed_form(form: str, sizes: tuple, gathered: list) -> tuple:
    """(forward, backward) bytes per device, per collective kind, of the block's two grid
    layers, and the bytes of the inputs gathered before them: x gathered over j, W over i,
    3D's partial output reduce-scattered over l; backward gathers both again and
    reduce-scatters dW, and dx except for the first layer (its input takes no gradient); 3D
    gathers the output's gradient over l first.  A layer whose input arrives gathered
    (`gathered`, per layer) neither gathers x nor reduce-scatters dx: the move before it does."""
    ni, nj = sizes[0], sizes[1]
    nl = sizes[2] if form == "3d" else 1
    p = ni * nj * (sizes[2] if len(sizes) > 2 else 1)
    fwd, bwd = {}, {}
    outside = 0

    def add(table, kind, elements):
        table[kind] = table.get(kind, 0) + 4 * elements
    for (x, y, first), before in zip(((X, Y, True), (Y, X, False)), gathered):
        gx, gw, gy = x / p * (nj - 1), W / (ni * nj * nl) * (ni - 1), y / p * (nl - 1)
        if before:   # (the first layer's input is the block's, whole on every rank: nothing gathers it)
            outside += 0 if first else 4 * gx
            gx = 0
        add(fwd, "all_gather", gx + gw)
        add(bwd, "all_gather", gx + (0 if first else gw))
        add(bwd, "reduce_scatter", gw + (0 if first else gx))
        if form == "3d":
            add(fwd, "reduce_scatter", gy)
            add(bwd, "all_gather", gy)
    return ({k: v for k, v in fwd.items() if v}, {k: v for k, v in bwd.items() if v}, outside)


@pytest.mark.parametrize("shape,layout,form", [((2, 2), "tp-2d", "summa"), ((2, 2, 2), "tp-2.5d", "2.5d"),
                                               ((2, 2, 2), "tp-3d", "3d")])
def test_grid_layers_move_the_bytes_of_their_closed_forms(pool4, pool8, shape, layout, form):
    """Counted at the collective calls of one forward and one training step, per device,
    inside the grid layers; an input the plan gathers before its layer is gathered there."""
    from grid_cases import block_plan, grid_bytes
    plan = block_plan(H, B, S, shape, layout)
    assert _forms(plan) == {form}
    linears = [n for n in plan["nodes"] if n["op"] == "aten.linear"]
    gathered = [n["inputs"][0][n["split"].index("grid-j")] == "R" for n in linears]
    fwd, bwd, outside = _grid_closed_form(form, shape, gathered)
    step = {k: fwd.get(k, 0) + bwd.get(k, 0) for k in set(fwd) | set(bwd)}
    for got in (pool4 if len(shape) == 2 else pool8).run(grid_bytes, H, B, S, plan):
        assert got["forward"]["grid"] == pytest.approx(fwd, abs=0), got
        assert got["step"]["grid"] == pytest.approx(step, abs=0), got
        assert got["forward"].get("other", {}).get("all_gather", 0) >= outside, got


def test_megatron_block_moves_its_closed_form(pool4):
    """1D Megatron on 4 ranks: the block's forward all-reduces its output once, 2 (p - 1)/p |y|
    per device (ring), where the loss reads it whole."""
    from grid_cases import block_plan, grid_bytes
    plan = block_plan(H, B, S, (4,), "megatron-tp")
    assert [n["strategy"] for n in plan["nodes"] if n["op"] == "aten.linear"] == ["a=col", "a=row"]
    got = pool4.run(grid_bytes, H, B, S, plan)[0]
    assert got["forward"] == {"other": {"all_reduce": 4 * 2 * 3 * X // 4}}, got


def test_weight_stationary_block_moves_its_closed_form(pool4):
    """2D weight-stationary on (2, 2): fc1 split columns on a and rows on b, fc2 the other
    way round; no weight moves.  Forward all-reduces fc1's Partial output over b and fc2's
    over a, 2 (q - 1)/q (|Y| + |X|)/q per device; backward all-reduces fc2's input gradient
    over b, 2 (q - 1)/q |Y|/q (the block's input takes none, so fc1's is not summed)."""
    from grid_cases import block_plan, grid_bytes
    plan = block_plan(H, B, S, (2, 2), "tp-2d-ws")
    assert sorted(_crossed(plan, "")) == [(0, 1), (1, 0)]
    q = 2
    forward = 4 * 2 * (q - 1) * (Y + X) // (q * q)
    backward = 4 * 2 * (q - 1) * Y // (q * q)
    for got in pool4.run(grid_bytes, H, B, S, plan):
        assert got["forward"]["other"]["all_reduce"] == forward, got
        assert got["step"]["other"]["all_reduce"] == forward + backward, got
        assert "reduce_scatter" not in got["step"]["other"], got     # (no weight gradient is summed)


def _random_plans(spec, layout, shape, seeds):
    import autopar
    from rt_cases import build_case
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, tuple("abc"[:len(shape)]), device="cpu")
    return [p.to_dict() for p in autopar.random_plans(model, mesh, args, example_kwargs=kwargs or None, seeds=seeds,
                                                      solve=autopar.SolveOptions(compare=False, layout=layout))]


@pytest.mark.parametrize("layout,shape", [("tp-2d", (2, 2)), ("tp-3d", (2, 2, 2)), ("tp-2d-ws", (2, 2))])
def test_random_grid_plans_train_like_one_device(pool4, pool8, layout, shape):
    """Random plans within the grid layouts (every op's strategy drawn from what the layout
    allows: orientations, row dims, inputs gathered inside or before, norms split or not;
    for the weight-stationary form, which axis takes the columns, and what lies between)."""
    plans = _random_plans(GPT, layout, shape, (1, 2))
    if layout == "tp-2d-ws":
        crossed = [c for p in plans for c in _crossed(p)]
        assert None not in crossed and set(crossed) == {(0, 1), (1, 0)}, crossed
    else:
        kinds = {(n["strategy"].split(" ", 1)[0], n["inputs"][0][n["split"].index("grid-j")] == "R")
                 for p in plans for n in p["nodes"] if n["op"] == "aten.linear" and "grid-j" in n["split"]}
        assert {gathered for _, gathered in kinds} == {False, True}, kinds
    for plan in plans:
        result = (pool4 if len(shape) == 2 else pool8).run(train_and_compare, GPT, plan)[0]
        assert result["ok"], (plan["origin"], result)


def test_tp_2d_trains_in_mixed_precision(pool4):
    from rt_cases import check_mixed_precision, mixed_precision_vs_reference
    plan = plan_for(GPT, "tp-2d", (2, 2), ("a", "b"), mixed_precision="bf16")
    assert "summa" in _forms(plan)
    check_mixed_precision(pool4.run(mixed_precision_vs_reference, GPT, plan)[0])


def test_a_grid_checkpoint_resumes_under_another_layout_and_back(pool4, tmp_path):
    """2D-sharded weights (two Shard placements) saved and resumed under ZeRO-3, and back."""
    from rt_cases import resume_across_layouts
    grid, other = plan_for(LLAMA, "tp-2d", (2, 2), ("a", "b")), plan_for(LLAMA, "zero3", (2, 2), ("a", "b"))
    assert any(len([p for p in pl if p.startswith("S")]) == 2 for pl in grid["param_placements"].values())
    for first, second, name in ((grid, other, "there"), (other, grid, "back")):
        result = pool4.run(resume_across_layouts, LLAMA, first, second, str(tmp_path / name))[0]
        assert result["param"] <= 0 and result["loss"] <= 0, (name, result)


def test_2_5d_with_zero_over_the_depth_trains_like_one_device(pool8):
    """The depth axis holds whole weights: drawn plans put ZeRO-1/2 on it."""
    plans = _random_plans(GPT, "tp-2.5d", (2, 2, 2), (3, 4))
    assert any(s["stage"] and "a" in s["axes"] for p in plans for s in p["param_states"].values())
    for plan in plans:
        assert "2.5d" in _forms(plan)
        result = pool8.run(train_and_compare, GPT, plan)[0]
        assert result["ok"], (plan["origin"], result)


def _gpt3_layers(layers: int, batch: int, seq: int = 2048):
    from autopar.models import build
    return build("gpt2-124m", device="meta", hidden=12288, n_heads=96, n_layers=layers, max_seq=seq, batch=batch,
                 seq=seq)


def test_planner_picks_2d_over_1d_where_it_wins_and_not_where_it_does_not():
    """GPT-3's layers (hidden 12288), two of them, planned for H100 clusters.

    512 devices, batch 8: the batch splits at most 8 ways, so 1D Megatron either computes
    redundantly or gathers every weight over 64 ranks; the ILP's plan splits the layers'
    weights 2D (weight-stationary) and predicts under half the best 1D layout's step, and no
    slower than the hand-written 2D layouts.  64 devices in nodes of 8, batch 256: the
    batch splits over the nodes and 1D Megatron inside a node costs less; the ILP keeps
    every layer 1D."""
    import autopar
    from autopar.ops.grid_rule import GRID_FORMS
    model, args = _gpt3_layers(2, 8)
    mesh = autopar.Mesh((8, 8, 8), ("a", "b", "c"), device="h100", devices_per_node=1)

    def step(layout):
        return autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout=layout),
                            mixed_precision="bf16")
    ilp = step(None)
    crossed = _crossed(ilp.to_dict())
    assert len(crossed) == 12 and None not in crossed, crossed
    assert "2D tensor parallelism (weight-stationary): a x b (12 linear layers)" in str(ilp)
    best_1d = min(step(f"megatron-tp x {s}").predicted.step_s for s in ("dp", "zero3"))
    assert ilp.predicted.step_s < 0.5 * best_1d
    for layout in ("tp-2d-ws", "tp-2d", "tp-3d"):
        assert ilp.predicted.step_s <= 1.05 * step(layout).predicted.step_s, layout

    model, args = _gpt3_layers(2, 256)
    mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", devices_per_node=8)
    ilp = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False), mixed_precision="bf16")
    assert set(_crossed(ilp.to_dict())) == {None}
    assert not {n.strategy.split(" ", 1)[0] for n in ilp.nodes} & set(GRID_FORMS)
    ws = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="tp-2d-ws"),
                      mixed_precision="bf16")
    assert ilp.predicted.step_s < ws.predicted.step_s
