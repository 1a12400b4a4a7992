"""Experts modules traced as one op, autopar::experts (autopar/trace/experts_op.py).

As written, a mixture-of-experts layer traces to a sort, a histogram and grouped matmuls
whose row counts depend on the routing: no sharding rule can say which rows a rank holds.
While tracing (`experts_as_op`), every module of a kind below runs through the op instead,
where the op reproduces it (a module it does not is traced as written, with a warning):

- Hugging Face's experts (transformers 5): stacked `gate_up_proj` and `down_proj`, called
  with the router's choices; GPT-OSS's with its biases and clamped gate (`why_not`);
- DBRX's: the same call, each weight flat (`flat_glu_weights`);
- a container of ungated MLPs dispatched by a one-hot mask (Switch Transformers',
  `mask_experts_weights`);
- grouped experts: rows sorted by expert, with each expert's row count (torchtitan's,
  `grouped_weights`).

`measure_routing` runs the model once through the op and measures how unevenly its
routers load the experts.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging

import torch

from autopar.trace.cache import TRACES
from autopar.trace.experts_op import experts, experts_math
from autopar.trace.patches import listed_counts

log = logging.getLogger("autopar")


# --- tracing Hugging Face experts modules through the op ----------------------------------------

_ACT_NAMES = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "GELU": "gelu",
              "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
              "ReLU": "relu"}


def _activation(module) -> str | None:
    act = getattr(module, "act_fn", None)
    name = _ACT_NAMES.get(type(act).__name__)
    if name == "gelu" and getattr(act, "approximate", "none") == "tanh":
        name = "gelu_tanh"
    return name


def why_not(module) -> str | None:
    """Why an experts module cannot be traced as the op (None: it can)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
        return "no stacked gate_up_proj / down_proj weights"
    oai = _is_oai(module)
    for flag, want in (("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(module, flag, want) != want:
            return f"{flag}={not want}"
    if not oai and (getattr(module, "has_bias", False) or not getattr(module, "is_concatenated", True)):
        return "biases or interleaved gate and up outside GPT-OSS's gate"
    if oai:
        if not all(isinstance(getattr(module, n, None), torch.Tensor)
                   for n in ("gate_up_proj_bias", "down_proj_bias")):
            return "GPT-OSS's gate without its two biases"
        return None
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return "a custom gate"
    if _activation(module) is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}"
    return None


def _is_oai(module) -> bool:
    """GPT-OSS's experts: interleaved gate and up columns, biases, its clamped gate."""
    gate = getattr(type(module), "_apply_gate", None)
    return (getattr(gate, "__qualname__", "") == "GptOssExperts._apply_gate" and hasattr(module, "alpha")
            and hasattr(module, "limit"))


# --- routing measured on a sample batch -------------------------------------------------------

# while measure_routing runs (in this thread or task): its list of (expert ids, expert count)
_ROUTED: contextvars.ContextVar = contextvars.ContextVar("autopar_routed", default=None)


def _record(ids, n_experts: int) -> None:
    seen = _ROUTED.get()
    if seen is not None:
        seen.append((ids.detach().reshape(-1), int(n_experts)))


def measure_routing(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None) -> dict:
    """The busiest rank's routed rows over the mean, per number of ranks the experts split
    over: {ways: factor}, the worst layer's, measured by running the model once (no
    gradients) on the sample batch with its experts modules taken as the experts op.  Rows
    are counted per contiguous block of E / ways experts, as expert parallelism places
    them; slots with no expert (padding, or dropped at capacity) count for no rank but
    for the mean, as the balanced price counts every slot."""
    tensors = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    tensors += [p for p in model.parameters()]
    if any(t.device.type == "meta" for t in tensors):
        raise ValueError("moe_imbalance='measured' runs the model on the sample batch: give real tensors (the "
                         "model and example inputs on a device, not meta), or state the load as a number")
    seen: list = []
    token = _ROUTED.set(seen)
    try:
        with experts_as_op(model), torch.no_grad():
            model(*args, **(kwargs or {}))
    finally:
        _ROUTED.reset(token)
    if not seen:
        raise ValueError("moe_imbalance='measured': the model has no experts module autopar takes as its experts "
                         "op (Hugging Face's stacked experts, or grouped w1/w2/w3 experts), so there is no "
                         "routing to measure")
    factors: dict = {}
    for ids, n_experts in seen:
        slots = ids.numel()   # what the op is priced by: every slot, balanced
        ids = ids[(ids >= 0) & (ids < n_experts)]
        if ids.numel() == 0:
            continue
        per_expert = torch.bincount(ids, minlength=n_experts).double()
        for ways in range(2, n_experts + 1):
            if n_experts % ways:
                continue
            load = per_expert.view(ways, -1).sum(1)
            factors[ways] = max(factors.get(ways, 1.0), float(load.max()) * ways / slots)
    return factors


def _forward(module, hidden_states, top_k_index, top_k_weights):
    transposed = bool(getattr(module, "is_transposed", False))
    if _is_oai(module):   # columns alternate gate, up; the biases likewise
        gate_up, bias = module.gate_up_proj, module.gate_up_proj_bias
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate_bias, up_bias = bias[..., ::2], bias[..., 1::2]
        act = f"swiglu_oai:{float(module.alpha)!r}:{float(module.limit)!r}"
        biases = (gate_bias, up_bias, module.down_proj_bias)
    else:
        gate, up = module.gate_up_proj.chunk(2, dim=2 if transposed else 1)  # planned as two parts
        act, biases = _activation(module), ()
    down = module.down_proj
    if transposed:
        gate, up, down = gate.transpose(1, 2), up.transpose(1, 2), down.transpose(1, 2)
    _record(top_k_index, gate.shape[0])
    return experts(hidden_states, top_k_index, top_k_weights, gate, up, down, act, 0, *biases)


def is_experts_module(module) -> bool:
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "has_gate")


