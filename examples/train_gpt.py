"""Plan and train gpt-tiny on a (2, 2) mesh of CPU ranks.

    torchrun --nproc_per_node 4 examples/train_gpt.py [--steps 10] [--mesh 2x2] [--plan plan.json]
                                                      [--set hidden=256 --set batch=16 ...]
                                                      [--pipeline 1f1b [--gantt run.svg]]

By default gpt-tiny is widened to hidden 256 (8 heads) with a batch of 16 sequences of
64 tokens, large enough that the CPU cost model prefers splitting it over the four ranks
(data and tensor parallelism mixed) to computing it whole on each.

Every rank builds the same model, plans it (the solver is deterministic, so every rank
gets the same plan; compile checks that) and trains it with data and tensor parallelism as
the plan says. Rank 0 prints the plan and the loss of every step next to the loss of the
same model trained on one device, which it runs alongside as a check.

--pipeline SCHEDULE cuts the model into pipeline stages over the mesh's first axis (one
device group per coordinate; gpipe, 1f1b, interleaved-1f1b or zero-bubble; "search" lets
the planner decide whether to pipeline at all), e.g. 4 stages of 2 layers each:

    torchrun --nproc_per_node 4 examples/train_gpt.py --mesh 4 --set n_layers=8 --pipeline 1f1b --gantt 1f1b.svg

--gantt writes the Gantt chart of the last step's measured forward and backward passes.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import time

import torch
import torch.distributed as dist

import autopar
from autopar.models import build


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2 (axes dp x tp) or 4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cpu", help="device preset the planner costs with")
    parser.add_argument("--plan", help="use this saved plan instead of planning")
    parser.add_argument("--no-check", action="store_true", help="skip the single-device reference run")
    parser.add_argument("--pipeline", help="pipeline schedule over the first mesh axis, or 'search'")
    parser.add_argument("--microbatches", type=int, help="microbatches per step of a pipelined plan")
    parser.add_argument("--gantt", help="write the last step's measured pipeline passes as an SVG Gantt chart")
    parser.add_argument("--backend", default="auto", choices=("auto", "eager", "inductor"),
                        help="run each rank's graph op by op, or its compute between collectives compiled by "
                             "Inductor (the plan is priced for it); auto: Inductor on GPUs, eager on CPU ranks")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="model config or example-input override (default hidden=256 n_heads=8 batch=16 seq=64)")
    args = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    shape = tuple(int(s) for s in args.mesh.split("x"))
    if len(shape) > 2:
        names = tuple(f"ax{i}" for i in range(len(shape)))
    else:  # a pipeline cuts the first axis
        names = (("pp" if args.pipeline else "dp"), "tp")[-len(shape):] if len(shape) == 2 else \
            ("pp" if args.pipeline else "tp",)
    mesh = autopar.Mesh(shape, names, device=args.device)

    overrides = {"hidden": 256, "n_heads": 8, "batch": 16, "seq": 64} if args.model == "gpt-tiny" else {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else value
    torch.manual_seed(0)
    model, batch = build(args.model, **overrides)
    reference = None if args.no_check else copy.deepcopy(model)
    pipeline = False
    if args.pipeline == "search":
        pipeline = True
    elif args.pipeline:
        pipeline = autopar.Pipeline(axis=names[0], groups=shape[0], schedule=args.pipeline,
                                    microbatches=args.microbatches,
                                    virtual=2 if args.pipeline == "interleaved-1f1b" else None)
    priced_for = args.backend if args.backend != "auto" else ("inductor" if torch.cuda.is_available() else "eager")
    plan = autopar.Plan.load(args.plan) if args.plan else autopar.plan(model, mesh, batch, pipeline=pipeline,
                                                                       pricing=autopar.Pricing(backend=priced_for))
    if rank == 0:
        print(plan, flush=True)
    cm = autopar.compile(model, mesh, batch, plan=plan, run=autopar.RunOptions(backend=args.backend))
    opt = cm.build_optimizer(torch.optim.AdamW, lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None

    recorder = None
    for step in range(args.steps):
        if args.gantt and step == args.steps - 1 and cm.runner.pipelined:
            from autopar.runtime.pipeline.pass_times import EventRecorder
            recorder = EventRecorder(*cm.runner.pipeline_stages)
        start = time.perf_counter()
        loss = cm.train_step(*batch)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        line = f"step {step:3d}  loss {loss.item():.6f}  ({elapsed * 1e3:.1f} ms)"
        if reference is not None:
            ref_loss = reference(*batch)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            line += f"  one device {ref_loss.item():.6f}  diff {abs(loss.item() - ref_loss.item()):.1e}"
        if rank == 0:
            print(line, flush=True)
    if recorder is not None:
        from autopar.report.gantt import gantt_svg
        from autopar.runtime.pipeline.pass_times import gather_timeline
        timeline = gather_timeline(recorder, plan.pipeline.schedule)
        if rank == 0:
            pp = plan.pipeline
            path = gantt_svg(timeline, args.gantt, title=f"{args.model}: {len(pp.stages)} stages, {pp.schedule}")
            print(f"measured bubble {timeline.bubble_fraction:.1%}; Gantt chart of the last step: {path}")
    elif args.gantt and rank == 0:
        print("--gantt draws pipelined runs only; this plan has no pipeline stages")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
