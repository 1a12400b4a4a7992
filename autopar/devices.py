"""What one device and the links around it sustain, and the device presets.

`DeviceSpec`: speeds of kernels, memory, links and the host, with the memory tiers beyond
the device's own; `KernelEfficiency`: how a GPU's kernels fall below those rates by shape.
`PRESETS`: GPUs from their datasheets times published efficiencies (each constant below
says where it comes from), and a CPU rank as `autopar calibrate` measured it.  A Mesh
(autopar/mesh.py) takes one by name or as a DeviceSpec; autopar.mesh exports these names.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace

import torch


CROSS_ENTROPY_KERNELS = ("torch", "fused")   # KernelEfficiency.cross_entropy


@dataclass(frozen=True)
class KernelEfficiency:
    """How close a GPU's kernels come to the rates in its DeviceSpec, by shape
    (autopar.cost.kernels uses it; a device without one is priced as a plain roofline).

    The DeviceSpec's `flops` are what a large, square GEMM sustains; a smaller or skinnier
    one runs below that for two reasons this describes.
    sms: streaming multiprocessors.  tiles: the GEMM output tiles the library picks from,
    (rows, columns, rate relative to the largest tile): a GEMM whose tiles leave SMs idle in
    its last wave (wave quantisation) or whose edges pad a tile runs slower, and the
    library takes whichever tile wastes least.  k_half: the reduction length at which a
    tile's fixed prologue and epilogue equal its main loop (efficiency k / (k + k_half),
    normalised to a 8192-long reduction).
    attention: (forward, backward) rate of the fused attention kernel torch's
    scaled_dot_product_attention runs on this part today, as a fraction of `flops`, at head
    dim 128 and long sequences, counting only the blocks a causal mask leaves (the kernel
    skips the rest); attention_kernels: other named kernels' (forward, backward) rates
    (older software: "flash-attn-2", "flash-attn-1"; see with_attention); head_dim_exponent: the rate scales as
    (head_dim / 128) ** exponent below 128; attention_seq_half: the sequence length at
    which per-block overheads halve the rate (rate x s / (s + half)).
    attention_kernel: "flash" (a fused kernel that never writes the score matrix, at the
    rates above) or "unfused" (two batched GEMMs over the whole score square, no causal
    skip, and a softmax, mask and dropout that read and write the s x s scores
    `score_passes` (forward, backward) times each, at memory bandwidth: attention before
    fused kernels, as Megatron-LM ran it in 2021-22).
    reduction: the share of the memory bandwidth norms and softmax reach (they reduce along
    rows; fitted to the one-H200 check of 2026-11-26, docs/gpu/: layer norm, RMS norm and
    softmax forward and backward ran at 0.30-0.78 of the elementwise roofline, geometric
    mean 0.53).
    gap: device seconds between two dependent kernels (launch and tail), paid per kernel
    on top of its work.
    misaligned: the share of its rate a 16- or 8-bit GEMM keeps when a row of an operand or
    of its output is not a whole number of 16-byte vectors (the reduction length k or the
    output width n not a multiple of 8 two-byte elements): the library then runs an
    older kernel that loads elements one by one (GPT-2's 50,257-token vocabulary is the
    usual case).  Sources per preset in autopar/devices.py.
    cross_entropy: the language-model loss's kernel: "torch" (log-softmax then NLL: its
    backward holds the log-probabilities' gradient and the logits' gradient at once) or
    "fused" (one kernel keeps the logits and each row's log-sum-exp and writes only the
    logits' gradient, as flash-attn's cross-entropy does; see with_cross_entropy)."""

    sms: int
    tiles: tuple = ((128, 256, 1.0), (128, 128, 0.92), (64, 128, 0.78), (64, 64, 0.55), (16, 64, 0.3))
    k_half: float = 64.0
    attention: tuple = (0.75, 0.6)
    attention_kernels: tuple = ()
    head_dim_exponent: float = 0.2
    attention_seq_half: float = 128.0
    attention_kernel: str = "flash"
    score_passes: tuple = (4.0, 8.0)
    reduction: float = 0.53
    gap: float = 1.5e-6
    misaligned: float = 0.5
    cross_entropy: str = "torch"

    def with_attention(self, kernel: str) -> "KernelEfficiency":
        """These kernels with another attention implementation: "sdpa" (torch's
        scaled_dot_product_attention today: `attention`), a named kernel of
        `attention_kernels` ("flash-attn-2", "flash-attn-1": the software of a given year),
        or "unfused" (the score matrix materialised, see attention_kernel)."""
        named = dict(self.attention_kernels)
        if kernel == "sdpa":
            return self
        if kernel in named:
            return replace(self, attention=tuple(named[kernel]))
        if kernel == "unfused":
            return replace(self, attention_kernel="unfused")
        raise ValueError(f"unknown attention kernel {kernel!r}; one of {['sdpa', *named, 'unfused']}")

    def with_cross_entropy(self, kernel: str) -> "KernelEfficiency":
        """These kernels with the loss run as `kernel`: "torch" (F.cross_entropy, what
        autopar's runtime runs) or "fused" (a run's own fused cross-entropy kernel, priced
        for its memory: a published run replayed)."""
        if kernel not in CROSS_ENTROPY_KERNELS:
            raise ValueError(f"unknown cross-entropy kernel {kernel!r}; one of {list(CROSS_ENTROPY_KERNELS)}")
        return replace(self, cross_entropy=kernel)

    def to_dict(self) -> dict:
        return {"sms": self.sms, "tiles": [list(t) for t in self.tiles], "k_half": self.k_half,
                "attention": list(self.attention),
                "attention_kernels": [[name, list(rates)] for name, rates in self.attention_kernels],
                "head_dim_exponent": self.head_dim_exponent,
                "attention_seq_half": self.attention_seq_half, "attention_kernel": self.attention_kernel,
                "score_passes": list(self.score_passes), "reduction": self.reduction, "gap": self.gap,
                "misaligned": self.misaligned, "cross_entropy": self.cross_entropy}

    @classmethod
    def from_dict(cls, data: dict) -> "KernelEfficiency":
        d = dict(data)
        d["tiles"] = tuple((int(a), int(b), float(r)) for a, b, r in d.get("tiles", cls.tiles))
        d["attention"] = tuple(float(x) for x in d.get("attention", cls.attention))
        d["attention_kernels"] = tuple((str(name), tuple(float(x) for x in rates))
                                       for name, rates in d.get("attention_kernels", ()))
        d["score_passes"] = tuple(float(x) for x in d.get("score_passes", cls.score_passes))
        if d.get("attention_kernel", "flash") not in ("flash", "unfused"):
            raise ValueError(f"kernels attention_kernel {d['attention_kernel']!r}: one of 'flash', 'unfused'")
        if d.get("cross_entropy", "torch") not in CROSS_ENTROPY_KERNELS:
            raise ValueError(f"kernels cross_entropy {d['cross_entropy']!r}: one of {list(CROSS_ENTROPY_KERNELS)}")
        return cls(**d)


@dataclass(frozen=True)
class DeviceSpec:
    """Speeds of one device and of the links around it: what kernels and collectives
    achieve (the presets: datasheet peaks times measured efficiencies; `autopar
    calibrate`: measured on the machine), not datasheet peaks.

    flops: FLOP/s per dtype name ("float32", "bfloat16", "float16").
    mem_bandwidth: device memory bytes/s.  memory: device memory bytes.
    intra_bandwidth / inter_bandwidth: bytes/s per device, one direction, inside a node
    (NVLink class) and between nodes (network).  intra/inter_latency: seconds per step of a
    ring collective; launch_latency: fixed seconds per collective call (kernel launch and
    synchronisation), so one all-reduce costs less than a reduce-scatter plus an all-gather.
    host_bandwidth: bytes/s between the device and host memory (offload);
    host_optimizer_rate: parameter elements per second the host's optimizer updates
    (a vectorised CPU Adam) for this device.  Memory tiers beyond the device's own:
    host_memory, host bytes this device may fill with offloaded states (its share of the
    node's memory; 0: not stated, unbounded); disk_memory, bytes of local disk (NVMe) this
    device may fill (0: no disk tier); disk_read_bandwidth / disk_write_bandwidth, bytes/s
    this device reads and writes there (its share of the node's drives, through the file
    system, as `autopar calibrate` times it).  algorithms: the collective algorithms its
    communication library runs (autopar.cost.collectives); the cost model takes the cheapest
    per call.

    op_latency: seconds one op costs however small (kernel launch, or eager dispatch on a
    CPU).  asynchronous: whether the host issues ops ahead of the device (CUDA streams):
    then an op takes max(op_latency, its roofline), the launch hidden behind longer ops;
    otherwise (a CPU rank running eagerly) op_latency + its roofline.
    links: measured collective lines (`autopar calibrate`), one entry per collective kind
    ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send") and link ("intra":
    inside a node, "inter": across): (kind, link, bandwidth, latency, launch), each read
    with the ring formulas of autopar.cost.collectives.  A kind or link not listed uses the
    bandwidths and latencies above.  optimizer: measured AdamW step (seconds per
    parameter tensor, seconds per element); empty: priced as memory traffic
    (cost.optimizer_seconds).  optimizer_fused: the same for AdamW's fused kernel (what a
    plan for the backend "inductor" runs).  attention_flops: FLOP/s of the fused attention kernel per
    dtype where it runs slower than matrix multiplies (a CPU's flash attention at small
    head sizes); empty: `flops`.  kernels: how a GPU's kernels fall below these rates by
    shape (KernelEfficiency); None: every op is a roofline at `flops` and `mem_bandwidth`.
    host_op: host seconds autopar's runtime spends on each traced op of the graph, once in
    forward and once more in backward where it has a gradient, views included (the
    generated code, autograd and the dispatcher): on an asynchronous device the step's
    forward and backward take at least their sum however small the kernels
    (autopar.solve.assemble).  0: no such floor.
    pointwise: measured elementwise ops that compute more than they move (a CPU's gelu,
    silu, tanh, exp, sigmoid, softmax: transcendental functions evaluated per element):
    (op key as autopar.cost.kernels.pointwise_key names it, forward seconds per element,
    backward seconds per element); such an op takes at least its elements times these.
    Empty (the GPU presets): they stream at memory bandwidth like any elementwise op.
    compute_scale: what `autopar calibrate`'s step check found (how much slower than the
    single-op rates a model's training step runs its work) and has already applied to the
    rates above (flops, attention_flops, mem_bandwidth divided by it; pointwise,
    optimizer, host_op multiplied; op_latency is then the per-op cost the steps show); a
    record, not applied again.  1.0: not checked (the presets).
    source: where the numbers come from.
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
    host_memory: float = 0.0
    disk_memory: float = 0.0
    disk_read_bandwidth: float = 2e9
    disk_write_bandwidth: float = 1e9
    algorithms: tuple = ("ring",)
    op_latency: float = 0.0
    asynchronous: bool = True
    links: tuple = ()
    source: str = ""
    optimizer: tuple = ()
    optimizer_fused: tuple = ()
    attention_flops: tuple = ()
    kernels: KernelEfficiency | None = None
    host_op: float = 0.0
    pointwise: tuple = ()
    compute_scale: float = 1.0

    def link(self, kind: str, inside: bool) -> tuple | None:
        """(bandwidth, latency, launch) measured for `kind` on the link class, or None."""
        want = "intra" if inside else "inter"
        for k, where, bandwidth, latency, launch in self.links:
            if k == kind and where == want:
                return bandwidth, latency, launch
        return None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flops"] = [list(f) for f in self.flops]
        d["algorithms"] = list(self.algorithms)
        d["links"] = [list(x) for x in self.links]
        d["optimizer"] = list(self.optimizer)
        d["optimizer_fused"] = list(self.optimizer_fused)
        d["attention_flops"] = [list(f) for f in self.attention_flops]
        d["kernels"] = self.kernels.to_dict() if self.kernels is not None else None
        d["pointwise"] = [list(x) for x in self.pointwise]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceSpec":
        """The inverse of to_dict; fields a file lacks take their defaults, unknown ones are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"device description has unknown fields {unknown}; known fields are {sorted(known)}")
        d = dict(data)
        d["flops"] = tuple((str(k), float(v)) for k, v in d["flops"])
        d["algorithms"] = tuple(d.get("algorithms", ("ring",)))
        d["links"] = tuple((str(k), str(w), float(b), float(lat), float(ln)) for k, w, b, lat, ln in d.get("links", ()))
        d["optimizer"] = tuple(float(x) for x in d.get("optimizer", ()))
        d["optimizer_fused"] = tuple(float(x) for x in d.get("optimizer_fused", ()))
        d["attention_flops"] = tuple((str(k), float(v)) for k, v in d.get("attention_flops", ()))
        d["kernels"] = KernelEfficiency.from_dict(d["kernels"]) if d.get("kernels") else None
        d["pointwise"] = tuple((str(k), float(f), float(b)) for k, f, b in d.get("pointwise", ()))
        return cls(**d)

    def pointwise_seconds(self, key: str | None) -> tuple | None:
        """(forward, backward) seconds per element measured for the elementwise op `key`
        (autopar.cost.kernels.pointwise_key), or None."""
        for k, fwd, bwd in self.pointwise:
            if k == key:
                return fwd, bwd
        return None

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump({"device": self.to_dict()}, f, indent=1)

    @classmethod
    def load(cls, path) -> "DeviceSpec":
        """A device written by `save` or by `autopar calibrate --out` (its "device" entry)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read device profile {path}: {exc.strerror}; write one with "
                             f"`torchrun --nproc_per_node N -m autopar calibrate --out {path}`") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"device profile {path} is not JSON ({exc}); it should be what "
                             f"`autopar calibrate --out` wrote") from None
        if not isinstance(data, dict) or "device" not in data:
            raise ValueError(f"device profile {path} has no 'device' entry; it should be what "
                             f"`autopar calibrate --out` wrote")
        return cls.from_dict(data["device"])

    def peak_flops(self, dtype: torch.dtype | str, attention: bool = False) -> float:
        """FLOP/s of matrix multiplies in `dtype` (attention=True: of the fused attention kernel)."""
        name = str(dtype).replace("torch.", "")
        table = dict(self.attention_flops if attention and self.attention_flops else self.flops)
        return table.get(name, table.get("float32", next(iter(table.values()))))


