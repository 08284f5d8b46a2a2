"""``ResourcePool``: how many ranks a role needs, and on how many nodes.

A pool is a plain description until its first WorkerGroup is created; then it takes
slots from the backend, and it gives them back when its last group shuts down. Every
group built on one pool is colocated: rank ``i`` of each lives on the pool's slot ``i``,
and at most ``max_colocate_count`` groups may share a slot.

``split_resource_pool`` cuts a pool into consecutive sub-pools on the same slots;
``merge_resource_pool`` joins two pools into one whose ranks are the first pool's slots
then the second's (both keep working on their own).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from .backends.base import Backend, Slot

__all__ = [
    "ResourcePool",
    "ResourcePoolManager",
    "merge_resource_pool",
    "split_resource_pool",
]


@dataclass
class Placement:
    """Slots a root pool holds on one backend, and how many groups use each of them."""

    backend: Backend
    slots: list[Slot]
    users: int = 0
    slot_users: list[int] = field(default_factory=list)
    rendezvous: dict[Any, tuple[str, int]] = field(default_factory=dict)
    replaced: dict[Slot, Slot] = field(default_factory=dict)


class ResourcePool:
    """``process_on_nodes=[4, 4]``: four ranks on each of two nodes.

    The positional order is verl's ``RayResourcePool``: ``(process_on_nodes, use_gpu,
    name_prefix, max_colocate_count, detached, accelerator_type)``; ``n_gpus_per_node``
    is verl's base ``ResourcePool`` keyword. ``use_gpu=None`` means "GPUs if the cluster
    has them". ``max_colocate_count`` is how many groups may share one slot (colocated
    groups share the slot's process); a group beyond it is a ``ValueError``. ``detached``,
    ``accelerator_type`` and ``n_gpus_per_node`` are kept for verl code that reads them:
    Dask places by worker, not by Ray resources, so they change no placement.
    An empty pool (``ResourcePool()``) may be filled with ``add_node`` before first use.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool | None = None,
        name_prefix: str | None = None,
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
        *,
        n_gpus_per_node: int = 8,
    ) -> None:
        nodes = [] if process_on_nodes is None else list(process_on_nodes)
        for i, n in enumerate(nodes):
            _check_count(n, f"process_on_nodes[{i}]")
        if use_gpu not in (None, True, False):
            raise TypeError(f"use_gpu must be True, False or None (auto), got {use_gpu!r}")
        if name_prefix is not None and not isinstance(name_prefix, str):
            raise TypeError(f"name_prefix must be a str, got {name_prefix!r}")
        _check_count(max_colocate_count, "max_colocate_count")
        _check_count(n_gpus_per_node, "n_gpus_per_node")
        if accelerator_type is not None and not isinstance(accelerator_type, str):
            raise TypeError(f"accelerator_type must be a str or None, got {accelerator_type!r}")
        self._store = nodes
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix or ""
        self.max_colocate_count = max_colocate_count
        self.detached = bool(detached)
        self.accelerator_type = accelerator_type
        self.n_gpus_per_node = n_gpus_per_node
        self._parent: ResourcePool | None = None  # set on split sub-pools
        self._offset = 0
        self._parts: list[ResourcePool] = []  # set on merged pools
        self._merged_users = 0
        self._merged_rendezvous: tuple[str, int] | None = None
        self._placement: Placement | None = None
        self._lock = threading.Lock()

    # -- the verl surface ----------------------------------------------------------

    @property
    def store(self) -> list[int]:
        """Ranks per node (for a sub-pool: its own ranks on each node it touches)."""
        if self._parts:
            return [n for part in self._parts for n in part.store]
        if self._parent is None:
            return list(self._store)
        counts: dict[int, int] = {}
        for node in self.node_list():
            counts[node] = counts.get(node, 0) + 1
        return list(counts.values())

    @property
    def world_size(self) -> int:
        if self._parts:
            return sum(part.world_size for part in self._parts)
        return sum(self._store)

    def __call__(self) -> list[int]:
        return self.store

    def add_node(self, process_count: int) -> None:
        if self._placement is not None or self._parent is not None or self._parts:
            raise ValueError(
                "add_node works on a pool that is not split, merged or in use; make a new "
                "ResourcePool with the extra node instead"
            )
        _check_count(process_count, "process_count")
        self._store.append(process_count)

    def local_world_size_list(self) -> list[int]:
        """Per rank: how many ranks of the (root) pool share its node."""
        return self._per_rank(lambda root: [n for n in root._store for _ in range(n)])

    def local_rank_list(self) -> list[int]:
        """Per rank: its index among the (root) pool's ranks on its node."""
        return self._per_rank(lambda root: [i for n in root._store for i in range(n)])

    def node_list(self) -> list[int]:
        """Per rank: the index of its node in the root pool's ``process_on_nodes``."""
        return self._per_rank(
            lambda root: [node for node, n in enumerate(root._store) for _ in range(n)]
        )

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self.store}, use_gpu={self.use_gpu}, "
            f"max_colocate_count={self.max_colocate_count})"
        )

    # -- placement (used by WorkerGroup) ----------------------------------------------

    def acquire(self, backend: Backend) -> list[Slot]:
        """This pool's slots on ``backend`` for one more group (placing on first use)."""
        if self.world_size == 0:
            raise ValueError(
                "this ResourcePool has no nodes; add some with add_node(n) or build it as "
                "ResourcePool([n])"
            )
        if self._parts:
            return self._acquire_parts(backend)
        root, offset = self._root()
        with root._lock:
            placement = root._placement
            if placement is None:
                slots = backend.place(root._store, root.use_gpu, root.name_prefix or "pool")
                placement = Placement(backend, list(slots), slot_users=[0] * len(slots))
                root._placement = placement
            elif placement.backend is not backend:
                raise ValueError(
                    "this ResourcePool is already placed on another backend; make a new "
                    "ResourcePool for groups on a different backend"
                )
            span = range(offset, offset + self.world_size)
            _check_colocation(root, placement, span)
            for i in span:
                placement.slot_users[i] += 1
            placement.users += 1
            return placement.slots[offset : offset + self.world_size]

    def release(self) -> None:
        """Drop one group; the last one hands the slots back to the backend."""
        if self._parts:
            self._release_parts()
            return
        root, offset = self._root()
        with root._lock:
            placement = root._placement
            if placement is None:
                return
            for i in range(offset, offset + self.world_size):
                placement.slot_users[i] = max(0, placement.slot_users[i] - 1)
            placement.users -= 1
            if placement.users <= 0:
                root._placement = None
                placement.backend.release(placement.slots)

    def rendezvous(self, backend: Backend, slots: list[Slot]) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` shared by every group on this pool."""
        if self._parts:
            with self._lock:
                if self._merged_rendezvous is None:
                    self._merged_rendezvous = (slots[0].host, backend.free_port(slots[0]))
                return self._merged_rendezvous
        root, offset = self._root()
        with root._lock:
            placement = root._placement
            if placement is None:
                raise RuntimeError("rendezvous asked for a pool that holds no slots")
            key = (offset, self.world_size)  # a sub-pool at offset 0 is not its parent
            if key not in placement.rendezvous:
                slot = slots[0]
                placement.rendezvous[key] = (slot.host, backend.free_port(slot))
            return placement.rendezvous[key]

    def node_peers(self) -> list[list[Slot]]:
        """Per rank: every slot of the root pool on that rank's node, in local-rank order.

        What ``CUDA_VISIBLE_DEVICES`` is built from, so that ``LOCAL_RANK`` indexes the
        rank's own GPU in it (the torchrun model).
        """
        if self._parts:
            return [peers for part in self._parts for peers in part.node_peers()]
        root, offset = self._root()
        placement = root._placement
        if placement is None:
            raise RuntimeError("node_peers asked for a pool that holds no slots")
        nodes = root.node_list()
        by_node: dict[int, list[Slot]] = {}
        for node, slot in zip(nodes, placement.slots):
            by_node.setdefault(node, []).append(slot)
        return [by_node[nodes[i]] for i in range(offset, offset + self.world_size)]

    def replace_slot(self, backend: Backend, dead: Slot) -> Slot:
        """The slot that takes a dead one's place, the same for every group on the pool.

        Colocated groups recovering one after another land in the same new process.
        """
        if self._parts:
            return self._part_holding(dead).replace_slot(backend, dead)
        root, _ = self._root()
        with root._lock:
            placement = root._placement
            if placement is None or placement.backend is not backend:
                raise RuntimeError("replace_slot asked for a pool that holds no slots")
            slot = dead
            while slot in placement.replaced:  # an earlier replacement may have died too
                slot = placement.replaced[slot]
            if not backend.alive(slot):
                new = backend.replace(slot)
                placement.replaced[slot] = new
                placement.slots = [new if s == slot else s for s in placement.slots]
                slot = new
            return slot

    # -- internals ------------------------------------------------------------------------

    def _root(self) -> tuple[ResourcePool, int]:
        pool, offset = self, 0
        while pool._parent is not None:
            offset += pool._offset
            pool = pool._parent
        return pool, offset

    def _per_rank(self, of_root: Any) -> list[int]:
        if self._parts:
            return [v for part in self._parts for v in part._per_rank(of_root)]
        root, offset = self._root()
        return of_root(root)[offset : offset + self.world_size]

    def _acquire_parts(self, backend: Backend) -> list[Slot]:
        taken: list[ResourcePool] = []
        slots: list[Slot] = []
        try:
            for part in self._parts:
                slots.extend(part.acquire(backend))
                taken.append(part)
        except BaseException:
            for part in taken:
                part.release()
            raise
        with self._lock:
            self._merged_users += 1
        return slots

    def _release_parts(self) -> None:
        with self._lock:
            if self._merged_users <= 0:
                return
            self._merged_users -= 1
            if self._merged_users == 0:
                self._merged_rendezvous = None
        for part in self._parts:
            part.release()

    def _part_holding(self, slot: Slot) -> ResourcePool:
        for part in self._parts:
            if part._holds(slot):
                return part
        raise RuntimeError(f"no part of this merged pool holds slot {slot}")

    def _holds(self, slot: Slot) -> bool:
        if self._parts:
            return any(part._holds(slot) for part in self._parts)
        root, _ = self._root()
        placement = root._placement
        return placement is not None and (slot in placement.slots or slot in placement.replaced)


def _check_count(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_colocation(root: ResourcePool, placement: Placement, span: range) -> None:
    limit = root.max_colocate_count
    full = [i for i in span if placement.slot_users[i] >= limit]
    if full:
        raise ValueError(
            f"ResourcePool {root.name_prefix or root.store} allows max_colocate_count={limit} "
            f"group(s) per slot and slot(s) {full} already host {limit}; shut a group on it "
            "down, build the pool with a larger max_colocate_count, fuse the roles into one "
            "group (create_colocated_worker_cls), or use another pool"
        )


def split_resource_pool(
    resource_pool: ResourcePool, split_size: int | Sequence[int]
) -> list[ResourcePool]:
    """Cut a pool into consecutive sub-pools that share its slots (rank offsets preserved).

    Sub-pools keep the root's node layout: a rank's ``LOCAL_RANK`` is its place on its
    node in the pool that was split, as verl's sub-pools do.
    """
    if not isinstance(resource_pool, ResourcePool):
        raise TypeError(f"resource_pool must be a ResourcePool, got {resource_pool!r}")
    if resource_pool._parts:
        raise ValueError("split the pools before merging them; a merged pool cannot be split")
    total = resource_pool.world_size
    sizes = _split_sizes(total, split_size)
    subs, offset = [], 0
    for index, size in enumerate(sizes):
        sub = ResourcePool(
            [size],
            use_gpu=resource_pool.use_gpu,
            name_prefix=(
                f"{resource_pool.name_prefix}_split_{index}" if resource_pool.name_prefix else ""
            ),
            max_colocate_count=resource_pool.max_colocate_count,
            detached=resource_pool.detached,
            accelerator_type=resource_pool.accelerator_type,
            n_gpus_per_node=resource_pool.n_gpus_per_node,
        )
        sub._parent, sub._offset = resource_pool, offset
        subs.append(sub)
        offset += size
    return subs


def _split_sizes(total: int, split_size: int | Sequence[int]) -> list[int]:
    if isinstance(split_size, int) and not isinstance(split_size, bool):
        if split_size <= 0 or total % split_size:
            raise ValueError(f"cannot split a pool of {total} ranks into pieces of {split_size}")
        return [split_size] * (total // split_size)
    sizes = list(cast("Sequence[int]", split_size))  # a bool is refused just below
    if any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
        raise ValueError(f"split sizes {sizes} must be positive ints")
    if sum(sizes) != total:
        raise ValueError(f"split sizes {sizes} must add up to the pool's {total} ranks")
    return sizes


def merge_resource_pool(rp1: ResourcePool, rp2: ResourcePool) -> ResourcePool:
    """One pool whose ranks are ``rp1``'s slots then ``rp2``'s (placed or not).

    Groups on the merged pool are colocated with groups on ``rp1`` (its first ranks) and
    on ``rp2`` (the rest), as verl's merged placement groups are. Both pools must agree on
    ``use_gpu``, ``max_colocate_count``, ``n_gpus_per_node`` and ``detached``.
    """
    for name, pool in (("rp1", rp1), ("rp2", rp2)):
        if not isinstance(pool, ResourcePool):
            raise TypeError(f"{name} must be a ResourcePool, got {pool!r}")
    for attr in ("use_gpu", "max_colocate_count", "n_gpus_per_node", "detached"):
        a, b = getattr(rp1, attr), getattr(rp2, attr)
        if a != b:
            what = (
                "a GPU pool with a CPU pool"
                if attr == "use_gpu"
                else f"pools with different {attr}"
            )
            raise ValueError(f"cannot merge {what} ({attr}={a!r} and {b!r})")
    merged = ResourcePool(
        None,
        use_gpu=rp1.use_gpu,
        name_prefix=f"{rp1.name_prefix}_{rp2.name_prefix}",
        max_colocate_count=rp1.max_colocate_count,
        detached=rp1.detached,
        accelerator_type=rp1.accelerator_type,
        n_gpus_per_node=rp1.n_gpus_per_node,
    )
    merged._parts = [rp1, rp2]
    return merged


class ResourcePoolManager:
    """Named pools (``{"global_pool": [4, 4]}``) and which role uses which (``mapping``).

    Positional order as verl's: ``(resource_pool_spec, mapping, max_colocate_count,
    resource_pool_dict)``; ``use_gpu`` is a keyword.
    """

    def __init__(
        self,
        resource_pool_spec: dict[str, Sequence[int]],
        mapping: dict[Any, str],
        max_colocate_count: int = 10,
        resource_pool_dict: dict[str, ResourcePool] | None = None,
        *,
        use_gpu: bool | None = None,
    ) -> None:
        unknown = {pool for pool in mapping.values() if pool not in resource_pool_spec}
        if unknown:
            raise ValueError(
                f"mapping names pools that resource_pool_spec lacks: {sorted(unknown)}"
            )
        _check_count(max_colocate_count, "max_colocate_count")
        self.resource_pool_spec = dict(resource_pool_spec)
        self.mapping = dict(mapping)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.resource_pool_dict: dict[str, ResourcePool] = dict(resource_pool_dict or {})

    def create_resource_pool(self) -> dict[str, ResourcePool]:
        for name, nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = ResourcePool(
                nodes,
                use_gpu=self.use_gpu,
                name_prefix=name,
                max_colocate_count=self.max_colocate_count,
            )
        return dict(self.resource_pool_dict)

    def get_resource_pool(self, role: Any) -> ResourcePool:
        if not self.resource_pool_dict:
            self.create_resource_pool()
        try:
            return self.resource_pool_dict[self.mapping[role]]
        except KeyError:
            raise ValueError(f"no resource pool is mapped to role {role!r}") from None

    def get_n_gpus(self) -> int:
        return sum(sum(nodes) for nodes in self.resource_pool_spec.values())
