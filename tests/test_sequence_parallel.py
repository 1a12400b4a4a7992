"""Sequence parallelism: Megatron-SP, Ulysses and ring attention (context parallel).

Numerics are the contract: each layout, on 2 and 4 gloo ranks, trains like one device
(loss, gradients and parameters after 3 AdamW steps); ring attention itself matches
whole-sequence attention in float64 and balances causal work (every rank computes the same
number of score blocks); activations per rank fall as 1/N with the split and match the plan.
"""
import pytest
import torch

import autopar
from autopar.models import build
from autopar.report.text import megatron_sp_axes
from rt_cases import build_case, plan_for, train_and_compare
from seq_cases import ring_blocks_and_numerics, saved_activation_bytes
from test_pipeline_runtime import pipelined_plan

GPT = ("autopar", "gpt-tiny", ())
LLAMA = ("autopar", "llama-tiny", ())   # 4 query heads, 2 key/value heads: enable_gqa
HF_LLAMA = ("hf-llama",)                # transformers' LlamaForCausalLM, 4 heads, 2 key/value heads
SPECS = {"gpt-tiny": GPT, "llama-tiny": LLAMA, "hf-llama": HF_LLAMA}
ATTENTION = "aten.scaled_dot_product_attention"


def _attention_kinds(plan) -> set:
    return {k for n in plan.nodes if n.op == ATTENTION for k in n.split if k is not None}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("heads, kv, causal", [(4, 4, True), (4, 2, True), (4, 4, False)])
def test_ring_attention_is_exact_and_balanced(request, n, heads, kv, causal):
    """Against F.scaled_dot_product_attention on the whole sequence (float64: only round-off
    differs).  Causal: the sequence is cut into 2n chunks and each rank computes the queries
    of chunks r and 2n-1-r, so each computes (r + 1) + (2n - r) = 2n + 1 blocks of scores and
    together they compute the 2n(2n + 1)/2 blocks on or below the diagonal, each once (with
    contiguous slices rank r would compute 4r + 3: 3 against 4n - 1)."""
    pool = request.getfixturevalue(f"pool{n}")
    results = pool.run(ring_blocks_and_numerics, heads, kv, 32, causal)
    for r in results:
        assert max(r["diff"].values()) < 1e-12, r
    blocks = [r["blocks"] for r in results]
    if causal:
        assert blocks == [2 * n + 1] * n
        assert sum(blocks) == (2 * n) * (2 * n + 1) // 2
    else:
        assert blocks == [4 * n] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("window", [3, 5, 12])
def test_ring_attention_with_a_sliding_window(request, n, window):
    """autopar::window_attention split by the ring equals the op on the whole sequence, and a
    rank computes only the blocks some query of its chunks sees: with chunks of L = 32 / 2n
    tokens, query chunk c meets key chunk k <= c when (c - k - 1) L + 1 < window."""
    results = request.getfixturevalue(f"pool{n}").run(ring_blocks_and_numerics, 4, 2, 32, True, 0, window)
    L = 32 // (2 * n)
    for rank, r in enumerate(results):
        assert max(r["diff"].values()) < 1e-12, r
        seen = sum(1 for c in (rank, 2 * n - 1 - rank) for k in range(c + 1) if (c - k - 1) * L + 1 < window)
        assert r["blocks"] == seen, (rank, r["blocks"], seen)


CASES = [(model, layout, n) for model in SPECS for layout in ("megatron-sp", "ulysses", "context-parallel")
         for n in (2, 4)]


@pytest.mark.parametrize("model, layout, n", CASES)
def test_sequence_layouts_train_like_one_device(request, model, layout, n):
    spec = SPECS[model]
    if layout == "ulysses" and n == 4 and model != "gpt-tiny":
        # 2 key/value heads cannot be spread over 4 ranks: the layout is refused, saying why
        with pytest.raises(ValueError, match="2 key/value heads on the rank do not divide by 4"):
            plan_for(spec, layout, shape=(n,), names=("sp",))
        return
    plan_dict = plan_for(spec, layout, shape=(n,), names=("sp",))
    plan = autopar.Plan.from_dict(plan_dict)
    if layout == "megatron-sp":
        assert megatron_sp_axes(plan) == ["sp"]
        assert "Megatron-SP" in str(plan)
        # every forward sum of a row-parallel matmul is reduce-scattered into sequence shards
        forward = [c.kind for c in plan.collectives if c.phase == "forward"]
        assert forward.count("all_reduce") == 0 and forward.count("reduce_scatter") >= 4
    else:
        kind = "ring" if layout == "context-parallel" else "ulysses"
        assert _attention_kinds(plan) == {kind}
        assert f"sp={kind}" in str(plan)
    result = request.getfixturevalue(f"pool{n}").run(train_and_compare, spec, plan_dict)[0]
    assert result["ok"], result


