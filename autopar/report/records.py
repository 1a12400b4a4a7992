"""The records a plan is made of: per-node choices, collectives, model-state placements,
predictions, solver statistics, timing and the pipeline layout (a placement's text form,
"S(0)", "R", "P", is autopar/placements.py's).  Frozen dataclasses, each with an exact JSON round trip
where it has its own; `autopar.report.plan.Plan` holds them."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from autopar.mesh import Mesh
from autopar.ops.strategy import offload_label


@dataclass(frozen=True)
class NodeChoice:
    """The strategy of one graph node.  inputs / outputs: placements per tensor operand /
    output; grads: placement of each operand's gradient (None: the operand takes none)."""

    name: str
    op: str
    module: str
    strategy: str
    split: tuple
    inputs: tuple
    outputs: tuple
    grads: tuple
    compute_s: float
    comm_s: float
    memory: float
    reduced: tuple = ()   # mesh axes whose split letter the op sums away (a local mean, loss, lookup)


@dataclass(frozen=True)
class Collective:
    """A collective the plan implies: `kind` on mesh `axes`, acting on `nbytes` per device,
    carrying `tensor` into `node`, in the forward or backward pass; `algorithm`: the one
    the cost model priced it with (autopar.cost.collectives)."""

    kind: str
    axes: tuple
    nbytes: float
    phase: str
    node: str
    tensor: str
    seconds: float
    algorithm: str = "ring"


@dataclass(frozen=True)
class ParamState:
    """Where a parameter's training state lives beyond its placement.  stage: ZeRO stage 1
    (optimizer state split over `axes`) or 2 (gradient too), or 0; offload: the memory tier
    the optimizer state and master weights stay in, "host" or "disk" ("": the device);
    weights: the stored shard and its gradient live in that tier too, copied to the device
    for each use.  (ZeRO-3 is a placement: Shard on an axis whose ops read the parameter
    whole.)"""

    stage: int
    axes: tuple
    offload: str = ""
    weights: bool = False

    def __str__(self) -> str:
        text = f"zero-{self.stage} over {'+'.join(self.axes)}" if self.stage else ""
        return ", ".join(t for t in (text, offload_label(self.offload, self.weights)) if t)


def tier_of(value) -> str:
    """A saved plan's offload field as a tier: plans saved before disk existed wrote a bool."""
    if value is True:
        return "host"
    if value in (False, None, ""):
        return ""
    if value not in ("host", "disk"):
        raise ValueError(f"plan's param_states offload {value!r}: one of 'host', 'disk' or ''")
    return value


def peak_bytes(memory: dict, step_memory: float = 0.0) -> float:
    """A step's peak memory per device from its parts (bytes by kind, as Prediction.memory):
    the states (weights, optimizer states) are held throughout; on top of them the peak is
    the larger of two moments.  At the start of backward every saved activation is held and
    the largest op (the logits and their loss, often) works, while no gradient exists yet
    (optimizer.zero_grad leaves none); in the optimizer step every gradient is held and the
    step's temporaries are allocated (in runs: cost.prices.step_temporary_total).  Measured
    on one H100 (bf16, one rank; docs/gpu/2026-11-26-h100-gpu_memory.txt): Llama-3-8B-wide
    layers at 8,192 tokens within 0.3 % at both moments; GPT-2 and Llama steps of
    gpu_check within 2.5 %, where the sum of all five kinds was 4-10 % high.  Under
    gradient accumulation or a pipeline the gradients of earlier micro-batches are held at
    backward's start too (the pipeline search counts them so)."""
    states = memory.get("params", 0.0) + memory.get("optimizer", 0.0)
    backward = memory.get("activations", 0.0) + memory.get("working", 0.0)
    return states + max(backward, memory.get("grads", 0.0) + step_memory)


