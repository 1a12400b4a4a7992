"""Tensor-parallel collectives beside their GEMMs, against the same plan with the linears
unfolded: median step on gloo ranks.

- folded: `autopar.compile` as it runs (autopar/passes/fold_linears.py: each
  column-parallel input's gradient collective starts before the weight gradients compute,
  each row-parallel output's GEMM runs in two pieces, the first reduced while the second
  computes);
- unfolded: the same plan with tp_overlap=False (the passes leave the linears unfolded),
  as autograd orders the linears' backward and the move follows the whole GEMM.

The same model (seed 0), Megatron TP or Megatron-SP over every rank, AdamW, every step
between barriers, median of `--steps` after `--warmup`, the two variants alternated
`--rounds` times.  Ratio: folded / unfolded, measured in the same run.  On CPU ranks the
collective runs in gloo's thread on the cores the compute uses, so little is expected; on
GPUs NCCL's stream runs beside the GEMMs.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/linear_grads.py
    ... --models gpt,llama --layouts megatron-tp,megatron-sp --steps 8 --warmup 2 --rounds 2
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

import autopar
from autopar.models import build
from autopar.passes.fold_linears import linear_then_reduce, linears_then_gradient
from compiled import _timed as timed   # (benchmarks/compiled.py: every step between barriers)

MODELS = {"gpt": ("gpt-tiny", dict(hidden=512, n_heads=8, n_layers=4, max_seq=256)),
          "llama": ("llama-tiny", dict(dim=512, n_heads=8, n_kv_heads=4, n_layers=4, max_seq=256))}


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def median_step(name: str, layout: str, folded: bool, args) -> tuple[float, str]:
    """(median step seconds, the folded calls in the rank's graph: inputs + outputs)."""
    preset, size = MODELS[name]
    torch.manual_seed(0)
    model, example = build(preset, batch=args.batch, seq=args.seq, **size)
    mesh = autopar.Mesh((dist.get_world_size(),), ("tp",), device="cpu")
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False, layout=layout))
    plan = plan if folded else dataclasses.replace(plan, tp_overlap=False)
    cm = autopar.compile(model, mesh, example, plan=plan, run=autopar.RunOptions(backend="eager"))
    nodes = [n for g in cm.graphs() for n in g.graph.nodes]
    calls = f"{sum(n.target is linears_then_gradient for n in nodes)} + {sum(n.target is linear_then_reduce for n in nodes)}"
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)

    def step():
        cm.train_step(*example)
        opt.step()
        opt.zero_grad()
    return timed(step, args.steps, args.warmup)[1], calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--layouts", default="megatron-tp,megatron-sp")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    say(f"{dist.get_world_size()} gloo ranks, batch {args.batch} x {args.seq}, median of {args.steps} steps "
        f"after {args.warmup}, {args.rounds} rounds alternated")
    say("| model | layout | folded calls (inputs + outputs) | folded | unfolded | folded / unfolded |")
    say("| --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        for layout in args.layouts.split(","):
            got = {True: [], False: []}
            calls = "0 + 0"
            for _ in range(args.rounds):
                for folded in (True, False):
                    seconds, n = median_step(name, layout, folded, args)
                    got[folded].append(seconds)
                    calls = n if folded else calls
            a, b = statistics.median(got[True]), statistics.median(got[False])
            say(f"| {name} | {layout} | {calls} | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | {a / b:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
