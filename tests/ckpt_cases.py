"""Jobs for the checkpoint and fault tests, run on every rank of a WorkerPool
(tests/distributed.py): resuming through a chain of plans and meshes, checkpoints that do
not fit, non-finite steps."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rt_cases import OPTIM, _loss, build_case, excess, reference

import autopar
import autopar.checkpoint
from autopar.report.plan import Plan
from autopar.runtime.compiled import NonFiniteError


def resume_through_plans(spec: tuple, plan_dicts: list, path: str) -> dict:
    """One AdamW step under each plan in turn, each compiled afresh and resumed from the
    checkpoint the one before saved: hops alternate between the bare torch.distributed.checkpoint
    pattern with the optimizer's own state_dict() and autopar.checkpoint.save / load.  The
    losses and final parameters against as many uninterrupted steps on one device."""
    steps = len(plan_dicts)
    losses, _, params, _ = reference(spec, steps)
    seen, infos = [], []
    cm = None
    for k, plan_dict in enumerate(plan_dicts):
        plan = Plan.from_dict(plan_dict)
        model, args, kwargs = build_case(spec)
        cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
        opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
        if k:
            where = f"{path}/{k - 1}"
            if k % 2:
                state = {"model": cm.state_dict(), "optim": opt.state_dict()}
                dcp.load(state, checkpoint_id=where)
                cm.load_state_dict(state["model"])
                opt.load_state_dict(state["optim"])
            else:
                infos.append(autopar.checkpoint.load(where, cm, opt)["step"])
        seen.append(cm.train_step(*args, **kwargs).item())
        opt.step()
        opt.zero_grad()
        if k % 2 == 0:
            dcp.save({"model": cm.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{path}/{k}")
        else:
            autopar.checkpoint.save(f"{path}/{k}", cm, opt, step=k + 1)
    full = cm.full_state_dict()
    return {"param": max(excess(full[n], params[n]) for n in params),
            "loss": max(abs(a - b) - 1e-6 - 1e-5 * abs(b) for a, b in zip(seen, losses)),
            "steps_read": infos, "losses": seen}


def load_mismatch(spec: tuple, plan_dict: dict, other_spec: tuple, path: str, optimizer: bool = True) -> str:
    """Save `spec`'s model with autopar.checkpoint, load into `other_spec`'s model: the error."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    autopar.checkpoint.save(path, cm, cm.build_optimizer(torch.optim.AdamW, **OPTIM) if optimizer else None,
                            step=1)
    other, args2, kwargs2 = build_case(other_spec)
    plan2 = autopar.plan(other, plan.mesh, args2, example_kwargs=kwargs2 or None,
                         solve=autopar.SolveOptions(compare=False))
    cm2 = autopar.compile(other, plan2.device_mesh(), args2, example_kwargs=kwargs2 or None, plan=plan2)
    try:
        autopar.checkpoint.load(path, cm2, cm2.build_optimizer(torch.optim.AdamW, **OPTIM))
    except autopar.checkpoint.CheckpointError as exc:
        return str(exc)
    return ""


def rng_round_trip(spec: tuple, plan_dict: dict, path: str) -> dict:
    """The RNG states autopar.checkpoint.save stored come back on load: the random numbers
    drawn after save equal those drawn after load."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    torch.manual_seed(100 + dist.get_rank())
    autopar.checkpoint.save(path, cm, None, step=7, extra={"epoch": 3})
    after_save = torch.rand(3)
    torch.manual_seed(0)
    info = autopar.checkpoint.load(path, cm)
    after_load = torch.rand(3)
    return {"same": bool(torch.equal(after_save, after_load)), "step": info["step"], "extra": info["extra"],
            "plan_hash": Plan.from_dict(info["plan"]).hash() == plan.hash()}


def non_finite_step(spec: tuple, plan_dict: dict, poison: str, check: bool = True, via: str = "train_step") -> dict:
    """Two good steps, then `poison` (a parameter name) gets an infinite entry: the third
    train_step's error on this rank, and the first parameter (in the model's order) whose
    gradient one device finds non-finite on the same weights."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                         run=autopar.RunOptions(check_finite=check))
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    for _ in range(2):
        cm.train_step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
    full = cm.full_state_dict()
    full[poison] = full[poison].clone()
    full[poison].view(-1)[0] = math.inf
    cm.load_full_state_dict(full)
    plain, _, _ = build_case(spec)
    plain.load_state_dict(full)
    _loss(plain(*args, **kwargs)).backward()
    first = next((n for n, p in plain.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()),
                 None)
    try:
        if via == "train_step":
            loss = cm.train_step(*args, **kwargs)
        else:   # two accumulated micro-steps: the one under no_sync is not checked, the last is
            with cm.no_sync():
                cm.backward(_loss(cm(*args, **kwargs)) / 2)
            loss = _loss(cm(*args, **kwargs)) / 2
            cm.backward(loss)
    except NonFiniteError as exc:
        return {"error": str(exc), "first": first}
    return {"error": "", "loss": float(loss.item()), "first": first}


