"""Argument checks shared by the protocol modules: clear errors instead of ``assert``."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_key_list", "non_negative_int", "positive_int"]


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int > 0, else TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def non_negative_int(value: Any, name: str) -> int:
    """``value`` as an int >= 0, else TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def as_key_list(keys: Any, name: str) -> list:
    """One key or an iterable of keys as a list (``None`` is no keys).

    A tuple is a list of keys, as in verl; name a nested TensorDict key inside a list:
    ``[("outer", "inner")]``.
    """
    if keys is None:
        return []
    if isinstance(keys, str):
        return [keys]
    if hasattr(keys, "__iter__"):
        return list(keys)
    raise TypeError(f"{name} must be a key or a list of keys, got {type(keys).__name__}")
