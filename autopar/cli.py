"""The `autopar` command line.

    autopar models
    autopar plan --model gpt2-124m --mesh 2x4 --axes dp,tp --device h100 [--precision bf16|fp32] \\
                 [--budget 70GiB] [--batch N] [--seq N] [--set key=value ...] [--save plan.json] \\
                 [--pipeline | --pipeline-stages N --schedule 1f1b --microbatches M] [--recompute full] \\
                 [--html report.html] [--json]
    autopar plan --hf llama --set num_hidden_layers=8 --mesh 8x8       (a transformers config, no weights)
    autopar report plan.json -o report.html
    autopar compare a.json b.json
    torchrun --nproc_per_node 4 -m autopar calibrate --out profile.json [--mesh 2x2 --axes dp,tp]
    autopar plan --model gpt2-124m --mesh 2x2 --device profile.json

`plan` builds the model on the meta device (no weights exist, so any size plans on a
laptop), plans it on the mesh and prints the plan.  Errors in what was asked for (an
unknown model, a bad mesh, a plan file it cannot read) exit with code 2 and one line
saying what to do (autopar/cli_args.py reads and checks the values).  Each subcommand is
an `_add_*` function adding its parser plus a `_cmd_*` function running it, so new ones
slot in.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections import Counter

import torch
import torch.distributed as dist

import autopar

from autopar.cli_args import (
    HF_COUNTS, UsageError, check_count, device_of, parse_axes, parse_bandwidth, parse_budget, parse_mesh,
    parse_overrides, pipeline_of)
from autopar.report.html import write_report
from autopar.models import PRESETS, ConfigError, build, list_models
from autopar.solve.pipeline.options import SCHEDULE_CHOICES
from autopar.report.plan import PlanFileError
from autopar.report.records import format_bytes, format_seconds
from autopar.solve.recompute.modes import MODES
from autopar.report.text import node_layout, table_rows
from autopar.runtime.calibrate.fit import calibrate

log = logging.getLogger("autopar")


# --- subcommands -------------------------------------------------------------------------

def _cmd_models(args) -> int:

    for name in list_models():
        p = PRESETS[name]
        shape = f"batch={p.batch}" + (f", seq={p.seq}" if p.seq is not None else "")
        print(f"{name:<12} {p.model_cls.__name__:<6} {shape}")
    return 0


def _cmd_calibrate(args) -> int:
    check_count("--repeats", args.repeats, "the timed runs per measurement", 5)
    if "RANK" not in os.environ:
        raise UsageError("calibrate measures the cluster from every rank: run it under torchrun, e.g. "
                         "torchrun --nproc_per_node 4 -m autopar calibrate --out profile.json")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        shape = parse_mesh(args.mesh) if args.mesh else (dist.get_world_size(),)
        axes = parse_axes(args.axes, shape) if args.mesh or args.axes else ("dp",)
        try:
            spec = calibrate(shape, axes, base=args.base, repeats=args.repeats, force=args.force, out=args.out,
                             offload_dir=args.offload_dir)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if dist.get_rank() == 0:
            rates = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in spec.flops)
            print(f"{spec.source}\n  compute: {rates}; memory {spec.mem_bandwidth / 1e9:.3g} GB/s; "
                  f"op latency {spec.op_latency * 1e6:.1f} us" +
                  (f"; a model step's work x{spec.compute_scale:.3f} the single ops' (step check)"
                   if spec.compute_scale != 1.0 else ""))
            print(f"  host memory {spec.host_memory / 2**30:.1f} GiB per device" + (
                f"; disk {spec.disk_memory / 2**30:.1f} GiB per device, write {spec.disk_write_bandwidth / 1e9:.3g} "
                f"GB/s, read {spec.disk_read_bandwidth / 1e9:.3g} GB/s" if args.offload_dir else ""))
            for kind, where, bw, lat, launch in spec.links:
                print(f"  {kind:<15}{where:<6}{bw / 1e9:9.3g} GB/s {lat * 1e6:9.1f} us/step {launch * 1e6:9.1f} us/call")
            if args.out:
                print(f"wrote {args.out}; plan with it: autopar plan --device {args.out} ...")
    finally:
        dist.destroy_process_group()
    return 0


def _cmd_plan(args) -> int:
    shape = parse_mesh(args.mesh)
    axes = parse_axes(args.axes, shape)
    overrides = parse_overrides(args.set)
    check_count("--batch", args.batch, "the global batch of the example inputs", 8)
    check_count("--seq", args.seq, "the sequence length of the example inputs", 2048)
    check_count("--pipeline-stages", args.pipeline_stages, "the number of pipeline stages", 2, least=2)
    check_count("--microbatches", args.microbatches, "the pipeline microbatches per step", 8)
    parse_budget(args.budget)
    try:
        mesh = autopar.Mesh(shape, axes, device=device_of(args.device), bandwidth=parse_bandwidth(args.bandwidth, shape))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    pipeline = pipeline_of(args, mesh)
    if args.hf is not None:
        model, inputs, kwargs = hf_model(args.hf, overrides, args.batch, args.seq)
        what = f"{type(model).__name__} from transformers config {args.hf!r}"
    else:
        model, inputs = preset_model(args.model, overrides, args.batch, args.seq)
        kwargs = None
        what = f"{args.model} ({', '.join(f'{k}={v}' for k, v in overrides.items()) or 'preset config'})"
    precision = args.precision or ("fp32" if mesh.device.name.startswith("cpu") else "bf16")
    mixed = autopar.MixedPrecision(torch.bfloat16) if precision == "bf16" else None
    log.info("planning %s on %s in %s%s", what, mesh, precision,
             "; searching pipeline stages, this takes a while: progress follows" if args.pipeline else "")
    try:
        plan = autopar.plan(model, mesh, inputs, example_kwargs=kwargs, memory_budget=args.budget,
                            mixed_precision=mixed, pipeline=pipeline,
                            recompute=None if args.recompute == "auto" else args.recompute,
                            pricing=autopar.Pricing(moe_imbalance=getattr(args, "moe_imbalance", None),
                                                    accumulation=getattr(args, "accumulation", 1)),
                            solve=autopar.SolveOptions(compare=not args.no_compare))
    except autopar.InfeasibleError as exc:
        print(f"autopar: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:   # a pipeline or layout the model or mesh cannot take
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(plan_summary(plan), indent=1))
    else:
        print(plan)
    if args.save:
        plan.save(args.save)
        log.info("saved the plan to %s", args.save)
    if args.html:
        write_report(plan, args.html)
        log.info("wrote the report to %s: open it in a browser", args.html)
    return 0


def preset_model(name: str, overrides: dict, batch, seq):
    """(model on the meta device, example inputs) of a preset, its config overridden."""
    if name not in list_models():
        raise UsageError(f"unknown model {name!r}; choose one of {', '.join(list_models())} "
                         f"(see `autopar models`), or give a transformers config with --hf")
    overrides = dict(overrides)
    for key, value in (("batch", batch), ("seq", seq)):
        if value is not None:
            overrides[key] = value
    try:
        return build(name, device="meta", **overrides)
    except ConfigError as exc:  # a --set field (--batch and --seq are checked before): named, with what it may be
        raise UsageError(f"--set {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except TypeError as exc:  # a value of the wrong type reached the model's constructor
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        raise UsageError(f"model {name!r} rejected {given}: {exc}; check the types of the --set values") from None


def hf_model(config: str, overrides: dict, batch: int | None, seq: int | None):
    """(model, (), kwargs) of a Hugging Face causal LM built from `config` on the meta device:
    a model type of the installed transformers ("llama", "mistral", "qwen2": its default
    config) or a local config.json (or a folder holding one); --set overrides config fields.
    No weights are read and nothing is downloaded.  kwargs: input_ids and labels of
    [batch (default 8), seq (default min(2048, max_position_embeddings))] tokens."""
    try:  # an optional dependency (the `test` extra): only --hf needs it, and importing it takes a second
        import transformers
    except ImportError:
        raise UsageError("--hf needs the transformers package: pip install transformers") from None
    fields = {}
    if os.path.exists(config):   # the file's fields, then --set's; fields it derives (head_dim) as it states them
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                fields = json.load(f)
            if not isinstance(fields, dict):
                raise ValueError(f"it holds a JSON {type(fields).__name__}, not an object")
            kind = fields.pop("model_type")
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise UsageError(f"cannot read the transformers config {path}: {type(exc).__name__} {exc}; give a "
                             f"config.json with a model_type, as save_pretrained writes it") from None
    else:
        kind = config
    try:
        defaults = transformers.AutoConfig.for_model(kind)
    except ValueError:
        raise UsageError(f"--hf {config!r} is neither a file nor a model type of transformers "
                         f"{transformers.__version__}; give a model type such as llama, mistral, qwen2, "
                         f"gpt2, or the path of a config.json") from None
    for key, value in overrides.items():
        if not hasattr(defaults, key):
            raise UsageError(f"--set {key}: {type(defaults).__name__} has no field {key!r}; e.g. num_hidden_layers, "
                             f"hidden_size, intermediate_size, num_attention_heads, vocab_size")
        if key in HF_COUNTS and not (value is None and getattr(defaults, key) is None) and (
                type(value) is not int or value < 1):
            raise UsageError(f"--set {key}={value!r}: {type(defaults).__name__}.{key} must be a whole number of "
                             f"at least 1")
    fields.pop("transformers_version", None)
    given = " ".join(f"--set {k}={v!r}" for k, v in overrides.items())
    try:
        cfg = transformers.AutoConfig.for_model(kind, **{**fields, **overrides})   # derived fields follow --set
        cfg.use_cache = False
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as exc:  # noqa: BLE001 - transformers' config checks, or a value its layers cannot take
        text = " ".join(str(exc).split())   # (its validation errors span lines)
        raise UsageError(f"transformers builds no causal LM from --hf {config!r}"
                         f"{' with ' + given if given else ''}: {type(exc).__name__}: {text}"
                         f"{'; check the --set values' if given else ''}") from None
    seq = seq or min(2048, getattr(cfg, "max_position_embeddings", None) or 2048)
    ids = torch.zeros((batch or 8, seq), dtype=torch.long, device="meta")
    return model, (), {"input_ids": ids, "labels": ids}


def plan_summary(plan) -> dict:
    """What `autopar plan --json` prints: the prediction, solver, pipeline and the
    hand-written layouts' predictions, in seconds and bytes per device."""
    def pred(p):
        if isinstance(p, str):
            return {"possible": False, "reason": p}
        return {"step_s": p.step_s, "compute_s": p.compute_s, "comm_s": dict(p.comm_s), "hidden_s": p.hidden_s,
                "memory": dict(p.memory), "memory_total": p.memory_total}

    pp = plan.pipeline
    mesh = plan.device_mesh()
    return {
        "model": plan.model, "hash": plan.hash(), "origin": plan.origin,
        "mesh": {"shape": list(mesh.shape), "axes": list(mesh.axis_names), "device": mesh.device.name,
                 "inside_node": list(mesh.inside)},
        "precision": None if plan.precision is None else plan.precision.to_dict(),
        "memory_budget": plan.memory_budget or plan.mesh.device.memory,
        "predicted": pred(plan.predicted),
        "step_s": plan.step_s,
        "pipeline": None if pp is None else {"stages": len(pp.stages) if pp.pipelined else 1, "axis": pp.axis,
                                             "schedule": pp.schedule, "microbatches": pp.microbatches,
                                             "step_s": pp.step_s, "no_pipeline_step_s": pp.no_pipeline_step_s,
                                             "bubble": pp.bubble, "memory": list(pp.memory)},
        "recompute": None if plan.recompute is None else dict(plan.recompute.layers),
        "solver": plan.solver.to_dict(), "timing": plan.timing.to_dict(),
        "baselines": {name: pred(p) for name, p in plan.baselines.items()},
        "collectives": len(plan.collectives), "nodes": len(plan.nodes),
    }


