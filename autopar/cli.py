"""The `autopar` command line.

    autopar models
    autopar plan --model gpt2-124m --mesh 2x4 --axes dp,tp --device h100 [--precision bf16|fp32] \\
                 [--budget 70GiB] [--batch N] [--seq N] [--set key=value ...] [--save plan.json]
    torchrun --nproc_per_node 4 -m autopar calibrate --out profile.json [--mesh 2x2 --axes dp,tp]
    autopar plan --model gpt2-124m --mesh 2x2 --device profile.json

`plan` builds the model on the meta device (no weights exist, so any size plans on a
laptop), plans it on the mesh and prints the plan.  Errors in what was asked for (an
unknown model, a bad mesh) exit with code 2 and one line saying what to do.
Each subcommand is a parser plus a `_cmd_*` function, so new ones (e.g. `demo`) slot in.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import torch
import torch.distributed as dist

import autopar

from .mesh import parse_shape
from .models import PRESETS, build, list_models
from .runtime.calibrate import calibrate

log = logging.getLogger("autopar")


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit code 2."""


# --- parsing helpers ---------------------------------------------------------------------

def parse_mesh(text: str) -> tuple[int, ...]:
    """'2x4' -> (2, 4); '8' -> (8,).  The spelling is autopar.Mesh's (autopar.mesh.parse_shape)."""
    try:
        return parse_shape(text)
    except ValueError:
        raise UsageError(f"cannot read --mesh {text!r}; write the positive axis sizes joined by 'x', "
                         f"e.g. --mesh 8x8 or --mesh 64") from None


def parse_axes(text: str | None, shape: tuple[int, ...]) -> tuple[str, ...]:
    """'dp,tp' -> ('dp', 'tp'); None -> dp, tp, ... defaults for the mesh's rank."""
    if text is None:
        defaults = {1: ("dp",), 2: ("dp", "tp"), 3: ("pp", "dp", "tp")}
        return defaults.get(len(shape), tuple(f"ax{i}" for i in range(len(shape))))
    axes = tuple(a.strip() for a in text.split(","))
    if len(axes) != len(shape) or not all(axes):
        raise UsageError(f"--axes {text!r} names {len(axes)} axes but --mesh {'x'.join(map(str, shape))} has "
                         f"{len(shape)}; give one comma-separated name per mesh axis, e.g. --axes "
                         f"{','.join(parse_axes(None, shape))}")
    if len(set(axes)) != len(axes):
        raise UsageError(f"--axes {text!r} repeats a name; mesh axis names must be distinct")
    return axes


def parse_value(text: str):
    """'4096' -> 4096, '1.3' -> 1.3, 'true'/'false' -> bool, 'none' -> None, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def parse_overrides(items: list[str]) -> dict:
    """['hidden=4096', 'n_layers=2'] -> {'hidden': 4096, 'n_layers': 2}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"cannot read --set {item!r}; write --set key=value, e.g. --set n_layers=2")
        out[key.strip()] = parse_value(value.strip())
    return out


# --- subcommands -------------------------------------------------------------------------

def _cmd_models(args) -> int:

    for name in list_models():
        p = PRESETS[name]
        shape = f"batch={p.batch}" + (f", seq={p.seq}" if p.seq is not None else "")
        print(f"{name:<12} {p.model_cls.__name__:<6} {shape}")
    return 0


def _cmd_calibrate(args) -> int:
    if "RANK" not in os.environ:
        raise UsageError("calibrate measures the cluster from every rank: run it under torchrun, e.g. "
                         "torchrun --nproc_per_node 4 -m autopar calibrate --out profile.json")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        shape = parse_mesh(args.mesh) if args.mesh else (dist.get_world_size(),)
        axes = parse_axes(args.axes, shape) if args.mesh or args.axes else ("dp",)
        try:
            spec = calibrate(shape, axes, base=args.base, repeats=args.repeats, force=args.force, out=args.out)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if dist.get_rank() == 0:
            rates = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in spec.flops)
            print(f"{spec.source}\n  compute: {rates}; memory {spec.mem_bandwidth / 1e9:.3g} GB/s; "
                  f"op latency {spec.op_latency * 1e6:.1f} us")
            for kind, where, bw, lat, launch in spec.links:
                print(f"  {kind:<15}{where:<6}{bw / 1e9:9.3g} GB/s {lat * 1e6:9.1f} us/step {launch * 1e6:9.1f} us/call")
            if args.out:
                print(f"wrote {args.out}; plan with it: autopar plan --device {args.out} ...")
    finally:
        dist.destroy_process_group()
    return 0


