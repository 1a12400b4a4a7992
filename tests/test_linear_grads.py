"""Tensor-parallel collectives beside the GEMMs (autopar/passes/fold_linears.py): input
gradients reduced while the weight gradients compute, row-parallel outputs reduced in
pieces while the next piece computes.  The folds on small graphs, their prices, and
Megatron TP, Megatron-SP and TP x ZeRO-3 training like one device with them, on 4 gloo
ranks."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.passes.collectives import Move, move
from autopar.passes.fold_linears import fold_linear_gradients, linears_then_gradient
from rt_cases import build_case, train_and_compare


class _OneAxis:
    ndim = 1

    def size(self, axis):
        return 2

    def coordinate(self, axis):
        return 0


def _graph(third_reader: bool) -> fx.GraphModule:
    """x -> move (Megatron's f: nothing forward, all-reduce backward) -> two linears, and
    with third_reader a relu reading the moved tensor too."""
    root = torch.nn.Module()
    root.f, root.groups = Move((Replicate(),), (Replicate(),), (Partial(),), (Replicate(),)), _OneAxis()
    g = fx.Graph()
    x, w1, b1, w2 = (g.placeholder(n) for n in ("x", "w1", "b1", "w2"))
    x.meta["val"] = torch.empty(4, 8)
    moved = g.call_function(move, (x, g.get_attr("f"), g.get_attr("groups")))
    y1 = g.call_function(torch.ops.aten.linear.default, (moved, w1, b1))
    y2 = g.call_function(torch.ops.aten.linear.default, (moved, w2))
    outs = [y1, y2] + ([g.call_function(torch.ops.aten.relu.default, (moved,))] if third_reader else [])
    g.output(tuple(outs))
    return fx.GraphModule(root, g)


def test_the_fold_makes_one_call_of_the_move_and_its_linears_and_keeps_the_values():
    torch.manual_seed(0)
    args = (torch.randn(4, 8), torch.randn(3, 8), torch.randn(3), torch.randn(5, 8))
    gm = _graph(third_reader=False)
    want = gm(*args)
    assert fold_linear_gradients(gm, (2,)) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [linears_then_gradient, operator.getitem, operator.getitem]
    assert calls[0].args[3] == (True, False)   # which linears have a bias
    for got, w in zip(gm(*args), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    other = _graph(third_reader=True)   # a reader that is not a linear: left as it is
    assert fold_linear_gradients(other, (2,)) == 0
    assert sum(n.target is move for n in other.graph.nodes) == 1

# (model, mesh, layout, whether a row-parallel linear's output is reduced right after it:
# under Megatron TP, GPT's and GPT-NeoX's dropout sits between, so the sum is reduced later)
CASES = [
    (("autopar", "gpt-tiny", ()), (4,), ("tp",), "megatron-tp", False),
    (("autopar", "gpt-tiny", ()), (2, 2), ("dp", "tp"), "megatron-sp x dp", True),
    (("autopar", "llama-tiny", ()), (2, 2), ("dp", "tp"), "megatron-tp x zero3", True),
    (("hf-llama",), (4,), ("tp",), "megatron-sp", True),
    (("hf-arch", "qwen3"), (2, 2), ("dp", "tp"), "megatron-tp x dp", True),
    (("hf-arch", "gpt_neox"), (4,), ("tp",), "megatron-tp", False),
]
# under selective recomputation: input gradients folded inside the recomputed regions, the
# kept row-parallel linears left whole (Megatron-SP's layer norm weights are gathered inside
# the regions: replayed outside the saved-tensor policy, runtime/regions/reshard.Regather.gather)
RECOMPUTED = [
    (("autopar", "gpt-tiny", ()), (4,), ("tp",), "megatron-sp", False, "selective"),
    (("hf-arch", "qwen3"), (2, 2), ("dp", "tp"), "megatron-tp x dp", False, "selective"),
    (("hf-arch", "gpt_neox"), (4,), ("tp",), "megatron-sp", False, "selective"),
]


CASES = [c + (None,) for c in CASES] + RECOMPUTED


@pytest.mark.parametrize("spec,shape,names,layout,rows,recompute", CASES,
                         ids=[f"{c[0][-1] if c[0][0] == 'hf-arch' else c[0][1] if len(c[0]) > 1 else c[0][0]}-"
                              f"{c[3]}-{'x'.join(map(str, c[1]))}" + (f"-{c[5]}" if c[5] else "") for c in CASES])
def test_folded_tensor_parallel_trains_like_one_device(pool4, spec, shape, names, layout, rows, recompute):
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, names, device="cpu")
    plan = autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                        solve=autopar.SolveOptions(compare=False, layout=layout), recompute=recompute)
    assert bool(plan.recompute and plan.recompute.layers) == bool(recompute)
    result = pool4.run(train_and_compare, spec, plan.to_dict())
    for r in result:
        assert r["ok"], r
        inputs, outputs = r["folded_linears"]
        assert inputs > 0 and (outputs > 0) == rows, r["folded_linears"]


def test_the_plan_hides_what_the_gemms_outlast(monkeypatch):
    """An MLP of width 4,096 (four linears) and batch 1,024 under Megatron on 4 H100, where
    every GEMM outlasts the collective beside it: each input gradient's all-reduce or
    reduce-scatter is hidden whole behind the weight gradient, and each row-parallel
    output's all-reduce half (two pieces: the last piece's waits); the loss's all-reduce
    and the forward all-gather are not beside a GEMM.  That is with the pieces priced at
    the whole GEMM's rate; as priced (prices.gemm_pieces_extra: 512-row halves run slower
    here), the row-parallel output hides less, the input gradients the same.  On CPU ranks
    nothing is hidden."""
    from autopar.models import build
    from autopar.cost import prices
    from autopar.cost.prices import GEMM_CHUNKS
    model, example = build("mlp", device="meta", hidden=4096, batch=1024)
    mesh = autopar.Mesh((4,), ("tp",), device="h100")
    priced = autopar.plan(model, mesh, example,
                          solve=autopar.SolveOptions(layout="megatron-tp",
                                                     compare=False)).predicted.linear_hidden_s["tp"]
    monkeypatch.setattr(prices, "gemm_pieces_extra", lambda *args: 0.0)
    for device in ("h100", "cpu"):
        plan = autopar.plan(model, autopar.Mesh((4,), ("tp",), device=device), example,
                            solve=autopar.SolveOptions(layout="megatron-tp", compare=False))
        pred = plan.predicted
        reductions = [c for c in plan.collectives if c.kind in ("all_reduce", "reduce_scatter")]
        backward = [c for c in reductions if c.phase == "backward"]
        rows = [c for c in reductions if c.phase == "forward" and c.tensor.startswith("linear")]
        if device == "h100":
            assert len(backward) == 2 and len(rows) == 1, plan.collectives
            want = sum(c.seconds for c in backward) + sum(c.seconds for c in rows) * (GEMM_CHUNKS - 1) / GEMM_CHUNKS
            assert pred.linear_hidden_s == pytest.approx({"tp": want}, rel=1e-12)
            assert "tensor-parallel collectives behind their GEMMs" in str(pred)
            assert sum(c.seconds for c in backward) < priced < want
        else:
            assert pred.linear_hidden_s == {} and pred.hidden_s == 0.0
        assert pred.step_s == pytest.approx(pred.compute_s + sum(pred.comm_s.values()) - pred.hidden_s, rel=1e-12)


def test_a_row_parallel_output_is_cut_along_batch_then_sequence():
    """gemm_chunk_dim: the batch dim when it has two rows, else the sequence; never the dim
    a reduce-scatter scatters, nor the features."""
    from autopar.cost.prices import gemm_chunk_dim
    assert gemm_chunk_dim((4, 16, 32), "all_reduce", None) == 0
    assert gemm_chunk_dim((1, 16, 32), "all_reduce", None) == 1
    assert gemm_chunk_dim((4, 16, 32), "reduce_scatter", 0) == 1
    assert gemm_chunk_dim((1, 16, 32), "reduce_scatter", 1) is None
    assert gemm_chunk_dim((1, 32), "all_reduce", None) is None


@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_pipeline_stages_take_off_what_their_runtime_folds(device):
    """A stage's costs (solve/pipeline/costs) carry each node's seconds hidden beside GEMMs
    (Assembled.folded, which add up to the stage plan's Prediction.linear_hidden_s).  A
    schedule whose stages fold them (1F1B: runtime/pipeline/pipelined.py folds every stage) runs
    each stage that much faster than one whose backward splits off the weight gradients
    (zero-bubble, left unfolded); on CPU ranks nothing is hidden and the two are equal."""
    from autopar.models import build
    from autopar.solve.assemble import assemble
    from autopar.solve.pipeline.candidates import _stages
    from autopar.solve.pipeline.costs import layer_costs
    from autopar.solve.built import build_problem
    from autopar.solve.ilp.solved import SolveOptions
    model, example = build("llama3-8b", device="meta", batch=2, seq=2048, n_layers=4)
    stage_mesh = autopar.Mesh((4,), ("tp",), device=device)
    built = build_problem(model, stage_mesh, example, None, autopar.MixedPrecision.of("bf16"))
    costs = layer_costs(built, model, SolveOptions(workers=1))
    parts = costs.by_mode["none"]
    hidden = sum(c.folded_forward + c.folded_backward for c in parts.members)
    predicted = assemble(built.problem, built.summed(SolveOptions(workers=1)).choice).predicted
    assert hidden == pytest.approx(sum(predicted.linear_hidden_s.values()), rel=1e-9)
    assert (hidden > 0.02 * predicted.step_s) == (device == "h100"), (hidden, predicted)
    _, f1, b1, *_ = _stages(parts, costs.copies, 0.0, 2, True, "1f1b")
    cuts, fz, bz, *_ = _stages(parts, costs.copies, 0.0, 2, True, "zero-bubble")
    for s, (a, b) in enumerate(cuts):
        members = list(parts.layers[a:b]) + ([parts.prefix] if s == 0 else []) + (
            [parts.suffix, costs.copies] if s == 1 else [])
        assert fz[s] - f1[s] == pytest.approx(sum(c.folded_forward for c in members), rel=1e-9, abs=1e-15)
        assert bz[s] - b1[s] == pytest.approx(sum(c.folded_backward for c in members), rel=1e-9, abs=1e-15)
    mesh = autopar.Mesh((2, 4), ("pp", "tp"), device=device)
    steps = {sched: autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp"),
                                 mixed_precision=autopar.MixedPrecision(),
                                 pipeline=autopar.Pipeline(axis="pp", groups=2, schedule=sched, microbatches=2))
             .pipeline.stage_s for sched in ("1f1b", "zero-bubble")}
    if device == "h100":
        assert all(a < b for a, b in zip(steps["1f1b"], steps["zero-bubble"])), steps
    else:
        assert steps["1f1b"] == pytest.approx(steps["zero-bubble"], rel=1e-12), steps


def test_a_fold_under_recomputation_is_priced_as_the_runtime_folds_it():
    """Selective recomputation keeps every linear of a layer: the runtime folds their input
    gradients as it does without recomputation (the folded call keeps its matrix products:
    runtime/regions/recompute.py), but not the row-parallel outputs, whose pieces are reduced in
    place.  "alternate" keeps q and v but not k, gate but not up (one call keeps all its
    products or none: those input gradients stay whole) and down_proj but not o_proj
    (o_proj's output is still folded).  Full recomputation keeps nothing and hides what
    the plan without recomputation hides.  The price hides exactly that much less."""
    from autopar.models import build
    model, example = build("llama3-8b", device="meta", batch=2, seq=2048, n_layers=4)
    mesh = autopar.Mesh((4,), ("tp",), device="h100")
    hidden, kept = {}, {}
    for mode in ("none", "selective", "alternate", "full"):
        plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp"),
                            recompute=mode, mixed_precision=autopar.MixedPrecision())
        hidden[mode] = sum(plan.predicted.linear_hidden_s.values())
        kept[mode] = plan.recompute.kept if plan.recompute is not None else ()
    assert sum(name.startswith("linear") for name in kept["selective"]) == 4 * 7, kept["selective"]
    assert hidden["full"] == pytest.approx(hidden["none"], rel=1e-12)
    assert 0 < hidden["alternate"] < hidden["selective"] < hidden["none"], hidden


def test_tp_overlap_false_runs_and_prices_the_collectives_whole(pool4):
    """autopar.plan(tp_overlap=False): nothing hidden beside GEMMs on GPUs (the step is the
    folded plan's plus what it hid, the layout being forced), the plan says so, keeps it
    through to_dict, and compile folds nothing: Megatron TP x DP trains like one device
    with every collective whole."""
    from autopar.models import build
    from autopar.report.plan import Plan
    model, example = build("llama3-8b", device="meta", batch=2, seq=2048, n_layers=2)
    mesh = autopar.Mesh((4,), ("tp",), device="h100")
    kw = dict(solve=autopar.SolveOptions(compare=False, layout="megatron-tp"), mixed_precision=autopar.MixedPrecision())
    folded = autopar.plan(model, mesh, example, **kw)
    whole = autopar.plan(model, mesh, example, pricing=autopar.Pricing(tp_overlap=False), **kw)
    assert folded.tp_overlap and not whole.tp_overlap and whole.predicted.linear_hidden_s == {}
    hidden = sum(folded.predicted.linear_hidden_s.values())
    assert hidden > 0
    assert whole.predicted.step_s == pytest.approx(folded.predicted.step_s + hidden, rel=0.02)
    assert "run whole, not beside their GEMMs (tp_overlap=False)" in str(whole)
    assert not Plan.from_dict(whole.to_dict()).tp_overlap
    with pytest.raises(ValueError, match="tp_overlap='no'"):
        autopar.plan(model, mesh, example, pricing=autopar.Pricing(tp_overlap="no"), **kw)
    spec = ("autopar", "llama-tiny", ())
    model, args, kwargs = build_case(spec)
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False, layout="megatron-tp x dp"),
                        pricing=autopar.Pricing(tp_overlap=False))
    for r in pool4.run(train_and_compare, spec, plan.to_dict()):
        assert r["ok"] and r["folded_linears"] == (0, 0), r


def test_a_gemm_in_pieces_is_charged_the_rate_its_smaller_pieces_lose():
    """prices.gemm_pieces_extra: a GEMM whose half fills the device's waves as well as the
    whole adds nothing (Llama-8B's down projection on 8 H100: 2,048 rows); GPT-2's output
    projection at 512 rows loses rate in halves (fewer tiles than SMs); nothing on CPU
    ranks, which have no kernel model.  The plan hides a row-parallel output's pieces less
    that extra share of the linear's forward."""
    from autopar.cost.prices import GEMM_CHUNKS, gemm_pieces_extra
    from autopar.cost.kernels import gemm_efficiency
    h100 = autopar.Mesh((8,), ("tp",), device="h100")
    kernels = h100.device.kernels
    assert gemm_pieces_extra((1, 2048, 4096), 1792, h100) == 0.0
    want = gemm_efficiency(512, 768, 96, kernels) / gemm_efficiency(256, 768, 96, kernels) - 1
    assert gemm_pieces_extra((1, 512, 768), 96, h100) == pytest.approx(want, rel=1e-12) and want > 0.1
    assert gemm_pieces_extra((1, 512, 768), 96, autopar.Mesh((8,), ("tp",), device="cpu")) == 0.0
    assert GEMM_CHUNKS == 2
