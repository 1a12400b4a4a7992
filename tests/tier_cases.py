"""Jobs for the memory-tier tests (tests/test_memory_tiers.py), run on every rank of a
WorkerPool: plans that keep optimizer states on disk, trained, checkpointed, resumed and
measured."""
from __future__ import annotations

import copy
import os

import torch

import autopar
from autopar.report.plan import Plan
from rt_cases import OPTIM, build_case


def with_tier(plan_dict: dict, tier: str) -> dict:
    """`plan_dict` with every offloaded parameter's states moved to `tier` ("" keeps them
    on the device): the same layouts, so the same arithmetic."""
    out = copy.deepcopy(plan_dict)
    for state in out["param_states"].values():
        if state["offload"]:
            state["offload"] = tier
            if not tier:
                state.pop("weights", None)   # (the stored shard back on the device too)
    return out


def _train(cm, opt, args, kwargs, steps: int) -> list:
    losses = []
    for _ in range(steps):
        losses.append(cm.train_step(*args, **kwargs).item())
        opt.step()
        opt.zero_grad()
    return losses


def resume_bitwise(spec: tuple, plan_dict: dict, other_dict: dict, path: str, steps: int = 3) -> dict:
    """`steps` AdamW steps under `plan_dict` without a break; and one step under it, model
    and optimizer saved with torch.distributed.checkpoint, loaded under `other_dict`, the
    rest there.  The largest difference between the two runs' losses and final weights
    (0: bit for bit), and the disk tier's bytes each compiled model reported."""
    import torch.distributed.checkpoint as dcp
    plan, other = Plan.from_dict(plan_dict), Plan.from_dict(other_dict)
    model, args, kwargs = build_case(spec)
    straight = autopar.compile(copy.deepcopy(model), plan.device_mesh(), args, example_kwargs=kwargs or None,
                               plan=plan)
    opt = straight.build_optimizer(torch.optim.AdamW, **OPTIM)
    want = _train(straight, opt, args, kwargs, steps)
    want_state = straight.full_state_dict()
    cm = autopar.compile(copy.deepcopy(model), plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    seen = _train(cm, opt, args, kwargs, 1)
    disk = [cm.memory_report()["measured"]["disk"]]
    dcp.save({"model": cm.state_dict(), "optim": cm.optimizer_state_dict(opt)}, checkpoint_id=path)
    cm2 = autopar.compile(copy.deepcopy(model), other.device_mesh(), args, example_kwargs=kwargs or None,
                          plan=other)
    opt2 = cm2.build_optimizer(torch.optim.AdamW, **OPTIM)
    state = {"model": cm2.state_dict(), "optim": cm2.optimizer_state_dict(opt2)}
    dcp.load(state, checkpoint_id=path)
    cm2.load_state_dict(state["model"])
    cm2.load_optimizer_state_dict(opt2, state["optim"])
    seen += _train(cm2, opt2, args, kwargs, steps - 1)
    disk.append(cm2.memory_report()["measured"]["disk"])
    got = cm2.full_state_dict()
    return {"loss": max(abs(a - b) for a, b in zip(seen, want)),
            "param": max(float((got[n].float() - want_state[n].float()).abs().max()) for n in want_state),
            "disk": disk}


def disk_capacity(spec: tuple, plan_dict: dict, steps: int = 2) -> dict:
    """Train `steps` steps under `plan_dict` (states on disk) and under the same plan with
    them in host memory; both runs' losses, the runtime's accounting after the last step
    (memory_report), the bytes the last step saved for backward (measure_saved) and the
    disk store's traffic."""
    from autopar.runtime.regions.recompute import measure_saved
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    out = {}
    for name, d in (("disk", plan_dict), ("host", with_tier(plan_dict, "host"))):
        p = Plan.from_dict(d)
        cm = autopar.compile(copy.deepcopy(model), p.device_mesh(), args, example_kwargs=kwargs or None, plan=p)
        opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
        losses = _train(cm, opt, args, kwargs, steps - 1)
        saved = measure_saved(cm, *args, **kwargs)
        losses.append(None)
        opt.step()
        report = cm.memory_report()
        opt.zero_grad()
        store = cm.rank_state.disk
        out[name] = {"losses": losses[:-1], "saved": saved, "measured": report["measured"],
                     "counts": cm.gather_counts(),
                     "files": sorted(os.listdir(store.directory)) if store is not None else [],
                     "read": store.read_bytes if store is not None else 0,
                     "written": store.written_bytes if store is not None else 0,
                     "directory": str(store.directory) if store is not None else None}
        if name == "disk":
            out["final_loss_disk"] = cm.train_step(*args, **kwargs).item()
        else:
            out["final_loss_host"] = cm.train_step(*args, **kwargs).item()
    out["predicted"] = plan.predicted.tiers
    return out


def disk_errors(spec: tuple, plan_dict: dict, blocked: str) -> dict:
    """compile's errors for a disk plan: with no offload_dir (and no AUTOPAR_OFFLOAD_DIR),
    and with an offload_dir under a regular file (`blocked`)."""
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    out = {}
    saved = os.environ.pop("AUTOPAR_OFFLOAD_DIR", None)
    try:
        for name, directory in (("missing", None), ("blocked", os.path.join(blocked, "under-a-file"))):
            try:
                autopar.compile(copy.deepcopy(model), plan.device_mesh(), args, example_kwargs=kwargs or None,
                                plan=plan, run=autopar.RunOptions(offload_dir=directory))
                out[name] = None
            except Exception as exc:   # noqa: BLE001 (the test reads the message)
                out[name] = f"{type(exc).__name__}: {exc}"
    finally:
        if saved is not None:
            os.environ["AUTOPAR_OFFLOAD_DIR"] = saved
    return out


def saved_by_tier(spec: tuple, plan_dict: dict) -> dict:
    """measure_saved_by_tier of one training step under `plan_dict`."""
    from autopar.runtime.regions.recompute import measure_saved_by_tier
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    return measure_saved_by_tier(cm, *args, **kwargs)
