"""compile(backend="inductor"): the rank's compute between collectives compiled by
Inductor (autopar/runtime/regions/inductor.py).  Every parallel form trains like one device on 4
gloo ranks (fused kernels reorder float operations: compared within rt_cases' 1e-5
relative tolerance, as every other form); a region Inductor cannot compile runs eagerly
with one warning; train() and eval() switch the compiled graph like the eager one."""
import warnings

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.runtime.regions.inductor import CompiledRegion, compile_regions
from autopar.report.records import check_backend
from rt_cases import eval_train_eval, plan_for, train_and_compare

GPT = ("autopar", "gpt-tiny", ())
LLAMA = ("autopar", "llama-tiny", ())
CASES = [(GPT, "data-parallel", (4,), ("dp",)), (GPT, "zero3", (4,), ("dp",)),
         (GPT, "megatron-tp x dp", (2, 2), ("dp", "tp")), (GPT, "megatron-sp", (4,), ("tp",)),
         (LLAMA, "ulysses x dp", (2, 2), ("dp", "tp")), (LLAMA, "context-parallel x dp", (2, 2), ("dp", "tp")),
         (LLAMA, None, (2, 2), ("dp", "tp")), (("hf-arch", "mixtral"), "expert-parallel", (2, 2), ("dp", "tp")),
         (("hf-arch", "qwen2"), "megatron-tp x dp", (2, 2), ("dp", "tp")),
         (GPT, "tp-2d", (2, 2), ("a", "b")), (LLAMA, "tp-2d-ws", (2, 2), ("a", "b"))]


@pytest.mark.parametrize("spec, layout, shape, names", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_inductor_trains_like_one_device(pool4, spec, layout, shape, names):
    plan_dict = plan_for(spec, layout, shape=shape, names=names)
    result = pool4.run(train_and_compare, spec, plan_dict, 3, None, "adamw", "inductor")[0]
    assert result["ok"], result
    assert result["regions"] > 0 and result["failed"] == 0, result
    if layout == "data-parallel":   # (GPT's dropouts of probability 0 draw nothing: no cut at them)
        assert result["regions"] == 1, result
    if layout in ("megatron-tp x dp", "megatron-sp", "ulysses x dp"):   # activation moves inside the regions
        assert result["compiled_moves"] > 0, result


@pytest.mark.parametrize("bucket_mb", [25.0, 0.02])
def test_inductor_zero3_gathers_each_layer_at_its_start(pool4, bucket_mb):
    """ZeRO-3 under Inductor: a layer's weight gathers run at the layer's start
    (runtime/regions/inductor.with_weights_ahead), so GPT's two blocks compile as one region each,
    beside the embedding's and the head's, not a region between every two weights; the
    gathers, prefetches and bucketed collectives are the ones eager runs (weight by weight
    too, with buckets of one weight), backward gathers again what it reads (bucket by bucket,
    as eager), and the gradients equal one device."""
    from rt_cases import under_backend, zero3_regather_counts
    plan = _gpt_plan("zero3", ((4,), ("dp",)))
    eager = pool4.run(zero3_regather_counts, plan, True, GPT, bucket_mb)[0]
    compiled = pool4.run(under_backend, "inductor", zero3_regather_counts, plan, True, GPT, bucket_mb)[0]
    assert compiled["regions"] == 4 and eager["regions"] == 0, (compiled, eager)
    for key in ("gathered", "prefetched", "bucket_gathers", "bucket_reduces", "buckets"):
        assert compiled[key] == eager[key], (key, compiled, eager)
    # (a region's compiled backward reads fewer of the saved weights, a bias's gradient needs
    # none, and reads them all at its start: fewer regathers, fewer of them started ahead)
    assert 0 < compiled["regathered"] <= eager["regathered"], (compiled, eager)
    assert compiled["regather_prefetched"] <= eager["regather_prefetched"], (compiled, eager)
    assert compiled["worst"] <= 0 and eager["worst"] <= 0, (compiled, eager)


@pytest.mark.parametrize("spec, layout, recompute", [(GPT, "megatron-tp x dp", "selective"),
                                                     (GPT, "megatron-tp x dp", "full"), (GPT, "zero3", "full"),
                                                     (("hf-arch", "qwen3"), "zero3", "full"),
                                                     (("hf-llama",), "zero3", "selective")],
                         ids=["gpt-megatron-selective", "gpt-megatron-full", "gpt-zero3-full", "qwen3-zero3-full",
                              "llama-zero3-selective"])
def test_inductor_with_recomputation(pool4, spec, layout, recompute):
    """Recomputed layers under Inductor: the compute inside each layer is compiled too
    (runtime/regions/inductor._recomputed_layers_compiled): a layer recomputed whole as one compiled
    run under checkpointing, whose compiled backward runs the fused forward again; under
    selective, the runs between the kept products, under the layer's checkpointing.
    Training equals one device.  (Qwen3's first layer starts with the model's rotary table,
    which the recomputation outlines into it: its weights' gathers still go first.)"""
    from rt_cases import build_case
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh((4,), ("dp",), device="cpu") if layout == "zero3" else \
        autopar.Mesh((2, 2), ("dp", "tp"), device="cpu")
    plan = autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                        solve=autopar.SolveOptions(compare=False, layout=layout), recompute=recompute)
    assert plan.recompute is not None and plan.recompute.layers
    result = pool4.run(train_and_compare, spec, plan.to_dict(), 3, None, "adamw", "inductor")[0]
    assert result["ok"] and result["failed"] == 0, result
    assert result["layer_regions"] >= len(plan.recompute.layers), result
    if layout == "zero3":   # each layer one compiled run, recomputed inside the compiled backward (a
        # Megatron TP layer holds more than compute and its weights' gathers: several runs, checkpointed whole),
        # but for a layer holding a grad-mode region: transformers before 5.19 compute the rotary table under
        # no_grad (one wrap_with_set_grad_enabled op), which the first layer takes in and compiles in parts
        from autopar.trace.export import trace
        regions = sum(1 for n in trace(model, args, kwargs or None).graph.graph.nodes
                      if "set_grad_enabled" in str(n.target))
        assert result["checkpointed_layers"] == len(plan.recompute.layers) - min(regions, 1), result


