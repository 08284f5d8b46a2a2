"""``DaskBackend``: ranks live in Dask worker processes, calls are pinned Dask tasks.

Every call is a task pinned to its rank's worker, keyed ``"{group}.{method}-<id>"`` so
the dashboard's task stream shows calls by role and method, and its result stays on
that worker as an ordinary ``distributed.Future`` until someone needs it. Driver data is
scattered straight to the worker that needs it; futures passed between groups move
worker to worker. Worker deaths are learnt from the scheduler's ``remove-worker``
events, so calls on a dead rank fail within a fraction of a second instead of hanging.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from dask.sizeof import sizeof
from distributed import Client, Future, fire_and_forget, wait

from ...protocol import DataProtoFuture
from ..base import InstanceRef, Slot, WorkerLostError
from . import serialization  # noqa: F401  (registers the DataProto serializers)
from .cluster import ClusterChoice, start_local_cluster
from .config import call_timeout, max_local_workers, scatter_threshold
from .connect import open_client
from .dashboard import GROUP_DATASET, register_group_monitor, task_key
from .host import (
    InstanceHost,
    WorkerRunner,
    create_instance,
    destroy_instance,
    probe_worker,
    run_call,
    skip_call,
    worker_port,
)
from .liveness import Liveness
from .placement import WorkerInfo, assign_slots

__all__ = ["DaskBackend"]

logger = logging.getLogger(__name__)

#: How often a waiting ``gather`` looks for dead workers.
POLL_S = 0.1
#: How long ``replace`` waits for a worker to take a dead one's place.
REPLACE_WAIT_S = 60
#: How long ``shutdown`` waits for groups' instances to be dropped.
SHUTDOWN_WAIT_S = 5


class DaskBackend:
    """Runs ranks on a Dask cluster: owned local, attached by address, or given.

    ``DaskBackend()`` starts a local cluster (``LocalCUDACluster`` when GPUs and
    dask-cuda are there, else ``LocalCluster``) grown to the slots pools need;
    ``address=`` attaches to a running scheduler; ``cluster=`` or ``client=`` use any
    Dask cluster object (dask-jobqueue, dask-kubernetes, ...). ``shutdown()`` stops only
    what this backend started.
    """

    def __init__(
        self,
        address: str | None = None,
        cluster: Any = None,
        client: Client | None = None,
        **cluster_kwargs: Any,
    ) -> None:
        if sum(x is not None for x in (address, cluster, client)) > 1:
            raise ValueError("pass at most one of address=, cluster=, client=")
        if cluster_kwargs and (address or cluster or client):
            raise ValueError(
                f"cluster keyword arguments {sorted(cluster_kwargs)} only apply to a cluster "
                "the backend starts itself"
            )
        self._owned_cluster = None
        self.choice: ClusterChoice | None = None
        if client is not None:
            self.client, self._owns_client = client, False
        else:
            if cluster is None and address is None:
                n = cluster_kwargs.pop("n_workers", 0)
                cluster, self.choice = start_local_cluster(n, **cluster_kwargs)
                self._owned_cluster = cluster
            target = address if address is not None else cluster
            self.client = open_client(target, set_as_default=False, direct_to_workers=True)
            self._owns_client = True
        self.cluster = cluster if cluster is not None else getattr(self.client, "cluster", None)
        self.driver_id = f"driver-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._taken: set[str] = set()
        self._seq: dict[str, int] = {}
        self._live = Liveness()
        self._priority = itertools.count()
        self._probe: dict[str, dict] = {}
        self._groups: dict[str, list[InstanceRef]] = {}
        self._destroying: list[Future] = []
        self._closed = False
        #: Bytes this driver sent to workers (scatter) and fetched from them (gather).
        self.driver_bytes = {"scattered": 0, "gathered": 0}
        self.client.register_plugin(InstanceHost(), name="hybridflow-host")
        register_group_monitor(self.client)  # the /hybridflow page on the dashboard
        self.client.subscribe_topic("all", self._on_scheduler_event)

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

    def __repr__(self) -> str:
        return f"<DaskBackend scheduler={self.client.scheduler.address}>"

    def __enter__(self) -> DaskBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- placement ----------------------------------------------------------------------

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        self._check_open()
        need = sum(process_on_nodes)
        with self._lock:
            free = self._free_workers()
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
                self.client.wait_for_workers(wanted, timeout=120)
                free = self._free_workers()
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
                slots = assign_slots(process_on_nodes, candidates)
            except ValueError as exc:
                total = len(self._workers())
                raise ValueError(
                    f"cannot place pool {list(process_on_nodes)} ({need} ranks"
                    f"{', GPU' if use_gpu else ''}) on a cluster of {total} workers: {exc}"
                ) from None
            self._taken.update(s.address for s in slots)
        logger.debug("placed pool %s on %s", name, [s.address for s in slots])
        return slots

    def replace(self, slot: Slot) -> Slot:
        """A free live worker on the dead slot's host: the nanny restarts a killed worker
        there within seconds (at a new address, or the same one with a fixed port). Waits up
        to ``REPLACE_WAIT_S``."""
        self._check_open()
        deadline = time.monotonic() + REPLACE_WAIT_S
        with self._lock:
            self._taken.discard(slot.address)  # a worker restarted there may take its place
        while True:
            with self._lock:
                for info in self._free_workers():
                    if info.host == slot.host and info.has_gpu == slot.device.startswith("cuda"):
                        self._taken.add(info.address)
                        return Slot(
                            slot.index,
                            info.address,
                            info.host,
                            slot.node,
                            info.device,
                            info.name,
                            info.worker_id,
                        )
            if time.monotonic() > deadline:
                raise WorkerLostError(
                    f"no free live worker on host {slot.host} to replace {slot.address} after "
                    f"{REPLACE_WAIT_S}s"
                )
            time.sleep(0.2)

    def release(self, slots: Sequence[Slot]) -> None:
        with self._lock:
            self._taken.difference_update(s.address for s in slots)

    def free_port(self, slot: Slot) -> int:
        self._check_alive(slot, None)
        return self.client.run(worker_port, workers=[slot.address])[slot.address]

    # -- instances and calls ------------------------------------------------------------

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict[str, str]
    ) -> Future:
        self._check_alive(ref.slot, ref)
        with self._lock:
            self._seq[ref.key] = 0
            self._live.hosts(ref)
            members = [r for r in self._groups.get(ref.group, []) if r.rank != ref.rank]
            members.append(ref)
            self._groups[ref.group] = members
        self.client.publish_dataset(**{GROUP_DATASET + ref.group: members}, override=True)
        fut = self._submit(
            create_instance,
            ref,
            cls,
            self._ship(args, ref.slot),
            self._ship(kwargs, ref.slot),
            env,
            label=f"{ref.group}.__init__",
            slot=ref.slot,
            ref=ref,
        )
        return fut

    def call(
        self,
        ref: InstanceRef,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool = False,
    ) -> Future:
        self._check_alive(ref.slot, ref)
        args = self._ship(args, ref.slot)
        kwargs = self._ship(kwargs, ref.slot)
        seq = self._next_seq(ref)
        try:
            fut = self._submit(
                run_call,
                ref,
                self.driver_id,
                seq,
                method,
                args,
                kwargs,
                label=label,
                slot=ref.slot,
                ref=ref,
            )
        except BaseException:
            self._skip(ref, seq)  # e.g. an argument that cannot be pickled: never sent
            raise
        fire_and_forget(fut)  # a call runs to completion even if the driver drops it
        # The callback also keeps the call's inputs referenced until it is done, so data
        # handed over inside an argument (an unmaterialized future) is not released early.
        fut.add_done_callback(lambda f, r=ref, s=seq, _=(args, kwargs): self._after_call(f, r, s))
        return fut

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> Future:
        self._check_open()
        if slot is not None:
            self._check_alive(slot, None)
        return self._submit(fn, *args, label=label, slot=slot, ref=None)

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Wait for all, failing early on an error or a dead worker, then fetch directly."""
        futures = list(futures)
        pending = [f for f in futures if isinstance(f, Future)]
        limit = call_timeout()
        start = time.monotonic()
        while pending:
            try:
                with self.client.as_current():
                    wait(pending, timeout=POLL_S)
                break
            except TimeoutError:  # distributed.wait raises rather than returning
                pending = [f for f in pending if not f.done()]
                if any(f.status == "error" for f in futures if isinstance(f, Future)):
                    break
                self._live.raise_if_lost(pending)
                if limit is not None and time.monotonic() - start > limit:
                    raise TimeoutError(self._live.still_running(pending, limit)) from None
        values = self.client.gather(futures, direct=True)
        self.driver_bytes["gathered"] += sum(
            sizeof(v) for f, v in zip(futures, values) if isinstance(f, Future)
        )
        return values

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, Future)

    def alive(self, slot: Slot) -> bool:
        return not self._closed and not self._live.is_dead(slot)

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        if self._closed:
            return
        self._destroying = [f for f in self._destroying if not f.done()]
        for ref in refs:
            if self._live.is_dead(ref.slot):
                continue
            seq = self._next_seq(ref)
            fut = self._submit(
                destroy_instance,
                ref,
                self.driver_id,
                seq,
                label=f"{ref.group}.__del__",
                slot=ref.slot,
                ref=ref,
            )
            fire_and_forget(fut)
            self._destroying.append(fut)
        with self._lock:
            for ref in refs:
                self._seq.pop(ref.key, None)
        groups = {ref.group for ref in refs}
        for group in groups:
            self._groups.pop(group, None)
            with contextlib.suppress(KeyError):
                self.client.unpublish_dataset(GROUP_DATASET + group)

    def lookup(self, group: str) -> list[InstanceRef]:
        self._check_open()
        return list(self.client.get_dataset(GROUP_DATASET + group, default=[]))

    def shutdown(self) -> None:
        if self._closed:
            return
        if self._owned_cluster is None:
            # Groups never shut down must not outlive the backend on a cluster it attached
            # to (their instances and published names would linger there).
            with contextlib.suppress(Exception):  # the scheduler may already be gone
                self.destroy([ref for refs in list(self._groups.values()) for ref in refs])
        self._closed = True
        with contextlib.suppress(Exception):
            self.client.unsubscribe_topic("all")
            # Let groups shut down just before finish dropping their instances, so the
            # cluster does not close under them.
            with self.client.as_current():
                wait([f for f in self._destroying if not f.done()], timeout=SHUTDOWN_WAIT_S)
        if self._owns_client:
            self.client.close()
        if self._owned_cluster is not None:
            self._owned_cluster.close()

    # -- internals ------------------------------------------------------------------------

    def _submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        label: str,
        slot: Slot | None,
        ref: InstanceRef | None,
    ) -> Future:
        key = task_key(label)
        options: dict[str, Any] = {"key": key, "pure": False}
        if slot is not None:
            options.update(workers=[slot.address], allow_other_workers=False)
        if ref is not None:
            options["priority"] = -next(self._priority)
        future = self.client.submit(fn, *args, **options)
        if slot is not None:
            self._live.track(future, slot, ref, args)
        return future

    def _ship(self, values: Any, slot: Slot) -> Any:
        """Scatter large driver values straight to ``slot``'s worker (never via the graph)."""
        threshold = scatter_threshold()
        if isinstance(values, dict):
            return {k: self._ship_one(v, slot, threshold) for k, v in values.items()}
        return tuple(self._ship_one(v, slot, threshold) for v in values)

    def _ship_one(self, value: Any, slot: Slot, threshold: int) -> Any:
        if isinstance(value, Future) or value is None or isinstance(value, (int, float, str, bool)):
            return value
        if isinstance(value, DataProtoFuture):  # materialize_futures=False: the rank resolves it
            return value.with_runner(WorkerRunner())
        size = sizeof(value)
        if size < threshold:
            return value
        self.driver_bytes["scattered"] += size
        return self.client.scatter([value], workers=[slot.address], direct=True, hash=False)[0]

    def _next_seq(self, ref: InstanceRef) -> int:
        key = ref.key
        with self._lock:
            seq = self._seq.get(key, 0) + 1
            self._seq[key] = seq
            return seq

    def _after_call(self, fut: Future, ref: InstanceRef, seq: int) -> None:
        # An errored or cancelled call may never have run (its input failed): tell the
        # worker to stop waiting for it. A no-op when the call did run.
        if fut.status in ("error", "cancelled"):
            self._skip(ref, seq)

    def _skip(self, ref: InstanceRef, seq: int) -> None:
        if self._closed or self._live.is_dead(ref.slot):
            return
        try:
            fire_and_forget(
                self.client.submit(
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
            )
        except Exception:  # the client is closing
            logger.debug("could not send skip for %s seq %d", ref.name, seq)

    def _on_scheduler_event(self, event: Any) -> None:
        address = self._live.on_scheduler_event(event)
        if address is not None:
            self._probe.pop(address, None)  # a worker restarted there is another process
            if address in self._taken:
                logger.warning("worker %s left the cluster; the ranks it hosted are lost", address)

    def _check_alive(self, slot: Slot, ref: InstanceRef | None) -> None:
        self._check_open()
        self._live.check(slot, ref)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DaskBackend is shut down")

    def _workers(self) -> dict[str, dict]:
        return self.client.scheduler_info(n_workers=-1)["workers"]

    def _free_workers(self) -> list[WorkerInfo]:
        workers = self._workers()
        unknown = [a for a in workers if a not in self._probe]
        if unknown:
            for address, probe in self.client.run(probe_worker, workers=unknown).items():
                self._probe[address] = probe
                self._live.seen(address, probe["worker_id"])
        return [
            WorkerInfo(
                addr,
                info.get("host", addr),
                str(info.get("name", addr)),
                self._probe[addr]["device"],
                self._probe[addr]["worker_id"],
            )
            for addr, info in workers.items()
            if addr not in self._taken and addr in self._probe and self._live.known(addr)
        ]

    def _can_grow(self) -> bool:
        return self.choice is not None and self.choice.kind == "LocalCluster"
