"""compile(run=RunOptions(backend="inductor")): each rank's graph run as Inductor-compiled regions.

After every pass, the rank's graph is copied and the plan's moves of activations (every
move whose tensor does not come straight from a placeholder) are rewritten as functional
collectives (runtime/regions/functional_moves.py): they become ordinary values in the graph.  The
copy is then cut into maximal runs of nodes, in graph order, of two kinds:

- compute: ATen ops (and `getitem` of their tuples) that draw no random numbers, and the
  functional moves;
- the rest: moves of parameters and inputs (ZeRO-3's gathers and the runtime's hooks on
  the parameters' own tensors), the runtime's random draws (dropout masks from autopar's
  own streams, replayed under recomputation; a dropout of probability 0, or in eval mode,
  draws nothing and counts as compute), recomputed regions, autopar's own ops
  (attention over a mesh axis, experts), anything else.

Every compute run with at least MIN_OPS ops that are not views is compiled by
`torch.compile(backend="inductor", fullgraph=True, dynamic=False)`: Inductor fuses its
memory-bound chains (norms, activations, residual adds, dropout's mask product) into few
kernels, AOTAutograd builds the run's backward, and the activation collectives of forward
and backward (Megatron's all-reduces, Megatron-SP's reduce-scatters and all-gathers,
Ulysses' all-to-alls) sit inside the compiled graphs, issued where the graph has them
(Inductor's compute/communication reordering is left off: every rank keeps the graph's
order of collectives).  The rest runs eagerly between the compiled runs, so the gradient
buckets, ZeRO-3's regathers and their prefetch run as the plan priced them.  Before the
cut, each weight's gather moves to the start of its layer's stretch of compute
(with_weights_ahead), so a layer is one run, not one run per weight.  On CUDA a run also
ends where the model's layer changes (LAYER_CUTS), so that backward hands each layer's
gradients to the buckets as it finishes the layer and their all-reduces overlap the earlier
layers' backward, as the plan prices them; CPU ranks, priced with no such overlap, keep
one run (measured 0-6 % faster there).

A recomputed layer (runtime/regions/recompute.Region) is compiled too.  One whose body is one
run of compute after its weights' gathers runs as one region with the checkpoint inside
the compiled graph (runtime/regions/compiled_checkpoint.py): its compiled backward runs the fused
forward again from the layer's inputs, and ZeRO-3's saved-tensor hooks regather the
gathered weights it keeps.  Recomputed whole, every op is tagged to be recomputed;
selectively, each kept op (a product with a weight, attention) runs under an annotation
(with_kept_tagged) that the checkpoint's policy reads as AOTAutograd traces it, so the
compiled forward saves the kept kernels' outputs and its backward runs only the ops
between them again.  The compiled graph's partitioner leaves out a kept output that no
backward reads (a block's MLP down-projection, read only by the residual add), which
eager's checkpoint caches: such a layer keeps less than the plan's activation bytes by
those outputs.  Any other layer (a body with random draws or eager ops, or a selective
one under a pipeline schedule whose backward recomputes it twice) keeps its
checkpointing and compiles its runs without Dynamo (_WithoutDynamo), which checkpointing
turns off when it runs the forward again.

Under a split-backward pipeline schedule (zero-bubble, ZB-V, DualPipeV) a stage's regions
run as split_backward.TwoPassRun instead: the backward of each is two compiled passes, the
input gradients in the schedule's B and the weights' gradients deferred to its W
(compile_regions' `passes`; the moves of activations stay eager there).

A run Inductor cannot compile runs eagerly, with one warning naming its first ops and the
error; a compile error never changes a result.  Inductor's FX graph cache (on by default)
keeps the compiled kernels across processes, so a restarted job compiles from the cache.
Fused kernels reorder floating-point operations, so results match eager to rounding (about
1e-6 relative in float32), not bit for bit.
"""
from __future__ import annotations

import logging
import operator
import time
import warnings

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._inductor.compile_fx import compile_fx
from torch.fx.passes.split_module import split_module
from torch.utils._python_dispatch import _disable_current_modes