def _graph():
    """A small ATen graph, as the rank's graphs are: ((x @ w).relu() + 1).sin().sum()."""
    from torch.fx.experimental.proxy_tensor import make_fx
    x, w = torch.randn(4, 8), torch.randn(8, 3, requires_grad=True)
    gm = make_fx(lambda x, w: ((x @ w).relu() + 1).sin().sum())(x, w.detach())
    return gm, x, w


def test_every_checkpointed_layer_compiles_past_dynamos_recompile_limit():
    """Twelve layers recomputed whole, each its own checkpointed region: every one is
    compiled (Dynamo compiles per code object and stops at its recompile limit, eight, for
    a forward shared by all), none fails, and each gradient equals the plain graph's."""
    from torch._dynamo.utils import counters
    from autopar.runtime.regions.inductor import CompiledRegion
    regions = []
    for i in range(12):
        gm, x, w = _graph()
        regions.append((CompiledRegion(gm, f"layer {i}", checkpointed=True), x, w))
    before = counters["stats"]["unique_graphs"]
    for region, x, w in regions:
        expected = torch.autograd.grad(region.eager.body(x, w), w)[0]
        got = torch.autograd.grad(region(x, w), w)[0]
        assert not region.failed and region.checkpointed
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (region.label, got, expected)
    assert counters["stats"]["unique_graphs"] - before == 12


