"""The finished calls a worker reports to the dashboard, as one compact event.

A worker reports its finished calls every ``SEND_INTERVAL_S`` in one ``CALL_TOPIC``
event. Carried as a list of dicts, that event cost more than the calls it described:
Dask's batched stream measures (``sizeof``) and checks (``_is_dumpable``) every value of
a message before it writes it, on the worker's event loop, and the scheduler walked them
again. Here the calls travel as rows (one per call, fields in ``CALL_FIELDS`` order)
packed into a single ``bytes`` with msgpack: Dask sees one opaque value, and packing and
unpacking run in C.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgpack

from .keys import CALL_STAMPS

__all__ = [
    "CALL_FIELDS",
    "FinishedCall",
    "call_row",
    "calls_event",
    "finished_calls",
    "rows_event",
]

#: A finished call's fields, in the order its row carries them (see ``CALL_TOPIC``).
CALL_FIELDS = (
    "key",
    "group",
    "method",
    "rank",
    "worker",
    "path",
    *CALL_STAMPS,
    "status",
    "nbytes",
    "error",
)
_ROW_LENGTH = len(CALL_FIELDS)


def call_row(
    key: str,
    group: str,
    method: str,
    rank: Any,
    worker: str,
    path: str,
    stamps: tuple[float, float, float, float, float],
    status: str,
    nbytes: int,
    error: Any,
) -> list[Any]:
    """One finished call's row (``stamps`` in ``CALL_STAMPS`` order), as a worker sends it."""
    return [key, group, method, rank, worker, path, *stamps, status, nbytes, error]


def rows_event(rows: list[list[Any]]) -> dict[str, bytes]:
    """The event for ``rows`` (each a ``call_row``). A value msgpack cannot carry travels
    as its ``str``."""
    return {"rows": msgpack.packb(rows, default=str)}


def calls_event(calls: Iterable[Mapping[str, Any]]) -> dict[str, bytes]:
    """The event for ``calls``, each a mapping of ``CALL_FIELDS`` (a field left out is
    sent as absent): what a test or another sender builds."""
    return rows_event([[call.get(name) for name in CALL_FIELDS] for call in calls])


class FinishedCall(NamedTuple):
    """One finished call as the reader takes it from a row, its fields checked."""

    key: str
    group: str
    method: str
    rank: Any
    worker: str
    path: str
    #: Its times, in ``CALL_STAMPS`` order (``received``, ``inputs``, ``start``, ``stop``,
    #: ``replied``).
    stamps: tuple[float, float, float, float, float]
    ok: bool
    nbytes: int
    #: What the sender said of its error (only when not ``ok``), as it came.
    error: Any


def finished_calls(msg: Mapping[str, Any]) -> list[FinishedCall]:
    """The well-formed calls an event carries; a malformed row (or event) is left out.

    A phase time the sender left out takes its neighbour's (no time spent in that phase):
    ``received`` and ``inputs`` default to ``start``, ``replied`` to ``stop``.
    """
    packed = msg.get("rows")
    if not isinstance(packed, bytes):
        return []
    try:
        rows = msgpack.unpackb(packed)
    except Exception:  # a malformed event from anyone who can log events: no calls
        return []
    if not isinstance(rows, list):
        return []
    calls = [_finished(row) for row in rows]
    return [call for call in calls if call is not None]


def _finished(row: Any) -> FinishedCall | None:
    # One pass per row, no intermediate dict: the scheduler reads a row per rank per call.
    if type(row) is not list or len(row) != _ROW_LENGTH:
        return None
    key, group, method, rank, worker, path, received, inputs, start, stop, replied, *rest = row
    status, nbytes, error = rest
    if not all(type(field) is str for field in (key, group, method, worker)):
        return None
    try:
        start, stop = float(start), float(stop)
        received = start if received is None else float(received)
        inputs = received if inputs is None else float(inputs)
        replied = stop if replied is None else float(replied)
        nbytes = int(nbytes or 0)
    except (TypeError, ValueError):
        return None
    if not received <= inputs <= start <= stop <= replied:
        return None
    ok = status is None or status == "OK"
    return FinishedCall(
        key,
        group,
        method,
        rank,
        worker,
        "direct" if path is None else str(path),
        (received, inputs, start, stop, replied),
        ok,
        nbytes,
        None if ok else error,
    )