from autopar.passes.collectives import move
from autopar.report.records import SELECTIVE_MODES
from autopar.runtime.regions.compiled_checkpoint import as_checkpointed, with_kept_tagged
from autopar.runtime.regions.functional_moves import functional_move
from autopar.runtime.regions.recompute import Region
from autopar.passes.gathers import gather
from autopar.passes.random_ops import draws_nothing, is_random, plain_op
from autopar.runtime.regions.sigmoid_gelu import with_sigmoid_gelus
from autopar.runtime.regions.split_backward import WEIGHT, TwoPassRun, WeightPasses, mark_weights
from autopar.ops.rules import VIEWS
from autopar.report.records import RECOMPUTING
from autopar.trace.paths import block_of, module_path


log = logging.getLogger("autopar")

MIN_OPS = 2   # a run with fewer non-view ops is not worth a compiled region
# whether a run of compute also ends where the model's layer changes (None: as the caller
# says, on CUDA; compile_regions)
LAYER_CUTS: bool | None = None


def _aten_name(node: fx.Node) -> str | None:
    """The ATen op's name (`mm`, `add`...) of a node that calls one (a kept op of a
    selective layer compiled whole, with_kept_tagged, included), else None."""
    target = getattr(node.target, "_autopar_tagged", node.target)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(target)
        if name.startswith("aten."):
            return name.split(".")[1]
    return None


def is_compute(node: fx.Node) -> bool:
    """Whether a node may run inside a compiled region."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or getattr(node.target, "_autopar_functional", False):
        return True
    # (random ops draw from autopar's streams; a dropout that draws nothing is compute)
    return _aten_name(node) is not None and (not is_random(node) or draws_nothing(node) is not None)


class _WithoutDynamo:
    """A run compiled by Inductor from its ATen graph directly (compile_fx, AOTAutograd
    included), once per grad mode and input signature, with no Dynamo frame: what runs
    inside a recomputed layer, whose backward runs the layer's forward again with Dynamo
    turned off (torch.utils.checkpoint), where a Dynamo-compiled module would try to trace
    again and fail.  Its graph returns a flat tuple of tensors, as compile_fx requires: an
    output that is an op's several results (topk's values and indices, which a run may hand
    on whole) is returned as its items, and the call puts the outputs back in their
    structure."""

    def __init__(self, gm: fx.GraphModule):
        graph = fx.Graph()
        value = graph.graph_copy(gm.graph, {})
        leaves, self.spec = pytree.tree_flatten(pytree.tree_map(lambda x: _items(graph, x), value))
        graph.output(tuple(leaves))
        self.gm = fx.GraphModule(gm, graph)   # (compile_fx may rewrite the graph it is given)
        self.compiled: dict = {}

    @staticmethod
    def _key(args) -> tuple:
        return (torch.is_grad_enabled(), tuple((tuple(a.shape), a.dtype, a.device, a.requires_grad)
                                               if isinstance(a, torch.Tensor) else repr(a) for a in args))

    def ready(self, args) -> bool:
        """Whether a call with `args` runs code already compiled."""
        return self._key(args) in self.compiled

    def prepare(self, args) -> None:
        """Compile for `args` (traced outside the layer's checkpointing: its saved-tensor
        hooks and dispatch modes)."""
        with torch.autograd.graph.saved_tensors_hooks(_itself, _itself), _disable_current_modes():
            self.compiled[self._key(args)] = compile_fx(self.gm, list(args))

    def __call__(self, *args):
        if not self.ready(args):
            self.prepare(args)
        return pytree.tree_unflatten(list(self.compiled[self._key(args)](*args)), self.spec)


def _items(graph: fx.Graph, x):
    """x, or where x is a node of an op with several results (topk) or a list of them
    (split), a tuple of its items."""
    schema = getattr(x.target, "_schema", None) if isinstance(x, fx.Node) and x.op == "call_function" else None
    if schema is None:
        return x
    n = len(schema.returns)
    if n == 1 and isinstance(x.meta.get("val"), (list, tuple)):
        n = len(x.meta["val"])
    elif n < 2:
        return x
    return tuple(graph.call_function(operator.getitem, (x, i)) for i in range(n))


def _itself(x):
    return x


class CompiledRegion(nn.Module):
    """One run of compute nodes: the Inductor-compiled module, or the eager one where
    compiling failed (said once).  dynamo False: compiled without Dynamo (_WithoutDynamo),
    for a run inside a recomputed layer; checkpointed: the run is a whole recomputed layer
    (as_checkpointed), selective: one that keeps its kept ops' outputs."""

    def __init__(self, eager: fx.GraphModule, label: str, dynamo: bool = True, checkpointed: bool = False,
                 selective: bool = False, passes: WeightPasses | None = None):
        super().__init__()
        if checkpointed:
            eager = as_checkpointed(eager, selective)
        self.eager = eager
        self.checkpointed = checkpointed
        self.label = label
        # (kept out of the module tree: the compiled module wraps `eager`, registered above)
        if passes is not None:   # (its weights' gradients in a later pass: runtime/regions/split_backward.py)
            flat = _WithoutDynamo(eager)
            weight = [bool(n.meta.get(WEIGHT)) for n in eager.graph.find_nodes(op="placeholder")]
            self.__dict__["compiled"] = TwoPassRun(flat.gm, flat.spec, weight, passes)
        else:
            self.__dict__["compiled"] = (torch.compile(eager, backend="inductor", fullgraph=True, dynamic=False)
                                         if dynamo else _WithoutDynamo(eager))
        self.failed = False
        self.compile_s = None
        self.moves = 0   # the plan's moves compiled inside it, as functional collectives
        self.inside = ""   # the recomputed layer it runs in ("" outside any)

    def forward(self, *args):
        if self.failed:
            return self.eager(*args)
        first = self.compile_s is None
        direct = isinstance(self.compiled, (_WithoutDynamo, TwoPassRun))   # (compiles per grad mode and signature)
        if not first and not (direct and not self.compiled.ready(args)):
            return self.compiled(*args)
        log.info("autopar: Inductor compiling region %s ...", self.label)   # say so, and time it
        start = time.perf_counter()
        try:
            out = self.compiled.prepare(args) if direct else self.compiled(*args)
        except Exception as exc:   # a region Inductor cannot compile runs eagerly
            self.failed = True
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"autopar: Inductor could not compile the region {self.label} "
                          f"({type(exc).__name__}: {reason[:300]}); it runs eagerly", stacklevel=2)
            return self.eager(*args)
        elapsed = time.perf_counter() - start
        self.compile_s = elapsed if first else self.compile_s + elapsed
        log.info("autopar: compiled region %s in %.1f s", self.label, elapsed)
        return self.compiled(*args) if direct else out