def test_a_run_compiled_without_dynamo_hands_on_an_ops_several_results():
    """A run inside a recomputed layer is compiled by compile_fx, which wants a flat tuple of
    tensors out; a run that hands on an op's several results whole (a Mixtral router's run
    passes on topk's values and indices) compiles, returns them in their structure, and
    its gradient is the plain graph's."""
    import operator

    from autopar.runtime.regions.inductor import CompiledRegion
    g = fx.Graph()
    x = g.placeholder("x")
    top = g.call_function(torch.ops.aten.topk.default, (g.call_function(torch.ops.aten._softmax.default,
                                                                         (x, -1, False)), 2))
    g.output((g.call_function(torch.ops.aten.mul.Tensor, (g.call_function(operator.getitem, (top, 0)), 2.0)), top))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x = torch.randn(8, 5, requires_grad=True)
    expected = gm(x)
    region = CompiledRegion(gm, "router", dynamo=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (no fallback to eager)
        got = region(x)
    assert not region.failed and isinstance(got[1], tuple) and len(got[1]) == 2
    assert torch.equal(got[1][1], expected[1][1])
    assert torch.allclose(got[0], expected[0]) and torch.allclose(got[1][0], expected[1][0])
    (want,) = torch.autograd.grad(expected[0].sum() + expected[1][0].sum(), x)
    (have,) = torch.autograd.grad(got[0].sum() + got[1][0].sum(), x)
    assert torch.allclose(have, want, rtol=1e-5, atol=1e-6)


def test_a_region_inductor_cannot_compile_runs_eagerly_with_one_warning():
    gm, x, w = _graph()
    expected = gm(x, w)
    split, regions = compile_regions(gm)
    assert len(regions) == 1

    def broken(*args):
        raise RuntimeError("lowering failed for aten.sin")
    regions[0].__dict__["compiled"] = broken
    with pytest.warns(UserWarning, match="could not compile the region 1 .*lowering failed.*runs eagerly"):
        got = split(x, w)
    assert torch.equal(got, expected) and regions[0].failed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(split(x, w), expected)   # said once


def test_regions_compile_and_keep_the_gradient():
    gm, x, w = _graph()
    expected = gm(x, w)
    (gw,) = torch.autograd.grad(expected, w)
    split, regions = compile_regions(gm)
    got = split(x, w)
    (gw2,) = torch.autograd.grad(got, w)
    assert isinstance(regions[0], CompiledRegion) and not regions[0].failed and regions[0].compile_s is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw2, gw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p, train, cut", [(0.0, True, False), (0.5, False, False), (0.5, True, True)])
def test_a_dropout_that_draws_nothing_does_not_cut_a_region(p, train, cut):
    """A dropout of probability 0, or in eval mode, returns its input: it joins the compute
    around it (run as the plain op, even where the runtime routes it through its random
    stream), where a dropout that draws runs eagerly between two regions."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from autopar.passes.random_ops import draw, draws_nothing, route_random
    from autopar.passes.slots import STREAMS, bind
    from autopar.runtime.regions.rng import RandomStreams

    def f(x, w):
        h = torch.ops.aten.native_dropout(torch.relu(x @ w), p, train)[0]
        return (h.sin() * 2).sum()
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    gm = make_fx(f)(x, w)
    streams = RandomStreams(0, None, torch.device("cpu"), route_random(gm))   # (no split axes: no groups read)
    assert bind(gm, STREAMS, streams) == 1
    (node,) = [n for n in gm.graph.nodes if n.meta.get("aten_target") is torch.ops.aten.native_dropout.default]
    assert (draws_nothing(node) is None) == cut
    state = torch.get_rng_state()
    expected = gm(x, w)
    split, regions = compile_regions(gm)
    assert len(regions) == (2 if cut else 1)
    assert node.target is draw   # (the graph itself still routes it)
    got = split(x, w)
    assert torch.equal(torch.get_rng_state(), state)   # neither moved the user's random state
    if not cut:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_inductor_steps_the_fused_optimizer_unless_told_otherwise(pool2):
    """Under backend "inductor" build_optimizer runs an optimizer's fused kernel where it has
    one and the call chose neither `fused` nor `foreach`; eager runs torch's default."""
    from rt_cases import optimizer_fused
    plan = plan_for(GPT, "data-parallel", shape=(2,), names=("dp",))
    asks = [("AdamW", {}), ("SGD", {}), ("AdamW", {"fused": False}), ("AdamW", {"foreach": False}), ("RMSprop", {})]
    assert pool2.run(optimizer_fused, GPT, plan, "inductor", asks)[0] == [True, True, False, None, "absent"]
    assert pool2.run(optimizer_fused, GPT, plan, "eager", asks[:2])[0] == [None, None]


def test_plans_for_inductor_price_the_fused_optimizer_step():
    """The fused AdamW kernel reads and writes each element FUSED_ADAMW_ACCESSES times,
    against ADAMW_ACCESSES for the multi-tensor step, and makes no temporaries: a plan
    priced for Inductor has a cheaper step and no step memory (float32, one H100)."""
    from autopar.cost import prices
    from autopar.models import build
    mesh = autopar.Mesh((8,), ("dp",), device="h100")
    assert prices.optimizer_seconds(1e9, 4, False, mesh, fused=True) == pytest.approx(
        prices.optimizer_seconds(1e9, 4, False, mesh) * prices.FUSED_ADAMW_ACCESSES / prices.ADAMW_ACCESSES)
    model, example = build("gpt-tiny", device="meta", batch=8, seq=64)
    plans = {b: autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="zero2"),
                             pricing=autopar.Pricing(backend=b))
             for b in ("eager", "inductor")}
    assert plans["eager"].predicted.step_memory > 0 and plans["inductor"].predicted.step_memory == 0
    calibrated = autopar.Mesh((8,), ("dp",), device=autopar.mesh.DeviceSpec.from_dict(
        {**mesh.device.to_dict(), "optimizer": [1e-5, 2e-11], "optimizer_fused": [1e-6, 5e-12]}))
    assert prices.optimizer_seconds(1e6, 4, False, calibrated, fused=True) == pytest.approx(1e-6 + 5e-12 * 1e6)
    assert prices.optimizer_seconds(1e6, 4, False, calibrated) == pytest.approx(1e-5 + 2e-11 * 1e6)


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"backend='tvm': choose 'eager'.*or 'inductor'"):
        check_backend("tvm")
    with pytest.raises(ValueError, match=r"RunOptions\(backend='tvm'\): choose 'auto'.*'eager'.*'inductor'"):
        autopar.RunOptions(backend="tvm")
    with pytest.raises(ValueError, match=r"Pricing\(backend='tvm'\): choose 'eager'.*'inductor'"):
        autopar.Pricing(backend="tvm")


