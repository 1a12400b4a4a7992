"""The planning description of a cluster: mesh shape, axis names, device and link speeds.

A `Mesh` needs no process group: plans for 1024+ devices are made on one CPU. At run time
the runtime turns it into a torch `DeviceMesh` of the same shape and axis names.
"""
from __future__ import annotations

import math
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
    (a vectorised CPU Adam) for this device.
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

    def peak_flops(self, dtype: torch.dtype | str) -> float:
        name = str(dtype).replace("torch.", "")
        table = dict(self.flops)
        return table.get(name, table["float32"])


GiB = 1024**3

PRESETS: dict[str, DeviceSpec] = {
    # H100 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no tensor cores), 3.35 TB/s HBM3,
    # NVLink 4 at 450 GB/s per direction, 400 Gb/s InfiniBand per GPU.
    "h100": DeviceSpec("h100", (("float32", 67e12), ("tfloat32", 494e12), ("bfloat16", 989e12),
                                ("float16", 989e12)),
                       mem_bandwidth=3.35e12, memory=80 * GiB, intra_bandwidth=450e9,
                       inter_bandwidth=50e9, devices_per_node=8, host_bandwidth=55e9),
    # A100 SXM 80GB: 312 TFLOP/s bf16, 19.5 fp32, 2.04 TB/s, NVLink 3 at 300 GB/s, 200 Gb/s IB.
    "a100": DeviceSpec("a100", (("float32", 19.5e12), ("tfloat32", 156e12), ("bfloat16", 312e12),
                                ("float16", 312e12)),
                       mem_bandwidth=2.04e12, memory=80 * GiB, intra_bandwidth=300e9,
                       inter_bandwidth=25e9, devices_per_node=8),
    # A CPU rank (one process of a few cores) talking gloo over loopback.
    "cpu": DeviceSpec("cpu", (("float32", 1e11), ("bfloat16", 5e10), ("float16", 2e10)),
                      mem_bandwidth=2e10, memory=16 * GiB, intra_bandwidth=5e9,
                      inter_bandwidth=1e9, devices_per_node=8, intra_latency=2e-5,
                      inter_latency=1e-4, launch_latency=5e-5, host_bandwidth=2e10),
}


def parse_bytes(value: int | float | str | None) -> float | None:
    """'70GiB' -> 75161927680.0; numbers pass through; None stays None."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip().replace(" ", "")
    units = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
             "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "B": 1}
    for unit, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise ValueError(f"cannot read memory size {value!r}; write e.g. '70GiB', '80GB' or a number of bytes")


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
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape {shape} must be a non-empty tuple of positive sizes")
        if axis_names is None:
            axis_names = tuple(f"ax{i}" for i in range(len(shape)))
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        if len(axis_names) != len(shape):
            raise ValueError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} "
                             f"names {axis_names}; give one name per axis")
        if len(set(axis_names)) != len(axis_names):
            raise ValueError(f"mesh axis names {axis_names} must be distinct")
        if isinstance(device, str):
            if device not in PRESETS:
                raise ValueError(f"unknown device {device!r}; presets are {sorted(PRESETS)} "
                                 f"or pass an autopar.mesh.DeviceSpec")
            device = PRESETS[device]
        if devices_per_node is not None:
            device = replace(device, devices_per_node=int(devices_per_node))
        if memory is not None:
            device = replace(device, memory=parse_bytes(memory))
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
                           "host_bandwidth": d.host_bandwidth, "host_optimizer_rate": d.host_optimizer_rate}}

    @classmethod
    def from_dict(cls, data: dict) -> "Mesh":
        dev = dict(data["device"])
        dev["flops"] = tuple((str(k), float(v)) for k, v in dev["flops"])
        return cls(tuple(data["shape"]), tuple(data["axis_names"]), device=DeviceSpec(**dev),
                   bandwidth=tuple(data["bandwidth"]), latency=tuple(data["latency"]))

    def __str__(self) -> str:
        axes = ", ".join(f"{n}={s} ({b / 1e9:.0f} GB/s)" for n, s, b in
                         zip(self.axis_names, self.shape, self.bandwidth))
        return f"Mesh[{axes}] of {self.size} x {self.device.name}"
