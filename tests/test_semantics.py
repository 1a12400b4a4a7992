"""The compiled model keeps the module's semantics: frozen parameters stay frozen, train()
and eval() switch dropout and batch norm as on the plain model, random ops draw from
streams that make any plan a valid dropout model (autopar/runtime/regions/rng.py), per-rank seeds change
nothing, and forward works under no_grad and inference_mode."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from rt_cases import plan_for, build_case, train_and_compare
from sem_cases import (batch_norm_train_eval, bn_case, dropnet_case, dropout_masks, eval_then_train, per_rank_seeds,
                       plan_once, train_then_eval_error, unseeded_models)

GPT = ("autopar", "gpt-tiny", ())
GPT_DROPOUT = ("autopar", "gpt-tiny", (("dropout", 0.1),))
FROZEN = {  # which parameters are frozen: first layer, middle, embedding, one of q/k/v
    "first-layer": ("blocks.0.",),
    "middle": ("blocks.0.mlp.fc1.", "blocks.1.ln"),
    "embedding": ("wte.", "wpe."),
    "one-of-qkv": ("blocks.1.attn.k.",),
}
MESH = ((2, 2), ("dp", "tp"))


_plan = plan_for


def _trainable(spec) -> int:
    model, _, _ = build_case(spec)
    return sum(p.requires_grad for p in model.parameters())


LAYOUTS = [None] + sorted(autopar.solve.layouts.layouts(autopar.Mesh(*MESH, device="cpu"), every=True))


@pytest.mark.parametrize("which", sorted(FROZEN))
def test_frozen_parameters_stay_frozen(pool4, which):
    """Under the solver's plan and every hand-written layout (ZeRO-1/2/3, Megatron, their
    products): frozen weights
    bit-identical after 3 AdamW steps, no gradient for them, not in the optimizer; the
    rest equal one device."""
    spec = ("frozen", GPT, FROZEN[which])
    failures = []
    for layout in LAYOUTS:
        r = pool4.run(train_and_compare, spec, _plan(spec, layout))[0]
        if not r["ok"]:
            failures.append(f"{layout}: frozen moved {r['frozen_moved']}, grads of frozen {r['grads_of_frozen']}, "
                            f"loss {r['loss']:.2e} grad {r['grad']} param {r['param']}")
        if layout in (None, "data-parallel", "megatron-tp x dp"):  # plain torch optimizer over the shards
            assert r["optimized"] == _trainable(spec), layout
    assert not failures, "\n".join(failures)


def test_frozen_parameters_in_pipeline_stages(pool4):
    # (frozen and trained layers are not identical: 4 layers leave 3 identical ones to cut between)
    spec = ("frozen", ("autopar", "gpt-tiny", (("n_layers", 4),)), FROZEN["first-layer"] + FROZEN["embedding"])
    plan = _plan(spec, None, (4,), ("pp",), autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    assert plan["pipeline"]["groups"] == 2
    r = pool4.run(train_and_compare, spec, plan)[0]
    assert r["ok"], r
    assert r["frozen_moved"] == 0.0


def test_frozen_parameters_are_priced_as_weights_only():
    model, args, _ = build_case(GPT)
    mesh = autopar.Mesh(4, "dp", device="cpu")
    full = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    spec = ("frozen", GPT, FROZEN["embedding"])
    frozen_model, _, _ = build_case(spec)
    part = autopar.plan(frozen_model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    frozen_bytes = sum(p.numel() * 4 for n, p in frozen_model.named_parameters() if not p.requires_grad)
    assert set(part.frozen) == {"wte.weight", "wpe.weight"}
    assert part.predicted.memory["params"] == full.predicted.memory["params"]
    # no gradient and no Adam moments for the frozen ones (float32: grad 4 B, moments 8 B)
    assert full.predicted.memory["grads"] - part.predicted.memory["grads"] == pytest.approx(frozen_bytes)
    assert full.predicted.memory["optimizer"] - part.predicted.memory["optimizer"] == pytest.approx(2 * frozen_bytes)
    assert not [c for c in part.collectives if c.tensor in part.frozen and c.phase == "backward"]


def test_plan_with_other_frozen_set_is_refused(pool4):
    plan = _plan(GPT, "data-parallel")  # made with everything trained
    spec = ("frozen", GPT, FROZEN["one-of-qkv"])
    with pytest.raises(Exception, match="frozen now but trained when planned"):
        pool4.run(train_and_compare, spec, plan)


@pytest.mark.parametrize("layout", ["data-parallel", "megatron-tp x dp", "replicated"])
def test_dropout_streams(pool4, layout):
    """DropNet (x rows identical, p = 0.5) under a plan: about half the units dropped, kept
    ones scaled by 1/(1-p) exactly; every rank sees the same output (replicated tensors get
    the same mask); where the output is split, the pieces have different masks; a new call
    draws new masks; eval is the plain model."""
    model, x = dropnet_case()
    mesh = autopar.Mesh(*MESH, device="cpu")
    plan = autopar.plan(model, mesh, (x,),
                        solve=autopar.SolveOptions(compare=False, layout=None if layout == "replicated" else layout))
    if layout == "replicated":  # the solver keeps this small model whole on every rank
        assert all(p == Replicate() for p in plan.node("dropout").outputs[0])
    results = pool4.run(dropout_masks, plan.to_dict())
    r = results[0]
    assert abs(r["zero_fraction"] - 0.5) < 0.03
    assert r["kept_scaled_exactly"] < 1e-5
    assert r["calls_differ"]
    assert r["eval_equals_plain"] < 1e-5
    assert all(d == r["digests"][0] for d in r["digests"]), "ranks disagree on the output"
    masks = r["masks"]
    if layout == "data-parallel":  # batch split over dp (and tp): each quarter of the rows its own mask
        quarters = masks.reshape(4, 16, -1)
        assert all(not torch.equal(quarters[0], quarters[i]) for i in range(1, 4))
    if layout == "megatron-tp x dp":  # hidden split over tp: column halves differ
        assert not torch.equal(masks[:, :128], masks[:, 128:])


def test_same_seed_same_run(pool4):
    model, x = dropnet_case()
    plan = autopar.plan(model, autopar.Mesh(*MESH, device="cpu"), (x,),
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    a = pool4.run(dropout_masks, plan.to_dict(), 7)[0]
    b = pool4.run(dropout_masks, plan.to_dict(), 7)[0]
    c = pool4.run(dropout_masks, plan.to_dict(), 8)[0]
    assert a["digests"] == b["digests"]  # bit-identical runs
    assert a["digests"] != c["digests"]


@pytest.mark.parametrize("layout", [None, "megatron-tp x dp"])
def test_per_rank_seeds_keep_replicas_identical(pool4, layout):
    """torch.manual_seed(base + rank) after building the model, dropout 0.1, 3 AdamW steps:
    ranks that hold the same shard of a parameter hold the same values, and every rank
    reports the same loss."""
    _assert_replicas_identical(pool4.run(per_rank_seeds, GPT_DROPOUT, _plan(GPT_DROPOUT, layout))[0],
                               _plan(GPT_DROPOUT, layout))


def _assert_replicas_identical(r: dict, plan_dict: dict) -> None:
    """A per_rank_seeds result: every rank saw the same losses, and ranks holding the same
    piece of a parameter (same coordinates on the axes it is split over) hold the same values."""
    assert all(l == r["losses"][0] for l in r["losses"])
    for name, placements in autopar.Plan.from_dict(plan_dict).param_placements.items():
        by_piece: dict = {}
        for coord, shards in zip(r["coord"], r["shards"]):
            piece = tuple(c for c, p in zip(coord, placements) if hasattr(p, "dim"))
            by_piece.setdefault(piece, set()).add(shards[name])
        assert all(len(d) == 1 for d in by_piece.values()), f"{name} diverged across replicas: {by_piece}"


def test_unseeded_models_start_from_rank0(pool4):
    r = pool4.run(unseeded_models, GPT, _plan(GPT, "megatron-tp x dp"))[0]
    assert r["max_diff_from_rank0"] == 0.0


@pytest.mark.parametrize("layout", ["data-parallel", "megatron-tp x dp"])
def test_eval_then_train_in_one_process(pool4, layout):
    r = pool4.run(eval_then_train, GPT_DROPOUT, layout, MESH[0])[0]
    assert r["eval_mode_of_first"] is False
    for value in r["eval"] + [r["train_then_eval"], r["no_grad"], r["inference_mode"]]:
        assert value == pytest.approx(r["plain_eval"], rel=1e-5, abs=1e-6)
    assert all(abs(t - r["plain_eval"]) > 1e-4 for t in r["train"]), "dropout is off in train mode"
    assert r["train"][0] != r["train"][1]


@pytest.mark.parametrize("layout", ["data-parallel", "megatron-tp x dp"])
def test_reentrant_checkpointing_in_the_model_trains(pool4, layout):
    """Blocks under torch.utils.checkpoint(use_reentrant=True): traced as plain code, the
    compiled model trains like the plain one (which recomputes) on one device."""
    spec = ("checkpointed", GPT)
    r = pool4.run(train_and_compare, spec, _plan(spec, layout))[0]
    assert r["ok"], r


@pytest.mark.parametrize("layout", [None, "data-parallel", "megatron-tp x dp"])
def test_batch_norm_statistics_in_train_and_eval(pool4, layout):
    """BatchNorm trained 2 steps, then eval: losses in both modes, running mean and the
    batch counter equal the plain model's (the counter does not move in eval)."""
    model, x = bn_case()
    plan = autopar.plan(model, autopar.Mesh(*MESH, device="cpu"), (x,),
                        solve=autopar.SolveOptions(compare=False, layout=layout))
    r = pool4.run(batch_norm_train_eval, plan.to_dict())[0]
    assert r["train"] == pytest.approx(r["plain_train"], rel=1e-5)
    assert r["eval"] == pytest.approx(r["plain_eval"], rel=1e-5)
    assert r["running_mean"] < 1e-6
    assert r["batches_tracked"] == (2, 2)


