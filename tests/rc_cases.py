"""Jobs for tests/test_recompute.py that run on every rank of a WorkerPool."""
from __future__ import annotations

import torch

import autopar
from autopar.report.plan import Plan
from rt_cases import OPTIM, build_case


def _compiled(spec, plan_dict):
    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan, seed=5)
    return cm, args, kwargs


def saved_bytes(spec: tuple, plan_dict: dict) -> dict:
    """This rank's bytes kept for backward in one step (runtime.regions.recompute.measure_saved), the
    plan's prediction, and how many recomputed regions the compiled graphs hold."""
    from autopar.runtime.regions.recompute import Region, measure_saved
    cm, args, kwargs = _compiled(spec, plan_dict)
    regions = sum(isinstance(m, Region) for g in cm.runner.graphs() for m in g.modules())
    return {"measured": measure_saved(cm, *args, **kwargs),
            "predicted": Plan.from_dict(plan_dict).predicted.memory["activations"], "regions": regions}


def losses_and_params(spec: tuple, plan_dict: dict, steps: int = 3) -> dict:
    """Losses of `steps` AdamW steps (dropout drawn from the job's seed 5) and the final
    local shards: two plans that differ only in recomputation must give the same."""
    cm, args, kwargs = _compiled(spec, plan_dict)
    opt = cm.build_optimizer(torch.optim.AdamW, **OPTIM)
    losses = []
    for _ in range(steps):
        losses.append(float(cm.train_step(*args, **kwargs)))
        opt.step()
        opt.zero_grad()
    local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in cm.state_dict().items()}
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in local.items()}}
