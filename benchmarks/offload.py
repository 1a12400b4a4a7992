"""Memory tiers: what the planner picks as the device budget shrinks, and what a step with
optimizer states on disk costs against the disk's measured rates.

Two parts:

    python benchmarks/offload.py --plans
        Llama-3-8B and Llama-3-70B shapes on 8 H100 (one node, data parallel over 8, bf16
        with float32 master weights, 4,096 tokens per GPU), the budget per GPU lowered from
        80 to 16 GiB: for each budget the planner's predicted
        tokens/s and step, and where the optimizer states of the plan live (device, host,
        disk: parameters and GiB per GPU; how many keep their weights there too).  Twice: on the h100 preset (a DGX H100's 225 GB
        of host memory per GPU) and on the same GPUs with 64 GB of host memory each (a
        smaller cloud machine), where the 70B's states spill to the NVMe.

    torchrun --nproc_per_node 2 benchmarks/offload.py --measure [--offload-dir DIR]
        A GPT (hidden 512, 4 layers, 12.7 M parameters, fp32 AdamW) on 2 gloo ranks, ZeRO-2
        over both, with its optimizer states on the device, in host memory and on disk
        (the same layout, only the tier changes; the losses must agree exactly).  The disk
        is timed first in the same directory (autopar.runtime.calibrate.fit.measure_tiers).
        Printed per tier: the median step, and for disk the bytes the store read and wrote
        per step, the time they take at the measured rates, and the ratio of the measured
        step to the host tier's step plus that time (target <= 1.3).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import autopar
from autopar.mesh import PRESETS
from autopar.models import build


def plans() -> None:
    h100 = PRESETS["h100"]
    small_host = dataclasses.replace(h100, name="h100-64gb-host", host_memory=64e9)
    print("| model | device | budget GiB/GPU | predicted step | tokens/s/GPU | states on device / host / disk "
          "(params) | of which with weights | host GiB | disk GiB | plan s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, batch in (("llama3-8b", 8), ("llama3-70b", 8)):   # (one 4,096-token sequence per GPU)
        model, example = build(name, device="meta", batch=batch, seq=4096)
        for device in (h100, small_host):
            mesh = autopar.Mesh((8,), ("dp",), device=device)
            for budget in (80, 64, 48, 32, 16):
                start = time.perf_counter()
                try:
                    plan = autopar.plan(model, mesh, example, memory_budget=f"{budget}GiB",
                                        solve=autopar.SolveOptions(compare=False),
                                        mixed_precision=autopar.MixedPrecision(param_dtype=torch.bfloat16))
                except Exception as exc:   # noqa: BLE001 (an infeasible budget is a row too)
                    print(f"| {name} | {device.name} | {budget} | - | - | {type(exc).__name__}: "
                          f"{str(exc)[:90]} | | | | {time.perf_counter() - start:.1f} |")
                    continue
                counts = {"": 0, "host": 0, "disk": 0}
                weights = 0
                for pname in plan.param_placements:
                    st = plan.param_states.get(pname)
                    counts[st.offload if st is not None else ""] += 1
                    weights += bool(st is not None and st.weights)
                tiers = plan.predicted.tiers
                tokens = batch * 4096 / plan.step_s / 8
                print(f"| {name} | {device.name} | {budget} | {plan.step_s:.2f} s | {tokens:,.0f} | "
                      f"{counts['']} / {counts['host']} / {counts['disk']} | {weights} | "
                      f"{tiers.get('host', 0) / 2**30:.1f} | "
                      f"{tiers.get('disk', 0) / 2**30:.1f} | {time.perf_counter() - start:.1f} |", flush=True)


def run(offload_dir: str | None, steps: int) -> None:
    from autopar.runtime.calibrate.fit import measure_tiers
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    directory = offload_dir or tempfile.gettempdir()
    tiers = measure_tiers(directory, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 64 * 2**20, 3, "cpu")
    model, example = build("gpt-tiny", hidden=512, n_layers=4, batch=2, seq=32)
    mesh = autopar.Mesh((2,), ("dp",), device="cpu")
    base = autopar.plan(model, mesh, example, solve=autopar.SolveOptions(layout="zero2", compare=False))
    results = {}
    for tier in ("", "host", "disk"):
        d = base.to_dict()
        for st in d["param_states"].values():
            st["offload"] = tier
        plan = autopar.Plan.from_dict(d)
        cm = autopar.compile(copy.deepcopy(model), mesh, example, plan=plan,
                             run=autopar.RunOptions(offload_dir=directory))
        opt = cm.build_optimizer(torch.optim.AdamW, lr=1e-4)
        times, losses = [], []
        store = cm.rank_state.disk
        moved = None
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            losses.append(cm.train_step(*example).item())
            if step == 1 and store is not None:
                moved = (store.read_bytes, store.written_bytes)
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step:
                times.append(time.perf_counter() - start)
        per_step = None
        if store is not None:
            per_step = ((store.read_bytes - moved[0]) / (steps - 1), (store.written_bytes - moved[1]) / (steps - 1))
        results[tier or "device"] = (statistics.median(times), losses, per_step)
        del cm, opt
    if rank == 0:
        print(f"disk at {directory}: write {tiers['disk_write_bandwidth'] / 1e9:.3g} GB/s, read "
              f"{tiers['disk_read_bandwidth'] / 1e9:.3g} GB/s per rank (2 ranks at once)")
        same = results["device"][1] == results["host"][1] == results["disk"][1]
        print(f"losses equal on every tier: {same}")
        print("| tier | median step | disk read / written per step | at the measured rates | "
              "step / (host step + disk time) |")
        print("| --- | --- | --- | --- | --- |")
        host_s = results["host"][0]
        for tier, (median, _, per_step) in results.items():
            if per_step is None:
                print(f"| {tier} | {median * 1e3:.1f} ms | - | - | - |")
                continue
            io = per_step[0] / tiers["disk_read_bandwidth"] + per_step[1] / tiers["disk_write_bandwidth"]
            print(f"| {tier} | {median * 1e3:.1f} ms | {per_step[0] / 2**20:.1f} / {per_step[1] / 2**20:.1f} MiB | "
                  f"{io * 1e3:.1f} ms | {median / (host_s + io):.3f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", action="store_true", help="the planner's sweep over budgets (one process)")
    parser.add_argument("--measure", action="store_true", help="the measured steps per tier (under torchrun, 2 ranks)")
    parser.add_argument("--offload-dir", help="the directory of the disk tier (default: the system's temp dir)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if args.plans or not args.measure:
        plans()
    if args.measure:
        run(args.offload_dir, args.steps)


if __name__ == "__main__":
    main()
