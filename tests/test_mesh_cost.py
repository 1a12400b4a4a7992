"""Mesh presets, per-axis links and the cost model's formulas."""
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.cost.prices import collective_time, redistribute
from autopar.mesh import PRESETS

R, P = Replicate(), Partial()


def test_presets_and_inner_axes_inside_a_node():
    for name in ("h100", "a100", "cpu"):
        d = PRESETS[name]
        assert d.peak_flops(torch.bfloat16) > 0 and d.peak_flops(torch.float32) > 0
        assert d.memory > 0 and d.mem_bandwidth > 0 and d.devices_per_node >= 1
        assert d.intra_bandwidth > d.inter_bandwidth
    for name in ("h100", "a100"):  # tensor cores: bf16 far above fp32
        assert PRESETS[name].peak_flops(torch.bfloat16) > 10 * PRESETS[name].peak_flops(torch.float32)
    mesh = autopar.Mesh((8, 8), ("dp", "tp"), device="h100")
    h100 = PRESETS["h100"]
    assert mesh.bandwidth == (h100.inter_bandwidth, h100.intra_bandwidth)   # tp inside a node
    mesh = autopar.Mesh((2, 4), ("dp", "tp"))
    assert mesh.bandwidth == (h100.intra_bandwidth,) * 2                     # all 8 in one node
    mesh = autopar.Mesh((4, 4), ("dp", "tp"), bandwidth=(1e9, 2e9), latency=0.0)
    assert mesh.bandwidth == (1e9, 2e9) and mesh.latency == (0.0, 0.0)
    assert autopar.Mesh((16, 64), ("dp", "tp")).size == 1024


def test_gpu_variants_have_presets_and_the_short_names_are_the_sxm_parts():
    """h100 is the SXM part and a100 the 80 GB one (their plans do not change); the other
    variants differ where their datasheets do: HBM bandwidth and size, and the 500 W HBM2e
    H100's lower compute peak."""
    def same_but_name(a, b):
        return {**PRESETS[a].to_dict(), "name": "", "source": ""} == {**PRESETS[b].to_dict(), "name": "", "source": ""}
    assert same_but_name("h100", "h100-sxm") and same_but_name("a100", "a100-80gb")
    bf16 = {k: PRESETS[k].peak_flops(torch.bfloat16) for k in PRESETS if k != "cpu"}
    assert bf16["h200"] == bf16["h100-sxm"] == pytest.approx(0.75 * 989e12)
    assert bf16["h100-hbm2e-500w"] == pytest.approx(0.75 * 835e12)
    assert bf16["a100-40gb"] == bf16["a100-80gb"] == pytest.approx(0.75 * 312e12)
    hbm = {k: PRESETS[k].mem_bandwidth for k in PRESETS}
    assert hbm["h200"] > hbm["h100-sxm"] > hbm["h100-hbm2e-500w"] > hbm["a100-80gb"] > hbm["a100-40gb"]
    mem = {k: PRESETS[k].memory / 2**30 for k in PRESETS}
    assert (mem["a100-40gb"], mem["a100-80gb"], mem["h100-hbm2e-500w"], mem["h200"]) == (39, 79, 94, 139)
    assert autopar.Mesh((8,), ("dp",), device="h200").device.name == "h200"


def test_bad_meshes_say_what_to_do():
    with pytest.raises(ValueError, match="one name per axis"):
        autopar.Mesh((2, 2), ("dp",))
    with pytest.raises(ValueError, match="presets are"):
        autopar.Mesh(4, "dp", device="tpu9")


def test_alpha_beta_formulas():
    mesh = autopar.Mesh(4, "x", bandwidth=1e9, latency=1e-6)
    launch = mesh.device.launch_latency
    n, b = 4, 8e6
    assert collective_time("all_reduce", b, 0, mesh) == pytest.approx(launch + 2 * (n - 1) * 1e-6 + 2 * (n - 1) / n * b / 1e9)
    assert collective_time("all_gather", b, 0, mesh) == pytest.approx(launch + (n - 1) * 1e-6 + (n - 1) / n * b / 1e9)
    assert collective_time("reduce_scatter", b, 0, mesh) == collective_time("all_gather", b, 0, mesh)


def test_redistribution_paths_over_two_axes():
    """The cost model prices the steps the runtime runs (autopar.cost.redistribution)."""
    mesh = autopar.Mesh((2, 4), ("dp", "tp"), bandwidth=(1e9, 4e9), latency=0.0)
    shape, item = (1024, 1024), 4
    full = math.prod(shape) * item
    launch = mesh.device.launch_latency
    assert redistribute(shape, item, (R, R), (Shard(0), Shard(1)), mesh) == ()       # slicing is free
    steps = redistribute(shape, item, (Shard(0), Shard(0)), (R, R), mesh)
    # nested shards come off innermost first: tp gathers an eighth into a half, then dp
    # gathers the halves into the whole tensor
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [("all_gather", 1, full / 2), ("all_gather", 0, full)]
    # different dims: the slice comes first, so the gather moves a quarter
    steps = redistribute(shape, item, (Shard(0), R), (R, Shard(1)), mesh)
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [("all_gather", 0, full / 4)]
    # one all-reduce call over both axes, priced hierarchically and listed per axis: the
    # fast axis reduce-scatters and all-gathers the whole tensor, the slow one all-reduces
    # a quarter; one launch in all
    steps = redistribute(shape, item, (P, P), (R, R), mesh)
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [("all_reduce", 1, full), ("all_reduce", 0, full / 4)]
    assert steps[0].seconds == pytest.approx(launch + 2 * 0.75 * full / 4e9)
    assert steps[1].seconds == pytest.approx(2 * 0.5 * (full / 4) / 1e9)
    steps = redistribute(shape, item, (Shard(0), R), (Shard(1), R), mesh)
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [("all_to_all", 0, full / 2)]
    assert steps[0].seconds == pytest.approx(launch + 0.5 * (full / 2) / 1e9)
    steps = redistribute(shape, item, (P, R), (Shard(0), R), mesh)
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [("reduce_scatter", 0, full)]


def test_memory_of_model_states_is_16_bytes_per_parameter_in_data_parallel():
    """float32 weights (4) + gradients (4) + Adam's two float32 states (8), all replicated."""
    from autopar.models import build
    model, example = build("mlp", hidden=256, batch=4096, device="meta")
    plan = autopar.plan(model, autopar.Mesh(4, "dp"), example,
                        solve=autopar.SolveOptions(compare=False, layout="data-parallel"))
    n = sum(p.numel() for p in model.parameters())
    assert plan.predicted.memory["params"] == 4 * n
    assert plan.predicted.memory["grads"] == 4 * n
    assert plan.predicted.memory["optimizer"] == 8 * n
