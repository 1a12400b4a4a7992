"""Strategies from annotations: placements, gradient placements, divisibility, fallbacks."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.ops.annotation import parse, view, view_groups
from autopar.ops.strategy import enumerate_strategies

R, P = Replicate(), Partial()


def by_name(strategies):
    return {s.name: s for s in strategies}


def test_linear_gives_megatron_and_data_parallel_rules():
    """x [8, 16, 32] @ W[64, 32]^T + b[64] on one axis of 4."""
    ins, outs = ((8, 16, 32), (64, 32), (64,)), ((8, 16, 64),)
    ann = parse("* row+, col row+, col -> * col", ins, outs, partial_inputs={2})
    s = by_name(enumerate_strategies(ann, ins, outs, (4,), ("tp",), [True, True, True]))
    col, row, batch = s["tp=col"], s["tp=row"], s["tp=b0"]
    # column: x whole (its gradient sums over ranks: Megatron's f), W and b split by rows
    assert col.inputs == ((R,), (Shard(0),), (Shard(0),)) and col.outputs == ((Shard(2),),)
    assert col.grads == ((P,), (Shard(0),), (Shard(0),))
    # row: contracted dim split, Partial output; the bias enters Partial
    assert row.inputs == ((Shard(2),), (Shard(1),), (P,)) and row.outputs == ((P,),)
    assert row.grads == ((Shard(2),), (Shard(1),), (R,))
    # batch: weights whole, their gradients Partial (the data-parallel all-reduce)
    assert batch.grads == ((Shard(0),), (P,), (P,))
    assert col.factor == row.factor == batch.factor == 4


def test_uneven_dims_never_split():
    """hidden 100 does not divide by 8: no strategy shards it."""
    ins, outs = ((6, 100), (100, 100)), ((6, 100),)
    ann = parse("* row+, col row+ -> * col", ins, outs)
    names = {s.name for s in enumerate_strategies(ann, ins, outs, (8,), ("tp",), [True, True])}
    assert names == {"replicate"}
    names = {s.name for s in enumerate_strategies(ann, ins, outs, (2,), ("tp",), [True, True])}
    assert names == {"replicate", "tp=b0", "tp=row", "tp=col"}


def test_two_axes_may_split_one_dim_in_order():
    ins, outs = ((16, 8),), ((16, 8),)
    ann = parse("a b -> a b", ins, outs)
    s = by_name(enumerate_strategies(ann, ins, outs, (2, 4), ("dp", "tp"), [True]))
    assert s["dp=a tp=a"].outputs == ((Shard(0), Shard(0)),) and s["dp=a tp=a"].factor == 8


def test_view_groups_and_head_split():
    assert view_groups((2, 8, 64), (2, 8, 4, 16)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    ann = view((2, 8, 64), (2, 8, 4, 16))
    s = by_name(enumerate_strategies(ann, ((2, 8, 64),), ((2, 8, 4, 16),), (4,), ("tp",), [True]))
    assert s["tp=v2"].inputs == ((Shard(2),),) and s["tp=v2"].outputs == ((Shard(2),),)
    # 4 heads split 8 ways would be uneven: excluded
    s8 = by_name(enumerate_strategies(ann, ((2, 8, 64),), ((2, 8, 4, 16),), (8,), ("tp",), [True]))
    assert "tp=v2" not in s8 and "tp=v1" in s8


class Weird(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return torch.fft.fft(y).real.sum() + torch.fft.fft(y * 2).real.sum()


def test_op_without_rule_runs_replicated_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.plan(Weird(), autopar.Mesh(2, "dp", device="cpu"), (torch.randn(8, 16),),
                            solve=autopar.SolveOptions(compare=False))
    msgs = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(plan.fallback_ops) >= 1
    assert len(msgs) == len(plan.fallback_ops)  # one warning per op, not per node
    op = plan.fallback_ops[0]
    assert op in msgs[0] and "replicated" in msgs[0]
    for n in plan.nodes:
        if n.op in plan.fallback_ops:
            assert n.strategy == "replicate"
            assert all(p == R for ps in n.inputs for p in ps)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        if self.inner(x).sum() > 0:   # data-dependent control flow: not traceable
            return x.sum()
        return x.mean()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Branchy()

    def forward(self, x):
        return self.block(x)


def test_trace_failure_names_the_module():
    with pytest.raises(autopar.TraceError) as err:
        autopar.plan(Outer(), autopar.Mesh(2, "dp"), (torch.randn(2, 4),))
    assert "'block'" in str(err.value) and "data-dependent" in str(err.value)


def test_user_graph_module_is_accepted():
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(64, 256)
            self.b = nn.Linear(256, 64)

        def forward(self, x):
            return F.relu(self.b(F.relu(self.a(x)))).pow(2).mean()

    gm = torch.fx.symbolic_trace(Small())
    plan = autopar.plan(gm, autopar.Mesh(4, "dp", device="cpu"), (torch.randn(4096, 64),),
                        solve=autopar.SolveOptions(compare=False))
    assert set(plan.param_placements) == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert any(n.op == "aten.linear" for n in plan.nodes)


def _menu(model_name, mesh, op, **overrides):
    from autopar.models import build
    from autopar.solve.problem.problem import Problem
    from autopar.trace.export import trace
    model, example = build(model_name, device="meta", **overrides)
    problem = Problem.build(trace(model, example), mesh)
    return problem, [pn for pn in problem.nodes if pn.op == op and pn.rep == pn.index]


def test_attention_splits_heads_with_grouped_query_attention():
    """llama-tiny: 4 query heads, 2 key/value heads.  tp=2 divides both; tp=4 does not
    divide the key/value heads, so heads never split 4 ways."""
    _, [sdpa, *_] = _menu("llama-tiny", autopar.Mesh(2, "tp"), "aten.scaled_dot_product_attention")
    heads = [s for s in sdpa.strategies if s.name == "tp=heads"]
    assert len(heads) == 1 and all(p == (Shard(1),) for p in heads[0].inputs)
    _, [sdpa4, *_] = _menu("llama-tiny", autopar.Mesh(4, "tp"), "aten.scaled_dot_product_attention")
    assert "tp=heads" not in {s.name for s in sdpa4.strategies}


def test_vocabulary_parallel_embedding_and_cross_entropy():
    mesh = autopar.Mesh(4, "tp")
    _, [emb, *_] = _menu("gpt-tiny", mesh, "aten.embedding")
    vocab = [s for s in emb.strategies if s.name == "tp=vocab"][0]
    # table split by rows, token ids whole, output a Partial sum (zeros for others' tokens)
    assert vocab.inputs == ((Shard(0),), (R,)) and vocab.outputs == ((P,),)
    problem, [ce] = _menu("gpt-tiny", mesh, "aten.cross_entropy_loss")
    named = [s for s in ce.strategies if "vocab-parallel" in s.name]
    assert len(named) == 1 and named[0].inputs[0] == (Shard(1),) and named[0].inputs[1] == (R,)
    # its internal all-reduces (row max, sum of exp, target logit) are costed
    i = ce.strategies.index(named[0])
    assert problem.choices[ce.index][i].comm[0] > 0


def test_reference_models_have_a_rule_for_every_op():
    from autopar.models import build
    for name in ("mlp", "gpt-tiny", "llama-tiny", "bert-tiny"):
        model, example = build(name, device="meta")
        plan = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp")), example,
                            solve=autopar.SolveOptions(compare=False))
        assert plan.fallback_ops == (), (name, plan.fallback_ops)


def test_compute_cost_is_a_roofline_over_the_local_shard():
    """A 4096 x 4096 linear on 4096 rows is compute-bound on an H100: forward 2*b*h*h FLOPs,
    backward twice that (input and weight gradients; the first layer computes only the
    weight's), divided by the ways the strategy splits the work, at the GEMM rate times
    the efficiency of the local shape (autopar.cost.kernels): large GEMMs like these, whole
    or split four ways, run within 12 % of the rate, never above it."""
    mesh = autopar.Mesh(4, "tp", device="h100")
    problem, linears = _menu("mlp", mesh, "aten.linear", hidden=4096, batch=4096)
    first, second = linears[0], linears[1]
    peak = mesh.device.peak_flops(torch.float32)
    for pn, flops in ((first, 2 * 2 * 4096**3), (second, 3 * 2 * 4096**3)):
        for s, c in zip(pn.strategies, problem.choices[pn.index]):
            ideal = flops / s.factor / peak
            assert ideal <= c.compute <= 1.12 * ideal, (s.name, c.compute / ideal)


class _Router(nn.Module):
    """A top-k router: softmax, top-k, renormalised in place (x.div_), as MoE models write it."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 8)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        top, idx = torch.topk(probs, 2, dim=-1)
        return top.div_(top.sum(dim=-1, keepdim=True)), idx


def test_topk_and_in_place_ops_have_rules():
    """topk splits every dim but its own; an in-place elementwise op is planned as its
    out-of-place form when nothing reads the written tensor afterwards, and has no rule
    (runs replicated, with the warning) when something does."""
    from autopar.ops import annotate
    from autopar.trace.export import trace
    torch.manual_seed(0)
    gm = trace(_Router(), (torch.randn(32, 16),)).graph
    ops = {str(n.target): n for n in gm.graph.nodes if n.op == "call_function"}
    topk, div_ = ops["aten.topk.default"], ops["aten.div_.Tensor"]
    shapes = [tuple(a.meta["val"].shape) for a in (topk.args[0],)]
    outs = [tuple(v.shape) for v in topk.meta["val"]]
    menu = by_name(enumerate_strategies(annotate(topk, shapes, outs), shapes, outs, (4,), ("dp",), [True]))
    assert set(menu) == {"replicate", "dp=d0"}  # rows split; the top-k dim never does
    assert menu["dp=d0"].outputs == ((Shard(0),), (Shard(0),))
    ins = [tuple(a.meta["val"].shape) for a in div_.args]
    assert annotate(div_, ins, [tuple(div_.meta["val"].shape)]) is not None
    # the same op with a later reader of the tensor it wrote: no rule
    with gm.graph.inserting_after(div_):
        later = gm.graph.call_function(torch.ops.aten.add.Tensor, (div_.args[0], 1))
    later.meta["val"] = div_.meta["val"]
    assert annotate(div_, ins, [tuple(div_.meta["val"].shape)]) is None


class _TensorSplit(torch.nn.Module):
    """Mamba's scan input split at a sequence index (transformers 5.25): torch.tensor_split."""

    def forward(self, x):
        head, tail = torch.tensor_split(x, [6], dim=2)
        return head.sum() + 2 * tail.sum()


def test_tensor_split_splits_every_dim_but_its_own():
    """x [4, 8, 10] split at sequence index 6 along dim 2: batch and channels may split on the
    axis (both parts keep their placement), the split dim never does."""
    from autopar.ops import annotate
    from autopar.trace.export import trace
    gm = trace(_TensorSplit(), (torch.randn(4, 8, 10),)).graph
    node = next(n for n in gm.graph.nodes if str(n.target).startswith("aten.tensor_split"))
    ins, outs = [(4, 8, 10)], [tuple(v.shape) for v in node.meta["val"]]
    assert outs == [(4, 8, 6), (4, 8, 4)]
    menu = by_name(enumerate_strategies(annotate(node, ins, outs), ins, outs, (4,), ("tp",), [True]))
    assert set(menu) == {"replicate", "tp=d0", "tp=d1", "tp=+"}   # (+: a Partial input stays Partial: it is linear)
    assert menu["tp=d1"].inputs == ((Shard(1),),) and menu["tp=d1"].outputs == ((Shard(1),), (Shard(1),))