def test_auto_takes_inductor_on_gpus_and_eager_on_cpu_ranks_and_split_backward_schedules(pool2):
    """compile's default backend: Inductor where CUDA is, eager on CPU ranks (what this
    pool runs), and eager for a zero-bubble plan even on a GPU (its two-pass compiled
    backward is not measured on one yet)."""
    from autopar.runtime.compiled import auto_backend
    from rt_cases import backend_chosen, build_case
    spec = ("autopar", "gpt-tiny", (("n_layers", 4),))
    model, args, _ = build_case(spec)
    mesh = autopar.Mesh((2,), ("pp",), device="cpu")
    plain = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False))
    split = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False),
                         pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="zero-bubble", microbatches=2))
    one_f_one_b = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False),
                               pipeline=autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    assert [auto_backend(p, cuda=True) for p in (None, plain, one_f_one_b, split)] == \
        ["inductor", "inductor", "inductor", "eager"]
    assert {auto_backend(p, cuda=False) for p in (None, plain, one_f_one_b, split)} == {"eager"}
    assert pool2.run(backend_chosen, spec, plain.to_dict()) == ["eager", "eager"]


def test_eval_and_train_switch_the_compiled_graph(pool4):
    """GPT-2 with dropout 0.1: eval(), train() with a step, eval() again: each mode runs its
    own compiled regions, and eval's loss equals the plain model's in eval mode both times
    (the training step's loss, with dropout, differs from it)."""
    spec = ("hf-dropout", "gpt2")
    result = pool4.run(eval_train_eval, spec, plan_for(spec, "megatron-tp x dp"), "inductor")[0]
    assert result["eval"] <= 1e-5 * abs(result["eval_loss"]), result
    assert abs(result["train_loss"] - result["eval_loss"]) > 1e-3, result   # dropout was on in between
    assert result["regions"] > 0 and result["failed"] == 0, result


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_inductor_runs_pipeline_stages(pool4, schedule):
    """Two device groups of 2 (pp x dp), GPT of 4 layers: each stage's graph runs as compiled
    regions under the schedule's microbatches, equal to one device."""
    from rt_cases import build_case
    spec = ("autopar", "gpt-tiny", (("n_layers", 4),))
    model, args, _ = build_case(spec)
    virtual = 2 if schedule == "interleaved-1f1b" else None
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("pp", "dp"), device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule=schedule, virtual=virtual,
                                                  microbatches=2))
    result = pool4.run(train_and_compare, spec, plan.to_dict(), 3, None, "adamw", "inductor")[0]
    assert result["ok"], result
    assert result["regions"] > 0 and result["failed"] == 0, result


