"""Tracing: an nn.Module and example inputs to the ATen training-IR graph, without real weights.

The model is exported with `torch.export.export(strict=False)`.  A model on the meta device
is traced as is; a model on CPU is traced under fake tensors, so even a model whose
weights exist is never run.  Shapes land in `node.meta["val"]`, module paths in
`node.meta["nn_module_stack"]`.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.trace.cache import TRACES, batch_family, fingerprint
from autopar.trace.experts import experts_as_op
from autopar.trace.grouped_linear import grouped_linears_as_op
from autopar.trace.functional import functionalize_writes, untie_factories
from autopar.trace.fused import Parts, as_linear, split_fused
from autopar.trace.patches import while_tracing
from autopar.trace.paths import module_path
from autopar.trace.unroll import cut_to_three, planning_module, repeated_layers
from autopar.trace.unroll import unroll as unroll_graph

log = logging.getLogger("autopar")


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module and the reason."""


@dataclass
class Traced:
    """graph: the training-IR GraphModule.  params / buffers: placeholder name -> model name."""

    graph: fx.GraphModule
    params: dict
    buffers: dict
    user_inputs: list
    tied: dict   # parameter name -> the name `named_parameters()` lists it under (tied weights)
    in_spec: object = None  # pytree structure of (args, kwargs) the graph's user inputs flatten from
    out_spec: object = None  # pytree structure the graph's outputs unflatten into
    constants: dict = field(default_factory=dict)  # name in `buffers` -> value of a tensor the forward creates
    parts: Parts = field(default_factory=Parts)  # fused weights planned as parts (autopar/trace/fused.py)
    # (module path, count, first alike) of the repeated layers written from three (autopar/trace/unroll.py),
    # and of a shortened trace (autopar/trace/shortened.py) each kept layer index -> how many
    # of the model's layers it stands for
    layers: tuple = ()
    weights: dict = field(default_factory=dict)

    def copy(self) -> "Traced":
        return Traced(copy.deepcopy(self.graph), dict(self.params), dict(self.buffers), list(self.user_inputs),
                      dict(self.tied), self.in_spec, self.out_spec, dict(self.constants), self.parts, self.layers,
                      dict(self.weights))


def _module_of_error(exc: BaseException, model: torch.nn.Module) -> str:
    """Best guess of the module that raised: the innermost frame whose `self` is a submodule."""
    names = {id(m): n for n, m in model.named_modules()}
    tb = exc.__traceback__
    found = None
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if obj is not None and id(obj) in names:
            found = names[id(obj)] or type(model).__name__
        tb = tb.tb_next
    return found or type(model).__name__


@contextlib.contextmanager
def in_mode(model: torch.nn.Module, mode: str):
    """Run the body with `model` in `mode`, then give every submodule its own flag back.

    "train": the model's training graph: as it is when `model.training` (submodules the
    user keeps in eval, such as a frozen backbone's batch norms, stay so), else as after
    `model.train()`.  "eval": as after `model.eval()`."""
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', not {mode!r}")
    flags = [(m, m.training) for m in model.modules()]
    try:
        if mode == "eval":
            model.eval()
        elif not model.training:
            model.train()
        yield model
    finally:
        for m, flag in flags:
            m.training = flag


def trace(model: torch.nn.Module | fx.GraphModule, example_inputs: tuple, example_kwargs: dict | None = None,
          cache: bool = True, mode: str = "train", unroll: bool = False, shared: bool = False) -> Traced:
    """The training-IR graph of `model(*example_inputs, **example_kwargs)` in `mode` (see
    in_mode: plans are made on the training graph; the runtime derives eval from both).

    Traces are cached in the process (autopar/trace/cache.py: TRACES) by a fingerprint of the
    model's structure, its modules' train/eval flags and the inputs' shapes (cache.fingerprint),
    so planning and compiling the same model, or compiling it with several plans, traces once;
    each caller gets its own copy of the graph unless `shared`.  cache=False always traces.

    unroll: when the model's layers are one list of alike modules, export three of them and
    write the graph of the others from theirs (autopar/trace/unroll.py): the same graph, node for
    node, in a fraction of the time.  For planning; the runtime traces every layer (and
    refuses a plan whose graph differs from it).

    shared: return the cached trace itself, not a copy, for callers that only read the
    graph (planning: a copy of a 9,000-node graph costs 0.3-1 s, once per pipeline
    candidate); a caller that rewrites the graph (the runtime's passes) takes a copy.  What a
    holder of a shared trace may and may not do: cache.TraceCache."""
    with in_mode(model, mode):
        return _trace_cached(model, example_inputs, example_kwargs, cache, unroll, shared)


