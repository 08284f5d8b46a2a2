"""Which Dask worker processes died, and which pending work needed them.

A process is known by the id Dask gives each worker incarnation, not by its address: a
worker restarted at a fixed port (``dask worker --worker-port``) comes back at the same
address as a new, empty process. Deaths come from the scheduler's plugin hook
(``scheduler.deaths``); every task the backend submits records the processes it needs alive (its own
and those of the inputs it depends on), so a wait on it can fail at once, naming the
group and rank that died, instead of hanging on a task that can never run.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from distributed import Future

from ...base import InstanceRef, Slot, WorkerLostError, WorkerUnreachableError
from .call_path import RankCall, same_arguments
from .replies import RankReply, one_call

__all__ = ["Liveness", "TopicFanOut", "futures_in", "lost_error", "unreachable_error"]

logger = logging.getLogger(__name__)

_NOTHING: tuple = (None, None, frozenset())


class Liveness:
    """The backend's view of dead workers and of what each of its tasks depends on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: set[str] = set()  # worker ids
        #: worker ids of the dead that are really unreachable (a cut link): for this driver
        #: they are lost, and what fails on them says so
        self._unreachable: dict[str, float] = {}
        self._id_at: dict[str, str] = {}  # address -> id of the process there now
        self._was_at: dict[str, str] = {}  # address -> id of the process that died there
        #: task key -> (slot, instance or None, worker ids it needs alive); an entry leaves
        #: when its Future is freed.
        self._tasks: dict[str, tuple[Slot | None, InstanceRef | None, frozenset[str]]] = {}
        self._hosted: dict[str, InstanceRef] = {}  # worker id -> an instance it hosts
        #: task key -> weak reference to its future
        self._refs: dict[str, weakref.ref] = {}
        #: The blocking calls in flight or still held (their first rank's key -> a weak
        #: reference to the call's ``Replies``): a call's ranks are looked up through it,
        #: not tracked one by one.
        self._blocking: dict[str, weakref.ref] = {}
        #: task key -> its call's number on its instance, and its deadline (or ``None``)
        self._calls: dict[str, tuple[int, float | None]] = {}
        #: worker id -> the set of just that id (what a task without inputs needs alive)
        self._alone: dict[str, frozenset[str]] = {}

    # -- what the backend tells us ---------------------------------------------------------

    def seen(self, address: str, worker_id: str) -> None:
        """The process at ``address`` is ``worker_id`` (from a probe of that worker)."""
        with self._lock:
            self._id_at[address] = worker_id

    def hosts(self, ref: InstanceRef) -> None:
        self._hosted[ref.slot.worker_id] = ref

    def track(
        self,
        future: Future,
        slot: Slot,
        ref: InstanceRef | None,
        args: Any,
        seq: int | None = None,
        deadline: float | None = None,
    ) -> None:
        """Remember where ``future``'s task runs, which processes its inputs need and,
        for a call, its number on its instance and its deadline (``time.time()``)."""
        self._track(future, slot, ref, futures_in(args), seq, deadline)

    def track_calls(
        self, futures: Sequence[Any], calls: Sequence[RankCall], deadline: float | None
    ) -> None:
        """``track`` each rank's part of one call. A blocking call (``RankReply``s of one
        ``Replies``, which holds the call's parts) is one entry, forgotten when the call
        is: its ``Replies`` answers for its ranks. Otherwise ranks given the very same
        argument objects (``ONE_TO_ALL``) are searched for input futures once."""
        together = one_call(futures) if len(futures) == len(calls) else None
        if together is not None:
            key = together.keys[0]  # (its first rank's: a call to no rank is not made)
            self._blocking[key] = weakref.ref(together, functools.partial(self._dropped, key))
            return
        inputs: list[Future] = []
        last: RankCall | None = None
        for future, call in zip(futures, calls):
            if last is None or not same_arguments(call.args, call.kwargs, last.args, last.kwargs):
                inputs, last = futures_in((call.args, call.kwargs)), call
            self._track(future, call.ref.slot, call.ref, inputs, call.seq, deadline)

    def _dropped(self, key: str, _: Any) -> None:
        self._blocking.pop(key, None)

    def _track(
        self,
        future: Future,
        slot: Slot,
        ref: InstanceRef | None,
        inputs: list[Future],
        seq: int | None,
        deadline: float | None,
    ) -> None:
        key = future.key
        self._tasks[key] = (slot, ref, self._needs(slot, inputs))
        if seq is not None:
            self._calls[key] = (seq, deadline)
        # A weak reference with a callback, not weakref.finalize: finalize keeps a global
        # registry and costs several times more, on every call. The callback fires only
        # while this reference is stored, so a newer Future of the same key replaces it.
        self._refs[key] = weakref.ref(future, functools.partial(self._forgotten, key))

    def _needs(self, slot: Slot, inputs: list[Future]) -> frozenset[str]:
        """The processes a task on ``slot`` with ``inputs`` needs alive."""
        if inputs:
            needs = {slot.worker_id}
            for dep in inputs:
                needs |= self._tasks.get(dep.key, _NOTHING)[2]
            return frozenset(needs)
        # the common case: only its own process (one set for all its tasks)
        return self._alone.get(slot.worker_id) or self._alone.setdefault(
            slot.worker_id, frozenset((slot.worker_id,))
        )

    def _entry(self, fut: Any) -> tuple[Slot | None, InstanceRef | None, frozenset[str]]:
        """``(slot, instance, worker ids it needs alive)`` of the task behind ``fut``."""
        if type(fut) is RankReply:  # a blocking call's rank: its call knows its part
            part = fut.replies.calls[fut.index]
            return part.ref.slot, part.ref, self._part_needs(part)
        return self._tasks.get(fut.key, _NOTHING)

    def _part_needs(self, part: RankCall) -> frozenset[str]:
        return self._needs(part.ref.slot, futures_in((part.args, part.kwargs)))

    def _tracked_future(self, key: str) -> Any:
        """The future tracked under ``key``, while it lives."""
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def _blocking_ranks(self) -> list[tuple[str, RankCall]]:
        """The part of each rank of the blocking calls still held that has not been
        answered yet, with its call's first key (every rank's key has the call's label)."""
        found = []
        for key, ref in list(self._blocking.items()):
            call = ref()
            if call is not None:
                found += [(key, part) for i, part in enumerate(call.calls) if not call.is_done(i)]
        return found

    def _forgotten(self, key: str, _: Any) -> None:
        self._forget(key)

    def _forget(self, key: str) -> None:
        self._tasks.pop(key, None)
        self._calls.pop(key, None)
        self._refs.pop(key, None)

    def id_at(self, address: str) -> str | None:
        """The id of the process this backend knows at ``address``."""
        return self._id_at.get(address)

    def on_worker_removed(self, event: Any) -> str | None:
        """Handle a confirmed ``DEATH_TOPIC`` event (``scheduler.deaths``); the dead
        address, if it was a process this backend knew."""
        address = dead_address(event)
        if address is None:
            return None
        with self._lock:
            worker_id = self._id_at.pop(address, None)
            if worker_id is not None:
                self._dead.add(worker_id)
                self._was_at[address] = worker_id
        return address if worker_id is not None else None

    def pending_with(self, address: str) -> list[tuple[InstanceRef, str]]:
        """``(instance, method)`` of the calls not finished when the process that was at
        ``address`` died, which ran there or needed its data."""
        worker_id = self._was_at.get(address)
        found = []
        for key, (_, ref, needs) in list(self._tasks.items()):
            if ref is None or worker_id not in needs:
                continue
            fut = self._tracked_future(key)
            if fut is not None and not fut.done():
                found.append((ref, _method_of(key, ref)))
        for key, part in self._blocking_ranks():
            if worker_id in self._part_needs(part):
                found.append((part.ref, _method_of(key, part.ref)))
        return found

    def unreachable(self, slot: Slot, bound: float) -> None:
        """``slot``'s worker did not answer on the network for ``bound`` seconds: lost to
        this driver, like a dead one, though its process may live on behind the cut."""
        with self._lock:
            self._dead.add(slot.worker_id)
            self._unreachable[slot.worker_id] = bound

    def error(self, slot: Slot, ref: InstanceRef | None) -> WorkerLostError:
        """What a call on a lost ``slot`` fails with: unreachable, or died."""
        bound = self._unreachable.get(slot.worker_id)
        if bound is not None:
            return unreachable_error(slot, ref, bound)
        return lost_error(slot, ref)

    # -- questions ---------------------------------------------------------------------------

    def issued(self, fut: Any) -> tuple[InstanceRef, int] | None:
        """The instance and number of the call behind ``fut``, if it is a call."""
        if type(fut) is RankReply:
            part = fut.replies.calls[fut.index]
            return part.ref, part.seq
        ref = self._tasks.get(fut.key, _NOTHING)[1]
        call = self._calls.get(fut.key)
        return None if ref is None or call is None else (ref, call[0])

    def deadline(self, futures: Sequence[Any]) -> float | None:
        """The earliest deadline (``time.time()``) of the calls behind ``futures``."""
        deadlines = []
        for f in futures:
            if type(f) is RankReply:
                deadline = f.replies.deadline
            else:
                deadline = call[1] if (call := self._calls.get(f.key)) else None
            if deadline is not None:
                deadlines.append(deadline)
        return min(deadlines, default=None)

    def is_dead(self, slot: Slot) -> bool:
        return slot.worker_id in self._dead

    def is_dead_id(self, worker_id: str) -> bool:
        return worker_id in self._dead

    def placed(self, fut: Any) -> tuple[Slot, InstanceRef | None] | None:
        """Where the task behind ``fut`` ran (so where its result is) and for which
        instance, if it is ours."""
        slot, ref, _ = self._entry(fut)
        return None if slot is None else (slot, ref)

    def known(self, address: str) -> bool:
        """Whether the process now at ``address`` has been probed (and is not dead)."""
        return address in self._id_at

    def lost_or(
        self, slot: Slot, ref: InstanceRef | None, error: BaseException, wait: float = 2.0
    ) -> BaseException:
        """What to raise for ``error``, a connection to ``slot``'s worker that broke: a
        ``WorkerLostError`` once the scheduler says the worker died (its word follows the
        broken connection within milliseconds; waits up to ``wait`` seconds for it), else
        ``error`` itself. From a caller's thread, never the event loop."""
        deadline = time.monotonic() + wait
        while not self.is_dead(slot):
            if time.monotonic() > deadline:
                return error
            time.sleep(0.01)
        return self.error(slot, ref)

    def check(self, slot: Slot, ref: InstanceRef | None) -> None:
        if self.is_dead(slot):
            raise self.error(slot, ref)

    def check_all(self, refs: Sequence[InstanceRef]) -> None:
        """``check`` each of ``refs`` (nothing to look at while no worker died)."""
        if self._dead:
            for ref in refs:
                self.check(ref.slot, ref)

    def raise_if_lost(self, futures: Sequence[Any]) -> None:
        """Fail a wait whose task, or any input it depends on, lived on a dead worker."""
        error = self.first_lost(futures)
        if error is not None:
            raise error

    def first_lost(self, futures: Sequence[Any]) -> WorkerLostError | None:
        """Why the first of ``futures`` that can never finish cannot, or ``None``."""
        if not self._dead:
            return None
        return next(filter(None, map(self.lost, futures)), None)

    def lost(self, fut: Any) -> WorkerLostError | None:
        """Why ``fut`` can never finish (its worker, or an input's, died), or ``None``."""
        if not self._dead:
            return None
        slot, ref, needs = self._entry(fut)
        if slot is not None and self.is_dead(slot):
            return self.error(slot, ref)
        dead = sorted(needs & self._dead)
        if not dead:
            return None
        return WorkerLostError(
            f"{_label(fut)} depends on data from a Dask worker that died"
            f"{self._hosted_by(dead[0], None)}; the data is lost (see WorkerGroup.recover)"
        )

    def lost_input(self, fut: Any) -> WorkerLostError | None:
        """Why another call can never get ``fut``'s data (its worker died), or ``None``."""
        _, ref, needs = self._entry(fut)
        dead = sorted(needs & self._dead)
        if not dead:
            return None
        return WorkerLostError(
            f"{_label(fut)} is needed by a later call but was lost with the Dask worker that "
            f"held it{self._hosted_by(dead[0], ref)}; the data is gone (see WorkerGroup.recover)"
        )

    def _hosted_by(self, worker_id: str, fallback: InstanceRef | None) -> str:
        """`` (it hosted rank R of group G)`` for a dead worker, or nothing if unknown."""
        host = self._hosted.get(worker_id) or fallback
        return f" (it hosted rank {host.rank} of group {host.group!r})" if host else ""

    def stranded(self) -> list[Any]:
        """Pending tracked futures that can never finish because an input's worker died."""
        found = []
        for key, (_, _, needs) in list(self._tasks.items()):
            if needs & self._dead:
                fut = self._tracked_future(key)
                if fut is not None and not fut.done():
                    found.append(fut)
        return found


