"""The planning description of a cluster: mesh shape, axis names, device and link speeds.

A `Mesh` needs no process group: plans for 1024+ devices are made on one CPU. At run time
the runtime turns it into a torch `DeviceMesh` of the same shape and axis names.  What a
device sustains (DeviceSpec) and the device presets are described in autopar/devices.py.
"""
from __future__ import annotations

import itertools
import math
import numbers
import re
from dataclasses import dataclass, field, replace

from autopar.devices import GEMM, HBM, NCCL, NETWORK, NVLINK, PRESETS, DeviceSpec, KernelEfficiency

# The device names users and the docs read from this module (autopar.mesh.DeviceSpec,
# PRESETS, NCCL, KernelEfficiency; GEMM ..., named by the presets' sources), exported here.
__all__ = ["Mesh", "DeviceSpec", "KernelEfficiency", "PRESETS", "NCCL", "GEMM", "HBM", "NVLINK", "NETWORK",
           "parse_bytes", "parse_shape", "parse_axis_names"]


# Longest suffix first, so "70GiB" is read as GiB and not as B.
_UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
          "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "B": 1}


def parse_bytes(value: int | float | str | None, name: str = "memory size") -> float | None:
    """'70GiB' -> 75161927680.0, '80GB' -> 8e10, 1e9 or '1e9' -> 1e9 bytes; None stays None.

    `name` is the argument the value came from (e.g. "memory_budget"), for the error."""
    if value is None:
        return None
    fix = "write a positive size such as '70GiB', '80GB' or a number of bytes"
    if isinstance(value, str):
        text = value.replace(" ", "")
        unit = next((u for u in _UNITS if text.endswith(u)), None)
        try:
            number = float(text[: len(text) - len(unit)] if unit else text) * _UNITS.get(unit, 1)
        except ValueError:
            raise ValueError(f"cannot read {name} {value!r}; {fix}") from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"{name} {value!r} is not a size; {fix}")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} {value!r} is not a positive, finite number of bytes; {fix}")
    return number


