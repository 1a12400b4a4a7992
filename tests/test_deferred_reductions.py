"""Reductions the runtime runs inside a gradient bucket are priced there
(docs/COST_MODEL.md, "Gradients that wait for the buckets"): the position embedding's
gradient, which stays Partial back to its weight (passes/collectives._deferrable_cones),
and the Partial loss, summed as one more element of the last bucket; and the finite
check's all-reduce, which a step runs where the ranks' losses are not one sum."""
import pytest
from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.cost import prices as C
from autopar.models import build


@pytest.fixture(scope="module")
def gpt():
    return build("gpt-tiny", device="meta", batch=8, seq=64)


def _by_tensor(plan, tensor, phase):
    (found,) = [c for c in plan.collectives if c.tensor == tensor and c.phase == phase]
    return found


@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_the_position_embeddings_gradient_joins_the_buckets(gpt, device):
    model, example = gpt
    mesh = autopar.Mesh((2,), ("dp",), device=device)
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    c = _by_tensor(plan, "embedding_1", "backward")   # wpe(positions), added to batch-split tokens
    shape = (64, int(c.nbytes) // (64 * 4))   # (seq, hidden), float32
    steps = C.redistribute(shape, 4, (Partial(),), (Replicate(),), mesh)
    blocking = sum(st.seconds for st in steps)
    bucketed = sum(st.seconds for st in C.bucketed(steps, c.nbytes, ("all_reduce",)))
    assert c.kind == "all_reduce" and [st.kind for st in steps] == ["all_reduce"]
    assert c.seconds == pytest.approx(bucketed) and c.seconds < blocking

def test_the_loss_is_summed_in_the_last_bucket_and_split_weights_pay_the_finite_check(gpt):
    model, example = gpt
    for device in ("cpu", "h100"):
        mesh = autopar.Mesh((2,), ("dp",), device=device)
        dp = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
        loss = _by_tensor(dp, "cross_entropy_loss", "forward")
        whole = sum(st.seconds for st in C.redistribute((), 4, (Partial(),), (Replicate(),), mesh))
        assert loss.nbytes == 4 and loss.seconds < 0.05 * whole   # a bucket's share of one call's fixed cost
        assert not [c for c in dp.collectives if c.tensor == "finite check"]   # every rank sees everyone's sum
        # Megatron TP's weights are split: a NaN in one rank's piece is that rank's alone, so the
        # step runs the finite check's all-reduce (runtime/checks/faults.check_step), and the plan prices it
        tp = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="megatron-tp"))
        (check,) = [c for c in tp.collectives if c.tensor == "finite check"]
        assert check.nbytes == 8 and check.phase == "step" and check.seconds == pytest.approx(
            sum(st.seconds for st in C.redistribute((), 8, (Partial(),), (Replicate(),), mesh)))


def split_bias_moves(spec, plan_dict) -> dict:
    """(rank job) The compiled graph's moves of parameters (placeholder name -> (gradient
    source, gradient destination) layouts), the parameters the buckets all-reduce, and
    the worst differences of 3 AdamW steps against one device."""
    from rt_cases import build_case, train_and_compare
    plan = autopar.Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, plan=plan)
    moves = {}
    for n in cm.graph_module.graph.nodes:
        if n.name.startswith("move") and n.args[0].op == "placeholder":
            m = getattr(cm.graph_module, str(n.args[1]))
            moves[str(n.args[0].target)] = (tuple(map(str, m.grad_src)), tuple(map(str, m.grad_dst)))
    return {"moves": moves, "synced": sorted(map(str, cm.grad_sync.params)),
            "trained": train_and_compare(spec, plan_dict, 3)}


def test_a_split_bias_leaves_its_data_parallel_sum_to_the_buckets(pool4):
    """Megatron TP x DP stores a row-parallel linear's bias split over tp; its gradient
    arrives whole on tp and Partial on dp.  The move in backward takes this rank's slice
    and leaves it Partial on dp for the bucketed all-reduce, as the cost model prices it
    (it used to all-reduce each such bias inside backward: 4 blocking calls per step of
    this 2-layer GPT); training equals one device."""
    from rt_cases import plan_for
    spec = ("autopar", "gpt-tiny", ())
    plan_dict = plan_for(spec, "megatron-tp x dp")
    plan = autopar.Plan.from_dict(plan_dict)
    split = [n for n, lay in plan.param_placements.items() if n.endswith((".o.bias", ".fc2.bias"))]
    assert len(split) == 4 and all(str(plan.param_placements[n][1]).startswith("S") for n in split)
    # the plan lists their gradients' all-reduce over dp as bucketed, nothing over tp
    for name in split:
        (c,) = [c for c in plan.collectives if c.tensor == name]
        assert (c.kind, c.axes, c.phase) == ("all_reduce", ("dp",), "backward")
    for r in pool4.run(split_bias_moves, spec, plan_dict):
        assert r["trained"]["ok"], r["trained"]
        biases = {ph: m for ph, m in r["moves"].items() if ph.endswith(("o_bias", "fc2_bias"))}
        assert len(biases) == len(split), r["moves"]
        for ph, (src, dst) in biases.items():
            assert src == ("P(sum)", "R") and dst == ("P(sum)", "S(0)"), (ph, src, dst)
        assert all(any(name.replace(".", "_") in ph for ph in biases) for name in split)
        assert len(r["synced"]) == len(plan.param_placements), r["synced"]


def test_a_bucketed_gradient_pays_its_copies_in_and_out_of_the_flat_buffer(gpt):
    """Data parallelism: each weight's gradient is copied into its bucket's flat buffer and
    back (a read and a write each way: 4 bytes per byte) and read once more by the finite
    check, at the device's memory bandwidth, with one op's latency for the copy back; the
    parameter's compute is its AdamW step plus these (docs/COST_MODEL.md, "The flat
    buffers' copies"), and the plan's compute is the sum of its nodes'."""
    model, example = gpt
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    dev, checked = mesh.device, 0
    for n in plan.nodes:
        if n.op != "parameter":
            continue
        elements = n.memory / 16   # float32 weights, gradients and Adam's two moments
        step = C.optimizer_seconds(elements, 4, False, mesh)
        copies = (4 * 4 * elements + 4 * elements) / dev.mem_bandwidth + dev.op_latency
        assert n.compute_s == pytest.approx(step + copies, rel=1e-9), n.name
        checked += 1
    assert checked >= 10
    assert plan.predicted.compute_s == pytest.approx(sum(n.compute_s for n in plan.nodes), rel=1e-9)
