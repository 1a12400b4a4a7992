"""The planning description of a cluster: mesh shape, axis names, device and link speeds.

A `Mesh` needs no process group: plans for 1024+ devices are made on one CPU. At run time
the runtime turns it into a torch `DeviceMesh` of the same shape and axis names.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class DeviceSpec:
    """Peak speeds of one device and of the links around it.

    flops: peak FLOP/s per dtype name ("float32", "bfloat16", "float16").
    mem_bandwidth: device memory bytes/s.  memory: device memory bytes.
    intra_bandwidth / inter_bandwidth: bytes/s per device, one direction, inside a node
    (NVLink class) and between nodes (network).  intra/inter_latency: seconds per step of a
    ring collective; launch_latency: fixed seconds per collective call (kernel launch and
    synchronisation), so one all-reduce costs less than a reduce-scatter plus an all-gather.
    host_bandwidth: bytes/s between the device and host memory (offload);
    host_optimizer_rate: parameter elements per second the host's optimizer updates
    (a vectorised CPU Adam) for this device.  algorithms: the collective algorithms its
    communication library runs (autopar.collectives); the cost model takes the cheapest
    per call.
    """

    name: str
    flops: tuple[tuple[str, float], ...]
    mem_bandwidth: float
    memory: float
    intra_bandwidth: float
    inter_bandwidth: float
    devices_per_node: int
    intra_latency: float = 1e-6
    inter_latency: float = 5e-6
    launch_latency: float = 5e-6
    host_bandwidth: float = 25e9
    host_optimizer_rate: float = 1e9
    algorithms: tuple = ("ring",)

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        name = str(dtype).replace("torch.", "")
        table = dict(self.flops)
        return table.get(name, table["float32"])


GiB = 1024**3
NCCL = ("ring", "tree")   # NCCL's all-reduce algorithms (its tuner picks per call)

PRESETS: dict[str, DeviceSpec] = {
    # H100 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no tensor cores), 3.35 TB/s HBM3,
    # NVLink 4 at 450 GB/s per direction, 400 Gb/s InfiniBand per GPU.
    "h100": DeviceSpec("h100", (("float32", 67e12), ("tfloat32", 494e12), ("bfloat16", 989e12),
                                ("float16", 989e12)),
                       mem_bandwidth=3.35e12, memory=80 * GiB, intra_bandwidth=450e9,
                       inter_bandwidth=50e9, devices_per_node=8, host_bandwidth=55e9,
                       algorithms=NCCL),
    # A100 SXM 80GB: 312 TFLOP/s bf16, 19.5 fp32, 2.04 TB/s, NVLink 3 at 300 GB/s, 200 Gb/s IB.
    "a100": DeviceSpec("a100", (("float32", 19.5e12), ("tfloat32", 156e12), ("bfloat16", 312e12),
                                ("float16", 312e12)),
                       mem_bandwidth=2.04e12, memory=80 * GiB, intra_bandwidth=300e9,
                       inter_bandwidth=25e9, devices_per_node=8, algorithms=NCCL),
    # A CPU rank (one process of a few cores) talking gloo over loopback.
    "cpu": DeviceSpec("cpu", (("float32", 1e11), ("bfloat16", 5e10), ("float16", 2e10)),
                      mem_bandwidth=2e10, memory=16 * GiB, intra_bandwidth=5e9,
                      inter_bandwidth=1e9, devices_per_node=8, intra_latency=2e-5,
                      inter_latency=1e-4, launch_latency=5e-5, host_bandwidth=2e10),
}


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
        inside = self._inside_node(shape, device.devices_per_node)
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
    def _inside_node(shape, per_node) -> tuple[bool, ...]:
        """Axis i lies inside a node when the product of it and all inner axes fits in a node."""
        inside, span = [], 1
        for size in reversed(shape):
            span *= size
            inside.append(span <= per_node)
        return tuple(reversed(inside))

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

    def to_dict(self) -> dict:
        d = self.device
        return {"shape": list(self.shape), "axis_names": list(self.axis_names),
                "bandwidth": list(self.bandwidth), "latency": list(self.latency),
                "device": {"name": d.name, "flops": [list(f) for f in d.flops],
                           "mem_bandwidth": d.mem_bandwidth, "memory": d.memory,
                           "intra_bandwidth": d.intra_bandwidth, "inter_bandwidth": d.inter_bandwidth,
                           "devices_per_node": d.devices_per_node, "intra_latency": d.intra_latency,
                           "inter_latency": d.inter_latency, "launch_latency": d.launch_latency,
                           "host_bandwidth": d.host_bandwidth, "host_optimizer_rate": d.host_optimizer_rate,
                           "algorithms": list(d.algorithms)}}

    @classmethod
    def from_dict(cls, data: dict) -> "Mesh":
        dev = dict(data["device"])
        dev["flops"] = tuple((str(k), float(v)) for k, v in dev["flops"])
        dev["algorithms"] = tuple(dev.get("algorithms", ("ring",)))
        return cls(tuple(data["shape"]), tuple(data["axis_names"]), device=DeviceSpec(**dev),
                   bandwidth=tuple(data["bandwidth"]), latency=tuple(data["latency"]))

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s} ({b / 1e9:.0f} GB/s)" for n, s, b in
                         zip(self.axis_names, self.shape, self.bandwidth))
        return f"Mesh[{axes}] of {self.size} x {self.device.name}"
