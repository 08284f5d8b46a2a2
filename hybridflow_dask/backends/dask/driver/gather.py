"""Gathering results in the driver: wait (bounded, watching liveness), then fetch.

One flow for every kind of future the backend hands out (a ``distributed.Future`` kept on
a worker, a ``RankReply`` of a blocking call's rank, a ``ReplyFuture`` of an instance's
creation): the first failure in rank order is raised once the ones before it are done, a
lost worker fails the wait at once, a call's deadline (``hybridflow.call-timeout`` when it
was made) ends the wait with ``CallTimeoutError``, and finished results are fetched on the
call path's lanes where it has them, through Dask's gather otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import operator
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, cast

from dask.sizeof import sizeof
from distributed import Client, Future

from ....errors import CallTimeoutError
from ...base import WorkerLostError
from ..config import call_timeout
from ..internals import future_state, wait_all
from .call_path import CallPath
from .direct_path import DEATH_WAIT_S
from .liveness import Liveness
from .replies import REPLY_KINDS, RankReply, Replies, ReplyFuture, all_values, one_call
from .timeouts import timed_out

__all__ = ["Gathering", "wait_some"]

#: How often a wait looks at liveness and the clock.
POLL_S = 0.1
#: How long a wait goes before the driver starts probing its workers' hosts.
WATCH_AFTER_S = 1.0
#: Marks a result that must be fetched from its worker.
_FETCH: Any = object()
#: What ``driver_bytes["gathered"]`` counts for a ``None`` result.
_NONE_SIZE = sizeof(None)


class Gathering:
    """The backend's waits for results; ``check_open`` raises once the backend closed,
    ``check_reachable`` probes the hosts of calls that take long (a cut link)."""

    def __init__(
        self,
        client: Client,
        live: Liveness,
        path: CallPath,
        counts: dict[str, int],
        check_open: Callable[[], None],
        check_reachable: Callable[[Sequence[Any]], None],
    ) -> None:
        self.client = client
        self._live = live
        self._path = path
        self._counts = counts
        self._check_open = check_open
        self._check_reachable = check_reachable

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Wait for all, failing early on an error or a lost worker, then fetch (on the
        lanes where the path has them, else through Dask)."""
        call = one_call(futures)
        if call is not None and call.wait(POLL_S) and call.all_ok():
            values = all_values(call, futures) or [f.result() for f in futures]
            self._count_gathered(values)  # a blocking call answered in full
            return values
        limit = call_timeout()
        start = time.monotonic()
        while pending := _still_pending(futures):
            wait_some(self.client, pending, POLL_S)
            self._check_open()
            pending = [f for f in pending if not f.done()]
            self._live.raise_if_lost(pending)
            if pending and time.monotonic() - start > WATCH_AFTER_S:
                self._check_reachable(pending)
            if pending and self._out_of_time(pending, start, limit):
                raise timed_out(pending, limit, self._live.issued, self._path.withdraw) from None
        for f in futures:  # the first failure, in rank order, as Dask's gather raises it
            if isinstance(f, REPLY_KINDS) and f.done() and f.exception() is not None:
                raise _detached(cast(BaseException, f.exception()))  # checked just above
            if isinstance(f, Future) and f.status == "error":
                state = future_state(f)
                raise _detached(state.exception).with_traceback(state.traceback)
            if isinstance(f, Future) and f.status == "cancelled":
                lost = self._live.lost(f)  # cancelled because its input died with a worker
                if lost is not None:
                    raise lost
        values = [self._at_hand(f) for f in futures]
        remote = [f for f, v in zip(futures, values) if v is _FETCH]
        on_lanes = self._path.fetch(remote) if remote else {}
        rest = [f for f in remote if f.key not in on_lanes]
        fetched = dict(on_lanes)
        if rest:
            fetched.update(zip((f.key for f in rest), self._gather_from_dask(rest)))
        values = [fetched[f.key] if v is _FETCH else v for f, v in zip(futures, values)]
        self._count_gathered([v for f, v in zip(futures, values) if _is_pending_kind(f)])
        return values

    def _count_gathered(self, values: list[Any]) -> None:
        """``driver_bytes["gathered"]``: what results brought into the driver."""
        # ``None``, a control call's usual result, sized once: counted in C, by identity
        # (``list.count`` would compare with ``==``, which a numpy array answers in bulk)
        nones = sum(map(operator.is_, values, repeat(None)))
        total = nones * _NONE_SIZE
        if nones < len(values):
            total += sum(sizeof(value) for value in values if value is not None)
        self._counts["gathered"] += total

    def _out_of_time(self, pending: list[Any], start: float, limit: float | None) -> bool:
        """Whether a wait for ``pending`` passed its limit: the deadline their calls were
        made with, else ``limit`` seconds from ``start`` (futures that are not calls)."""
        deadline = self._live.deadline(pending)
        if deadline is not None:
            return time.time() >= deadline
        return limit is not None and time.monotonic() - start > limit

    def _gather_from_dask(self, futures: list[Future]) -> list[Any]:
        """Dask's gather, watched: a result lost with its worker meanwhile is a
        ``WorkerLostError`` naming the rank, not Dask's cancellation or a wait for a
        worker that never comes back (a pinned task's result is recomputed only there)."""
        self._live.raise_if_lost(futures)
        limit = call_timeout()
        give_up = None if limit is None else time.monotonic() + limit
        coroutine = self.client.gather(futures, direct=True, asynchronous=True)
        running = asyncio.run_coroutine_threadsafe(coroutine, self.client.loop.asyncio_loop)
        try:
            while True:
                try:
                    return running.result(POLL_S)
                except concurrent.futures.TimeoutError:
                    self._check_open()
                    if give_up is not None and time.monotonic() > give_up:
                        raise CallTimeoutError(
                            f"fetching {len(futures)} result(s) ({_label(futures[0])}, ...) "
                            f"took longer than hybridflow.call-timeout={limit:g}s: is the "
                            "worker holding them stopped or hung?"
                        ) from None
                    lost = self._live.first_lost(futures)
                    if lost is not None:
                        raise lost from None
        except concurrent.futures.CancelledError as exc:
            # The scheduler cancels a dead worker's keys; its word on the death itself
            # (which names the rank) follows within milliseconds.
            deadline = time.monotonic() + DEATH_WAIT_S
            while (lost := self._live.first_lost(futures)) is None:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
            raise lost from exc
        finally:
            running.cancel()  # (a no-op once it is done)

    def _at_hand(self, f: Any) -> Any:
        """What ``gather`` returns for ``f`` without fetching, or ``_FETCH``."""
        if isinstance(f, REPLY_KINDS):
            return f.result()
        if isinstance(f, Future):
            return self._path.plain_result(f, _FETCH)
        return f