# DBRX's experts: the same call (hidden_states, top_k_index, top_k_weights), each weight flat,
# `mlp.w1`, `mlp.v1` and `mlp.w2` [experts * inner, hidden]: gate = w1[e], up = v1[e] and
# down = w2[e].T, under `mlp.activation_fn`.

def flat_glu_weights(module) -> tuple | None:
    """(w1, v1, w2, experts, inner, hidden) of a DBRX-style experts module, else None."""
    mlp = getattr(module, "mlp", None)
    sizes = (getattr(module, "num_experts", None), getattr(module, "ffn_hidden_size", None),
             getattr(module, "hidden_size", None))
    weights = tuple(getattr(mlp, n, None) for n in ("w1", "v1", "w2"))
    if mlp is None or not all(isinstance(s, int) for s in sizes) or not all(
            isinstance(w, torch.Tensor) and tuple(w.shape) == (sizes[0] * sizes[1], sizes[2]) for w in weights):
        return None
    return (*weights, *sizes)


def _flat_glu_act(module) -> str | None:
    return _ACT_NAMES.get(type(getattr(module.mlp, "activation_fn", None)).__name__)


def _flat_glu_forward(module, hidden_states, top_k_index, top_k_weights):
    w1, v1, w2, n_experts, inner, hidden = flat_glu_weights(module)
    x = hidden_states.reshape(-1, hidden)
    _record(top_k_index, n_experts)
    out = experts(x, top_k_index, top_k_weights, w1.view(n_experts, inner, hidden), v1.view(n_experts, inner, hidden),
                  w2.view(n_experts, inner, hidden).transpose(1, 2), _flat_glu_act(module), 0)
    return out.view(hidden_states.shape[0], -1, hidden)


