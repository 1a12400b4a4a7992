"""Peak memory of Llama-3-8B-wide layers on one GPU: predicted, allocated and reserved.

torchtitan's published runs state the caching allocator's peak *reserved* memory, which
holds more than the tensors alive at the peak (blocks split and freed in odd sizes stay
cached).  autopar predicts the tensors alive.  This measures both on one GPU for layers
of the published shape (4,096 wide, 8,192 tokens, the 128,256-word vocabulary), eager,
bf16 with float32 masters, with and without recomputation, under the allocator's default
settings and under `expandable_segments:True`, and once with the loss on float32 logits
(`float_loss`, torchtitan's loss: case "selective+float32"); each case runs in its own
process, as the allocator reads its settings once.

    python benchmarks/gpu_memory.py [--layers 2] [--seq 8192] [--out result.json]

Without CUDA it runs a tiny shape on the CPU (peak memory n/a) so the code path is tested.
"""
from __future__ import annotations

import autopar
import argparse
import json
import os
import subprocess
import sys
import time

CASES = [("none", ""), ("selective", ""), ("full", ""),
         ("none", "expandable_segments:True"), ("selective", "expandable_segments:True"), ("selective+float32", "")]


def one(recompute: str, layers: int, seq: int, steps: int) -> dict:
    import torch

    recompute, _, loss = recompute.partition("+")   # "selective+float32": the loss on float32 logits

    import socket

    import autopar
    from autopar.mesh import PRESETS
    from autopar.models import build
    from autopar.runtime import init_process_group

    gpu = torch.cuda.is_available()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    init_process_group("nccl" if gpu else "gloo")
    shape = (dict(dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, multiple_of=1024, batch=1, seq=seq)
             if gpu else dict(dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, vocab=256, batch=1, seq=64))
    model, example = build("llama3-8b", device="meta", float_loss=loss == "float32", **shape)
    device = PRESETS["h200" if gpu and "H200" in torch.cuda.get_device_name() else "h100"] if gpu else None
    mesh = autopar.Mesh((1,), ("dp",), device=device) if device is not None else autopar.Mesh((1,), ("dp",))
    precision = torch.bfloat16 if gpu else None
    plan = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(compare=False), mixed_precision=precision,
                        recompute=recompute)
    cm = autopar.compile(model, plan.mesh, example, plan=plan, seed=0,
                         run=autopar.RunOptions(check_finite=False, check_inputs=0, backend="eager"))
    opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)
    dev = "cuda" if gpu else "cpu"
    batch = tuple(torch.randint(0, model.config.vocab, t.shape, device=dev) for t in example)
    times, phases = [], {}

    def peak(phase: str):   # the peak since the last call, per phase of the step
        if gpu:
            torch.cuda.synchronize()
            got = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            old = phases.get(phase, (0, 0))
            phases[phase] = (max(old[0], got[0]), max(old[1], got[1]))
            torch.cuda.reset_peak_memory_stats()

    for i in range(steps):
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        cm.train_step(*batch)
        if i:
            peak("forward and backward")
        opt.step()
        if i:
            peak("optimizer step")
        opt.zero_grad()
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    mem = plan.predicted.memory
    return dict(recompute=recompute, loss=loss or "logits' dtype", layers=layers, seq=seq, step_s=min(times[1:] or times),
                predicted_step_s=plan.step_s, predicted=plan.memory_per_device,
                parts={k: float(v) for k, v in mem.items()},
                allocated=max((a for a, _ in phases.values()), default=None),
                reserved=max((r for _, r in phases.values()), default=None),
                phases={k: list(v) for k, v in phases.items()},
                recomputed_layers=len(plan.recompute.layers) if plan.recompute is not None else 0)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cases", help="comma-separated recompute[+float32][:allocator] cases (default: all six)")
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)   # recompute mode, in a child process
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.layers, args.seq, args.steps)), flush=True)
        return []
    results = []
    gib = 2 ** 30
    print(f"{'recompute':<10} {'allocator':<26} {'predicted':>10} {'allocated':>10} {'reserved':>10} "
          f"{'pred/alloc':>10} {'pred/res':>9} {'res/alloc':>9}  step pred/meas")
    cases = CASES if not args.cases else [tuple((c + ":").split(":", 1)) for c in args.cases.split(",")]
    cases = [(r, conf.rstrip(":")) for r, conf in cases]
    for recompute, conf in cases:
        env = dict(os.environ)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        cmd = [sys.executable, __file__, "--one", recompute, "--layers", str(args.layers), "--seq", str(args.seq),
               "--steps", str(args.steps)]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        got = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode or not got:
            print(f"{recompute:<10} {conf or 'default':<26} FAILED: {(run.stderr or run.stdout)[-600:]}")
            continue
        r = json.loads(got[-1][len("RESULT "):])
        r["allocator"] = conf or "default"
        results.append(r)
        a, res = r["allocated"], r["reserved"]
        ratio = (lambda x, y: f"{x / y:.3f}" if x and y else "n/a")
        print(f"{recompute:<10} {r['allocator']:<26} {r['predicted'] / gib:9.2f}G "
              f"{(a or 0) / gib:9.2f}G {(res or 0) / gib:9.2f}G {ratio(r['predicted'], a):>10} "
              f"{ratio(r['predicted'], res):>9} {ratio(res, a):>9}  "
              f"{r['predicted_step_s'] * 1e3:.1f} / {r['step_s'] * 1e3:.1f} ms")
        print("           parts: " + ", ".join(f"{k} {v / gib:.2f}G" for k, v in r["parts"].items()))
        print("           peaks: " + ", ".join(f"{k} {a / gib:.2f}G allocated, {b / gib:.2f}G reserved"
                                        for k, (a, b) in r["phases"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