SPLIT_CASES = [(("autopar", "gpt-tiny", (("n_layers", 4),)), "zero-bubble", None),
               (("autopar", "llama-tiny", (("n_layers", 4),)), "zbv", None),
               (("autopar", "gpt-tiny", (("n_layers", 4),)), "dualpipev", "zero3"),
               (("hf-llama", 4), "zbv", "megatron-tp"),
               (("hf-arch", "mixtral"), "zero-bubble", None),
               (("hf-arch", "gpt_neox"), "zero-bubble", None)]


@pytest.mark.parametrize("spec, schedule, intra", SPLIT_CASES,
                         ids=["gpt-zero-bubble", "llama-zbv", "gpt-dualpipev-zero3", "hf-llama-zbv-megatron",
                              "mixtral-zero-bubble", "hf-gpt-neox-zero-bubble"])
def test_inductor_runs_split_backward_schedules(pool4, spec, schedule, intra):
    """Zero-bubble, ZB-V and DualPipeV under Inductor (runtime/regions/split_backward.py), two device
    groups of 2 with data parallelism, ZeRO-3 or Megatron TP inside (GPT-NeoX: a parallel
    block whose fused projection's split hands on a list): each compiled region's
    backward runs as two compiled passes, its weights' gradients deferred to the schedule's
    W action, and 3 AdamW steps equal one device.  Every deferred W runs, once per region
    reading weights, microbatch and step; the pipeline's metadata inference, which asks
    autograd for input gradients only, defers nothing that runs."""
    from rt_cases import build_case
    model, args, kwargs = build_case(spec)
    inside = "tp" if intra == "megatron-tp" else "dp"
    microbatches = 4 if schedule == "dualpipev" else 2
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("pp", inside), device="cpu"), args, example_kwargs=kwargs or None,
                        solve=autopar.SolveOptions(compare=False, layout=intra),
                        pipeline=autopar.Pipeline(axis="pp", groups=2, schedule=schedule, microbatches=microbatches))
    assert plan.pipeline.schedule == schedule
    for result in pool4.run(train_and_compare, spec, plan.to_dict(), 3, None, "adamw", "inductor"):
        assert result["ok"], result
        assert result["regions"] > 0 and result["failed"] == 0, result
        deferred, ran, _ = result["weight_passes"]
        assert deferred == ran and deferred > 0 and deferred % (3 * microbatches) == 0, result


