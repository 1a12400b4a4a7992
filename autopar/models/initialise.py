"""Shared GPT-2 style initialization for the models' `init_weights` / `init_module`.

Every model initializes one module at a time (see the package docstring):
`init_weights(model)` re-ties the model's shared weights, then calls
`model.init_module(name, module)` for every module in `named_modules()` order,
and the models' `init_module` methods delegate to `init_module` below with
their own rules (which Linear layers write into the residual stream, which
module shares a tied weight, which norm types they use).
"""

import math

import torch
import torch.nn as nn

STD = 0.02  # std of the normal init of Linear and Embedding weights


def residual_std(n_layers: int) -> float:
    """Std of the projections that write into the residual stream: 0.02 / sqrt(2 * n_layers),
    so the residual stream does not grow with depth."""
    return STD / math.sqrt(2 * n_layers)


def init_linear(module: nn.Linear, std: float = STD) -> None:
    """weight ~ normal(0, std), bias (if any) zero."""
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def init_embedding(module: nn.Embedding, std: float = STD) -> None:
    """weight ~ normal(0, std)."""
    nn.init.normal_(module.weight, mean=0.0, std=std)


def init_norm(module: nn.Module) -> None:
    """LayerNorm / RMSNorm: weight one, bias (if any) zero; no RNG."""
    module.reset_parameters()


def init_tied(model: nn.Module, module: nn.Linear) -> None:
    """The Linear whose weight is tied to an embedding: draw nothing for the weight,
    re-tie it (`model.tie_weights()`, dropping whatever tensor it held), zero the bias."""
    model.tie_weights()  # the weight is the embedding's, initialized by its own init_module
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def check_owns_nothing(name: str, module: nn.Module) -> None:
    """Raise if `module` directly owns a parameter or buffer.

    `init_module` calls this for the module types it has no rule for (the model
    itself, containers, activations, dropout), so a new layer type cannot be
    left silently uninitialized.
    """
    own = [k for k, _ in module.named_parameters(recurse=False)]
    own += [k for k, _ in module.named_buffers(recurse=False)]
    if own:
        raise TypeError(
            f"init_module has no rule for {type(module).__name__} {name!r}, "
            f"which owns {', '.join(own)}"
        )


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """`model.tie_weights()` (if the model has one), then `model.init_module(name, module)`
    for every module in `named_modules()` order."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for name, module in model.named_modules():
        model.init_module(name, module)


@torch.no_grad()
def init_module(
    name: str,
    module: nn.Module,
    *,
    model: nn.Module | None = None,
    tied: nn.Module | None = None,
    residual: tuple[str, ...] = (),
    n_layers: int = 1,
    embeddings: tuple[type[nn.Module], ...] = (nn.Embedding,),
    norms: tuple[type[nn.Module], ...] = (),
) -> None:
    """Initialize the parameters and buffers `module` owns directly, GPT-2 style.

    name:       the path of `module` in `model.named_modules()` ("" for the model)
    module:     the submodule at that path
    model:      the model (needed only with `tied`, for `model.tie_weights()`)
    tied:       the Linear whose weight is tied to an embedding, or None; it draws
                nothing for the weight (see `init_tied`)
    residual:   name suffixes of the Linears that write into the residual stream;
                they get std `residual_std(n_layers)`, other Linears 0.02
    embeddings: the embedding types (weight ~ normal(0, 0.02))
    norms:      the norm types (`reset_parameters()`: weight one, bias zero)

    Any other module must own no tensors, else `TypeError` (`check_owns_nothing`).
    Draws from the global RNG only for Linear and embedding weights, so calling
    it for every module in `named_modules()` order after the same
    `torch.manual_seed` gives bit-identical weights.
    """
    if tied is not None and module is tied:
        init_tied(model, module)
    elif isinstance(module, nn.Linear):
        init_linear(module, residual_std(n_layers) if name.endswith(residual) else STD)
    elif isinstance(module, embeddings):
        init_embedding(module)
    elif isinstance(module, norms):
        init_norm(module)
    else:
        check_owns_nothing(name, module)
