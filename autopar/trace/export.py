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
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.trace.attention import window_attention, window_mask
from autopar.trace.cache import TRACES, batch_family, fingerprint
from autopar.trace.experts import experts_as_op
from autopar.trace.grouped_linear import grouped_linears_as_op
from autopar.trace.functional import functionalize_writes
from autopar.trace.fused import Parts, as_linear, split_fused
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

    def copy(self) -> "Traced":
        return Traced(copy.deepcopy(self.graph), dict(self.params), dict(self.buffers), list(self.user_inputs),
                      dict(self.tied), self.in_spec, self.out_spec, dict(self.constants), self.parts)


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


@contextlib.contextmanager
def _checkpoints_inline():
    """Trace `torch.utils.checkpoint(..., use_reentrant=True)` regions as plain code.

    The reentrant form runs its function under no_grad inside an autograd.Function, so
    export records the region as gradient-free and the compiled model could not train.
    Its non-reentrant form is traced inline already; this makes both the same (recomputing
    activations is the planner's choice, not the trace's)."""
    fn = torch.utils.checkpoint.CheckpointFunction
    own = fn.__dict__.get("apply")
    fn.apply = staticmethod(lambda function, preserve_rng_state, *args: function(*args))
    try:
        yield
    finally:
        if own is None:
            del fn.apply
        else:
            fn.apply = own


@contextlib.contextmanager
def _idle_moves_skipped():
    """A module moved or cast inside its own forward to where it already is
    (`self.classifier = self.classifier.to(self.dtype)`, Switch Transformers' router) is
    left alone while tracing: under export its parameters are tracing tensors, which torch
    cannot swap in place even for a conversion that changes nothing."""
    own = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        idle = memory_format is None and all(
            (device is None or t.device == device or (device.index is None and t.device.type == device.type))
            and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
            for t in tensors)
        return module if idle else own(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = own


@contextlib.contextmanager
def _causal_masks_as_flags(model, windows: bool = True):
    """Hugging Face models build a dense causal mask when they see torch.export, where eager
    runs pass `is_causal=True` to attention instead (no padding mask, one sequence per row,
    query and key lengths equal).  When a Hugging Face model inside `model` is called with
    neither an attention mask nor position ids (so positions are its own 0..s-1), trace it
    as it runs eagerly: attention then knows its mask is causal, which ring attention needs
    (a dense mask could say anything).  Whether it was is read from the call itself (a
    forward pre-hook on each Hugging Face model), so it holds however many inputs the outer
    module takes (a loss wrapper's `(x, y)` included).  A padding mask or packed sequences
    still build the dense mask.

    windows: sliding-window layers skip their dense mask too, and their attention call
    (which gets `sliding_window=w`) runs as autopar::window_attention (autopar/trace/attention.py).
    Yields the counts (windowed masks skipped, windowed attention calls): a model that
    skipped masks but made no such call must be traced again with windows=False."""
    masking = sys.modules.get("transformers.masking_utils")
    library = sys.modules.get("transformers")
    names = ("is_torchdynamo_exporting", "find_packed_sequence_indices", "_ignore_causal_mask_sdpa")
    counts = {"skipped": 0, "calls": 0}
    pretrained = getattr(library, "PreTrainedModel", None) if library is not None else None
    hf_models = [m for m in model.modules() if pretrained is not None and isinstance(m, pretrained)]
    if masking is None or not all(hasattr(masking, n) for n in names) or not hf_models:
        yield counts
        return
    own = {n: getattr(masking, n) for n in names}
    registry = _attention_registry() if windows else None
    own_sdpa = registry.get("sdpa") if registry is not None else None
    plain = [True]   # the Hugging Face model running now got no mask, positions or cache

    def called(module, args, kwargs):
        given = {k for k, v in kwargs.items() if v is not None}
        plain[0] = len(args) <= 1 and not given & {"attention_mask", "position_ids", "cache_position",
                                                    "past_key_values"}

    def exporting():
        return False if plain[0] else own["is_torchdynamo_exporting"]()

    def packed(position_ids):
        return None if plain[0] else own["find_packed_sequence_indices"](position_ids)

    def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
        if local_attention_size is None or own_sdpa is None or not plain[0]:
            return own["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset, kv_offset,
                                                   local_attention_size)
        skip = own["_ignore_causal_mask_sdpa"](padding_mask, q_length, kv_length, q_offset, kv_offset, None)
        counts["skipped"] += bool(skip)
        return skip

    def sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        window = kwargs.get("sliding_window")
        if plain[0] and window is not None and attention_mask is None and query.shape[2] > 1:
            counts["calls"] += 1
            if not dropout:
                scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
                out = window_attention(query, key, value, int(window), scale, key.shape[1] != query.shape[1])
                return out.transpose(1, 2).contiguous(), None
            pos = torch.arange(query.shape[2], device=query.device)
            attention_mask = window_mask(pos, pos, int(window))[None, None]
        return own_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    hooks = [m.register_forward_pre_hook(called, with_kwargs=True) for m in hf_models]
    masking.is_torchdynamo_exporting = exporting
    masking.find_packed_sequence_indices = packed
    masking._ignore_causal_mask_sdpa = ignore
    if own_sdpa is not None:
        registry["sdpa"] = sdpa
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()
        for n, f in own.items():
            setattr(masking, n, f)
        if own_sdpa is not None:
            registry["sdpa"] = own_sdpa


def _attention_registry():
    """transformers' library-wide attention functions by implementation name, or None."""
    utils = sys.modules.get("transformers.modeling_utils")
    interface = getattr(utils, "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    return mapping if isinstance(mapping, dict) else None


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
             len(gm.graph.nodes), f" (3 of its {found.count} layers exported)" if written is not None else "")
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied[name] = first.setdefault(id(p), name)
    known = {ph: ep.constants[name] for ph, name in lifted.items()
             if isinstance(ep.constants.get(name), torch.Tensor) and not ep.constants[name].is_meta}
    refuse_data_dependent_shapes(gm, type(model).__name__)
    functionalize_writes(gm)
    as_linear(gm, params)
    parts = split_fused(gm, params, tied, known)
    share_reads(gm)
    constants = {name: value.detach().clone() for name, value in ep.constants.items()
                 if name in set(lifted.values()) and isinstance(value, torch.Tensor) and not value.is_meta}
    return Traced(gm, params, buffers, list(sig.user_inputs), tied, ep.call_spec.in_spec, ep.call_spec.out_spec,
                  constants, parts)


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
    """torch.export.export(strict=False) of the model as it runs eagerly (_checkpoints_inline,
    experts_as_op, _causal_masks_as_flags), its layer list cut to three when `found`."""
    def export(windows: bool):
        with contextlib.ExitStack() as stack:
            stack.enter_context(_checkpoints_inline())
            stack.enter_context(_idle_moves_skipped())
            stack.enter_context(experts_as_op(model))
            stack.enter_context(grouped_linears_as_op(model))
            if found is not None:
                stack.enter_context(cut_to_three(found))
            seen = stack.enter_context(_causal_masks_as_flags(model, windows=windows))
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
