"""Reference models for autopar: MLP, GPT-2, Llama 3 and BERT.

The models are plain single-device PyTorch modules (no parallelism code) that
return the training loss when called with targets, so one training step is
`loss = model(*example_inputs); loss.backward()`.

    >>> from autopar.models import build, list_models
    >>> model, example_inputs = build("gpt-tiny")
    >>> loss = model(*example_inputs)            # scalar
    >>> model, example_inputs = build("llama3-70b", device="meta")   # no memory used
    >>> model, example_inputs = build("gpt2-124m", n_layers=2, batch=2, seq=128)

`build` accepts as keyword overrides any field of the preset's config
dataclass plus `batch` and `seq` (the shape of the example inputs).

Initialization, one module at a time
------------------------------------
Every model class has

    model.init_module(name, module)   # name: the path in named_modules(), "" for the model

which initializes only the parameters and buffers that `module` owns directly
(`recurse=False`), drawing from the global RNG exactly as the whole-model init
does for that module. `model.init_weights()` is exactly `model.tie_weights()`
(if the model has tied weights) followed by

    for name, module in model.named_modules():
        model.init_module(name, module)

so a model built on the meta device can be initialized without ever
materializing all of it, with bit-identical values to `build(name)` after the
same seed:

    >>> model, _ = build("gpt-tiny", device="meta")
    >>> torch.manual_seed(0)                       # once, before the first module
    >>> for name, module in model.named_modules():  # this order, every module
    ...     module.to_empty(device="cpu", recurse=False)   # only its own tensors
    ...     model.init_module(name, module)
    ...     # (a real sharded loader would shard / offload `module` here)

Rules and pitfalls:

* Visit every module, in `named_modules()` order (the model itself first),
  even ones owning nothing, and seed once: skipping or reordering a module
  shifts the RNG for all later ones. (On the meta device `init_module`
  draws nothing from the CPU RNG, so a rank that keeps only some modules must
  still advance the RNG past the others to get the same values.)
* Tied weights (GPT `lm_head.weight` = `wte.weight`, Llama `output.weight` =
  `tok_embeddings.weight` when `tie_embeddings`, BERT `head.decoder.weight` =
  `embeddings.word_embeddings.weight`) are drawn once, by the module that
  `named_parameters()` lists them under (the embedding, which comes first).
  `init_module` on the sharing module draws nothing for the weight; it re-ties
  it, i.e. assigns the embedding's Parameter to it.
* `to_empty()` unties: on a meta model, `to_empty(recurse=False)` on the
  sharing module allocates a fresh, throwaway tensor of the full tied shape
  (the vocab x hidden matrix), which `init_module` then replaces by the tied
  one. To avoid that allocation, materialize only tensors still on meta and
  give a tensor that is shared with an already materialized module that
  module's tensor (a memo keyed by the meta tensor's id).
* Never call `to_empty()` on a module whose tied weight is already
  materialized on the same device type: for cpu -> cpu (or cuda -> cuda) it
  swaps the storage of the shared Parameter in place (`param.data = ...`),
  so it overwrites the weight the embedding already initialized.
* Non-persistent buffers (the Llama RoPE `rope_cos` / `rope_sin` tables,
  owned by the model itself, name "") are computed in `init_module` without
  the RNG.
* `init_module` raises `TypeError` for a module that owns tensors it has no
  rule for, so a new layer type cannot be left uninitialized silently.
"""

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from autopar.models.bert import IGNORE_INDEX, Bert, BertConfig
from autopar.models.checks import ConfigError, check_count
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig, ffn_hidden_dim
from autopar.models.mlp import MLP, MLPConfig

__all__ = [
    "build",
    "list_models",
    "PRESETS",
    "Preset",
    "MLP",
    "MLPConfig",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ffn_hidden_dim",
    "ConfigError",
    "Bert",
    "BertConfig",
]

# The example inputs are drawn from their own generator with this seed, so they
# are the same on every call and do not disturb the global RNG.
EXAMPLE_SEED = 0


# --- example inputs ----------------------------------------------------------
# Each function returns a tuple whose last element is the targets, so that
# `model(*inputs)` is the scalar loss. On the meta device the tensors are empty
# meta tensors of the right shape and dtype.


def _random_tokens(shape: tuple[int, ...], vocab: int, device: torch.device, gen: torch.Generator):
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.long, device="meta")
    return torch.randint(0, vocab, shape, generator=gen).to(device)


def _regression_inputs(config: MLPConfig, batch: int, seq: int | None, device: torch.device):
    """(x [batch, hidden] float32, target [batch, hidden] float32)"""
    shape = (batch, config.hidden)
    if device.type == "meta":
        return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
    gen = torch.Generator().manual_seed(EXAMPLE_SEED)
    x = torch.randn(shape, generator=gen)
    target = torch.randn(shape, generator=gen)
    return x.to(device), target.to(device)


def _causal_lm_inputs(config: GPTConfig | LlamaConfig, batch: int, seq: int, device: torch.device):
    """(tokens [batch, seq] int64, targets [batch, seq] int64), ids in [0, vocab)"""
    gen = torch.Generator().manual_seed(EXAMPLE_SEED)
    tokens = _random_tokens((batch, seq), config.vocab, device, gen)
    targets = _random_tokens((batch, seq), config.vocab, device, gen)
    return tokens, targets


