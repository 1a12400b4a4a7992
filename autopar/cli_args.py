"""The values of the `autopar` command line (autopar/cli.py), read and checked: the mesh, its
axis names and bandwidths, counts, the memory budget, --set overrides, the device and the
pipeline asked for.  A mistake raises UsageError, which the command prints as one line
saying what to write instead (exit code 2).
"""
from __future__ import annotations

import math
import os

import autopar

from autopar.mesh import parse_shape


class UsageError(Exception):
    """A mistake in the command line; printed as one line, exit code 2."""


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


def parse_bandwidth(text: str | None, shape: tuple[int, ...]) -> tuple[float, ...] | None:
    """'2.5,450' (GB/s per mesh axis, outermost first) -> (2.5e9, 450e9); None: the device's."""
    if text is None:
        return None
    try:
        values = tuple(float(v) * 1e9 for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != len(shape) or not all(math.isfinite(v) and v > 0 for v in values):
        raise UsageError(f"cannot read --bandwidth {text!r}; give one positive GB/s per mesh axis joined by ',', "
                         f"e.g. --bandwidth {','.join(['2.5'] + ['450'] * (len(shape) - 1))}")
    return values


def check_count(option: str, value: int | None, what: str, example: int, least: int = 1) -> None:
    """An integer option (argparse made it an int) is at least `least`, or a UsageError naming
    the option, the value and what it may be."""
    if value is not None and value < least:
        raise UsageError(f"{option} {value}: {what} must be a whole number of at least {least}, "
                         f"e.g. {option} {example}")


def parse_budget(text: str | None) -> float | None:
    """--budget '70GiB' -> bytes per device; a size a model cannot train in (under 1 MiB, most
    likely a unit left out: a bare number is bytes) is refused."""
    if text is None:
        return None
    try:
        value = autopar.mesh.parse_bytes(text, "--budget")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if value < 2**20:
        raise UsageError(f"--budget {text!r} is {value:g} bytes per device, under 1 MiB: a size without a unit "
                         f"is in bytes; write the unit, e.g. --budget {text}GiB")
    return value


# Hugging Face config fields that count something (sizes, layers, heads, experts): --set must
# give them a whole number >= 1 (or None where the config's own default is None).
HF_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
             "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "n_embd",
             "n_layer", "n_head", "n_positions", "n_inner", "multi_query_group_num", "num_key_value_groups")


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


def device_of(text: str):
    """--device: a preset name, or a profile written by `autopar calibrate --out`."""
    if text.endswith(".json") or os.path.sep in text:
        try:
            return autopar.DeviceSpec.load(text)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return text


def pipeline_of(args, mesh):
    """--pipeline: True (search); --pipeline-stages/--schedule/--microbatches/--pipeline-axis:
    an autopar.Pipeline fixing those (the plan is then always pipelined); else False."""
    fixed = dict(axis=args.pipeline_axis, groups=args.pipeline_stages, schedule=args.schedule,
                 microbatches=args.microbatches)
    if all(v is None for v in fixed.values()) and not getattr(args, "asynchronous", False):
        return bool(args.pipeline)
    wanted = autopar.Pipeline(**fixed, asynchronous=getattr(args, "asynchronous", False))
    try:
        wanted.check(mesh)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return wanted