@pytest.mark.parametrize("model", ["gpt-tiny", "hf-llama"])
def test_context_parallel_with_tensor_parallel(pool4, model):
    """Ring attention over 'cp' with Megatron over 'tp' on a (2, 2) mesh: heads split on tp,
    each head's sequence on cp."""
    plan_dict = plan_for(SPECS[model], "context-parallel x megatron-tp", shape=(2, 2), names=("cp", "tp"))
    plan = autopar.Plan.from_dict(plan_dict)
    attention = [n for n in plan.nodes if n.op == ATTENTION]
    assert attention and all(n.split[0] == "ring" and n.split[1] == "heads" for n in attention)
    result = pool4.run(train_and_compare, SPECS[model], plan_dict)[0]
    assert result["ok"], result


@pytest.mark.parametrize("layout", ["context-parallel x dp", "ulysses x dp", "context-parallel x zero3"])
def test_sequence_split_with_data_parallel_and_zero(pool4, layout):
    """The sequence split on 'cp' and the batch on 'dp' (2, 2); with ZeRO-3 every weight is
    stored in quarters and gathered for use."""
    plan_dict = plan_for(HF_LLAMA, layout, shape=(2, 2), names=("dp", "cp"))
    plan = autopar.Plan.from_dict(plan_dict)
    kind = "ulysses" if layout.startswith("ulysses") else "ring"
    assert all(n.split == ("b0", kind) for n in plan.nodes if n.op == ATTENTION), \
        [n.split for n in plan.nodes if n.op == ATTENTION]
    if layout.endswith("zero3"):
        assert all(plan.zero_stage(name) == 3 for name in plan.param_placements)
    result = pool4.run(train_and_compare, HF_LLAMA, plan_dict)[0]
    assert result["ok"], result


@pytest.mark.parametrize("model, n", [("hf-llama", 4), pytest.param("gpt-tiny", 2, marks=pytest.mark.slow)])
def test_context_parallel_with_zero3_on_its_one_axis(request, model, n):
    """On a 1-D mesh, context-parallel x zero3: the one axis splits attention's sequence
    (ring) and stores every parameter sharded over it, as FSDP over the context-parallel
    ranks does (torchtitan's FSDP 1 x CP 8).  Each weight's state is 1/n per rank and the
    model trains like one device."""
    spec = SPECS[model]
    plan_dict = plan_for(spec, "context-parallel x zero3", shape=(n,), names=("cp",))
    plan = autopar.Plan.from_dict(plan_dict)
    assert _attention_kinds(plan) == {"ring"}
    assert plan.param_placements and all(plan.zero_stage(name) == 3 for name in plan.param_placements)
    whole = autopar.Plan.from_dict(plan_for(spec, "context-parallel", shape=(n,), names=("cp",)))
    assert plan.predicted.memory["optimizer"] == pytest.approx(whole.predicted.memory["optimizer"] / n, rel=0.02)
    result = request.getfixturevalue(f"pool{n}").run(train_and_compare, spec, plan_dict)[0]
    assert result["ok"], result


@pytest.mark.parametrize("layout", ["context-parallel", "ulysses", "megatron-sp"])
def test_sequence_split_inside_pipeline_stages(pool4, layout):
    spec = ("autopar", "llama-tiny", (("n_layers", 4),))
    plan = pipelined_plan(spec, (2, 2), ("pp", "cp"), 2, "1f1b", layout, microbatches=2)
    assert plan.pipeline.pipelined and plan.pipeline.groups == 2
    if layout != "megatron-sp":
        assert _attention_kinds(plan) == {"ring" if layout == "context-parallel" else "ulysses"}
    result = pool4.run(train_and_compare, spec, plan.to_dict())[0]
    assert result["ok"], result