def _masked_lm_inputs(config: BertConfig, batch: int, seq: int, device: torch.device):
    """(input_ids [batch, seq] int64, targets [batch, seq] int64)

    About 15% of the positions (and always position 0, so the loss is never an
    average over nothing) are "masked": their target is a token id, every other
    target is -100. The ids are random; no [MASK] token is substituted.
    """
    gen = torch.Generator().manual_seed(EXAMPLE_SEED)
    input_ids = _random_tokens((batch, seq), config.vocab, device, gen)
    if device.type == "meta":
        return input_ids, torch.empty((batch, seq), dtype=torch.long, device="meta")
    masked = torch.rand((batch, seq), generator=gen) < 0.15
    masked[:, 0] = True
    targets = torch.where(masked, input_ids.cpu(), IGNORE_INDEX)
    return input_ids, targets.to(device)


# --- presets -----------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A named model: its class, its config, and the default example-input shape."""

    model_cls: type[nn.Module]
    config: Any  # an instance of the model's config dataclass
    make_inputs: Callable[..., tuple[torch.Tensor, ...]]
    batch: int
    seq: int | None  # None for models whose inputs have no sequence dimension


def _gpt2(n_layers: int, hidden: int, n_heads: int) -> Preset:
    config = GPTConfig(vocab=50257, max_seq=1024, hidden=hidden, n_layers=n_layers, n_heads=n_heads)
    return Preset(GPT, config, _causal_lm_inputs, batch=8, seq=1024)


def _llama3(dim: int, n_layers: int, n_heads: int, multiple_of: int) -> Preset:
    # The models support 8192 tokens; the example inputs use 2048 to keep
    # planning and tracing fast (pass seq=8192 for the full context).
    config = LlamaConfig(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, vocab=128256,
        multiple_of=multiple_of, ffn_dim_multiplier=1.3, rope_theta=500000.0, max_seq=8192,
    )
    return Preset(Llama, config, _causal_lm_inputs, batch=1, seq=2048)


def _tiny(
    model_cls: type[nn.Module], config: Any, make_inputs: Callable[..., tuple[torch.Tensor, ...]]
) -> Preset:
    """A small model for tests and examples: batch 4, seq 16."""
    return Preset(model_cls, config, make_inputs, batch=4, seq=16)


PRESETS: dict[str, Preset] = {
    "mlp": Preset(MLP, MLPConfig(hidden=1024, n_layers=4), _regression_inputs, batch=64, seq=None),
    # GPT-2 sizes from the GPT-2 paper / Hugging Face configs.
    "gpt2-124m": _gpt2(n_layers=12, hidden=768, n_heads=12),
    "gpt2-355m": _gpt2(n_layers=24, hidden=1024, n_heads=16),
    "gpt2-774m": _gpt2(n_layers=36, hidden=1280, n_heads=20),
    "gpt2-1.5b": _gpt2(n_layers=48, hidden=1600, n_heads=25),
    "gpt-tiny": _tiny(
        GPT, GPTConfig(vocab=128, max_seq=64, hidden=64, n_layers=2, n_heads=4), _causal_lm_inputs
    ),
    # Llama 3 sizes from Meta's params.json.
    "llama3-8b": _llama3(dim=4096, n_layers=32, n_heads=32, multiple_of=1024),
    "llama3-70b": _llama3(dim=8192, n_layers=80, n_heads=64, multiple_of=4096),
    "llama-tiny": _tiny(
        Llama,
        LlamaConfig(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=128,
            multiple_of=32, ffn_dim_multiplier=None, max_seq=64, tie_embeddings=True,
        ),
        _causal_lm_inputs,
    ),
    # bert-base-uncased.
    "bert-base": Preset(Bert, BertConfig(), _masked_lm_inputs, batch=8, seq=512),
    "bert-tiny": _tiny(
        Bert, BertConfig(vocab=128, max_seq=64, hidden=64, n_layers=2, n_heads=4), _masked_lm_inputs
    ),
}


def list_models() -> list[str]:
    """The preset names accepted by `build`."""
    return list(PRESETS)


def build(
    name: str, device: str | torch.device = "cpu", **overrides: Any
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a preset model and example inputs for one training step.

    name:      a preset name, see `list_models()`
    device:    "cpu" (or any real device) for a materialized, initialized model;
               "meta" for a model and inputs that have shapes but no storage
    overrides: any field of the preset's config dataclass (e.g. n_layers=2),
               plus `batch` and `seq` for the example inputs

    returns (model, example_inputs) with `model(*example_inputs)` a scalar loss.
    On a real device the weights are drawn from the global RNG, so
    `torch.manual_seed(s)` before `build` makes them reproducible; the example
    inputs are always the same.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(PRESETS)}")
    preset = PRESETS[name]

    config_fields = [f.name for f in fields(preset.config)]
    input_fields = ["batch"] if preset.seq is None else ["batch", "seq"]
    unknown = [k for k in overrides if k not in config_fields and k not in input_fields]
    if unknown:
        raise ValueError(
            f"unknown override(s) {', '.join(map(repr, unknown))} for model {name!r}; "
            f"valid fields: {', '.join(config_fields + input_fields)}"
        )
    config = replace(preset.config, **{k: v for k, v in overrides.items() if k in config_fields})

    batch = overrides.get("batch", preset.batch)
    check_count("batch", batch, f"the example inputs' batch of {name!r}")
    seq = preset.seq
    if seq is not None:
        # If only max_seq was lowered, shorten the default example to fit.
        seq = overrides.get("seq", min(seq, config.max_seq))
        check_count("seq", seq, f"the example inputs' sequence length of {name!r}")
        if seq > config.max_seq:
            raise ValueError(f"seq={seq} exceeds max_seq={config.max_seq} of model {name!r}")

    # Construct on the meta device (no memory, no init cost), then materialize
    # and initialize on the requested device.
    device = torch.device(device)
    with torch.device("meta"):
        model = preset.model_cls(config)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()

    example_inputs = preset.make_inputs(config, batch, seq, device)
    return model, example_inputs