GiB = 1024**3
NCCL = ("ring", "tree")   # NCCL's all-reduce algorithms (its tuner picks per call)

# Efficiency of the GPU presets: what training kernels reach, not the datasheet's peak.
# Large bf16 GEMMs in cuBLAS sustain about three quarters of an SXM part's dense peak under
# its power limit; STREAM-style copies reach about 90 % of HBM bandwidth (about 3.0 of
# 3.35 TB/s on H100); NCCL's all-reduce reaches about 80 % of NVLink's per-direction rate
# as bus bandwidth and about 90 % of an InfiniBand NIC's line rate.  These fractions are
# estimates from published benchmark reports (nccl-tests, cuBLAS GEMM sweeps), not our
# measurements: `autopar calibrate` on the machine replaces them (docs/COST_MODEL.md).
GEMM, HBM, NVLINK, NETWORK = 0.75, 0.90, 0.80, 0.90
USABLE = 79 * GiB   # 80 GB parts show CUDA about 79.6 GiB; the CUDA context takes about 0.5 GiB
LAUNCH = 4e-6       # seconds per kernel launch through PyTorch's eager dispatch
# host seconds per traced op and direction in autopar's runtime (DeviceSpec.host_op): measured
# on one H100's host (docs/gpu/2026-11-26-h100-host.txt): GPT-2 124M (310 traced ops, 308
# with a gradient) and a 4-layer Llama (283, 246) trained on 64 tokens, where the kernels take
# almost nothing, spent 18.05 and 13.46 ms per forward and backward: 29.2 and 25.4 us per op
# and direction, 27 on average
HOST_OP = 27e-6


