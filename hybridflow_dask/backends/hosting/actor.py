"""One instance in a shared process, hosted the way a Ray actor is hosted.

A Ray actor has a thread of its own, an event loop that lives as long as it does, an
environment that is its process's, and inputs nobody else can change. Instances here
share a process with its transport (a Dask worker's event loop and task threads, a Ray
actor's loop) and with colocated instances, so each ``Actor`` provides those explicitly:

- **its own thread**: ``__init__`` and every ``def`` method run there, one at a time, in
  the order the driver issued them (a per-driver sequence number; calls that arrive early
  wait in a table until their turn, calls that will never come are skipped, and a call
  whose deadline passed before its turn came is refused: its driver has reported it
  failed, or is about to);
- **its own event loop**, started with the instance when its class has ``async def``
  methods (or at the first awaitable a method returns) and stopped when it is destroyed:
  background tasks keep running between calls; a coroutine call's body starts before
  the instance's next call does (the thread waits for its first step), and coroutine
  calls then overlap, up to ``MAX_CONCURRENCY`` at once, as on an async Ray actor;
- **its own environment**: an ``EnvGate`` shared by the process puts the instance's
  variables in ``os.environ`` and lets calls of instances with the very same variables
  (the colocated ranks of one pool) run together, while an instance with other variables
  waits until they are done.

Copies of inputs are made by ``serve``, which knows where each came from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import inspect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ...errors import CallTimeoutError, CallWithdrawnError
from ..base import InstanceRef
from .cpu_share import CpuShare
from .environment import EnvGate
from .failures import annotate_error

__all__ = ["MAX_CONCURRENCY", "Actor", "Done", "FutureOutcome", "release_device_memory"]

#: What a call's outcome is handed to, once: ``done(value, None)`` or ``done(None, error)``.
#: Called in the instance's thread as the method returns (before its next call starts), or
#: in the submitting thread when the call is refused at once.
Done = Callable[[Any, "BaseException | None"], None]

#: How many coroutine calls of one instance may run at once (Ray's default for async actors).
MAX_CONCURRENCY = 1000

_CLOSE: Any = object()  # the job that ends an actor's thread

_SKIP = object()  # a sequence number that will never be called

_DONE = object()  # what ``drive`` waited for is settled


def release_device_memory() -> None:
    """GPU only, once an instance is gone: give the CUDA memory torch's caching allocator
    keeps idle back to the device, so a shut-down group's memory is free for other
    processes (the process's CUDA context stays until the worker restarts). Nothing in a
    process that never started CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    gc.collect()  # the instance's own reference cycles (modules, optimizers) hold tensors
    torch.cuda.empty_cache()


class _Order:
    """Calls of one driver to one instance, by sequence number."""

    def __init__(self) -> None:
        self.next = 1
        self.waiting: dict[int, Any] = {}
        #: Numbers withdrawn by the driver (failed calls: few), so a late copy never runs.
        self.skipped: set[int] = set()

    def pop_ready(self) -> Any:
        while self.next in self.waiting:
            entry = self.waiting.pop(self.next)
            self.next += 1
            if entry is not _SKIP:
                return entry
        return None


class Actor:
    """One instance: its thread, its loop, its call order, its environment."""

    def __init__(
        self,
        ref: InstanceRef,
        env: dict[str, str],
        gate: EnvGate,
        enter: Callable[[Actor], None] | None = None,
        own_thread: bool = True,
    ) -> None:
        self.ref = ref
        #: Run first in each of the instance's threads (the transport's context for user
        #: code: Dask's ``get_worker()``, the worker's log page).
        self._enter = enter
        self.env = dict(env)
        self._env_key = frozenset(self.env.items())
        #: Held by this actor's thread except while the gate admits it (see ``EnvGate``).
        self._turn = threading.Lock()
        self._turn.acquire()
        self.obj: Any = None
        self._gate = gate
        self._orders: dict[str, _Order] = {}
        #: Guards the call table; ``_wake`` is released once to wake the thread that
        #: waits for a job (a condition variable's wait and notify cost twice as much per
        #: hand-off, and every call is one). Reentrant: a call failed while the table is
        #: held (``skip``, ``stop``) settles its future there, and the callback of a
        #: thread driving that future (``drive``) takes the table again to wake it.
        self._mutex = threading.RLock()
        self._wake = threading.Lock()
        self._wake.acquire()
        self._sleeping = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._slots: asyncio.Semaphore | None = None
        #: ``False``: the transport lends its thread instead, ``drive`` running the calls
        #: in it (always the same one: Ray's one default thread of a slot actor).
        self.own_thread = own_thread
        self._entered = False
        #: Set while the instance is a light rank: its thread keeps to the CPU its calls
        #: arrive on (see ``cpu_share``).
        self.cpu_share: CpuShare | None = None
        #: The native id of the instance's own thread (``None``: it has none).
        self.thread_id: int | None = None
        if own_thread:
            thread = threading.Thread(target=self._serve, name=f"hf-{ref.name}", daemon=True)
            thread.start()
            self.thread_id = thread.native_id

    # -- what the table asks ----------------------------------------------------------------

    def post(
        self,
        driver: str,
        seq: int,
        job: Callable[[Actor], Any],
        done: Done,
        deadline: float | None = None,
    ) -> None:
        """Run ``job`` (given the instance) at its turn; its outcome goes to ``done``.

        A call whose number was skipped (before or after it arrived) never runs: the
        driver has reported it failed. Nor does one whose ``deadline`` (``time.time()``,
        the driver's call-timeout) passed before its turn came: the driver reports it
        failed at that moment, without waiting for word from here.
        """
        if self.cpu_share is not None:  # (before the table's lock: it may move threads)
            self.cpu_share.follow()
        with self._mutex:
            if self._closing:
                error: BaseException = self._gone()
            else:
                order = self._order(driver)
                if seq < order.next or seq in order.skipped:
                    error = self._withdrawn(seq)
                else:
                    order.waiting[seq] = (job, done, deadline, seq, order)
                    self._wake_up()
                    return
        done(None, error)

    def submit(
        self,
        driver: str,
        seq: int,
        job: Callable[[Actor], Any],
        deadline: float | None = None,
    ) -> concurrent.futures.Future:
        """``post``, its outcome in a future (a job whose future was cancelled before its
        turn does not run)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.post(driver, seq, job, FutureOutcome(future), deadline)
        return future

    def skip(self, driver: str, seq: int) -> bool:
        """Call number ``seq`` must not run (the driver reported it failed): later calls
        go ahead. Whether that held: ``False`` when it had already started or run."""
        with self._mutex:
            order = self._order(driver)
            if seq < order.next:
                return seq in order.skipped
            order.skipped.add(seq)
            entry = order.waiting.get(seq)
            if entry is not None and entry is not _SKIP:
                entry[1](None, self._withdrawn(seq))
            order.waiting[seq] = _SKIP
            self._wake_up()
            return True

    def close(self, driver: str, seq: int) -> concurrent.futures.Future:
        """Destroy the instance after every call issued before ``seq``."""
        return self.submit(driver, seq, _CLOSE)

    def stop(self) -> None:
        """Stop at once (the worker is closing): drop waiting calls, end thread and loop."""
        with self._mutex:
            self._drop_waiting()
            self._wake_up()
        self._stop_loop()

    # -- the instance's thread ------------------------------------------------------------

    def _serve(self) -> None:
        if self._enter is not None:
            self._enter(self)
        while True:
            entry = self._wait_for(self._next_job)
            if not self._take(entry):
                return
            entry = None  # (nothing of a call stays referenced while the next is awaited)

    def drive(self, until: concurrent.futures.Future) -> None:
        """Run this actor's jobs, in their order, in the calling thread until ``until`` is
        done (or the actor is closed): for an actor without a thread of its own, whose
        transport lends it the one thread all its calls arrive on."""
        if not self._entered and self._enter is not None:
            self._entered = True
            self._enter(self)

        def next_job() -> Any:
            return _DONE if until.done() else self._next_job()

        def wake(_: object) -> None:  # ``until`` may be settled in another thread
            with self._mutex:
                self._wake_up()

        until.add_done_callback(wake)
        while True:
            entry = self._wait_for(next_job)
            if entry is _DONE or not self._take(entry):
                return
            entry = None

    def _take(self, entry: Any) -> bool:
        """Run one entry of the table; ``False`` once the actor is closed."""
        if entry is _CLOSE:
            return False
        job, done, deadline, seq, order = entry
        if job is _CLOSE:
            self._finish_close(done)
            return False
        wanted = getattr(done, "wanted", None)  # a future cancelled meanwhile: not run
        if wanted is None or wanted():
            self._run(job, done, deadline, seq, order)
        return True

    def _wait_for(self, next_job: Callable[[], Any]) -> Any:
        """What ``next_job`` returns once it is not ``None``, sleeping until woken."""
        while True:
            with self._mutex:
                entry = next_job()
                if entry is None:
                    self._sleeping = True
            if entry is not None:
                return entry
            self._wake.acquire()

    def _wake_up(self) -> None:
        """Wake the thread waiting for a job, if one waits (hold ``_mutex``)."""
        if self._sleeping:
            self._sleeping = False
            self._wake.release()

    def _next_job(self) -> Any:
        if self._closing:
            return _CLOSE
        for order in self._orders.values():
            entry = order.pop_ready()
            if entry is not None:
                return entry
        return None

    def _run(
        self,
        job: Callable[[Actor], Any],
        done: Done,
        deadline: float | None,
        seq: int,
        order: _Order,
    ) -> None:
        record = getattr(job, "record", None)  # the call's phase times (see call_log)
        gate = self._gate
        gate.enter(self._env_key, self.env, self._turn)  # waiting here for another env is queue
        # Checked last thing before the method starts: its turn may have come after its
        # deadline, or the process may have been stopped meanwhile.
        if deadline is not None and time.time() >= deadline:
            gate.leave()
            with self._mutex:  # so that a later withdrawal hears it did not run
                order.skipped.add(seq)
            done(None, self._late(seq))  # (no run time stamped: it never ran)
            return
        if record is not None:
            record.start = time.time()
        try:
            result = job(self)
        except BaseException as exc:  # the method's own error, annotated by the job
            gate.leave()
            _stopped(record)
            done(None, exc)
            return
        gate.leave()
        if result is not None and inspect.isawaitable(result):
            self._start_coroutine(result, done, job)
        else:
            _stopped(record)
            _settle(done, job, result)

    def _finish_close(self, done: Done) -> None:
        with self._mutex:
            self._drop_waiting()
        self._stop_loop()
        self.obj = None
        release_device_memory()
        done(None, None)

    # -- the instance's event loop ----------------------------------------------------------

    def start_loop(self) -> None:
        """Give the instance a running loop of its own (idempotent)."""
        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve() -> None:
            if self._enter is not None:
                self._enter(self)
            asyncio.set_event_loop(loop)
            self._slots = asyncio.Semaphore(MAX_CONCURRENCY)
            loop.call_soon(ready.set)
            loop.run_forever()
            with contextlib.suppress(Exception):
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._loop = loop
        self._loop_thread = threading.Thread(
            target=serve, name=f"hf-{self.ref.name}-loop", daemon=True
        )
        self._loop_thread.start()
        ready.wait()

    def _start_coroutine(self, awaitable: Any, done: Done, job: Any) -> None:
        """Hand a coroutine to the instance's loop and wait until its body has run to its
        first ``await`` (or to its end): the instance's next call starts after that, as on
        a Ray async actor. Only then do calls overlap."""
        self.start_loop()
        method = getattr(job, "method", "<coroutine>")
        stepped = threading.Event()

        async def run() -> Any:
            assert self._slots is not None
            try:
                async with self._slots:
                    gated = _Gated(awaitable, self._gate, self._env_key, self.env, stepped.set)
                    return await gated
            finally:
                stepped.set()  # (cancelled before its first step)

        def ended(task: concurrent.futures.Future) -> None:
            _stopped(getattr(job, "record", None))
            try:
                result = task.result()
            except BaseException as exc:
                done(None, annotate_error(exc, self.ref, method))
            else:
                _settle(done, job, result)

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(run(), self._loop).add_done_callback(ended)
        stepped.wait()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._loop_thread
        self._loop = None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(loop.stop)
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)

    # -- helpers ------------------------------------------------------------------------------

    def _drop_waiting(self) -> None:
        """Close for good: calls still waiting for their turn fail (hold ``_mutex``)."""
        self._closing = True
        for order in self._orders.values():
            for entry in order.waiting.values():
                if entry is not _SKIP:
                    entry[1](None, self._gone())
            order.waiting.clear()

    def _order(self, driver: str) -> _Order:
        order = self._orders.get(driver)
        if order is None:
            order = self._orders[driver] = _Order()
        return order

    def _withdrawn(self, seq: int) -> CallWithdrawnError:
        return CallWithdrawnError(
            f"call {seq} on {self.ref.name} was withdrawn by its driver (reported failed "
            "there), so it does not run"
        )

    def _late(self, seq: int) -> CallTimeoutError:
        return CallTimeoutError(
            f"call {seq} on {self.ref.name} did not start: its hybridflow.call-timeout "
            "passed while it waited for its turn (its driver reports it failed), so it "
            "does not run"
        )

    def _gone(self) -> LookupError:
        return LookupError(
            f"instance {self.ref.name} was destroyed: its group was shut down, or the worker "
            "restarted (see WorkerGroup.recover)"
        )


def _stopped(record: Any) -> None:
    if record is not None:
        record.stop = time.time()


def _settle(done: Done, job: Any, result: Any) -> None:
    """The job's outcome as its caller gets it: ``job.capture(result)`` where the job
    says what to keep of its result (a snapshot), taken before the next call runs."""
    capture = getattr(job, "capture", None)
    if capture is not None:
        try:
            result = capture(result)
        except BaseException as exc:
            done(None, exc)
            return
    done(result, None)


class FutureOutcome:
    """A ``Done`` that settles ``future`` (unless it was cancelled meanwhile: nobody waits
    for it then); a job whose future was cancelled before its turn is not run."""

    __slots__ = ("future",)

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def wanted(self) -> bool:
        return self.future.set_running_or_notify_cancel()

    def __call__(self, value: Any, error: BaseException | None) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)


class _Gated:
    """Awaits a coroutine with its instance's environment in place during every step;
    ``stepped`` is called once its first step is over (it awaits, or it ended)."""

    def __init__(
        self,
        awaitable: Any,
        gate: EnvGate,
        key: frozenset,
        env: dict[str, str],
        stepped: Callable[[], None],
    ) -> None:
        self._it = awaitable.__await__()
        self._gate, self._key, self._env = gate, key, env
        self._stepped = stepped

    def __await__(self) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                self._gate.enter(self._key, self._env)  # (a new turn: steps may overlap)
                try:
                    step = self._it.throw(error) if error is not None else self._it.send(value)
                except StopIteration as stop:
                    return stop.value
                finally:
                    self._gate.leave()
            finally:
                self._stepped()
            try:
                value, error = (yield step), None
            except BaseException as exc:  # cancellation and errors go into the coroutine
                value, error = None, exc
