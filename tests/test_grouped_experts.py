"""Experts written the torchtitan way (tests/user_models.SortedMoE): rows sorted by expert
with argsort, grouped experts called with each expert's row count, whose `.tolist()` makes
split sizes known only at run time.  The grouped module is traced as autopar's experts op
(each row's expert computed from the counts with fixed shapes), so the model plans with
its expert weights split and trains like one device under the solver's plan, forced
layouts and random plans."""
import warnings

import pytest
import torch

import autopar
from autopar.trace.experts import experts_as_op, grouped_weights, row_experts
from rt_cases import build_case, plan_for, train_and_compare
from user_models import GroupedExperts

SPEC = ("user", "titan-moe")


def test_row_experts_follow_the_counts():
    counts = torch.tensor([2, 0, 3, 1])
    assert row_experts(counts, 8).tolist() == [0, 0, 2, 2, 2, 3, 4, 4]   # rows past the counts: no expert


@pytest.mark.parametrize("transposed", [True, False])
def test_grouped_module_runs_as_the_experts_op(transposed):
    """The op reproduces the module bit for bit in either weight layout (w1 [E, inner,
    hidden] used transposed, or [E, hidden, inner] used as is), square shapes included."""
    torch.manual_seed(0)
    module = GroupedExperts(8, 8 if transposed else 12, 4)
    if not transposed:   # the same experts stored the other way round, and a forward to match
        for name in ("w1", "w2", "w3"):
            setattr(module, name, torch.nn.Parameter(getattr(module, name).detach().transpose(1, 2).contiguous()))

        def forward(rows, counts):
            outs = []
            for e, part in enumerate(torch.split(rows, counts.tolist())):
                h = torch.nn.functional.silu(part @ module.w1[e]) * (part @ module.w3[e])
                outs.append(h @ module.w2[e])
            return torch.cat(outs)
        module.forward = forward
    assert grouped_weights(module) is not None
    rows, counts = torch.randn(9, 8), torch.tensor([4, 0, 2, 3])
    expected = module(rows, counts)
    with experts_as_op(module) as patched:
        got = module(rows, counts)
    assert patched == 1
    assert torch.equal(got, expected)


def test_sorted_moe_plans_with_its_experts_split():
    """On a mesh that makes splitting pay (8 experts of hidden 1,024 and inner 4,096 on 8
    ranks of an H100 mesh, meta tensors), the plan splits every expert weight and nothing
    runs replicated for want of a rule."""
    from user_models import SmallLM, SortedMoE
    with torch.device("meta"):
        model = SmallLM("titan-moe", dim=1024, seq=2048, vocab=4096)
        for block in model.h:
            block.mlp = SortedMoE(1024, hidden=4096, experts=8)
    ids = torch.zeros((8, 2048), dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = autopar.plan(model, autopar.Mesh((2, 4), ("dp", "tp"), device="h100"), (ids, ids),
                            solve=autopar.SolveOptions(compare=False))
    experts = [n for n in plan.nodes if n.op == "autopar.experts"]
    assert len(experts) == 2
    for name, placement in plan.param_placements.items():
        if ".grouped.w" in name:
            assert any(str(p).startswith("S(") for p in placement), (name, placement)


def _random_plans(count: int) -> list:
    model, args, _ = build_case(SPEC)
    mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    return [p.to_dict() for p in autopar.random_plans(model, mesh, args, seeds=range(3, 3 + count))]


@pytest.mark.parametrize("layout", [None, "expert-parallel", "megatron-tp x dp", "random"])
def test_sorted_moe_trains_like_one_device(pool4, layout):
    if layout == "random":
        plans = _random_plans(2)
    else:
        plans = [plan_for(SPEC, layout)]
        want = {"expert-parallel": "tp=expert-parallel", "megatron-tp x dp": "tp=inner"}.get(layout)
        if want:   # the forced layout reaches the experts op
            split = [n.strategy for n in autopar.Plan.from_dict(plans[0]).nodes if n.op == "autopar.experts"]
            assert split and all(want in s for s in split), split
    for plan_dict in plans:
        result = pool4.run(train_and_compare, SPEC, plan_dict)[0]
        assert result["ok"], (layout, result)


def test_bincount_counts_plan_and_train_like_one_device(pool4):
    """The expert counts made with `bincount(ids, minlength=E)` (whose size depends on the
    data as written) have E bins while tracing: the model plans with nothing replicated and
    trains like one device under the solver's plan and expert parallelism."""
    spec = ("user", "titan-moe-bincount")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plans = [plan_for(spec, None), plan_for(spec, "expert-parallel")]
    for plan_dict in plans:
        result = pool4.run(train_and_compare, spec, plan_dict)[0]
        assert result["ok"], result


# --- grouped linear layers: Hugging Face's JetMoE ---------------------------------------------

JETMOE = ("hf-arch", "jetmoe")


def test_jetmoe_plans_with_its_grouped_linears_split():
    """JetMoE at hidden 1,024 on an H100 mesh of 8 (meta tensors): its experts and attention
    experts (grouped linear layers whose split sizes come from .tolist()) trace as the
    grouped linear op, nothing runs replicated for want of a rule, every grouped op splits
    its rows or features, and no expert weight is stored whole on every rank."""
    import transformers as tf
    with torch.device("meta"):
        model = tf.JetMoeForCausalLM(tf.JetMoeConfig(
            vocab_size=4096, hidden_size=1024, num_hidden_layers=2, num_key_value_heads=8, kv_channels=64,
            intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2, use_cache=False))
    ids = torch.zeros((8, 1024), dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plan = autopar.plan(model, autopar.Mesh((2, 4), ("dp", "tp"), device="h100"),
                            example_kwargs={"input_ids": ids, "labels": ids}, solve=autopar.SolveOptions(compare=False))
    grouped = [n for n in plan.nodes if n.op == "autopar.grouped_linear"]
    assert len(grouped) == 8, [n.name for n in grouped]   # per layer: the experts' two, the attention's two
    assert all(n.strategy != "replicate" for n in grouped), [n.strategy for n in grouped]
    stacked = {n.module: n.strategy for n in plan.nodes if n.op == "parameter" and n.module.endswith("_linear.weight")}
    assert len(stacked) == 8, stacked
    for name, strategy in stacked.items():   # split, or its states sharded by ZeRO
        assert "S(" in strategy or "zero" in strategy, (name, strategy)


@pytest.mark.parametrize("layout", [None, "megatron-tp x dp", "random"])
def test_jetmoe_trains_like_one_device(pool4, layout):
    if layout == "random":
        model, _, kwargs = build_case(JETMOE)
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
        plans = [p.to_dict() for p in autopar.random_plans(model, mesh, example_kwargs=kwargs, seeds=range(5, 7))]
    else:
        plans = [plan_for(JETMOE, layout)]
    for plan_dict in plans:
        result = pool4.run(train_and_compare, JETMOE, plan_dict)[0]
        assert result["ok"], (layout, result)
