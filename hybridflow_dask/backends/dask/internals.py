"""Every private Dask API the backend uses, in one place, each behind one small function.

The direct call path needs things no public API offers: a worker answering our own
messages (its comm handler table), a result kept in a worker's memory and made known to
the scheduler as the result of a call (``Worker.update_data`` + ``Scheduler.update_data``,
what ``Client.scatter`` does inside a task), a driver-side ``Future`` for a key that is not
computed yet whose outcome we set ourselves (the client's ``FutureState``), and pulling a
key from the worker that holds it (``get_data_from_worker``). ``materialize_futures=False``
needs a future that travelled inside an argument to work in the worker's client
(``Client._send_to_scheduler``). Released futures of calls are forgotten by the client
in batches (``Releases``: the client's reference counts). A worker reads a driver's
stream with its values still serialized, so that one it cannot load fails its own
message, not the stream (``read_serialized``, ``load_serialized``). The driver's own
streams and, on a cluster it starts, the scheduler's keep shorter logs of recent messages
(``cap_message_log``). On the scheduler, the dashboard page reads the published
datasets, draws calls in Dask's task stream and adds a tab to Dask's navigation bar; an
owned cluster overrides two ``SpecCluster`` methods, and its nannies start their worker
processes from a fork server (``ForkserverNanny``). The list of workers is asked of the
scheduler itself (``workers_of``): the client's cached answer races the client's own
refresh. ``tests/dask/test_dask_internals.py`` (the fork server: ``test_worker_start.py``)
exercises each one for real and fails loudly when a Dask release changes it;
``pyproject.toml`` bounds ``distributed`` to the versions it passed on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import struct
import sys
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

import dask.config
from distributed import Future, Nanny
from distributed.comm.utils import OFFLOAD_THRESHOLD
from distributed.deploy.cluster import Cluster
from distributed.diagnostics.task_stream import TaskStreamPlugin
from distributed.protocol.compression import decompress
from distributed.protocol.serialize import Serialized, merge_and_deserialize
from distributed.utils import get_mp_context, nbytes, offload
from distributed.worker import _worker_cvar, get_data_from_worker

__all__ = [
    "ForkserverNanny",
    "Releases",
    "add_dashboard_page",
    "add_handlers",
    "adopt_future",
    "cap_message_log",
    "dont_reply",
    "enter_worker",
    "fail_future",
    "fetch_keys",
    "finish_future",
    "future_state",
    "keep_task_stream",
    "load_serialized",
    "owned_cluster_class",
    "pending_future",
    "published_datasets",
    "published_value",
    "read_serialized",
    "record_finished_task",
    "register_keys",
    "reset_comm",
    "scheduler_streams",
    "start_fork_server",
    "submit_as",
    "wait_all",
    "wait_future",
    "worker_id_of",
    "workers_of",
]

#: How often ``fetch_keys`` asks a busy holder again.
BUSY_RETRY_S = 0.01


def adopt_future(client: Any, key: Any) -> Future:
    """A ``Future`` for ``key`` bound to ``client`` (the scheduler keeps the key for it)."""
    future = Future(key, client)
    client._send_to_scheduler({"op": "client-desires-keys", "keys": [key], "client": client.id})
    return future


def cap_message_log(stream: Any, maxlen: int) -> None:
    """Keep at most ``maxlen`` recent batches in ``stream``'s debugging log (a
    ``BatchedSend``'s ``recent_message_log``, sized by Dask's
    ``distributed.admin.low-level-log-length`` when the stream was made)."""
    log = getattr(stream, "recent_message_log", None)
    if isinstance(log, collections.deque) and log.maxlen != maxlen:
        stream.recent_message_log = collections.deque(log, maxlen=maxlen)


def scheduler_streams(scheduler: Any, worker: str | None = None) -> list[Any]:
    """The scheduler's batched streams: to ``worker`` only, or to every worker and client."""
    if worker is not None:
        return [s for s in [scheduler.stream_comms.get(worker)] if s is not None]
    return [*scheduler.stream_comms.values(), *scheduler.client_comms.values()]


