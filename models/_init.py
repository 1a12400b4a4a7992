"""Shared helper for the models' `init_module` methods."""

import torch.nn as nn


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
