"""Pipeline stage search (autopar.pipeline.search via autopar.plan(pipeline=True))."""
from __future__ import annotations

import time

import pytest
from torch.distributed.tensor import Shard

import autopar
from autopar.models import build
from autopar.pipeline.search import _balanced_cuts


def test_balanced_cuts_minimise_the_slowest_stage():
    assert _balanced_cuts([1.0] * 8, 4, 0.0, 0.0) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # a heavy prefix (embedding) pushes layers away from the first stage
    assert _balanced_cuts([1.0] * 6, 2, 2.0, 0.0) == [(0, 2), (2, 6)]
    assert _balanced_cuts([5.0, 1.0, 1.0, 1.0], 2, 0.0, 0.0) == [(0, 1), (1, 4)]


@pytest.fixture(scope="module")
def slow_network_plan():
    """gpt2-1.5b on 8 nodes x 8 H100s whose network between nodes is slow (2.5 GB/s)."""
    model, example = build("gpt2-1.5b", device="meta", batch=16)
    mesh = autopar.Mesh((8, 8), ("node", "gpu"), device="h100", bandwidth=(2.5e9, 450e9))
    start = time.perf_counter()
    plan = autopar.plan(model, mesh, example, compare=False, pipeline=True)
    return plan, time.perf_counter() - start


def test_slow_network_gets_stages_across_nodes_and_tensor_parallelism_inside(slow_network_plan):
    plan, _ = slow_network_plan
    pp = plan.pipeline
    assert pp["axis"] == "node" and pp["groups"] > 1            # stages across nodes
    assert pp["submesh"][1] == 8                                # each stage keeps the whole node
    assert pp["step_s"] < pp["no_pipeline_step_s"]
    assert sum(b - a for a, b in pp["stages"]) == 48 and pp["stages"][0][0] == 0
    gpu = plan.mesh["axis_names"].index("gpu")
    matrices = [n for n, pl in plan.param_placements.items() if n.startswith("blocks.") and n.endswith("weight")
                and isinstance(pl[gpu], Shard)]
    assert len(matrices) >= 4 * 48 * 0.9, matrices[:5]           # q/k/v/o/fc1/fc2 split on gpu: TP in the node


def test_fast_uniform_network_and_small_model_use_no_pipeline():
    model, example = build("gpt2-124m", device="meta", batch=8)
    mesh = autopar.Mesh((8,), ("dp",), device="h100", bandwidth=450e9)
    plan = autopar.plan(model, mesh, example, compare=False, pipeline=True)
    assert plan.pipeline["axis"] is None
    assert plan.mesh["shape"] == [8]


def test_pipeline_plans_round_trip_and_do_not_compile_yet(slow_network_plan, tmp_path):
    plan, _ = slow_network_plan
    path = tmp_path / "pp.json"
    plan.save(path)
    assert autopar.Plan.load(path) == plan
    assert "stages over node" in str(plan)