@dataclass(frozen=True)
class Prediction:
    """Step time and memory per device by kind.  The step is compute plus communication
    per mesh axis less `hidden_s`: the communication that runs while the device computes,
    out of `overlappable_s`.  Two kinds overlap: gradient buckets reduced while backward
    runs (autopar.solve.assemble.hidden_gradient_seconds) and, of which `prefetch_hidden_s` out
    of `prefetchable_s`, ZeRO-3 weight gathers started one ahead while forward runs
    (autopar.solve.assemble.hidden_prefetch_seconds).  contended_s: what those streams would
    hide more if their transfers did not wait while the device's own collectives hold the
    same links (the network where a group spans nodes, else NVLink; contention).
    linear_hidden_s: mesh axis -> seconds of tensor-parallel collectives run beside GEMMs
    (autopar/passes/fold_linears.py), part of hidden_s: the input gradients' (Megatron's
    f, Megatron-SP's reduce-scatter) while the same linears' weight gradients compute, and
    row-parallel outputs' all-reduces and reduce-scatters piece by piece while the next
    piece of the GEMM computes.  host_bound_s: what the step's compute was raised by to
    the host's time issuing the ops (DeviceSpec.host_op; 0 where the kernels take longer)."""

    step_s: float
    compute_s: float
    comm_s: dict
    memory: dict
    hidden_s: float = 0.0
    overlappable_s: float = 0.0   # the gradient buckets' and prefetched gathers' communication, hidden or not
    prefetch_hidden_s: float = 0.0
    prefetchable_s: float = 0.0
    host_bound_s: float = 0.0
    step_memory: float = 0.0   # what the optimizer step allocates while it runs (cost.prices.step_temporary_bytes)
    tiers: dict = field(default_factory=dict)   # "host" / "disk" -> offloaded bytes per device kept there
    contended_s: float = 0.0
    linear_hidden_s: dict = field(default_factory=dict)

    @property
    def memory_total(self) -> float:
        """The peak per device (peak_bytes): the larger of backward's start and the optimizer step."""
        return peak_bytes(self.memory, self.step_memory)

    def __str__(self) -> str:
        comm = ", ".join(f"{k} {format_seconds(v)}" for k, v in self.comm_s.items())
        mem = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.memory.items())
        if self.step_memory:
            mem += f"; the optimizer step's temporaries {format_bytes(self.step_memory)}"
        linear = sum(self.linear_hidden_s.values())
        behind = self.hidden_s - self.prefetch_hidden_s - linear
        parts = ([f"{format_seconds(behind)} behind backward"] if behind > 1e-12 else []) + \
            ([f"{format_seconds(self.prefetch_hidden_s)} of weight gathers behind forward"]
             if self.prefetch_hidden_s > 1e-12 else []) + \
            ([f"{format_seconds(linear)} of tensor-parallel collectives behind their GEMMs"]
             if linear > 1e-12 else [])
        if self.contended_s > 1e-12:
            parts.append(f"{format_seconds(self.contended_s)} not hidden as the device's own collectives hold the "
                         f"same links")
        hidden = f", hidden: {' and '.join(parts)}" if parts else ""
        host = f", host-bound: +{format_seconds(self.host_bound_s)}" if self.host_bound_s > 1e-12 else ""
        beyond = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.tiers.items() if v)
        return (f"step {format_seconds(self.step_s)} (compute {format_seconds(self.compute_s)}{host}; comm {comm}{hidden}); "
                f"memory {format_bytes(self.memory_total)} ({mem})" + (f"; off the device: {beyond}" if beyond else ""))


@dataclass(frozen=True)
class SolverStats:
    """How the ILP went: the graph's and the menus' sizes, and (when an ILP ran: not for
    random or hand-set choices) optimality, gap, objective and bound in seconds, and the
    model's size after the presolve."""

    graph_nodes: int = 0
    choice_nodes: int = 0
    optimal: bool | None = None
    gap: float | None = None
    objective_s: float | None = None
    bound_s: float | None = None
    variables: int | None = None
    constraints: int | None = None

    @property
    def solved(self) -> bool:
        return self.optimal is not None

    def to_dict(self) -> dict:
        return _flat_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SolverStats":
        return cls(**d)


@dataclass(frozen=True)
class Timing:
    """Wall seconds of each planning step (pipeline_search_s: None without the search)."""

    trace_s: float = 0.0
    costs_s: float = 0.0
    solve_s: float = 0.0
    total_s: float = 0.0
    pipeline_search_s: float | None = None

    def to_dict(self) -> dict:
        return _flat_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Timing":
        return cls(**d)


def _flat_dict(record) -> dict:
    """A record of plain fields as JSON: fields left None (not known) are left out."""
    return {k: v for k, v in asdict(record).items() if v is not None}


