"""The worker side of the Dask backend: a plugin that hosts instances as actors.

Each Dask worker process gets one ``InstanceHost`` (a ``WorkerPlugin``). It keeps an
``Actor`` per instance (its own thread, loop, call order and environment; see ``actor``)
and takes calls two ways, both into the same per-instance order:

- **direct** (the default path): the driver's message reaches a handler this plugin adds
  to the worker (``hf_call`` and friends). The handler runs on the worker's event loop
  only long enough to fetch inputs and hand the call to the actor; a blocking call's
  result goes back in the reply, a non-blocking one stays in this worker's memory,
  registered with the scheduler as an ordinary Dask key. Blocking calls without future
  inputs skip the event loop altogether: they arrive on the plugin's socket lane
  (``lane_server``) and their replies leave from the actor's thread;
- **task** (``hybridflow.call-path: task``): the call is a Dask task pinned to this worker
  (``tasks.run_call``) that hands the call to the actor and waits off the worker's pool.

Inputs that were already in this process (a colocated producer's result) are copied
before the method sees them, so a consumer changing its input in place never changes the
producer's stored result (``hybridflow.share-colocated-inputs`` turns that off).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from distributed.comm import CommClosedError
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize

from ...base import InstanceRef
from ...hosting import find_free_port, sendable
from ..config import apply_buffer_cache, freeze_gc
from ..internals import add_handlers, fetch_keys, register_keys
from ..wire import serialization  # noqa: F401  (workers decode tensors and DataProtos with it)
from ..wire.keys import InputKey, swap_inputs
from ..wire.lane_protocol import is_tls, lane_host
from ..wire.messages import LaneLimits, is_plain, pack, unpack
from ..wire.snapshot import snapshot
from .actor import Actor, EnvGate
from .call_log import CallLog
from .jobs import Construct, Invoke
from .lane_server import LaneServer

__all__ = ["PLUGIN_NAME", "InstanceHost", "Registrar"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "hybridflow-host"
#: How long a fetch on the socket lane waits for the worker's event loop.
FETCH_TIMEOUT_S = 60.0
#: Threads that write fetched results to lanes (the lanes' readers never write them).
FETCH_THREADS = 2


class InstanceHost(WorkerPlugin):
    """Instances living in this worker process, each hosted by its ``Actor``."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        _quiet_worker_logs(worker)
        self.actors: dict[str, Actor] = {}
        self.gate = EnvGate()
        self._lock = threading.Lock()
        add_handlers(
            worker,
            {
                "hf_create": self.handle_create,
                "hf_call": self.handle_call,
                "hf_destroy": self.handle_destroy,
                "hf_skip": self.handle_skip,
                "hf_port": self.handle_port,
                "hf_lane": self.handle_lane,
                "hf_stream": self.handle_stream,
            },
        )
        self._registrar = Registrar(worker)
        self.calls = CallLog(worker)
        self._loop: asyncio.AbstractEventLoop = worker.loop.asyncio_loop
        self._lane: LaneServer | None = None
        self._fetchers = concurrent.futures.ThreadPoolExecutor(
            FETCH_THREADS, thread_name_prefix="hybridflow-lane-fetch"
        )
        freeze_gc()  # the worker's imported modules: no full collection scans them again
        apply_buffer_cache()

    def teardown(self, worker: Any) -> None:
        with self._lock:
            actors, self.actors = list(self.actors.values()), {}
            lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        self.calls.close()
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        for actor in actors:
            actor.stop()
        # The worker has closed; what is left is interpreter teardown, which takes a second
        # or more once torch is loaded, while the nanny waits (and, on a busy machine,
        # kills the process with a warning). Registered last, this runs first at exit.
        atexit.register(_exit_now)

    # -- the table -------------------------------------------------------------------------

    def actor(self, instance: str) -> Actor:
        try:
            return self.actors[instance]
        except KeyError:
            raise LookupError(
                f"instance {instance.split('#')[0]!r} is not in this worker process: its group "
                "was shut down, or the worker restarted (see WorkerGroup.recover)"
            ) from None

    def new_actor(self, ref: InstanceRef, env: dict[str, str]) -> Actor:
        actor = Actor(ref, env, self.gate, self.worker)
        with self._lock:
            old = self.actors.pop(ref.key, None)
            self.actors[ref.key] = actor
        if old is not None:
            old.stop()
        return actor

    def forget(self, instance: str) -> None:
        with self._lock:
            actor = self.actors.pop(instance, None)
        if actor is not None:
            actor.stop()

    def skip(self, instance: str, driver: str, seq: int) -> bool:
        """Withdraw a call; whether it is sure not to run (see ``Actor.skip``)."""
        actor = self.actors.get(instance)
        if actor is None:  # a skip for a forgotten instance must not bring it back
            return True
        return actor.skip(driver, seq)

    # -- the direct path's handlers (the worker's event loop) ------------------------------

    async def handle_create(
        self,
        ref: InstanceRef,
        cls: type,
        args: tuple,
        kwargs: dict,
        env: dict,
        driver: str,
        seq: int,
        key: str = "",
        share: bool = False,
    ) -> dict:
        actor = self.new_actor(ref, env)
        record = self.calls.begin(ref, key, "__init__")
        try:
            args, kwargs = await self._resolve(args, kwargs, share)
            record.inputs = time.time()
            await _wrap(actor.submit(driver, seq, Construct(cls, args, kwargs, record)))
        except BaseException as exc:
            self.forget(ref.key)
            self.calls.end(record, exc)
            return _error_reply(exc)
        self.calls.end(record)
        return {"status": "OK"}

    async def handle_call(
        self,
        instance: str,
        driver: str,
        seq: int,
        method: str,
        args: tuple,
        kwargs: dict,
        key: str,
        keep: bool,
        client: str,
        share: bool = False,
    ) -> dict:
        try:
            actor = self.actor(instance)
        except LookupError as exc:
            return _error_reply(exc)
        record = self.calls.begin(actor.ref, key, method)
        try:
            args, kwargs = await self._resolve(args, kwargs, share)
        except BaseException as exc:
            actor.skip(driver, seq)
            self.calls.end(record, exc)
            return _error_reply(exc)
        record.inputs = time.time()
        try:
            # Kept by reference only where the driver chose to share colocated results.
            invoke = Invoke(method, args, kwargs, snapshot=not (keep and share), record=record)
            result = await _wrap(actor.submit(driver, seq, invoke))
        except BaseException as exc:
            self.calls.end(record, exc)
            return _error_reply(exc)
        if keep:
            nbytes = await self._registrar.keep(key, result, client)
            self.calls.end(record, nbytes=nbytes)
            if is_plain(result):  # the driver keeps a copy: gathering it costs no fetch
                return {"status": "OK", "nbytes": nbytes, "value": result}
            return {"status": "OK", "nbytes": nbytes}
        try:
            payload = _payload(result, actor, method)
        except TypeError as exc:
            self.calls.end(record, exc)
            return _error_reply(exc)
        self.calls.end(record)
        return {"status": "OK", "result": payload}

    async def handle_destroy(self, instance: str, driver: str, seq: int) -> dict:
        actor = self.actors.get(instance)
        if actor is not None:
            try:
                await _wrap(actor.close(driver, seq))
            finally:
                self.forget(instance)
        return {"status": "OK"}

    async def handle_stream(self, comm: Any) -> Any:
        """Serve one driver's stream: batches of messages in, batches of replies out.

        One long-lived connection per driver and worker carries every message, each with
        an ``id`` its reply repeats; replies are written as they are ready, many per write.
        """
        outbox: list[dict] = []
        ready = asyncio.Event()
        tasks: set[asyncio.Task] = set()

        async def answer(msg: dict) -> None:
            ident = msg.pop("id")
            op = msg.pop("op")
            try:
                reply = await self._ops[op](**msg)
            except Exception as exc:  # a bug on our side: the caller still gets an answer
                reply = _error_reply(exc)
            reply["id"] = ident
            outbox.append(reply)
            ready.set()

        async def write() -> None:
            while True:
                await ready.wait()
                ready.clear()
                batch = outbox[:]
                del outbox[:]
                await comm.write(batch)

        writer = asyncio.ensure_future(write())
        try:
            while True:
                try:
                    msgs = await comm.read()
                except CommClosedError:
                    break
                for msg in msgs:
                    task = asyncio.ensure_future(answer(msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        finally:
            writer.cancel()
        return Status.dont_reply

    @property
    def _ops(self) -> dict[str, Any]:
        return {
            "hf_create": self.handle_create,
            "hf_call": self.handle_call,
            "hf_destroy": self.handle_destroy,
            "hf_skip": _as_coroutine(self.handle_skip),
            "hf_port": _as_coroutine(self.handle_port),
            "hf_lane": _as_coroutine(self.handle_lane),
        }

    def handle_lane(self, driver: str = "") -> dict:
        """Where this worker's socket lane listens (started on first use), and the token
        ``driver`` is to prove when it opens lanes there (its own: see
        ``wire.lane_protocol``); ``None`` when the worker's comm is neither TCP nor TLS."""
        host = lane_host(self.worker.address)
        if host is None:
            return {"status": "OK", "result": None}
        with self._lock:
            if self._lane is None:
                tls = None
                if is_tls(self.worker.address):  # the cluster's own certificates
                    tls = self.worker.security.get_listen_args("worker")["ssl_context"]
                self._lane = LaneServer(
                    host, self.lane_message, limits=LaneLimits.from_config(), tls=tls
                )
            lane = self._lane
        return {"status": "OK", "result": (lane.port, *lane.token_for(driver))}

    # -- the socket lane (its connection's thread, then the actor's) ------------------------

    def lane_message(self, msg: dict, reply: Callable[[dict], None]) -> None:
        """Called by the lane's reading thread, which must go back to reading at once: a
        fetch's reply is written by a fetch thread, a call's by its instance's thread."""
        if msg.get("op") == "fetch":
            self._fetchers.submit(self.lane_fetch, msg, reply)
        else:
            self.lane_call(msg, reply)

    def lane_fetch(self, msg: dict, reply: Callable[[dict], None]) -> None:
        """Results this worker holds, taken from its memory on its event loop (where Dask
        touches it) and written from the lane's thread, so a large reply never holds up
        the loop. Keys it no longer holds are left out; the driver asks Dask for those."""
        keys = msg["keys"]

        async def held() -> dict:
            data = self.worker.data
            return {key: data[key] for key in keys if key in data}

        try:
            values = asyncio.run_coroutine_threadsafe(held(), self._loop).result(FETCH_TIMEOUT_S)
            payload = pack(values, "the fetched results", back=True)
        except BaseException as exc:
            reply(_lane_error(msg["id"], exc))
            return
        reply({"id": msg["id"], "status": "OK", "result": payload})

    def lane_call(self, msg: dict, reply: Callable[[dict], None]) -> None:
        """A blocking call from the lane: handed to the actor; answered from its thread."""
        ident, driver, seq, method = msg["id"], msg["driver"], msg["seq"], msg["method"]

        def fail(exc: BaseException) -> None:
            reply(_lane_error(ident, exc))

        try:
            actor = self.actor(msg["instance"])
        except LookupError as exc:
            fail(exc)
            return
        record = self.calls.begin(actor.ref, msg["key"], method)
        try:
            args, kwargs = unpack(msg["args"]), unpack(msg["kwargs"])
        except BaseException as exc:
            actor.skip(driver, seq)
            fail(exc)
            self.calls.end(record, exc)
            return
        record.inputs = time.time()

        def answer(done: Any) -> None:
            error = done.exception()
            if error is None:
                try:
                    payload = _payload(done.result(), actor, method)
                except TypeError as exc:
                    error = exc
            if error is not None:
                fail(error)
            else:
                reply({"id": ident, "status": "OK", "result": payload})
            self.calls.end(record, error)

        # The reply is written (or its frames released) from the instance's thread before
        # the next call runs: no snapshot needed.
        invoke = Invoke(method, args, kwargs, snapshot=False, record=record)
        actor.submit(driver, seq, invoke).add_done_callback(answer)

    def handle_port(self) -> dict:
        return {"status": "OK", "result": find_free_port(self.worker.ip)}

    def handle_skip(self, instance: str, driver: str, seq: int) -> dict:
        return {"status": "OK", "result": self.skip(instance, driver, seq)}

    async def _resolve(self, args: tuple, kwargs: dict, share: bool) -> tuple[tuple, dict]:
        keys: list[str] = []
        swap_inputs(args, lambda v: keys.append(v.key) if isinstance(v, InputKey) else None)
        swap_inputs(kwargs, lambda v: keys.append(v.key) if isinstance(v, InputKey) else None)
        if not keys:
            return args, kwargs
        local = {k for k in keys if k in self.worker.data}
        values = await fetch_keys(self.worker, keys)

        def swap(value: Any) -> Any:
            if not isinstance(value, InputKey):
                return value
            found = values[value.key]
            if share or value.key not in local:
                return found
            return snapshot(found, f"the input {value.key}")  # the producer's: a copy

        return swap_inputs(args, swap), swap_inputs(kwargs, swap)


class Registrar:
    """Keeps results in the worker's memory and registers them with the scheduler in batches.

    A result must be known to the scheduler before the driver may use its future, so each
    kept result waits for a registration; all those finished by one turn of the event
    loop are stored with one ``update_data`` call (one pass of the worker's state machine)
    and registered with one message to the scheduler, instead of paying for each.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._values: dict[str, Any] = {}
        self._owners: dict[str, str] = {}  # key -> id of the client that wants it
        self._waiters: dict[str, asyncio.Future] = {}

    async def keep(self, key: str, value: Any, client: str) -> int:
        """Store ``value`` under ``key`` for ``client``; its size once registered."""
        if not self._waiters:
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush()))
        self._values[key] = value
        self._owners[key] = client
        waiter = self._waiters[key] = asyncio.get_running_loop().create_future()
        return await waiter

    async def _flush(self) -> None:
        values, self._values = self._values, {}
        owners, self._owners = self._owners, {}
        waiters, self._waiters = self._waiters, {}
        try:
            nbytes = self.worker.update_data(data=values)["nbytes"]
            by_client: dict[str, dict[str, int]] = {}
            for key, client in owners.items():
                by_client.setdefault(client, {})[key] = nbytes[key]
            for client, sizes in by_client.items():
                await register_keys(self.worker, sizes, client)
        except BaseException as exc:
            for waiter in waiters.values():
                if not waiter.done():
                    waiter.set_exception(exc)
            raise
        for key, waiter in waiters.items():
            if not waiter.done():
                waiter.set_result(nbytes[key])


def _as_coroutine(fn: Callable[..., Any]) -> Callable[..., Any]:
    async def run(**kwargs: Any) -> Any:
        return fn(**kwargs)

    return run


class _UserErrorFilter(logging.Filter):
    """Drops Dask's "Compute Failed" report for our call tasks: a method's exception is
    re-raised once, in the driver, naming the group, method and rank. Dask's own errors
    (a dead worker, a failed transfer) still show."""

    TASKS = ("run_call", "create_instance", "destroy_instance")

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Compute Failed"):
            return True
        task = (
            str(record.args[2]) if isinstance(record.args, tuple) and len(record.args) > 2 else ""
        )
        return not any(name in task for name in self.TASKS)


_CLOSING = frozenset({Status.closing, Status.closing_gracefully, Status.closed, Status.failed})


class _ClosingHeartbeatFilter(logging.Filter):
    """Drops the heartbeat error of a worker that is itself closing.

    When a cluster shuts down, a worker's heartbeat can be in flight as the scheduler
    goes: Dask logs a traceback for it although nothing is wrong. A heartbeat failing
    while the worker is running still shows.
    """

    def __init__(self, worker: Any) -> None:
        super().__init__()
        self._worker = weakref.ref(worker)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Failed to communicate with scheduler"):
            return True
        worker = self._worker()
        return worker is not None and worker.status not in _CLOSING


def _quiet_worker_logs(worker: Any) -> None:
    worker_logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, _UserErrorFilter) for f in worker_logger.filters):
        worker_logger.addFilter(_UserErrorFilter())
    if not any(isinstance(f, _ClosingHeartbeatFilter) for f in worker_logger.filters):
        worker_logger.addFilter(_ClosingHeartbeatFilter(worker))


def _exit_now() -> None:
    """End a closed worker's process without tearing down every module."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


async def _wrap(future: Any) -> Any:
    return await asyncio.wrap_future(future)


def _error_reply(exc: BaseException) -> dict:
    return {"status": "error", "exception": to_serialize(sendable(exc))}


def _lane_error(ident: int, exc: BaseException) -> dict:
    """A socket-lane reply carrying ``exc`` (the lane pickles it as it is)."""
    return {"id": ident, "status": "error", "exception": sendable(exc)}


def _payload(result: Any, actor: Actor, method: str) -> Any:
    """A blocking call's result as its reply carries it: plain, or serialized here (so a
    result that cannot travel is an error for its caller, not a broken stream)."""
    if is_plain(result):
        return result
    ref = actor.ref
    return pack(result, f"the result of {ref.group}.{method} (rank {ref.rank})", back=True)