def workers_of(client: Any) -> dict[str, dict]:
    """Every worker the scheduler knows, asked for now.

    ``Client.scheduler_info(n_workers=-1)`` fetches the workers into a cache it then reads,
    and the client's periodic refresh (which fetches no workers) can overwrite that cache in
    between: about one call in twenty answered "no workers" with a refresh every 5 ms.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


async def worker_id_of(client: Any, address: str, timeout: float) -> str | None:
    """The id of the worker process at ``address`` (``Worker.id``, one per incarnation),
    asked of the worker itself through the client's connection pool; ``None`` when it
    does not answer within ``timeout``."""
    try:
        info = await asyncio.wait_for(client.rpc(address).identity(), timeout)
    except Exception:
        return None
    return info.get("id") if isinstance(info, dict) else None


def dont_reply() -> Any:
    """What a comm handler returns when it answers on the stream itself (``Status``'s
    member for it is not part of Dask's documented API)."""
    from distributed.core import Status

    return Status.dont_reply


def add_handlers(worker: Any, handlers: dict[str, Callable[..., Any]]) -> None:
    """Let ``worker`` answer messages whose ``op`` is one of ``handlers``' names."""
    worker.handlers.update(handlers)


def add_dashboard_page(scheduler: Any, route: str) -> bool:
    """Add ``route`` to the navigation bar of the scheduler's dashboard pages (idempotent).

    Dask's pages draw their tabs from one list per scheduler (``template_variables``),
    read each time a page is rendered. Whether it was added (``False``: no dashboard).
    """
    try:
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # the dashboard needs bokeh, an optional dependency
        return False
    pages = template_variables(scheduler)["pages"]
    if route not in pages:
        pages.append(route)
    return True


def owned_cluster_class(base: type, worker_prefix: str = "") -> type:
    """A subclass of the cluster class ``base`` for a cluster the backend owns: it never
    closes a nanny because its worker left the scheduler for a while, and (with
    ``worker_prefix``) names its workers ``<prefix><n>`` in the dashboard.

    ``SpecCluster._update_worker_status`` closes a worker's nanny when, ``lost-worker-
    timeout`` (15 s) after the worker left, no worker of that name is connected. A worker
    restarted again within those 15 s (fresh processes for each new pool) can be
    mid-restart at that instant: its nanny was closed and the cluster lost the slot for
    good (reproduced: about one restart in five, each wait 60-120 s). On an owned local
    cluster every worker has a live nanny that starts it again, so nothing needs that cull.
    """

    def _update_worker_status(self: Any, op: str, msg: Any) -> None:
        if op == "remove":
            Cluster._update_worker_status(self, op, msg)  # the bookkeeping, not the cull
        else:
            base._update_worker_status(self, op, msg)  # type: ignore[attr-defined]

    methods: dict[str, Any] = {"_update_worker_status": _update_worker_status}
    if worker_prefix:
        methods["_new_worker_name"] = lambda self, number: f"{worker_prefix}{number}"
    owned = type(f"Owned{base.__name__}", (base,), methods)
    return owned


#: Dask's setting for how a nanny starts its worker process ("spawn" by default).
START_METHOD = "distributed.worker.multiprocessing-method"


class ForkserverNanny(Nanny):
    """A nanny whose worker process is forked from multiprocessing's fork server, which
    imported ``preload_once`` once for every worker, instead of spawned as a fresh
    interpreter that imports them again (~2 s of torch and Dask per worker here). With an
    empty ``preload_once`` it is Dask's own nanny.

    Dask has no per-nanny start method: ``WorkerProcess.start`` reads it from the global
    config as it starts a process (``get_mp_context``). So these nannies put
    ``forkserver``, and their list of modules, in force only while one of them starts
    its process, and only over Dask's default ``spawn`` (a count under a lock: several
    start at once, on one cluster's loop or several); a start method the user chose is
    theirs, and so is a fork server's list. A process forked from the server has the
    server's environment, so each worker is given the driver's environment as it is at
    that moment, as a spawned one would have (below the nanny's own ``env``, which wins).
    """

    _lock = threading.Lock()
    _starting = 0  # these nannies starting a process under the forkserver they put in force

    def __init__(
        self,
        *args: Any,
        preload_once: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # ``settings``: Dask settings in force while the nanny is made (a server reads how
        # often to check its event loop then); its worker's are the nanny's ``config``.
        with dask.config.set(dict(settings or {})):
            super().__init__(*args, **kwargs)
        self._modules = list(preload_once)
        self._own_env: dict[str, str] = dict(self.env)

    async def instantiate(self) -> Any:
        if not self._modules:
            return await super().instantiate()
        env = {**os.environ, **self._own_env}
        self.env = env
        if self.process is not None:  # a restart starts the same ``WorkerProcess`` again
            self.process.env = env
        cls = ForkserverNanny
        with cls._lock:
            ours = cls._starting > 0 or _owns_start_method()
            if ours:
                if cls._starting == 0:
                    dask.config.set({START_METHOD: "forkserver"})
                cls._starting += 1
        if not ours:
            return await super().instantiate()
        try:
            # (Dask's first call under forkserver sets its own list; ours replaces it. A
            # list only matters until the server starts, with the first worker.)
            get_mp_context().set_forkserver_preload(self._modules)
            return await super().instantiate()
        finally:
            with cls._lock:
                cls._starting -= 1
                if cls._starting == 0:
                    dask.config.set({START_METHOD: "spawn"})


def _owns_start_method() -> bool:
    """Whether Dask's start method is still its default, ours to change while we start."""
    return dask.config.get(START_METHOD) == "spawn"


def start_fork_server(modules: Sequence[str]) -> None:
    """Start the server ``ForkserverNanny``s fork from now (a cluster of them is about to
    start): its imports then run while the scheduler starts (~0.5-0.8 s with its
    dashboard), instead of after it, when the first nanny starts its process. It starts
    in the environment that nanny would have put in place first (Dask's
    ``pre-spawn-environ``, one thread per numeric library, and its hash seed: what a
    nanny's ``pre_spawn_env`` holds), since the libraries it preloads read theirs as they
    are imported. A server already running is left as it is, and so is a start method
    the user chose."""
    if not modules or not _owns_start_method():
        return
    wanted = dask.config.get("distributed.nanny.pre-spawn-environ") or {}
    env = {str(k): os.environ.get(str(k), str(v)) for k, v in wanted.items()}
    if env.get("PYTHONHASHSEED") in (None, "0"):
        env["PYTHONHASHSEED"] = "6640"  # Dask's seed for its workers
    os.environ.update(env)  # (as every nanny does before it starts a process)
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(modules))
    multiprocessing.forkserver.ensure_running()


def published_value(client: Any, name: str, default: Any) -> Any:
    """The dataset published as ``name`` (``default`` if none), read from the scheduler.

    ``Client.get_dataset`` does this and then tells the scheduler again of every key the
    client holds (to rebind futures inside a dataset); the scheduler warns ("desires key
    ... but key is unknown") for each key it does not know yet, such as a non-blocking
    call's result still on its way or one whose call failed. Our datasets hold no futures.
    """
    out = client.sync(client.scheduler.publish_get, names=[name])[0]
    return default if out is None else out["data"]


def published_datasets(scheduler: Any) -> dict[Any, Any]:
    """The datasets clients published, as the scheduler keeps them (``{"data": ...}``)."""
    publish = scheduler.extensions.get("publish")
    return publish.datasets if publish is not None else {}


def keep_task_stream(scheduler: Any, maxlen: int | None = None) -> None:
    """Start the task stream's records now (the dashboard starts them when it first draws
    the stream), so calls made before anyone opened the page are in it; ``maxlen`` records
    at most (``None``: Dask's own task-stream lengths)."""
    if TaskStreamPlugin.name not in scheduler.plugins:
        scheduler.add_plugin(TaskStreamPlugin(scheduler, maxlen=maxlen))


def record_finished_task(
    scheduler: Any,
    key: str,
    *,
    ok: bool,
    worker: str,
    thread: str,
    spans: Sequence[tuple[str, float, float]],
    nbytes: int,
) -> None:
    """Add a finished task's record to the task stream, as if the scheduler had seen it:
    ``spans`` are ``(action, start, stop)`` with Dask's actions (``compute``,
    ``transfer``, ...), drawn in Dask's colours. A call that was no task is drawn this way.

    The record holds what the stream draws and ``get_task_stream`` reports (key, worker,
    thread, spans, status, bytes), the worker's address shared between records: every
    call adds one, so the fields a task's record also has (``metadata``, a stimulus id)
    would be megabytes over a long run.
    """
    stream = scheduler.plugins.get(TaskStreamPlugin.name)
    if stream is None:
        return
    stream.transition(
        key,
        "processing",
        "memory" if ok else "erred",
        worker=sys.intern(worker),
        thread=sys.intern(thread),
        startstops=tuple({"action": a, "start": b, "stop": c} for a, b, c in spans),
        status="OK" if ok else "error",
        nbytes=nbytes,
    )


def enter_worker(worker: Any) -> None:
    """Make ``worker`` the one ``distributed.get_worker()`` (and so ``get_client()`` and
    ``worker_client()``) finds in this thread's context, as Dask does in a task's thread.

    An instance's own thread and loop are not Dask's, so without this the worker API
    raises "No worker found" inside a method. Call it once at the start of such a thread.
    """
    _worker_cvar.set(worker)


def reset_comm(comm: Any) -> None:
    """Close a Dask comm at once, dropping what it has not delivered yet: the socket under
    a TCP/TLS comm is closed with ``SO_LINGER`` 0 (a reset), so bytes still queued for a
    peer behind a cut link are never delivered when the link comes back, where a plain
    close would keep sending them. Other comms are aborted as they are."""
    stream = getattr(comm, "stream", None)
    sock = getattr(stream, "socket", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    comm.abort()


def pending_future(client: Any, key: str) -> Future:
    """A driver-side ``Future`` for ``key`` that nothing computes yet: we set its outcome."""
    return Future(key, client)


class Releases:
    """Releases of ``client``'s futures, carried out on its loop in batches.

    Dask's ``Future.release`` wakes the client's loop once per future (a write to the
    loop's self-pipe, then a callback that sends the scheduler a message): dropping a
    burst of non-blocking calls' futures cost the driver more than making them. Here one
    wake-up releases every future dropped meanwhile, with one message to the scheduler;
    a key the scheduler never knew (``local``: a plain result the driver held) is
    forgotten by the client alone. Safe from any thread and from ``__del__`` (no lock is
    taken on the caller's side).
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._pending: collections.deque[tuple[str, bool]] = collections.deque()
        self._scheduled = False

    def release(self, future: Future, *, local: bool) -> None:
        """What ``Future.release`` does, batched (the same once-only and stale-client checks)."""
        client = self._client
        if future._cleared or client.generation != future._generation:
            return
        future._cleared = True
        self._pending.append((future.key, local))
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(TypeError, RuntimeError):  # the loop is closing
                client.loop.add_callback(self._flush)

    def _flush(self) -> None:
        self._scheduled = False  # (before taking the batch: a release after it schedules again)
        pending, client = self._pending, self._client
        batch = [pending.popleft() for _ in range(len(pending))]
        gone: list[str] = []
        with client._refcount_lock:
            for key, local in batch:
                client.refcount[key] -= 1
                if client.refcount[key] == 0:
                    del client.refcount[key]
                    state = client.futures.pop(key, None)
                    if state is not None:
                        state.cancel()
                    if not local:
                        gone.append(key)
        if gone and client.status != "closed":
            client._send_to_scheduler(
                {"op": "client-releases-keys", "keys": gone, "client": client.id}
            )


def submit_as(
    client: Any, future: Future, fn: Callable[..., Any], *args: Any, **options: Any
) -> None:
    """Submit ``fn`` as the task behind ``future`` (a ``pending_future`` handed out earlier).

    ``Client.submit`` returns at once without sending anything when the key already has a
    state in the client, so the pending state steps aside during the submit and is put
    back, shared with the new task's future, so whoever waits on it sees the task's outcome.
    """
    key = future.key
    with client._refcount_lock:
        state = client.futures.pop(key, None)
    inner = client.submit(fn, *args, key=key, **options)
    if state is not None:
        with client._refcount_lock:
            client.futures[key] = state
        inner._state = state
        future._state = state


def future_state(future: Future) -> Any:
    return future._state


def finish_future(future: Future) -> None:
    """Mark a pending future finished (its key is now in a worker's memory). Loop thread."""
    state = future._state
    if state is not None and state.status == "pending":
        state.finish()


def fail_future(future: Future, exc: BaseException) -> None:
    """Mark a pending future errored with ``exc``. Loop thread."""
    state = future._state
    if state is not None and state.status == "pending":
        state.set_error(exc, exc.__traceback__)


async def wait_future(future: Future, timeout: float | None = None) -> bool:
    """Wait (on the client's loop) until ``future`` is done; whether it is."""
    state = future._state
    if state is None:
        return True
    try:
        await asyncio.wait_for(state._get_event().wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def wait_all(futures: Sequence[Future], timeout: float) -> None:
    """Wait (on the client's loop) until every one of ``futures`` is done, or ``timeout``.

    One at a time, in their order: results that finish about in order (a burst of calls)
    cost a wait or two, where ``distributed.wait`` starts a task per future every time.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for future in futures:
        if future.done():
            continue
        left = deadline - loop.time()
        if left <= 0 or not await wait_future(future, left):
            return


async def register_keys(worker: Any, nbytes: dict[str, int], client_id: str) -> None:
    """Tell the scheduler that ``worker`` holds ``nbytes``' keys, wanted by ``client_id``.

    Runs on the worker's event loop, after ``worker.update_data`` stored the values. The
    registration goes over an ordinary RPC (as ``Client.scatter`` inside a task does),
    never over the worker's batched stream (the scheduler drops a worker that does that).
    """
    await worker.scheduler.update_data(
        who_has={key: [worker.address] for key in nbytes}, nbytes=nbytes, client=client_id
    )


def read_serialized(comm: Any) -> None:
    """Have ``comm`` hand over its messages' serialized values as ``Serialized`` (header
    and frames) for ``load_serialized``: by default a comm deserializes every value of a
    batch as it reads it, and one it cannot load (its class's module missing in this
    process) fails the whole read, every message of the batch with it."""
    comm.deserialize = False


async def load_serialized(msg: dict) -> dict:
    """``msg``, read by a comm given to ``read_serialized``, as that comm would have
    decoded it: its ``Serialized`` values (at any depth of dicts, tuples and lists)
    decompressed, merged and deserialized; off the event loop past Dask's
    ``distributed.comm.offload`` bytes, as the comm does. A value that cannot be loaded
    raises here, for this message alone."""
    found: list[Serialized] = []

    def seen(value: Serialized) -> Serialized:
        found.append(value)
        return value

    _with_serialized(msg, seen)
    if not found:
        return msg
    size = sum(nbytes(frame) for value in found for frame in value.frames)
    if OFFLOAD_THRESHOLD and size > OFFLOAD_THRESHOLD:
        return await offload(_with_serialized, msg, _deserialized)
    return _with_serialized(msg, _deserialized)


def _deserialized(value: Serialized) -> Any:
    frames = value.frames
    if "compression" in value.header:
        frames = decompress(value.header, frames)
    return merge_and_deserialize(value.header, frames)


_NESTED = (Serialized, dict, tuple, list)


def _with_serialized(value: Any, load: Callable[[Serialized], Any]) -> Any:
    """``value`` with each ``Serialized`` in it replaced by ``load(it)`` (dicts in place,
    tuples and lists remade only when something in them changed)."""
    kind = type(value)
    if kind is Serialized:
        return load(value)
    if kind is dict:
        for key, item in value.items():
            if type(item) in _NESTED:
                value[key] = _with_serialized(item, load)
    elif (kind is tuple or kind is list) and any(type(item) in _NESTED for item in value):
        items = [_with_serialized(item, load) for item in value]
        if any(new is not old for new, old in zip(items, value)):
            return kind(items)
    return value


async def fetch_keys(
    worker: Any,
    keys: Collection[str],
    borrow: Callable[[str, list[str]], Awaitable[dict[str, Any] | None]] | None = None,
) -> dict[str, Any]:
    """The values of ``keys``: from this worker's memory, else from the workers holding them
    (asked first through ``borrow(holder, keys)``, which answers those it could get, or
    ``None``; the rest are pulled through Dask)."""
    found = {k: worker.data[k] for k in keys if k in worker.data}
    missing = [k for k in keys if k not in found]
    if not missing:
        return found
    who_has = await worker.scheduler.who_has(keys=missing)
    by_holder: dict[str, list[str]] = {}
    for key in missing:
        holders = who_has.get(key) or []
        if not holders:
            raise KeyError(f"no worker holds {key!r} any more (was its worker lost?)")
        by_holder.setdefault(holders[0], []).append(key)
    for holder, wanted in by_holder.items():
        if borrow is not None:
            found.update(await borrow(holder, wanted) or {})
            wanted = [k for k in wanted if k not in found]
            if not wanted:
                continue
        while True:
            reply = await get_data_from_worker(worker.rpc, wanted, holder, who=worker.address)
            if reply["status"] == "OK":
                found.update(reply["data"])
                break
            await asyncio.sleep(BUSY_RETRY_S)
    return found