# --- experts as a container of MLPs, dispatched by a one-hot mask (Switch Transformers) ----------
#
# The container's children are E ungated MLPs of the same class, each two bias-free linear
# layers (in: [inner, hidden], out: [hidden, inner]) around an activation; it is called with
# the rows [tokens, hidden], a one-hot mask [tokens, slots, E] (a slot the router dropped
# for capacity is all zeros) and the routing weights [tokens, slots]:
#
#     out[t] = sum_s weight[t, s] * expert_e(x[t]),  e the expert mask[t, s] picks
#
# While tracing, it runs the experts op on the children's weights stacked, each slot's
# expert the mask's argmax (E, no expert, where the slot is all zeros).

_ACT_ATTRS = ("act", "act_fn", "activation", "activation_fn")


def mask_experts_weights(module) -> tuple | None:
    """(in weights, out weights, activation) of such a container, each weights list in
    child order, else None."""
    children = list(module.children())
    if len(children) < 2 or len({type(c) for c in children}) != 1:
        return None
    ins, outs, act = [], [], None
    for child in children:
        linears = [m for m in child.children() if isinstance(m, torch.nn.Linear)]
        acts = [_ACT_NAMES.get(type(getattr(child, n, None)).__name__) for n in _ACT_ATTRS]
        acts = [a for a in acts if a is not None]
        if len(linears) != 2 or any(m.bias is not None for m in linears) or len(acts) != 1:
            return None
        first, second = linears
        if tuple(second.weight.shape) != tuple(first.weight.shape)[::-1]:
            return None
        ins.append(first.weight)
        outs.append(second.weight)
        act = acts[0]
    if len({tuple(w.shape) for w in ins}) != 1 or not _takes(module, 3):
        return None
    return ins, outs, act


def _takes(module, count: int) -> bool:
    """Whether the module's forward takes `count` positional arguments."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) == count


def _mask_ids(mask, rows: int, n_experts: int):
    """Each (row, slot)'s expert, [rows, slots], from a one-hot mask: its argmax, or
    n_experts (no expert) where the slot is all zeros."""
    m = mask.reshape(rows, -1, n_experts)
    return torch.where(m.sum(-1) > 0, m.argmax(-1), torch.full_like(m[..., 0], n_experts, dtype=torch.long))


def _mask_call(x, ids, routing_weights, ins, outs, act: str, capacity: float = 0.0):
    weight = routing_weights.reshape(x.shape[0], -1)
    return experts(x, ids, weight, torch.stack(list(ins)), None, torch.stack(list(outs)), act, 0, capacity=capacity)


def _probe_mask(module, found) -> bool:
    """Whether the experts op reproduces the container: run once on a few rows with random
    weights of its shapes, one row dropped (an all-zero mask)."""
    ins, outs, act = found
    n_experts, (inner, hidden) = len(ins), ins[0].shape
    if n_experts * 2 * inner * hidden > 1 << 22:   # large: probe a smaller copy's arithmetic
        inner, hidden = min(inner, 16), min(hidden, 16)
    gen = torch.Generator().manual_seed(0)
    names = {id(p): n for n, p in module.named_parameters()}
    probe_in = [torch.randn(inner, hidden, generator=gen) for _ in ins]
    probe_out = [torch.randn(hidden, inner, generator=gen) for _ in outs]
    given = {names[id(w)]: p for w, p in zip([*ins, *outs], [*probe_in, *probe_out])}
    rows = torch.randn(4, hidden, generator=gen)
    mask = torch.zeros(4, 1, n_experts, dtype=torch.long)
    mask[0, 0, 0] = mask[1, 0, n_experts - 1] = mask[2, 0, 0] = 1
    weights = torch.rand(4, 1, generator=gen)
    try:
        with torch.no_grad():
            expected = torch.func.functional_call(module, given, (rows, mask, weights))
    except Exception:
        return False
    got = _mask_call(rows, _mask_ids(mask, 4, n_experts), weights, probe_in, probe_out, act)
    return expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-6)


def _router_capacity(parent, n_experts: int) -> int | None:
    """The expert capacity (rows per expert per sequence) of the container's sibling router."""
    router = getattr(parent, "router", None)
    capacity = getattr(router, "expert_capacity", None)
    if isinstance(capacity, int) and capacity > 0 and getattr(router, "num_experts", n_experts) == n_experts:
        return capacity
    return None