def _achievable(peaks: dict) -> tuple:
    return tuple((name, GEMM * flops) for name, flops in peaks.items())


def _gpu(name: str, peaks: dict, hbm: float, memory: float, nvlink: float, network: float, source: str,
         **extra) -> DeviceSpec:
    """A GPU preset from datasheet numbers (FLOP/s per dtype, HBM bytes/s, usable bytes, NVLink
    bytes/s per direction, network bytes/s per GPU), each times the efficiencies above; its
    kernels (KernelEfficiency) by architecture, Hopper where the bf16 peak is Hopper's class."""
    kernels = HOPPER_KERNELS if peaks["bfloat16"] > 500e12 else AMPERE_KERNELS
    return DeviceSpec(name, _achievable(peaks), mem_bandwidth=HBM * hbm, memory=memory,
                      intra_bandwidth=NVLINK * nvlink, inter_bandwidth=NETWORK * network, devices_per_node=8,
                      algorithms=NCCL, op_latency=LAUNCH, source=source, kernels=kernels, host_op=HOST_OP,
                      **extra)


# How the presets' kernels fall below those rates by shape (KernelEfficiency).  SMs from the
# datasheets (H100/H200 SXM 132, A100 108).  Attention's rate per FLOP it computes (a causal
# mask's skipped blocks not counted), as a fraction of the preset's GEMM rate:
# - today's torch scaled_dot_product_attention on Hopper: measured on one H200 (torch 2.11,
#   benchmarks/gpu_check.py, 2026-11-26, docs/gpu/): causal, head dim 128, 8,192 tokens,
#   620 TFLOP/s forward and 373 backward against the preset's 742: 0.84 and 0.50;
# - FlashAttention-2 on H100 SXM (Shah et al. 2024, FlashAttention-3, fig. 5-6: about 350
#   TFLOP/s forward and 295 backward at head dim 128): 0.47 and 0.40; on A100 (Dao 2023,
#   fig. 4-6: 73 % of the bf16 peak forward, 63 % backward): 0.93 and 0.80, which is also
#   what torch's kernel runs there;
# - FlashAttention-1: half FlashAttention-2's rates (Dao 2023: FlashAttention-2 is about
#   twice as fast).
# A GEMM with a row that is not a whole number of 16-byte vectors (KernelEfficiency.misaligned):
# - Hopper, measured on one H100 (torch 2.11, benchmarks/gpu_profile.py, docs/gpu/2026-11-26-h100-*.txt):
#   GPT-2's language-model head, 8,192 tokens x 768 -> 50,257, ran its forward and both
#   backward GEMMs on a Turing-generation tensor-core kernel at 95-148 TFLOP/s, 123 on
#   average: 0.17 of the preset's 742;
# - Ampere: padding nanoGPT's vocabulary from 50,257 to 50,304 made its A100 step about 25 %
#   faster (Karpathy, nanoGPT, 2023); with the head a quarter of the FLOPs, the misaligned
#   GEMMs ran at about half the aligned rate: 0.5.
HOPPER_KERNELS = KernelEfficiency(sms=132, attention=(0.84, 0.50), misaligned=0.17,
                                  attention_kernels=(("flash-attn-2", (0.47, 0.40)), ("flash-attn-1", (0.235, 0.20))))
