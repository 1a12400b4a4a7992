"""The Plan: what autopar chose, for every node, with the predicted time and memory.

A Plan is the only thing the passes and the runtime consume.  It is plain data: it prints
as a table a person reads in a terminal, saves to JSON and loads back equal.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from torch.distributed.tensor import Partial, Replicate, Shard

from .mesh import Mesh

FORMAT_VERSION = 1


class PlanFileError(ValueError):
    """A plan file that cannot be used; the message names the file and the problem."""


def placement_str(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    raise TypeError(f"not a placement: {p!r}")


def placement_from_str(text: str):
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    m = re.fullmatch(r"S\((\d+)\)", text)
    if not m:
        raise ValueError(f"not a placement: {text!r}")
    return Shard(int(m.group(1)))


def show(placements) -> str:
    return "(" + ", ".join(placement_str(p) for p in placements) + ")"


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


@dataclass(frozen=True)
class Collective:
    """A collective the plan implies: `kind` on mesh `axes`, acting on `nbytes` per device,
    carrying `tensor` into `node`, in the forward or backward pass."""

    kind: str
    axes: tuple
    nbytes: float
    phase: str
    node: str
    tensor: str
    seconds: float


@dataclass(frozen=True)
class ParamState:
    """Where a parameter's training state lives beyond its placement.  stage: ZeRO stage 1
    (optimizer state split over `axes`) or 2 (gradient too), or 0; offload: the optimizer
    state and master weights stay in host memory.  (ZeRO-3 is a placement: Shard on an axis
    whose ops read the parameter whole.)"""

    stage: int
    axes: tuple
    offload: bool = False

    def __str__(self) -> str:
        text = f"zero-{self.stage} over {'+'.join(self.axes)}" if self.stage else ""
        return ", ".join(t for t in (text, "offload" if self.offload else "") if t)


@dataclass(frozen=True)
class Prediction:
    """Step time (compute plus communication per mesh axis) and memory per device by kind."""

    step_s: float
    compute_s: float
    comm_s: dict
    memory: dict

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    def __str__(self) -> str:
        comm = ", ".join(f"{k} {_t(v)}" for k, v in self.comm_s.items())
        mem = ", ".join(f"{k} {_b(v)}" for k, v in self.memory.items())
        return (f"step {_t(self.step_s)} (compute {_t(self.compute_s)}; comm {comm}); "
                f"memory {_b(self.memory_total)} ({mem})")


@dataclass(frozen=True)
class Plan:
    mesh: dict
    model: str
    param_placements: dict
    nodes: tuple
    collectives: tuple
    predicted: Prediction
    solver: dict
    baselines: dict = field(default_factory=dict)   # layout name -> Prediction or a reason string
    memory_budget: float | None = None
    fallback_ops: tuple = ()
    layers: tuple = ()                              # (module prefix, repeated layer indices)
    grad_sums: dict = field(default_factory=dict)   # "node:output" -> layout its readers' gradients are added in
    origin: str = "ilp"                             # "ilp", "layout:<name>" or "random:<seed>"
    timing: dict = field(default_factory=dict, compare=False)  # wall seconds of each planning step
    param_states: dict = field(default_factory=dict)  # parameter name -> ParamState (ZeRO-1/2, offload)
    precision: dict | None = None                   # MixedPrecision.to_dict(), None: the model's dtypes
    pipeline: dict | None = None                    # stages, schedule, microbatches (autopar.pipeline.search)
    frozen: tuple = ()                              # parameters planned without gradient (requires_grad=False)
    graph: str = ""                                 # autopar.trace.graph_signature of the graph planned

    def device_mesh(self):
        """The Mesh to compile this plan on: the whole mesh of a pipelined plan (whose `mesh`
        is one stage's sub-mesh), else `mesh`."""
        if self.pipeline and self.pipeline.get("axis"):
            return Mesh.from_dict(self.pipeline["full_mesh"])
        return Mesh.from_dict(self.mesh)

    def zero_stage(self, name: str) -> int:
        """The ZeRO stage of parameter `name`: 3 when it is stored split and all-gathered for
        use in forward, else its ParamState's stage (0 when it has none)."""
        if name not in self.param_placements:
            raise KeyError(f"plan has no parameter {name!r}")
        state = self.param_states.get(name)
        if state is not None and state.stage:
            return state.stage
        gathered = any(c.tensor == name and c.kind == "all_gather" and c.phase == "forward" for c in self.collectives)
        return 3 if gathered else 0

    @property
    def identity(self) -> dict:
        """Everything that defines the plan (its timing left out)."""
        d = self.to_dict()
        d.pop("timing")
        return d

    # --- queries ----------------------------------------------------------------------------
    def node(self, name: str) -> NodeChoice:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan has no node {name!r}")

    def collectives_of(self, kind: str | None = None, phase: str | None = None) -> list:
        return [c for c in self.collectives if (kind is None or c.kind == kind) and (phase is None or c.phase == phase)]

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]

    # --- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        def node_dict(n: NodeChoice):
            d = asdict(n)
            d["split"] = list(n.split)
            d["inputs"] = [[placement_str(p) for p in ps] for ps in n.inputs]
            d["outputs"] = [[placement_str(p) for p in ps] for ps in n.outputs]
            d["grads"] = [None if ps is None else [placement_str(p) for p in ps] for ps in n.grads]
            return d

        def pred(p):
            return asdict(p) if isinstance(p, Prediction) else p

        return {
            "format": FORMAT_VERSION, "model": self.model, "mesh": self.mesh,
            "param_placements": {k: [placement_str(p) for p in v] for k, v in self.param_placements.items()},
            "nodes": [node_dict(n) for n in self.nodes],
            "collectives": [dict(asdict(c), axes=list(c.axes)) for c in self.collectives],
            "predicted": pred(self.predicted), "solver": self.solver,
            "baselines": {k: pred(v) for k, v in self.baselines.items()},
            "memory_budget": self.memory_budget, "fallback_ops": list(self.fallback_ops),
            "layers": [[p, list(ix)] for p, ix in self.layers],
            "grad_sums": {k: [placement_str(p) for p in v] for k, v in self.grad_sums.items()},
            "origin": self.origin, "timing": self.timing,
            "param_states": {k: {"stage": v.stage, "axes": list(v.axes), "offload": v.offload}
                             for k, v in self.param_states.items()},
            "precision": self.precision, "pipeline": self.pipeline, "frozen": list(self.frozen),
            "graph": self.graph,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"plan format {d.get('format')} is not {FORMAT_VERSION}; re-plan with this autopar")

        def places(ps):
            return tuple(placement_from_str(p) for p in ps)

        def pred(p):
            return Prediction(**p) if isinstance(p, dict) else p

        nodes = tuple(NodeChoice(**dict(n, split=tuple(n["split"]), inputs=tuple(places(x) for x in n["inputs"]),
                                        outputs=tuple(places(x) for x in n["outputs"]),
                                        grads=tuple(None if x is None else places(x) for x in n["grads"])))
                      for n in d["nodes"])
        return cls(mesh=d["mesh"], model=d["model"],
                   param_placements={k: places(v) for k, v in d["param_placements"].items()},
                   nodes=nodes, collectives=tuple(Collective(**dict(c, axes=tuple(c["axes"]))) for c in d["collectives"]),
                   predicted=pred(d["predicted"]), solver=d["solver"],
                   baselines={k: pred(v) for k, v in d["baselines"].items()},
                   memory_budget=d["memory_budget"], fallback_ops=tuple(d["fallback_ops"]),
                   layers=tuple((p, tuple(ix)) for p, ix in d["layers"]),
                   grad_sums={k: places(v) for k, v in d["grad_sums"].items()}, origin=d["origin"],
                   timing=d.get("timing", {}),
                   param_states={k: ParamState(v["stage"], tuple(v["axes"]), v["offload"])
                                 for k, v in d.get("param_states", {}).items()},
                   precision=d.get("precision"), pipeline=d.get("pipeline"), frozen=tuple(d.get("frozen", ())),
                   graph=d.get("graph", ""))

    def save(self, path) -> None:
        """JSON with a checksum of the plan, so that a file edited by hand is refused at load."""
        with open(path, "w") as f:
            f.write(json.dumps(dict(self.to_dict(), checksum=self.hash()), indent=1))

    @classmethod
    def load(cls, path) -> "Plan":
        """A plan saved by Plan.save; PlanFileError names the file and what is wrong with it."""
        with open(path) as f:
            text = f.read()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(f"plan file {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                                f"{exc.msg}); save plans with plan.save(path), or plan again") from None
        if not isinstance(d, dict):
            raise PlanFileError(f"plan file {path} holds a {type(d).__name__}, not a plan; plan again")
        checksum = d.pop("checksum", None)
        try:
            plan = cls.from_dict(d)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFileError(f"plan file {path} is not a plan this autopar can read ({type(exc).__name__}: "
                                f"{exc}); plan again with this version") from None
        if checksum is not None and checksum != plan.hash():
            raise PlanFileError(f"plan file {path} was changed after it was saved (its checksum {checksum} does "
                                f"not match its contents {plan.hash()}): a hand-edited placement or strategy can "
                                f"make the passes produce wrong shapes. Fix the choice with autopar.plan(..., "
                                f"layout=...) or memory_budget instead, or plan again")
        return plan

    # --- printing ---------------------------------------------------------------------------
    def __str__(self) -> str:
        axes = self.mesh["axis_names"]
        shape = self.mesh["shape"]
        lines = [f"autopar plan ({self.origin}) for {self.model} on mesh "
                 + " x ".join(f"{a}={s}" for a, s in zip(axes, shape))
                 + f" ({self.mesh['device']['name']})",
                 f"predicted: {self.predicted}"]
        s = self.solver
        if "optimal" not in s:
            state = "not solved (" + self.origin + ")"
        else:
            state = "optimal" if s.get("optimal") else f"feasible (gap {s.get('gap', 0):.2%})"
        t = self.timing
        size = f", {s['variables']} variables, {s['constraints']} constraints" if "variables" in s else ""
        lines.append(f"solver: {state}{size}; planned in {t.get('total_s', 0):.2f}s (trace {t.get('trace_s', 0):.2f}s, "
                     f"menus and costs {t.get('costs_s', 0):.2f}s, ILP {t.get('solve_s', 0):.2f}s)")
        if self.memory_budget:
            lines.append(f"memory budget: {_b(self.memory_budget)} per device")
        if self.pipeline:
            lines.append(self.pipeline["summary"] + ("; the table below is one stage's plan for one microbatch"
                                                     if self.pipeline["axis"] else ""))
        if self.precision:
            lines.append(f"precision: compute {self.precision['param_dtype']}, float32 master weights, "
                         f"gradients reduced in {self.precision['reduce_dtype']}")
        states = Counter()
        for name in self.param_placements:
            st = self.param_states.get(name)
            label = f"zero-{self.zero_stage(name)}" + (", offload" if st is not None and st.offload else "")
            states[label] += 1
        if states:
            lines.append("model states: " + "; ".join(f"{k}: {v} parameters" for k, v in sorted(states.items())))
        if self.fallback_ops:
            lines.append(f"replicated (no sharding rule): {', '.join(self.fallback_ops)}")
        if self.baselines:
            lines.append("")
            lines.append("hand-written layouts on the same mesh (predicted):")
            lines.append(f"  {'layout':<22}{'step':>12}{'memory':>12}{'vs plan':>10}")
            lines.append(f"  {'autopar':<22}{_t(self.predicted.step_s):>12}{_b(self.predicted.memory_total):>12}{'1.00x':>10}")
            limit = self.memory_budget or self.mesh["device"]["memory"]
            for name, p in self.baselines.items():
                if isinstance(p, Prediction):
                    ratio = p.step_s / self.predicted.step_s if self.predicted.step_s else float("nan")
                    fits = "" if p.memory_total <= limit else f"  does not fit {_b(limit)}"
                    lines.append(f"  {name:<22}{_t(p.step_s):>12}{_b(p.memory_total):>12}{ratio:>9.2f}x{fits}")
                else:
                    lines.append(f"  {name:<22}  not possible: {p}")
        lines.append("")
        lines.append("collectives per step:")
        tally = Counter()
        vol = defaultdict(float)
        for c in self.collectives:
            key = (c.phase, c.kind, "+".join(c.axes))
            tally[key] += 1
            vol[key] += c.nbytes
        for key in sorted(tally):
            lines.append(f"  {key[0]:<9}{key[1]:<15} on {key[2]:<8}{tally[key]:>6} x, {_b(vol[key])} total")
        if not tally:
            lines.append("  none")
        lines.append("")
        lines.append(self.table())
        return "\n".join(lines)

    def table(self) -> str:
        """One row per parameter and compute node; identical repeated layers collapse to one row."""
        groups: dict = {}
        order = []
        for n in self.nodes:
            if n.op in _HIDDEN_OPS:
                continue
            generic, idx = _generic(n.module, self.layers)
            key = (generic, n.op, n.strategy, _layout(n))
            if key not in groups:
                groups[key] = [set(), 0, 0.0, 0.0]
                order.append(key)
            g = groups[key]
            g[0].add(idx)
            g[1] += 1
            g[2] += n.compute_s + n.comm_s
            g[3] += n.memory
        header = f"{'module':<40} {'op':<30} {'layout':<34} {'time':>10} {'memory':>10}"
        rows = [header, "-" * len(header)]
        for key in order:
            generic, op, strategy, layout = key
            idxs, count, t, m = groups[key]
            label = generic
            if idxs != {None}:
                ix = sorted(i for i in idxs if i is not None)
                span = f"{ix[0]}-{ix[-1]}" if len(ix) > 1 else str(ix[0])
                label = generic.replace("{}", span, 1)
            if count > 1:
                label += f" x{count}"
            rows.append(f"{label[:40]:<40} {op.replace('aten.', '')[:30]:<30} {(strategy + ' ' + layout)[:34]:<34} "
                        f"{_t(t):>10} {_b(m):>10}")
        return "\n".join(rows)


_HIDDEN_OPS = {"input", "output"}


def _layout(n: NodeChoice) -> str:
    if n.op == "parameter":
        return ""
    return "-> " + " ".join(show(p) for p in n.outputs)


def _generic(module: str, layers) -> tuple[str, int | None]:
    for prefix, indices in layers:
        m = re.match(re.escape(prefix) + r"\.(\d+)(\.|$)(.*)", module)
        if m and int(m.group(1)) in indices:
            rest = (m.group(2) + m.group(3)) if m.group(3) else ""
            return f"{prefix}.{{}}{rest}", int(m.group(1))
    return module or "(model)", None


def _t(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds * 1e6:.1f}us"


def _b(nbytes: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}{unit}"
    return f"{nbytes:.0f}B"
