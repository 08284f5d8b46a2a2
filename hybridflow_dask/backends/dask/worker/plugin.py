"""The worker side of the Dask backend: a plugin whose instances serve calls.

Each Dask worker process gets one ``InstancesPlugin`` (a ``WorkerPlugin``). Its instances
live in the backend-neutral ``hosting.Instances`` (an actor each: thread, order, loop,
environment), and every call, however it came, goes through that one flow. This module
only translates Dask's transports into calls and their outcomes back:

- **Dask's comm** (the direct path's default): the driver's message reaches a handler
  this plugin adds to the worker (``hf_call`` and friends); a non-blocking call's result
  stays in this worker's memory, registered with the scheduler as an ordinary Dask key
  (a plain one goes back in the reply instead, kept here only once the driver asks:
  ``hf_keep``), a blocking one's goes back in the reply;
- **the socket lane** (``lane_server``): blocking calls without future inputs, answered
  from the instance's thread, no event loop involved;
- **Dask tasks** (``hybridflow.call-path: task``): see ``tasks``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

from distributed.comm import CommClosedError
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize
from distributed.protocol.serialize import Serialized

from ....protocol import DataProto
from ....protocol.lazy_tensordict import import_now, imported
from ...base import InstanceRef
from ...hosting import (
    Actor,
    Call,
    Instances,
    Resolved,
    explain_load_error,
    find_free_port,
    sendable,
)
from ..config import apply_buffer_cache, ensure_defaults, freeze_gc
from ..internals import (
    add_handlers,
    dont_reply,
    enter_worker,
    fetch_keys,
    load_serialized,
    read_serialized,
    register_keys,
)
from ..wire import serialization  # noqa: F401  (workers decode tensors and DataProtos with it)
from ..wire.keys import InputKey, key_of, swap_inputs
from ..wire.lane_protocol import is_tls, lane_host
from ..wire.messages import LaneLimits, is_plain, own_framed, pack, unpack
from ..wire.row_pieces import join_results, rows_for
from ..wire.snapshot import SerializerCopy, seal
from . import rank_output
from .borrow import Borrower, Lender
from .call_log import CallLog
from .lane_server import LaneServer

__all__ = ["PLUGIN_NAME", "InstancesPlugin", "Registrar"]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "hybridflow-instances"
#: How long a fetch on the socket lane waits for the worker's event loop.
FETCH_TIMEOUT_S = 60.0
#: Threads that write fetched results to lanes (the lanes' readers never write them).
FETCH_THREADS = 2


class InstancesPlugin(WorkerPlugin):
    """Instances living in this worker process, served by the one call flow (``Instances``)."""

    name = PLUGIN_NAME
    idempotent = True

    def setup(self, worker: Any) -> None:
        ensure_defaults()  # before any setting is read here
        self.worker = worker
        #: A pool has taken this worker (``used_mark``): a fresh-processes driver restarts it.
        self.used = False
        _quiet_worker_logs(worker)
        self.calls = CallLog(worker)
        self.instances = Instances(SerializerCopy(), self.calls, enter=self._enter)
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
        self._lender = Lender(worker.data)  # kept results, lent to workers of this host
        self._borrower = Borrower(worker)
        add_handlers(worker, {"hf_lend": self._lender.lend, "hf_give_back": self._lender.give_back})
        #: What a driver's stream may ask, each answered by a coroutine (made once).
        self._ops: dict[str, Callable[..., Any]] = {
            "hf_create": self.handle_create,
            "hf_call": self.handle_call,
            "hf_calls": self.handle_calls,
            "hf_keep": self.handle_keep,
            "hf_destroy": self.handle_destroy,
            "hf_skip": _as_coroutine(self.handle_skip),
            "hf_port": _as_coroutine(self.handle_port),
            "hf_lane": _as_coroutine(self.handle_lane),
        }
        self._registrar = Registrar(worker)
        self._loop: asyncio.AbstractEventLoop = worker.loop.asyncio_loop
        self._lane: LaneServer | None = None
        self._fetchers = concurrent.futures.ThreadPoolExecutor(
            FETCH_THREADS, thread_name_prefix="hybridflow-lane-fetch"
        )
        freeze_gc()  # the worker's imported modules: no full collection scans them again
        apply_buffer_cache()

    def teardown(self, worker: Any) -> None:
        with self._lock:
            lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        self.calls.close()
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self.instances.stop_all()
        # The worker has closed; what is left is interpreter teardown, which takes a second
        # or more once torch is loaded, while the nanny waits (and, on a busy machine,
        # kills the process with a warning). Registered last, this runs first at exit.
        atexit.register(_exit_now)

    def _enter(self, actor: Actor) -> None:
        """An instance's thread belongs to the worker: ``get_worker()``, ``get_client()``
        and ``worker_client()`` work in its methods, as in a Dask actor's, and what it
        prints goes to the worker's log page."""
        enter_worker(self.worker)
        rank_output.enter(f"{actor.ref.group}[{actor.ref.rank}]", self.worker)

    # -- Dask's comm (handlers on the worker's event loop) ----------------------------------

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
        call = Call(ref.key, driver, seq, "__init__", args, kwargs, share=share, key=key)
        try:
            await self.instances.construct(ref, cls, env, call, self._resolve)
        except BaseException as exc:
            return _error_reply(exc)
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
        deadline: float | None = None,
        hold: int = 0,
    ) -> dict:
        """A call on Dask's comm: a non-blocking one's result is kept here under ``key``
        (registered with the scheduler for ``client``) unless the driver holds it (plain,
        or at most ``hold`` bytes), a blocking one's is the reply."""
        # A reply on Dask's comm is written after the instance's next call may have run.
        result: Literal["kept", "later"] = "kept" if keep else "later"
        call = Call(instance, driver, seq, method, args, kwargs, result, share, deadline, key)
        return await self._serve_on_comm(call, client, hold)

    async def handle_calls(
        self, calls: Sequence[tuple | dict], keep: bool, client: str, hold: int = 0, **msg: Any
    ) -> dict:
        """Several ranks' parts of one call on Dask's comm (the ranks this process hosts),
        each served as its own call, as ``handle_call`` serves one (parts as a lane's
        batch has them: see ``_call_of``); one reply holds each part's, in order."""
        result: Literal["kept", "later"] = "kept" if keep else "later"
        made = [_call_of(part, msg, result) for part in calls]
        rows = msg.get("rows")
        if rows is not None:  # one piece of rows for all: each rank's own copy of its rows
            for call, (start, stop) in zip(made, rows):
                call.args, call.kwargs = rows_for(call.args, call.kwargs, start, stop)
        served = (self._serve_on_comm(call, client, hold) for call in made)
        return {"status": "OK", "replies": list(await asyncio.gather(*served))}

    async def _serve_on_comm(self, call: Call, client: str, hold: int) -> dict:
        """Serve ``call``; its reply on Dask's comm: the result (``"later"``), or where
        it is kept (``"kept"``: here under its key for ``client``, or by the driver
        when plain or at most ``hold`` bytes: ``"value"``, ``"sealed"``)."""

        async def deliver(value: Any) -> tuple[dict, int]:
            if call.result != "kept":
                return {"status": "OK", "result": _payload(value, call)}, 0
            # The driver holds a plain or small result: no key here until it asks (hf_keep).
            if is_plain(value):
                return {"status": "OK", "value": value}, 0
            sealed = seal(value, _result_of(call), hold) if hold else None
            if sealed is not None:
                return {"status": "OK", "sealed": sealed}, 0
            nbytes = await self._registrar.keep(call.key, value, client)
            return {"status": "OK", "nbytes": nbytes}, nbytes

        try:
            return await self.instances.serve(call, self._resolve, deliver)
        except BaseException as exc:
            return _error_reply(exc)

    async def handle_keep(self, key: str, value: Any, client: str) -> dict:
        """Keep a result the driver held under its call's key, for ``client``:
        another process needs it now (as a later call's or a task's input)."""
        await self._registrar.keep(key, value, client)
        return {"status": "OK"}

    async def handle_destroy(self, instance: str, driver: str, seq: int) -> dict:
        await asyncio.wrap_future(self.instances.close(instance, driver, seq))
        return {"status": "OK"}

    def handle_skip(self, instance: str, driver: str, seq: int) -> dict:
        return {"status": "OK", "result": self.instances.withdraw(instance, driver, seq)}

    def handle_port(self) -> dict:
        return {"status": "OK", "result": find_free_port(self.worker.ip)}

    async def handle_stream(self, comm: Any) -> Any:
        """Serve one driver's stream: batches of messages in, batches of replies out.

        One long-lived connection per driver and worker carries every message, each with
        an ``id`` its reply repeats; replies are written as they are ready, many per write.
        Each message's serialized values are loaded by themselves: one this process
        cannot load fails that message alone (its calls withdrawn, so later ones go on).
        """
        outbox: list[dict] = []
        ready = asyncio.Event()
        tasks: set[asyncio.Task] = set()

        async def answer(msg: dict) -> None:
            ident = msg.pop("id")
            op = msg.pop("op")
            try:
                msg = await load_serialized(msg)
            except Exception as exc:  # its class's module is missing here, say
                explain_load_error(exc, self.worker.address, f"a message ({op})")
                for call in _calls_in(op, msg):  # never reach their instances: later
                    self.instances.withdraw(call.instance, call.driver, call.seq)  # go ahead
                reply = _error_reply(exc)
            else:
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
        read_serialized(comm)
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
        return dont_reply()

    async def _resolve(self, args: tuple, kwargs: dict) -> Resolved:
        """Input futures (``InputKey``s) replaced by their values; the arguments that
        hold a value this worker already kept (a colocated producer's) are named, so the
        call flow copies them (values fetched from elsewhere are this call's own)."""
        keys = _input_keys(args) + _input_keys(kwargs)
        if not keys:
            return args, kwargs, ()
        if not imported():  # decoding a batch would import tensordict on this loop
            await asyncio.get_running_loop().run_in_executor(None, import_now)
        local = {k for k in keys if k in self.worker.data}
        values = await fetch_keys(self.worker, keys, self._borrower.borrow)
        private = {
            name
            for name, value in (*enumerate(args), *kwargs.items())
            if local.intersection(_input_keys((value,)))
        }

        def swap(value: Any) -> Any:
            return values[value.key] if isinstance(value, InputKey) else value

        return swap_inputs(args, swap), swap_inputs(kwargs, swap), private

    # -- the socket lane (its reader's thread, then the instance's) -------------------------

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
        return {"status": "OK", "result": (lane.port, *lane.token_for(driver), lane.local_name)}

    def lane_message(self, msg: dict, reply: Callable[[dict], None]) -> None:
        """Called by the lane's reading thread, which must go back to reading at once: a
        fetch's reply is written by a fetch thread, a call's by its instance's thread."""
        op = msg.get("op")
        if op == "fetch":
            self._fetchers.submit(self.lane_fetch, msg, reply)
        elif op == "calls":
            self.lane_calls(msg, reply)
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
        """A blocking call from the lane, without future inputs: its arguments are read
        (from the driver's memory, on the same host) only if its deadline has not passed,
        and its reply is written from the instance's thread before its next call runs, so
        the result needs no snapshot."""
        ident = msg["id"]
        call = _call_of(msg, msg, "now")

        def answer(value: Any, error: BaseException | None) -> None:
            if error is not None:
                reply(_lane_error(ident, error))
            else:
                reply({"id": ident, "status": "OK", "result": value})

        self.instances.serve_then(call, _unpacked, lambda value: _payload(value, call), answer)

    def lane_calls(self, msg: dict, reply: Callable[[dict], None]) -> None:
        """Several ranks' parts of one blocking call (the ranks this process hosts), each
        served by the one call flow as its own call, answered together once the last has
        returned. Each result is therefore copied as its method returns (unless plain),
        since its instance may run its next call before the reply is written; a rank given
        the arguments all share (``args``/``kwargs`` at the batch's top) reads them from
        frames of its own, so no two instances hold the same objects. The ranks of a piece
        of rows (``wire.row_pieces``) that all return a ``DataProto`` answer with their rows
        joined and packed once, and each rank's bounds and ``meta_info``."""
        parts = msg["calls"]
        rows = msg.get("rows")
        calls = [_call_of(part, msg, "later") for part in parts]
        values: list[Any] = [None] * len(parts)
        errors: dict[int, BaseException] = {}
        left = [len(parts)]
        lock = threading.Lock()

        def answered(index: int, value: Any, error: BaseException | None) -> None:
            with lock:
                if error is None:
                    values[index] = value
                else:
                    errors[index] = error
                left[0] -= 1
                if left[0]:
                    return
            if rows is not None:
                joined = _joined(values, calls) if not errors else None
                if joined is not None:
                    reply({"id": msg["id"], "status": "OK", **joined})
                    return
                _pack_each(values, calls, errors)
            # Every part's value plain: the reply is just the values (no dict per rank to
            # write, read and walk on the way).
            if not errors and all(map(_plain, values)):
                reply({"id": msg["id"], "status": "OK", "results": values})
                return
            replies = [
                {"status": "error", "exception": errors[i]}
                if i in errors
                else {"status": "OK", "result": value}
                for i, value in enumerate(values)
            ]
            reply({"id": msg["id"], "status": "OK", "replies": replies})

        piece = _Piece()
        for index, (part, call) in enumerate(zip(parts, calls)):
            shared = type(part) is tuple  # (instance, seq, key): the batch's arguments
            # Each part is read (in this thread) before it is handed to its instance, so
            # the frames themselves go to the last part: every copy is made before any
            # instance that could change them in place has them.
            resolve = _unpacked if not shared or index == len(parts) - 1 else _unpacked_own
            deliver = functools.partial(_payload, call=call)
            if rows is not None:  # each rank's own copy of its rows of the piece
                resolve = functools.partial(piece.rows, *rows[index])
                deliver = functools.partial(_payload_or_rows, call=call)
            self.instances.serve_then(call, resolve, deliver, functools.partial(answered, index))


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


