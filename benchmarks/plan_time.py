"""How long autopar takes to plan, and how much memory it needs, for real model sizes.

For each case the model is built on the meta device (no weights exist) and planned with
`autopar.plan`; one row reports:

- planning wall time from `plan.timing`: total, and its trace (torch.export), costs
  (strategy menus and cost model) and ILP (CP-SAT) parts.  "other" is the rest of the
  total: with comparison on, mostly solving the hand-written layouts (one ILP each);
- the process's peak resident memory (`ru_maxrss`) before building the model and after
  planning, and the increase;
- the ILP's size (variables, constraints) and whether it was solved to optimality (gap);
- the predicted step time, and the best hand-written layout (data parallel, ZeRO-3,
  Megatron, ...) that fits in device memory, with its predicted step time over
  autopar's (>1.00x: autopar is faster).

Each case runs in a fresh Python process (this script with the hidden `--one CASE`), so
the peak memory of one case is not inherited by the next.

Target: llama3-8b on 64 devices (dp=8 x tp=8) planned in under 10 s on a 2-core machine.
For reference, PyTorch's own ILP autoparallel reports about 37 s of solving alone for
the same model and mesh.

Planning at scale (`--scale`): the cases below, in bf16, without the hand-written layouts,
each against its target (printed as target / time; >= 1.00 meets it) and stopped after
`--timeout` seconds (default 600; a case still running is reported as not finished):

- 8b-8x8: llama3-8b on 8x8 H100, batch 64 x 2048, no pipeline search: <= 3 s;
- 8b-8x8-pp: the same with pipeline search: <= 2x the time of 8b-8x8;
- 70b-1024: llama3-70b on 128x8 H100, batch 128 x 2048: <= 10 s;
- 405b-16k-pp: a 405B-shaped Llama (126 layers, hidden 16,384, 128 heads) on 16,384 H100
  as pp 16 x dp 128 x tp 8, batch 2048 x 2048, with pipeline search: <= 60 s and under 2 GB;
- dsv3-2048, dsv3-2048-pp, qwen3-235b-2048, qwen3-235b-2048-pp: DeepSeek-V3 (transformers'
  config: 61 layers of multi-head latent attention, 256 routed experts) and Qwen3-MoE-235B-A22B's
  config (94 layers, 128 experts) on 2,048 H100, each as dp 256 x ep 8, and as pp 32 x dp 8 x
  ep 8 with pipeline search; batch 256 x 4096: each <= 120 s and 8 GiB (the planner and its
  largest worker together).

For reference, PyTorch's own ILP autoparallel reports 37 s of solving for llama3-8b on 64
GPUs (no pipeline search), and Alpa 2,393 s to compile GPT-39B for 64 GPUs.

Run:
    python benchmarks/plan_time.py                        # all cases, with baselines
    python benchmarks/plan_time.py --scale                # the planning-at-scale targets
    python benchmarks/plan_time.py --scale --cases 8b-8x8 # one of them
    python benchmarks/plan_time.py --cases llama3-8b      # one case
    python benchmarks/plan_time.py --no-compare           # skip the hand-written layouts
    python benchmarks/plan_time.py --json plan_time.json  # also write the rows as JSON
"""
from __future__ import annotations

import autopar
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

REFERENCE_ILP_S = 37.0     # PyTorch autoparallel, ILP solve only, llama3-8b on 8x8 H100
TARGET_TOTAL_S = 10.0      # our target for the whole of planning, llama3-8b on 8x8
TARGET_CASE = "llama3-8b"
ROW_MARK = "PLAN_TIME_ROW "  # prefix of the one JSON line a `--one` child prints


@dataclass(frozen=True)
class Case:
    model: str
    shape: tuple
    axes: tuple
    device: str = "h100"
    batch: int | None = None   # global batch of the example inputs (None: the preset's)
    seq: int | None = None
    overrides: tuple = ()      # model config fields ((name, value), ...)
    precision: str | None = None
    pipeline: bool = False
    target_s: float | None = None     # planning time target
    relative_to: str | None = None    # target_s is a multiple of this case's time
    target_bytes: float | None = None  # peak memory target
    hf: tuple = ()             # a transformers config instead of a preset: (model_type, (field, value), ...)

    @property
    def label(self) -> str:
        return self.hf[0] if self.hf else self.model

    @property
    def mesh_label(self) -> str:
        return "x".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))


CASES = {
    "gpt2-124m": Case("gpt2-124m", (8,), ("dp",)),
    # one sequence of 2048 tokens per data-parallel rank, so data parallelism is possible
    "llama3-8b": Case("llama3-8b", (8, 8), ("dp", "tp"), batch=8),
    "llama3-70b": Case("llama3-70b", (16, 8), ("dp", "tp"), batch=16),
}
QWEN3_235B = ("qwen3_moe", ("hidden_size", 4096), ("num_hidden_layers", 94), ("num_attention_heads", 64),
              ("num_key_value_heads", 4), ("head_dim", 128), ("moe_intermediate_size", 1536),
              ("intermediate_size", 12288), ("num_local_experts", 128), ("num_experts_per_tok", 8),
              ("vocab_size", 151936))   # Qwen3-235B-A22B's config