def device_of(text: str):
    """--device: a preset name, or a profile written by `autopar calibrate --out`."""
    if text.endswith(".json") or os.path.sep in text:
        try:
            return autopar.DeviceSpec.load(text)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return text


def _cmd_plan(args) -> int:

    if args.model not in list_models():
        raise UsageError(f"unknown model {args.model!r}; choose one of {', '.join(list_models())} "
                         f"(see `autopar models`)")
    shape = parse_mesh(args.mesh)
    axes = parse_axes(args.axes, shape)
    overrides = parse_overrides(args.set)
    for key in ("batch", "seq"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.budget is not None:
        try:
            autopar.mesh.parse_bytes(args.budget, "--budget")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        mesh = autopar.Mesh(shape, axes, device=device_of(args.device))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        model, example_inputs = build(args.model, device="meta", **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except TypeError as exc:  # a value of the wrong type reached the model's constructor
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        raise UsageError(f"model {args.model!r} rejected {given}: {exc}; check the types of the --set values") from None

    precision = args.precision or ("fp32" if mesh.device.name.startswith("cpu") else "bf16")
    mixed = autopar.MixedPrecision(torch.bfloat16) if precision == "bf16" else None
    log.info("planning %s (%s) on %s", args.model, ", ".join(f"{k}={v}" for k, v in overrides.items()) or
             "preset config", mesh)
    try:
        plan = autopar.plan(model, mesh, example_inputs, memory_budget=args.budget,
                            compare=not args.no_compare, mixed_precision=mixed)
    except autopar.InfeasibleError as exc:
        print(f"autopar: {exc}", file=sys.stderr)
        return 1
    print(plan)
    if args.save:
        plan.save(args.save)
        log.info("saved the plan to %s", args.save)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Plan the parallel training of a PyTorch model.")
    parser.add_argument("-q", "--quiet", action="store_true", help="log only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("models", help="list the model presets")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("plan", help="plan a preset model on a device mesh and print the plan",
                       description="Build a preset model on the meta device, plan it on a mesh, print the plan.")
    p.add_argument("--model", required=True, help="preset name (see `autopar models`)")
    p.add_argument("--mesh", required=True, help="axis sizes joined by 'x', outermost first: 8x8, 64, 2x4")
    p.add_argument("--axes", help="comma-separated axis names, one per mesh axis (default dp / dp,tp)")
    p.add_argument("--device", default="h100",
                   help="device preset (h100, a100, cpu; default h100) or a profile from `autopar calibrate`")
    p.add_argument("--budget", help="memory per device, e.g. 70GiB (default: the device's memory)")
    p.add_argument("--batch", type=int, help="global batch of the example inputs")
    p.add_argument("--seq", type=int, help="sequence length of the example inputs")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. --set n_layers=2 (repeatable)")
    p.add_argument("--precision", choices=("bf16", "fp32"),
                   help="bf16 mixed precision (float32 master weights) or float32 throughout "
                        "(default: bf16 on GPU devices, fp32 on cpu)")
    p.add_argument("--no-compare", action="store_true", help="do not cost the hand-written layouts")
    p.add_argument("--save", metavar="PATH", help="write the plan as JSON (autopar.Plan.load reads it)")
    p.set_defaults(func=_cmd_plan)

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
    p.set_defaults(func=_cmd_calibrate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
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
    finally:
        log.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
