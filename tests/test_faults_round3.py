"""Faults that one rank sees and the others do not (issue 45): a NaN on one rank stops every
rank with NonFiniteError under every layout, the solver's replicated plans included, and
inputs that diverge after the first calls (a per-rank seeded reshuffle at a new epoch) are
caught by the sampled check on every rank, at no collective more where the step's NaN
check already makes one.

The jobs below run on every rank of a WorkerPool (tests/distributed.py).  Each compiles with
timeout=TIMEOUT_S, so a rank left alone in a collective fails the test in seconds instead of
hanging until the pool's own timeout.
"""
from __future__ import annotations

import contextlib
import functools
import math
import re
import time

import pytest
import torch
import torch.distributed as dist
from rt_cases import OPTIM, _loss, build_case, plan_for

import autopar
from autopar.report.plan import Plan
from autopar.runtime.compiled import NonFiniteError
from autopar.runtime.checks.inputs import InputError

GPT = ("autopar", "gpt-tiny", ())
GPT4 = ("autopar", "gpt-tiny", (("n_layers", 4),))   # (two pipeline stages of two blocks)
MESH = ((2, 2), ("dp", "tp"))
TIMEOUT_S = 30
POISONED = "blocks.1.mlp.fc1.weight"


# --- jobs (every rank) -------------------------------------------------------------------------
def _compile(spec: tuple, plan_dict: dict, sample_every: int | None = None, **options):
    """Compile the model of `spec` under `plan_dict`; sample_every: RunOptions'
    check_inputs_every (the period of the sampled input check); options: RunOptions' others."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    if sample_every is not None:
        options["check_inputs_every"] = sample_every
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                         run=autopar.RunOptions(timeout=TIMEOUT_S, **options))
    return cm, args, kwargs


def _holder(cm, name: str) -> int:
    """The last rank holding (a shard of) parameter `name` (a pipeline stage holds some)."""
    told = [None] * dist.get_world_size()
    dist.all_gather_object(told, name.replace(".", "__") in cm.shards)
    return max(r for r, held in enumerate(told) if held)


def nan_on_one_rank(spec: tuple, plan_dict: dict, how: str, name: str = POISONED, sampled: bool = False) -> dict:
    """A good step, then on one rank only (the last holding `name`) either its gradient of
    `name` is made NaN by a hook ("grad": the loss stays finite; "grad no_sync": the same in a
    step under cm.no_sync(), whose gradients are not summed) or one entry of its shard of
    `name` is set to NaN ("param": its loss is NaN too).  Step 2's error on this rank and how
    long it took; then (for "grad") the job goes on: the batch skipped, step 3 on every rank.
    sampled: every call's inputs compared by the sampled check (none whole), so the flag
    rides in its slots."""
    cm, args, kwargs = _compile(spec, plan_dict, 1 if sampled else None, check_inputs=0 if sampled else 3)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    cm.train_step(*args, **kwargs)
    opt.step()
    opt.zero_grad()
    bad = _holder(cm, name)
    key = name.replace(".", "__")
    hook = None
    if dist.get_rank() == bad:
        if how.startswith("grad"):
            hook = cm.shards[key].register_hook(lambda g: g * math.nan)
        else:
            with torch.no_grad():
                cm.shards[key].view(-1)[0] = math.nan
    start = time.perf_counter()
    try:
        with cm.no_sync() if how == "grad no_sync" else contextlib.nullcontext():
            cm.train_step(*args, **kwargs)
        error = ""
    except NonFiniteError as exc:
        error = str(exc)
    out = {"bad": bad, "error": error, "seconds": time.perf_counter() - start}
    if how.startswith("grad"):
        if hook is not None:
            hook.remove()
        opt.zero_grad()
        out["after"] = cm.train_step(*args, **kwargs).item()
    return out


def first_non_finite_on_one_device(spec: tuple, name: str) -> str:
    """The first parameter (in the model's order) whose gradient is not finite on one device
    when `name` is NaN throughout."""
    model, args, kwargs = build_case(spec)
    with torch.no_grad():
        dict(model.named_parameters())[name].fill_(math.nan)
    _loss(model(*args, **kwargs)).backward()
    return next(n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all())


def _batch(seed: int) -> tuple:
    """A gpt-tiny batch (ids, next-token targets) drawn from `seed`."""
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
    return ids, ids.roll(-1, 1)


def diverging_inputs(spec: tuple, plan_dict: dict, sample_every: int, odd_rank: int, calls: tuple,
                     steps: int, how: str = "train_step", local: bool = False, nan: bool = False) -> dict:
    """`steps` calls on a fresh batch each (the same on every rank), except that `odd_rank`
    draws its own batch on the calls in `calls` (a per-rank seeded reshuffle).  how:
    "train_step", or "forward" (cm(*batch) alone).  local: compiled with local_inputs=True,
    each rank passing its shard.  nan: on those calls `odd_rank`'s gradient of POISONED is
    NaN too.  The call that raised and its error, or the losses."""
    cm, _, _ = _compile(spec, plan_dict, sample_every, local_inputs=local)
    losses = []
    for call in range(1, steps + 1):
        odd = dist.get_rank() == odd_rank and call in calls
        batch = _batch(1000 * (dist.get_rank() + 1) + call if odd else call)
        args, kwargs = cm.shard_inputs(*batch) if local else (batch, {})
        hook = cm.shards[POISONED.replace(".", "__")].register_hook(lambda g: g * math.nan) if odd and nan else None
        try:
            loss = cm.train_step(*args, **kwargs) if how == "train_step" else cm(*args, **kwargs)
        except (InputError, NonFiniteError) as exc:
            return {"call": call, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            if hook is not None:
                hook.remove()
        losses.append(loss.item())
    return {"call": None, "error": "", "losses": losses}


@contextlib.contextmanager
def _counting_all_reduces(counts: list):
    """Count torch.distributed.all_reduce calls made inside (the runtime calls it as
    dist.all_reduce, so the module attribute is what it reaches)."""
    real = dist.all_reduce

    def counted(*args, **kwargs):
        counts[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = real


def all_reduces_per_step(spec: tuple, plan_dict: dict, check_finite: bool, sample_every: int) -> list:
    """torch.distributed.all_reduce calls of each of 8 train_steps (calls 1-3 compare whole,
    then every `sample_every`-th call is sampled; 0: none)."""
    cm, args, kwargs = _compile(spec, plan_dict, sample_every, check_finite=check_finite)
    out = []
    for _ in range(8):
        counts = [0]
        with _counting_all_reduces(counts):
            cm.train_step(*args, **kwargs)
        out.append(counts[0])
    return out


# --- plans ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def random_plan(seed: int) -> dict:
    model, args, _ = build_case(GPT)
    return autopar.random_plans(model, autopar.Mesh(*MESH, device="cpu"), args, seeds=(seed,))[0].to_dict()


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def _whole_step_plan(spec: tuple) -> dict:
    """The solver's plan where communication is dear (every call 1 s): each rank computes
    the whole step, every weight whole, no gradient all-reduce and no loss sum, the plan the
    solver once chose for gpt-tiny on 4 CPU ranks before the loss and the position
    embedding's gradient were priced inside the gradient buckets."""
    import dataclasses
    from autopar.mesh import PRESETS
    model, args, _ = build_case(spec)
    device = dataclasses.replace(PRESETS["cpu"], links=(), launch_latency=1.0, intra_latency=1.0, inter_latency=1.0)
    return autopar.plan(model, autopar.Mesh((2, 2), ("dp", "tp"), device=device), args,
                        solve=autopar.SolveOptions(compare=False)).to_dict()


def checked_tensors(spec: tuple, plan_dict: dict) -> dict:
    """After a synchronised step and after one under no_sync: how many tensors the finite
    check reads, against the trained gradients and the step's buckets."""
    from autopar.runtime.grads.norms import local_grads
    cm, args, kwargs = _compile(spec, plan_dict)
    out = {}
    for name, ctx in (("synced", contextlib.nullcontext), ("no_sync", cm.no_sync)):
        with ctx():
            cm.train_step(*args, **kwargs)
        grads = list(local_grads(cm.rank_state))
        pieces = cm.grad_sync.checked_pieces(grads)
        out[name] = {"grads": len(grads), "pieces": len(pieces), "buckets": len(cm.grad_sync.reduced),
                     "elements": sum(p.numel() for p in pieces), "grad_elements": sum(g.numel() for _, g in grads)}
    return out


def layout_plan(layout: str) -> tuple:
    """(spec, plan dict) of a layout name: "solver" (the whole step on every rank,
    _whole_step_plan), "random", "pipeline" or a hand-written one."""
    if layout == "solver":
        return GPT, _whole_step_plan(GPT)
    if layout == "random":
        return GPT, random_plan(5)
    if layout == "pipeline":
        return GPT4, plan_for(GPT4, "megatron-tp", (2, 2), ("pp", "tp"),
                              autopar.Pipeline(axis="pp", groups=2, schedule="1f1b", microbatches=2))
    return GPT, plan_for(GPT, layout)


LAYOUTS = ["solver", "random", "data-parallel", "megatron-tp x dp", "zero2", "zero3", "megatron-sp x dp",
           "ulysses x dp", "context-parallel x dp", "pipeline"]


# --- NaN on one rank -------------------------------------------------------------------------
def test_the_solver_plan_for_gpt_tiny_computes_the_whole_step_on_every_rank():
    """Why the solver's plan was the one that stalled: every weight whole on every rank, no
    gradient all-reduce and no loss sum (each rank computes the whole batch; ZeRO-1 splits
    only the optimizer state), so a NaN on one rank is seen by that rank alone."""
    plan = Plan.from_dict(layout_plan("solver")[1])
    assert all(all(p.is_replicate() for p in placements) for placements in plan.param_placements.values())
    assert not plan.collectives_of(kind="all_reduce", phase="backward")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_gradient_on_one_rank_stops_every_rank(pool4, layout):
    """One rank's gradient of blocks.1.mlp.fc1.weight made NaN (its loss finite): every rank
    raises NonFiniteError at step 2 naming that parameter and the rank, within seconds (it
    used to leave the rank alone in a collective until the timeout under the solver's plan);
    the batch skipped, step 3 trains on and gives every rank the same loss."""
    spec, plan = layout_plan(layout)
    results = pool4.run(nan_on_one_rank, spec, plan, "grad")
    bad = results[0]["bad"]
    for r in results:
        assert r["error"].startswith("step 2: the loss is "), (layout, r)
        assert f"the first parameter with a non-finite gradient is {POISONED!r}" in r["error"], (layout, r)
        seen = re.search(r"non-finite values seen on rank\(s\) ([\d, ]+) of 4", r["error"])
        assert seen and str(bad) in seen.group(1).split(", "), (layout, r)
        assert r["seconds"] < 5, (layout, r)
        assert math.isfinite(r["after"]) and r["after"] == results[0]["after"], (layout, r)


@pytest.mark.parametrize("layout", ["solver", "megatron-tp x dp", "random"])
def test_a_nan_weight_on_one_rank_stops_every_rank(pool4, layout):
    """One entry of one rank's shard of blocks.1.mlp.fc1.weight set to NaN: every rank names
    step 2 and the first parameter whose gradient one device finds non-finite with that
    weight NaN; under the solver's replicated plan the loss is NaN on that rank alone, and
    the message says so on every rank.  (The random draw, seed 5, stores the weight split
    over tp and gathers it whole for the matmul: the NaN reaches every rank of the bad
    rank's tp group.  A draw may also leave the poisoned entry unread: seed 3 now runs the
    layer as SUMMA, whose rank reads only its block of the replicated weight, and the next
    ZeRO-2 step overwrites the unread copy; nothing is wrong then, and nothing is raised.)"""
    spec, plan = layout_plan(layout)
    results = pool4.run(nan_on_one_rank, spec, plan, "param")
    first = first_non_finite_on_one_device(spec, POISONED)
    for r in results:
        assert r["error"].startswith("step 2: the loss is "), (layout, r)
        if layout != "random":
            assert r["error"].startswith("step 2: the loss is not finite on rank(s) "), (layout, r)
        assert f"the first parameter with a non-finite gradient is {first!r}" in r["error"], (layout, r)
        assert r["seconds"] < 5, (layout, r)
    assert len({r["error"] for r in results}) == 1
    if layout == "solver":
        assert f"the loss is not finite on rank(s) {results[0]['bad']} and" in results[0]["error"]


def test_a_nan_gradient_on_one_rank_under_no_sync_stops_every_rank(pool4):
    """Data parallelism needs no collective for the check when gradients are summed; inside
    cm.no_sync() they are not, so one rank's NaN gradient is its own: every rank still
    raises, naming it."""
    spec, plan = layout_plan("data-parallel")
    results = pool4.run(nan_on_one_rank, spec, plan, "grad no_sync")
    for r in results:
        assert r["error"].startswith("step 2: the loss is "), r
        assert f"is {POISONED!r} (non-finite values seen on rank(s) {results[0]['bad']} of 4)" in r["error"], r
        assert r["after"] == results[0]["after"], r


@pytest.mark.parametrize("layout", ["solver", "data-parallel"])
def test_a_nan_on_a_sampled_call_is_still_caught(pool4, layout):
    """Every call sampled by the input check (whose slots then carry the NaN flag): the same
    NonFiniteError on every rank, and no InputError (the inputs agree)."""
    spec, plan = layout_plan(layout)
    results = pool4.run(nan_on_one_rank, spec, plan, "grad", POISONED, True)
    for r in results:
        assert r["error"].startswith("step 2: the loss is "), (layout, r)
        assert f"the first parameter with a non-finite gradient is {POISONED!r}" in r["error"], (layout, r)
        assert r["after"] == results[0]["after"], (layout, r)


def test_the_finite_check_all_reduces_only_where_a_rank_can_see_alone(pool4):
    """all_reduce calls per step: under data parallelism the loss and every gradient are
    summed over all ranks, so the check adds none (as many with it as without); under the
    solver's replicated plan nothing is summed, so it adds exactly one."""
    for layout, extra in (("data-parallel", 0), ("solver", 1)):
        spec, plan = layout_plan(layout)
        on = pool4.run(all_reduces_per_step, spec, plan, True, 0)[0]
        off = pool4.run(all_reduces_per_step, spec, plan, False, 0)[0]
        assert [a - b for a, b in zip(on, off)] == [extra] * 8, (layout, on, off)


# --- inputs that diverge after the first calls ----------------------------------------------
def _assert_caught(results: list, call: int, odd: int, local: bool = False) -> None:
    for r in results:
        assert r["call"] == call and r["error"].startswith("InputError: "), r
        assert f"on call {call}" in r["error"] and "'idx'" in r["error"], r
        assert "passed the same inputs for the first 3 calls" in r["error"], r
        if local:
            assert re.search(rf"ranks \d and {odd} hold the same piece of input 'idx'", r["error"]), r
        else:
            assert f"rank {odd} passed a different input 'idx' than rank 0" in r["error"], r
            assert "local_inputs=True" in r["error"], r
    assert len({r["error"] for r in results}) == 1


@pytest.mark.parametrize("layout,sample_every,odd,calls,caught", [
    ("megatron-tp x dp", 5, 1, range(5, 13), 5),   # tp partners differ from call 5 (a new epoch)
    ("solver", 4, 2, range(6, 13), 8),             # from call 6: the next sampled call, 8
    ("data-parallel", 4, 3, (12,), 12),            # one later sampled call only
    ("pipeline", 5, 1, range(5, 13), 5),
])
def test_inputs_diverging_after_the_first_calls_are_caught_on_every_rank(pool4, layout, sample_every, odd,
                                                                           calls, caught):
    """A rank draws its own batches from a later call on: the first sampled call among them
    raises InputError on every rank, naming the call, the input, the rank and
    local_inputs=True (it used to train on silently, replicas apart)."""
    spec, plan = layout_plan(layout)
    results = pool4.run(diverging_inputs, spec, plan, sample_every, odd, tuple(calls), 12)
    _assert_caught(results, caught, odd)


def test_diverging_inputs_are_named_before_the_nan_they_cause(pool4):
    """A rank passes its own batch on sampled call 8, and its gradient there is NaN: the
    flag carried in the slots hides whether the inputs agree, so the ranks compare them whole
    and raise the InputError (the cause) on every rank rather than the NonFiniteError.  On
    call 7, which is not sampled, the same fault is seen as the NonFiniteError alone."""
    spec, plan = layout_plan("solver")
    _assert_caught(pool4.run(diverging_inputs, spec, plan, 4, 2, (8,), 12, "train_step", False, True), 8, 2)
    nan_only = pool4.run(diverging_inputs, spec, plan, 4, 2, (7,), 12, "train_step", False, True)
    assert all(r["call"] == 7 and r["error"].startswith("NonFiniteError: step 7") for r in nan_only), nan_only


def test_diverging_inputs_to_forward_and_local_shards_are_caught(pool4):
    """The same from forward alone (cm(*batch), its own small all-reduce at the door), and
    with local_inputs=True where two tensor-parallel partners hold the same piece of the
    batch but pass different data."""
    spec, plan = layout_plan("megatron-tp x dp")
    _assert_caught(pool4.run(diverging_inputs, spec, plan, 5, 1, tuple(range(5, 13)), 12, "forward"), 5, 1)
    _assert_caught(pool4.run(diverging_inputs, spec, plan, 5, 1, tuple(range(5, 13)), 12, "train_step", True),
                   5, 1, local=True)


@pytest.mark.parametrize("layout,local", [("solver", False), ("data-parallel", False), ("megatron-tp x dp", False),
                                          ("megatron-tp x dp", True), ("pipeline", False)])
def test_identical_inputs_never_raise(pool4, layout, local):
    """Every call sampled (sample_every=1), 12 fresh batches the same on every rank: no error,
    and every rank reports the same 12 losses."""
    spec, plan = layout_plan(layout)
    results = pool4.run(diverging_inputs, spec, plan, 1, 0, (), 12, "train_step", local)
    assert all(r["error"] == "" and len(r["losses"]) == 12 for r in results), results
    assert len({tuple(r["losses"]) for r in results}) == 1


def test_the_sampled_check_rides_in_the_finite_check_all_reduce(pool4):
    """all_reduce calls per step with every call from the 4th sampled, against none sampled:
    where the NaN check all-reduces anyway (Megatron x DP, the solver's plan) the same number;
    under data parallelism, where it makes none, one more on each sampled step only."""
    for layout, extra in (("megatron-tp x dp", 0), ("solver", 0), ("data-parallel", 1)):
        spec, plan = layout_plan(layout)
        sampled = pool4.run(all_reduces_per_step, spec, plan, True, 1)[0]
        plain = pool4.run(all_reduces_per_step, spec, plan, True, 0)[0]
        assert [a - b for a, b in zip(sampled, plain)] == [0, 0, 0] + [extra] * 5, (layout, sampled, plain)
    spec, plan = layout_plan("data-parallel")
    every4 = pool4.run(all_reduces_per_step, spec, plan, True, 4)[0]
    plain = pool4.run(all_reduces_per_step, spec, plan, True, 0)[0]
    assert [a - b for a, b in zip(every4, plain)] == [0, 0, 0, 1, 0, 0, 0, 1]


def test_a_failed_wait_on_an_asynchronous_collective_is_named():
    """A peer gone while a rank waits on an asynchronous collective's Work (a ZeRO-2 bucket's
    reduce-scatter) fails inside Work.wait(), with no Python frame inside torch: the error
    names the wait and the autopar code that waited."""
    from autopar.runtime.checks.faults import _collective_of

    def reduce_scatter_finish():
        raise RuntimeError("Connection reset by peer")
    try:
        reduce_scatter_finish()
    except RuntimeError as exc:
        named = _collective_of(exc)
    assert named.startswith("torch.distributed.Work.wait() on an asynchronous collective in reduce_scatter_finish ("), named


def test_the_finite_check_reads_each_bucket_whole(pool4):
    """Under data parallelism the finite check reads each all-reduced bucket's flat buffer
    (the loss rides at the end of the last) rather than every gradient: one norm per bucket
    (on CPU ranks torch's foreach norm runs a kernel per tensor); under no_sync, where
    nothing is bucketed, every gradient."""
    spec, plan = layout_plan("data-parallel")
    for r in pool4.run(checked_tensors, spec, plan):
        synced, alone = r["synced"], r["no_sync"]
        assert 0 < synced["buckets"] == synced["pieces"] < synced["grads"], r
        assert synced["elements"] == synced["grad_elements"] + 1, r   # (+ the loss)
        assert alone["pieces"] == alone["grads"] == synced["grads"], r
