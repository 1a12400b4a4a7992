"""Plan and train gpt-tiny on a (2, 2) mesh of CPU ranks.

    torchrun --nproc_per_node 4 examples/train_gpt.py [--steps 10] [--mesh 2x2] [--plan plan.json]
                                                      [--set hidden=256 --set batch=16 ...]

By default gpt-tiny is widened to hidden 256 (8 heads) with a batch of 16 sequences of
64 tokens, large enough that the CPU cost model prefers splitting it over the four ranks
(data and tensor parallelism mixed) to computing it whole on each.

Every rank builds the same model, plans it (the solver is deterministic, so every rank
gets the same plan; compile checks that) and trains it with data and tensor parallelism as
the plan says. Rank 0 prints the plan and the loss of every step next to the loss of the
same model trained on one device, which it runs alongside as a check.
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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="model config or example-input override (default hidden=256 n_heads=8 batch=16 seq=64)")
    args = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    shape = tuple(int(s) for s in args.mesh.split("x"))
    names = ("dp", "tp")[-len(shape):] if len(shape) <= 2 else tuple(f"ax{i}" for i in range(len(shape)))
    mesh = autopar.Mesh(shape, names, device=args.device)

    overrides = {"hidden": 256, "n_heads": 8, "batch": 16, "seq": 64} if args.model == "gpt-tiny" else {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else value
    torch.manual_seed(0)
    model, batch = build(args.model, **overrides)
    reference = None if args.no_check else copy.deepcopy(model)
    plan = autopar.Plan.load(args.plan) if args.plan else autopar.plan(model, mesh, batch)
    if rank == 0:
        print(plan, flush=True)
    cm = autopar.compile(model, mesh, batch, plan=plan)
    opt = cm.build_optimizer(torch.optim.AdamW, lr=args.lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr) if reference is not None else None

    for step in range(args.steps):
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