def _error_reply(exc: BaseException) -> dict:
    return {"status": "error", "exception": to_serialize(sendable(exc))}


def _lane_error(ident: int, exc: BaseException) -> dict:
    """A socket-lane reply carrying ``exc`` (the lane pickles it as it is)."""
    return {"id": ident, "status": "error", "exception": sendable(exc)}


def _input_keys(values: Any) -> list[str]:
    """The keys of the input futures among a call's arguments."""
    keys: list[str] = []
    swap_inputs(values, lambda v: keys.append(v.key) if isinstance(v, InputKey) else None)
    return keys


def _call_of(part: dict | tuple, msg: dict, result: Literal["now", "later", "kept"]) -> Call:
    """The call a lane message carries (``part`` is ``msg``), or one part of a batch (on
    a lane, or on Dask's comm): the driver, method, deadline and sharing are the
    message's; the instance, number, key and arguments the part's, where a part sharing
    its arguments with the others (the batch's ``args``/``kwargs``) is the tuple
    ``(instance, seq, index)``, its key the call's ``index``-th (``msg["keys"]``: see
    ``KeyRun``)."""
    if isinstance(part, dict):
        instance, seq, key = part["instance"], part["seq"], part["key"]
        args, kwargs = part["args"], part["kwargs"]
    else:  # (a tuple, or a list as some decoders make one)
        instance, seq, index = part
        key = key_of(msg["keys"], index)
        args, kwargs = msg["args"], msg["kwargs"]
    return Call(
        instance,
        msg["driver"],
        seq,
        msg["method"],
        args,
        kwargs,
        result=result,
        share=msg.get("share", False),
        deadline=msg.get("deadline"),
        key=key,
    )


