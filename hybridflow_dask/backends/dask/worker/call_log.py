"""What the dashboard learns of the calls on one worker: their phases, their outcome.

Every call an instance receives, on any path, gets a ``CallRecord`` stamped at each phase:

- ``received``: the message (or task) reached the worker;
- ``inputs``: its input futures were fetched (equal to ``received`` when it had none);
- ``start``: its turn came and the method began, in the instance's thread;
- ``stop``: the method returned or raised;
- and, when it ends, the time its reply was handed back (or its result kept).

Finished calls go to the scheduler in one ``hybridflow-call`` event per 250 ms, not one
per call (``wire.call_events``): a failed call, or one reported while pending, as a row of
its own; the good calls of a method between those folded into counts per rank, with a
uniform sample of their rows for the page's phase times. A call still pending
``REPORT_AFTER_S`` after it arrived is reported while pending (fetching inputs, queued or
running) and again whenever that state changes, so a hung or slow rank shows on the page
within a second instead of only when it ends. Fast calls cost nothing more than the
event they are batched into.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from tornado.ioloop import PeriodicCallback

from ...base import InstanceRef
from ..wire.call_events import call_row, fold_entry, rows_event
from ..wire.keys import CALL_STAMPS, CALL_TOPIC

__all__ = ["CallLog", "CallRecord", "error_detail"]

#: A call pending this long is reported before it ends.
REPORT_AFTER_S = 0.5
#: How often pending calls are looked at.
SCAN_INTERVAL_S = 0.25
#: How long finished calls gather before they go to the scheduler in one event: an eighth
#: of the page's refresh. Each event costs the scheduler (in the driver's process, on a
#: cluster the backend starts) ~0.4 ms: at 50 ms, 8 busy workers' events took ~5% of a
#: core there, ~30 µs of the driver's CPU per no-op call to 8 processes.
SEND_INTERVAL_S = 0.25
#: The most characters of a traceback or message an event carries.
TRACEBACK_CHARS = 12_000
MESSAGE_CHARS = 2_000
#: The most rows of good calls each method samples per event (see ``wire.call_events``).
SAMPLED = 8


class CallRecord:
    """One call's phase times (``time.time()``), filled in as it goes."""

    __slots__ = ("key", "method", "path", "ref", "told", *CALL_STAMPS)
    # (the stamps the hosting flow sets, typed; every stamp starts as None)
    received: float
    inputs: float | None
    start: float | None
    stop: float | None
    replied: float | None

    def __init__(self, ref: InstanceRef, key: str, method: str, path: str) -> None:
        self.ref, self.key, self.method, self.path = ref, key, method, path
        self.received = time.time()
        self.inputs = self.start = self.stop = self.replied = None
        self.told = ""  # the pending state last reported to the scheduler

    def state(self) -> str:
        if self.start is not None:
            return "running"
        return "queued" if self.inputs is not None else "inputs"