SCALE = {
    "8b-8x8": Case("llama3-8b", (8, 8), ("dp", "tp"), batch=64, seq=2048, precision="bf16", target_s=3.0),
    "8b-8x8-pp": Case("llama3-8b", (8, 8), ("dp", "tp"), batch=64, seq=2048, precision="bf16", pipeline=True,
                      target_s=2.0, relative_to="8b-8x8"),
    "70b-1024": Case("llama3-70b", (128, 8), ("dp", "tp"), batch=128, seq=2048, precision="bf16", target_s=10.0),
    "405b-16k-pp": Case("llama3-70b", (16, 128, 8), ("pp", "dp", "tp"), batch=2048, seq=2048,
                        overrides=(("dim", 16384), ("n_layers", 126), ("n_heads", 128), ("ffn_dim_multiplier", 1.2)),
                        precision="bf16", pipeline=True, target_s=60.0, target_bytes=2 * 2**30),
    # frontier mixtures of experts from their transformers configs (no weights), 256 x 4096 tokens
    "dsv3-2048": Case("", (256, 8), ("dp", "ep"), batch=256, seq=4096, precision="bf16", hf=("deepseek_v3",),
                      target_s=120.0, target_bytes=8 * 2**30),
    "dsv3-2048-pp": Case("", (32, 8, 8), ("pp", "dp", "ep"), batch=256, seq=4096, precision="bf16", pipeline=True,
                         hf=("deepseek_v3",), target_s=120.0, target_bytes=8 * 2**30),
    "qwen3-235b-2048": Case("", (256, 8), ("dp", "ep"), batch=256, seq=4096, precision="bf16", target_s=120.0,
                            target_bytes=8 * 2**30, hf=QWEN3_235B),
    "qwen3-235b-2048-pp": Case("", (32, 8, 8), ("pp", "dp", "ep"), batch=256, seq=4096, precision="bf16",
                               pipeline=True, target_s=120.0, target_bytes=8 * 2**30, hf=QWEN3_235B),
}
ALL = {**CASES, **SCALE}


def _maxrss_bytes() -> int:
    """Peak resident memory of this process so far; Linux reports KiB, macOS bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _cpu_seconds() -> float:
    """CPU seconds this process and its finished children (the forked planners) have used:
    the work planning does, which a loaded machine stretches in wall time but not here."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_one(name: str, compare: bool) -> dict:
    """Plan one case in this process and return its row."""
    rss_start = _maxrss_bytes()  # before torch is imported
    import autopar
    from autopar.models import build
    from autopar.report.plan import Prediction

    case = ALL[name]
    rss_before = _maxrss_bytes()
    start = time.perf_counter()
    overrides = dict(case.overrides)
    overrides.update({k: v for k, v in (("batch", case.batch), ("seq", case.seq)) if v})
    if case.hf:
        model, example_inputs, example_kwargs = hf_case(case)
    else:
        model, example_inputs = build(case.model, device="meta", **overrides)
        example_kwargs = None
    t_build = time.perf_counter() - start
    mesh = autopar.Mesh(case.shape, case.axes, device=case.device)
    cpu_start = _cpu_seconds()
    plan = autopar.plan(model, mesh, example_inputs, example_kwargs=example_kwargs,
                        solve=autopar.SolveOptions(compare=compare), mixed_precision=case.precision,
                        pipeline=case.pipeline)
    cpu = _cpu_seconds() - cpu_start
    rss_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    rss_after = _maxrss_bytes()
    pp = plan.pipeline

    # The layouts are costed without a memory budget; only those that fit a device count.
    best, over_memory = None, []
    for layout, pred in plan.baselines.items():
        if not isinstance(pred, Prediction):
            continue
        if pred.memory_total > mesh.device.memory:
            over_memory.append(layout)
        elif best is None or pred.step_s < best[1]:
            best = (layout, pred.step_s)
    t = plan.timing
    return {
        "case": name, "model": case.label, "mesh": case.mesh_label, "devices": mesh.size,
        "build_s": t_build, "trace_s": t.trace_s, "costs_s": t.costs_s, "ilp_s": t.solve_s,
        "total_s": t.total_s, "cpu_s": cpu, "other_s": t.total_s - t.trace_s - t.costs_s - t.solve_s,
        "rss_import_bytes": rss_before - rss_start,
        "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
        "rss_increase_bytes": rss_after - rss_before,
        "rss_workers_bytes": rss_children,   # the largest forked worker's peak (pipeline search)
        "variables": plan.solver.variables, "constraints": plan.solver.constraints,
        "graph_nodes": plan.solver.graph_nodes, "optimal": bool(plan.solver.optimal),
        "gap": float(plan.solver.gap),
        "step_s": plan.step_s,
        "memory_bytes": plan.memory_per_device,
        "candidates": pp.candidates if pp is not None else None,
        "layout": pp.summary if pp is not None else None,
        "best_layout": best[0] if best else None,
        "best_layout_step_s": best[1] if best else None,
        "best_layout_ratio": best[1] / plan.predicted.step_s if best else None,
        "baselines_failed": sorted(k for k, v in plan.baselines.items() if not isinstance(v, Prediction)),
        "baselines_over_memory": over_memory, "device_memory_bytes": mesh.device.memory,
    }


