"""Tensor-parallel collectives beside the GEMMs (autopar/runtime/linear_grads.py): input
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
from autopar.runtime.linear_grads import fold_linear_gradients, linears_then_gradient
from rt_cases import build_case, train_and_compare


class _OneAxis:
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
    assert fold_linear_gradients(gm) == 1
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [linears_then_gradient, operator.getitem, operator.getitem]
    assert calls[0].args[3] == (True, False)   # which linears have a bias
    for got, w in zip(gm(*args), want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    other = _graph(third_reader=True)   # a reader that is not a linear: left as it is
    assert fold_linear_gradients(other) == 0
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


@pytest.mark.parametrize("spec,shape,names,layout,rows", CASES,
                         ids=[f"{c[0][-1] if c[0][0] == 'hf-arch' else c[0][1] if len(c[0]) > 1 else c[0][0]}-"
                              f"{c[3]}-{'x'.join(map(str, c[1]))}" for c in CASES])
def test_folded_tensor_parallel_trains_like_one_device(pool4, spec, shape, names, layout, rows):
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh(shape, names, device="cpu")
    plan = autopar.plan(model, mesh, args, example_kwargs=kwargs or None, compare=False, layout=layout)
    result = pool4.run(train_and_compare, spec, plan.to_dict())
    for r in result:
        assert r["ok"], r
        inputs, outputs = r["folded_linears"]
        assert inputs > 0 and (outputs > 0) == rows, r["folded_linears"]


def test_the_plan_hides_what_the_gemms_outlast():
    """An MLP of width 4,096 (four linears) and batch 1,024 under Megatron on 4 H100, where
    every GEMM outlasts the collective beside it: each input gradient's all-reduce or
    reduce-scatter is hidden whole behind the weight gradient, and each row-parallel
    output's all-reduce half (two pieces: the last piece's waits); the loss's all-reduce
    and the forward all-gather are not beside a GEMM.  On CPU ranks nothing is hidden."""
    from autopar.models import build
    from autopar.cost.prices import GEMM_CHUNKS
    model, example = build("mlp", device="meta", hidden=4096, batch=1024)
    for device in ("h100", "cpu"):
        plan = autopar.plan(model, autopar.Mesh((4,), ("tp",), device=device), example, layout="megatron-tp",
                            compare=False)
        pred = plan.predicted
        reductions = [c for c in plan.collectives if c.kind in ("all_reduce", "reduce_scatter")]
        backward = [c for c in reductions if c.phase == "backward"]
        rows = [c for c in reductions if c.phase == "forward" and c.tensor.startswith("linear")]
        if device == "h100":
            assert len(backward) == 2 and len(rows) == 1, plan.collectives
            want = sum(c.seconds for c in backward) + sum(c.seconds for c in rows) * (GEMM_CHUNKS - 1) / GEMM_CHUNKS
            assert pred.linear_hidden_s == pytest.approx({"tp": want}, rel=1e-12)
            assert "tensor-parallel collectives behind their GEMMs" in str(pred)
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
