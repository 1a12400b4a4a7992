"""Split-backward schedules under Inductor: each compiled region's backward as two passes.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/split_backward.py [--steps 8] [--microbatches 8]

Model: GPT (vocab 128, untied embeddings) with hidden 256, 8 heads, 8 layers; global batch
16 x 64 tokens; two gloo ranks, one pipeline stage group each.  Schedules: zero-bubble
(ZB-H1), ZB-V and DualPipeV (four stages, a V over the two ranks), and 1F1B as the
schedule that does not split backward.  For each, autopar.compile with backend="eager"
and backend="inductor" on copies of one model, timed in turn (after `--warmup` untimed
steps each, `--steps` rounds of one step per side, a step being cm.train_step + AdamW +
zero_grad between two barriers, timed on rank 0).  The step-0 losses must agree.

Printed per schedule: the median step of each backend and inductor / eager (the baseline:
autopar eager, measured in the same run), and from one measured step
(autopar.runtime.pipeline.pass_times) each backend's share of backward spent in W passes (what the
schedule can move into its bubbles; under Inductor it was 0 before
runtime/regions/split_backward.py, when the compiled regions could not run these schedules at
all) and the measured bubble fraction.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch
import torch.distributed as dist

import autopar
from autopar.cost.schedules import SPLIT_BACKWARD
from autopar.models import build
from autopar.runtime.pipeline.pass_times import pass_times
from pipeline import measured_timeline, timed
from runtime_overhead import init_gloo

SCHEDULES = ("1f1b", "zero-bubble", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


def compiled(gpt, batch, schedule: str, n_mb: int, backend: str):
    mesh = autopar.Mesh((dist.get_world_size(),), ("pp",), device="cpu")
    fixed = autopar.Pipeline(axis="pp", groups=mesh.size, schedule=schedule, microbatches=n_mb,
                             virtual=2 if schedule in V_SHAPED else None)
    plan = autopar.plan(gpt, mesh, batch, solve=autopar.SolveOptions(compare=False),
                        pricing=autopar.Pricing(backend=backend), pipeline=fixed)
    cm = autopar.compile(gpt, mesh, batch, plan=plan, run=autopar.RunOptions(backend=backend))
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)

    def step(idx, targets):
        loss = cm.train_step(idx, targets)
        opt.step()
        opt.zero_grad()
        return loss
    return step, cm


def measured(cm, step, batch, schedule: str):
    """(W's share of backward, bubble fraction) of one step's measured passes."""
    timeline = measured_timeline(cm, step, batch, schedule)
    return pass_times(timeline).w_fraction, timeline.bubble_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    init_gloo(2, __file__)
    rank = dist.get_rank()
    torch.manual_seed(0)
    gpt, batch = build("gpt-tiny", hidden=256, n_heads=8, n_layers=8, tie_embeddings=False, batch=16, seq=64)
    rows = []
    for schedule in args.schedules.split(","):
        sides = {b: compiled(copy.deepcopy(gpt), batch, schedule, args.microbatches, b) for b in ("eager", "inductor")}
        first = {b: step(*batch).item() for b, (step, _) in sides.items()}
        for _ in range(args.warmup - 1):
            for step, _ in sides.values():
                step(*batch)
        times: dict = {b: [] for b in sides}
        for _ in range(args.steps):
            for b, (step, _) in sides.items():
                times[b].append(timed(step, batch))
        med = {b: statistics.median(v) for b, v in times.items()}
        passes = {b: measured(cm, step, batch, schedule) for b, (step, cm) in sides.items()}
        rows.append((schedule, med, first, passes))
    if rank == 0:
        print(f"GPT 256 x 8 layers, 16 x 64 tokens, {args.microbatches} microbatches, 2 ranks; "
              f"median of {args.steps} steps each, in turn")
        print("| schedule | eager | inductor | inductor / eager | W share of backward, eager / inductor "
              "| bubble, eager / inductor | step-0 loss difference |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for schedule, med, first, passes in rows:
            (we, be), (wi, bi) = passes["eager"], passes["inductor"]
            share = f"{we:.2f} / {wi:.2f}" if schedule in SPLIT_BACKWARD else "(no W passes)"
            print(f"| {schedule} | {med['eager'] * 1e3:.1f} ms | {med['inductor'] * 1e3:.1f} ms | "
                  f"{med['inductor'] / med['eager']:.2f} | {share} | {be:.2f} / {bi:.2f} | "
                  f"{abs(first['eager'] - first['inductor']):.1e} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