def hf_case(case: Case):
    """(model, (), kwargs) of a case given as a transformers config, on the meta device."""
    import transformers
    import torch

    kind, *fields = case.hf
    cfg = transformers.AutoConfig.for_model(kind, **dict(fields))
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.zeros((case.batch, case.seq), dtype=torch.long, device="meta")
    return model, (), {"input_ids": ids, "labels": ids}


def run_case_subprocess(name: str, compare: bool, timeout: float | None = None) -> dict:
    """Run `run_one` in a fresh interpreter; on failure the child's stderr goes to ours."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name]
    if not compare:
        cmd.append("--no-compare")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"not finished in {timeout:.0f} s", "process_s": time.perf_counter() - start,
                "timeout": True}
    wall = time.perf_counter() - start
    rows = [line[len(ROW_MARK):] for line in proc.stdout.splitlines() if line.startswith(ROW_MARK)]
    if proc.returncode != 0 or not rows:
        sys.stderr.write(proc.stderr)
        return {"case": name, "error": f"exit code {proc.returncode}", "process_s": wall}
    row = json.loads(rows[-1])
    row["process_s"] = wall
    return row


# --- printing ----------------------------------------------------------------------------

def _s(x: float) -> str:
    return f"{x:.2f}s"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}M"


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}ms" if seconds < 1 else f"{seconds:.3f}s"


COLUMNS = [  # (header, width, row -> text)
    ("case", 11, lambda r: r["case"]),
    ("mesh", 12, lambda r: r["mesh"]),
    ("total", 7, lambda r: _s(r["total_s"])),
    ("trace", 7, lambda r: _s(r["trace_s"])),
    ("costs", 7, lambda r: _s(r["costs_s"])),
    ("ILP", 7, lambda r: _s(r["ilp_s"])),
    ("other", 7, lambda r: _s(r["other_s"])),
    ("process", 8, lambda r: _s(r["process_s"])),
    ("rss before", 11, lambda r: _mib(r["rss_before_bytes"])),
    ("rss peak", 9, lambda r: _mib(r["rss_after_bytes"])),
    ("increase", 9, lambda r: _mib(r["rss_increase_bytes"])),
    ("vars", 7, lambda r: str(r["variables"])),
    ("cons", 7, lambda r: str(r["constraints"])),
    ("ILP state", 10, lambda r: "optimal" if r["optimal"] else f"gap {r['gap']:.2%}"),
]


def print_header(compare: bool) -> None:
    print("autopar planning time and memory (models on the meta device)")
    print(f"machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}, {platform.machine()}")
    print(f"target:   {TARGET_CASE} on 64 devices (dp=8 x tp=8) planned in under {TARGET_TOTAL_S:.0f} s "
          f"on a 2-core machine")
    print(f"baseline: PyTorch's own ILP autoparallel reports about {REFERENCE_ILP_S:.0f} s of solving "
          f"alone for the same model and mesh")
    print("columns:  total = trace + costs + ILP + other (other: hand-written layouts"
          + (", one ILP each)" if compare else "; off with --no-compare)")
          + "; process: wall time of the child process incl. imports; rss in MiB (ru_maxrss)")
    print()


def print_table(rows: list[dict], compare: bool) -> None:
    print("  ".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (h, w, _) in enumerate(COLUMNS)))
    print("-" * (sum(w for _, w, _ in COLUMNS) + 2 * (len(COLUMNS) - 1)))
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<11}  failed ({r['error']}), see the traceback above")
            continue
        print("  ".join(f"{f(r):<{w}}" if i < 2 else f"{f(r):>{w}}" for i, (_, w, f) in enumerate(COLUMNS)))

    print()
    print(f"{'case':<11}  {'predicted step':>14}  {'memory/device':>13}  best hand-written layout that fits")
    for r in rows:
        if "error" in r:
            continue
        if not compare:
            best = "(skipped: --no-compare)"
        elif r["best_layout"] is None:
            best = "(none feasible)"
        else:
            best = (f"{r['best_layout']} {_t(r['best_layout_step_s'])} = {r['best_layout_ratio']:.2f}x "
                    f"autopar's step")
        if r["baselines_failed"]:
            best += f"; infeasible: {', '.join(r['baselines_failed'])}"
        if r["baselines_over_memory"]:
            best += (f"; over {r['device_memory_bytes'] / 2**30:.0f} GiB/device: "
                     f"{', '.join(r['baselines_over_memory'])}")
        print(f"{r['case']:<11}  {_t(r['step_s']):>14}  {r['memory_bytes'] / 2**30:>10.2f}GiB  {best}")

    target = next((r for r in rows if r["case"] == TARGET_CASE and "error" not in r), None)
    if target is not None:
        print()
        print(f"{TARGET_CASE} on {target['mesh']}: ILP {target['ilp_s']:.2f}s -> "
              f"{REFERENCE_ILP_S:.0f} / {target['ilp_s']:.2f} = {REFERENCE_ILP_S / target['ilp_s']:.1f}x "
              f"faster than PyTorch autoparallel's reported solve")
        verdict = "meets" if target["total_s"] < TARGET_TOTAL_S else "MISSES"
        print(f"{TARGET_CASE} on {target['mesh']}: total {target['total_s']:.2f}s -> "
              f"{TARGET_TOTAL_S:.0f} / {target['total_s']:.2f} = {TARGET_TOTAL_S / target['total_s']:.2f}x "
              f"({verdict} the {TARGET_TOTAL_S:.0f} s target on {os.cpu_count()} cores)")


def print_scale(rows: list[dict]) -> None:
    """The planning-at-scale table: time, peak memory, candidates, gap, against each target."""
    print("autopar planning at scale (bf16, pipeline search where named; no hand-written layouts)")
    print(f"machine: {os.cpu_count()} CPU cores, Python {platform.python_version()}")
    print()
    by = {r["case"]: r for r in rows}
    print(f"{'case':<12} {'mesh':<22} {'time':>8} {'rss peak':>9} {'cand.':>6} {'ILP':>9} {'step':>10}  target")
    for r in rows:
        case = SCALE[r["case"]]
        if "error" in r:
            t = r.get("process_s", 0.0)
            verdict = f"MISSES (>= {t:.0f} s)" if r.get("timeout") and case.target_s and not case.relative_to \
                else "-"
            print(f"{r['case']:<12} {case.mesh_label:<22} {r['error']:>40}  {verdict}")
            continue
        target = case.target_s
        what = f"<= {target:.0f} s"
        if case.relative_to:
            base = by.get(case.relative_to)
            target = target * base["total_s"] if base and "error" not in base else None
            what = f"<= {case.target_s:.0f}x {case.relative_to}"
        parts = []
        if target:
            parts.append(f"{what}: {target / r['total_s']:.2f}x ({'meets' if r['total_s'] <= target else 'MISSES'})")
        if case.target_bytes:   # (the planner's peak and its largest forked worker's, as if at once)
            peak = r["rss_after_bytes"] + r.get("rss_workers_bytes", 0)
            ok = peak <= case.target_bytes
            parts.append(f"< {case.target_bytes / 2**30:.0f} GiB (with workers {_mib(peak)}): "
                         f"{case.target_bytes / peak:.2f}x ({'meets' if ok else 'MISSES'})")
        gap = "optimal" if r["optimal"] else f"gap {r['gap']:.2%}"
        print(f"{r['case']:<12} {case.mesh_label:<22} {_s(r['total_s']):>8} {_mib(r['rss_after_bytes']):>9} "
              f"{r['candidates'] if r['candidates'] is not None else '-':>6} {gap:>9} {_t(r['step_s']):>10}  "
              + "; ".join(parts))
    for r in rows:
        if "error" not in r and r.get("layout"):
            print(f"  {r['case']}: {r['layout']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(ALL),
                        help="cases to run (default: all, or all the --scale ones)")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="do not cost the hand-written layouts")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--scale", action="store_true", help="the planning-at-scale cases and their targets")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a case is stopped")
    parser.add_argument("--one", choices=list(ALL), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:
        print(ROW_MARK + json.dumps(run_one(args.one, args.compare)), flush=True)
        return 0
    if args.scale:
        rows = []
        for name in args.cases or SCALE:
            print(f"planning {name} ...", file=sys.stderr, flush=True)
            rows.append(run_case_subprocess(name, False, args.timeout))
        print_scale(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"scale": True, "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
        return 0

    print_header(args.compare)
    rows = []
    for name in args.cases or CASES:
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        rows.append(run_case_subprocess(name, args.compare, args.timeout))
    print_table(rows, args.compare)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compare": args.compare, "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
