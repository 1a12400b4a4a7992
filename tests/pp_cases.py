"""Jobs for tests/test_pipeline_measured.py: run a real torch.distributed.pipelining
schedule on the pool's ranks, one stage per rank, and report when every pass ran, the
losses and this rank's gradients.

The model is N_STAGES equal stages, each LAYERS x (Linear(HIDDEN, HIDDEN), ReLU); a
microbatch is MB rows, so one forward of one stage is LAYERS matmuls of [MB, HIDDEN] x
[HIDDEN, HIDDEN] (2.1 GFLOP), about 8 ms on one thread of a current x86 core, ~20 ms when
4 ranks share 2 cores, and the backward 1.7-2x that.  Rank r holds stage r; every rank
builds the whole model (seed 0) and keeps its stage, so the stages equal the single-device
reference.  The pipeline uses the pool's default (world) gloo group, so the job needs a
pool of exactly N_STAGES ranks.
"""
from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autopar.runtime.pipeline.pass_times import EventRecorder, gather_timeline

N_STAGES, LAYERS, HIDDEN, MB = 4, 8, 512, 512
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_model() -> torch.nn.Sequential:
    """The whole model, the same on every call (seed 0): N_STAGES Sequentials of LAYERS
    (Linear, ReLU) pairs.  x: [batch, HIDDEN] -> [batch, HIDDEN]."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU())])
        for _ in range(N_STAGES)])


def batch(n_microbatches: int) -> tuple:
    """(x, target), both [n_microbatches * MB, HIDDEN], the same on every call."""
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n_microbatches * MB, HIDDEN, generator=g),
            torch.randn(n_microbatches * MB, HIDDEN, generator=g))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def measured_bubble(schedule_name: str, n_microbatches: int, steps: int = 3, warmup: int = 1) -> dict:
    """Run `warmup` steps of `schedule_name` ("gpipe" or "1f1b"), then `steps` measured ones.

    Returns, on every rank: "timelines", each measured step's passes on all ranks (autopar
    Timelines, times in seconds); "grads", this rank's stage gradients of the last step by
    parameter name in build_model() ("2.0.weight"); on the last rank "losses", the last
    step's per-microbatch losses (mean-reduced MSE, so their mean is the whole batch's
    loss, and scale_grads divides the summed gradients by n_microbatches to match).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    if dist.get_world_size() != N_STAGES:
        raise RuntimeError(f"measured_bubble runs {N_STAGES} stages on {N_STAGES} ranks, one each; "
                           f"got {dist.get_world_size()} ranks, use the pool4 fixture")
    torch.set_num_threads(1)
    submodule = build_model()[rank]
    stage = PipelineStage(submodule, rank, N_STAGES, device=torch.device("cpu"))
    schedule = SCHEDULES[schedule_name](stage, n_microbatches, loss_fn=loss_fn)
    x, target = batch(n_microbatches)
    timelines = []
    with EventRecorder(stage) as recorder:
        for step in range(warmup + steps):
            recorder.clear()
            submodule.zero_grad()
            losses = []
            dist.barrier()  # start every step together, so that rank 0's first forward starts it
            schedule.step(*([x] if rank == 0 else []),
                          **({"target": target, "losses": losses} if rank == N_STAGES - 1 else {}))
            if step >= warmup:
                timelines.append(gather_timeline(recorder, schedule_name))
    out = {"timelines": timelines,
           "grads": {f"{rank}.{name}": p.grad.clone() for name, p in submodule.named_parameters()}}
    if rank == N_STAGES - 1:
        out["losses"] = [loss.item() for loss in losses]
    return out


def compiled_pipeline_events(spec: tuple, plan_dict: dict, warmup: int = 1):
    """Compile a pipelined plan, run `warmup` train steps, then time one: the Timeline of
    every rank's passes (EventRecorder on the compiled model's PipelineStages)."""
    import autopar
    from autopar.report.plan import Plan
    from rt_cases import build_case

    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    for _ in range(warmup):
        cm.train_step(*args, **kwargs)
    with EventRecorder(*cm.runner.pipeline_stages) as recorder:
        cm.train_step(*args, **kwargs)
        return gather_timeline(recorder, plan.pipeline.schedule, group=None)


def pipelined_forward_loss(spec: tuple, plan_dict: dict) -> tuple:
    """(compiled forward's loss, the plain model's loss) on the example batch, before any step."""
    import autopar
    from autopar.report.plan import Plan
    from rt_cases import build_case

    plan = Plan.from_dict(plan_dict)
    model, args, kwargs = build_case(spec)
    expected = model(*args, **kwargs).item()
    cm = autopar.compile(model, plan.device_mesh(), args, example_kwargs=kwargs or None, plan=plan)
    return cm(*args, **kwargs).item(), expected
