"""Stage costs for the pipeline search (autopar/solve/pipeline/search.py).

For each sub-mesh and microbatch size the whole model is planned by the intra-stage ILP
(tensor, data parallelism and ZeRO inside the stage) on a microbatch; the plan's per-node
times are summed per repeated layer, plus what runs before the first layer (embeddings)
and after the last (head, loss).  Every op pays the device's op latency once per pass
(forward, and twice in backward; cost.roofline): small microbatches are not free, which
is what keeps small models on fast networks out of pipelines.  Per microbatch a layer
costs its compute and activation communication; its gradient synchronisation, optimizer
step and optimizer all-gathers run once per step.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields, replace

from autopar.placements import local_numel
from autopar.mesh import Mesh
from autopar.solve import layouts as B
from autopar.solve.assemble import assemble
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.report.records import RECOMPUTING
from autopar.solve.recompute.modes import layer_paths, mode_costs
from autopar.solve.problem.pricing import Pricing
from autopar.solve.built import Built, build_problem
from autopar.solve.ilp.solved import SolveOptions
from autopar.trace.batching import batch_size, first_microbatch
from autopar.trace.paths import layer_of

BACKWARD_SHARE = 2.0 / 3.0   # of a trainable op's per-microbatch seconds: backward runs two matmuls per forward one


@dataclass(frozen=True)
class StageCost:
    """Seconds and bytes of one candidate stage layout, per microbatch unless noted."""

    forward_s: float
    backward_s: float
    once_s: float        # per step: gradient synchronisation, optimizer all-gathers
    params: float        # bytes of parameters,
    grads: float         # ... of gradients
    optimizer: float     # ... and of optimizer states (with master weights)
    activations: float   # bytes kept for backward per microbatch
    working: float = 0.0  # the most any one op needs beyond them while it runs (recompute/modes.working_bytes)
    host: float = 0.0     # bytes per microbatch its layers' offloaded activations keep in host memory
    # what the tensor-parallel collectives the runtime runs hidden beside their GEMMs
    # (passes/fold_linears.py; solve/assemble's Assembled.folded) take off forward_s and
    # backward_s (a node's hidden seconds split as its seconds are), where the schedule's
    # stages fold them (cost.schedules.folds_tp)
    folded_forward: float = 0.0
    folded_backward: float = 0.0
    # bytes of its gradients once synchronised (a ZeRO-2 rank's shard: it holds the whole
    # local gradient, `grads`, until the last microbatch): what chimera's two copies of a
    # stage sum after the step
    synced_grads: float = 0.0
    # of once_s, the gradients' synchronisation (their buckets go out during a stage's last
    # backward, runtime/pipeline/pipelined._sync_on_last: what of it that pass covers is hidden on an
    # asynchronous device); the rest (the optimizer's step and gathers) runs after it
    sync_s: float = 0.0

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer


STATES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class StageParts:
    """One recompute mode's costs of a candidate: each repeated layer's, in order, and what
    runs before the first layer (prefix) and after the last (suffix)."""

    layers: tuple
    prefix: StageCost
    suffix: StageCost

    @property
    def members(self) -> list:
        return [self.prefix, *self.layers, self.suffix]


@dataclass(frozen=True)
class LayerCosts:
    """A candidate's costs split per repeated layer: by_mode, recompute mode -> StageParts;
    boundary: bytes per device of the tensor crossing a cut; layer_prefix and
    layer_indices: the repeated layers (`layer_prefix`.<i>); copies: the model states the
    last stage holds again (weights tied to the first stage's).  layout: the hand-written
    layout the stage plan follows (None: the free summed optimum); alternatives: the same
    candidate's costs under the layouts of STAGE_LAYOUTS, each a LayerCosts."""

    by_mode: dict
    boundary: float
    layer_prefix: str
    layer_indices: tuple
    copies: StageCost
    layout: str | None = None
    alternatives: tuple = ()

    def variants(self) -> list:
        """This candidate's costs and its alternatives', the free plan first."""
        return [self, *self.alternatives]


def stage_problem(model, mesh, example_inputs, example_kwargs, mixed_precision, sub_shape, mb_size,
                  pricing=None, short: bool = False) -> Built:
    """The traced and costed problem of one stage candidate: the model on a sub-mesh of
    `mesh` shaped `sub_shape` (same links), for a microbatch of `mb_size` rows.  Pipeline
    stages gather their ZeRO-3 weights one by one (autopar/runtime/pipeline/pipelined.py): only the whole
    mesh's candidate prices them grouped.  A stage accumulates its gradients over the step's
    batch // mb_size microbatches (the runtime runs every backward but each stage's last
    under runtime/grads/sync.no_sync), so its problem is priced for that accumulation
    (Pricing.accumulation): the ILP weighs the once-per-step gradient reductions, the
    optimizer step and ZeRO-1/2's gathers at their share of one microbatch, and a ZeRO-2
    stage keeps its whole local gradient until the last; _Split counts them back whole,
    once per step.  short: traced through four or five of its alike layers
    (build_problem(short=True)), for the search's costs alone."""
    sub = Mesh(sub_shape, mesh.axis_names, device=mesh.device, bandwidth=mesh.bandwidth, latency=mesh.latency)
    batch = batch_size(example_inputs, example_kwargs)
    pricing = replace(pricing or Pricing(), accumulation=max(batch // mb_size, 1))
    args, kwargs = first_microbatch((tuple(example_inputs), example_kwargs), batch, mb_size)
    return build_problem(model, sub, args, kwargs, mixed_precision, tuple(sub_shape) == tuple(mesh.shape),
                         pricing, pipelined=True, short=short)


class StageCosts:
    """(sub-mesh shape, microbatch rows) -> LayerCosts of the candidate stage, each built,
    solved and split once in this process (forked workers fill their own copies and send
    back what they costed: adopt).  Every candidate but the whole mesh is costed on its
    shortened trace (build_problem(short=True): the same per-layer costs from a problem of
    four or five layers); the planner plans the winner's whole.  The problems built here are
    kept only for the whole mesh and the best candidate so far, where whole (keep_only):
    the planner reuses them."""

    def __init__(self, model, mesh: Mesh, example_inputs, example_kwargs, mixed_precision, options: SolveOptions,
                 modes: tuple, pricing=None, layout: str | None = None, wants=None):
        self.model, self.mesh, self.wants = model, mesh, wants   # wants(key, free costs): price the alternatives
        self.pricing, self.layout = pricing, layout
        self.example_inputs, self.example_kwargs = example_inputs, example_kwargs
        self.mixed_precision, self.options, self.modes = mixed_precision, options, modes
        self.whole = (tuple(mesh.shape), batch_size(example_inputs, example_kwargs))
        self._costs: dict = {}
        self._problems: dict = {}

    def __call__(self, key) -> LayerCosts | None:
        if key not in self._costs:
            built = self._problems[key] = stage_problem(self.model, self.mesh, self.example_inputs,
                                                        self.example_kwargs, self.mixed_precision, *key,
                                                        self.pricing, short=key != self.whole)
            wants = None if self.wants is None else (lambda free: key != self.whole and self.wants(key, free))
            self._costs[key] = layer_costs(built, self.model, self.options, self.modes, self.layout, wants)
            if built.short:
                del self._problems[key]   # (no plan is made of it)
        return self._costs[key]

    def share(self, groups, keep: bool = True) -> dict:
        """{key: costs} over groups of keys (workers.deal), costed here.  keep=False: each
        problem dropped once costed (a forked worker, which sends back only the costs and
        has no use for the problems after)."""
        out = {}
        for group in groups:
            for key in group:
                out[key] = self(key)
                if not keep and key != self.whole:
                    self._problems.pop(key, None)
        return out

    def missing(self, keys) -> list:
        return [k for k in keys if k not in self._costs]

    def adopt(self, costed: dict) -> None:
        """Costs another process computed (workers.Costed.costs)."""
        self._costs.update(costed)

    def problem(self, key) -> Built | None:
        """The problem built here for `key`, while kept."""
        return self._problems.get(key)

    def keep_only(self, best: Built | None) -> None:
        """Forget every problem but `best` and the whole mesh's."""
        for key in [k for k, b in self._problems.items() if b is not best and k != self.whole]:
            del self._problems[key]


def layer_costs(built: Built, model, options: SolveOptions, modes=("none",), layout: str | None = None,
                alternatives=None) -> LayerCosts | None:
    """Plan the built problem by its summed optimum (Built.summed: the stage costs below add
    up the plan's seconds, so that is the plan they price best) and split the plan's costs
    per repeated layer; None when nothing fits.  With `layout` (a hand-written layout the
    stages are forced into: plan(solve=SolveOptions(layout=...), pipeline=...)) the stage is planned in that
    layout alone, so the search prices, cuts and checks the memory of the stages that will
    run; None where the candidate's sub-mesh has no such layout.  Under a recompute mode (every repeated
    layer alike) a layer keeps what recompute/modes.ModeCosts says, its backward runs again the
    forward of the ops it does not keep, and its working memory includes what it makes
    again.

    The summed optimum knows nothing of memory: where a stage must recompute to fit, a
    slower layout that keeps less may win (Megatron-SP splits the norms' and residuals'
    activations by sequence, so selective recomputation fits where the free plan needs full;
    Korthikanti et al. 2022).  So the candidate is priced under each of stage_layouts too
    (LayerCosts.alternatives), and the search takes whichever is fastest once it fits;
    `alternatives(free)`, where given, says whether the free plan's costs need them (the
    search asks whether every layout of the candidate fits under the free plan: then the
    free plan, the fastest, wins; llama3-8b on 64 H100 prices 9 candidates once, not three
    times)."""
    problem = built.problem
    if layout is not None:
        rule = B.layouts(problem.mesh, every=True).get(layout)
        if rule is None or B.unavailable(rule, problem):
            return None
        try:
            choice = built.laid_out(layout, rule, options).choice
        except InfeasibleError:
            return None
    else:
        try:
            choice = built.summed(options).choice
        except InfeasibleError:
            return None
    if not problem.layer_groups:
        raise ValueError(f"{type(model).__name__} has no repeated layers (modules named like blocks.0, "
                         f"blocks.1, ...) to cut into pipeline stages")
    if layout is not None:
        return _split_costs(problem, choice, modes, layout)
    free = _split_costs(problem, choice, modes, None)
    if alternatives is not None and not alternatives(free):
        return free
    others = []
    for name, rule in stage_layouts(problem).items():
        try:
            ruled = built.laid_out(name, rule, options).choice
        except InfeasibleError:
            continue
        others.append(_split_costs(problem, ruled, modes, name))
    return dataclasses.replace(free, alternatives=tuple(others))


def stage_layouts(problem) -> dict:
    """name -> rule of the hand-written layouts a stage candidate is priced in besides its
    free plan: Megatron-SP where the stage's mesh has a dimension to split and the model
    has attention, and, on a stage mesh of two or more axes, Megatron with ZeRO-1 over the
    others (solve/layouts.py).  The free plan weighs no memory: accumulating over the
    microbatches, it keeps whole optimizer states, which a stage of a large model can hold
    only by recomputing everything; ZeRO-1 stores them sharded at one gather a step, the
    layout Megatron-LM runs its pipelines in (its 314B and 462B GPTs' stages: the free plan
    recomputed every layer and was predicted 0.84-0.91x their layout before this)."""
    mesh = problem.mesh
    if not any(n > 1 for n in mesh.shape):
        return {}
    rules = B.layouts(mesh, every=True)
    out = {}
    for name in ("megatron-sp" if "megatron-sp" in rules else "megatron-sp x dp", "megatron-tp x zero1"):
        rule = rules.get(name)
        if rule is not None and B.relevant(name, problem) and not B.unavailable(rule, problem):
            out[name] = rule
    return out


def _split_costs(problem, choice, modes, layout) -> LayerCosts:
    """A plan's costs split per repeated layer under each recompute mode."""
    assembled = assemble(problem, choice)
    short = problem.traced.layers if problem.traced.weights else None
    prefix_name, indices = next((g for g in problem.layer_groups if g[0] == short[0] and short[2] + 1 in g[1]),
                                (None, ())) if short else (None, ())
    if prefix_name is None:
        short = None
        prefix_name, indices = max(problem.layer_groups, key=lambda g: len(g[1]))
    position = {i: k for k, i in enumerate(sorted(indices))}
    split = _Split(problem, choice, assembled, prefix_name, position)
    by_mode = {mode: split.parts(mode, prefix_name, indices) for mode in modes}
    if short:   # each kept layer's costs copied to the layers it stands for (trace/shortened.py)
        _, count, lead = short
        at = [position[i] if i in (lead, count - 1) else position[lead + 2 - (i - lead) % 2]
              for i in range(lead, count)]
        by_mode = {m: replace(p, layers=tuple(p.layers[k] for k in at)) for m, p in by_mode.items()}
        indices = range(lead, count)
    return LayerCosts(by_mode, _boundary_bytes(problem, choice, prefix_name), prefix_name, tuple(sorted(indices)),
                      StageCost(**split.buckets["copies"]), layout)


class _Split:
    """A plan's seconds and bytes added up per bucket: each repeated layer (by position),
    "prefix", "suffix", and "copies" (states of tied weights the last stage holds again);
    each bucket a dict of StageCost's fields."""

    def __init__(self, problem, choice, assembled, prefix: str, position):
        self.problem, self.choice = problem, choice
        self.folded = assembled.folded
        once, sync = {}, {}
        params = {pn.param_name for pn in problem.nodes if pn.kind == "param"}
        for c in assembled.collectives:  # per-step collectives: gradients of parameters, the optimizer's gathers
            if (c.phase == "backward" and c.tensor in params) or c.phase == "step":
                once[c.node] = once.get(c.node, 0.0) + c.seconds
            if c.phase == "backward" and c.tensor in params:
                sync[c.node] = sync.get(c.node, 0.0) + c.seconds
        self.sync = sync
        self.keys, self.forward = {}, {}   # node index -> its bucket; op -> the forward seconds it runs per microbatch
        self.buckets = {k: dict.fromkeys((f.name for f in fields(StageCost)), 0.0)
                        for k in ["prefix", "suffix", "copies", *range(len(position))]}
        seen_layer = False
        for idx in sorted(assembled.nodes):
            pn, n = problem.nodes[idx], assembled.nodes[idx]
            layer = layer_of(n.module or "", prefix)
            if layer in position:
                key = position[layer]
                seen_layer = seen_layer or pn.kind == "op"
            elif pn.kind == "param":
                key = "prefix" if _first_reader_before_layers(problem, pn, prefix) else "suffix"
            else:
                key = "suffix" if seen_layer else "prefix"
            self.keys[idx] = key
            self._add(idx, pn, n, key, once, prefix)

    def _add(self, idx, pn, n, key, once, prefix: str) -> None:
        b = self.buckets[key]
        c = self.problem.choices[pn.rep][self.choice[idx]]
        total = n.compute_s + n.comm_s
        o = once.get(n.name, 0.0) + ((once.get(n.module, 0.0) + n.compute_s) if pn.kind == "param" else 0.0)
        per_mb = max(total - o, 0.0)
        o *= self.problem.pricing.accumulation   # (priced at its share of one microbatch: stage_problem)
        bwd_share = BACKWARD_SHARE if pn.requires_grad else 0.0
        f = per_mb * (1 - bwd_share)
        b["backward_s"] += per_mb * bwd_share
        b["forward_s"] += f
        self.forward[idx] = f if pn.kind == "op" else 0.0
        b["once_s"] += o
        b["sync_s"] += min(o, (self.sync.get(n.name, 0.0) + (self.sync.get(n.module, 0.0) if pn.kind == "param" else 0.0))
                           * self.problem.pricing.accumulation)
        hidden = min(self.folded.get(idx, 0.0), per_mb)   # (split as the node's seconds are)
        b["folded_forward"] += hidden * (1 - bwd_share)
        b["folded_backward"] += hidden * bwd_share
        for kind in (*STATES, "activations"):
            b[kind] += c.memory[kind]
        if pn.kind == "param":
            st = self.problem.nodes[pn.rep].strategies[self.choice[idx]]
            ways = math.prod(self.problem.mesh.shape[a] for a in st.zero_axes) if st.zero == 2 else 1
            b["synced_grads"] += c.memory["grads"] / ways if self.problem.pricing.accumulation > 1 else c.memory["grads"]
        b["working"] = max(b["working"], c.work if pn.kind == "op" else 0.0)
        if key == "prefix" and pn.kind == "param" and _read_after_layers(self.problem, pn, prefix):
            for kind in STATES:   # a tied head: the last stage holds it too
                self.buckets["copies"][kind] += c.memory[kind]

    def parts(self, mode: str, prefix_name: str, indices) -> StageParts:
        """The StageParts under recompute `mode` on every repeated layer."""
        problem, choice = self.problem, self.choice
        got = {k: dict(b) for k, b in self.buckets.items()}
        if mode != "none":
            costs = mode_costs(problem, {f"{prefix_name}.{i}": mode for i in indices})   # (once per candidate)
            layer = layer_paths(problem)
            remade = costs.remade(problem, choice)
            for b in got.values():
                b["activations"] = 0.0
            for idx, key in self.keys.items():
                b = got[key]
                kept = costs.keeps.get(idx)
                b["activations"] += 0.0 if kept is None else float(kept[choice[idx]])
                path = layer.get(idx)
                if path in costs.modes and problem.nodes[idx].kind == "op":
                    if mode in RECOMPUTING and idx not in costs.kept:
                        b["backward_s"] += self.forward[idx]   # backward runs its forward again
                    work = problem.choices[problem.nodes[idx].rep][choice[idx]].work
                    b["working"] = max(b["working"], float(work + remade[path]))
            if mode == "offload":   # each layer's saved storages down to host memory and back
                by_layer: dict = {}
                for n, item in costs.host_entries:
                    by_layer.setdefault(self.keys.get(n), []).append((n, item))
                for key, entries in by_layer.items():
                    if key in got:
                        held = problem.saved.kept_bytes(choice, entries)
                        got[key]["forward_s"] += costs.crossing * held / 2
                        got[key]["backward_s"] += costs.crossing * held / 2
                        got[key]["host"] += held
        return StageParts(tuple(StageCost(**got[k]) for k in range(len(indices))), StageCost(**got["prefix"]),
                          StageCost(**got["suffix"]))


def _first_reader_before_layers(problem, pn, prefix: str) -> bool:
    """A parameter outside the layers belongs to the prefix if it is read before any layer
    (embeddings; a tied head reads it again at the end: the prefix owns it)."""
    readers = [r for r, _ in problem.readers.get((pn.index, 0), [])]
    if not readers:
        return True
    first = min(readers)
    return not any(problem.nodes[r].kind == "op" and layer_of(problem.nodes[r].module or "", prefix) is not None
                   for r in range(first))


def _read_after_layers(problem, pn, prefix: str) -> bool:
    """Whether a parameter is also read after the last repeated layer (a head tied to the
    input embedding): the last stage then holds a copy of it."""
    readers = [r for r, _ in problem.readers.get((pn.index, 0), [])]
    layer_ops = [i for i, n in enumerate(problem.nodes)
                 if n.kind == "op" and layer_of(n.module or "", prefix) is not None]
    return bool(readers and layer_ops) and max(readers) > max(layer_ops)


def _boundary_bytes(problem, choice, prefix: str) -> float:
    """Bytes per device of the tensor that flows from one layer into the next (the largest
    such tensor: the residual stream)."""
    best = 0.0
    for pn in problem.nodes:
        layer = layer_of(pn.module or "", prefix)
        if pn.kind != "op" or layer is None:
            continue
        for src, out in pn.inputs:
            before = layer_of(problem.nodes[src].module or "", prefix)
            if before is not None and before != layer:
                s = problem.nodes[src]
                layout = problem.nodes[s.rep].strategies[choice[src]].outputs[out]
                nbytes = local_numel(s.out_shapes[out], layout, problem.mesh.shape) * s.out_dtypes[out].itemsize
                best = max(best, nbytes)
    return best
