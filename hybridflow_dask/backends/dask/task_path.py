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

import itertools
import logging
from collections.abc import Callable
from typing import Any

from distributed import Future

from ..base import InstanceRef, Slot
from .dashboard import task_key
from .host import create_instance, destroy_instance, run_call, skip_call
from .internals import submit_as
from .liveness import Liveness

__all__ = ["TaskPath"]

logger = logging.getLogger(__name__)


class TaskPath:
    """Creations, calls, skips and teardowns as tasks pinned to the rank's worker."""

    name = "task"

    def __init__(self, client: Any, driver_id: str, live: Liveness, *, share: bool) -> None:
        self.client = client
        self.driver_id = driver_id
        self._live = live
        self._share = share
        self._priority = itertools.count()
        self._closed = False
        self._running: set[Future] = set()

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict, seq: int
    ) -> Future:
        return self.submit(
            create_instance,
            ref,
            cls,
            args,
            kwargs,
            env,
            self.driver_id,
            seq,
            label=f"{ref.group}.__init__",
            slot=ref.slot,
            ref=ref,
        )

    def call(
        self,
        ref: InstanceRef,
        seq: int,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool,
        private: tuple = (),
    ) -> Future:
        try:
            future = self.submit(
                run_call,
                ref,
                self.driver_id,
                seq,
                method,
                args,
                kwargs,
                () if self._share else private,
                self._share,
                label=label,
                slot=ref.slot,
                ref=ref,
            )
        except BaseException:
            self.skip(ref, seq)  # e.g. an argument that cannot be pickled: never sent
            raise
        # The callback also keeps the call's inputs referenced until it is done, so data
        # handed over inside an argument (an unmaterialized future) is not released early.
        self._hold(future, lambda f, r=ref, s=seq, _=(args, kwargs): self._after_call(f, r, s))
        return future

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
            skipping = self.client.submit(
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
            self._hold(skipping)
        except Exception:  # the client is closing
            logger.debug("could not send skip for %s seq %d", ref.name, seq)

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
