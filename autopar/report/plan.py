"""The Plan: what autopar chose, for every node, with the predicted time and memory.

A Plan is the only thing the passes and the runtime consume.  It is plain data made of the
records in autopar/report/records.py: it prints as a table a person reads in a terminal
(autopar/report/text.py), saves to JSON and loads back equal.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from autopar.mesh import Mesh
from autopar.cost.precision import MixedPrecision
from autopar.report.records import (
    Collective, NodeChoice, ParamState, PipelineLayout, Prediction, Recompute, SolverStats, Timing, tier_of)
from autopar.placements import placement_from_str, placement_str
from autopar.report.text import plan_table, plan_text

__all__ = ["Plan", "PlanFileError", "FORMAT_VERSION", "Collective", "NodeChoice", "ParamState", "PipelineLayout",
           "Prediction", "Recompute", "SolverStats", "Timing"]

FORMAT_VERSION = 2  # 2: NodeChoice.reduced (localize reads it instead of re-running the op rules)


class PlanFileError(ValueError):
    """A plan file that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Plan:
    mesh: Mesh                                      # the mesh planned (a pipelined plan: one stage's sub-mesh)
    model: str
    param_placements: dict
    nodes: tuple
    collectives: tuple
    predicted: Prediction
    solver: SolverStats
    baselines: dict = field(default_factory=dict)   # layout name -> Prediction or a reason string
    memory_budget: float | None = None
    fallback_ops: tuple = ()
    layers: tuple = ()                              # (module prefix, repeated layer indices)
    grad_sums: dict = field(default_factory=dict)   # "node:output" -> layout its readers' gradients are added in
    origin: str = "ilp"                             # "ilp", "layout:<name>" or "random:<seed>"
    timing: Timing = field(default_factory=Timing, compare=False)  # wall seconds of each planning step
    param_states: dict = field(default_factory=dict)  # parameter name -> ParamState (ZeRO-1/2, offload)
    precision: MixedPrecision | None = None         # None: the model's own dtypes
    pipeline: PipelineLayout | None = None          # stages, schedule, microbatches (autopar.solve.pipeline.search)
    frozen: tuple = ()                              # parameters planned without gradient (requires_grad=False)
    graph: str = ""                                 # autopar.trace.export.graph_signature of the graph planned
    notes: tuple = ()                               # why forms were left off the menus (heads, sequence splits)
    recompute: Recompute | None = None              # layers recomputed in backward (None: none)
    backend: str = "eager"                          # what it was priced for: "eager" or "inductor" (fused chains)
    accumulation: int = 1                           # micro-steps per optimizer step it was priced for
    tp_overlap: bool = True                         # TP collectives run (and priced) beside their GEMMs

    def device_mesh(self):
        """The Mesh to compile this plan on: the whole mesh of a pipelined plan (whose `mesh`
        is one stage's sub-mesh), else `mesh`."""
        if self.pipeline is not None and self.pipeline.pipelined:
            return self.pipeline.full_mesh
        return self.mesh

    @property
    def step_s(self) -> float:
        """The predicted training step of the whole plan: its pipeline's when it has stages
        (`predicted` is then one stage's plan for one microbatch)."""
        pp = self.pipeline
        return pp.step_s if pp is not None and pp.pipelined else self.predicted.step_s

    @property
    def memory_per_device(self) -> float:
        """The predicted bytes per device of the whole plan: its fullest device group's when
        it has stages."""
        pp = self.pipeline
        return max(pp.memory) if pp is not None and pp.pipelined else self.predicted.memory_total

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
            "format": FORMAT_VERSION, "model": self.model, "mesh": self.mesh.to_dict(),
            "param_placements": {k: [placement_str(p) for p in v] for k, v in self.param_placements.items()},
            "nodes": [node_dict(n) for n in self.nodes],
            "collectives": [dict(asdict(c), axes=list(c.axes)) for c in self.collectives],
            "predicted": pred(self.predicted), "solver": self.solver.to_dict(),
            "baselines": {k: pred(v) for k, v in self.baselines.items()},
            "memory_budget": self.memory_budget, "fallback_ops": list(self.fallback_ops),
            "layers": [[p, list(ix)] for p, ix in self.layers],
            "grad_sums": {k: [placement_str(p) for p in v] for k, v in self.grad_sums.items()},
            "origin": self.origin, "timing": self.timing.to_dict(),
            "param_states": {k: {"stage": v.stage, "axes": list(v.axes), "offload": v.offload,
                                   **({"weights": True} if v.weights else {})}
                             for k, v in self.param_states.items()},
            "precision": None if self.precision is None else self.precision.to_dict(),
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(), "frozen": list(self.frozen),
            "graph": self.graph, "notes": list(self.notes),
            "recompute": None if self.recompute is None else self.recompute.to_dict(),
            "backend": self.backend, "accumulation": self.accumulation, "tp_overlap": self.tp_overlap,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"plan format {d.get('format')} is not this autopar's format {FORMAT_VERSION} (format 2 "
                             f"records which mesh axes each op sums over); plan again with this autopar")

        def places(ps):
            return tuple(placement_from_str(p) for p in ps)

        def pred(p):
            return Prediction(**p) if isinstance(p, dict) else p

        nodes = tuple(NodeChoice(**dict(n, split=tuple(n["split"]), inputs=tuple(places(x) for x in n["inputs"]),
                                        outputs=tuple(places(x) for x in n["outputs"]),
                                        grads=tuple(None if x is None else places(x) for x in n["grads"]),
                                        reduced=tuple(n["reduced"])))
                      for n in d["nodes"])
        return cls(mesh=Mesh.from_dict(d["mesh"]), model=d["model"],
                   param_placements={k: places(v) for k, v in d["param_placements"].items()},
                   nodes=nodes, collectives=tuple(Collective(**dict(c, axes=tuple(c["axes"]))) for c in d["collectives"]),
                   predicted=pred(d["predicted"]), solver=SolverStats.from_dict(d["solver"]),
                   baselines={k: pred(v) for k, v in d["baselines"].items()},
                   memory_budget=d["memory_budget"], fallback_ops=tuple(d["fallback_ops"]),
                   layers=tuple((p, tuple(ix)) for p, ix in d["layers"]),
                   grad_sums={k: places(v) for k, v in d["grad_sums"].items()}, origin=d["origin"],
                   timing=Timing.from_dict(d.get("timing", {})),
                   param_states={k: ParamState(v["stage"], tuple(v["axes"]), tier_of(v["offload"]),
                                                    bool(v.get("weights", False)))
                                 for k, v in d.get("param_states", {}).items()},
                   precision=MixedPrecision.from_dict(d.get("precision")),
                   pipeline=None if d.get("pipeline") is None else PipelineLayout.from_dict(d["pipeline"]),
                   frozen=tuple(d.get("frozen", ())),
                   graph=d.get("graph", ""), notes=tuple(d.get("notes", ())),
                   recompute=None if d.get("recompute") is None else Recompute.from_dict(d["recompute"]),
                   backend=d.get("backend", "eager"), accumulation=int(d.get("accumulation", 1)),
                   tp_overlap=bool(d.get("tp_overlap", True)))

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
                                f"solve=SolveOptions(layout=...)) or memory_budget instead, or plan again")
        return plan

    # --- printing ---------------------------------------------------------------------------
    def __str__(self) -> str:
        return plan_text(self)

    def table(self) -> str:
        """One row per parameter and compute node; identical repeated layers collapse to one row."""
        return plan_table(self)