def lost_error(slot: Slot, ref: InstanceRef | None) -> WorkerLostError:
    who = f"rank {ref.rank} of worker group {ref.group!r}" if ref else f"slot {slot.index}"
    return WorkerLostError(
        f"the Dask worker {slot.address} hosting {who} died; its instances and results "
        "are lost (WorkerGroup.recover() rebuilds the rank on a live worker)"
    )


def unreachable_error(slot: Slot, ref: InstanceRef | None, bound: float) -> WorkerUnreachableError:
    who = f"rank {ref.rank} of worker group {ref.group!r}" if ref else f"slot {slot.index}"
    return WorkerUnreachableError(
        f"the Dask worker {slot.address} hosting {who} is unreachable: no connection to it "
        f"completed for hybridflow.unreachable-timeout={bound:g}s (a cut link or a lost "
        "host); its calls failed and will not be delivered, its instances and results are "
        "lost to this driver (WorkerGroup.recover() rebuilds the rank on a reachable worker)"
    )


class TopicFanOut:
    """Lets several backends on one ``Client`` each receive the events of one topic.

    A client keeps one handler per topic, so a second subscriber would silently replace
    the first, and the first to unsubscribe would cut off both. One fan-out per client,
    kept on the client itself, calls every subscriber instead.
    """

    ATTRIBUTE = "_hybridflow_topic_fan_out"

    def __init__(self) -> None:
        self.handlers: list[Any] = []

    def __call__(self, event: Any) -> None:
        for handler in list(self.handlers):
            try:
                handler(event)
            except Exception:  # one subscriber's bug must not starve the others
                logger.exception("hybridflow event handler failed")

    @classmethod
    def subscribe(cls, client: Any, topic: str, handler: Any) -> None:
        fan = getattr(client, cls.ATTRIBUTE, None)
        if fan is None:
            fan = cls()
            setattr(client, cls.ATTRIBUTE, fan)
            client.subscribe_topic(topic, fan)
        fan.handlers.append(handler)

    @classmethod
    def unsubscribe(cls, client: Any, topic: str, handler: Any) -> None:
        fan = getattr(client, cls.ATTRIBUTE, None)
        if fan is None:
            return
        if handler in fan.handlers:
            fan.handlers.remove(handler)
        if not fan.handlers:
            delattr(client, cls.ATTRIBUTE)
            client.unsubscribe_topic(topic)


def dead_address(event: Any) -> str | None:
    """The address a ``DEATH_TOPIC`` event names, or ``None`` for a malformed one."""
    _, msg = event if isinstance(event, tuple) and len(event) == 2 else (None, event)
    address = msg.get("worker") if isinstance(msg, dict) else None
    return address if isinstance(address, str) else None


def futures_in(values: Any, depth: int = 2) -> list[Future]:
    """Futures among task arguments (top level, and inside the tuples/dicts we pass)."""
    found: list[Future] = []
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, Future):
            found.append(value)
        elif depth and isinstance(value, (tuple, list, dict)):
            found.extend(futures_in(value, depth - 1))
    return found


def _label(fut: Future) -> str:
    return _label_of(fut.key)


def _label_of(key: str) -> str:
    return str(key).rsplit("-", 1)[0]


def _method_of(key: str, ref: InstanceRef) -> str:
    """The method a call's task key names (``group.method-...``)."""
    group = ref.group.replace("-", "_")  # as in task keys
    return _label_of(key)[len(group) + 1 :]
