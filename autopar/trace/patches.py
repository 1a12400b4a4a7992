"""Every process-wide change autopar makes while it traces a model, in one place.

torch.export traces a model as its code runs under export, which is not always how it runs
eagerly; a few library functions are therefore replaced for the length of one export and
restored after it.  `while_tracing` is the one entry: it holds a process-wide lock (two
threads never trace under each other's replacements) and enters, in this order:

- `torch.utils.checkpoint.CheckpointFunction.apply` (_checkpoints_inline): a reentrant
  checkpoint is traced as plain code, not as a gradient-free region;
- `torch.nn.Module.to` (_idle_moves_skipped): a move or cast of a module to where it already
  is, inside its own forward, is left alone;
- `torch.Tensor.tolist` and the tracing subclasses' own (_tolist_remembered): a list of
  counts remembers the tensor it came from (`listed_counts` reads it back);
- `torch.bincount` and `Tensor.bincount` with `minlength` (_bincount_sized): a histogram of
  fixed size;
- `transformers.masking_utils` (`is_torchdynamo_exporting`, `find_packed_sequence_indices`,
  `_ignore_causal_mask_sdpa`) and transformers' "sdpa" attention function
  (_causal_masks_as_flags): a Hugging Face model called without a mask traces its causal
  mask as a flag, as it runs eagerly.

Changes to the user's own modules for one trace (experts as one op, grouped linears, the
layer list cut to three) are not here: they touch one model, not the process, and live
with the rewrite they serve."""
from __future__ import annotations

import contextlib
import sys
import threading

import torch

from autopar.trace.attention import window_attention, window_mask

_LOCK = threading.RLock()


@contextlib.contextmanager
def while_tracing(model: torch.nn.Module, windows: bool = True):
    """Every process-wide replacement above, for one export of `model`, under the lock.
    Yields causal_masks_as_flags' counts (windowed masks skipped, windowed attention calls)."""
    with _LOCK, contextlib.ExitStack() as stack:
        stack.enter_context(_checkpoints_inline())
        stack.enter_context(_idle_moves_skipped())
        stack.enter_context(_tolist_remembered())
        stack.enter_context(_bincount_sized())
        yield stack.enter_context(_causal_masks_as_flags(model, windows=windows))


# `.tolist()` of a 1-D integer tensor while tracing: the list's values are known only when
# the step runs; a grouped module given that list reads the tensor instead.
_LISTED: dict = {}


def listed_counts(counts, device):
    """The tensor a list of counts came from (its `.tolist()` while tracing), or the list
    as a tensor where its values are plain numbers."""
    hit = _LISTED.get(id(counts))
    if hit is not None and hit[0] is counts:
        return hit[1]
    if all(isinstance(c, int) for c in counts):
        return torch.tensor(list(counts), device=device)
    raise TypeError("grouped experts called with counts that are neither a tensor nor its .tolist()")


def _tensor_classes() -> list:
    """torch.Tensor and the tracing subclasses with their own tolist."""
    classes = [torch.Tensor]
    with contextlib.suppress(ImportError):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor
        classes += [c for c in (FunctionalTensor, FakeTensor) if "tolist" in c.__dict__]
    return classes


@contextlib.contextmanager
def _tolist_remembered():
    originals = {cls: cls.__dict__.get("tolist") for cls in _tensor_classes()}

    def remembering(original):
        def tolist(self):
            out = original(self)
            if isinstance(out, list) and self.dim() == 1 and not self.is_floating_point():
                _LISTED[id(out)] = (out, self)
            return out
        return tolist

    for cls, original in originals.items():   # (torch.Tensor inherits its tolist from the C base)
        cls.tolist = remembering(original or cls.tolist)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.tolist
            else:
                cls.tolist = original
        _LISTED.clear()


@contextlib.contextmanager
def _bincount_sized():
    """While tracing, `bincount(ids, minlength=E)` of integer ids (the tokens each expert
    gets) has E bins, as it has whenever every id is below E (ids picked among E experts):
    counted with scatter_add, whose size is fixed.  An id of E or more then fails the step
    with an index error instead of growing the histogram; without minlength the size
    depends on the data and the trace says so."""
    own_fn, own_method = torch.bincount, torch.Tensor.bincount

    def bincount(ids, weights=None, minlength=0):
        if minlength <= 0 or ids.dim() != 1 or ids.is_floating_point():
            return own_fn(ids, weights, minlength)
        values = torch.ones_like(ids) if weights is None else weights
        dtype = torch.long if weights is None else (weights.dtype if weights.is_floating_point() else torch.double)
        return torch.zeros(minlength, dtype=dtype, device=ids.device).scatter_add(0, ids.long(), values.to(dtype))

    torch.bincount = bincount
    torch.Tensor.bincount = lambda self, weights=None, minlength=0: bincount(self, weights, minlength)
    try:
        yield
    finally:
        torch.bincount, torch.Tensor.bincount = own_fn, own_method


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
