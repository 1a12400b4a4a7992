"""Pipelined training: autopar's compiled stages against hand-written torch.distributed.pipelining.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 benchmarks/pipeline.py [--steps 10] [--microbatches 8]

Model: GPT (vocab 128, untied embeddings so that the hand-written split needs no weight
sharing) with hidden 256, 8 heads, 8 layers; global batch 16 x 64 tokens; 4 stages of 2
layers, one per gloo rank.

Two sides per schedule (GPipe, 1F1B; the V-shaped ZB-V and DualPipeV with 8 stages of one
layer, rank r holding stages r and 7-r; Chimera, 4 stages of 2 layers each held by ranks r
and 3-r; PipeDream-2BW, 1F1B without flushes and weights one step stale; both against
torch's 1F1B by hand, torch having neither), timed in the same run on copies of one model:

    hand-written  four nn.Modules cut by hand (embeddings + blocks 0-1 | blocks 2-3 |
                  blocks 4-5 | blocks 6-7 + final norm + head), PipelineStage each, the
                  schedule with loss_fn = cross-entropy, AdamW per stage
    autopar       autopar.plan(..., pipeline=autopar.Pipeline(axis="pp", groups=4,
                  schedule=..., microbatches=...)), autopar.compile, cm.train_step,
                  cm.build_optimizer(AdamW)

A step is the schedule's step (forward and backward of every microbatch) + AdamW step +
zero_grad, between two barriers, timed on rank 0; after `--warmup` untimed steps the two
sides alternate for `--steps` steps each and the median is reported.  The step-0 losses
must agree (same weights, same batch).  For autopar's last step the measured passes give
the measured bubble fraction, and the simulator run with the measured per-stage pass
times gives the predicted one (autopar.runtime.pipeline.pass_times.pass_times).

Then 2 stages x data parallel 2 on a (2, 2) mesh, 1F1B: autopar with the gradient
reduction overlapped with each stage's last backward (the default) against the same
compiled model with `cm.runner.overlap_grad_sync = False` (reduced after the schedule).

Ratios printed (target <= 1.05, not asserted): autopar / hand-written step time; and
overlapped / after-the-schedule (target < 1).
Timings are noisy: 4 ranks share this machine's cores.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.models import build
from autopar.runtime.pipeline.pass_times import EventRecorder, gather_timeline, pass_times
from runtime_overhead import init_gloo


V_SCHEDULES = ("zbv", "dualpipev")
OWN = ("chimera", "pipedream-2bw")   # schedules autopar runs itself


class HandStage(nn.Module):
    """Stage s of n cut by hand from a GPT: layers [a, b), the first with the embeddings,
    the last with the final norm and head (the loss is the schedule's loss_fn)."""

    def __init__(self, gpt, s: int, n_stages: int):
        super().__init__()
        per = len(gpt.blocks) // n_stages
        self.first, self.last = s == 0, s == n_stages - 1
        if self.first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[s * per:(s + 1) * per])
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def hand_written(gpt, schedule: str, n_mb: int, lr: float):
    from torch.distributed import pipelining as pp
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab = gpt.config.vocab

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    if schedule in V_SCHEDULES:   # 2 x world stages, rank r holding r and 2 world - 1 - r
        n = 2 * world
        modules = [HandStage(gpt, s, n) for s in (rank, n - 1 - rank)]
        stages = [pp.PipelineStage(m, s, n, torch.device("cpu")) for m, s in zip(modules, (rank, n - 1 - rank))]
        cls = {"zbv": pp.ScheduleZBVZeroBubble, "dualpipev": pp.ScheduleDualPipeV}[schedule]
        sched = cls(stages, n_mb, loss_fn=loss_fn)
        last = 0
    else:
        modules = [HandStage(gpt, rank, world)]
        stage = pp.PipelineStage(modules[0], rank, world, torch.device("cpu"))
        sched = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B}[schedule](stage, n_mb, loss_fn=loss_fn)
        last = world - 1
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=lr)

    def step(idx, targets):
        losses = []
        sched.step(*([idx] if rank == 0 else []),
                   **({"target": targets, "losses": losses} if rank == last else {}))
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=last)
        return loss
    return step