def _from_input(x: fx.Node) -> bool:
    """Whether x is a placeholder (a parameter, a user input), or moves of one: such moves
    stay eager, where the runtime's hooks see the parameters' own tensors (ZeRO-3's
    regathers, a tied weight's gradient-sum point)."""
    while x.op == "call_function" and x.target is move:
        x = x.args[0]
    return x.op == "placeholder"


def with_functional_moves(gm: fx.GraphModule, moves: bool = True) -> tuple[fx.GraphModule, int]:
    """A copy of gm whose moves of activations run as functional collectives
    (runtime/regions/functional_moves.py), so they join the compute runs, and whose dropouts that
    draw nothing (rng.draws_nothing: probability 0, or eval mode) run as the plain op
    rather than through their stream, so they do not cut a run either; gm itself is left
    as it is.  moves False: the moves stay as they are (a run compiled without Dynamo
    traces no autograd.Function of a move).  Returns (the copy, how many moves were
    rewritten)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    out = fx.GraphModule(gm, graph)
    count = 0
    for node in out.graph.nodes:
        op = draws_nothing(node)
        if op is not None and node.target is not op:   # (runs as the plain op: it draws nothing)
            plain_op(node)
        if not moves or node.op != "call_function" or node.target is not move:
            continue
        x, spec, groups_node, *rest = node.args
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or _from_input(x):
            continue
        fn = functional_move(getattr(gm, spec.target), getattr(gm, groups_node.target), val.dim(),
                             rest[0] if rest else None)
        fn._autopar_functional = True
        node.target, node.args = fn, (x,)
        count += 1
    out.recompile()
    return out, count


def _weight_gather(node: fx.Node) -> bool:
    """Whether a node makes a weight ready for its reader and reads nothing computed: a
    ZeRO-3 gather (passes/gathers.gather) or a move of a placeholder (a tied weight's
    gradient-sum point, a weight's local slice)."""
    if node.op != "call_function":
        return False
    if node.target is gather:
        return True
    return node.target is move and _from_input(node)


def _layer(node: fx.Node):
    """The repeated layer a node computes in ((list path, index); None outside any layer)."""
    return block_of(module_path(node))


def _reader_layer(node: fx.Node):
    """The layer of the first node that reads what a weight gather makes (through other
    gathers of it: an identity move, then its gather); None when nothing reads it."""
    readers = sorted(node.users, key=lambda u: u._sort_key if hasattr(u, "_sort_key") else 0)
    for u in readers:
        if _weight_gather(u):
            return _reader_layer(u)
        return ("read", _layer(u))
    return None


def with_weights_ahead(gm: fx.GraphModule, one_layer: bool = False) -> int:
    """Move each weight gather (_weight_gather) of gm, in place, to the start of the stretch
    of its reader's layer: the consecutive compute nodes of one layer since the last node
    that is neither compute nor a weight gather.  A layer then gathers its weights at its
    start (ZeRO-3's bucket of them at once, as the runtime's buckets do anyway) and its
    compute is one run, not one run per weight; the gathers keep their order (the
    runtime's prefetch counts them in it), and a gather at a layer's start stays where it
    is.  one_layer: gm is one recomputed layer's body, all of it one stretch (its start may
    hold model-level ops the layer reads, a rotary table).  Returns how many gathers moved."""
    moved = 0
    stretch, first = object(), None   # the current stretch's layer and first node
    since: set = set()                 # the nodes after `first`, as they stand now
    for node in list(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        since.add(node)
        if node.op == "get_attr":
            continue
        if _weight_gather(node):
            inputs = [x for x in node.all_input_nodes if x in since]
            if (first is not None and (one_layer or _reader_layer(node) == ("read", stretch))
                    and all(x.op == "get_attr" for x in inputs)):
                for x in inputs:   # (its spec and groups, read where it now runs)
                    first.prepend(x)
                    since.discard(x)
                first.prepend(node)
                since.discard(node)
                moved += 1
            continue
        if not is_compute(node):
            stretch, first = object(), None
            continue
        if not node.meta.get("nn_module_stack") and first is not None:
            continue   # (a node the passes made, a move of an activation: part of the stretch it is in)
        layer = None if one_layer else _layer(node)
        if first is None or layer != stretch:
            stretch, first, since = layer, node, {node}
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def _recomputed_layers_compiled(gm: fx.GraphModule) -> list:
    """Each recomputed layer of gm (a runtime/regions/recompute.Region, which gm's copy shares with
    the graph it was copied from) replaced, in gm only, by one that runs its body cut and
    compiled the same way (compile_regions), under the same checkpointing: backward runs
    the compiled forward again.  A layer whose body is one run of compute after its
    weights' gathers is one checkpointed region; under selective recomputation its kept
    ops (products, attention) run inside it tagged (with_kept_tagged), and the compiled
    forward saves their outputs while the cheap ops between them run again, fused.  Any
    other layer keeps its Region, whose runs between the eager ops compile without Dynamo;
    there the kept ops stay eager calls between the compiled runs (as under a pipeline
    schedule whose backward recomputes a layer twice and hands the kept outputs back,
    Region.replays).  Returns the layers' regions."""
    regions = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        layer = gm.get_submodule(node.target)
        if not (isinstance(layer, Region) and layer.mode in RECOMPUTING):
            continue
        selective = layer.mode in SELECTIVE_MODES
        # (fx.traceback.annotate: torch 2.9 and later)
        if not (selective and (layer.replays or not hasattr(fx_traceback, "annotate"))):
            # one run of compute (after its weights' gathers): checkpointed inside
            body, inner = compile_regions(with_kept_tagged(layer.body) if selective else layer.body, layer.path,
                                          checkpointed=True, selective=selective)
            if body is not None:
                gm.add_submodule(node.target, body)
                regions += inner
                continue
        body, inner = compile_regions(layer.body, layer.path, dynamo=False)
        gm.add_submodule(node.target, Region(layer.path, layer.mode, body, layer.streams, layer.replays))
        regions += inner
    return regions


def compile_regions(gm: fx.GraphModule, layer: str = "", dynamo: bool = True,
                    checkpointed: bool = False, selective: bool = False,
                    layer_cuts: bool = False, passes: WeightPasses | None = None,
                    params: frozenset = frozenset()) -> tuple[fx.GraphModule | None, list]:
    """gm cut into runs (module docstring), its moves rewritten as functional collectives and
    joined to the compute around them, its weights' gathers moved to their layers' starts
    (with_weights_ahead), its compute runs wrapped as CompiledRegions, the bodies of its
    recomputed layers compiled the same way; returns (the split module, the regions, those
    inside recomputed layers included).  layer_cuts (the runtime's choice on CUDA): a run
    also ends where the model's layer changes, so that backward hands each layer's
    gradients to the runtime's buckets as it finishes the layer, and their all-reduces run
    beside the earlier layers' backward, as the plan prices them (one region's compiled
    backward returns every gradient at its end; on CPU ranks, where the plan prices no such
    overlap, one region measured 0-6 % faster).  layer: gm is the body of that recomputed layer
    (its path, which prefixes the regions' labels); dynamo: whether Dynamo compiles them
    (CompiledRegion).  checkpointed: the layer is recomputed (whole, or selective: its kept
    ops tagged, with_kept_tagged), to run as one checkpointed compiled region after its
    weights' gathers; (None, []) where its body is
    more than that (a random draw, a collective on a weight, an op Inductor is not given,
    a run too small to compile).  passes: gm is a stage's graph under a split-backward
    schedule, its placeholders `params` the parameters: each region runs its weights'
    gradients as a later pass that `passes` hands the schedule (runtime/regions/split_backward.py;
    the moves of activations stay eager there)."""
    gm, moves = with_functional_moves(gm, moves=dynamo and passes is None)
    gelus = with_sigmoid_gelus(gm)
    ahead = with_weights_ahead(gm, one_layer=checkpointed)
    inner = _recomputed_layers_compiled(gm)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    cuts = not layer and (layer_cuts if LAYER_CUTS is None else LAYER_CUTS)
    run_of: dict = {}
    part, kind, stretch = 0, None, None
    for node in nodes:
        k = is_compute(node)
        # (a node the passes made, with no module of its own, continues the run it is in)
        here = _layer(node) if k and cuts and node.meta.get("nn_module_stack") else stretch
        if k != kind or (k and here != stretch):
            part, kind = part + 1, k
        stretch = here if k else None
        run_of[node] = part
    compute_parts = {run_of[n] for n in nodes if is_compute(n)}
    if checkpointed and (len(compute_parts) != 1 or inner
                         or any(not is_compute(n) and not _weight_gather(n) for n in nodes)
                         or any(_weight_gather(n) for n in nodes if run_of[n] > min(compute_parts))):
        return None, []
    heavy = {p: sum(1 for n in nodes if run_of[n] == p and is_compute(n) and n.target is not operator.getitem
                    and f"aten.{_aten_name(n)}" not in VIEWS) for p in compute_parts}
    if checkpointed and min(heavy.values()) < MIN_OPS:
        return None, []   # (left uncompiled, the run would lose the layer's checkpointing)
    first = {}
    for node in nodes:
        first.setdefault(run_of[node], node)
    if passes is not None:   # (before the cut: the regions' placeholders copy their nodes' meta)
        compiled = {p for p in compute_parts if heavy[p] >= MIN_OPS}
        mark_weights(gm, set(params), {n for n in nodes if run_of[n] not in compiled})
    split = split_module(gm, gm, lambda n: run_of.get(n, 0), keep_original_order=True)
    regions = []
    for p in sorted(compute_parts):
        name = f"submod_{p}"
        sub = getattr(split, name, None)
        if sub is None or heavy[p] < MIN_OPS:
            continue
        ops = [_aten_name(n) or "getitem" for n in sub.graph.nodes if n.op == "call_function"]
        stack = first[p].meta.get("nn_module_stack") or {}
        module = next(reversed(stack.values()))[0] if stack else ""
        label = (f"{layer + ': ' if layer else ''}{len(regions) + 1} "
                 f"({len(ops)} ops from {ops[0]}{f' in {module}' if module else ''})")
        region = CompiledRegion(sub, label, dynamo, checkpointed, selective, passes)
        region.inside = layer
        region.moves = sum(1 for n in sub.graph.nodes if getattr(n.target, "_autopar_functional", False))
        setattr(split, name, region)
        regions.append(region)
    if layer:
        return split, regions
    regions += inner
    log.info("autopar: backend inductor: %d compiled regions with %d of the plan's moves inside (the first step "
             "compiles them; Inductor's FX graph cache keeps them for later processes); %d runs of compute too "
             "small to compile run eagerly; %d weight gathers moved to their layers' starts; %d tanh GELUs computed as "
             "sigmoids (CPU)", len(regions), moves, len(compute_parts) - len(regions), ahead, gelus)
    return split, regions
