"""What pricing a plan for Inductor's memory changes in the planner's choices (predicted).

Llama-3-8B on 8 GPUs of the `h100` preset, bf16, as memory shrinks: the plan priced for
`backend="eager"` against the one priced for `backend="inductor"`, whose compiled graphs
keep less for backward (the partitioner runs pointwise chains again; a selective layer
compiled whole keeps only the kept outputs its backward reads: docs/COST_MODEL.md, Memory).
The baseline is the eager-priced plan of the same budget; the ratio is inductor / eager
step.

    python benchmarks/inductor_memory.py [--budgets 79,64,48] [--tokens 8192] [--batch 8]
"""
from __future__ import annotations

import argparse
import time

import autopar
from autopar.models import build

GIB = 2 ** 30


def row(model, example, mesh, budget, backend) -> dict:
    start = time.perf_counter()
    plan = autopar.plan(model, mesh, example, mixed_precision="bf16", memory_budget=budget * GIB,
                        pricing=autopar.Pricing(backend=backend), solve=autopar.SolveOptions(compare=False))
    mem = plan.predicted.memory
    modes = dict(plan.recompute.layers) if plan.recompute is not None else {}
    counted = {m: sum(1 for v in modes.values() if v == m) for m in sorted(set(modes.values()))}
    return {"step": plan.predicted.step_s, "activations": mem["activations"] / GIB,
            "recomputed": ", ".join(f"{n} {m}" for m, n in counted.items()) or "none",
            "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="79,64,48", help="GiB per GPU, comma-separated")
    ap.add_argument("--tokens", type=int, default=8192, help="sequence length")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (all GPUs)")
    args = ap.parse_args()
    model, example = build("llama3-8b", device="meta", batch=args.batch, seq=args.tokens)
    mesh = autopar.Mesh((8,), ("dp",), device="h100")
    print("| budget | eager: step, activations, recomputed | inductor: step, activations, recomputed "
          "| inductor / eager step |")
    print("| --- | --- | --- | --- |")
    for budget in (float(b) for b in args.budgets.split(",")):
        e, i = row(model, example, mesh, budget, "eager"), row(model, example, mesh, budget, "inductor")
        print(f"| {budget:g} GiB | {e['step'] * 1e3:.1f} ms, {e['activations']:.2f} GiB, {e['recomputed']} "
              f"| {i['step'] * 1e3:.1f} ms, {i['activations']:.2f} GiB, {i['recomputed']} "
              f"| {i['step'] / e['step']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
