"""The dashboard's call records on the wire: what a worker packs, the scheduler reads back.

The scheduler reads one row per rank per call, so the reader takes each row in one pass;
these check it keeps every field and refuses what is malformed (no cluster needed).
"""

from __future__ import annotations

import msgpack

from hybridflow_dask.backends.dask.wire.call_events import (
    CALL_FIELDS,
    calls_event,
    finished_calls,
)
from hybridflow_dask.backends.dask.wire.keys import CALL_STAMPS

T = 1_700_000_000.0


def full_call(**changes):
    call = {
        "key": "grp.generate-0123",
        "group": "grp",
        "method": "generate",
        "rank": 3,
        "worker": "tcp://10.0.0.2:4000",
        "path": "lane",
        "received": T,
        "inputs": T + 0.1,
        "start": T + 0.2,
        "stop": T + 0.5,
        "replied": T + 0.6,
        "status": "OK",
        "nbytes": 1024,
        "error": None,
    }
    return {**call, **changes}


def test_every_field_a_worker_sends_comes_back_to_the_reader():
    assert set(CALL_FIELDS) == set(full_call())  # the reader knows every field sent
    (call,) = finished_calls(calls_event([full_call()]))
    assert (call.key, call.group, call.method, call.rank) == (
        "grp.generate-0123",
        "grp",
        "generate",
        3,
    )
    assert (call.worker, call.path, call.ok, call.nbytes) == (
        "tcp://10.0.0.2:4000",
        "lane",
        True,
        1024,
    )
    assert call.stamps == tuple(full_call()[name] for name in CALL_STAMPS)
    assert call.error is None


def test_a_failed_call_keeps_its_error_and_a_good_one_drops_any():
    detail = {"type": "ValueError", "message": "bad", "traceback": "..."}
    failed, fine = finished_calls(
        calls_event([full_call(status="error", error=detail), full_call(error=detail)])
    )
    assert (failed.ok, failed.error) == (False, detail)
    assert (fine.ok, fine.error) == (True, None)


def test_stamps_left_out_take_their_neighbours():
    sparse = {k: v for k, v in full_call().items() if k not in ("received", "inputs", "replied")}
    sparse.pop("path")
    (call,) = finished_calls(calls_event([sparse]))
    start, stop = T + 0.2, T + 0.5
    assert call.stamps == (start, start, start, stop, stop)  # no time in those phases
    assert call.path == "direct"


def test_malformed_rows_are_left_out_and_the_rest_kept():
    rows = [
        full_call(key=7),  # not a string
        full_call(worker=None),  # no worker
        full_call(start=None),  # start is required
        full_call(stop="soon"),  # not a time
        full_call(inputs=T + 0.3),  # stamps out of order (inputs after start)
        full_call(key="grp.generate-kept"),
    ]
    event = calls_event(rows)
    unpacked = msgpack.unpackb(event["rows"])
    unpacked.insert(0, ["too", "short"])
    unpacked.insert(0, "not a row")
    kept = finished_calls({"rows": msgpack.packb(unpacked)})
    assert [c.key for c in kept] == ["grp.generate-kept"]
    assert finished_calls({"rows": b"\xc1"}) == [] and finished_calls({"rows": 3}) == []
    assert finished_calls({"rows": msgpack.packb({"a": 1})}) == []
