"""Memory of model states per device under ZeRO (Rajbhandari et al., 2020).

Per parameter, with mixed-precision Adam: 2 bytes of weights, 2 of gradients and 12 of
optimizer states (float32 master weights, momentum and variance).  On N data-parallel
devices:

    stage 0 (plain data parallel)   2 + 2 + 12          = 16 bytes
    stage 1 (optimizer states)      2 + 2 + 12 / N
    stage 2 (+ gradients)           2 + (2 + 12) / N
    stage 3 (+ weights)             (2 + 2 + 12) / N
"""
from __future__ import annotations

from .mesh import parse_bytes


def state_bytes_per_param(n_devices: int, zero_stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                          optimizer_bytes: float = 12) -> float:
    """Bytes one parameter costs each device at a ZeRO stage."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage!r} is not one of 0, 1, 2, 3")
    if n_devices < 1:
        raise ValueError(f"n_devices must be at least 1, got {n_devices}")
    n = n_devices
    p = param_bytes / n if zero_stage >= 3 else param_bytes
    g = grad_bytes / n if zero_stage >= 2 else grad_bytes
    o = optimizer_bytes / n if zero_stage >= 1 else optimizer_bytes
    return p + g + o


def max_trainable_params(device_memory_bytes, n_devices: int, zero_stage: int, param_bytes: float = 2,
                         grad_bytes: float = 2, optimizer_bytes: float = 12) -> float:
    """The most parameters whose model states fit in `device_memory_bytes` per device
    ('80GB' works), activations and buffers not counted."""
    memory = parse_bytes(device_memory_bytes, "device_memory_bytes")
    return memory / state_bytes_per_param(n_devices, zero_stage, param_bytes, grad_bytes, optimizer_bytes)