def test_plans_priced_for_inductor_fuse_memory_bound_chains():
    """GPT of width 1,024 on 8 H100 (bf16): priced for inductor, the memory-bound ops cost
    less (a chain reads its inputs and writes what leaves it once) and only chain heads
    launch, while matmuls and attention cost the same; the plan records its backend, which
    survives saving; a bad backend is refused."""
    from autopar.models import build
    model, example = build("gpt-tiny", device="meta", hidden=1024, n_heads=16, n_layers=4, batch=8, seq=1024,
                           max_seq=1024)
    mesh = autopar.Mesh((8,), ("dp",), device="h100")
    plans = {b: autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout="zero2"),
                             pricing=autopar.Pricing(backend=b), mixed_precision="bf16")
             for b in ("eager", "inductor")}
    eager, fused = plans["eager"], plans["inductor"]

    def seconds(plan, ops):
        return sum(n.compute_s for n in plan.nodes if n.op in ops)
    pointwise = ("aten.gelu", "aten.add", "aten.layer_norm", "aten.dropout")
    assert seconds(fused, pointwise) < 0.9 * seconds(eager, pointwise)
    heavy = ("aten.linear", "aten.scaled_dot_product_attention")
    assert seconds(fused, heavy) == pytest.approx(seconds(eager, heavy), rel=1e-9)
    assert fused.predicted.step_s < eager.predicted.step_s
    assert (eager.backend, fused.backend) == ("eager", "inductor")
    assert autopar.Plan.from_dict(fused.to_dict()).backend == "inductor"
    assert "priced for backend inductor" in str(fused) and "priced for backend" not in str(eager)
    with pytest.raises(ValueError, match="backend='xla'"):
        autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False),
                     pricing=autopar.Pricing(backend="xla"))


# --- what the plan chose survives compilation -------------------------------------------------

def _gpt_plan(layout, mesh=((2, 2), ("dp", "tp")), **kw):
    from rt_cases import build_case
    model, args, _ = build_case(GPT)
    return autopar.plan(model, autopar.Mesh(*mesh, device="cpu"), args,
                        solve=autopar.SolveOptions(compare=False, layout=layout), **kw).to_dict()


def test_inductor_mixed_precision_equals_one_device(pool4):
    from rt_cases import check_mixed_precision, mixed_precision_vs_reference, under_backend
    plan = _gpt_plan("megatron-tp x dp", mixed_precision=autopar.MixedPrecision())
    check_mixed_precision(pool4.run(under_backend, "inductor", mixed_precision_vs_reference, GPT, plan)[0])


def test_inductor_frozen_parameters_and_clipping(pool4):
    """Frozen first block (no gradient, weights bit-identical after the steps) and gradients
    clipped to norm 0.5 (cm.clip_grad_norm_ against torch's), as under eager."""
    spec = ("frozen", GPT, ("h.0",))
    result = pool4.run(train_and_compare, spec, plan_for(spec, "megatron-tp x dp"), 3, 0.5, "adamw", "inductor")[0]
    assert result["ok"], result
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in result["norms"]), result["norms"]


