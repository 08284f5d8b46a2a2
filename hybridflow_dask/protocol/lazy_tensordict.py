"""``tensordict``, imported when first used instead of with this package.

Importing tensordict imports ``torch._dynamo`` (about 2 s of CPU here, more than torch
itself), and every Dask worker imports this package as it starts. Code that never
touches a TensorDict (a group's control calls, the CLI, a worker that has not received a
DataProto yet) should not wait for it.

A process that hosts instances will receive DataProtos, though, and the first one it
decodes pays the import wherever the decoding happens: on a Dask worker that is often the
worker's event loop (Dask's own gather, e.g. a ``materialize_futures=False`` rank
resolving its future), stalled for seconds (up to ~9 s with two fresh workers importing
at once on a busy 2-core machine) with every comm of the worker. So a process that
starts hosting an instance calls ``import_soon`` (the import runs on a thread of its own,
next to the instance's ``__init__``, which does not wait for it: a group of control calls
is ready as soon as before), and code that is about to decode a batch on an event loop
first waits for that import off the loop (``wait_imported``, in a thread): the loop
keeps serving its comms meanwhile, and by the first batch the import is usually done.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any

__all__ = ["import_soon", "imported", "is_tensordict", "tensordict", "wait_imported"]

logger = logging.getLogger(__name__)

#: How long a construction waits for the background import (then decoding pays the rest).
IMPORT_WAIT_S = 120.0

_started = threading.Lock()  # held for good by the first import_soon
_done = threading.Event()


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


def import_soon() -> None:
    """Start importing tensordict on a background thread, once per process."""
    if not _started.acquire(blocking=False):
        return
    threading.Thread(target=_import, name="hf-import-tensordict", daemon=True).start()


def imported() -> bool:
    """Whether tensordict is imported here (and no background import is still going)."""
    return "tensordict" in sys.modules and (_done.is_set() or not _started.locked())


def wait_imported(timeout: float = IMPORT_WAIT_S) -> None:
    """Return once ``import_soon``'s import has ended (at once if none was started)."""
    if _started.locked():
        _done.wait(timeout)


def _import() -> None:
    try:
        importlib.import_module("tensordict")
    except BaseException as exc:  # its first real use raises it again, where it is seen
        logger.debug("importing tensordict in the background failed: %r", exc)
    finally:
        _done.set()