def _is_size(value) -> bool:
    """A positive integer: an int or a numpy integer, not a bool or a float such as 2.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def parse_shape(shape) -> tuple[int, ...]:
    """A mesh shape as the user spells it: (2, 4), [2, 4], '2x4' -> (2, 4); 8 or '8' -> (8,)."""
    fix = "sizes must be positive integers, e.g. (2, 4), 8 or '2x4'"
    if isinstance(shape, str):
        text = shape.lower().replace(" ", "").replace("\u00d7", "x")
        if not re.fullmatch(r"[0-9]+(x[0-9]+)*", text):
            raise ValueError(f"cannot read mesh shape {shape!r}; write the axis sizes joined by 'x', "
                             f"e.g. '2x4' or '8', or pass a tuple such as (2, 4)")
        sizes = tuple(int(s) for s in text.split("x"))
    elif isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        sizes = (shape,)
    elif isinstance(shape, (tuple, list)):
        sizes = tuple(shape)
    else:
        raise ValueError(f"mesh shape {shape!r}: {fix}")
    if not sizes or not all(_is_size(s) for s in sizes):
        raise ValueError(f"mesh shape {shape!r}: {fix}")
    return tuple(int(s) for s in sizes)


def parse_axis_names(axis_names, shape: tuple[int, ...]) -> tuple[str, ...]:
    """'tp' -> ('tp',); ('dp', 'tp') stays; None -> ('ax0', 'ax1', ...), one per axis of `shape`."""
    default = tuple(f"ax{i}" for i in range(len(shape)))
    if axis_names is None:
        return default
    names = (axis_names,) if isinstance(axis_names, str) else axis_names
    fix = f"give one name per axis, distinct non-empty strings, or leave axis_names out for {default}"
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"mesh axis_names {axis_names!r}: names must be non-empty strings; {fix}")
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"mesh axis_names {axis_names!r}: {len(names)} names for the {len(shape)} axes "
                         f"of shape {shape}; {fix}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh axis_names {axis_names!r}: names repeat; {fix}")
    return names


@dataclass(frozen=True)
class Mesh:
    """A logical device mesh for planning.

    Mesh((8, 8), ("dp", "tp"), device="h100"): 64 devices; the innermost (last) axes are
    placed inside a node first, so with 8 devices per node "tp" runs over NVLink and "dp"
    over the network.  `bandwidth` / `latency` (one value per axis, bytes/s and seconds)
    override what follows from the device preset.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device: DeviceSpec = field(default=PRESETS["h100"])
    bandwidth: tuple[float, ...] = ()
    latency: tuple[float, ...] = ()

    def __init__(self, shape, axis_names=None, device: str | DeviceSpec = "h100", bandwidth=None,
                 latency=None, devices_per_node: int | None = None, memory=None):
        shape = parse_shape(shape)
        axis_names = parse_axis_names(axis_names, shape)
        if isinstance(device, str) and device.endswith(".json"):
            device = DeviceSpec.load(device)
        if isinstance(device, str):
            if device not in PRESETS:
                raise ValueError(f"unknown device {device!r}; presets are {sorted(PRESETS)} "
                                 f"or pass an autopar.mesh.DeviceSpec")
            device = PRESETS[device]
        if devices_per_node is not None:
            if not _is_size(devices_per_node):
                raise ValueError(f"mesh devices_per_node {devices_per_node!r}: must be a positive integer, e.g. 8")
            device = replace(device, devices_per_node=int(devices_per_node))
        if memory is not None:
            device = replace(device, memory=parse_bytes(memory, "mesh memory"))
        inside = self.inside_node(shape, device.devices_per_node)
        default_bw = tuple(device.intra_bandwidth if i else device.inter_bandwidth for i in inside)
        default_lat = tuple(device.intra_latency if i else device.inter_latency for i in inside)
        bandwidth = default_bw if bandwidth is None else self._per_axis(bandwidth, axis_names, "bandwidth")
        latency = default_lat if latency is None else self._per_axis(latency, axis_names, "latency")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "bandwidth", tuple(float(b) for b in bandwidth))
        object.__setattr__(self, "latency", tuple(float(x) for x in latency))

    @staticmethod
    def inside_node(shape, per_node) -> tuple[bool, ...]:
        """Axis i lies inside a node when the product of it and all inner axes fits in a node."""
        inside, span = [], 1
        for size in reversed(shape):
            span *= size
            inside.append(span <= per_node)
        return tuple(reversed(inside))

    def placement(self, axes) -> tuple[int, int]:
        """(ranks per node, nodes) of one group of devices along mesh `axes` (a name, an index
        or several; the other coordinates fixed): devices are numbered row-major, the last axis
        fastest, and fill nodes of devices_per_node in that order (as `inside_node`).  A dp=64
        axis outside nothing spans 8 nodes with 8 ranks in each; outside tp=8, 64 nodes with 1."""
        axes = [self.axis(a) for a in ((axes,) if isinstance(axes, (str, int)) else axes)]
        strides = [math.prod(self.shape[a + 1:]) for a in axes]
        nodes = {sum(i * s for i, s in zip(index, strides)) // self.device.devices_per_node
                 for index in itertools.product(*(range(self.shape[a]) for a in axes))}
        ranks = math.prod(self.shape[a] for a in axes)
        return max(1, ranks // len(nodes)), len(nodes)

    @staticmethod
    def _per_axis(values, names, what):
        if isinstance(values, dict):
            unknown = set(values) - set(names)
            if unknown:
                raise ValueError(f"{what} names unknown mesh axes {sorted(unknown)}; axes are {names}")
            if set(values) != set(names):
                raise ValueError(f"{what} as a dict must name every axis {names}")
            return tuple(values[n] for n in names)
        if isinstance(values, (int, float)):
            return tuple(float(values) for _ in names)
        values = tuple(values)
        if len(values) != len(names):
            raise ValueError(f"{what} needs one value per mesh axis {names}, got {values}")
        return values

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name_or_index: str | int) -> int:
        if isinstance(name_or_index, int):
            return name_or_index
        try:
            return self.axis_names.index(name_or_index)
        except ValueError:
            raise ValueError(f"mesh has no axis {name_or_index!r}; axes are {self.axis_names}") from None

    @property
    def inside(self) -> tuple[bool, ...]:
        """Per axis, whether it lies inside a node (see inside_node)."""
        return self.inside_node(self.shape, self.device.devices_per_node)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names),
                "bandwidth": list(self.bandwidth), "latency": list(self.latency),
                "device": self.device.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "Mesh":
        return cls(tuple(data["shape"]), tuple(data["axis_names"]), device=DeviceSpec.from_dict(data["device"]),
                   bandwidth=tuple(data["bandwidth"]), latency=tuple(data["latency"]))

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s} ({b / 1e9:.0f} GB/s)" for n, s, b in
                         zip(self.axis_names, self.shape, self.bandwidth))
        return f"Mesh[{axes}] of {self.size} x {self.device.name}"