def test_inductor_accumulation_under_no_sync(pool4):
    from rt_cases import accumulate_vs_whole_batch, build_case, under_backend
    model, example, _ = build_case(("autopar", "gpt-tiny", (("batch", 16),)))
    plan = autopar.plan(model, autopar.Mesh((4,), ("dp",), device="cpu"), example,
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    result = pool4.run(under_backend, "inductor", accumulate_vs_whole_batch, plan.to_dict())[0]
    assert result["bucketed"] > 0 and result["worst"] <= 0, result


def test_inductor_checkpoints_round_trip(pool4, tmp_path):
    from rt_cases import checkpoint_round_trip, under_backend
    r = pool4.run(under_backend, "inductor", checkpoint_round_trip, GPT, _gpt_plan("zero3"),
                  _gpt_plan("megatron-tp x dp"), str(tmp_path / "ckpt"))[0]
    assert r["keys_equal_plain"] and r["worst"] == 0.0, r


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_inductor_keeps_the_planned_saved_bytes(pool4, mode):
    """What a step keeps for backward (runtime.regions.recompute.measure_saved) under the compiled
    regions, against the activation bytes of the plan priced for Inductor: within 5 %, as
    under eager."""
    from rc_cases import saved_bytes
    from rt_cases import under_backend
    plan = _gpt_plan("megatron-tp x dp", recompute=mode, pricing=autopar.Pricing(backend="inductor"))
    rows = pool4.run(under_backend, "inductor", saved_bytes, GPT, plan)
    bad = [(r["measured"], r["predicted"]) for r in rows if abs(r["predicted"] - r["measured"]) > 0.05 * r["measured"]]
    assert not bad, bad


@pytest.mark.parametrize("spec", [("hf-gpt2",), ("hf-llama",)], ids=["hf-gpt2", "hf-llama"])
def test_inductor_plan_keeps_what_the_partitioner_keeps(pool4, spec):
    """Nothing recomputed, data parallel: the compiled graphs' partitioner runs pointwise
    chains again in backward (GPT-2's tanh GELU, Llama's RMSNorm scaling and SwiGLU product)
    rather than keep them, so a step keeps a third less than under eager; a plan priced for
    Inductor (solve/problem/partitioned.py) predicts what it keeps within 2 %."""
    from rc_cases import saved_bytes
    from rt_cases import build_case, under_backend
    model, args, kwargs = build_case(spec)
    mesh = autopar.Mesh((4,), ("dp",), device="cpu")
    plans = {b: autopar.plan(model, mesh, args, example_kwargs=kwargs or None,
                             solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                             pricing=autopar.Pricing(backend=b)) for b in ("eager", "inductor")}
    eager = pool4.run(saved_bytes, spec, plans["eager"].to_dict())
    fused = pool4.run(under_backend, "inductor", saved_bytes, spec, plans["inductor"].to_dict())
    assert all(r["measured"] == r["predicted"] for r in eager), eager
    assert all(r["measured"] < 0.8 * e["measured"] for r, e in zip(fused, eager)), (fused, eager)
    assert all(r["measured"] == pytest.approx(r["predicted"], rel=0.02) for r in fused), fused


def test_inductor_compiles_a_selective_layer_whole(pool4):
    """Selective recomputation under Inductor, data parallel: each layer is one compiled
    checkpointed region (runtime/regions/compiled_checkpoint._tagged: the kept products and attention saved by
    the compiled forward, the ops between them run again in its backward), training equals
    one device, and what a step keeps is eager's less exactly the kept outputs no backward
    reads: each block's MLP down-projection, which only the residual add reads (eager's
    checkpoint caches them; the compiled graph's partitioner does not save them).  A plan
    priced for Inductor (solve/recompute/modes.compiled_whole) predicts exactly those bytes."""
    from rc_cases import saved_bytes
    from rt_cases import build_case, under_backend
    model, args, _ = build_case(GPT)
    mesh = autopar.Mesh((4,), ("dp",), device="cpu")
    plan = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                        recompute="selective")
    layers = len(plan.recompute.layers)
    result = pool4.run(train_and_compare, GPT, plan.to_dict(), 3, None, "adamw", "inductor")[0]
    assert result["ok"] and result["failed"] == 0, result
    assert result["checkpointed_layers"] == layers == len(model.blocks), result
    eager = pool4.run(saved_bytes, GPT, plan.to_dict())
    fused = pool4.run(under_backend, "inductor", saved_bytes, GPT, plan.to_dict())
    unread = layers * (args[0].numel() // 4) * model.blocks[0].mlp.fc2.out_features * 4   # float32
    assert [r["measured"] for r in fused] == [r["measured"] - unread for r in eager], (fused, eager, unread)
    priced = autopar.plan(model, mesh, args, solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                          pricing=autopar.Pricing(backend="inductor"), recompute="selective")
    assert priced.predicted.memory["activations"] == plan.predicted.memory["activations"] - unread
    assert [r["measured"] for r in fused] == [priced.predicted.memory["activations"]] * 4, fused


def test_inductor_layer_cuts_hand_gradients_to_the_buckets_layer_by_layer(pool4):
    """On CUDA the compiled regions end at every layer (runtime/regions/inductor.LAYER_CUTS), so that
    the gradient buckets' all-reduces start while earlier layers' backward runs, as the
    plan prices them; forced here on CPU ranks: GPT under data parallelism compiles as the
    embedding, each block and the head, trains like one device, and by the time backward
    reaches the first block the later blocks' and the head's gradients are on their way."""
    from rt_cases import buckets_before_first_layer, with_layer_cuts
    plan = plan_for(GPT, "data-parallel", shape=(4,), names=("dp",))
    result = pool4.run(with_layer_cuts, train_and_compare, GPT, plan, 3, None, "adamw", "inductor")[0]
    assert result["ok"] and result["failed"] == 0 and result["regions"] == 4, result
    got = pool4.run(with_layer_cuts, buckets_before_first_layer, GPT, plan)[0]
    assert got["regions"] == 4 and "blocks.0" in got["first"], got
    assert 0 < got["at_first_layer"][0] < got["launched"], got


@pytest.mark.parametrize("layout", ["data-parallel", "megatron-tp x dp"])
def test_inductor_batch_norm_trains_and_keeps_its_statistics(pool4, layout):
    """Batch norm's running statistics (buffers updated in place inside a compiled region):
    training equals one device, and the statistics and eval() behave as under eager."""
    from rt_cases import under_backend
    from sem_cases import batch_norm_train_eval, bn_case
    model, x = bn_case()
    plan = autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device="cpu"), (x,),
                        solve=autopar.SolveOptions(compare=False, layout=layout)).to_dict()
    # (SGD: a bias before batch norm has no gradient in exact arithmetic, only rounding, which
    # Adam's normalised step turns into full steps that differ wherever the kernels are fused)
    result = pool4.run(train_and_compare, ("bn",), plan, 3, None, "sgd", "inductor")[0]
    assert result["ok"] and result["regions"] > 0 and result["failed"] == 0, result
    eager = pool4.run(batch_norm_train_eval, plan)[0]
    fused = pool4.run(under_backend, "inductor", batch_norm_train_eval, plan)[0]
    assert fused.keys() == eager.keys() and fused["batches_tracked"] == eager["batches_tracked"]
    for key in fused:   # (lists compared element by element: approx does not nest them in a dict)
        if key != "batches_tracked":
            assert fused[key] == pytest.approx(eager[key], rel=1e-5, abs=1e-6), (key, fused, eager)