def _calls_in(op: str, msg: dict) -> list[Call]:
    """The calls a stream message carries, each numbered on its instance (none but in a
    call's or a batch's message)."""
    if op == "hf_call":
        return [Call(msg["instance"], msg["driver"], msg["seq"], msg["method"], (), {})]
    if op == "hf_calls":
        return [_call_of(part, msg, "later") for part in msg["calls"]]
    return []


def _unpacked(args: Any, kwargs: Any) -> Resolved:
    """A lane call's arguments, read from its message (and the driver's memory)."""
    return unpack(args), unpack(kwargs), ()


def _unpacked_own(args: Any, kwargs: Any) -> Resolved:
    """Arguments another rank of the batch reads too, from copies of their frames."""
    return unpack(own_framed(args)), unpack(own_framed(kwargs)), ()


class _Piece:
    """A lane batch's piece of rows (``wire.row_pieces``), read once, by the first rank
    whose call is still in time (in the lane's reading thread, as each part's arguments
    are); every rank then copies its own rows out of it."""

    def __init__(self) -> None:
        self._read: tuple[tuple, dict] | None = None

    def rows(self, start: int, stop: int, args: Any, kwargs: Any) -> Resolved:
        if self._read is None:
            self._read = (unpack(args), unpack(kwargs))
        return (*rows_for(*self._read, start, stop), ())