def load_plan(path: str):
    try:
        return autopar.Plan.load(path)
    except FileNotFoundError:
        raise UsageError(f"no plan file {path}; write one with autopar plan ... --save {path}") from None
    except PlanFileError as exc:
        raise UsageError(str(exc)) from None


def _cmd_report(args) -> int:
    plan = load_plan(args.plan)
    out = args.out or os.path.splitext(args.plan)[0] + ".html"
    write_report(plan, out)
    print(f"wrote {out}: open it in a browser (it needs no network)")
    return 0


def _cmd_compare(args) -> int:
    a, b = load_plan(args.a), load_plan(args.b)
    print(compare_text(a, b, args.a, args.b))
    return 0


def compare_text(a, b, name_a: str = "A", name_b: str = "B") -> str:
    """What differs between plans a and b: predicted step and memory (per axis and category),
    pipeline, the collectives per phase, kind and axis, and the layouts that changed, one
    line per row of a's per-module table (repeated layers collapsed)."""
    lines = [f"A: {name_a}: {a.model} on {a.device_mesh()}", f"B: {name_b}: {b.model} on {b.device_mesh()}"]
    if a.graph and b.graph and a.graph != b.graph:
        lines.append("the plans are of different graphs (another model, size, batch or precision): layouts are matched by "
                     "node name where both have the node")
    step_a, step_b = a.step_s, b.step_s
    lines.append(f"step:   {format_seconds(step_a):>10} -> {format_seconds(step_b):>10}  ({_ratio(step_b, step_a)})")
    lines.append(f"memory: {format_bytes(a.memory_per_device):>10} -> {format_bytes(b.memory_per_device):>10}  "
                 f"({_ratio(b.memory_per_device, a.memory_per_device)})")
    pa, pb = a.predicted, b.predicted
    rows = [("compute", pa.compute_s, pb.compute_s, format_seconds)]
    rows += [(f"comm {ax}", pa.comm_s.get(ax, 0.0), pb.comm_s.get(ax, 0.0), format_seconds)
             for ax in dict.fromkeys([*pa.comm_s, *pb.comm_s])]
    rows += [(f"memory {k}", pa.memory.get(k, 0.0), pb.memory.get(k, 0.0), format_bytes)
             for k in dict.fromkeys([*pa.memory, *pb.memory])]
    for label, x, y, fmt in rows:
        if fmt(x) != fmt(y):
            lines.append(f"  {label:<20}{fmt(x):>10} -> {fmt(y):>10}")
    summary_a = a.pipeline.summary if a.pipeline is not None else "pipeline: not searched"
    summary_b = b.pipeline.summary if b.pipeline is not None else "pipeline: not searched"
    if summary_a != summary_b:
        lines += [f"A {summary_a}", f"B {summary_b}"]
    if (a.precision is None) != (b.precision is None) or (a.precision and a.precision.to_dict() != b.precision.to_dict()):
        lines.append(f"precision: {a.precision and a.precision.to_dict()} -> {b.precision and b.precision.to_dict()}")
    tally_a = Counter((c.phase, c.kind, "+".join(c.axes)) for c in a.collectives)
    tally_b = Counter((c.phase, c.kind, "+".join(c.axes)) for c in b.collectives)
    changed = [k for k in sorted(set(tally_a) | set(tally_b)) if tally_a[k] != tally_b[k]]
    if changed:
        lines.append("collectives per step:")
        lines += [f"  {p:<9}{kind:<15} on {ax:<8}{tally_a[k]:>6} -> {tally_b[k]}" for k in changed
                  for p, kind, ax in [k]]
    theirs = {n.name: n for n in b.nodes}
    layout_lines, rows = [], table_rows(a)
    changed_rows = 0
    for row in rows:
        moved = Counter()
        for n in row.nodes:
            m = theirs.get(n.name)
            if m is not None and (m.strategy, m.outputs) != (n.strategy, n.outputs):
                moved[(m.strategy + " " + node_layout(m)).strip()] += 1
        changed_rows += bool(moved)
        for to, count in moved.items():
            of = f" ({count} of {row.count} nodes)" if count != row.count else ""
            layout_lines.append(f"  {row.label}  {row.op.replace('aten.', '')}: "
                                f"{(row.strategy + ' ' + row.layout).strip()}  ->  {to}{of}")
    only_a = sum(1 for n in a.nodes if n.name not in theirs)
    if only_a:
        layout_lines.append(f"  {only_a} nodes of A are not in B")
    lines.append(f"layouts that changed ({changed_rows} of {len(rows)} rows of A's table):" if layout_lines
                 else "layouts: the same")
    lines += layout_lines
    return "\n".join(lines)


