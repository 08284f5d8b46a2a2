"""The task call path (``hybridflow.call-path: task``): every call is a pinned Dask task.

Public Dask APIs only, which makes it the fallback should a Dask release break the direct
path's internals. Each call is a task pinned to its rank's worker, keyed
``"{group}.{method}-<id>"``; it hands the call to the instance's actor (so order,
thread, loop and environment are the same as on the direct path) and waits off the
worker's thread pool. Results stay on the worker as ordinary futures. The path holds
every call's future until it is done, so a call runs to completion even if the driver
drops it, and a call that will never run (its input failed or was lost) is skipped on
the worker so later calls go ahead.

Why not ``fire_and_forget``: its request travels apart from the task, and a task that
finishes before the request reaches the scheduler stays in worker memory for good (seen
with teardowns, which finish in a millisecond, on a busy machine).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from dask.sizeof import sizeof
from distributed import Future
from distributed.comm import CommClosedError

from ....errors import CallTimeoutError
from ....protocol import DataProtoFuture
from ...base import InstanceRef, Slot
from ..config import scatter_threshold
from ..internals import submit_as
from ..wire.keys import task_key
from ..wire.messages import is_plain
from ..wire.snapshot import Captured
from ..worker.tasks import create_instance, destroy_instance, run_call, skip_call, worker_port
from .call_path import RankCalls
from .liveness import Liveness, futures_in

__all__ = ["TaskPath"]

logger = logging.getLogger(__name__)


class TaskPath:
    """Creations, calls, skips and teardowns as tasks pinned to the rank's worker."""

    name = "task"

    def __init__(
        self, client: Any, driver_id: str, live: Liveness, *, share: bool, counts: dict[str, int]
    ) -> None:
        self.client = client
        self.driver_id = driver_id
        self._live = live
        self._share = share
        #: The backend's ``driver_bytes``: arguments this path scatters count as "scattered".
        self._counts = counts
        self._priority = itertools.count()
        self._closed = False
        self._running: set[Future] = set()

    def port(self, slot: Slot) -> int:
        return self.client.run(worker_port, workers=[slot.address])[slot.address]

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict, seq: int
    ) -> Future:
        what = f"the arguments of {ref.group}.__init__"
        return self.submit(
            create_instance,
            ref,
            # (captured: a class the worker cannot load fails this task, where Dask would
            # fail the worker's whole connection to the scheduler reading it)
            Captured(cls, f"worker class {getattr(cls, '__name__', cls)!r}"),
            self._ship(args, ref, what),
            self._ship(kwargs, ref, what),
            env,
            self.driver_id,
            seq,
            label=f"{ref.group}.__init__",
            slot=ref.slot,
            ref=ref,
        )

    def call(
        self,
        calls: RankCalls,
        method: str,
        *,
        label: str,
        blocking: bool,
        deadline: float | None = None,
    ) -> list[Future]:
        """A pinned task per rank (the scheduler has no batch of its own to offer)."""
        return [self._call(*c, method, label=label, deadline=deadline) for c in calls]

    def _call(
        self,
        ref: InstanceRef,
        seq: int,
        args: tuple,
        kwargs: dict,
        method: str,
        *,
        label: str,
        deadline: float | None,
    ) -> Future:
        private = _shared_positions(args, kwargs)
        what = f"the arguments of {label} for rank {ref.rank}"
        args, kwargs = (
            self._ship(args, ref, what, deadline),
            self._ship(kwargs, ref, what, deadline),
        )
        future = self.submit(
            run_call,
            ref,
            self.driver_id,
            seq,
            method,
            args,
            kwargs,
            private,
            self._share,
            deadline,
            label=label,
            slot=ref.slot,
            ref=ref,
        )
        # The callback also keeps the call's inputs referenced until it is done, so data
        # handed over inside an argument (an unmaterialized future) is not released early.
        self._hold(future, lambda f, r=ref, s=seq, _=(args, kwargs): self._after_call(f, r, s))  # type: ignore[misc]
        return future

    def fetch(self, futures: Sequence[Future]) -> dict[str, Any]:
        return {}  # Dask gathers them all

    def plain_result(self, future: Future, default: Any) -> Any:
        return default  # results stay on the workers until gathered

    def submit_when_known(
        self, futures: Sequence[Future], submit: Callable[[Future | None], Future], label: str
    ) -> Future:
        return submit(None)  # every key this path hands out is the scheduler's from the start

    def destroy(self, ref: InstanceRef, seq: int) -> Future:
        future = self.submit(
            destroy_instance,
            ref,
            self.driver_id,
            seq,
            label=f"{ref.group}.__del__",
            slot=ref.slot,
            ref=ref,
        )
        self._hold(future)
        return future

    def skip(self, ref: InstanceRef, seq: int) -> None:
        if self._closed or self._live.is_dead(ref.slot):
            return
        try:
            self.withdraw(ref, seq)
        except Exception:  # the client is closing
            logger.debug("could not send skip for %s seq %d", ref.name, seq)

    def withdraw(self, ref: InstanceRef, seq: int) -> Future:
        withdrawing = self.client.submit(
            skip_call,
            ref.key,
            self.driver_id,
            seq,
            workers=[ref.slot.address],
            allow_other_workers=False,
            pure=False,
            key=task_key(f"{ref.group}.__skip__"),
            priority=1_000_000,
        )
        self._hold(withdrawing)
        return withdrawing

    def close(self) -> None:
        self._closed = True

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        label: str,
        slot: Slot | None,
        ref: InstanceRef | None,
        future: Future | None = None,
    ) -> Future:
        """A task running ``fn``, pinned to ``slot``, recorded for liveness checks.

        ``future``: a pending future handed out earlier that this task is to fulfil.
        """
        options: dict[str, Any] = {"pure": False}
        if slot is not None:
            options.update(workers=[slot.address], allow_other_workers=False)
        if ref is not None:  # calls are submitted in issue order: keep it when they are ready
            options["priority"] = -next(self._priority)
        if future is not None:
            submit_as(self.client, future, fn, *args, **options)
            return future
        future = self.client.submit(fn, *args, key=task_key(label), **options)
        if slot is not None:
            self._live.track(future, slot, ref, args)
        return future

    def _ship(self, values: Any, ref: InstanceRef, what: str, deadline: float | None = None) -> Any:
        """Driver values as a task takes them, captured now: large ones scattered straight
        to ``ref``'s worker (never via the graph), small ones serialized into the graph."""
        threshold = scatter_threshold()
        if isinstance(values, dict):
            return {k: self._ship_one(v, ref, threshold, what, deadline) for k, v in values.items()}
        return tuple(self._ship_one(v, ref, threshold, what, deadline) for v in values)

    def _ship_one(
        self, value: Any, ref: InstanceRef, threshold: int, what: str, deadline: float | None
    ) -> Any:
        if isinstance(value, (Future, DataProtoFuture)) or is_plain(value):
            return value  # a DataProtoFuture: the rank resolves it (materialize_futures=False)
        if futures_in([value]):  # Dask resolves the futures inside it where the task runs
            return value
        size = sizeof(value)
        if size < threshold:
            return Captured(value, what)
        self._counts["scattered"] += size
        limit = None if deadline is None else max(deadline - time.time(), 1e-3)
        scattering = asyncio.run_coroutine_threadsafe(
            self.client.scatter(
                [value], workers=[ref.slot.address], direct=True, hash=False, asynchronous=True
            ),
            self.client.loop.asyncio_loop,
        )
        try:  # (Dask's own scatter timeout does not bound a direct scatter)
            return scattering.result(limit)[0]
        except concurrent.futures.TimeoutError as exc:  # (before OSError: it is one)
            scattering.cancel()
            raise CallTimeoutError(
                f"sending {what} to its worker {ref.slot.address} took longer than "
                "hybridflow.call-timeout: is the worker stopped or hung? The call was not "
                "made, and will not run",
                queued=(ref.rank,),
            ) from exc
        except (CommClosedError, OSError) as exc:
            if self._closed:
                raise RuntimeError("the backend was shut down while sending arguments") from exc
            raise self._live.lost_or(ref.slot, ref, exc) from exc

    def _hold(self, future: Future, then: Callable[[Future], None] | None = None) -> None:
        """Keep ``future`` (so its task runs) until it is done, then run ``then``."""
        self._running.add(future)

        def done(f: Future) -> None:
            self._running.discard(f)
            if then is not None:
                then(f)

        future.add_done_callback(done)

    def _after_call(self, future: Future, ref: InstanceRef, seq: int) -> None:
        # An errored or cancelled call may never have run (its input failed): tell the
        # worker to stop waiting for it. A no-op when the call did run.
        if future.status in ("error", "cancelled"):
            self.skip(ref, seq)


def _shared_positions(args: tuple, kwargs: dict) -> tuple:
    """Which arguments are futures of stored results (to be copied before a method sees them)."""
    positions: list[Any] = [i for i, a in enumerate(args) if isinstance(a, Future)]
    positions += [k for k, v in kwargs.items() if isinstance(v, Future)]
    return tuple(positions)