def _error_of(f: Any) -> BaseException | None:
    """The error of a failed future of either kind."""
    return f.exception() if isinstance(f, REPLY_KINDS) else future_state(f).exception


#: What a gather waits for (anything else among its futures is a value already).
_PENDING_KINDS = (Future, *REPLY_KINDS)


def _is_pending_kind(obj: Any) -> bool:
    return isinstance(obj, _PENDING_KINDS)


def _still_pending(futures: Sequence[Any]) -> list[Any]:
    """The futures still to wait for, in one pass: those not done before the first
    known to have failed (none when a worker was lost: that fails the wait at once)."""
    pending = []
    for f in futures:
        if not isinstance(f, _PENDING_KINDS):
            continue
        if not f.done():
            pending.append(f)
        elif f.status in ("error", "cancelled"):
            lost = f.status == "cancelled" or isinstance(_error_of(f), WorkerLostError)
            return [] if lost else pending
    return pending


def wait_some(client: Client, futures: Sequence[Any], timeout: float) -> None:
    """Wait up to ``timeout`` for Dask futures and reply futures alike, until all are
    done or one failed. The ranks of one blocking call are waited for together (one
    wake-up, not one per rank), and the caller reads their lanes itself while none of
    that call's ranks failed."""
    if not futures:
        return
    deadline = time.monotonic() + timeout
    remote = [f for f in futures if isinstance(f, Future)]
    ranks: dict[Replies, list[int]] = {}  # each blocking call's ranks among ``futures``
    others: list[ReplyFuture] = []
    for f in futures:
        if type(f) is RankReply:
            ranks.setdefault(f.replies, []).append(f.index)
        elif isinstance(f, ReplyFuture):
            others.append(f)
    call = one_call(futures)  # one call's ranks only, none failed yet: it reads its lanes
    if call is not None and call.over:
        call = None
    if call is None:  # this thread reads no lane while it waits here: their threads do
        for replied in ranks:
            replied.hand_over()
    if remote:
        client.sync(wait_all, remote, timeout)
    if not (ranks or others) or time.monotonic() >= deadline:
        return
    if call is not None:
        call.wait(deadline - time.monotonic())
        return
    if any(f.done() and f.exception() is not None for f in others):
        return
    for replied, indices in ranks.items():
        left = deadline - time.monotonic()
        if left <= 0 or not replied.wait_parts(indices, left):
            return
        if any(replied.error(i) is not None for i in indices):
            return
    if others:
        concurrent.futures.wait(
            others,
            timeout=max(deadline - time.monotonic(), 0.0),
            return_when=concurrent.futures.FIRST_EXCEPTION,
        )


def _detached(exc: BaseException) -> BaseException:
    """A copy of a stored error to raise: raising the stored one would tie this call's
    frames (and the futures they hold) to the client's record of the future forever."""
    try:
        clone = copy.copy(exc)
    except Exception:  # an exception that cannot be copied: raise it as it is
        return exc
    clone.__cause__, clone.__context__ = exc.__cause__, exc.__context__
    return clone


def _label(future: Any) -> str:
    return str(future.key).rsplit("-", 1)[0]
