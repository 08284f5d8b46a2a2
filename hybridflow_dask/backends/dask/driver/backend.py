"""``DaskBackend``: ranks live in Dask worker processes; the core talks to this class.

It places pools on workers, keeps the per-instance sequence numbers that order calls, and
learns of dead workers from a scheduler plugin's hook (``scheduler.deaths``), so calls on
a dead rank fail within a fraction of a second instead of hanging. How a call travels is the
call path's business: ``direct_path`` (the default, a message to the worker's own
handler) or ``task_path`` (a pinned Dask task, public APIs only). Either way results are
ordinary ``distributed.Future``s that stay on the workers until someone needs them, and
futures passed between groups move worker to worker.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import logging
import operator
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import dask
from distributed import Client, Future

from ....protocol import DataProtoFuture
from ...base import InstanceRef, Slot, WorkerLostError
from ..config import (
    apply_buffer_cache,
    call_path,
    call_timeout,
    freeze_gc,
    fresh_processes,
    group_messages,
    hold_threshold,
    max_local_workers,
    message_log_length,
    same_host_copy,
    scheduler_timeout,
    share_colocated_inputs,
    socket_lane,
    unreachable_timeout,
)
from ..config import device_transfer as config_device_transfer
from ..config import ranks_per_worker as config_ranks_per_worker
from ..internals import cap_message_log, published_value, worker_id_of, workers_of
from ..scheduler.dashboard import register_group_monitor
from ..scheduler.deaths import DEATH_TOPIC, register_worker_deaths
from ..scheduler.message_logs import register_message_log_cap
from ..wire import (
    device_route,
    serialization,  # noqa: F401  (registers the tensor and DataProto serializers)
)
from ..wire.device_route import (
    DEVICE_ROUTE_PLUGIN,
    DeviceRoutePlugin,
    TransferRoute,
    choose_transfer_route,
)
from ..wire.keys import EVENT_TOPIC, GROUP_DATASET
from ..worker.plugin import PLUGIN_NAME, InstancesPlugin
from ..worker.probe import probe_worker
from ..worker.tasks import WorkerRunner, count_instances
from ..worker.used_mark import is_used, mark_used
from .call_path import CallPath, RankCalls, all_are
from .cluster import ClusterChoice, quiet_restarts, start_local_cluster, wait_for_local_workers
from .cluster import owned_settings as _owned_settings
from .connect import SchedulerLostError, open_client, resolve_security
from .direct_path import DirectPath
from .gather import Gathering, wait_some
from .liveness import Liveness, TopicFanOut, dead_address, futures_in
from .placement import WorkerInfo, assign_slots, workers_needed
from .reachability import CONNECT_S, PROBE_S, Reachability
from .replies import REPLY_KINDS, RankReplies
from .task_path import TaskPath

__all__ = ["DaskBackend"]

logger = logging.getLogger(__name__)

#: How long a worker reported dead while the scheduler still lists it may take to answer.
DEATH_CHECK_S = 1.0
#: How long ``replace`` waits for a worker to take a dead one's place.
REPLACE_WAIT_S = 60
#: How long a released worker may take to come back as a fresh process.
RESTART_WAIT_S = 60
#: How long the driver keeps trying to reach a worker it found unreachable, to replace it.
REJOIN_WAIT_S = 600
#: How long ``replace`` waits for a worker on the dead slot's host before it takes a free
#: one on another host (a nanny restarts a killed worker there within seconds; a host
#: that was lost whole, or cut off, has none to offer).
SAME_HOST_WAIT_S = 5.0
#: How long ``shutdown`` waits for groups' instances to be dropped.
SHUTDOWN_WAIT_S = 5


class DaskBackend:
    """Runs ranks on a Dask cluster: owned local, attached by address, or given.

    ``DaskBackend()`` starts a local cluster (``LocalCUDACluster`` when GPUs and
    dask-cuda are there, else ``LocalCluster``) grown to the slots pools need;
    ``address=`` attaches to a running scheduler; ``cluster=`` or ``client=`` use any
    Dask cluster object (dask-jobqueue, dask-kubernetes, ...). ``shutdown()`` stops only
    what this backend started.

    ``security`` (a ``distributed.security.Security``, or ``True`` for a temporary
    self-signed one, which needs ``cryptography``) is TLS for the comms: a cluster the
    backend starts then speaks only ``tls://``, and an ``address=`` is reached with those
    credentials. A given ``client=`` or ``cluster=`` already carries its own.

    ``device_transfer`` (``"host"`` or ``"device"``; default ``hybridflow.device-transfer``,
    ``"host"``) is where CUDA tensors' bytes go when a value is copied or moved: see
    ``wire.device_route``; ``transfer_route`` says what this cluster gives.
    """

    #: What ranks see as ``WG_BACKEND`` (the ``Backend`` protocol's ``name``).
    name = "dask"

    def __init__(
        self,
        address: str | None = None,
        cluster: Any = None,
        client: Client | None = None,
        *,
        security: Any = None,
        device_transfer: str | None = None,
        ranks_per_worker: int | None = None,
        **cluster_kwargs: Any,
    ) -> None:
        requested_route = config_device_transfer(device_transfer)
        #: Ranks of one pool per worker process (``hybridflow.ranks-per-worker``).
        self.ranks_per_worker = config_ranks_per_worker(ranks_per_worker)
        if sum(x is not None for x in (address, cluster, client)) > 1:
            raise ValueError("pass at most one of address=, cluster=, client=")
        if cluster_kwargs and (address or cluster or client):
            raise ValueError(
                f"cluster keyword arguments {sorted(cluster_kwargs)} only apply to a cluster "
                "the backend starts itself"
            )
        if security is not None and (cluster is not None or client is not None):
            raise ValueError(
                "security= applies to a cluster the backend starts or to an address=; a "
                "given client= or cluster= carries its own security: make it with yours"
            )
        security = resolve_security(security)
        self._owned_cluster = None
        self.choice: ClusterChoice | None = None
        if client is not None:
            self.client, self._owns_client = client, False
        else:
            if cluster is None and address is None:
                n = cluster_kwargs.pop("n_workers", 0)
                cluster, self.choice = start_local_cluster(n, security=security, **cluster_kwargs)
                self._owned_cluster = cluster
            target = address if address is not None else cluster
            self.client = open_client(
                target, security=security, set_as_default=False, direct_to_workers=True
            )
            self._owns_client = True
        self.cluster = cluster if cluster is not None else getattr(self.client, "cluster", None)
        self.driver_id = f"driver-{uuid.uuid4().hex[:8]}"
        self._scheduler_address = self.client.scheduler.address
        #: When the client was first seen without its scheduler (``None``: it has one).
        self._scheduler_lost_since: float | None = None
        self._lock = threading.Lock()
        self._taken: set[str] = set()
        #: Light ranks: the process that took over a dead one's ranks, by the dead one's id.
        self._moved: dict[str, Slot] = {}
        self._fresh = fresh_processes()
        self._seq: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self._live = Liveness()
        self._reach = Reachability(self.client.connection_args.get("ssl_context"))
        self._probe: dict[str, dict] = {}
        self._groups: dict[str, list[InstanceRef]] = {}
        self._destroying: list[Any] = []
        self._closed = False
        self._confirming: set[asyncio.Future] = set()  # death reports being checked
        #: Bytes this driver sent to workers and fetched from them, whatever the path.
        self.driver_bytes = {"scattered": 0, "gathered": 0}
        share = share_colocated_inputs()
        #: Plain functions (row routing) always run as tasks, whichever path calls take.
        self._tasks = TaskPath(
            self.client, self.driver_id, self._live, share=share, counts=self.driver_bytes
        )
        self._direct = (
            DirectPath(
                self.client,
                self.driver_id,
                self._live,
                share=share,
                lanes=socket_lane(),
                same_host_copy=same_host_copy(),
                counts=self.driver_bytes,
                group_messages=group_messages(),
                hold_threshold=hold_threshold(),
            )
            if call_path() == "direct"
            else None
        )
        self._path: CallPath = self._direct or self._tasks
        self._gathering = Gathering(
            self.client,
            self._live,
            self._path,
            self.driver_bytes,
            lambda: self._check_open("gather results"),
            self._check_reachable,
        )
        self.client.register_plugin(InstancesPlugin(), name=PLUGIN_NAME)
        with dask.config.set(_owned_settings() if self._owned_cluster is not None else {}):
            register_group_monitor(self.client)  # the /hybridflow page on the dashboard
        logs = message_log_length()
        if logs is not None and self._owns_client:  # this driver's own memory
            cap_message_log(self.client.scheduler_comm, logs)
            if self._owned_cluster is not None:  # its scheduler runs in this process
                register_message_log_cap(self.client, logs)
        register_worker_deaths(self.client)
        TopicFanOut.subscribe(self.client, DEATH_TOPIC, self._on_worker_removed)
        if self._owned_cluster is not None:
            # A program that ends without shutdown(): close cleanly before distributed's own
            # exit hook (registered earlier, so run later) closes the cluster under us.
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        freeze_gc()  # the imported modules' objects: no full collection scans them again
        apply_buffer_cache()
        try:
            #: What this backend does with CUDA tensors' bytes (``wire.device_route``).
            self.transfer_route = self._transfer_route(requested_route)
        except ValueError:
            self.shutdown()
            raise

    # -- public conveniences ------------------------------------------------------------

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    @property
    def groups_page(self) -> str:
        """URL of the dashboard page that lists this cluster's worker groups."""
        link = self.dashboard_link
        base = link[: -len("/status")] if link.endswith("/status") else link.rstrip("/")
        return base + "/hybridflow"

    @property
    def call_path(self) -> str:
        """``"direct"`` or ``"task"``: how this backend's calls reach the workers."""
        return self._path.name

    def __repr__(self) -> str:
        return f"<DaskBackend scheduler={self.client.scheduler.address} path={self.call_path}>"

    def __enter__(self) -> DaskBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- placement ----------------------------------------------------------------------

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        self._check_open()
        need = workers_needed(process_on_nodes, self.ranks_per_worker)
        avoid = self._freshen(need) if self._fresh else set()
        with self._lock:
            free = [w for w in self._free_workers() if w.address not in avoid]
            if self._owned_cluster is not None and len(free) < need and self._can_grow():
                total = len(self._workers())
                wanted = total + need - len(free)
                limit = max_local_workers()
                if wanted > limit:
                    raise ValueError(
                        f"the pool needs {need} worker processes; the local cluster has "
                        f"{len(free)} free of {total} and may grow to "
                        f"hybridflow.max-local-workers={limit}: use a smaller pool, shut down "
                        "other groups, or raise the limit"
                    )
                self._owned_cluster.scale(wanted)
                wait_for_local_workers(self._owned_cluster, self.client, wanted, timeout=120)
                free = [w for w in self._free_workers() if w.address not in avoid]
            gpu_workers = [w for w in free if w.has_gpu]
            if use_gpu is None:
                use_gpu = bool(gpu_workers) and len(gpu_workers) >= need
            if use_gpu and not gpu_workers:
                if any(p.get("device", "cpu") != "cpu" for p in self._probe.values()):
                    raise ValueError(
                        "the pool asks for GPUs (use_gpu=True) but every GPU worker of this "
                        "cluster is taken by other pools; shut some groups down first"
                    )
                raise ValueError(
                    "the pool asks for GPUs (use_gpu=True) but no worker of this cluster has "
                    "one; use use_gpu=None/False or start GPU workers (dask cuda worker)"
                )
            candidates = gpu_workers if use_gpu else free
            try:
                slots = assign_slots(process_on_nodes, candidates, self.ranks_per_worker)
            except ValueError as exc:
                total = len(self._workers())
                raise ValueError(
                    f"cannot place pool {list(process_on_nodes)} ({sum(process_on_nodes)} ranks"
                    f"{', GPU' if use_gpu else ''}) on a cluster of {total} workers: {exc}"
                ) from None
            addresses = sorted({s.address for s in slots})
            self._taken.update(addresses)
        self._mark_used(addresses)
        logger.debug("placed pool %s on %s", name, [s.address for s in slots])
        return slots

    def replace(self, slot: Slot) -> Slot:
        """A free live worker on the dead slot's host: the nanny restarts a killed worker
        there within seconds (at a new address, or the same one with a fixed port); after
        ``SAME_HOST_WAIT_S`` without one, a free worker on any host. Waits up to
        ``REPLACE_WAIT_S``."""
        self._check_open()
        start = time.monotonic()
        deadline = start + REPLACE_WAIT_S
        with self._lock:
            moved = self._moved.get(slot.worker_id)
            if moved is not None:  # another light rank of that process moved already
                return dataclasses.replace(moved, index=slot.index, node=slot.node)
            self._taken.discard(slot.address)  # a worker restarted there may take its place
        while True:
            with self._lock:
                # the same host first; after SAME_HOST_WAIT_S, any host (a lost host's
                # ranks are rebuilt on the others)
                anywhere = time.monotonic() - start > SAME_HOST_WAIT_S
                for info in self._free_workers():
                    here = info.host == slot.host or anywhere
                    if here and info.has_gpu == slot.device.startswith("cuda"):
                        self._taken.add(info.address)
                        new = Slot(
                            slot.index,
                            info.address,
                            info.host,
                            slot.node,
                            info.device,
                            info.name,
                            info.worker_id,
                        )
                        if self.ranks_per_worker > 1:
                            self._moved[slot.worker_id] = new
                        break
                else:
                    new = None
            if new is not None:
                self._mark_used([new.address])
                return new
            if time.monotonic() > deadline:
                raise WorkerLostError(
                    f"no free live worker on host {slot.host} to replace {slot.address} after "
                    f"{REPLACE_WAIT_S}s"
                )
            time.sleep(0.2)

    def release(self, slots: Sequence[Slot]) -> None:
        """Give slots back. Their workers are restarted (fresh processes: no default process
        group, module globals or CUDA context left by this group) before another pool takes
        them, as every verl group gets new processes; clean workers are taken first."""
        with self._lock:
            self._taken.difference_update(s.address for s in slots)

    def _mark_used(self, addresses: list[str]) -> None:
        """Mark the workers a pool takes, in their own processes (``worker.used_mark``), so
        that every driver of a shared cluster sees they are no longer fresh."""
        if addresses:
            self.client.run(mark_used, workers=addresses, on_error="return")

    def _freshen(self, need: int) -> set[str]:
        """Restart as many used free workers (marked by any driver) as a pool of ``need``
        lacks clean ones; return the used ones left as they are, for the pool to avoid."""
        with self._lock:
            free = self._free_workers()
        marks = self.client.run(is_used, workers=[w.address for w in free], on_error="return")
        used = [w.address for w in free if marks.get(w.address) is not False]
        clean = len(free) - len(used)
        restart = used[: max(0, need - clean)]
        busy: list[str] = []
        if restart:  # never one that hosts instances (another backend's, on a shared cluster)
            hosting = self.client.run(count_instances, workers=restart, on_error="return")
            busy = [a for a in restart if hosting.get(a) != 0]  # shared with live instances
            restart = [a for a in restart if a not in busy]
        avoid = set(used) - set(restart) - set(busy)
        if not restart:
            return avoid
        with quiet_restarts():  # returns once the new processes have registered
            outcome = self.client.restart_workers(
                restart, timeout=RESTART_WAIT_S, raise_for_error=False
            )
        reused = [a for a, status in outcome.items() if status != "OK"]
        if reused:
            logger.info("workers %s could not be restarted (no nanny?): reused as is", reused)
        gone = set(restart) - set(reused)
        deadline = time.monotonic() + RESTART_WAIT_S
        while time.monotonic() < deadline:  # until the scheduler lists the new processes
            with self._lock:
                addresses = {w.address for w in self._free_workers()}
            if not addresses & gone and len(addresses) >= len(free):
                break
            time.sleep(0.05)
        return avoid

    def free_port(self, slot: Slot) -> int:
        self._check_alive(slot, None)
        return self._path.port(slot)

    # -- instances and calls ------------------------------------------------------------

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict[str, str]
    ) -> Any:
        self._check_alive(ref.slot, ref)
        with self._lock:
            self._seq[ref.key] = 0
            self._live.hosts(ref)
            before = self._groups.get(ref.group, [])
            was = next((r.slot.address for r in before if r.rank == ref.rank), None)
            members = [r for r in before if r.rank != ref.rank]
            members.append(ref)
            self._groups[ref.group] = members
        self.client.publish_dataset(**{GROUP_DATASET + ref.group: members}, override=True)
        if was is not None and was != ref.slot.address:  # WorkerGroup.recover()
            self._report(
                {
                    "kind": "recovered",
                    "group": ref.group,
                    "rank": ref.rank,
                    "worker": ref.slot.address,
                    "message": f"rebuilt from __init__ on {ref.slot.address} (it was on {was})",
                }
            )
        (seq,) = self._next_seqs([ref.key])
        future = self._path.create(ref, cls, args, kwargs, env, seq)
        self._live.track(future, ref.slot, ref, (args, kwargs), seq)
        return future

    def call(
        self,
        ref: InstanceRef,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool = False,
    ) -> Any:
        return self.call_ranks([ref], method, [args], [kwargs], label=label, blocking=blocking)[0]

    def call_ranks(
        self,
        refs: Sequence[InstanceRef],
        method: str,
        args: Sequence[tuple],
        kwargs: Sequence[dict],
        *,
        label: str,
        blocking: bool = False,
    ) -> Sequence[Any]:
        """One call to several ranks, the same flow on every path: a dead rank fails it
        before anything is sent; each rank's number orders it on its instance; a call that
        could not be sent is withdrawn (later calls must not wait for it); each result's
        worker is remembered, so a wait on it fails at once if that worker (or an input's)
        dies. The path sends each worker process its ranks' parts together."""
        self._check_open()
        self._live.check_all(refs)
        keys = list(map(_KEY, refs))
        seqs = self._next_seqs(keys)
        # ranks given the very same arguments share one view of them
        if args and all_are(args, args[0]) and all_are(kwargs, kwargs[0]):  # ONE_TO_ALL
            a, kw = _for_worker(args[0]), _for_worker(kwargs[0])
            calls = RankCalls(refs, keys, seqs, a, kw, shared=True)
        else:
            view_args, view_kwargs = _ForWorker(), _ForWorker()
            calls = RankCalls(
                refs,
                keys,
                seqs,
                list(map(view_args, args)),
                list(map(view_kwargs, kwargs)),
                shared=False,
            )
        limit = call_timeout()  # the limit in force when the call is made, on every wait
        deadline = None if limit is None else time.time() + limit
        try:
            futures = self._path.call(
                calls, method, label=label, blocking=blocking, deadline=deadline
            )
        except BaseException:
            for ref, seq in zip(refs, seqs):
                self._path.skip(ref, seq)
            raise
        self._live.track_calls(futures, calls, deadline)
        return futures

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> Future:
        self._check_open()
        if slot is not None:
            self._check_alive(slot, None)

        def send(future: Future | None) -> Future:
            self._check_open()
            return self._tasks.submit(fn, *args, label=label, slot=slot, ref=None, future=future)

        future = self._path.submit_when_known(futures_in(args), send, label)
        if slot is not None:
            self._live.track(future, slot, None, args)
        return future

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Wait for all, failing early on an error or a dead worker, then fetch directly.

        Several failures raise the first in rank order: once a method fails, the calls
        before it are still waited for, as ``ray.get`` would; a lost worker fails it at
        once. A backend shut down meanwhile (by another thread) is the ``RuntimeError``
        every use after shutdown raises, whatever broke on the way.
        """
        self._check_open("gather results")
        try:
            # (a blocking call's own futures are gathered from its record, not rank by rank)
            return self._gathering.gather(
                futures if type(futures) is RankReplies else list(futures)
            )
        except Exception as exc:
            if self._closed:
                raise self._closed_error("gather results") from exc
            if self.client.status != "running":  # what broke was the scheduler
                self._check_scheduler()  # raises SchedulerLostError unless it came back
            raise

    def _check_reachable(self, pending: Sequence[Any]) -> None:
        """Probe the hosts of the calls still pending (and the scheduler's): a worker no
        connection reached for ``hybridflow.unreachable-timeout`` is lost to this driver
        (``WorkerUnreachableError``); a scheduler unreachable for
        ``hybridflow.scheduler-timeout`` is ``SchedulerLostError``. When the scheduler
        does not answer either, the cut is the driver's own: the workers are not blamed."""
        where: dict[str, tuple[Slot, InstanceRef | None]] = {}
        for f in pending:
            placed = self._live.placed(f)
            if placed is not None:
                where.setdefault(placed[0].address, placed)
        scheduler = self._scheduler_address
        self._reach.watch([scheduler, *where])
        cut_off = self._reach.unreachable_for(scheduler)
        if cut_off > scheduler_timeout():
            raise SchedulerLostError(scheduler, scheduler_timeout())
        if cut_off > CONNECT_S + PROBE_S:
            return
        bound = unreachable_timeout()
        for address, (slot, ref) in where.items():
            if self._reach.unreachable_for(address) > bound:
                self._lose_unreachable(slot, bound)
                raise self._live.error(slot, ref)

    def _lose_unreachable(self, slot: Slot, bound: float) -> None:
        """``slot``'s worker is cut off: lost to this driver. What is still queued for it is
        dropped (its connections reset), and once it answers again it is restarted (a
        fresh process, free for any pool) unless it hosts other drivers' instances."""
        with self._lock:
            if self._live.is_dead(slot):
                return
            self._live.unreachable(slot, bound)
            stale = sum(
                r.slot.worker_id == slot.worker_id for refs in self._groups.values() for r in refs
            )
        logger.warning(
            "worker %s unreachable for %gs: its ranks are lost to this driver", slot.address, bound
        )
        if self._direct is not None:
            self._direct.abandon(slot.address)
        threading.Thread(
            target=self._replace_when_back,
            args=(slot.address, stale),
            name="hybridflow-rejoin",
            daemon=True,
        ).start()

    def _replace_when_back(self, address: str, stale: int) -> None:
        """Once the cut-off worker at ``address`` answers again, restart it: its instances
        are ours and lost (rebuilt elsewhere by ``recover()``), so a fresh process takes
        its place. A worker the scheduler dropped meanwhile comes back by itself."""
        deadline = time.monotonic() + REJOIN_WAIT_S
        while not self._closed and time.monotonic() < deadline:
            self._reach.watch([address])
            time.sleep(1.0)
            if self._reach.unreachable_for(address) > CONNECT_S + PROBE_S:
                continue
            try:
                if address not in self._workers():
                    return
                hosting = self.client.run(count_instances, workers=[address], on_error="return")
                count = hosting.get(address)
                if isinstance(count, int) and count <= stale:
                    with quiet_restarts():
                        self.client.restart_workers(
                            [address], timeout=RESTART_WAIT_S, raise_for_error=False
                        )
                    logger.info("worker %s is reachable again: restarted", address)
                return
            except Exception:  # not reachable after all, or the client is closing
                logger.debug("worker %s not back yet", address, exc_info=True)

    def future_problem(self, obj: Any) -> str | None:
        """Why ``obj``, a Dask future, can no longer be an argument: its client closed."""
        if isinstance(obj, Future) and getattr(obj.client, "status", None) in ("closing", "closed"):
            return (
                "is a future of a DaskBackend that was shut down (its client is closed), so "
                "its result is gone; compute it again on an open backend"
            )
        return None

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, (Future, *REPLY_KINDS))

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` was called (the core refuses this backend's futures then)."""
        return self._closed

    def alive(self, slot: Slot) -> bool:
        return not self._closed and not self._live.is_dead(slot)

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        if self._closed:
            return
        for ref in refs:
            if self._live.is_dead(ref.slot):
                continue
            teardown = self._path.destroy(ref, *self._next_seqs([ref.key]))
            self._destroying.append(teardown)
            # dropped once done, so a teardown's (empty) result is not kept on the worker
            teardown.add_done_callback(self._forget_teardown)
        with self._lock:
            for ref in refs:
                self._seq.pop(ref.key, None)
        groups = {ref.group for ref in refs}
        for group in groups:
            self._groups.pop(group, None)
            with contextlib.suppress(KeyError):
                self.client.unpublish_dataset(GROUP_DATASET + group)

    def _forget_teardown(self, teardown: Any) -> None:
        with contextlib.suppress(ValueError):
            self._destroying.remove(teardown)

    def lookup(self, group: str) -> list[InstanceRef]:
        self._check_open()
        return list(published_value(self.client, GROUP_DATASET + group, []))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._reach.close()
        if self.client.status != "running":  # the scheduler is gone: nothing to tell it
            self._closed = True
            self._tasks.close()
            self._path.close()
            if self._owns_client:
                with contextlib.suppress(Exception):
                    self.client.close(timeout=SHUTDOWN_WAIT_S)
            if self._owned_cluster is not None:
                self._owned_cluster.close()
            return
        if self._owned_cluster is None:
            # Groups never shut down must not outlive the backend on a cluster it attached
            # to (their instances and published names would linger there).
            with contextlib.suppress(Exception):  # the scheduler may already be gone
                self.destroy([ref for refs in list(self._groups.values()) for ref in refs])
        self._closed = True
        self._tasks.close()
        self._path.close()
        with contextlib.suppress(Exception):
            TopicFanOut.unsubscribe(self.client, DEATH_TOPIC, self._on_worker_removed)
            # Let groups shut down just before finish dropping their instances, so the
            # cluster does not close under them.
            pending = [f for f in self._destroying if not f.done()]
            wait_some(self.client, pending, SHUTDOWN_WAIT_S)
        if self._owns_client:
            self.client.close()
        if self._owned_cluster is not None:
            self._owned_cluster.close()

    # -- internals ------------------------------------------------------------------------

    def _next_seqs(self, keys: Sequence[str]) -> list[int]:
        """The next call number on each of the instances ``keys``."""
        numbers = self._seq
        with self._seq_lock:
            if len(set(keys)) == len(keys):  # each instance once (a group call): in bulk, in C
                out = list(map(operator.add, map(numbers.get, keys, repeat(0)), repeat(1)))
                numbers.update(zip(keys, out))
                return out
            out = []
            for key in keys:
                seq = numbers[key] = numbers.get(key, 0) + 1
                out.append(seq)
        return out

    def _on_worker_removed(self, event: Any) -> None:
        """A death report on the topic (loop thread). Any client may post there, so the
        report counts only once the scheduler confirms it (``_confirm_death``)."""
        address = dead_address(event)
        if address is None or not self._live.known(address):
            return
        confirming = asyncio.ensure_future(self._confirm_death(address, event))
        self._confirming.add(confirming)  # (held until done: the loop keeps weak ones)
        confirming.add_done_callback(self._confirming.discard)

    async def _confirm_death(self, address: str, event: Any) -> None:
        """The worker at ``address`` is gone if the scheduler no longer lists it, or the
        process there now is another one (or does not answer at once); a report about a
        live worker the scheduler still lists is ignored, and logged."""
        try:
            listed = address in (await self.client.scheduler.identity())["workers"]
        except Exception:  # the scheduler is gone too: the report stands
            listed = False
        if listed:
            process = await worker_id_of(self.client, address, DEATH_CHECK_S)
            if process is not None and process == self._live.id_at(address):
                logger.warning(
                    "ignored a report that the Dask worker %s died: the scheduler still "
                    "lists it and it answers as the same process",
                    address,
                )
                return
        self._worker_removed(event)

    def _worker_removed(self, event: Any) -> None:
        address = self._live.on_worker_removed(event)
        if address is None:
            return
        self._probe.pop(address, None)  # a worker restarted there is another process
        if address in self._taken and not self._closed:
            logger.warning("worker %s left the cluster; the ranks it hosted are lost", address)
        # Calls waiting for data that died with it can never run: fail them now, which
        # also tells their (live) workers to skip them so later calls go ahead.
        stranded = self._live.stranded()
        if stranded:
            self.client.loop.add_callback(self._cancel, stranded)
        lost = collections.Counter(
            (ref.group, ref.rank, method) for ref, method in self._live.pending_with(address)
        )
        for (group, rank, method), count in lost.items():
            self._report(
                {
                    "kind": "lost",
                    "group": group,
                    "rank": rank,
                    "method": method,
                    "worker": address,
                    "count": count,
                    "message": f"{count} call(s) lost with the worker: they fail with "
                    "WorkerLostError",
                }
            )

    def _report(self, event: dict[str, Any]) -> None:
        """Tell the dashboard (the scheduler's group monitor) what this driver saw."""

        async def send() -> None:
            with contextlib.suppress(Exception):  # the page is a convenience, never a failure
                await self.client.scheduler.log_event(topic=EVENT_TOPIC, msg=event)

        self.client.loop.add_callback(send)

    async def _cancel(self, futures: list[Any]) -> None:
        tasks = [f for f in futures if isinstance(f, Future) and not f.done()]
        if tasks:
            await self.client.cancel(tasks, asynchronous=True)

    def _check_alive(self, slot: Slot, ref: InstanceRef | None) -> None:
        self._check_open()
        self._live.check(slot, ref)

    def _check_open(self, doing: str = "") -> None:
        if self._closed:
            raise self._closed_error(doing)
        if self.client.status != "running":
            self._check_scheduler()

    def _check_scheduler(self) -> None:
        """The client lost its scheduler: wait up to ``hybridflow.scheduler-timeout`` (from
        when that was first seen) for it to come back, else ``SchedulerLostError``."""
        limit = scheduler_timeout()
        since = self._scheduler_lost_since or time.monotonic()
        self._scheduler_lost_since = since
        while self.client.status != "running":
            if self._closed:
                raise self._closed_error()
            if time.monotonic() - since > limit:
                raise SchedulerLostError(self._scheduler_address, limit)
            time.sleep(0.05)
        self._scheduler_lost_since = None

    def _closed_error(self, doing: str = "") -> RuntimeError:
        what = f"cannot {doing}: " if doing else ""
        return RuntimeError(
            f"{what}this DaskBackend was shut down (backend.shutdown() or "
            "hybridflow_dask.shutdown()); its results and instances are gone"
        )

    def _workers(self) -> dict[str, dict]:
        return workers_of(self.client)

    def _free_workers(self) -> list[WorkerInfo]:
        workers = self._workers()
        unknown = [a for a in workers if a not in self._probe]
        if unknown:
            for address, probe in self.client.run(probe_worker, workers=unknown).items():
                self._probe[address] = probe
                self._live.seen(address, probe["worker_id"])
        free = []
        for addr, info in workers.items():
            probe = self._probe.get(addr)  # the event handler may drop it meanwhile
            if addr in self._taken:
                continue
            if probe is None or not self._live.known(addr):
                continue
            if self._live.is_dead_id(probe["worker_id"]):  # cut off: lost until restarted
                continue
            free.append(
                WorkerInfo(
                    addr,
                    info.get("host", addr),
                    str(info.get("name", addr)),
                    probe["device"],
                    probe["worker_id"],
                )
            )
        return free

    def _transfer_route(self, requested: str) -> TransferRoute:
        """Check the device route against this cluster, and turn it on where it applies."""
        if requested == "host":
            return choose_transfer_route("host", protocol="", gpus=None)
        if self._owned_cluster is not None and self.choice is not None:
            gpus: int | None = self.choice.gpus
        else:
            self._free_workers()  # probes every worker the cluster has now
            devices = [p.get("device", "cpu") for p in self._probe.values()]
            gpus = sum(d != "cpu" for d in devices) if devices else None
        protocol = self._scheduler_address.split("://", 1)[0]
        route = choose_transfer_route(requested, protocol=protocol, gpus=gpus)
        device_route.enable()
        self.client.register_plugin(DeviceRoutePlugin(), name=DEVICE_ROUTE_PLUGIN)
        logger.info("DaskBackend: %s", route.reason)
        return route

    def _can_grow(self) -> bool:
        return self.choice is not None and self.choice.kind == "LocalCluster"


class _ForWorker:
    """``_for_worker``, remembering the last arguments it was given: ``ONE_TO_ALL`` hands
    every rank the very same tuple and dict."""

    __slots__ = ("_last", "_made")

    def __init__(self) -> None:
        self._last: Any = None
        self._made: Any = None

    def __call__(self, values: Any) -> Any:
        if values is not self._last:
            self._last, self._made = values, _for_worker(values)
        return self._made


#: An instance's key (``InstanceRef.key``, cached on it), read in C for every rank of a call.
_KEY = operator.attrgetter("key")


def _for_worker(values: Any) -> Any:
    """Arguments as a rank receives them: a ``DataProtoFuture`` resolves through the worker."""

    if isinstance(values, dict):
        if not any(isinstance(v, DataProtoFuture) for v in values.values()):
            return values  # the common case: nothing to change, no copy of the dict
        return {k: _worker_view(v) for k, v in values.items()}
    if not any(isinstance(v, DataProtoFuture) for v in values):
        return values
    return tuple(_worker_view(v) for v in values)


def _worker_view(value: Any) -> Any:
    """A ``DataProtoFuture`` resolved inside the rank's worker; anything else as it is."""
    return value.with_runner(WorkerRunner()) if isinstance(value, DataProtoFuture) else value


def _shutdown_at_exit(ref: weakref.ref) -> None:
    backend = ref()
    if backend is not None:
        backend.shutdown()


def _label(future: Any) -> str:
    return str(future.key).rsplit("-", 1)[0]