def test_random_plans_with_sequence_strategies(pool4):
    """Random valid plans whose attention draws ring or Ulysses (on either axis of a (2, 2)
    mesh, with whatever the other ops drew) train like one device."""
    model, args, kwargs = build_case(GPT)
    mesh = autopar.Mesh((2, 2), ("dp", "sp"), device="cpu")
    plans = autopar.random_plans(model, mesh, args, solve=autopar.SolveOptions(compare=False), seeds=range(40))
    chosen = [p for p in plans if _attention_kinds(p) & {"ring", "ulysses"}][:4]
    assert len(chosen) == 4
    assert {"ring", "ulysses"} <= set().union(*(_attention_kinds(p) for p in chosen))
    for plan in chosen:
        result = pool4.run(train_and_compare, GPT, plan.to_dict())[0]
        assert result["ok"], (plan.origin, result)


LONG = ("autopar", "gpt-tiny", (("seq", 128), ("batch", 1), ("max_seq", 128)))


@pytest.mark.parametrize("layout", ["context-parallel", "ulysses"])
def test_activation_memory_falls_with_the_split(pool2, pool4, layout):
    """Bytes saved for backward per rank (saved_tensors_hooks, storages once, parameters
    left out) on one 128-token sequence: N times them is the single device's bytes within
    10 % for N = 2 and 4, and each is the plan's predicted activation memory within 10 %."""
    model, args, _ = build_case(LONG)
    seen: dict = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args).backward()
    whole = sum(v for k, v in seen.items() if k not in params)
    for n, pool in ((2, pool2), (4, pool4)):
        got = pool.run(saved_activation_bytes, LONG, plan_for(LONG, layout, shape=(n,), names=("sp",)))
        for r in got:
            assert r["measured"] * n == pytest.approx(whole, rel=0.10), (n, r, whole)
            assert r["predicted"] == pytest.approx(r["measured"], rel=0.10), (n, r)


def test_why_a_sequence_split_is_left_off():
    """A sequence that does not divide into 2 x the axis size keeps ring attention off the
    menu, and the plan says so and how to fix it; Ulysses needs the heads to divide."""
    model, example = build("gpt-tiny", seq=12)
    plan = autopar.plan(model, autopar.Mesh((4,), ("sp",), device="cpu"), example,
                        solve=autopar.SolveOptions(compare=True))
    notes = " ".join(plan.notes)
    assert "ring on 'sp': sequence 12 does not divide into 8 chunks" in notes and "pad it" in notes
    assert "ring" not in _attention_kinds(plan)
    assert "sequence 12 does not divide" in plan.baselines["context-parallel"]
    assert "note: sequence split of attention in blocks.0.attn: ring on 'sp'" in str(plan)


def test_dense_masks_keep_the_ring_off():
    """A padding mask the user passes stays a dense mask, which the ring cannot take: the
    note names the node; Ulysses (the mask broadcast over heads) remains."""
    import hf_archs
    model, kwargs = hf_archs.build("llama", seq=16)
    kwargs = dict(kwargs, attention_mask=torch.ones(4, 16, dtype=torch.long))
    plan = autopar.plan(model, autopar.Mesh((2,), ("sp",), device="cpu"), (), example_kwargs=kwargs,
                        solve=autopar.SolveOptions(compare=True))
    assert any("ring on 'sp': an explicit attention mask" in n and "self_attn" in n for n in plan.notes), plan.notes
    assert "an explicit attention mask" in plan.baselines["context-parallel"]
    assert not isinstance(plan.baselines["ulysses"], str)


@pytest.mark.parametrize("layout", ["context-parallel", "ulysses", "megatron-sp"])
def test_sliding_window_model_trains_like_one_device(pool2, layout):
    """HF Mistral with an 8-token window on 16 tokens: traced through autopar::window_attention
    (no dense mask), so the ring splits it (each rank's 8 tokens in chunks of 4: blocks
    wholly outside the window skipped) and Ulysses runs the windowed op on whole sequences."""
    spec = ("hf-arch", "mistral")
    plan_dict = plan_for(spec, layout, shape=(2,), names=("sp",))
    plan = autopar.Plan.from_dict(plan_dict)
    windows = [n for n in plan.nodes if n.op == "autopar.window_attention"]
    assert len(windows) == 2
    if layout != "megatron-sp":
        assert {n.split for n in windows} == {("ring",) if layout == "context-parallel" else ("ulysses",)}
    result = pool2.run(train_and_compare, spec, plan_dict)[0]
    assert result["ok"], result