AMPERE_KERNELS = KernelEfficiency(sms=108, attention=(0.93, 0.80), misaligned=0.5,
                                  attention_kernels=(("flash-attn-2", (0.93, 0.80)), ("flash-attn-1", (0.465, 0.40))))

# Memory tiers beyond HBM, per GPU (DeviceSpec.host_memory, disk_memory, disk_*_bandwidth),
# from the DGX datasheets: DGX H100 and H200, 2 TB of system memory and a data cache of
# 8 x 3.84 TB U.2 NVMe (one drive per GPU); DGX A100 640 GB, 2 TB and 8 x 3.84 TB; DGX
# A100 320 GB, 1 TB and 4 x 3.84 TB (one drive per two GPUs).  Host memory: a GPU's share
# less a tenth for the system and the data loaders.  Disk rates: the sequential datasheet
# class of a PCIe 4 U.2 drive (about 7 GB/s read, 4 GB/s write) times 0.8 through a file
# system; not measured here (`autopar calibrate` times them on the machine).
_DGX_TIERS = dict(host_memory=0.9 * 2e12 / 8, disk_memory=3.84e12, disk_read_bandwidth=0.8 * 7e9,
                  disk_write_bandwidth=0.8 * 4e9)
_DGX_A100_320_TIERS = dict(host_memory=0.9 * 1e12 / 8, disk_memory=3.84e12 / 2, disk_read_bandwidth=0.8 * 7e9 / 2,
                           disk_write_bandwidth=0.8 * 4e9 / 2)