def _payload_or_rows(result: Any, call: Call) -> Any:
    """A result of a piece's rank: a ``DataProto`` as it is (its snapshot, to be joined
    with the other ranks'), anything else as ``_payload`` makes it."""
    return result if type(result) is DataProto else _payload(result, call)


def _joined(values: list[Any], calls: list[Call]) -> dict | None:
    """A piece's reply with its ranks' results joined (``join_results``) and packed once,
    or ``None`` when they do not join or cannot travel together."""
    joined = join_results(values)
    if joined is None:
        return None
    try:
        packed = pack(joined[:2], _result_of(calls[0]), back=True)
    except Exception:  # (a meta_info that cannot travel: said rank by rank)
        return None
    return {"joined": packed, "bounds": joined[2]}


def _pack_each(values: list[Any], calls: list[Call], errors: dict) -> None:
    """The ``DataProto`` results of a piece that is not answered joined, each packed by
    itself (as ``_payload`` packs any other result), or its rank's error."""
    for index, (value, call) in enumerate(zip(values, calls)):
        if type(value) is DataProto:
            try:
                values[index] = _payload(value, call)
            except Exception as exc:
                errors[index] = sendable(exc)


def _plain(payload: Any) -> bool:
    """Whether a result as ``_payload`` made it travels as it is (not serialized)."""
    return not isinstance(payload, Serialized)


def _payload(result: Any, call: Call) -> Any:
    """A blocking call's result as its reply carries it: plain, or serialized here (so a
    result that cannot travel is an error for its caller, not a broken stream)."""
    if is_plain(result):
        return result
    return pack(result, _result_of(call), back=True)


def _result_of(call: Call) -> str:
    return f"the result of {call.method} on {call.instance.split('#')[0]}"