def test_short_sequences_large_batch_split_the_batch():
    """llama3-8b shapes (2 layers), 64 x 8,192 tokens on 8 H100 in bf16: splitting the batch
    costs no communication in attention, so the planner splits no sequence there."""
    model, example = build("llama3-8b", device="meta", n_layers=2, batch=64, seq=8192)
    plan = autopar.plan(model, autopar.Mesh((8,), ("dp",), device="h100"), example, mixed_precision="bf16",
                        solve=autopar.SolveOptions(compare=False))
    assert not _attention_kinds(plan) & {"ring", "ulysses"}
    assert all(n.inputs[0][0] == torch.distributed.tensor.Shard(0) for n in plan.nodes if n.op == ATTENTION)


def test_megatron_sp_closed_form():
    """GPT-2 shapes (2 layers), 8 x 1,024 tokens, tp = 4, bf16: Megatron-SP replaces each
    block's two forward all-reduces of [8, 1024, 768] by a reduce-scatter after the
    row-parallel matmul and an all-gather before the next column-parallel one (plus one
    gather before the output head): 4 reduce-scatters, 5 all-gathers, no all-reduce, each
    of the same bytes as the all-reduce's input, and the activations between the blocks
    at 1/4.  Its norms and residual adds run on a quarter of the tokens, so it computes
    less; on the wire the ring moves the same bytes either way, so on an A100 node it is no
    slower, while on an H100 node NCCL's NVLS all-reduce (NVLink SHARP in the switch) beats
    the ring's reduce-scatter and all-gather per byte, so there it communicates longer."""
    # (the vocabulary padded to 50,304 as nanoGPT pads it: split four ways, 50,257 leaves
    # rows of an odd length, whose GEMMs run on a slow kernel, and the head is then better
    # split by its contraction, which adds an all-reduce of the logits)
    model, example = build("gpt2-124m", device="meta", n_layers=2, batch=8, seq=1024, vocab=50304)
    mesh = autopar.Mesh((4,), ("tp",), device="h100")
    tp = autopar.plan(model, mesh, example, mixed_precision="bf16",
                      solve=autopar.SolveOptions(layout="megatron-tp", compare=False))
    sp = autopar.plan(model, mesh, example, mixed_precision="bf16",
                      solve=autopar.SolveOptions(layout="megatron-sp", compare=False))
    stream = 8 * 1024 * 768 * 2
    params = set(sp.param_placements)

    def stream_moves(plan, embedding=False):
        # forward collectives of the residual stream (weights may be ZeRO-gathered); a
        # vocabulary-split embedding's partial sums apart (embedding=True: only those)
        return sorted((c.kind, c.nbytes) for c in plan.collectives
                      if c.phase == "forward" and c.tensor not in params and c.nbytes >= stream
                      and c.tensor.startswith("embedding") == embedding)

    assert stream_moves(sp) == sorted([("all_gather", stream)] * 5 + [("reduce_scatter", stream)] * 4)
    # (Megatron may split the embedding by vocabulary: one all-reduce of its partial sums,
    # under SP one reduce-scatter, as Megatron's vocabulary-parallel embedding has them)
    assert stream_moves(sp, embedding=True) in ([], [("reduce_scatter", stream)])
    # (Megatron may also gather a hidden-split embedding once, before the first block, or
    # all-reduce a vocabulary-split one's partial sums where they meet the position embedding)
    assert [m for m in stream_moves(tp) if m[0] != "all_gather"] in ([("all_reduce", stream)] * 4,
                                                                     [("all_reduce", stream)] * 5)
    assert stream_moves(tp).count(("all_gather", stream)) <= 1
    def ops(plan):   # (not the parameters': Megatron-SP's norm weights' gradients join buckets and are copied)
        return sum(n.compute_s for n in plan.nodes if n.op != "parameter")
    assert ops(sp) < ops(tp)
    assert sp.predicted.comm_s["tp"] > tp.predicted.comm_s["tp"]
    assert {c.algorithm.split("/")[0] for c in tp.collectives if c.kind == "all_reduce" and c.nbytes >= stream} \
        == {"nvls"}
    assert sp.predicted.memory["activations"] < tp.predicted.memory["activations"]
    ampere = autopar.Mesh((4,), ("tp",), device="a100")
    tp_a, sp_a = (autopar.plan(model, ampere, example, mixed_precision="bf16",
                               solve=autopar.SolveOptions(layout=name, compare=False))
                  for name in ("megatron-tp", "megatron-sp"))
    assert sp_a.predicted.step_s <= tp_a.predicted.step_s
    assert megatron_sp_axes(sp) == ["tp"] and megatron_sp_axes(tp) == []