_HOPPER = {"float32": 67e12, "tfloat32": 494e12, "bfloat16": 989e12, "float16": 989e12}   # H100/H200 SXM, dense
_AMPERE = {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12}  # A100 SXM, dense
_SXM_SOURCE = "{} datasheet peaks times typical efficiencies (autopar.mesh.GEMM ...)"

PRESETS: dict[str, DeviceSpec] = {
    # H100 SXM (datasheet): 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (no tensor cores),
    # 494 tf32, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction, 400 Gb/s InfiniBand
    # (50 GB/s) per GPU; each times the efficiency above.  "h100" is this part.
    "h100": _gpu("h100", _HOPPER, 3.35e12, USABLE, 450e9, 50e9, _SXM_SOURCE.format("H100 SXM"), host_bandwidth=55e9,
                 **_DGX_TIERS),
    "h100-sxm": _gpu("h100-sxm", _HOPPER, 3.35e12, USABLE, 450e9, 50e9, _SXM_SOURCE.format("H100 SXM"),
                     host_bandwidth=55e9, **_DGX_TIERS),
    # H100 with 96 GB of HBM2e at a 500 W power limit (the parts of torchtitan's published
    # H100 runs, "Grand Teton"): 2.4 TB/s as stated there; its peak is stated only as
    # between the SXM and NVL parts, so the NVL datasheet's 835 TFLOP/s dense bf16 (60 fp32,
    # 418 tf32) is taken, the lower end; 400 Gb/s RDMA per GPU as stated.
    "h100-hbm2e-500w": _gpu("h100-hbm2e-500w", {"float32": 60e12, "tfloat32": 418e12, "bfloat16": 835e12,
                                                 "float16": 835e12}, 2.4e12, 94 * GiB, 450e9, 50e9,
                            "H100 96 GB HBM2e 500 W: NVL datasheet peaks (a lower bound), torchtitan's "
                            "stated bandwidths; times typical efficiencies", host_bandwidth=55e9),
    # H200 SXM (datasheet): the H100 SXM's compute, 141 GB of HBM3e at 4.8 TB/s (about 139.5 GiB
    # usable, as the one-GPU check saw), NVLink 4, 400 Gb/s InfiniBand per GPU.
    "h200": _gpu("h200", _HOPPER, 4.8e12, 139 * GiB, 450e9, 50e9, _SXM_SOURCE.format("H200 SXM"),
                 host_bandwidth=55e9, **_DGX_TIERS),
    # A100 SXM 80GB (datasheet): 312 TFLOP/s bf16, 19.5 fp32, 156 tf32, 2.04 TB/s, NVLink 3
    # at 300 GB/s, 200 Gb/s InfiniBand (25 GB/s); each times the efficiency above.  "a100" is this part.
    "a100": _gpu("a100", _AMPERE, 2.04e12, USABLE, 300e9, 25e9, _SXM_SOURCE.format("A100 SXM"), **_DGX_TIERS),
    "a100-80gb": _gpu("a100-80gb", _AMPERE, 2.04e12, USABLE, 300e9, 25e9, _SXM_SOURCE.format("A100 SXM 80GB"),
                      **_DGX_TIERS),
    # A100 SXM 40GB (datasheet): the same compute, 1.555 TB/s HBM2, 40 GB (about 39.4 GiB usable).
    "a100-40gb": _gpu("a100-40gb", _AMPERE, 1.555e12, 39 * GiB, 300e9, 25e9, _SXM_SOURCE.format("A100 SXM 40GB"),
                      **_DGX_A100_320_TIERS),
    # A CPU rank (one process of a few cores) talking gloo over loopback: what `autopar
    # calibrate` measured for 4 ranks sharing the 2 cores of this project's CI machine (one
    # intra-op thread each), rounded.  Ops run eagerly: each op's latency adds to its work.
    # Tiers: a quarter of the machine's 24 GiB of host memory less the ranks' own, and the
    # virtual disk's buffered rates as timed there (0.3-1.0 GB/s).
    "cpu": DeviceSpec("cpu", (("float32", 4e10), ("bfloat16", 1e11), ("float16", 2e10)),
                      mem_bandwidth=3e10, memory=16 * GiB, intra_bandwidth=2e9,
                      inter_bandwidth=1e9, devices_per_node=8, intra_latency=5e-4,
                      inter_latency=1e-3, launch_latency=2e-4, host_bandwidth=1e10,
                      host_optimizer_rate=2e8, op_latency=7e-6, asynchronous=False, optimizer=(5e-5, 5e-9),
                      host_memory=4 * GiB, disk_memory=16 * GiB, disk_read_bandwidth=5e8, disk_write_bandwidth=3e8,
                      attention_flops=(("float32", 1.7e10), ("bfloat16", 1.6e10)),
                      source="autopar calibrate on 4 gloo ranks sharing 2 CPU cores, rounded"),
}