def mixed_precision_round_trip(spec: tuple, plan_dict: dict, other_dict: dict, path: str) -> dict:
    """One bf16 AdamW step under `plan_dict`, autopar.checkpoint.save, load under `other_dict`
    (another layout, also bf16): the float32 master weights and the AdamW moments come back
    bit for bit (their whole values compared), and the compute weights are their bf16 casts."""
    plan, other = Plan.from_dict(plan_dict), Plan.from_dict(other_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    cm.train_step(*args, **kwargs)
    opt.step()
    opt.zero_grad()
    masters = cm.full_state_dict(master=True)
    moments = {n: s["exp_avg_sq"].full_tensor() for n, s in opt.state_dict()["state"].items()}
    autopar.checkpoint.save(path, cm, opt, step=1)
    fresh, _, _ = build_case(spec)
    cm2 = autopar.compile(fresh, other.device_mesh(), args, example_kwargs=kwargs or None, plan=other)
    opt2 = cm2.build_optimizer(torch.optim.AdamW, **OPTIM)
    autopar.checkpoint.load(path, cm2, opt2)
    back = cm2.full_state_dict(master=True)
    compute = cm2.full_state_dict()
    moments2 = {n: s["exp_avg_sq"].full_tensor() for n, s in opt2.state_dict()["state"].items()}
    return {"masters": max(float((back[n] - masters[n]).abs().max()) for n in masters),
            "moments": max(float((moments2[n] - moments[n]).abs().max()) for n in moments),
            "compute": max(float((compute[n].float() - masters[n].bfloat16().float()).abs().max())
                           for n in masters if compute[n].is_floating_point()),
            "dtypes": sorted({str(p.dtype) for p in cm2.shards.values()}), "moved": bool(moments)}


def batch_check_window(spec: tuple, plan_dict: dict, check_inputs: int, differ_at: int) -> str:
    """compile(check_inputs=n); rank 1 passes another batch on call `differ_at` (1-based):
    the error, or '' when no rank noticed."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan,
                         run=autopar.RunOptions(check_inputs=check_inputs))
    try:
        for call in range(1, differ_at + 1):
            mine = args
            if call == differ_at and dist.get_rank() == 1:
                mine = tuple(a.roll(1, 0) if isinstance(a, torch.Tensor) else a for a in args)
            cm.train_step(*mine, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    return ""


def _raised(fn) -> str:
    """The CheckpointError fn() raises here, as text ('' where it returns)."""
    try:
        fn()
    except autopar.checkpoint.CheckpointError as exc:
        return str(exc)
    return ""


def failed_saves(spec: tuple, plan_dict: dict, root: str) -> dict:
    """Saves that fail never block a resume: an `extra` JSON cannot hold is refused on every
    rank before a shard is written; a record rank 0 cannot write (a full disk) fails the
    save on every rank, naming rank 0; a stale `*.partial` with a truncated record and a
    complete save whose record was damaged later are passed over by latest(); load(None)
    (a first run) says there is nothing to resume; a flipped byte in a shard is found."""
    import os
    import warnings
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    rank = dist.get_rank()
    out = {"first_run": _raised(lambda: autopar.checkpoint.load(autopar.checkpoint.latest(root), cm, opt))}
    autopar.checkpoint.save(f"{root}/step1", cm, opt, step=1)
    out["bad_extra"] = _raised(lambda: autopar.checkpoint.save(f"{root}/step2", cm, opt, step=2,
                                                                  extra={"lr": torch.tensor(0.1)}))
    out["left_behind"] = sorted(os.listdir(root))
    replace = os.replace

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    if rank == 0:
        os.replace = full_disk
    try:
        out["full_disk"] = _raised(lambda: autopar.checkpoint.save(f"{root}/step3", cm, opt, step=3))
    finally:
        os.replace = replace
    dist.barrier()
    if rank == 0:   # a save killed while rank 0 wrote its record, and a record damaged later
        os.makedirs(f"{root}/step4.partial", exist_ok=True)
        with open(f"{root}/step4.partial/autopar.json", "w") as f:
            f.write('{"format": 2, "step": 4, "ext')
    dist.barrier()
    autopar.checkpoint.save(f"{root}/step5", cm, opt, step=5)
    if rank == 0:
        with open(f"{root}/step5/autopar.json", "w") as f:
            f.write('{"format": 2, "st')
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["latest"] = os.path.basename(autopar.checkpoint.latest(root))
    out["warned"] = [str(w.message) for w in caught]
    out["damaged_record"] = _raised(lambda: autopar.checkpoint.load(f"{root}/step5", cm, opt))
    out["loads"] = autopar.checkpoint.load(f"{root}/step1", cm, opt)["step"]
    dist.barrier()
    if rank == 0:
        shard = sorted(n for n in os.listdir(f"{root}/step1") if n.endswith(".distcp"))[-1]
        with open(f"{root}/step1/{shard}", "r+b") as f:
            f.seek(os.path.getsize(f"{root}/step1/{shard}") // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    out["flipped"] = _raised(lambda: autopar.checkpoint.load(f"{root}/step1", cm, opt))
    return out


def stalled_optimizer_step(spec: tuple, plan_dict: dict) -> dict:
    """A ZeRO gather after the optimizer's update that fails as a stalled peer makes it fail
    (the backend's timeout, raised where the gather waits): the error names the optimizer
    step; an LR scheduler over the same optimizer steps as usual."""
    import warnings
    from autopar.runtime.checks.faults import CollectiveError
    from autopar.runtime.state import sharded_optimizer
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    cm.train_step(*args, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        sched.step()
    out = {"lr": opt.param_groups[0]["lr"], "warned": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]}
    cm.train_step(*args, **kwargs)
    gather = sharded_optimizer.all_gather_chunks

    def stalled(*a, **k):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 600000ms for recv operation")
    sharded_optimizer.all_gather_chunks = stalled
    try:
        opt.step()
        out["error"] = ""
    except CollectiveError as exc:
        out["error"] = str(exc)
    finally:
        sharded_optimizer.all_gather_chunks = gather
    return out