@dataclass(frozen=True)
class PipelineLayout:
    """The pipeline stages of a plan (autopar.solve.pipeline.search).  axis: the mesh axis cut into
    `groups` device groups, each a sub-mesh of shape `submesh` (None: the search chose no
    pipeline); stages: (first, last + 1) positions in `layer_indices` of the repeated layers
    `layer_prefix`.<i>, per stage; schedule, microbatches and virtual stages per group;
    step_s / no_pipeline_step_s: predicted step with and without stages; bubble: idle
    fraction of the schedule; stage_s: each stage's forward + backward per microbatch;
    memory: bytes per device of each device group; full_mesh: the mesh the plan compiles on."""

    axis: str | None
    groups: int
    submesh: tuple
    stages: tuple
    schedule: str
    microbatches: int
    virtual: int
    step_s: float
    no_pipeline_step_s: float
    bubble: float
    stage_s: tuple
    memory: tuple
    full_mesh: Mesh
    summary: str
    layer_prefix: str = ""
    layer_indices: tuple = ()
    group_memory: tuple = ()   # per device group: {params, grads, optimizer, activations} bytes per device
    candidates: int = 0        # layouts the search found within the budget (the plain one included)
    send_s: float = 0.0        # one activation's (or gradient's) trip across a cut
    sends_overlap: bool = False   # sends delay only their receiver (asynchronous devices); else in stage_s

    @property
    def pipelined(self) -> bool:
        return self.axis is not None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(submesh=list(self.submesh), stages=[list(st) for st in self.stages], stage_s=list(self.stage_s),
                 memory=list(self.memory), full_mesh=self.full_mesh.to_dict(),
                 layer_indices=list(self.layer_indices), group_memory=[dict(m) for m in self.group_memory])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineLayout":
        return cls(**dict(d, submesh=tuple(d["submesh"]), stages=tuple(tuple(st) for st in d["stages"]),
                          stage_s=tuple(d["stage_s"]), memory=tuple(d["memory"]),
                          full_mesh=Mesh.from_dict(d["full_mesh"]), layer_indices=tuple(d["layer_indices"]),
                          group_memory=tuple(dict(m) for m in d.get("group_memory", ()))))


# the recomputation modes that run a layer's forward again in backward, and those of them
# that keep some ops' outputs (Recompute.kept) and run the rest again
RECOMPUTING = ("selective", "alternate", "full")
SELECTIVE_MODES = ("selective", "alternate")

# how a rank's graph runs: op by op, or its compute between collectives compiled by Inductor
BACKENDS = ("eager", "inductor")


def check_backend(backend: str, auto: bool = False, where: str = "") -> str:
    """`backend` if it is one of BACKENDS (or, with `auto`, "auto": compile's default, which
    chooses per device), else a ValueError naming the choices; `where` prefixes the
    message (e.g. "autopar.compile")."""
    if backend in BACKENDS or (auto and backend == "auto"):
        return backend
    choices = ("'auto' (the default: Inductor on GPUs, eager on CPU ranks), " if auto else "") + \
        "'eager' (the rank's graph op by op) or 'inductor' (its compute between collectives compiled by torch.compile)"
    raise ValueError(f"{where + '(' if where else ''}backend={backend!r}{')' if where else ''}: choose {choices}")


@dataclass(frozen=True)
class Recompute:
    """The activation recomputation of a plan (autopar/solve/recompute/modes.py).  layers: layer path ->
    "selective", "alternate" or "full", for the layers that recompute (the others keep what
    autograd saves); kept: the graph nodes whose outputs the SELECTIVE_MODES keep (matrix
    products with a weight, attention, experts; under "alternate" every second product of a
    layer left out); saved_bytes: activation bytes per device it saves against
    keeping everything; added_s: the seconds per step the forward run again costs; forced:
    the `recompute=` the plan was made with (None: chosen by the ILP); note: what selective
    keeps of this model's attention; whole: the kept nodes that communicate inside (ring or
    Ulysses attention, expert all-to-alls), which run outside the checkpointed regions so
    that backward does not communicate again (they keep what autograd saves)."""

    layers: dict
    kept: tuple = ()
    saved_bytes: float = 0.0
    added_s: float = 0.0
    forced: str | None = None
    note: str = ""
    whole: tuple = ()

    def to_dict(self) -> dict:
        return dict(asdict(self), layers=dict(self.layers), kept=list(self.kept), whole=list(self.whole))

    @classmethod
    def from_dict(cls, d: dict) -> "Recompute":
        return cls(**dict(d, layers=dict(d["layers"]), kept=tuple(d["kept"]), whole=tuple(d.get("whole", ()))))


def format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds * 1e6:.1f}us"


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}{unit}"
    return f"{nbytes:.0f}B"
