"""``tensordict``, imported when first used instead of with this package.

Importing tensordict imports ``torch._dynamo`` (about 2 s of CPU here, more than torch
itself), and every Dask worker imports this package as it starts. Code that never
touches a TensorDict (a group's control calls, the CLI, a worker that has not received a
DataProto yet) should not wait for it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["is_tensordict", "tensordict"]


class _OnFirstUse:
    """Attribute access imports ``tensordict`` and keeps the attribute for next time."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(importlib.import_module("tensordict"), name)
        setattr(self, name, value)
        return value


tensordict: Any = _OnFirstUse()


def is_tensordict(value: Any) -> bool:
    """``value`` is a TensorDict, asked without importing tensordict: if no code imported it
    yet, nothing can be one."""
    return "tensordict" in sys.modules and isinstance(value, tensordict.TensorDictBase)
