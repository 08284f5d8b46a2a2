"""``tensordict``, imported when first used instead of with this package.

Importing tensordict imports ``torch._dynamo`` (about 2 s of CPU here, more than torch
itself), and every Dask worker imports this package as it starts. Code that never
touches a TensorDict (a group's control calls, the CLI, a worker that has not received a
DataProto yet) should not wait for it.

A process that hosts instances will receive DataProtos, though, and the first one it
decodes pays the import wherever the decoding happens: on a Dask worker that is often the
worker's event loop (Dask's own gather, e.g. a ``materialize_futures=False`` rank
resolving its future), stalled for seconds (up to ~9 s with two fresh workers importing
at once on a busy 2-core machine) with every comm of the worker. So code about to decode
a batch on an event loop imports first, off the loop (``import_now`` in a thread, or in
the instance's own thread): the loop keeps serving its comms meanwhile. Importing in the
background as soon as a process hosts an instance was tried and left: on two cores the
import competes with the group's first calls (a no-op call took 3.5 ms instead of 0.7
during the first second) and with its start-up.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

__all__ = ["import_now", "imported", "is_tensordict", "tensordict"]

logger = logging.getLogger(__name__)


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


def imported() -> bool:
    """Whether tensordict is imported here (decoding a batch costs no import)."""
    module = sys.modules.get("tensordict")
    return module is not None and getattr(module, "TensorDictBase", None) is not None


def import_now() -> None:
    """Import tensordict in this thread (once per process; at once when it is imported)."""
    if imported():
        return
    try:  # (Python's import lock makes a second thread wait for the first one's import)
        importlib.import_module("tensordict")
    except BaseException as exc:  # its first real use raises it again, where it is seen
        logger.debug("importing tensordict ahead of a batch failed: %r", exc)