def _ratio(new: float, old: float) -> str:
    if not old:
        return "n/a"
    return f"{new / old:.2f}x" if abs(new / old - 1) > 5e-3 else "same"


EXAMPLES = """commands, one example each:
  models      autopar models
  plan        autopar plan --model llama3-8b --mesh 8x8 --save llama.json --html llama.html
              autopar plan --hf llama --set num_hidden_layers=8 --mesh 8x8 --pipeline --json
  report      autopar report llama.json -o llama.html
  compare     autopar compare llama.json llama-fp32.json
  calibrate   torchrun --nproc_per_node 4 -m autopar calibrate --out profile.json

`autopar COMMAND --help` lists a command's options."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Plan the parallel training of a PyTorch model.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-q", "--quiet", action="store_true", help="log only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in (_add_models, _add_plan, _add_report, _add_compare, _add_calibrate):
        add(sub)
    return parser


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the model presets")
    p.set_defaults(func=_cmd_models)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="plan a model on a device mesh and print the plan",
                       description="Build a preset model (or a transformers config) on the meta device, plan it on "
                                   "a mesh, print the plan.",
                       epilog="example: autopar plan --model llama3-8b --mesh 8x8 --save llama.json --html llama.html",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="preset name (see `autopar models`)")
    which.add_argument("--hf", metavar="CONFIG",
                       help="a Hugging Face causal LM: a model type of the installed transformers (llama, mistral, "
                            "qwen2, ...; its default config) or a local config.json; --set changes its fields "
                            "(e.g. --set num_hidden_layers=8); no weights, no network")
    p.add_argument("--mesh", required=True, help="axis sizes joined by 'x', outermost first: 8x8, 64, 2x4")
    p.add_argument("--axes", help="comma-separated axis names, one per mesh axis (default dp / dp,tp)")
    p.add_argument("--device", default="h100",
                   help=f"device preset ({', '.join(autopar.mesh.PRESETS)}; default h100) or a profile from `autopar calibrate`")
    p.add_argument("--bandwidth", metavar="GB/S,...",
                   help="link bandwidth per mesh axis in GB/s, e.g. 2.5,450 for a slow network between nodes "
                        "(default: the device's, by whether the axis is inside a node)")
    p.add_argument("--budget", help="memory per device, e.g. 70GiB (default: the device's memory)")
    p.add_argument("--batch", type=int, help="global batch of the example inputs")
    p.add_argument("--seq", type=int, help="sequence length of the example inputs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --set n_layers=2 (repeatable)")
    p.add_argument("--precision", choices=("bf16", "fp32"),
                   help="bf16 mixed precision (float32 master weights) or float32 throughout "
                        "(default: bf16 on GPU devices, fp32 on cpu)")
    p.add_argument("--pipeline", action="store_true",
                   help="also search pipeline stages (cuts, sub-meshes, schedule, microbatches); slower")
    p.add_argument("--pipeline-stages", type=int, metavar="N",
                   help="pipeline over N device groups (stages; x virtual under interleaved-1f1b)")
    p.add_argument("--pipeline-axis", metavar="AXIS", help="the mesh axis cut into pipeline groups")
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, help="pipeline schedule")
    p.add_argument("--microbatches", type=int, metavar="M", help="pipeline microbatches per step")
    p.add_argument("--asynchronous", action="store_true",
                   help="allow pipelines without a flush between steps (pipedream-2bw: each step's gradient "
                        "taken at the weights one update older)")
    p.add_argument("--recompute", choices=("auto", *MODES), default="auto",
                   help="activation recomputation: auto (the solver chooses per layer where memory needs it; "
                        "default) or one policy for every repeated layer")
    p.add_argument("--moe-imbalance", type=float, metavar="R",
                   help="mixture of experts: the busiest expert rank's routed rows over the mean "
                        "(default: uniformly random routing)")
    p.add_argument("--accumulation", type=int, default=1, metavar="K",
                   help="gradient accumulation: micro-steps per optimizer step (--batch is one micro-step's); "
                        "the optimizer step and gradient reductions are priced once per K micro-steps")
    p.add_argument("--no-compare", action="store_true", help="do not cost the hand-written layouts")
    p.add_argument("--save", metavar="PATH", help="write the plan as JSON (autopar.Plan.load reads it)")
    p.add_argument("--html", metavar="PATH", help="write the plan's HTML report (as `autopar report` does)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary instead of the plan")
    p.set_defaults(func=_cmd_plan)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="render a saved plan as one self-contained HTML page",
                       description="Render a plan saved by `autopar plan --save` (or plan.save) as one HTML file "
                                   "with its charts inline: it opens offline in any browser.",
                       epilog="example: autopar report llama.json -o llama.html")
    p.add_argument("plan", help="a plan JSON file")
    p.add_argument("-o", "--out", metavar="PATH", help="the HTML file to write (default: the plan's name, .html)")
    p.set_defaults(func=_cmd_report)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="print what differs between two saved plans",
                       description="Print the predicted step and memory of two plans, what changed per axis and "
                                   "category, the collectives per step, and every layout that changed.",
                       epilog="example: autopar compare llama.json llama-fp32.json")
    p.add_argument("a", help="the first plan JSON file")
    p.add_argument("b", help="the second plan JSON file")
    p.set_defaults(func=_cmd_compare)


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this cluster's compute and collectives (under torchrun)",
                       description="Measure matmul and memory rates and each collective per mesh axis on every "
                                   "rank, fit the cost model and write a device profile.  Run under torchrun.")
    p.add_argument("--out", metavar="PATH", help="write the profile here (JSON; autopar.DeviceSpec.load reads it)")
    p.add_argument("--mesh", help="the mesh to measure axis by axis, e.g. 2x4 (default: one axis over every rank)")
    p.add_argument("--axes", help="comma-separated axis names, one per mesh axis")
    p.add_argument("--base", choices=sorted(autopar.mesh.PRESETS),
                   help="preset whose unmeasured numbers are kept (default h100 on GPUs, cpu otherwise)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (default 5)")
    p.add_argument("--force", action="store_true", help="measure again even if this cluster is cached")
    p.add_argument("--offload-dir", metavar="DIR",
                   help="time writing and reading files here (the disk tier: autopar.RunOptions(offload_dir=DIR))")
    p.set_defaults(func=_cmd_calibrate)


def _file_problem(exc: OSError) -> str:
    """What went wrong with a file the command was given, and the fix."""
    name = exc.filename if exc.filename is not None else "a file"
    if isinstance(exc, IsADirectoryError):
        return f"{name!s} is a folder; give a file's path (a plan's JSON, as `autopar plan --save` writes it)"
    if isinstance(exc, FileNotFoundError):
        folder = os.path.dirname(os.fspath(name)) if exc.filename is not None else ""
        if folder and not os.path.isdir(folder):
            return f"cannot write {name!s}: its folder {folder} does not exist; create it first or choose another path"
        return f"{name!s} does not exist"
    return f"cannot open {name!s}: {exc.strerror or exc}"


def _joined(argv: list) -> list:
    """`--budget -5GiB` as `--budget=-5GiB`: argparse takes a value that starts with a dash
    and a digit but is not a plain number for an option of its own ("expected one
    argument"); joined, the option's own check names what is wrong with it."""
    out = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-[0-9.]", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(_joined(list(sys.argv[1:] if argv is None else argv)))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `autopar plan ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:   # a file the command reads or writes: named, with what to do, not a traceback
        print(f"autopar {args.command}: error: {_file_problem(exc)}", file=sys.stderr)
        return 2
    finally:
        log.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