def _trace_cached(model, example_inputs, example_kwargs, cache: bool, unroll: bool = False,
                  shared: bool = False) -> Traced:
    if not cache:
        return _trace(model, example_inputs, example_kwargs, unroll)
    key = fingerprint(model, example_inputs, example_kwargs or {})
    traced = TRACES.find(key, unroll)
    if traced is not None:
        return traced if shared else traced.copy()
    family = batch_family(model, example_inputs, example_kwargs or {}) if unroll else None
    traced = TRACES.written(family) if family is not None else None
    exported = traced is None
    if exported:
        traced = _trace(model, example_inputs, example_kwargs, unroll)
    TRACES.store(key, traced, unroll, family if exported else None)
    return traced if shared else traced.copy()


def _trace(model: torch.nn.Module | fx.GraphModule, example_inputs: tuple, example_kwargs: dict | None = None,
           unroll: bool = False) -> Traced:
    """Export `model(*example_inputs, **example_kwargs)` to ATen training IR on fake tensors.

    A user-made `fx.GraphModule` (e.g. from `torch.fx.symbolic_trace`) is an nn.Module and
    is exported the same way, which lowers its ops to ATen and records its shapes.
    unroll: export three of its repeated layers and write the rest (autopar/trace/unroll.py)."""
    example_kwargs = example_kwargs or {}
    start = time.perf_counter()
    found = repeated_layers(model) if unroll else None
    written = None
    if found is not None:
        try:
            ep = _export(model, tuple(example_inputs), example_kwargs, found)
            params, buffers, lifted = _placeholders(ep)
            written = unroll_graph(ep.graph_module.graph, params, buffers, found)
        except TraceError:
            pass
        if written is None:
            log.info("the %d layers of %s do not trace alike: tracing every layer", found.count, found.path)
    if written is None:
        ep = _export(model, tuple(example_inputs), example_kwargs, None)
        params, buffers, lifted = _placeholders(ep)
        gm = fx.GraphModule(ep.graph_module, ep.graph_module.graph)
    else:
        params, buffers = written.params, written.buffers
        gm = planning_module(ep.graph_module, written.graph)
    sig = ep.graph_signature
    log.info("traced %s in %.2fs: %d nodes%s", type(model).__name__, time.perf_counter() - start,
             len(gm.graph.nodes), f" ({found.first + 3} of its {found.count} layers exported)" if written is not None else "")
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied[name] = first.setdefault(id(p), name)
    known = {ph: ep.constants[name] for ph, name in lifted.items()
             if isinstance(ep.constants.get(name), torch.Tensor) and not ep.constants[name].is_meta}
    refuse_data_dependent_shapes(gm, type(model).__name__)
    functionalize_writes(gm)
    untie_factories(gm)
    as_linear(gm, params)
    parts = split_fused(gm, params, tied, known)
    share_reads(gm)
    constants = {name: value.detach().clone() for name, value in ep.constants.items()
                 if name in set(lifted.values()) and isinstance(value, torch.Tensor) and not value.is_meta}
    return Traced(gm, params, buffers, list(sig.user_inputs), tied, ep.call_spec.in_spec, ep.call_spec.out_spec,
                  constants, parts, (found.path, found.count, found.first) if written is not None else ())