def _mask_forward(module, hidden_states, mask, routing_weights):
    ins, outs, act = mask_experts_weights(module)
    capacity = 0.0
    per_sequence, sequence = getattr(module, "_autopar_capacity", None), getattr(module, "_autopar_sequence", None)
    if per_sequence and sequence:   # rows one expert may take over the mean rows per expert
        slots = mask.numel() // (hidden_states.shape[0] * len(ins))
        capacity = per_sequence * len(ins) / (sequence * max(slots, 1))
    ids = _mask_ids(mask, hidden_states.shape[0], len(ins))
    _record(ids, len(ins))
    return _mask_call(hidden_states, ids, routing_weights, ins, outs, act, capacity)


# --- grouped experts: rows already sorted by expert, with each expert's row count --------------
#
# torchtitan-style code (and code like it) keeps three stacked weights w1, w3 [experts, inner,
# hidden] and w2 [experts, hidden, inner] (or each transposed) and calls the module with the
# routed rows sorted by expert and the row count of every expert: `experts(rows, counts)`.
# Inside, the counts become split sizes (`.tolist()`) or grouped-matmul offsets, so the
# rows' sizes depend on the data and nothing can be planned.  While tracing, such a module
# runs the experts op instead, each row carrying its expert's id, computed from the counts
# with fixed shapes (rows past the counted ones get no expert and a zero output, like the
# padding such code appends):
#
#     ids[r] = #{e : ends[e] <= r},  ends = cumsum(counts)


def grouped_weights(module) -> tuple | None:
    """(w1, w2, w3): the module's own three stacked expert weights, named w1, w2, w3 (or
    with a suffix, w1_EFD), w1 and w3 of one shape [E, a, b] and w2 [E, b, a]; else None."""
    found = {}
    for name, p in module.named_parameters(recurse=False):
        for key in ("w1", "w2", "w3"):
            if name == key or name.startswith(key + "_"):
                found[key] = p
    if len(found) != 3 or any(p.dim() != 3 for p in found.values()):
        return None
    w1, w2, w3 = found["w1"], found["w2"], found["w3"]
    if w1.shape != w3.shape or w2.shape != (w1.shape[0], w1.shape[2], w1.shape[1]):
        return None
    return (w1, w2, w3) if takes_rows_and_counts(module) else None


def takes_rows_and_counts(module) -> bool:
    """Whether the module's forward takes two positional arguments (the sorted rows and
    their counts or split sizes)."""
    return _takes(module, 2)


def _grouped_operands(w1, w2, w3, transposed: bool):
    """gate, up, down as the experts op takes them ([E, inner, hidden], [E, hidden, inner])."""
    if transposed:   # w1 [E, inner, hidden]: rows @ w1[e].T
        return w1, w3, w2
    return w1.transpose(1, 2), w3.transpose(1, 2), w2.transpose(1, 2)


def row_experts(counts, rows: int):
    """Each of `rows` sorted rows' expert: the number of experts whose rows end at or before it."""
    ends = torch.cumsum(counts.reshape(-1), 0)
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device, dtype=ends.dtype), right=True)


