"""Experts with a capacity (Switch Transformers): a top-1 router caps every expert at
`expert_capacity` rows per sequence and drops the rest, and the experts are a container of
ungated MLPs dispatched by a one-hot mask.  The container is traced as autopar's experts op
(ungated, the children's weights stacked, a dropped slot routed to no expert); a split op
is priced no longer than the capacity allows; and the model trains like one device under
the solver's plan, expert parallelism (dropped slots stay on their rank), Megatron inside
the experts and a random plan."""
import pytest
import torch

import autopar
from torch.distributed.tensor import Shard
from autopar.solve.built import build_problem
from autopar.trace.experts import experts_as_op, mask_experts_weights, measure_routing
from rt_cases import build_case, plan_for, train_and_compare

SPEC = ("hf-switch",)


def _containers(model):
    return [m for _, m in model.named_modules() if mask_experts_weights(m) is not None]


def test_container_runs_as_the_experts_op_with_drops(caplog):
    """The op reproduces the container bit for bit on rows the router routed, capped and
    dropped: the example batch drops some tokens at capacity 5 of 16 per sequence."""
    model, args, _ = build_case(SPEC)
    containers = _containers(model)
    assert len(containers) == 2   # one sparse layer in the encoder, one in the decoder
    seen = {}

    def keep(module, inputs, output):
        seen.setdefault(id(module), []).append((inputs, output))
    hooks = [c.register_forward_hook(keep) for c in containers]
    with torch.no_grad():
        expected = model(*args)
        with experts_as_op(model) as patched:
            got = model(*args)
    for h in hooks:
        h.remove()
    assert patched == 2
    assert torch.equal(got, expected)
    assert [r for r in caplog.records if "gets a zero gradient" in r.getMessage()]
    for calls in seen.values():
        (x, mask, _), plain = calls[0]
        _, taken = calls[-1]   # (between them, the probe's call on random weights)
        assert torch.equal(taken, plain)
        assert int((mask.sum(-1) == 0).sum()) > 0   # some slots dropped at capacity


def test_split_experts_are_priced_no_longer_than_the_capacity():
    """Capacity 5 rows per expert per sequence of 16 over 4 experts caps any expert at
    1.25x the mean: a stated imbalance of 3 is priced at 1.25, a lower one as stated, and
    the plan's notes say so."""
    model, args, _ = build_case(SPEC)
    mesh = autopar.Mesh((4,), ("ep",), device="h100")
    for stated, priced in ((3.0, 1.25), (1.1, 1.1)):
        plan = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="expert-parallel"),
                            pricing=autopar.Pricing(moe_imbalance=stated))
        assert {n.strategy for n in plan.nodes if n.op == "autopar.experts"} == {"ep=expert-parallel"}
        note = [n for n in plan.notes if "busiest rank" in n]
        assert note and f"{priced:.3f}x the mean rows" in note[0], plan.notes
        assert "caps each expert at 1.250x" in note[0], note
    problem = build_problem(model, mesh, args, {}).problem
    ops = [pn for pn in problem.nodes if pn.kind == "op" and pn.op == "autopar.experts"]
    assert ops and all(problem.node_prices.routing_factor(pn, s) <= 1.25 for pn in ops for s in problem.nodes[pn.rep].strategies)


def test_measured_routing_counts_only_kept_rows():
    """Measured routing counts the rows the router kept (dropped slots count for no rank)."""
    model, args, _ = build_case(SPEC)
    factors = measure_routing(model, args)
    assert set(factors) == {2, 4}
    assert all(1.0 <= f <= 1.25 + 1e-9 for f in factors.values()), factors


@pytest.mark.parametrize("layout", ["expert-parallel", "megatron-tp x dp", None, "random"])
def test_switch_trains_like_one_device(pool4, layout):
    """3 AdamW steps on 4 gloo ranks equal one device (the case's init reaches every expert
    in every step: an expert no token reaches keeps a None gradient in the plain model and
    gets zeros from the op, which the trace warns about)."""
    if layout == "random":
        model, args, _ = build_case(SPEC)
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
        plans = [p.to_dict() for p in autopar.random_plans(model, mesh, args, seeds=range(7, 8))]
    else:
        plans = [plan_for(SPEC, layout)]
        want = {"expert-parallel": "tp=expert-parallel", "megatron-tp x dp": "tp=inner"}.get(layout)
        if want:
            split = [n.strategy for n in autopar.Plan.from_dict(plans[0]).nodes if n.op == "autopar.experts"]
            assert split and all(want in s for s in split), split
    for plan_dict in plans:
        assert not autopar.Plan.from_dict(plan_dict).fallback_ops
        result = pool4.run(train_and_compare, SPEC, plan_dict)[0]
        assert result["ok"], (layout, result)


# --- capacity written out with fixed shapes (GShard-style dispatch einsums) -----------------------

GSHARD = ("user", "capacity-moe")


def test_fixed_capacity_dispatch_plans_by_its_shapes(caplog):
    """A GShard-style MoE (tests/user_models.CapacityMoE: a [batch, seq, experts, capacity]
    dispatch tensor, experts as einsums over their queues) is traced as written and priced by
    its shapes (experts x capacity rows, dropped tokens included).  At hidden 1,024 on an
    H100 mesh of 8 (meta tensors) the solver splits the expert weights by expert with
    nothing replicated; forcing expert-parallel, which needs an experts op, says it trains
    as data parallelism."""
    from user_models import CapacityMoE, SmallLM
    with torch.device("meta"):
        model = SmallLM("capacity-moe", dim=1024, seq=2048, vocab=4096)
        for block in model.h:
            block.mlp = CapacityMoE(1024, hidden=4096, experts=8, seq=2048)
    ids = torch.zeros((8, 2048), dtype=torch.long, device="meta")
    plan = autopar.plan(model, autopar.Mesh((2, 4), ("dp", "tp"), device="h100"), (ids, ids),
                        solve=autopar.SolveOptions(compare=False))
    assert plan.fallback_ops == ()
    for name in ("h.0.mlp.wi", "h.0.mlp.wo", "h.1.mlp.wi", "h.1.mlp.wo"):
        assert Shard(0) in plan.param_placements[name], (name, plan.param_placements[name])
    small, args, _ = build_case(GSHARD)
    autopar.plan(small, autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"), args,
                 solve=autopar.SolveOptions(compare=False, layout="expert-parallel"))
    assert [r for r in caplog.records if "trains as data parallelism" in r.getMessage()]


@pytest.mark.parametrize("layout", ["megatron-tp x dp", "random"])
def test_fixed_capacity_dispatch_trains_like_one_device(pool4, layout):
    """3 AdamW steps on 4 gloo ranks equal one device, with tokens dropped at capacity."""
    model, args, _ = build_case(GSHARD)
    for block in model.h:
        block.mlp.record = True
    with torch.no_grad():
        model(*args)
    for block in model.h:
        block.mlp.record = False
    assert any(int(block.mlp.kept.sum()) < args[0].numel() for block in model.h)
    if layout == "random":
        mesh = autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
        plans = [p.to_dict() for p in autopar.random_plans(model, mesh, args, seeds=range(11, 13))]
    else:
        plans = [plan_for(GSHARD, layout)]
        placed = autopar.Plan.from_dict(plans[0]).param_placements
        assert placed["h.0.mlp.wi"][1] == Shard(0), placed["h.0.mlp.wi"]   # experts split over tp
    for plan_dict in plans:
        result = pool4.run(train_and_compare, GSHARD, plan_dict)[0]
        assert result["ok"], (layout, result)