def test_tanh_gelus_run_as_sigmoids_on_cpu():
    """aten's tanh GELU and the hand-written 0.5 x (1 + tanh z) become x * sigmoid(2 z) on CPU
    (Inductor's tanh there costs three exps); a tanh read elsewhere stays; values and
    gradients equal the graph's, and the sigmoid form is the more accurate where the GELU
    is small."""
    import math
    from torch.fx.experimental.proxy_tensor import make_fx
    from autopar.runtime.regions.inductor import with_sigmoid_gelus
    aten = torch.ops.aten

    def f(x, w):
        h = torch.nn.functional.gelu(x @ w, approximate="tanh")
        g = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        t = torch.tanh(g)
        return (g * (t + 1)).sum() + t.sum()   # (this tanh has two readers: it stays)
    x, w = torch.randn(16, 8, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    gm = make_fx(f)(x, w)
    expected = gm(x, w)
    (gw,) = torch.autograd.grad(expected, w)
    assert with_sigmoid_gelus(gm) == 2
    targets = [n.target for n in gm.graph.nodes]
    assert aten.gelu.default not in targets and targets.count(aten.tanh.default) == 1
    assert targets.count(aten.sigmoid.default) == 2
    got = gm(x, w)
    (gw2,) = torch.autograd.grad(got, w)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw2, gw, rtol=1e-12, atol=1e-12)
    # float32, where the GELU is small: against float64
    v = torch.linspace(-6, -3, 64)
    one = make_fx(lambda v: torch.nn.functional.gelu(v, approximate="tanh"))(v)
    d = v.double()   # (in float64 too, 1 + tanh z rounds to 0 below about -9)
    exact = d * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (d + 0.044715 * d ** 3))
    before = ((one(v).double() - exact).abs() / exact.abs()).max()
    assert with_sigmoid_gelus(one) == 1
    after = ((one(v).double() - exact).abs() / exact.abs()).max()
    assert after < 1e-5 < before, (after, before)
    # on another device nothing is rewritten
    meta = make_fx(lambda v: torch.nn.functional.gelu(v, approximate="tanh"))(torch.randn(4, device="meta"))
    assert with_sigmoid_gelus(meta) == 0
