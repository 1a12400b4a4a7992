"""Tensors a model makes itself and large outputs, planned as they are held.

- `x.new_empty(size)` (new_zeros, new_ones, new_full) traces as the factory without its
  tensor operand, and a large tensor made that way (multi-head latent attention's keys) or
  any large tensor without a gradient (a router's per-token masks) is planned: each rank
  makes only its piece, instead of the whole on every rank (ops.rules._made_rule,
  solve/problem/menus.PLANNED_WITHOUT_GRAD).
- A large output beside the loss (a causal LM's logits) is returned in the layout the plan
  leaves it, as a DTensor, not gathered whole to every rank (ops.returned_split): priced
  free, and equal to one device's once gathered.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autopar
from autopar.trace.export import trace


class Latent(nn.Module):
    """Keys and queries assembled in slices of a tensor made by new_empty (as DeepSeek-V3's
    attention does), attention, a vocabulary head; returns (loss, logits)."""

    def __init__(self, dim=32, heads=4, nope=8, rope=4, vocab=64):
        super().__init__()
        self.heads, self.nope, self.rope = heads, nope, rope
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.k = nn.Linear(dim, heads * nope, bias=False)
        self.k_rope = nn.Linear(dim, rope, bias=False)
        self.v = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.o = nn.Linear(heads * (nope + rope), dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        b, s = ids.shape
        x = self.embed(ids)
        q = self.q(x).view(b, s, self.heads, -1).transpose(1, 2)
        k_pass = self.k(x).view(b, s, self.heads, self.nope).transpose(1, 2)
        k_rot = self.k_rope(x).view(b, 1, s, self.rope)
        keys = k_rot.new_empty(b, self.heads, s, self.nope + self.rope)
        keys[:, :, :, : self.nope] = k_pass
        keys[:, :, :, self.nope:] = k_rot
        v = self.v(x).view(b, s, self.heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, keys, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class LossOnly(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids, labels)[0]


def tokens(b, s, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)


def test_new_empty_traces_as_a_factory_without_its_tensor_operand():
    torch.manual_seed(0)
    model = Latent()
    ids, labels = tokens(2, 8)
    traced = trace(model, (ids, labels), cache=False)
    graph = traced.graph
    made = [n for n in graph.graph.nodes if n.op == "call_function" and "empty" in str(n.target)]
    assert [str(n.target) for n in made] == ["aten.empty.memory_format"]
    assert not made[0].all_input_nodes and made[0].kwargs["dtype"] == torch.float32
    params = dict(model.named_parameters())
    given = dict(zip(traced.user_inputs, (ids, labels)))
    feed = [params[traced.params[n.target]] if n.target in traced.params else given[n.target]
            for n in graph.graph.nodes if n.op == "placeholder"]
    out = graph(*feed)
    loss, logits = model(ids, labels)
    assert torch.equal(out[0], loss) and torch.equal(out[1], logits)


def _planned(model, b, s, mesh, **kw):
    with torch.device("meta"):
        ids = torch.zeros(b, s, dtype=torch.long)
    return autopar.plan(model, mesh, (ids, ids), solve=autopar.SolveOptions(compare=False), **kw)


def test_large_made_keys_are_planned_split_not_whole_on_every_rank():
    # keys of 64 x 16 x 2048 x 192 float32: 1.5 GiB whole, made by new_empty
    with torch.device("meta"):
        model = Latent(dim=1024, heads=16, nope=128, rope=64, vocab=1024)
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    plan = _planned(model, 64, 2048, mesh)
    empty = next(n for n in plan.nodes if n.op == "aten.empty")
    whole = 64 * 16 * 2048 * 192 * 4
    assert empty.strategy != "replicate" and any(a is not None for a in empty.split)
    assert plan.predicted.memory["working"] < whole / 8


def test_large_logits_beside_the_loss_are_priced_as_left_where_they_lie():
    # logits of 64 x 2048 x 32768 float32 (16 GiB whole): gathered to every rank they would
    # cost more than the step; returned as they lie, the step is the loss-only model's
    with torch.device("meta"):
        model = Latent(dim=512, heads=8, nope=32, rope=32, vocab=32768)
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    both = _planned(model, 64, 2048, mesh)
    alone = _planned(LossOnly(model), 64, 2048, mesh)
    assert both.predicted.step_s == pytest.approx(alone.predicted.step_s, rel=1e-6)
    assert both.predicted.memory_total == pytest.approx(alone.predicted.memory_total, rel=1e-6)


def returned_as_they_lie(steps: int = 3) -> dict:
    """On 2 ranks, thresholds at zero (so small tensors take the large ones' path): the
    keys made split, the logits returned as a DTensor; against one device."""
    import autopar.ops.nodes as nodes
    import autopar.solve.problem.menus as menus
    kept = nodes.RETURNED_SPLIT_BYTES, menus.PLANNED_WITHOUT_GRAD
    nodes.RETURNED_SPLIT_BYTES, menus.PLANNED_WITHOUT_GRAD = 0, 0
    try:   # (the pool's ranks run the other tests' jobs after this one)
        return _returned_as_they_lie(steps)
    finally:
        nodes.RETURNED_SPLIT_BYTES, menus.PLANNED_WITHOUT_GRAD = kept


def _returned_as_they_lie(steps: int) -> dict:
    torch.manual_seed(0)
    model = Latent()
    reference = Latent()
    reference.load_state_dict(model.state_dict())
    ids, labels = tokens(4, 8)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    # (the solver makes tensors this small whole: a random valid plan that splits them)
    plan = next(p for p in autopar.random_plans(model, mesh, (ids, labels), seeds=range(32))
                if next(n for n in p.nodes if n.op == "aten.empty").strategy != "replicate"
                and next(n for n in p.nodes if n.module == "head").strategy != "replicate")
    cm = autopar.compile(model, plan.device_mesh(), (ids, labels), plan=plan)
    empty = next(n for n in plan.nodes if n.op == "aten.empty")
    out = cm(ids, labels)
    loss, logits = reference(ids, labels)
    result = {"empty": empty.strategy, "dtensor": isinstance(out[1], DTensor),
              "placements": str(out[1].placements) if isinstance(out[1], DTensor) else "",
              "logits": float((out[1].full_tensor() - logits).abs().max()) if isinstance(out[1], DTensor) else -1.0,
              "loss": [abs(float(out[0]) - float(loss))]}
    opt = cm.build_optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(steps):
        got = cm.train_step(ids, labels)
        want = reference(ids, labels)[0]
        want.backward()
        result["loss"].append(abs(float(got) - float(want)))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return result


def test_returned_as_they_lie_trains_like_one_device(pool2):
    result = pool2.run(returned_as_they_lie)[0]
    assert result["empty"] != "replicate"
    assert result["dtensor"] and "Shard" in result["placements"]
    assert result["logits"] < 1e-5
    assert max(result["loss"]) < 1e-5, result
