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


def non_finite_step(spec: tuple, plan_dict: dict, poison: str, check: bool = True) -> dict:
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
        loss = cm.train_step(*args, **kwargs)
    except NonFiniteError as exc:
        return {"error": str(exc), "first": first}
    return {"error": "", "loss": loss.item(), "first": first}


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
