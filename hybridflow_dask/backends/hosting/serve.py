"""The worker side of a call, written once for every transport.

Whatever carried a call here (a message on Dask's comm, the socket lane, a Dask task, a
Ray actor call), it is served by ``Instances.serve`` (transports with an event loop) or
``Instances.serve_then`` (a thread that must not wait: the outcome is handed to a
callback; ``serve_now`` puts it in a future), and both take the same steps, each decided
only here:

1. **look-up**: the instance must live in this process (a destroyed one fails at once);
2. **deadline**: a call whose driver's ``call-timeout`` passed is refused before anything
   of it is read, so a driver that reported it failed may reuse its memory;
3. **inputs**: the transport resolves them (``resolve``); if that fails, the call gives
   up its turn so later calls go ahead, and fails (saying so when its arguments name a
   module this process cannot import);
4. **copies**: an input that is the very object another instance in this process keeps
   (a colocated producer's result) is copied, unless the driver chose to share them; a
   result that outlives the method's return (``Call.result``) is copied as it returns;
5. **run**: in the instance's actor, at its turn, refused there too if its deadline
   passed while it waited;
6. **hand back**: the transport's ``deliver`` (keep, or pack a reply), then one record
   of the call for the dashboard, and any error made able to travel.

A transport adapter only translates its message into a ``Call`` and the outcome back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ...errors import CallTimeoutError
from ..base import InstanceRef
from .actor import Actor, Done, FutureOutcome
from .copies import CopyPolicy
from .cpu_share import CpuShare, current_cpu
from .environment import EnvGate
from .failures import explain_load_error, sendable
from .jobs import Construct, Invoke, Record

__all__ = ["Call", "CallLog", "Instances", "NoLog", "Resolved"]

#: A call's arguments once its inputs are in this process, and which of them (positions
#: in ``args``, names in ``kwargs``) are objects this process's store keeps for others.
Resolved = tuple[tuple, dict, Collection[int | str]]


class CallLog(Protocol):
    """Where a transport records its calls' phases (the Dask backend's dashboard)."""

    def begin(self, ref: InstanceRef, key: str, method: str, path: str) -> Record: ...

    def end(self, record: Any, error: BaseException | None = None, nbytes: int = 0) -> None: ...


class _Record:
    __slots__ = ("inputs", "start", "stop")

    def __init__(self) -> None:
        self.inputs: float | None = None
        self.start: float | None = None
        self.stop: float | None = None


class NoLog:
    """Records nothing (backends without a dashboard of calls)."""

    def begin(self, ref: InstanceRef, key: str, method: str, path: str) -> Record:
        return _Record()

    def end(self, record: Any, error: BaseException | None = None, nbytes: int = 0) -> None:
        pass


@dataclass
class Call:
    """One method call as it reaches the process hosting its instance."""

    instance: str  # InstanceRef.key
    driver: str
    seq: int
    method: str
    args: tuple
    kwargs: dict
    #: What becomes of the result: ``"now"``, written out by the instance's thread before
    #: its next call (no copy); ``"later"``, written out afterwards (copied as the method
    #: returns); ``"kept"`` in this process for later fetches (copied, unless ``share``).
    result: Literal["now", "later", "kept"] = "kept"
    #: ``hybridflow.share-colocated-inputs``: colocated inputs and kept results by reference.
    share: bool = False
    #: ``time.time()`` after which the call must not start (the driver's call-timeout).
    deadline: float | None = None
    key: str = ""
    path: str = "direct"


class Instances:
    """The instances living in one process, each in its ``Actor``, and the call flow.

    ``copy`` is the backend's way to copy a value; ``log`` records calls; ``enter`` runs
    first in every thread an instance gets (the transport's context for user code).
    """

    def __init__(
        self,
        copy: CopyPolicy,
        log: CallLog | None = None,
        enter: Callable[[Actor], None] | None = None,
    ) -> None:
        self.copy = copy
        self.log: CallLog = log or NoLog()
        self._enter = enter
        self.gate = EnvGate()
        self._actors: dict[str, Actor] = {}
        self._lock = threading.Lock()
        #: Light ranks' threads (two or more ranks of one group here) share a CPU.
        self.cpu_share = CpuShare() if current_cpu() is not None else None

    # -- the table ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._actors)

    def keys(self) -> list[str]:
        return list(self._actors)

    def get(self, instance: str) -> Actor | None:
        return self._actors.get(instance)

    def actor(self, instance: str) -> Actor:
        try:
            return self._actors[instance]
        except KeyError:
            raise LookupError(
                f"instance {instance.split('#')[0]!r} is not in this worker process: its group "
                "was shut down, or the worker restarted (see WorkerGroup.recover)"
            ) from None

    def add(self, ref: InstanceRef, env: dict[str, str], own_thread: bool = True) -> Actor:
        """A new actor for ``ref`` (replacing one under the same key); ``own_thread=False``:
        one its transport drives in a thread it lends (``Actor.drive``)."""
        actor = Actor(ref, env, self.gate, self._enter, own_thread)
        with self._lock:
            old = self._actors.pop(ref.key, None)
            self._actors[ref.key] = actor
            self._share_cpu(ref.group)
        if old is not None:
            self._stop(old)
        return actor

    def forget(self, instance: str) -> None:
        with self._lock:
            actor = self._actors.pop(instance, None)
        if actor is not None:
            self._stop(actor)

    def stop_all(self) -> None:
        with self._lock:
            actors, self._actors = list(self._actors.values()), {}
        for actor in actors:
            self._stop(actor)

    def _share_cpu(self, group: str) -> None:
        """Two or more ranks of ``group`` here are light ranks: their threads join the
        process's CPU share (hold ``_lock``)."""
        share = self.cpu_share
        if share is None:
            return
        ranks = [a for a in self._actors.values() if a.ref.group == group]
        if len(ranks) < 2:
            return
        for actor in ranks:
            if actor.cpu_share is None and actor.thread_id is not None:
                share.join(actor.thread_id)
                actor.cpu_share = share

    def _stop(self, actor: Actor) -> None:
        if actor.cpu_share is not None and actor.thread_id is not None:
            actor.cpu_share.leave(actor.thread_id)
            actor.cpu_share = None
        actor.stop()

    def withdraw(self, instance: str, driver: str, seq: int) -> bool:
        """Call ``seq`` must not run (its driver reported it failed); whether that is sure
        (``False``: it had already started)."""
        actor = self._actors.get(instance)
        if actor is None:  # a withdrawal for a forgotten instance must not bring it back
            return True
        return actor.skip(driver, seq)

    def close(self, instance: str, driver: str, seq: int) -> concurrent.futures.Future:
        """Destroy the instance after the calls issued before ``seq``; then forget it."""
        actor = self._actors.get(instance)
        if actor is None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(None)
            return done
        closing = actor.close(driver, seq)
        closing.add_done_callback(lambda _: self.forget(instance))
        return closing

    # -- construction ------------------------------------------------------------------------

    async def construct(
        self,
        ref: InstanceRef,
        cls: type,
        env: dict[str, str],
        call: Call,
        resolve: Callable[[tuple, dict], Awaitable[Resolved]],
    ) -> None:
        """Build the instance in a new actor, as ``call`` (method ``__init__``): its turn
        is taken at once, so calls arriving while its inputs are fetched wait behind it.
        Raises the annotated ``__init__`` error, sendable; a failed instance is forgotten."""
        actor = self.add(ref, env)
        record = self.log.begin(ref, call.key, "__init__", call.path)
        try:
            resolved = await resolve(call.args, call.kwargs)
        except BaseException as exc:
            raise self._unbuilt(ref, record, _unreadable(exc, ref, call)) from None
        await asyncio.wrap_future(self._build(actor, cls, call, record, resolved))

    def construct_now(
        self,
        ref: InstanceRef,
        cls: type,
        env: dict[str, str],
        call: Call,
        resolve: Callable[[tuple, dict], Resolved],
        own_thread: bool = True,
    ) -> concurrent.futures.Future:
        """``construct`` from a thread that must not wait: the future holds its outcome."""
        actor = self.add(ref, env, own_thread)
        record = self.log.begin(ref, call.key, "__init__", call.path)
        try:
            resolved = resolve(call.args, call.kwargs)
        except BaseException as exc:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(self._unbuilt(ref, record, _unreadable(exc, ref, call)))
            return failed
        return self._build(actor, cls, call, record, resolved)

    def _build(
        self, actor: Actor, cls: type, call: Call, record: Any, resolved: Resolved
    ) -> concurrent.futures.Future:
        args, kwargs = self._own_inputs(actor, call, record, resolved)
        built = actor.submit(call.driver, call.seq, Construct(cls, args, kwargs, record))
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        def finish(done: concurrent.futures.Future) -> None:
            error = done.exception()
            if error is not None:
                outcome.set_exception(self._unbuilt(actor.ref, record, error))
            else:
                self.log.end(record)
                outcome.set_result(None)

        built.add_done_callback(finish)
        return outcome

    # -- calls -------------------------------------------------------------------------------

    async def serve(
        self,
        call: Call,
        resolve: Callable[[tuple, dict], Awaitable[Resolved]],
        deliver: Callable[[Any], Awaitable[tuple[Any, int]]],
    ) -> Any:
        """Serve ``call`` from an event loop: the value ``deliver`` made of its result.

        ``resolve`` fetches its input futures; ``deliver`` keeps or packs the result and
        says how many bytes it kept. Raises the call's error, made sendable.
        """
        actor = self.actor(call.instance)
        record = self.log.begin(actor.ref, call.key, call.method, call.path)
        try:
            self._check_deadline(call, actor)
            resolved = await resolve(call.args, call.kwargs)
        except BaseException as exc:
            raise self._refused(actor, call, record, exc) from None
        try:
            invoke = self._invoke(actor, call, record, resolved)
            started = actor.submit(call.driver, call.seq, invoke, call.deadline)
            result = await asyncio.wrap_future(started)
            value, nbytes = await deliver(result)
        except BaseException as exc:
            self.log.end(record, exc)
            raise sendable(exc) from None
        self.log.end(record, nbytes=nbytes)
        return value

    def serve_then(
        self,
        call: Call,
        resolve: Callable[[tuple, dict], Resolved],
        deliver: Callable[[Any], Any] | None,
        answer: Done,
    ) -> None:
        """Serve ``call`` from a thread that must not wait for it (a lane's reader):
        ``answer(value, error)`` gets what ``deliver`` made of the result, in the
        instance's thread as the method returns (before its next call), or the sendable
        error (at once, in this thread, when the call is refused before it is queued)."""
        try:
            actor = self.actor(call.instance)
        except LookupError as exc:
            answer(None, exc)
            return
        log = self.log
        record = log.begin(actor.ref, call.key, call.method, call.path)
        try:
            self._check_deadline(call, actor)
            resolved = resolve(call.args, call.kwargs)
        except BaseException as exc:
            answer(None, self._refused(actor, call, record, exc))
            return

        def finish(result: Any, error: BaseException | None) -> None:
            if error is None and deliver is not None:
                try:
                    result = deliver(result)
                except BaseException as exc:
                    error = exc
            if error is not None:
                log.end(record, error)
                answer(None, sendable(error))
            else:
                log.end(record)
                answer(result, None)

        invoke = self._invoke(actor, call, record, resolved)
        actor.post(call.driver, call.seq, invoke, finish, call.deadline)

    def serve_now(
        self,
        call: Call,
        resolve: Callable[[tuple, dict], Resolved],
        deliver: Callable[[Any], Any] | None = None,
    ) -> concurrent.futures.Future:
        """``serve_then``, its outcome in a future (a task, a Ray actor call)."""
        outcome: concurrent.futures.Future = concurrent.futures.Future()
        self.serve_then(call, resolve, deliver, FutureOutcome(outcome))
        return outcome

    def _own_inputs(
        self, actor: Actor, call: Call, record: Any, resolved: Resolved
    ) -> tuple[tuple, dict]:
        """The arguments the instance may change: the producer's own objects (inputs this
        process keeps for others) replaced by copies, unless sharing was chosen."""
        record.inputs = time.time()
        args, kwargs, private = resolved
        if not private or call.share:
            return args, kwargs
        what = f"an input of {actor.ref.group}.{call.method}"
        copy = self.copy.copy
        args = tuple(copy(a, what) if i in private else a for i, a in enumerate(args))
        kwargs = {k: copy(v, what) if k in private else v for k, v in kwargs.items()}
        return args, kwargs

    def _check_deadline(self, call: Call, actor: Actor) -> None:
        if call.deadline is not None and time.time() >= call.deadline:
            raise CallTimeoutError(
                f"call {call.seq} ({call.method}) on {actor.ref.name} arrived after its "
                "hybridflow.call-timeout had passed (its driver reports it failed), so it "
                "does not run and its arguments were not read"
            )

    def _unbuilt(self, ref: InstanceRef, record: Any, exc: BaseException) -> BaseException:
        """The instance could not be built: it is forgotten, and its error can travel."""
        self.forget(ref.key)
        self.log.end(record, exc)
        return sendable(exc)

    def _refused(self, actor: Actor, call: Call, record: Any, exc: BaseException) -> BaseException:
        """The call will never run: its turn passes, so later calls go ahead."""
        actor.skip(call.driver, call.seq)
        exc = _unreadable(exc, actor.ref, call)
        self.log.end(record, exc)
        return sendable(exc)

    def _invoke(self, actor: Actor, call: Call, record: Any, resolved: Resolved) -> Invoke:
        """The job that runs ``call``: its own inputs, its result snapshotted if it
        outlives the method's return."""
        args, kwargs = self._own_inputs(actor, call, record, resolved)
        snapshot = call.result == "later" or (call.result == "kept" and not call.share)
        return Invoke(
            call.method, args, kwargs, copy=self.copy if snapshot else None, record=record
        )


def _unreadable(exc: BaseException, ref: InstanceRef, call: Call) -> BaseException:
    """``exc``, raised before ``call`` ran (reading its arguments, or its deadline):
    explained when those arguments name a module this process cannot import."""
    if isinstance(exc, ImportError):
        explain_load_error(exc, ref.slot.address, f"the arguments of {ref.group}.{call.method}")
    return exc
