"""``ResourcePool``: how many ranks a role needs, and on how many nodes.

A pool is a plain description until its first WorkerGroup is created; then it takes
slots from the backend, and it gives them back when its last group shuts down. Every
group built on one pool is colocated: rank ``i`` of each lives on the pool's slot ``i``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .backends.base import Backend, Slot

__all__ = [
    "ResourcePool",
    "ResourcePoolManager",
    "merge_resource_pool",
    "split_resource_pool",
]


@dataclass
class Placement:
    """Slots a root pool holds on one backend, and how many groups use them."""

    backend: Backend
    slots: list[Slot]
    users: int = 0
    rendezvous: dict[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    replaced: dict[Slot, Slot] = field(default_factory=dict)


class ResourcePool:
    """``process_on_nodes=[4, 4]``: four ranks on each of two nodes.

    ``use_gpu=None`` means "GPUs if the cluster has them". ``max_colocate_count`` is how
    many groups may share one slot (kept for verl compatibility; colocated groups share
    the slot's process).
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool | None = None,
        max_colocate_count: int = 10,
        name_prefix: str | None = None,
    ) -> None:
        nodes = [] if process_on_nodes is None else list(process_on_nodes)
        if not nodes:
            raise ValueError(
                "ResourcePool needs at least one node with at least one process, e.g. "
                "ResourcePool([2]) for two ranks on one node"
            )
        for i, n in enumerate(nodes):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(
                    f"process_on_nodes[{i}] must be a positive int (ranks on that node), got {n!r}"
                )
        if use_gpu not in (None, True, False):
            raise TypeError(f"use_gpu must be True, False or None (auto), got {use_gpu!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count <= 0:
            raise ValueError(
                f"max_colocate_count must be a positive int, got {max_colocate_count!r}"
            )
        self._store = nodes
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix or ""
        self._parent: ResourcePool | None = None
        self._offset = 0
        self._placement: Placement | None = None
        self._lock = threading.Lock()

    # -- the verl surface ----------------------------------------------------------

    @property
    def store(self) -> list[int]:
        return list(self._store)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    def __call__(self) -> list[int]:
        return self.store

    def add_node(self, process_count: int) -> None:
        if self._placement is not None:
            raise ValueError("cannot add a node to a pool that already holds slots")
        if not isinstance(process_count, int) or process_count <= 0:
            raise ValueError(f"process_count must be a positive int, got {process_count!r}")
        self._store.append(process_count)

    def local_world_size_list(self) -> list[int]:
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        return [i for n in self._store for i in range(n)]

    def node_list(self) -> list[int]:
        return [node for node, n in enumerate(self._store) for _ in range(n)]

    def __repr__(self) -> str:
        return f"ResourcePool({self._store}, use_gpu={self.use_gpu})"

    # -- placement (used by WorkerGroup) ----------------------------------------------

    def acquire(self, backend: Backend) -> list[Slot]:
        """This pool's slots on ``backend`` (placing the root pool on first use)."""
        root, offset = self._root()
        with root._lock:
            placement = root._placement
            if placement is None:
                slots = backend.place(root._store, root.use_gpu, root.name_prefix or "pool")
                placement = root._placement = Placement(backend, list(slots))
            elif placement.backend is not backend:
                raise ValueError(
                    "this ResourcePool is already placed on another backend; make a new "
                    "ResourcePool for groups on a different backend"
                )
            placement.users += 1
            return placement.slots[offset : offset + self.world_size]

    def release(self) -> None:
        """Drop one user; the last one hands the slots back to the backend."""
        root, _ = self._root()
        with root._lock:
            placement = root._placement
            if placement is None:
                return
            placement.users -= 1
            if placement.users <= 0:
                root._placement = None
                placement.backend.release(placement.slots)

    def rendezvous(self, backend: Backend, slots: list[Slot]) -> tuple[str, int]:
        """``(MASTER_ADDR, MASTER_PORT)`` shared by every group on this pool."""
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

    def replace_slot(self, backend: Backend, dead: Slot) -> Slot:
        """The slot that takes a dead one's place, the same for every group on the pool.

        Colocated groups recovering one after another land in the same new process.
        """
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

    def _root(self) -> tuple[ResourcePool, int]:
        pool, offset = self, 0
        while pool._parent is not None:
            offset += pool._offset
            pool = pool._parent
        return pool, offset


def split_resource_pool(pool: ResourcePool, split_size: int | Sequence[int]) -> list[ResourcePool]:
    """Cut a pool into consecutive sub-pools that share its slots (rank offsets preserved)."""
    total = pool.world_size
    if isinstance(split_size, int):
        if split_size <= 0 or total % split_size:
            raise ValueError(f"cannot split a pool of {total} ranks into pieces of {split_size}")
        sizes = [split_size] * (total // split_size)
    else:
        sizes = list(split_size)
        if any(not isinstance(s, int) or s <= 0 for s in sizes) or sum(sizes) != total:
            raise ValueError(f"split sizes {sizes} must be positive and add up to {total}")
    subs, offset = [], 0
    for size in sizes:
        sub = ResourcePool([size], use_gpu=pool.use_gpu, max_colocate_count=pool.max_colocate_count)
        sub._parent, sub._offset = pool, offset
        sub.name_prefix = f"{pool.name_prefix}{offset}" if pool.name_prefix else ""
        subs.append(sub)
        offset += size
    return subs


def merge_resource_pool(pool_a: ResourcePool, pool_b: ResourcePool) -> ResourcePool:
    """One pool with the nodes of both (neither may be placed yet)."""
    if pool_a.use_gpu != pool_b.use_gpu:
        raise ValueError("cannot merge a GPU pool with a CPU pool")
    for p in (pool_a, pool_b):
        if p._placement is not None or p._parent is not None:
            raise ValueError("only unplaced, unsplit pools can be merged")
    return ResourcePool(
        pool_a.store + pool_b.store,
        use_gpu=pool_a.use_gpu,
        max_colocate_count=pool_a.max_colocate_count,
        name_prefix=pool_a.name_prefix,
    )


class ResourcePoolManager:
    """Named pools (``{"global_pool": [4, 4]}``) and which role uses which (``mapping``)."""

    def __init__(
        self,
        resource_pool_spec: dict[str, Sequence[int]],
        mapping: dict[Any, str],
        use_gpu: bool | None = None,
        max_colocate_count: int = 10,
    ) -> None:
        unknown = {pool for pool in mapping.values() if pool not in resource_pool_spec}
        if unknown:
            raise ValueError(
                f"mapping names pools that resource_pool_spec lacks: {sorted(unknown)}"
            )
        self.resource_pool_spec = dict(resource_pool_spec)
        self.mapping = dict(mapping)
        self.use_gpu = use_gpu
        self.max_colocate_count = max_colocate_count
        self.resource_pool_dict: dict[str, ResourcePool] = {}

    def create_resource_pool(self) -> dict[str, ResourcePool]:
        for name, nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = ResourcePool(
                nodes, self.use_gpu, self.max_colocate_count, name_prefix=name
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
