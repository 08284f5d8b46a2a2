"""A method's exception as its caller gets it: named, explained, and able to travel."""

from __future__ import annotations

import contextlib
import pickle

from ..base import InstanceRef
from .tracebacks import remote_traceback

__all__ = ["annotate_error", "explain_init_error", "explain_load_error", "sendable"]

_INIT_TWICE = "default process group twice"


def annotate_error(exc: BaseException, ref: InstanceRef, method: str) -> BaseException:
    """Name where ``exc`` came from and keep the traceback text across pickling."""
    where = f"raised by {ref.group}.{method} on rank {ref.rank} (worker {ref.slot.address})"
    if not hasattr(exc, "remote_traceback"):
        with contextlib.suppress(Exception):
            exc.remote_traceback = remote_traceback(exc)  # type: ignore[attr-defined]
    exc.hybridflow_origin = (ref.group, method, ref.rank)  # type: ignore[attr-defined]
    if hasattr(exc, "add_note"):
        exc.add_note(where)
    return exc


def sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling both ways, else a ``RuntimeError`` that keeps its
    type's name, message, notes (the group, method and rank) and remote traceback.

    An exception whose class cannot be rebuilt from its ``args`` (an ``__init__`` with
    other parameters) pickles fine and fails only where it is unpickled: it is checked
    here, where its caller can still be told, not on the driver's side of the wire.
    """
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception as why:
        stand_in = RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        for name in ("remote_traceback", "hybridflow_origin", "__notes__"):
            if hasattr(exc, name):
                setattr(stand_in, name, getattr(exc, name))
        if hasattr(stand_in, "add_note"):  # Python 3.11+
            stand_in.add_note(f"(sent as a RuntimeError: the original cannot be pickled: {why!r})")
        return stand_in
    return exc


def explain_load_error(exc: BaseException, worker: str, what: str) -> BaseException:
    """Say on ``exc``, raised as worker ``worker`` loaded ``what`` the driver sent, what
    that process lacks: most often a module only the driver has (a worker started apart
    from the driver, with another environment or working directory)."""
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(
            f"raised by worker {worker} loading {what} from the driver: the worker's "
            "process must import every module those come from, as the driver does"
        )
    return exc


def explain_init_error(exc: BaseException) -> BaseException:
    """Say why ``init_process_group`` fails in a colocated instance, and the ways out.

    Groups on one pool share each rank's process, so the second group's unguarded
    ``torch.distributed.init_process_group()`` finds the first one's default group.
    """
    if _INIT_TWICE not in str(exc):
        return exc
    message = (
        "torch.distributed is already initialized in this process: worker groups on the same "
        "ResourcePool share each rank's process (and its default process group, which has the "
        "pool's rank layout). Guard the call with `if not torch.distributed.is_initialized():` "
        "as verl's workers do, fuse the roles into one class with create_colocated_worker_cls, "
        "or put the groups on separate pools."
    )
    try:
        clear = type(exc)(message)
    except Exception:  # an exception type with another constructor
        clear = RuntimeError(message)
    clear.__cause__ = exc
    return clear
