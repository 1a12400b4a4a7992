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
    plan = autopar.plan(model, mesh, example, compare=False, layout="data-parallel")
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
        dp = autopar.plan(model, mesh, example, compare=False, layout="data-parallel")
        loss = _by_tensor(dp, "cross_entropy_loss", "forward")
        whole = sum(st.seconds for st in C.redistribute((), 4, (Partial(),), (Replicate(),), mesh))
        assert loss.nbytes == 4 and loss.seconds < 0.05 * whole   # a bucket's share of one call's fixed cost
        assert not [c for c in dp.collectives if c.tensor == "finite check"]   # every rank sees everyone's sum
        # Megatron TP's weights are split: a NaN in one rank's piece is that rank's alone, so the
        # step runs the finite check's all-reduce (runtime/faults.check_step), and the plan prices it
        tp = autopar.plan(model, mesh, example, compare=False, layout="megatron-tp")
        (check,) = [c for c in tp.collectives if c.tensor == "finite check"]
        assert check.nbytes == 8 and check.phase == "step" and check.seconds == pytest.approx(
            sum(st.seconds for st in C.redistribute((), 8, (Partial(),), (Replicate(),), mesh)))