def compiled(gpt, batch, schedule: str, n_mb: int, lr: float, data_parallel: bool = False):
    world = dist.get_world_size()
    if data_parallel:
        mesh = autopar.Mesh((2, world // 2), ("pp", "dp"), device="cpu")
        fixed = autopar.Pipeline(axis="pp", groups=2, schedule=schedule, microbatches=n_mb)
        plan = autopar.plan(gpt, mesh, batch, solve=autopar.SolveOptions(compare=False, layout="data-parallel"),
                            pipeline=fixed)
    else:
        mesh = autopar.Mesh((world,), ("pp",), device="cpu")
        fixed = autopar.Pipeline(axis="pp", groups=world, schedule=schedule, microbatches=n_mb,
                                 asynchronous=schedule == "pipedream-2bw")
        plan = autopar.plan(gpt, mesh, batch, solve=autopar.SolveOptions(compare=False), pipeline=fixed)
    cm = autopar.compile(gpt, mesh, batch, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, lr=lr)

    def step(idx, targets):
        loss = cm.train_step(idx, targets)
        opt.step()
        opt.zero_grad()
        return loss
    return step, cm, plan


def measured_timeline(cm, step, batch, schedule: str):
    """Every rank's passes of one step (autopar.runtime.pipeline.pass_times), as one Timeline."""
    if schedule == "chimera":   # autopar's own runner records its passes itself
        cm.runner.schedule.events = []
        step(*batch)
        events, cm.runner.schedule.events = cm.runner.schedule.events, None
        return gather_timeline(events, schedule)
    with EventRecorder(*cm.runner.pipeline_stages) as recorder:
        step(*batch)
        return gather_timeline(recorder, schedule)


def timed(step, batch) -> float:
    dist.barrier()
    start = time.perf_counter()
    step(*batch)
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_gloo(4, __file__)  # four hand-written stages
    rank = dist.get_rank()
    torch.manual_seed(0)
    gpt, batch = build("gpt-tiny", hidden=256, n_heads=8, n_layers=args.layers, tie_embeddings=False,
                       batch=16, seq=64)
    rows = []
    for schedule in ("gpipe", "1f1b", *V_SCHEDULES, *OWN):
        # (torch has neither Chimera nor PipeDream-2BW: their rows' hand-written side is torch's 1F1B)
        hand = hand_written(copy.deepcopy(gpt), "1f1b" if schedule in OWN else schedule, args.microbatches, 1e-4)
        mine, cm, plan = compiled(copy.deepcopy(gpt), batch, schedule, args.microbatches, 1e-4)
        first = (hand(*batch).item(), mine(*batch).item())
        for _ in range(args.warmup - 1):
            hand(*batch)
            mine(*batch)
        times = {"hand": [], "autopar": []}
        for _ in range(args.steps):
            times["hand"].append(timed(hand, batch))
            times["autopar"].append(timed(mine, batch))
        med = {k: statistics.median(v) for k, v in times.items()}
        if schedule == "pipedream-2bw":   # (a stream without flushes: the plan's steady-state bubble)
            rows.append((schedule, plan.pipeline.stages, med, first, float("nan"), plan.pipeline.bubble))
            continue
        timeline = measured_timeline(cm, mine, batch, schedule)
        simulated = pass_times(timeline).simulate(schedule, args.microbatches)
        rows.append((schedule, plan.pipeline.stages, med, first, timeline.bubble_fraction,
                     simulated.bubble_fraction))
    step, cm, _ = compiled(copy.deepcopy(gpt), batch, "1f1b", args.microbatches // 2, 1e-4, data_parallel=True)
    for _ in range(args.warmup):
        step(*batch)
    overlap = {True: [], False: []}
    for _ in range(args.steps):
        for on in (True, False):
            cm.runner.overlap_grad_sync = on
            overlap[on].append(timed(step, batch))
    if rank == 0:
        print(f"GPT hidden 256 x {args.layers} layers, batch 16x64, 4 stages on 4 gloo ranks, "
              f"{args.microbatches} microbatches; median of {args.steps} steps")
        print(f"{'schedule':14} {'hand-written ms':>16} {'autopar ms':>11} {'ratio':>6} {'step-0 loss diff':>17} "
              f"{'bubble measured':>16} {'simulated':>10}  autopar's cuts")
        for schedule, stages, med, first, measured, sim in rows:
            print(f"{schedule:14} {med['hand'] * 1e3:16.1f} {med['autopar'] * 1e3:11.1f} "
                  f"{med['autopar'] / med['hand']:6.3f} {abs(first[0] - first[1]):17.1e} {measured:16.1%} "
                  f"{sim:10.1%}  {stages}")
        print("target: autopar / hand-written <= 1.05 (chimera, pipedream-2bw: against torch's 1f1b)")
        on, off = (statistics.median(overlap[k]) for k in (True, False))
        print(f"2 stages x dp 2, 1f1b, {args.microbatches // 2} microbatches: gradient reduction overlapped "
              f"{on * 1e3:.1f} ms, after the schedule {off * 1e3:.1f} ms, ratio {on / off:.3f} (target < 1)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
