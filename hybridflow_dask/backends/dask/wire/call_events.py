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
from typing import Any

import msgpack

from .keys import CALL_STAMPS

__all__ = ["CALL_FIELDS", "calls_event", "calls_of"]

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


def calls_event(calls: Iterable[Mapping[str, Any]]) -> dict[str, bytes]:
    """The event for ``calls`` (each a mapping of ``CALL_FIELDS``; a field left out is
    sent as absent). A value msgpack cannot carry travels as its ``str``."""
    rows = [[call.get(name) for name in CALL_FIELDS] for call in calls]
    return {"rows": msgpack.packb(rows, default=str)}


def calls_of(msg: Mapping[str, Any]) -> list[Any]:
    """The calls an event carries, each a dict of the fields its sender set; an entry
    that is not a row of ``CALL_FIELDS`` is passed on as it is (the reader ignores what
    is malformed). An event whose rows cannot be read carries none."""
    packed = msg.get("rows")
    if not isinstance(packed, bytes):
        return []
    try:
        rows = msgpack.unpackb(packed)
    except Exception:  # a malformed event from anyone who can log events: no calls
        return []
    if not isinstance(rows, list):
        return []
    return [
        {n: v for n, v in zip(CALL_FIELDS, row) if v is not None}
        if isinstance(row, list) and len(row) == _ROW_LENGTH
        else row
        for row in rows
    ]
