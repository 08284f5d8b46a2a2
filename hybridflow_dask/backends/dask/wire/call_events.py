"""The finished calls a worker reports to the dashboard, as one compact event.

A worker reports its finished calls every ``SEND_INTERVAL_S`` in one ``CALL_TOPIC``
event. Carried as a list of dicts, that event cost more than the calls it described:
Dask's batched stream measures (``sizeof``) and checks (``_is_dumpable``) every value of
a message before it writes it, on the worker's event loop, and the scheduler walked them
again. Here the calls travel as rows (one per call, fields in ``CALL_FIELDS`` order)
packed into a single ``bytes`` with msgpack: Dask sees one opaque value, and packing and
unpacking run in C.

A row per call still cost the scheduler ~5-7 µs per rank call to read and count, so a
worker sends a row only for a call the page must see by itself (one that failed, or that
was reported while pending); the good calls of one method between two such rows travel
as one *fold*: per rank, how many there were and the longest run. Their phase times
reach the page as a *sample*: up to ``SAMPLED`` rows per method and event, drawn
uniformly, which feed the percentiles and the task stream but are not counted again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgpack

from .keys import CALL_STAMPS

__all__ = [
    "CALL_FIELDS",
    "FOLD",
    "FinishedCall",
    "FoldedCalls",
    "call_entries",
    "call_row",
    "calls_event",
    "finished_calls",
    "fold_entry",
    "rows_event",
    "sampled_calls",
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


#: The first field of a fold (a row's first field is its call's key, never this).
FOLD = "+fold"


def fold_entry(
    group: str, method: str, worker: str, path: str, ranks: list[list[Any]]
) -> list[Any]:
    """Good calls of one method folded: ``ranks`` holds ``[rank, calls, longest run]``."""
    return [FOLD, group, method, worker, path, ranks]


def rows_event(rows: list[list[Any]], samples: list[list[Any]] | None = None) -> dict[str, bytes]:
    """The event for ``rows`` (each a ``call_row`` or a ``fold_entry``, in the order the
    calls ended) and ``samples`` (``call_row``s of calls some fold counts). A value
    msgpack cannot carry travels as its ``str``."""
    event = {"rows": msgpack.packb(rows, default=str)}
    if samples:
        event["samples"] = msgpack.packb(samples, default=str)
    return event


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


class FoldedCalls(NamedTuple):
    """Good calls of one method on one worker, folded: per rank, how many and the longest run."""

    group: str
    method: str
    worker: str
    path: str
    #: ``(rank, calls, longest run in seconds)`` per rank.
    ranks: list[tuple[Any, int, float]]


def call_entries(msg: Mapping[str, Any]) -> list[FinishedCall | FoldedCalls]:
    """The well-formed rows and folds an event carries, in its order; a malformed one (or
    event) is left out.

    A phase time the sender left out takes its neighbour's (no time spent in that phase):
    ``received`` and ``inputs`` default to ``start``, ``replied`` to ``stop``.
    """
    entries = [_folded(row) if _is_fold(row) else _finished(row) for row in _unpacked(msg, "rows")]
    return [entry for entry in entries if entry is not None]


def finished_calls(msg: Mapping[str, Any]) -> list[FinishedCall]:
    """The well-formed rows an event carries (its folds left out)."""
    return [entry for entry in call_entries(msg) if type(entry) is FinishedCall]


def sampled_calls(msg: Mapping[str, Any]) -> list[FinishedCall]:
    """The well-formed sampled rows an event carries (calls its folds count)."""
    calls = [_finished(row) for row in _unpacked(msg, "samples")]
    return [call for call in calls if call is not None]


def _unpacked(msg: Mapping[str, Any], field: str) -> list[Any]:
    packed = msg.get(field)
    if not isinstance(packed, bytes):
        return []
    try:
        rows = msgpack.unpackb(packed)
    except Exception:  # a malformed event from anyone who can log events: nothing
        return []
    return rows if isinstance(rows, list) else []


def _is_fold(row: Any) -> bool:
    return type(row) is list and len(row) == 6 and row[0] == FOLD


def _folded(row: list[Any]) -> FoldedCalls | None:
    _, group, method, worker, path, ranks = row
    if not all(type(field) is str for field in (group, method, worker, path)):
        return None
    if type(ranks) is not list:
        return None
    good = []
    for entry in ranks:
        if type(entry) is not list or len(entry) != 3:
            continue
        rank, count, run = entry
        if type(count) is not int or count < 1 or not isinstance(run, (int, float)):
            continue
        good.append((rank, count, max(0.0, float(run))))
    return FoldedCalls(group, method, worker, path, good)


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
