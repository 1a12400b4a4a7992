"""A plain multi-layer perceptron: the smallest model worth parallelizing.

    x ──► Linear ──► GELU ──► Linear ──► GELU ──► ... ──► Linear ──► out

Every layer is a square `hidden x hidden` matrix, so the model is a clean
test bed for tensor/data parallel planning: no embeddings, no attention, no
reshapes. The loss is the mean squared error against a target of the same
shape as the output.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models import initialise
from autopar.models.checks import check_config


@dataclass
class MLPConfig:
    hidden: int = 1024  # width of every layer (input, hidden and output)
    n_layers: int = 4  # number of nn.Linear layers
    bias: bool = False  # whether the linear layers carry a bias

    def __post_init__(self):
        check_config(self, counts=("hidden", "n_layers"))


class MLP(nn.Module):
    """`n_layers` square linear layers with GELU in between (not after the last)."""

    def __init__(self, config: MLPConfig):
        super().__init__()
        if config.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {config.n_layers}")
        self.config = config
        # A ModuleList so parameter paths read `layers.0.weight`, `layers.1.weight`, ...
        self.layers = nn.ModuleList(
            nn.Linear(config.hidden, config.hidden, bias=config.bias)
            for _ in range(config.n_layers)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init: weights ~ normal(0, 0.02), biases zero."""
        initialise.init_weights(self)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """`initialise.init_module` for the MLP: only its Linear layers own tensors."""
        initialise.init_module(name, module, embeddings=())

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """
        x:      [batch, hidden]
        target: [batch, hidden] (optional)
        returns the scalar MSE loss if `target` is given, else out: [batch, hidden]
        """
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i != last:
                x = F.gelu(x)
        if target is None:
            return x
        return F.mse_loss(x, target)

