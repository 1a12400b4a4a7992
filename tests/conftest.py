"""Shared fixtures: `pool4` and `pool2`, gloo worker pools kept for the whole session.

A pool starts on the first test that asks for it and stops when the session ends; see
tests/distributed.py for what a job may be.
"""
import os
import sys
import tempfile

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from distributed import WorkerPool  # noqa: E402

# Plans that keep optimizer states on disk (random plans draw them) write under one
# directory for the session; the workers inherit it.
os.environ.setdefault("AUTOPAR_OFFLOAD_DIR", tempfile.mkdtemp(prefix="autopar-offload-tests-"))


def _pool_fixture(world_size: int):
    @pytest.fixture(scope="session")
    def pool():
        p = WorkerPool(world_size)
        try:
            yield p
        finally:
            p.close()

    pool.__doc__ = f"A WorkerPool of {world_size} gloo ranks, started on first use."
    return pool


pool4 = _pool_fixture(4)
pool2 = _pool_fixture(2)


@pytest.fixture(scope="module")
def pool8():
    """A WorkerPool of 8 gloo ranks for one test module (3-D layouts), closed after it."""
    p = WorkerPool(8)
    try:
        yield p
    finally:
        p.close()


# --- two tiers ------------------------------------------------------------------------------
# The README's test command runs the fast tier (pyproject's addopts deselect `slow`);
# `pytest -m slow` runs the rest: whole tests listed in SLOW, and of each sweep in SAMPLED
# all but a fixed-seed sample of its cases (the sample stays in the fast tier, so every
# sweep keeps some cases there, and which ones does not change from run to run).
SLOW = {
    "test_launch.py",                                                   # torchrun launches and restarts
    "test_redistribution_plan.py::test_every_pair_on_a_2x2x2_mesh",
    "test_planner_zero.py::test_a_budget_below_the_minimum_names_the_minimum_and_the_fixes",
    "test_training_loop.py::test_repeated_planning_does_not_grow_memory",
    "test_user_models.py::test_deepseek_v3_latent_attention_and_grouped_router",
    "test_hf_models.py::test_llama4_router_and_dense_experts_train_like_one_device",
    "test_hf_models.py::test_mamba_plans_per_distinct_block_and_trains_like_one_device",
    "test_inductor.py::test_inductor_with_recomputation",
    "test_recompute.py::test_recompute_bounds_hold_from_the_keep_everything_reserve",   # 32 s
    "test_inductor.py::test_eval_and_train_switch_the_compiled_graph",
    "test_inductor.py::test_inductor_runs_pipeline_stages",
    "test_inductor.py::test_zero_bubble_under_inductor_is_refused",
    "test_inductor.py::test_inductor_mixed_precision_equals_one_device",
    "test_inductor.py::test_inductor_frozen_parameters_and_clipping",
    "test_inductor.py::test_inductor_accumulation_under_no_sync",
    "test_inductor.py::test_inductor_checkpoints_round_trip",
    "test_inductor.py::test_inductor_keeps_the_planned_saved_bytes",
    "test_gpu_check.py::test_backends_section_steps_three_ways",
    "test_inductor.py::test_inductor_batch_norm_trains_and_keeps_its_statistics",
    "test_grouped_experts.py::test_jetmoe_trains_like_one_device",          # 15-25 s
    "test_hf_models.py::test_phimoe_router_noise_is_planned_and_trains",
    "test_capacity_experts.py::test_switch_trains_like_one_device",             # 12 s a layout
    "test_pipeline_search.py::test_search_does_not_pick_zbv_with_too_few_microbatches",
    "test_pipeline_runtime.py::test_newer_schedules_on_hugging_face_families",
    "test_pipeline_runtime.py::test_own_schedules_on_attention_as_users_write_it",
    "test_planner_3axis.py::test_hand_written_layouts_plan_on_three_axes",     # 16 s
}
SAMPLED = {   # test -> cases kept in the fast tier
    "test_runtime.py::test_training_matches_one_device": 1,
    "test_semantics.py::test_frozen_parameters_stay_frozen": 1,
    "test_hf_models.py::test_family_trains_like_one_device": 4,
    "test_hf_models.py::test_mixture_of_experts_trains_like_one_device": 1,
    "test_hf_models.py::test_further_moe_families_train_like_one_device": 1,
    "test_hf_models.py::test_further_moe_families_shard_their_experts": 3,
    "test_hf_models.py::test_megatron_meets_its_closed_form": 6,
    "test_pipeline_runtime.py::test_every_schedule_trains_like_one_device": 2,
    "test_pipeline_flushless.py::test_stale_weights_train_like_the_reference_rule": 2,
    "test_pipeline_runtime.py::test_three_dimensional_layouts_train_like_one_device": 1,
    "test_recompute.py::test_recomputed_training_matches_one_device": 4,
    "test_recompute.py::test_predicted_activations_match_saved_bytes": 2,
    "test_experts_routing.py::test_routing_that_leaves_experts_idle_trains_like_one_device": 3,
    "test_unroll.py::test_unrolled_graph_is_the_full_export": 6,
    "test_rebatch.py::test_written_trace_is_the_export": 6,
    "test_pipeline_measured.py::test_measured_bubble_matches_simulator": 1,
    "test_pipeline_search.py::test_search_never_loses_to_the_plain_plan": 2,
    "test_faults_round3.py::test_a_nan_gradient_on_one_rank_stops_every_rank": 5,
    "test_sequence_parallel.py::test_sequence_layouts_train_like_one_device": 5,
    "test_planner_3axis.py::test_presolve_equals_full_ilp_on_random_graphs": 10,
    "test_user_models.py::test_user_attention_trains_like_one_device": 1,
    "test_grouped_experts.py::test_sorted_moe_trains_like_one_device": 1,
    "test_capacity_experts.py::test_fixed_capacity_dispatch_trains_like_one_device": 1,
    "test_inductor.py::test_inductor_trains_like_one_device": 1,
}


def pytest_collection_modifyitems(config, items):
    import random

    by_sweep: dict = {}
    for item in items:
        test = f"{item.path.name}::{item.originalname}"
        if item.path.name in SLOW or test in SLOW:
            item.add_marker(pytest.mark.slow)
        elif test in SAMPLED:
            by_sweep.setdefault(test, []).append(item)
    for test, cases in by_sweep.items():
        kept = set(random.Random(test).sample(range(len(cases)), min(SAMPLED[test], len(cases))))
        for k, item in enumerate(cases):
            if k not in kept:
                item.add_marker(pytest.mark.slow)
