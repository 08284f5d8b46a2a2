"""``RayBackend``: the driver side. Places pools as placement groups, starts one slot
actor per bundle, numbers each instance's calls, and reads deaths from Ray's errors.

See the package docstring for the design and ``worker.slot_actor`` for the cluster side.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray import exceptions as rex
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ....protocol import DataProtoFuture
from ...base import InstanceRef, Slot, WorkerLostError
from ...hosting.jobs import has_coroutines
from ..call_names import call_name
from ..futures import RayFuture, SlotRunner, mark_inputs, resolve_all, translate
from ..worker.slot_actor import CONCURRENCY_GROUPS, THREADED, SlotActor
from .connect import check_answers, with_driver_paths
from .registry import REGISTRY_NAME, RegistryActor

__all__ = ["NAMESPACE", "SLOT_RESOURCE", "RayBackend"]

logger = logging.getLogger(__name__)

#: The Ray namespace of the slot actors and the registry (what a second driver joins).
NAMESPACE = "hybridflow"
#: The logical resource a cluster the backend starts has one of per slot.
SLOT_RESOURCE = "hf_slot"
#: How long new slot actors may take to start (a process importing torch, on a busy machine).
START_WAIT_S = 120.0
#: How long a short question to a slot actor (a port, the registry) may take.
ASK_WAIT_S = 60.0

_SlotActor: Any = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(SlotActor)


@dataclass(eq=False)
class _StartedSlot:
    """A slot actor this backend started: its bundle, and where it runs once started."""

    address: str
    handle: Any
    pg: PlacementGroup
    index: int
    gpu: bool
    ip: str = ""
    device: str = "cpu"
    actor_id: str = ""


@ray.remote(num_cpus=0)
def _run_anywhere(fn: Callable[..., Any], *args: Any) -> Any:
    """A routing function with no slot to run on (no pool is placed yet)."""
    return fn(*args)


class RayBackend:
    """Runs ranks in Ray actors placed in placement-group bundles; see the package docs.

    ``RayBackend()`` starts a local Ray instance (no dashboard, ``max_slots`` logical
    ``hf_slot`` resources so pools fit whatever the core count) and stops it at
    ``shutdown()``; ``RayBackend(address=...)`` connects to a running cluster (``"auto"``
    or ``"ray://..."``, anything ``ray.init`` takes) and only disconnects. In a process
    where Ray is already initialized it uses that connection and leaves it open.
    ``slot_resources`` is what each slot's bundle asks for: by default one ``hf_slot``
    where the cluster has them, else one CPU (a GPU is added for GPU pools).
    ``place_timeout`` is how long a pool waits for bundles other pools hold. The
    driver's import folders (``sys.path`` outside the Python installation) are on the
    hosts' ``PYTHONPATH``, so worker classes import there as they do here.

    Released slots get new processes by default (as every verl group gets new actors:
    no process group, module globals or CUDA context left over); ``reuse_processes=True``
    keeps a released slot's host, emptied, for the next pool (tests: a host takes seconds
    to start). Other keywords go to ``ray.init``.
    """

    #: What ranks see as ``WG_BACKEND``.
    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        *,
        namespace: str = NAMESPACE,
        max_slots: int = 32,
        slot_resources: Mapping[str, float] | None = None,
        place_timeout: float = 30.0,
        reuse_processes: bool = False,
        **init_kwargs: Any,
    ) -> None:
        self._owns_ray = False
        self._where = "the Ray connection this process already had"
        if ray.is_initialized():
            if address is not None or init_kwargs:
                raise ValueError(
                    "Ray is already initialized in this process, so RayBackend uses that "
                    "connection: drop address= and the ray.init keywords (or call "
                    "ray.shutdown() first)"
                )
        else:
            options: dict[str, Any] = {
                "namespace": namespace,
                "include_dashboard": False,
                "logging_level": logging.WARNING,
            }
            if address is None:
                options["resources"] = {SLOT_RESOURCE: float(max_slots)}
            else:
                check_answers(address)
                options["address"] = address
            extra = dict(init_kwargs)
            if address is None or "resources" in extra:
                options["resources"] = {
                    **options.get("resources", {}),
                    **extra.pop("resources", {}),
                }
            options["runtime_env"] = with_driver_paths(extra.pop("runtime_env", None))
            options.update(extra)
            ray.init(**options)
            self._owns_ray = True
            self._where = (
                f"the Ray cluster at {address}"
                if address is not None
                else "a local Ray instance started for this program (no dashboard)"
            )
        self.namespace = namespace
        self.place_timeout = float(place_timeout)
        total = ray.cluster_resources()
        if slot_resources is not None:
            self.slot_resources = {str(k): float(v) for k, v in slot_resources.items()}
        elif total.get(SLOT_RESOURCE, 0) > 0:
            self.slot_resources = {SLOT_RESOURCE: 1.0}
        else:
            self.slot_resources = {"CPU": 1.0}
        self.reuse_processes = bool(reuse_processes)
        self.driver_id = f"driver-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._order_locks: dict[str, threading.Lock] = {}
        self._seq: dict[str, int] = {}
        self._own: dict[str, _StartedSlot] = {}  # the hosts this backend started, by address
        self._idle: list[str] = []  # released hosts kept for reuse (reuse_processes)
        self._handles: dict[str, Any] = {}  # other drivers' hosts this one has called
        self._pg_hosts: dict[str, set[str]] = {}  # placement group id -> its live hosts
        self._watches: dict[str, ray.ObjectRef] = {}
        self._dead: set[str] = set()
        self._groups: dict[str, dict[int, InstanceRef]] = {}  # made by this backend
        #: The instances that run on their slot actor's one default thread, by key.
        self._lent: set[str] = set()
        self._closed = False
        self._registry = RegistryActor.options(
            name=REGISTRY_NAME,
            namespace=namespace,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
        ).remote()

    def describe(self) -> str:
        """Which Ray this backend runs on, in words (what the demo prints)."""
        return f"{self._where}, namespace {self.namespace!r}"

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"{len(self._own)} slot actors"
        return f"<RayBackend namespace={self.namespace!r} {state}>"

    def __enter__(self) -> RayBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- placement ----------------------------------------------------------------------

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        """One bundle per rank, one STRICT_PACK placement group per node entry (so a
        node's ranks share a Ray node), and a slot actor started in every bundle."""
        self._check_open()
        counts = [int(n) for n in process_on_nodes]
        need = sum(counts)
        gpu = self._wants_gpu(use_gpu, need)
        bundle = dict(self.slot_resources)
        if gpu:
            bundle["GPU"] = bundle.get("GPU", 0.0) + 1.0
        self._check_fits(counts, bundle)
        pool_id = uuid.uuid4().hex[:6]
        per_node: list[list[_StartedSlot]] = [self._take_idle(n, gpu) for n in counts]
        groups = {
            node: placement_group(
                [dict(bundle) for _ in range(n)],
                strategy="STRICT_PACK",
                name=f"hf-{name}-{pool_id}-{node}",
            )
            for node, n in enumerate(counts)
            if n and not per_node[node]
        }
        fresh: list[_StartedSlot] = []
        try:
            self._wait_placed(list(groups.values()), counts, bundle)
            for node, pg in groups.items():
                for index in range(pg.bundle_count):
                    host = self._start_host(f"hf-{name}-{pool_id}-{node}-{index}", pg, index, gpu)
                    per_node[node].append(host)
                    fresh.append(host)
            self._describe(fresh)
        except BaseException:
            for host in fresh:
                self._stop_host(host.address)
            for pg in groups.values():
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            for hosts in per_node:
                for host in hosts:
                    if host not in fresh:
                        self._release_host(host.address)
            raise
        slots = [
            Slot(
                index=i,
                address=host.address,
                host=host.ip,
                node=node,
                device=host.device,
                name=name,
                worker_id=host.actor_id,
            )
            for i, (node, host) in enumerate(
                (node, host) for node, hosts in enumerate(per_node) for host in hosts
            )
        ]
        logger.debug("placed pool %s on %s", name, [s.address for s in slots])
        return slots

    def release(self, slots: Sequence[Slot]) -> None:
        """Stop the slots' hosts (a later pool gets fresh processes; with
        ``reuse_processes`` they are emptied and kept) and remove each placement group
        once none of its bundles has a host."""
        if self._closed:
            return
        for slot in slots:
            self._release_host(slot.address)

    def free_port(self, slot: Slot) -> int:
        self._check_usable(slot, None)
        return int(self._ask(self._handle(slot).free_port.remote(), slot.address))

    def alive(self, slot: Slot) -> bool:
        """Whether the slot's host process lives: its ``watch`` call has not failed."""
        if self._closed:
            return False
        if slot.address in self._dead:
            return False
        watch = self._watches.get(slot.address)
        if watch is None:  # a slot another driver placed: watch it from now on
            try:
                watch = self._watch(slot.address, self._handle(slot))
            except WorkerLostError:
                return False
            ray.wait([watch], timeout=0.2)  # a dead host's failure arrives within this
        ready, _ = ray.wait([watch], timeout=0)
        if ready:
            self._dead.add(slot.address)
            return False
        return True

    def replace(self, slot: Slot) -> Slot:
        """A new slot actor in the dead one's bundle (the same node, same resources)."""
        self._check_open()
        old = self._own.get(slot.address)
        if old is None:
            raise WorkerLostError(
                f"slot {slot.address} was not placed by this RayBackend, so it cannot be "
                "replaced from here (recover from the driver that made the group)"
            )
        self._stop_host(slot.address, keep_group=True)
        address = f"{slot.address.split('~')[0]}~{uuid.uuid4().hex[:4]}"
        host = self._start_host(address, old.pg, old.index, old.gpu)
        self._describe([host])
        return Slot(
            index=slot.index,
            address=address,
            host=host.ip,
            node=slot.node,
            device=host.device,
            name=slot.name,
            worker_id=host.actor_id,
        )

    # -- instances and calls ------------------------------------------------------------

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict[str, str]
    ) -> RayFuture:
        self._check_usable(ref.slot, ref)
        handle = self._handle(ref.slot)
        args, kwargs = mark_inputs(args, self._view), mark_inputs(kwargs, self._view)
        lent = not has_coroutines(cls)  # (calls of async methods overlap: a thread of their own)
        if lent:
            with self._lock:
                self._lent.add(ref.key)
        create = _on_its_thread(handle.create, lent)
        with self._order(ref.key):
            self._seq[ref.key] = 1
            object_ref = create.remote(
                ref, cls, args, kwargs, dict(env), self.driver_id, 1, not lent
            )
        with self._lock:
            self._groups.setdefault(ref.group, {})[ref.rank] = ref
        entry = pickle.dumps((ref, lent))
        self._ask(self._registry.put.remote(ref.group, ref.rank, ref.uid, entry))
        return RayFuture(object_ref, ref.slot, f"{ref.group}.__init__ on rank {ref.rank}")

    def call(
        self,
        ref: InstanceRef,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool = False,
    ) -> RayFuture:
        """An actor call numbered for its instance: the host runs it at its turn."""
        self._check_usable(ref.slot, ref)
        handle = self._handle(ref.slot)
        args, kwargs = mark_inputs(args, self._view), mark_inputs(kwargs, self._view)
        with self._order(ref.key):
            seq = self._seq.get(ref.key, 0) + 1
            self._seq[ref.key] = seq
            try:
                lent = ref.key in self._lent
                if args or kwargs:
                    message = (ref.key, self.driver_id, seq, method, args, kwargs)
                    object_ref = _on_its_thread(handle.call, lent).remote(message)
                else:  # said by the task's name: Ray charges for every argument
                    name = call_name(ref.key, self.driver_id, seq, method)
                    object_ref = _on_its_thread(handle.call_named, lent, name=name).remote()
            except BaseException as exc:  # not sent (e.g. an argument Ray cannot pickle)
                handle.skip.remote(ref.key, self.driver_id, seq)
                if isinstance(exc, TypeError):  # named as every backend names it
                    raise TypeError(
                        f"the arguments of {label} for rank {ref.rank} cannot be sent to a "
                        f"worker: {exc}; pass picklable values (tensors, arrays, DataProto, "
                        "plain Python objects)"
                    ) from exc
                raise
        return RayFuture(object_ref, ref.slot, f"{ref.group}.{method} on rank {ref.rank}")

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        if self._closed:
            return
        by_group: dict[str, list[str]] = {}
        for ref in refs:
            by_group.setdefault(ref.group, []).append(ref.uid)
            with self._lock:
                members = self._groups.get(ref.group, {})
                if members.get(ref.rank) == ref:
                    del members[ref.rank]
                if not members:
                    self._groups.pop(ref.group, None)
            lent = ref.key in self._lent
            if ref.slot.address not in self._dead:
                with contextlib.suppress(Exception), self._order(ref.key):
                    seq = self._seq.get(ref.key, 0) + 1
                    destroy = _on_its_thread(self._handle(ref.slot).destroy, lent)
                    destroy.remote(ref.key, self.driver_id, seq)
            with self._lock:  # the instance is gone: so is its numbering
                self._seq.pop(ref.key, None)
                self._order_locks.pop(ref.key, None)
                self._lent.discard(ref.key)
        for group, uids in by_group.items():
            with contextlib.suppress(Exception):
                self._ask(self._registry.drop.remote(group, uids))

    def lookup(self, group: str) -> list[InstanceRef]:
        self._check_open()
        blobs = self._ask(self._registry.get.remote(group))
        refs = []
        for ref, lent in (pickle.loads(b) for b in blobs):
            if lent:  # (a call to it must go to its slot actor's default thread)
                with self._lock:
                    self._lent.add(ref.key)
            refs.append(ref)
        return sorted(refs, key=lambda r: r.rank)

    # -- futures ------------------------------------------------------------------------

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> RayFuture:
        """Run ``fn`` on ``slot``'s host, else next to its first input, else on any host
        of this backend (a plain Ray task when there is none)."""
        self._check_open()
        if slot is not None:
            self._check_usable(slot, None)
        target = slot or self._near(args)
        if target is None:
            plain = tuple(a.ref if isinstance(a, RayFuture) else a for a in args)
            return RayFuture(_run_anywhere.remote(fn, *plain), None, label)
        marked = mark_inputs(args, self._view)
        return RayFuture(self._handle(target).run.remote(fn, marked, label), target, label)

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Each future's value in order; other entries as they are. A lost worker raises
        ``WorkerLostError`` at once, a method's error once the ranks before it are done."""
        self._check_open("gather results")
        picked = [f for f in futures if isinstance(f, RayFuture)]
        try:
            values = iter(
                resolve_all(picked, lambda: self._check_open("gather results"), self._on_lost)
            )
        except WorkerLostError as exc:
            if self._closed:
                raise self._closed_error("gather results") from exc
            raise
        return [next(values) if isinstance(f, RayFuture) else f for f in futures]

    #: Finished results live in Ray's object store, not in the process that made them:
    #: a gather after that process died still returns them (see ``base``, Death).
    results_outlive_workers = True

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` was called (the core refuses this backend's futures then)."""
        return self._closed

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, RayFuture)

    # -- lifetime -----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Drop this backend's groups from the registry, kill the slot actors and placement
        groups it started, and stop Ray if it started it (idempotent)."""
        with self._lock:
            if self._closed:
                return
            groups = {g: [r.uid for r in m.values()] for g, m in self._groups.items()}
            self._groups.clear()
        for group, uids in groups.items():
            with contextlib.suppress(Exception):
                ray.get(self._registry.drop.remote(group, uids), timeout=5)
        for address in list(self._own):
            self._stop_host(address)
        self._closed = True
        if self._owns_ray:
            ray.shutdown()

    # -- internals ----------------------------------------------------------------------

    def _start_host(self, address: str, pg: PlacementGroup, index: int, gpu: bool) -> _StartedSlot:
        resources = dict(self.slot_resources)
        cpus = resources.pop("CPU", 0.0)
        gpus = resources.pop("GPU", 0.0) + (1.0 if gpu else 0.0)
        handle = _SlotActor.options(
            name=address,
            namespace=self.namespace,
            num_cpus=cpus,
            num_gpus=gpus,
            resources=resources,
            max_concurrency=1,  # the default group: the one thread its instances run on
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index
            ),
        ).remote(address)
        host = _StartedSlot(address, handle, pg, index, gpu)
        with self._lock:
            self._own[address] = host
            self._pg_hosts.setdefault(pg.id.hex(), set()).add(address)
        self._watch(address, handle)
        return host

    def _describe(self, hosts: list[_StartedSlot]) -> None:
        """Wait for new hosts to start, and learn where they run."""
        if not hosts:
            return
        refs = [h.handle.describe.remote() for h in hosts]
        names = [h.address for h in hosts]
        try:
            infos = ray.get(refs, timeout=START_WAIT_S)
        except rex.GetTimeoutError:
            raise TimeoutError(
                f"slot actors {names} did not start within {START_WAIT_S:g}s"
            ) from None
        except Exception as exc:
            raise translate(exc, f"new slot actors {names}") from exc
        for host, info in zip(hosts, infos):
            host.ip, host.actor_id = info["host"], info["actor_id"]
            host.device = f"cuda:{info['gpus'][0]}" if host.gpu and info["gpus"] else "cpu"

    def _take_idle(self, n: int, gpu: bool) -> list[_StartedSlot]:
        """``n`` idle hosts on one node for one node entry of a pool, or none."""
        if not n:
            return []
        with self._lock:
            by_ip: dict[str, list[_StartedSlot]] = {}
            for address in self._idle:
                host = self._own[address]
                if host.gpu == gpu and address not in self._dead:
                    by_ip.setdefault(host.ip, []).append(host)
            for hosts in by_ip.values():
                if len(hosts) >= n:
                    taken = hosts[:n]
                    for host in taken:
                        self._idle.remove(host.address)
                    return taken
        return []

    def _wait_placed(self, groups: list[PlacementGroup], counts: list[int], bundle: dict) -> None:
        """Wait for the placement groups; idle kept hosts make room if they hold it."""
        if not groups:
            return
        ready = [pg.ready() for pg in groups]
        deadline = time.monotonic() + self.place_timeout
        _, waiting = ray.wait(ready, num_returns=len(ready), timeout=0.5)
        while waiting and self._idle:
            for address in list(self._idle):
                self._stop_host(address)
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0.5)
        if waiting:
            left = max(0.0, deadline - time.monotonic())
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=left)
        if waiting:
            raise ValueError(
                f"cannot place pool {counts} ({sum(counts)} slots of {bundle}) within "
                f"{self.place_timeout:g}s: the Ray cluster has {_resources(bundle)} "
                "available now, the rest is held by other pools (shut some groups down, or "
                "raise place_timeout while a cluster scales up)"
            )

    def _watch(self, address: str, handle: Any) -> ray.ObjectRef:
        """Start the host's never-ending ``watch`` call: it fails when the process dies."""
        watch = handle.watch.remote()
        self._watches[address] = watch
        watch.future().add_done_callback(lambda _: self._dead.add(address))
        return watch

    def _release_host(self, address: str) -> None:
        """A host no pool uses any more: emptied and kept, or stopped."""
        with self._lock:
            host = self._own.get(address)
            keep = (
                self.reuse_processes
                and host is not None
                and address not in self._dead
                and address not in self._idle
            )
            if keep:
                self._idle.append(address)
        if keep and host is not None:
            try:
                clean = ray.get(host.handle.reset.remote(), timeout=ASK_WAIT_S)
            except Exception:
                clean = False
            if clean:
                return
            with self._lock:
                if address in self._idle:
                    self._idle.remove(address)
        self._stop_host(address)

    def _stop_host(self, address: str, keep_group: bool = False) -> None:
        """Kill a host this backend started, and its placement group once it is empty."""
        with self._lock:
            host = self._own.pop(address, None)
            if address in self._idle:
                self._idle.remove(address)
            self._watches.pop(address, None)
            self._dead.add(address)
            if host is None:
                return
            members = self._pg_hosts.get(host.pg.id.hex(), set())
            members.discard(address)
            empty = not members and not keep_group
            if empty:
                self._pg_hosts.pop(host.pg.id.hex(), None)
        with contextlib.suppress(Exception):
            ray.kill(host.handle, no_restart=True)
        if empty:
            with contextlib.suppress(Exception):
                remove_placement_group(host.pg)

    def _handle(self, slot: Slot) -> Any:
        """The actor handle of a slot's host (another driver's: found by name)."""
        host = self._own.get(slot.address)
        if host is not None:
            return host.handle
        handle = self._handles.get(slot.address)
        if handle is not None:
            return handle
        try:
            handle = ray.get_actor(slot.address, namespace=self.namespace)
        except ValueError:
            self._dead.add(slot.address)
            raise WorkerLostError(
                f"the slot actor {slot.address} on {slot.host} is gone (no Ray actor of that "
                f"name in namespace {self.namespace!r})"
            ) from None
        with self._lock:
            self._handles.setdefault(slot.address, handle)
        return handle

    def _near(self, args: tuple) -> Slot | None:
        """The slot of the first input future that has a live one, else any live host."""
        for value in args:
            if isinstance(value, RayFuture) and value.slot is not None and self.alive(value.slot):
                return value.slot
        with self._lock:
            live = [h for a, h in self._own.items() if a not in self._dead and h.ip]
        if not live:
            return None
        return Slot(index=0, address=live[0].address, host=live[0].ip, name="any")

    def _view(self, future: DataProtoFuture) -> DataProtoFuture:
        """A ``DataProtoFuture`` as a rank receives it: resolved through its host."""
        return future.with_runner(SlotRunner(self.namespace))

    def _order(self, key: str) -> threading.Lock:
        with self._lock:
            lock = self._order_locks.get(key)
            if lock is None:
                lock = self._order_locks[key] = threading.Lock()
            return lock

    def _on_lost(self, future: RayFuture, exc: BaseException) -> None:
        """A call failed because its own actor died: that slot is dead from now on (its
        ``watch`` call says so too, a moment later)."""
        if isinstance(exc, rex.RayActorError) and future.slot is not None:
            self._dead.add(future.slot.address)

    def _wants_gpu(self, use_gpu: bool | None, need: int) -> bool:
        gpus = ray.cluster_resources().get("GPU", 0.0)
        if use_gpu is None:
            return need > 0 and gpus >= need
        if use_gpu and gpus < need:
            raise ValueError(
                f"the pool asks for GPUs (use_gpu=True) for {need} ranks but the Ray cluster "
                f"has {gpus:g}; use use_gpu=None/False, or add GPU nodes"
            )
        return bool(use_gpu)

    def _check_fits(self, counts: list[int], bundle: dict[str, float]) -> None:
        """A pool the cluster could never hold is a ``ValueError`` now, not a wait."""
        need = sum(counts)
        total = ray.cluster_resources()
        short = {k: v * need for k, v in bundle.items() if total.get(k, 0.0) < v * need}
        if short:
            have = {k: total.get(k, 0.0) for k in short}
            raise ValueError(
                f"cannot place pool {counts}: {need} slots of {bundle} need {short} but the Ray "
                f"cluster has {have} in all; use a smaller pool"
                + (
                    ", or start the backend with more (RayBackend(max_slots=...))"
                    if SLOT_RESOURCE in short
                    else ""
                )
            )
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        for count in counts:
            if count and not any(
                all(res.get(k, 0.0) >= v * count for k, v in bundle.items()) for res in nodes
            ):
                raise ValueError(
                    f"cannot place pool {counts}: the {count} ranks of one node must share a "
                    f"Ray node, and no node has {count} x {bundle}"
                )

    def _check_usable(self, slot: Slot, ref: InstanceRef | None) -> None:
        self._check_open()
        if slot.address in self._dead:
            what = f"{ref.group} rank {ref.rank}" if ref is not None else f"slot {slot.index}"
            raise WorkerLostError(
                f"the worker process hosting {what} ({slot.address} on {slot.host}) died; "
                "WorkerGroup.recover() rebuilds lost ranks"
            )

    def _check_open(self, doing: str = "") -> None:
        if self._closed:
            raise self._closed_error(doing)

    def _closed_error(self, doing: str = "") -> RuntimeError:
        what = f"cannot {doing}: " if doing else ""
        return RuntimeError(
            f"{what}this RayBackend was shut down (backend.shutdown() or "
            "hybridflow_dask.shutdown()); its slot actors and results are gone"
        )

    def _ask(self, ref: ray.ObjectRef, address: str = "") -> Any:
        """A short question's answer (a port, the registry), Ray's errors translated."""
        try:
            return ray.get(ref, timeout=ASK_WAIT_S)
        except Exception as exc:
            raise translate(exc, f"slot actor {address}" if address else "the registry") from exc


def _on_its_thread(method: Any, lent: bool, **options: Any) -> Any:
    """A slot actor's method, sent where the instance runs: the actor's default thread
    (``lent``), or the group whose threads wait for instances with threads of their own;
    with Ray's other task ``options`` (a ``name``)."""
    if not lent:
        options["concurrency_group"] = THREADED
    return method.options(**options) if options else method


def _resources(wanted: Mapping[str, float]) -> dict[str, float]:
    available = ray.available_resources()
    return {k: available.get(k, 0.0) for k in wanted}
