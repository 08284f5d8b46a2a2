"""Names both ends of the wire agree on: task keys, event topics, and stand-ins for inputs.

A call's key is ``"{group}.{method}-<32 hex digits>"``: the driver makes it, the worker
stores the result under it, and the dashboard (on the scheduler) groups calls by its
prefix. A future among a direct call's arguments travels as an ``InputKey`` that the
worker resolves itself.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CALL_PHASES",
    "CALL_STAMPS",
    "CALL_TOPIC",
    "EVENT_TOPIC",
    "GROUP_DATASET",
    "InputKey",
    "KeyRun",
    "key_of",
    "swap_inputs",
    "task_key",
    "task_keys",
]

#: Prefix of the published datasets that list each group's instances (the backend writes them).
GROUP_DATASET = "hybridflow-group-"
#: Event topic of the calls a worker hosts (``worker.call_log``): ``{"rows": bytes}`` for
#: finished calls (``call_events.calls_event``: one row per call of ``"key", "group",
#: "method", "rank", "worker", "path"``, the phase times
#: ``"received", "inputs", "start", "stop", "replied"`` from the worker's clock, ``"status"``
#: ``"OK" | "error"``, ``"nbytes"`` and, on error, ``"error": {"type", "message",
#: "traceback"}``) and ``{"pending": [...]}`` for calls still pending (``"state"``, ``"age"``
#: and ``"running_for"`` in seconds).
CALL_TOPIC = "hybridflow-call"
#: A call's time stamps on its worker (``time.time()``), in the order they happen: its
#: record (``worker.call_log``) has one attribute each, its event carries them by name, a
#: stamp left out takes its neighbour's time. A new stamp is a name here and the line
#: that sets it where it happens; the dashboard picks it up through ``CALL_PHASES``.
CALL_STAMPS = ("received", "inputs", "start", "stop", "replied")
#: What the dashboard shows of a call: each phase from one stamp to another, in column
#: order (``run``, the method itself, is shown apart, as percentiles).
CALL_PHASES = {
    "queue": ("inputs", "start"),
    "inputs": ("received", "inputs"),
    "reply": ("stop", "replied"),
    "run": ("start", "stop"),
}
#: Event topic of what a driver saw happen: ``{"kind": "lost" | "recovered", "group",
#: "rank", "worker", "message", ...}``.
EVENT_TOPIC = "hybridflow-event"


def task_key(label: str) -> str:
    """A unique task key ``"{group}.{method}-<uuid hex>"`` for a call labelled ``label``.

    Hyphens in the label become underscores: Dask's ``key_split`` cuts a key at its first
    hyphen, which would show ``actor`` for every task of group ``actor-rollout`` in its
    dashboard instead of ``actor_rollout.generate_sequences``.
    """
    return f"{label.replace('-', '_')}-{_key_ids.next()}"


def task_keys(label: str, count: int) -> KeyRun:
    """``count`` keys as ``task_key(label)`` makes them, with consecutive ids (a call to
    many ranks): each made only when asked for."""
    return KeyRun(f"{label.replace('-', '_')}-{_key_ids.prefix()}", _key_ids.take(count), count)


class KeyRun:
    """The keys of one call's ranks, rank ``i``'s ``"{head}{first + i:012x}"``.

    Made when asked for: a blocking call to hundreds of ranks names few of them in the
    driver, and a batch of its ranks carries ``(head, first)`` once, each worker making
    its own ranks' keys from their indices (``key_of``).
    """

    __slots__ = ("count", "first", "head")

    def __init__(self, head: str, first: int, count: int) -> None:
        self.head, self.first, self.count = head, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < self.count:
            raise IndexError(f"rank index {index} is not in a call to {self.count} ranks")
        return key_of((self.head, self.first), index)

    def __iter__(self) -> Iterator[str]:
        return (key_of((self.head, self.first), i) for i in range(self.count))


def key_of(run: tuple[str, int], index: int) -> str:
    """The key of rank ``index`` of the call whose ``KeyRun`` is ``(head, first)``."""
    head, first = run
    return f"{head}{first + index:012x}"


class _KeyIds:
    """32 hex digits per key: a random per-process prefix and a counter.

    ``uuid4()`` per call read the OS's random source every time; this is as unique across
    drivers (the prefix) and within one (the counter), and a forked child draws a new
    prefix. The counter's leading zeros keep a digit in every id, so Dask's ``key_split``
    never mistakes an all-letter id for part of the name.
    """

    def __init__(self) -> None:
        self._prefix = ""
        self._next = 0
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forked)

    def prefix(self) -> str:
        if not self._prefix:  # (drawn on first use, and again in a forked child)
            self._prefix = uuid.uuid4().hex[:20]
        return self._prefix

    def take(self, count: int) -> int:
        """The first of ``count`` consecutive ids, none of them handed out before."""
        with self._lock:
            first = self._next
            self._next += count
        return first

    def next(self) -> str:
        return f"{self.prefix()}{self.take(1):012x}"

    def _forked(self) -> None:
        self._lock = threading.Lock()  # (a thread of the parent may have held it)
        self._prefix = ""


_key_ids = _KeyIds()


@dataclass(frozen=True)
class InputKey:
    """Stands in a direct call's arguments for a Dask key the worker fetches itself."""

    key: str


def swap_inputs(values: Any, swap: Callable[[Any], Any], depth: int = 2) -> Any:
    """``values`` (a tuple or dict of arguments) with ``swap`` applied to each leaf."""
    if isinstance(values, dict):
        return {k: _swap_one(v, swap, depth) for k, v in values.items()}
    return tuple(_swap_one(v, swap, depth) for v in values)


def _swap_one(value: Any, swap: Callable[[Any], Any], depth: int) -> Any:
    if depth and isinstance(value, (tuple, list, dict)) and type(value) in (tuple, list, dict):
        inner = swap_inputs(value, swap, depth - 1)
        return list(inner) if isinstance(value, list) else inner
    return swap(value)