def test_rank0_plans_once_per_job(pool4):
    results = pool4.run(plan_once, GPT)
    assert [r["planned"] for r in results] == [1, 0, 0, 0]
    assert len(set(results[0]["hashes"])) == 1
    assert all(r["loss"] == results[0]["loss"] for r in results)


@pytest.mark.parametrize("family", ["gpt2", "bert", "qwen2"])
def test_hugging_face_dropout_train_eval_and_per_rank_seeds(pool4, family):
    """Hugging Face models with dropout 0.1 (hidden, attention, embeddings) under Megatron x DP:
    eval equals the plain model, train draws masks, and per-rank seeds leave every replica
    identical after 3 steps."""
    spec = ("hf-dropout", family)
    r = pool4.run(eval_then_train, spec, "megatron-tp x dp", MESH[0])[0]
    for value in r["eval"] + [r["train_then_eval"], r["no_grad"], r["inference_mode"]]:
        assert value == pytest.approx(r["plain_eval"], rel=1e-5, abs=1e-6)
    assert r["train"][0] != r["train"][1]
    plan = _plan(spec, "megatron-tp x dp")
    _assert_replicas_identical(pool4.run(per_rank_seeds, spec, plan)[0], plan)


class _TrainOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            y = y + 1.0
        return y.sum()