class CallLog:
    """The worker's records: pending ones, and finished ones not sent yet. Any thread."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._pending: set[CallRecord] = set()
        #: What the next event carries: rows of calls shown alone and folds, in order.
        self._entries: list[list[Any] | _Fold] = []
        #: (group, method, path) -> the fold its next good call joins, and its sample.
        self._folds: dict[tuple[str, str, str], _Fold] = {}
        self._samples: dict[tuple[str, str, str], _Sample] = {}
        self._loop = worker.loop.asyncio_loop
        self._scan = PeriodicCallback(self._report_pending, SCAN_INTERVAL_S * 1000)
        self._scan.start()

    def close(self) -> None:
        self._scan.stop()

    def begin(self, ref: InstanceRef, key: str, method: str, path: str = "direct") -> CallRecord:
        record = CallRecord(ref, key, method, path)
        with self._lock:
            self._pending.add(record)
        return record

    def end(self, record: CallRecord, error: BaseException | None = None, nbytes: int = 0) -> None:
        """The call was answered (or its result kept): queue it for the scheduler."""
        replied = record.replied = time.time()
        # Stamps a call never reached (refused, or its inputs failed) take the time of the
        # one before: a call that never ran spans no run time.
        inputs = record.inputs or record.received
        start = record.start or inputs
        stop = record.stop or start
        ref = record.ref
        stamps = (record.received, inputs, start, stop, replied)
        what = (ref.group, record.method, record.path)
        with self._lock:
            self._pending.discard(record)
            first = not self._entries
            if error is None and not record.told:  # a good call: counted in a fold
                fold = self._folds.get(what)
                if fold is None:
                    fold = self._folds[what] = _Fold(what)
                    self._entries.append(fold)
                fold.add(ref.rank, stop - start)
                sample = self._samples.get(what)
                if sample is None:
                    sample = self._samples[what] = _Sample()
                sample.offer(self._row, record, stamps, None, nbytes)
            else:  # shown by itself; the method's later good calls fold after it
                self._entries.append(self._row(record, stamps, error, nbytes))
                self._folds.pop(what, None)
        if first:
            with contextlib.suppress(RuntimeError):  # the worker's loop closed meanwhile
                self._loop.call_soon_threadsafe(self._loop.call_later, SEND_INTERVAL_S, self.send)

    def _row(
        self,
        record: CallRecord,
        stamps: tuple[float, float, float, float, float],
        error: BaseException | None,
        nbytes: int,
    ) -> list[Any]:
        ref = record.ref
        return call_row(
            record.key,
            ref.group,
            record.method,
            ref.rank,
            self.worker.address,
            record.path,
            stamps,
            "OK" if error is None else "error",
            nbytes,
            None if error is None else error_detail(error),
        )

    def send(self) -> None:
        """One event for the calls finished since the last one (on the worker's loop)."""
        with self._lock:
            entries, self._entries = self._entries, []
            samples, self._samples = self._samples, {}
            self._folds = {}
        if not entries:
            return
        address = self.worker.address
        rows = [e.entry(address) if isinstance(e, _Fold) else e for e in entries]
        sampled = [row for sample in samples.values() for row in sample.rows]
        self.worker.log_event(CALL_TOPIC, rows_event(rows, sampled))

    def _report_pending(self) -> None:
        now = time.time()
        changed = []
        with self._lock:
            for record in self._pending:
                state = record.state()
                if state != record.told and now - record.received >= REPORT_AFTER_S:
                    record.told = state
                    changed.append((record, state))
        if not changed:
            return
        pending = []
        for record, state in changed:
            entry = self._entry(record)
            entry.update(state=state, age=now - record.received)
            if record.start is not None:
                entry["running_for"] = now - record.start
            pending.append(entry)
        self.worker.log_event(CALL_TOPIC, {"pending": pending})

    def _entry(self, record: CallRecord) -> dict[str, Any]:
        ref = record.ref
        return {
            "key": record.key,
            "group": ref.group,
            "method": record.method,
            "rank": ref.rank,
            "worker": self.worker.address,
            "path": record.path,
        }


class _Fold:
    """Good calls of one method in a row: per rank, how many and the longest run."""

    __slots__ = ("ranks", "what")

    def __init__(self, what: tuple[str, str, str]) -> None:
        self.what = what
        self.ranks: dict[Any, list[Any]] = {}

    def add(self, rank: Any, run: float) -> None:
        counted = self.ranks.get(rank)
        if counted is None:
            self.ranks[rank] = [rank, 1, run]
        else:
            counted[1] += 1
            if run > counted[2]:
                counted[2] = run

    def entry(self, worker: str) -> list[Any]:
        group, method, path = self.what
        return fold_entry(group, method, worker, path, list(self.ranks.values()))


class _Sample:
    """Up to ``SAMPLED`` rows of one method's good calls, each call equally likely to be
    kept (reservoir sampling): the fastest calls of an event are not the ones shown.

    Which call is kept next is drawn ahead (Li's "algorithm L": the gap to the next kept
    call follows from the reservoir's current weight), so a call not kept costs a count
    and a comparison, not a random number: this runs for every call the worker serves.
    """

    __slots__ = ("next", "rows", "seen", "weight")

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.seen = 0
        #: The index (in calls seen) of the next call to keep once the rows are full.
        self.next = SAMPLED - 1
        self.weight = 1.0

    def offer(self, row: Callable[..., list[Any]], *args: Any) -> None:
        """The call seen now: its ``row(*args)`` is made only when it is kept."""
        index = self.seen
        self.seen = index + 1
        if index < SAMPLED:
            self.rows.append(row(*args))
            if index == SAMPLED - 1:
                self._draw_next()
        elif index == self.next:
            self.rows[random.randrange(SAMPLED)] = row(*args)
            self._draw_next()

    def _draw_next(self) -> None:
        self.weight *= math.exp(math.log(1.0 - random.random()) / SAMPLED)
        gap = math.log(1.0 - random.random()) / math.log(max(1.0 - self.weight, 1e-300))
        self.next += math.floor(gap) + 1


def error_detail(exc: BaseException) -> dict[str, str]:
    """An exception as the page shows it: its type, message and traceback, bounded."""
    cls = type(exc)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not lose the event
        message = f"<{name}: str() failed>"
    text = "".join(traceback.format_exception(exc))
    if len(text) > TRACEBACK_CHARS:
        text = "...\n" + text[-TRACEBACK_CHARS:]
    return {"type": name, "message": message[:MESSAGE_CHARS], "traceback": text}