def _probe_grouped(module, weights) -> bool | None:
    """Which layout reproduces the module (True: w1 [E, inner, hidden], used transposed;
    False: [E, hidden, inner]); None where neither does (another activation, a cast to a
    lower precision, a bias).  Runs the module once on a few random rows with random
    weights of its shapes (distinct per expert where they are small; else one expert's,
    repeated, so nothing large is allocated)."""
    w1, w2, w3 = weights
    n_experts, a, b = w1.shape
    gen = torch.Generator().manual_seed(0)
    small = 3 * w1.numel() <= 1 << 22

    def weight(shape):
        if small:
            return torch.randn(shape, generator=gen)
        return torch.randn((1, *shape[1:]), generator=gen).expand(shape)

    probe = {"w1": weight(w1.shape), "w2": weight(w2.shape), "w3": weight(w3.shape)}
    names = {id(p): n for n, p in module.named_parameters(recurse=False)}
    given = {names[id(w)]: probe[key] for key, w in zip(("w1", "w2", "w3"), weights)}
    counts = torch.zeros(n_experts, dtype=torch.long)
    counts[0], counts[-1] = 2, 1
    for transposed in (True, False):
        width = b if transposed else a
        rows = torch.randn(3, width, generator=gen)
        try:
            with torch.no_grad():
                expected = torch.func.functional_call(module, given, (rows, counts))
        except Exception:
            continue
        gate, up, down = _grouped_operands(probe["w1"], probe["w2"], probe["w3"], transposed)
        ids = row_experts(counts, rows.shape[0]).unsqueeze(-1)
        got = experts_math(rows, ids, torch.ones(3, 1), gate, up, down, "silu")
        if expected.shape == got.shape and torch.allclose(expected, got, rtol=1e-5, atol=1e-6):
            return transposed
    return None


def _grouped_forward(module, rows, counts):
    if isinstance(counts, (list, tuple)):
        counts = listed_counts(counts, rows.device)
    w1, w2, w3 = grouped_weights(module)
    gate, up, down = _grouped_operands(w1, w2, w3, module._autopar_transposed)
    ids = row_experts(counts, rows.shape[0]).unsqueeze(-1)
    _record(ids, gate.shape[0])
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return experts(rows, ids, ones, gate, up, down, "silu", 0)


@contextlib.contextmanager
def experts_as_op(model: torch.nn.Module):
    """While tracing, every experts module the op covers runs through it; the others are
    traced as they are (their grouped matmuls then run replicated, with the usual warning)."""
    patched, hooks = [], []
    for name, module in model.named_modules():
        found = mask_experts_weights(module)
        if found is not None:
            if not _probe_mask(module, found):
                continue
            _sequence_known(model, name, module, found, hooks)
            if TRACES.first_time("experts' zero gradients", model):
                log.warning("autopar: experts in %s run as one op: an expert no token reaches in a step gets a zero "
                            "gradient, where the model as written leaves its gradient None (torch's optimizers then "
                            "skip it: no weight decay, no momentum step)", name)
            module.forward = _mask_forward.__get__(module)
            patched.append(module)
            continue
        weights = grouped_weights(module)
        if weights is not None:
            transposed = _probe_grouped(module, weights)
            if transposed is None:
                log.warning("autopar: grouped experts in %s traced as written: no layout of the experts op "
                            "(silu(rows @ w1) * (rows @ w3) @ w2, in the weights' own precision) reproduces "
                            "them", name)
                continue
            module._autopar_transposed = transposed
            module.forward = _grouped_forward.__get__(module)
            patched.append(module)
            continue
        if flat_glu_weights(module) is not None and _flat_glu_act(module) is not None:
            module.forward = _flat_glu_forward.__get__(module)
            patched.append(module)
            continue
        if not is_experts_module(module):
            continue
        reason = why_not(module)
        if reason is not None:
            log.warning("autopar: experts in %s traced as written (%s): they run replicated", name, reason)
            continue
        module.forward = _forward.__get__(module)
        patched.append(module)
    try:
        yield len(patched)
    finally:
        for hook in hooks:
            hook.remove()
        for module in patched:
            del module.forward
            for attr in ("_autopar_transposed", "_autopar_capacity", "_autopar_sequence"):
                if hasattr(module, attr):
                    delattr(module, attr)


def _sequence_known(model, name: str, module, found, hooks: list) -> None:
    """Where the container's sibling router caps every expert at a capacity per sequence
    (Switch's), note it on the container, and the sequence length its parent is called
    with (input [batch, sequence, hidden]) at each call."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    capacity = _router_capacity(parent, len(found[0]))
    if capacity is None:
        return
    module._autopar_capacity = capacity

    def note(_, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            module._autopar_sequence = int(x.shape[1])
    hooks.append(parent.register_forward_pre_hook(note, with_kwargs=True))
