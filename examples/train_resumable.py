"""Train gpt-tiny so that a killed or restarted job picks up where it stopped.

    torchrun --nproc_per_node 4 --max-restarts 3 examples/train_resumable.py --checkpoints ckpt/ [--steps 20]

Every `--save-every` steps every rank writes its shards of the model and the optimizer,
with the plan, the step and its RNG state, to `ckpt/step_N` (autopar.checkpoint.save: the
directory appears whole or not at all). At start the script resumes from the newest
complete checkpoint (autopar.checkpoint.latest) and draws each step's batch from the step
number, so the losses continue exactly as an uninterrupted run's. When a rank dies,
torchrun (--max-restarts) ends the others and starts the job again; a stalled rank ends
every rank after --timeout seconds (autopar.compile(timeout=...)) and is restarted the same
way.

Across nodes (each node runs the same command; the mesh's first axis spans the nodes):

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id job1 --max-restarts 3 examples/train_resumable.py --mesh 2x2 --checkpoints ckpt/

--kill-at STEP kills rank --kill-rank (SIGKILL) after that step on the job's first attempt
and --stall-at STEP puts it to sleep there instead: how the tests show recovery and clean
failure. --loss-log FILE appends one JSON line per step from rank 0 (step, loss, attempt).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist

import autopar
import autopar.checkpoint
from autopar.models import build
from autopar.runtime import init_process_group


def batch_of(step: int, like: tuple) -> tuple:
    """The batch of step `step`: token ids drawn from a generator seeded by the step, shaped
    like the example inputs (the same on every rank and every attempt)."""
    g = torch.Generator().manual_seed(1000 + step)
    return tuple(torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype) for t in like)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", required=True, help="directory of the step_N checkpoints")
    parser.add_argument("--mesh", default="2x2", help="mesh shape: 2x2 (axes node x gpu), or 4")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    parser.add_argument("--layout", help="a hand-written layout instead of the planner's (e.g. zero3)")
    parser.add_argument("--loss-log", help="append each step's loss to this file (JSON lines, rank 0)")
    parser.add_argument("--kill-at", type=int, help="first attempt only: kill --kill-rank after this step")
    parser.add_argument("--stall-at", type=int, help="first attempt only: --kill-rank sleeps after this step")
    parser.add_argument("--kill-rank", type=int, default=1)
    args = parser.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_process_group(timeout=args.timeout)   # (torch's own fails to reconnect after a torchrun restart)
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(asctime)s %(message)s")
    shape = tuple(int(s) for s in args.mesh.split("x"))
    mesh = autopar.Mesh(shape, ("node", "gpu")[-len(shape):] if len(shape) <= 2 else None, device="cpu")

    torch.manual_seed(0)
    model, example = build("gpt-tiny", hidden=128, n_heads=4, batch=8, seq=32)
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=args.layout))
    cm = autopar.compile(model, mesh, example, plan=plan, run=autopar.RunOptions(timeout=args.timeout))
    opt = cm.build_optimizer(torch.optim.AdamW, lr=args.lr)
    start = 0
    last = autopar.checkpoint.latest(args.checkpoints)
    if last is not None:
        start = autopar.checkpoint.load(last, cm, opt)["step"]
        if rank == 0:
            print(f"attempt {attempt}: resumed from {last} at step {start} at {time.time():.3f}", flush=True)
    if rank == 0:
        print(f"attempt {attempt}: ready at {time.time():.3f}", flush=True)
    for step in range(start, args.steps):
        loss = cm.train_step(*batch_of(step, example))
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss.item(), "attempt": attempt}) + "\n")
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            autopar.checkpoint.save(os.path.join(args.checkpoints, f"step_{step + 1}"), cm, opt, step=step + 1)
        if attempt == 0 and rank == args.kill_rank and step + 1 == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and rank == args.kill_rank and step + 1 == args.stall_at:
            print(f"rank {rank} stalls after step {step} at {time.time():.3f}", flush=True)
            time.sleep(3600)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