def test_eval_graph_with_other_ops_is_named():
    from autopar.passes.modes import ModeError, mode_switch
    from autopar.trace.export import trace
    model, x = _TrainOnly(), torch.randn(2, 4)
    train, evaluated = trace(model, (x,)), trace(model, (x,), mode="eval")
    switch = mode_switch(train.graph, evaluated.graph, train.buffers)
    assert "module 'fc'" in switch.reason or "add" in switch.reason
    with pytest.raises(ModeError, match="cannot run the compiled model in eval mode"):
        switch.apply(train.graph, training=False)
    switch.apply(train.graph, training=True)  # the training graph is always available


def test_mode_switch_records_flags_and_buffer_updates():
    from autopar.passes.modes import mode_switch
    from autopar.trace.export import trace
    model, x = bn_case()
    model.drop = torch.nn.Dropout(0.2)
    model.forward = lambda x: model.fc2(model.drop(torch.relu(model.bn(model.fc1(x))))).sum()
    train, evaluated = trace(model, (x,), cache=False), trace(model, (x,), cache=False, mode="eval")
    switch = mode_switch(train.graph, evaluated.graph, train.buffers)
    assert switch.reason == ""
    flags = sorted((w, t, e) for sw in switch.switches.values() for w, t, e in sw.args)
    assert flags == [("train", True, False), ("training", True, False)]
    assert sum(sw.skip for sw in switch.switches.values()) == 1   # num_batches_tracked += 1
    assert model.training  # tracing in eval mode gave every module its flag back


class _EvalUntraceable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if not self.training and y.sum() > 0:  # data-dependent control flow: export cannot trace it
            y = y + 1.0
        return y.sum()


def test_model_untraceable_in_eval_still_trains(pool2):
    r = pool2.run(train_then_eval_error, _EvalUntraceable.__module__)[0]
    assert r["steps"] == 2
    assert "could not be traced in eval mode" in r["eval_error"]
