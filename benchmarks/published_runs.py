"""Published training runs replayed: each run's own layout forced, its step predicted, and
the prediction set against what its authors measured.

The runs are in benchmarks/published_runs.json (sources, hardware, model shapes, parallel
degrees, schedule, recomputation, precision and the measured throughput, each with where
it was read; fp8 rows kept and flagged).  For each run this script builds the model on the
meta device (Llama-style rows with autopar's Llama, GPT and MPT rows with its GPT; the
published shapes: layers, width, heads, key/value heads, SwiGLU width, vocabulary),
plans it on a mesh (pp, dp, cp, tp) of the run's degrees with the run's layout forced
(`autopar.plan(..., layout=..., pipeline=autopar.Pipeline(...), recompute=...)`) on the
preset of its GPU, and compares tokens per second per GPU:

    predicted = tokens per step / (predicted step seconds x GPUs)
    measured  = the source's tokens/s/GPU; where it publishes only model TFLOP/s per GPU,
                tokens/s/GPU = TFLOP/s / FLOPs per token, with the source's own formula
                (Narayanan et al. 2021: 96 l h^2 (1 + s/6h + V/16lh), recomputation
                counted; Megatron-LM's README, model FLOPs: 72 l h^2 (1 + s/6h) + 6 V h)

A run that accumulates gradients over several micro-steps (global batch / (micro batch x
data-parallel degree) of them; one sequence each where the source does not say) is
planned on one micro-step's batch, whose activations are what the device holds, with
`autopar.plan(accumulation=...)`: its step is that many micro-steps' forward and backward
(with FSDP's gathers and reduce-scatters in each) plus, once, the optimizer step, the weight
gathers after it and, for a run that is not FSDP, the gradient reduction (`step_seconds`).
Overlaps a run states that autopar's runtime does not have (Megatron-LM's parameter-gather
and tensor-parallel communication overlap) are taken off; a pipelined run's step is the
schedule's.  autopar's own plan of the job is compared with the published layout both as
autopar's runtime runs them (the speedup: plan against plan) and with the layout as it ran
(speedup_as_ran: where the run's runtime hides more than autopar's, this is below the first).

It prints every row (pred/meas), then per source and overall the median |pred/meas - 1|
and Spearman's rank correlation, for the fitting rows and the held-out rows apart (the
split is in the data file, made by a fixed rule before anything was predicted; nothing in
autopar is fitted on the held-out rows), and the planning time: the whole replay's and
its slowest plan's, against issue 39's targets (15 minutes on 2 cores; no plan over 60 s).
The rows without pipeline stages are planned in parallel, one process per core (--jobs);
the staged rows after them, one at a time, each pipeline search costing its candidates on
every core.

What is not modelled yet is said per row instead of guessed: fp8 rows are skipped
(--fp8 plans them in bf16, flagged), the 500 W HBM2e H100 (whose peak is published only as a
range) is marked, and a run whose layout autopar cannot force is listed with the reason.

Run:
    python benchmarks/published_runs.py                       # every bf16/fp16 row (sampled, see --sample)
    python benchmarks/published_runs.py --source torchtitan   # one source
    python benchmarks/published_runs.py --sample 0            # every row, no sampling
    python benchmarks/published_runs.py --json out.json       # the rows as JSON too
    python benchmarks/published_runs.py --jobs 1              # every row in this process
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import autopar
from autopar.models import build

DATA = Path(__file__).with_name("published_runs.json")

# GPU as the sources state it -> (autopar preset, exact: whether the preset is that part; the
# 500 W HBM2e H100's peak is published only as a range, so its preset is a bound)
PRESET_OF = {"h100-sxm": ("h100-sxm", True), "a100-80gb": ("a100-80gb", True), "a100-40gb": ("a100-40gb", True),
             "h100-hbm2e-500w": ("h100-hbm2e-500w", False), "h200": ("h200", True)}
SCHEDULE = {"1f1b": "1f1b", "interleaved-1f1b": "interleaved-1f1b", "interleaved 1f1b": "interleaved-1f1b",
            "gpipe": "gpipe", "zero-bubble": "zero-bubble"}


def measured_tokens_per_s(run: dict) -> tuple[float | None, str]:
    """(tokens/s/GPU the source measured, how it was read)."""
    m, d = run["measured"], run.get("derived") or {}
    if m.get("tokens_per_s_per_gpu"):
        return float(m["tokens_per_s_per_gpu"]), "tokens/s/GPU"
    step = m.get("step_s") or d.get("step_s")
    tokens = run.get("tokens_per_step") or d.get("tokens_per_step")
    if step and tokens:
        return tokens / (step * run["hardware"]["gpus"]), "step time"
    tflops = m.get("tflops_per_gpu")
    if tflops and run["source"] == "narayanan2021" and d.get("tokens_per_s_per_gpu_from_paper_flops"):
        return float(d["tokens_per_s_per_gpu_from_paper_flops"]), "TFLOP/s, paper's formula"
    if tflops and run["source"] == "megatron-lm-readme":
        mod, s = run["model"], run["seq_len"]
        l, h, v = mod["n_layers"], mod["hidden"], mod["vocab"]
        per_token = 72 * l * h * h * (1 + s / (6 * h)) + 6 * v * h
        return tflops * 1e12 / per_token, "model TFLOP/s, 72lh^2(1+s/6h)+6Vh"
    return None, "no throughput this script can read"


def accumulation(run: dict) -> int:
    """Gradient-accumulation steps of a run without pipeline stages: global batch / (micro
    batch x data-parallel degree); each runs forward and backward on micro x dp sequences
    (its activations are what memory holds), so the planned batch is that and the step is
    that many planned steps.  A micro batch the source does not state is taken as one
    sequence (the smallest, so the layout is not charged activations it may never have
    held).  1 where the global batch is not published (or with stages: the pipeline's
    microbatches are planned as the schedule runs them)."""
    par, g, mb = run["parallel"], run.get("global_batch_sequences"), run.get("micro_batch") or 1
    if not g or (par.get("pp") or 1) > 1:
        return 1
    steps = g / (mb * (par.get("dp") or 1))
    return int(steps) if steps >= 1 and steps == int(steps) else 1


def stated_tp_overlap(run: dict) -> bool:
    """Whether the run hid its tensor-parallel collectives behind GEMMs (Megatron-LM's
    --tp-comm-overlap, torchtitan's async TP).  The run is planned with
    autopar.Pricing(tp_overlap=<this>), so that its price has the overlap it ran with:
    autopar's folds (input gradients and row-parallel outputs beside their GEMMs) standing
    for the run's, or every collective whole."""
    par = run["parallel"]
    return bool(par.get("tp_comm_overlap") or par.get("async_tp"))


def step_seconds(plan, run: dict, runtime: str = "published") -> float:
    """Seconds of the run's whole step from the plan of one micro-step, planned with the
    run's gradient accumulation (autopar.plan(accumulation=...)): every micro-step runs
    forward and backward (and, under FSDP / ZeRO-3, gathers its weights and reduce-scatters
    its gradients), and the plan charges each its share of what runs once per step (the
    optimizer step, the weights' gathers after it, the gradient reduction of a run that is
    not FSDP, of which what the last backward does not hide).

    `runtime` "published", the run's layout as it ran: the plan is priced with the
    tensor-parallel overlap the run states (stated_tp_overlap: none, or autopar's folds
    standing for it), and the overlaps a run states beyond autopar's runtime are taken off:
    Megatron-LM's --overlap-param-gather hides the distributed optimizer's gathers behind
    the next step's first forward (about a third of a micro-step's compute),
    --tp-comm-overlap all of the tensor-parallel collectives behind the GEMMs they feed.
    "autopar": the plan as autopar's runtime runs it (planned with tp_overlap=True), none
    of the run's own overlaps, the footing on which two plans of one job are compared.  A
    pipelined run's step is the schedule's."""
    if runtime not in ("published", "autopar"):
        raise ValueError(f"runtime {runtime!r}: 'published' or 'autopar'")
    want = True if runtime == "autopar" else stated_tp_overlap(run)
    if plan.tp_overlap != want:
        raise ValueError(f"a plan with tp_overlap={plan.tp_overlap} priced as {runtime!r} for {run['id']}: "
                         f"plan it with tp_overlap={want}")
    if plan.pipeline is not None:
        return plan.pipeline.step_s
    pred, par = plan.predicted, run["parallel"]
    steps = plan.accumulation
    if runtime == "autopar":
        return steps * pred.step_s
    gathers = steps * sum(c.seconds for c in plan.collectives_of(phase="step"))   # (planned at 1/steps each)
    shown = max(gathers - pred.compute_s / 3, 0.0) if par.get("dp_overlap") else gathers
    # (of the tensor-parallel collectives, what autopar's folds leave waiting)
    tp_hidden = (pred.comm_s.get("tp", 0.0) - pred.linear_hidden_s.get("tp", 0.0)) if par.get("tp_comm_overlap") else 0.0
    return steps * (pred.step_s - tp_hidden) - gathers + shown


def build_model(run: dict):
    """The run's model on the meta device, with a step's sequences of seq_len tokens (the
    global batch, or one accumulation step of it)."""
    mod, seq = run["model"], run["seq_len"]
    if not run.get("global_batch_sequences"):
        raise ValueError("no global batch published")
    batch = run["global_batch_sequences"] // accumulation(run)
    if mod["family"] == "llama":
        ffn = mod.get("ffn_hidden")
        # the SwiGLU width as published: rounding int(8 dim / 3) up to a multiple of itself gives it
        extra = dict(multiple_of=ffn, ffn_dim_multiplier=None) if ffn and ffn >= int(8 * mod["hidden"] / 3) else {}
        return build("llama3-8b", device="meta", batch=batch, seq=seq, dim=mod["hidden"], n_layers=mod["n_layers"],
                     n_heads=mod["n_heads"], n_kv_heads=mod.get("n_kv_heads") or mod["n_heads"],
                     vocab=mod.get("vocab") or 128256, max_seq=max(seq, 8192),
                     float_loss=run.get("loss_dtype") == "float32", **extra)
    if mod["family"] in ("gpt", "mpt"):
        if mod.get("ffn_hidden") and mod["ffn_hidden"] != 4 * mod["hidden"]:
            raise ValueError(f"GPT feed-forward width {mod['ffn_hidden']} is not 4 x {mod['hidden']}")
        return build("gpt2-124m", device="meta", batch=batch, seq=seq, hidden=mod["hidden"], n_layers=mod["n_layers"],
                     n_heads=mod["n_heads"], vocab=mod.get("vocab") or 50257, max_seq=seq,
                     bias=mod["family"] == "gpt")
    raise ValueError(f"model family {mod['family']!r} has no builder here")


def forced(run: dict) -> tuple[autopar.Mesh, dict]:
    """The mesh of the run's degrees and autopar.plan's keywords that force its layout."""
    par = run["parallel"]
    degrees = [("pp", par.get("pp") or 1), ("dp", par.get("dp") or 1), ("cp", par.get("cp") or 1),
               ("tp", par.get("tp") or 1)]
    if (par.get("ep") or 1) > 1:
        raise ValueError("expert parallelism: no MoE rows are replayed yet")
    gpus = run["hardware"]["gpus"]
    if math.prod(d for _, d in degrees) != gpus:
        raise ValueError(f"degrees {dict(degrees)} do not multiply to {gpus} GPUs")
    shape = tuple(d for _, d in degrees if d > 1) or (1,)
    names = tuple(a for a, d in degrees if d > 1) or ("dp",)
    preset, _ = PRESET_OF.get(run["hardware"]["gpu"], ("h100", False))
    device = autopar.mesh.PRESETS[preset]
    # the run's attention and loss kernels (the data file says which its software stack ran)
    device = dataclasses.replace(device, kernels=device.kernels.with_attention(run.get("attention_kernel", "sdpa"))
                                 .with_cross_entropy(run.get("loss_kernel", "torch")))
    mesh = autopar.Mesh(shape, names, device=device)
    sharded = par.get("fsdp") or (par.get("zero") or 0) >= 3
    tp, cp = (par.get("tp") or 1) > 1, (par.get("cp") or 1) > 1
    if cp and tp:
        raise ValueError("context parallelism with tensor parallelism has no hand-written layout yet")
    alone = (par.get("dp") or 1) == 1   # one axis within a stage: the layouts' names drop " x dp"
    if cp:
        # (FSDP over the context-parallel ranks too, as torchtitan shards over dp_shard x cp)
        layout = "context-parallel x zero3" if sharded else "context-parallel" if alone else "context-parallel x dp"
    elif tp:
        sp = par.get("sequence_parallel") or run.get("recompute") == "selective" and run["source"] == "korthikanti2022"
        kind = "megatron-sp" if sp else "megatron-tp"
        zero = par.get("zero") or 0
        layout = kind if alone else "megatron-tp x zero3" if sharded else \
            f"megatron-tp x zero{zero}" if zero in (1, 2) else f"{kind} x dp"
    elif sharded:
        layout = "zero3"
    elif (par.get("zero") or 0) in (1, 2):
        layout = f"zero{par['zero']}"
    else:
        layout = "data-parallel"
    kw = {"solve": autopar.SolveOptions(layout=layout, compare=False), "mixed_precision": autopar.MixedPrecision(),
          "pricing": autopar.Pricing(backend="inductor" if run.get("compile") else "eager",   # torch.compile'd runs
                                     accumulation=accumulation(run),                          # fuse as Inductor does
                                     tp_overlap=stated_tp_overlap(run))}
    if run.get("recompute") in ("none", "selective", "full"):
        kw["recompute"] = run["recompute"]
        if run["recompute"] == "selective" and run.get("recompute_policy") == "op":
            kw["recompute"] = "alternate"   # torchtitan's per-op policy: every second projection recomputed too
    if (par.get("pp") or 1) > 1:
        schedule = SCHEDULE.get(str(par.get("schedule") or "1f1b").lower().split(" (")[0], "1f1b")
        kw["pipeline"] = autopar.Pipeline(axis="pp", groups=par["pp"], schedule=schedule,
                                          microbatches=par.get("microbatches"),
                                          virtual=par.get("virtual_stages") or None)
    return mesh, kw


def terms(plan, run: dict, runtime: str = "published") -> dict:
    """The parts of a plan's step per micro-step, by name: compute, communication per mesh
    axis less what overlaps, or, pipelined, the schedule's step and bubble; and what the
    run's own overlaps take off (step_seconds)."""
    if plan.pipeline is not None:
        pp = plan.pipeline
        return {"pipeline step": pp.step_s}
    pred = plan.predicted
    out = {"compute": pred.compute_s, "hidden communication": -pred.hidden_s}
    out.update({f"communication on {axis}": s for axis, s in pred.comm_s.items()})
    out["the run's own overlaps"] = step_seconds(plan, run, runtime) / plan.accumulation - pred.step_s
    return out


def deciding(forced: dict, free: dict, slower: bool) -> str:
    """The term whose difference most explains why the free plan is slower (the one it
    pays most more for) or faster (the one it saves most on)."""
    names = sorted(set(forced) | set(free))
    delta_of = {k: free.get(k, 0.0) - forced.get(k, 0.0) for k in names}
    name = max(names, key=delta_of.get) if slower else min(names, key=delta_of.get)
    delta = delta_of[name]
    return f"{name} {'+' if delta >= 0 else '-'}{abs(delta) * 1e3:.1f} ms per micro-step"


def free_plan(run: dict, model, example, mesh: autopar.Mesh, forced_kw: dict) -> dict:
    """autopar's own plan of the same job: nothing forced, stages searched where the run has a
    pp axis; its predicted step against the forced layout's, and what differs."""
    kw = {"solve": autopar.SolveOptions(compare=False), "mixed_precision": forced_kw["mixed_precision"],
          "pricing": dataclasses.replace(forced_kw["pricing"], tp_overlap=True)}
    if "pipeline" in forced_kw:
        kw["pipeline"] = autopar.Pipeline(axis="pp")
    start = time.perf_counter()
    plan = autopar.plan(model, mesh, example, **kw)
    step = step_seconds(plan, run, "autopar")
    what = (f"{len(plan.pipeline.stages)} stages, {plan.pipeline.schedule} x {plan.pipeline.microbatches}"
            if plan.pipeline is not None else "no stages")
    if plan.recompute is not None and plan.recompute.layers:
        modes = collections.Counter(plan.recompute.layers.values())
        what += ", recompute " + ", ".join(f"{mode} x{n}" for mode, n in sorted(modes.items()))
    return {"free_step_s": step, "free_plan_s": time.perf_counter() - start, "free": what,
            "free_terms": terms(plan, run, "autopar")}


def replay(run: dict, free: bool = True) -> dict:
    """One row: predicted and measured tokens/s/GPU, or why it was not planned; with `free`,
    also autopar's own plan for the job."""
    row = {"id": run["id"], "source": run["source"], "split": run["split"], "gpu": run["hardware"]["gpu"],
           "gpus": run["hardware"]["gpus"], "model": run["model"]["name"]}
    meas, how = measured_tokens_per_s(run)
    row.update(measured=meas, read=how)
    if meas is None:
        return {**row, "skipped": how}
    try:
        model, example = build_model(run)
        mesh, kw = forced(run)
        start = time.perf_counter()
        plan = autopar.plan(model, mesh, example, **kw)
        row["plan_s"] = time.perf_counter() - start
    except Exception as exc:   # a row autopar cannot force is reported, not hidden
        return {**row, "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    steps = accumulation(run)
    tokens = example[0].numel() * steps
    step = step_seconds(plan, run)
    row.update(layout=kw["solve"].layout, pipeline=str(kw.get("pipeline") or ""), step_s=step, accumulation=steps,
               predicted=tokens / (step * row["gpus"]), ratio=tokens / (step * row["gpus"]) / meas,
               memory_gib=(max(plan.pipeline.memory) if plan.pipeline is not None else plan.predicted.memory_total) / 2**30, measured_memory_gib=run["measured"].get("memory_gib"),
               memory_kind=run["measured"].get("memory_kind", "allocated"), fp8=bool(run.get("fp8")),
               preset_exact=PRESET_OF.get(run["hardware"]["gpu"], ("", False))[1],
               over_memory=bool((max(plan.pipeline.memory) if plan.pipeline is not None else plan.predicted.memory_total)
               > mesh.device.memory))
    if free:
        try:
            row.update(free_plan(run, model, example, mesh, kw))
            if not plan.tp_overlap:   # the published layout as autopar's runtime runs it: TP beside GEMMs
                plan = autopar.plan(model, mesh, example,
                                    **dict(kw, pricing=dataclasses.replace(kw["pricing"], tp_overlap=True))) \
                    if (run["parallel"].get("tp") or 1) > 1 or (run["parallel"].get("cp") or 1) > 1 \
                    else dataclasses.replace(plan, tp_overlap=True)   # (no TP axis: nothing to fold)
            # plan against plan: both as autopar's runtime runs them; and autopar's plan as
            # autopar runs it against the published layout as it ran (the runtimes differ too)
            row["speedup"] = step_seconds(plan, run, "autopar") / row["free_step_s"]
            row["speedup_as_ran"] = step / row["free_step_s"]
            if abs(row["speedup"] - 1) > 0.005:
                why = deciding(terms(plan, run, "autopar"), row.pop("free_terms"), row["speedup"] < 1)
                row["free"] += f"; decides: {why}"
            else:
                row.pop("free_terms")
        except Exception as exc:
            row["free"] = f"not planned: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return row


def allocator_reserve(rows: list) -> float | None:
    """The caching allocator's reserved peak over the allocated peak, as the runs that report
    their reserved peak show it: the median, over the fitting rows only (bf16 rows, not fp8
    ones planned in bf16), of the measured reserved peak over the predicted allocated peak.
    autopar predicts what the allocator hands out (its runtime's `max_memory_allocated`, on
    one H200 within 0.3 %: docs/gpu/2026-11-28-h200-gpu_memory.txt); a source reporting the
    reserved peak counts, besides, the blocks the allocator holds free between tensors of
    other sizes.  On that H200 reserved/allocated was 1.02-1.07 under expandable segments and
    1.03-1.15 under the default allocator, autopar's runtime, 1B-parameter Llama, 8k tokens;
    FSDP fine-tuning runs publish 1.26-1.35 (Llama-2-7B on 4 A100, the default allocator:
    meta-llama/llama-recipes pull 41).  None where no fitting row reports a reserved peak."""
    fitting = [r["measured_memory_gib"] / r["memory_gib"] for r in rows
               if "ratio" in r and r.get("measured_memory_gib") and r.get("memory_kind") == "reserved"
               and r["split"] == "fit" and not r.get("fp8")]
    return statistics.median(fitting) if fitting else None


def memory_predicted(r: dict, reserve: float | None) -> float | None:
    """A row's predicted memory in the measure its source reports (GiB): the allocated peak,
    or times `reserve` where the source reports the reserved peak (None: no reserve fitted)."""
    if r.get("memory_kind") != "reserved":
        return r["memory_gib"]
    return r["memory_gib"] * reserve if reserve is not None else None


def spearman(xs: list, ys: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = k
        return r
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def summary(rows: list) -> list:
    """(group, split, n, median |pred/meas - 1|, Spearman) per source and overall."""
    out = []
    done = [r for r in rows if "ratio" in r]
    for group in sorted({r["source"] for r in done}) + ["all"]:
        for split in ("fit", "held_out"):
            sel = [r for r in done if (group == "all" or r["source"] == group) and r["split"] == split]
            if sel:
                err = statistics.median(abs(r["ratio"] - 1) for r in sel)
                out.append((group, split, len(sel), err, spearman([r["predicted"] for r in sel],
                                                                   [r["measured"] for r in sel])))
    return out


def show(r: dict) -> None:
    """Print one replayed row."""
    if "ratio" in r:
        flag = ("" if r["preset_exact"] else "  (preset is a bound)") + (
            f"  (over memory: {r['memory_gib']:.0f} GiB predicted)" if r["over_memory"] else "")
        speed = f"{r['speedup']:.2f}x, {r['speedup_as_ran']:.2f}x as it ran ({r['free']}; planned in " \
            f"{r['free_plan_s']:.1f}s)" if "speedup" in r \
            else r.get("free", "")
        print(f"{r['id'][:52]:<52} {r['split']:<8} {r['layout'][:22]:<22} {r['measured']:>8.0f} "
              f"{r['predicted']:>8.0f} {r['ratio']:>9.2f}  {r['plan_s']:.1f}s  {speed}{flag}", flush=True)
    else:
        print(f"{r['id'][:52]:<52} {r['split']:<8} skipped: {r['skipped']}", flush=True)


def _one_core() -> None:
    """A replay worker plans on its own core: one torch thread, no forked planning lanes."""
    os.environ["AUTOPAR_WORKERS"] = "1"
    torch.set_num_threads(1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", help="only these sources (repeatable)")
    parser.add_argument("--fp8", action="store_true", help="also plan fp8 rows (in bf16; flagged)")
    parser.add_argument("--sample", type=int, default=24,
                        help="at most this many rows per source, drawn with a fixed seed (0: all)")
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("--no-free", action="store_true", help="skip autopar's own plan of each job")
    parser.add_argument("--markdown", help="write the summary and every row here as a markdown table")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                        else os.cpu_count() or 1,
                        help="processes for the rows without pipeline stages, one core each (default: the cores "
                             "this process may use); the staged rows run after them one at a time, each plan's "
                             "pipeline search using every core")
    args = parser.parse_args(argv)
    runs = json.loads(DATA.read_text())["runs"]
    runs = [r for r in runs if (args.fp8 or not r.get("fp8")) and (not args.source or r["source"] in args.source)]
    if args.sample:
        picked = []
        for source in sorted({r["source"] for r in runs}):
            mine = sorted((r for r in runs if r["source"] == source), key=lambda r: r["id"])
            picked += sorted(random.Random(0).sample(mine, args.sample), key=lambda r: r["id"]) \
                if len(mine) > args.sample else mine
        runs = picked
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    print(f"{'run':<52} {'split':<8} {'layout':<22} {'meas':>8} {'pred':>8} {'pred/meas':>9}  plan   "
          f"free plan: speedup over the published layout")
    free = not args.no_free
    staged = [run for run in runs if (run["parallel"].get("pp") or 1) > 1]
    plain = [run for run in runs if (run["parallel"].get("pp") or 1) <= 1]
    done = {}
    if args.jobs > 1 and len(plain) > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_one_core) as pool:
            for r in pool.map(replay, plain, [free] * len(plain)):
                done[r["id"]] = r
                show(r)
    for run in plain + staged:
        if run["id"] not in done:
            done[run["id"]] = r = replay(run, free=free)
            show(r)
    rows = [done[run["id"]] for run in runs]
    print(f"\n{len([r for r in rows if 'ratio' in r])} of {len(rows)} rows planned in "
          f"{time.perf_counter() - start:.0f} s (fp8 rows {'planned in bf16' if args.fp8 else 'left out'})")
    timed = [(r[key], r["id"], what) for r in rows for key, what in (("plan_s", "published layout"),
                                                                     ("free_plan_s", "autopar's own plan"))
             if key in r]
    if timed:
        secs, rid, what = max(timed)
        print(f"slowest plan: {secs:.1f} s ({what} of {rid}); {sum(s > 60 for s, _, _ in timed)} of {len(timed)} "
              f"plans over 60 s")
    print()
    print(f"{'source':<24} {'split':<9} {'rows':>4} {'median |pred/meas-1|':>21} {'Spearman':>9}")
    for group, split, n, err, rho in summary(rows):
        print(f"{group:<24} {split:<9} {n:>4} {err:>20.1%} {rho:>9.2f}")
    freed = [r for r in rows if "speedup" in r]
    if freed:
        slower = [r["id"] for r in freed if r["speedup"] < 0.999 and not r["over_memory"]]
        print(f"\nautopar's own plans: median {statistics.median(r['speedup'] for r in freed):.2f}x the published "
              f"layout's predicted throughput (range {min(r['speedup'] for r in freed):.2f}-"
              f"{max(r['speedup'] for r in freed):.2f}x); predicted slower than a published layout that fits: "
              f"{', '.join(slower) or 'none'} (both as autopar runs them)")
        behind = [f"{r['id']} {r['speedup_as_ran']:.3f}x" for r in freed
                  if r["speedup_as_ran"] < 0.999 and not r["over_memory"]]
        print(f"against the published layout as it ran, with its runtime's overlaps: median "
              f"{statistics.median(r['speedup_as_ran'] for r in freed):.2f}x; below 1: {', '.join(behind) or 'none'}")
    over = [r["id"] for r in rows if r.get("over_memory")]
    if over:
        print(f"published layouts predicted not to fit where they ran ({len(over)}): {', '.join(over)}")
    memory = [r for r in rows if "ratio" in r and r.get("measured_memory_gib")]
    if memory:
        reserve = allocator_reserve(rows)
        print("\nmemory, where the source states it (GiB per GPU): the predicted allocated peak; where the "
              "source reports the reserved peak, times the allocator's reserve"
              + (f" ({reserve:.3f}, fitted on the fitting bf16 rows: allocator_reserve)" if reserve else
                 " (none fitted: no fitting bf16 row reports it)"))
        print(f"  {'run':<52} {'split':<8} {'measure':<9} {'allocated':>9} {'predicted':>9} {'measured':>9} {'pred/meas':>9}")
        errors = collections.defaultdict(list)
        for r in memory:
            pred = memory_predicted(r, reserve)
            ratio = pred / r["measured_memory_gib"] if pred else float("nan")
            if pred and not r.get("fp8"):
                errors[r["split"]].append(abs(ratio - 1))
            print(f"  {r['id'][:52]:<52} {r['split']:<8} {r['memory_kind']:<9} {r['memory_gib']:9.1f} "
                  f"{pred or float('nan'):9.1f} {r['measured_memory_gib']:9.1f} {ratio:9.3f}"
                  + ("  (fp8, planned in bf16)" if r.get("fp8") else ""))
        for split in ("fit", "held_out"):
            if errors[split]:
                print(f"  memory, bf16 {split} rows: median |pred/meas - 1| {statistics.median(errors[split]):.1%}, "
                      f"largest {max(errors[split]):.1%} ({len(errors[split])} rows)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=float))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 0


def markdown(rows: list) -> str:
    """The summary per source and split, then every row, as markdown tables."""
    out = ["| source | split | rows | median \\|pred/meas - 1\\| | Spearman |", "| --- | --- | --- | --- | --- |"]
    out += [f"| {g} | {split} | {n} | {err:.1%} | {rho:.2f} |" for g, split, n, err, rho in summary(rows)]
    out += ["", "| run | source | split | forced layout | measured tok/s/GPU | predicted | pred/meas | memory GiB "
            "(predicted / measured) | autopar's own plan (speedup over the published layout as autopar runs it, and as it ran) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    reserve = allocator_reserve(rows)
    for r in rows:
        if "ratio" not in r:
            out.append(f"| {r['id']} | {r['source']} | {r['split']} | not planned: {r['skipped']} | | | | | |")
            continue
        memory = f"{r['memory_gib']:.1f}"
        if r.get("measured_memory_gib"):
            pred = memory_predicted(r, reserve)
            memory = (f"{memory} allocated, {pred:.1f} reserved" if r.get("memory_kind") == "reserved" and pred
                      else memory) + f" / {r['measured_memory_gib']:.1f}"
        if r["over_memory"]:
            memory += " (over)"
        free = f"{r['speedup']:.2f}x, {r['speedup_as_ran']:.2f}x as it ran ({r['free']})" if "speedup" in r \
            else r.get("free", "")
        out.append(f"| {r['id']} | {r['source']} | {r['split']} | {r['layout']} | {r['measured']:.0f} | "
                   f"{r['predicted']:.0f} | {r['ratio']:.2f} | {memory} | {free} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