def refuse_data_dependent_shapes(gm: fx.GraphModule, model_name: str) -> None:
    """A TraceError naming the first op whose output's size is known only when the step runs
    (a `.tolist()` of token counts, `nonzero`, a boolean mask): planning prices and splits
    every tensor by its shape, so such a graph cannot be planned, and it used to fail later
    with an unrelated TypeError."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        vals = node.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else (vals,)
        for val in vals:
            if isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
                module = module_path(node) or "the model's top level"
                shape = ", ".join(str(d) for d in val.shape)
                raise TraceError(
                    f"{model_name}: {node.target} in {module} makes a tensor of shape ({shape}) whose size "
                    f"depends on the data (known only when the step runs: a .tolist() of token counts, "
                    f"nonzero, a boolean mask or a bincount without minlength). autopar plans every tensor by its "
                    f"shape, so it cannot plan this. Fix: route without data-dependent sizes. autopar "
                    f"takes whole, as its experts op, a dropless experts module with stacked weights "
                    f"(gate_up_proj [experts, 2 * inner, hidden] and down_proj [experts, hidden, inner], "
                    f"as Hugging Face's MoE families write them; or w1, w3 [experts, inner, hidden] and "
                    f"w2 [experts, hidden, inner] called with rows sorted by expert and their counts, as "
                    f"torchtitan does), and as its grouped linear op a module with one stacked weight "
                    f"[experts, out, in] called with sorted rows and their sizes (JetMoE's): keep the "
                    f"data-dependent split inside such a module; or pad each expert's tokens to a fixed "
                    f"capacity")


def _placeholders(ep) -> tuple:
    """(parameters, buffers and lifted constants, lifted constants): placeholder -> name."""
    sig = ep.graph_signature
    lifted = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    return dict(sig.inputs_to_parameters), {**sig.inputs_to_buffers, **lifted}, lifted


def _export(model, example_inputs: tuple, example_kwargs: dict, found):
    """torch.export.export(strict=False) of the model as it runs eagerly (the process-wide
    replacements of autopar/trace/patches.py, experts_as_op, grouped_linears_as_op), its layer
    list cut to three when `found`."""
    def export(windows: bool):
        with contextlib.ExitStack() as stack:
            seen = stack.enter_context(while_tracing(model, windows=windows))
            stack.enter_context(experts_as_op(model))
            stack.enter_context(grouped_linears_as_op(model))
            if found is not None:
                stack.enter_context(cut_to_three(found))
            return torch.export.export(model, example_inputs, example_kwargs, strict=False), seen

    try:
        ep, windows = export(True)
        if windows["skipped"] and not windows["calls"]:  # its attention did not take the window: keep the masks
            ep, _ = export(False)
    except Exception as exc:  # name the module that failed and why
        where = _module_of_error(exc, model)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"could not trace module {where!r} ({type(model).__name__}): {type(exc).__name__}: "
                         f"{reason}. Make its forward traceable by torch.export(strict=False): no "
                         f"data-dependent Python control flow or .item(); Hugging Face models need "
                         f"use_cache=False.") from exc
    return ep


SHARED_SUFFIX = "_shared"


def share_reads(gm: fx.GraphModule) -> None:
    """Give every op result that several nodes read one `aten.alias` node its readers read
    instead ("<producer>_shared").  The alias is where the plan moves the tensor once for
    all its readers: a Partial attention output read by a norm's pow, mul and cast is
    all-reduced once, not three times (the planner prices the alias's layout change once,
    and the collectives pass inserts one move before it).  Parameters and user inputs are
    left alone (a tied weight is one parameter read in two places, each in its own layout)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        readers = list(node.users)
        if len(readers) < 2 or any(_mutates(r) for r in readers):
            continue  # (a reader that writes into the tensor must write into the one the others read)
        with graph.inserting_after(node):
            shared = graph.create_node("call_function", torch.ops.aten.alias.default, (node,), {},
                                       name=f"{node.name}{SHARED_SUFFIX}")
        shared.meta = {k: v for k, v in node.meta.items() if k in ("val", "nn_module_stack", "stack_trace")}
        stack = _common_stack(readers)
        if stack is not None:  # the readers' module: a layer's input shared inside the layer belongs to it
            shared.meta["nn_module_stack"] = stack
        for reader in readers:
            reader.replace_input_with(node, shared)
    graph.lint()
    gm.recompile()


def _mutates(node: fx.Node) -> bool:
    """Whether the node writes into one of its operands (an in-place op such as div_)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _common_stack(readers: list):
    """The module stack every reader is inside (the longest common prefix), or None when
    some reader has none (the graph's output)."""
    stacks = [r.meta.get("nn_module_stack") for r in readers]
    if any(not st for st in stacks):
        return None
    common = []
    for entries in zip(*(list(st.items()) for st in stacks)):
        if any(e[0] != entries[0][0] for e in entries):
            break
        common.append(entries[0])
    return dict(common)


def graph_signature(gm: fx.GraphModule) -> str:
    """A short digest of a traced graph's nodes, ops and tensor shapes: a plan records it,
    and compile refuses a plan whose model traces to another graph (another size, say)."""
    parts = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        parts.append((node.op, node.name, str(node.target), shape, str(getattr(val, "dtype", ""))))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
