"""Checks of the model configs' values, run when a config is made (`__post_init__`, so
`dataclasses.replace` and `build(name, **overrides)` run them too): a bad value fails at
once with the field, the value and what it may be, instead of as a negative dimension or
a division by zero deep inside a layer's constructor or the planner."""
from __future__ import annotations

import math
import numbers


class ConfigError(ValueError):
    """A config field (or an example input size) holds a value the model cannot be built with.
    field, value: what was given; rule: what the field may be, a sentence."""

    def __init__(self, field: str, value, rule: str):
        self.field, self.value = field, value
        super().__init__(f"{field}={value!r}: {rule}")


def _is_int(v) -> bool:  # (a bool is an int to Python, never a size)
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_count(field: str, value, owner: str) -> None:
    """value is a whole number >= 1 (a size, a number of layers or heads)."""
    if not _is_int(value) or value < 1:
        raise ConfigError(field, value, f"{owner} must be a whole number of at least 1")


def check_config(config, counts=(), probabilities=(), nonnegative=(), positive=()) -> None:
    """counts: fields that are whole numbers >= 1 (sizes, layers, heads); probabilities:
    numbers in [0, 1]; nonnegative: finite numbers >= 0 (epsilons); positive: finite
    numbers > 0, or None where the field allows it."""
    cls = type(config).__name__
    for name in counts:
        check_count(name, getattr(config, name), f"{cls}.{name}")
    for name in probabilities:
        v = getattr(config, name)
        if not _is_real(v) or not 0 <= v <= 1:
            raise ConfigError(name, v, f"{cls}.{name} must be a probability in [0, 1]")
    for name in nonnegative:
        v = getattr(config, name)
        if not _is_real(v) or v < 0:
            raise ConfigError(name, v, f"{cls}.{name} must be a finite number of at least 0")
    for name in positive:
        v = getattr(config, name)
        if v is not None and (not _is_real(v) or v <= 0):
            raise ConfigError(name, v, f"{cls}.{name} must be a finite number above 0")


def check_divides(config, whole: str, part: str) -> None:
    """getattr(config, part) divides getattr(config, whole) (heads into the width): the message
    lists the values of `part` that would."""
    w, p = getattr(config, whole), getattr(config, part)
    if w % p:
        divisors = [d for d in range(1, w + 1) if w % d == 0]
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        raise ConfigError(part, p, f"{type(config).__name__}.{part} must divide {whole}={w} (one of {shown}), "
                                   f"or change {whole}")
