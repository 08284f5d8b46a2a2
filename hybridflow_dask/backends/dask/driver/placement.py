"""Mapping a pool's ``process_on_nodes`` onto Dask workers: a pure function, tested alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...base import Slot

__all__ = ["WorkerInfo", "assign_slots", "workers_needed"]


@dataclass(frozen=True)
class WorkerInfo:
    address: str
    host: str
    name: str
    device: str = "cpu"
    worker_id: str = ""

    @property
    def has_gpu(self) -> bool:
        return self.device.startswith("cuda")


def workers_needed(process_on_nodes: Sequence[int], ranks_per_worker: int = 1) -> int:
    """How many worker processes a pool takes when each hosts up to ``ranks_per_worker``
    of its ranks (the ranks of one node entry never share a process with another's)."""
    return sum(-(-count // ranks_per_worker) for count in process_on_nodes)


def assign_slots(
    process_on_nodes: Sequence[int], free: Sequence[WorkerInfo], ranks_per_worker: int = 1
) -> list[Slot]:
    """One free worker per ``ranks_per_worker`` ranks (consecutive ranks share it); the
    ranks of one node entry share a host.

    Entries go to distinct hosts when the cluster has several; on a one-host cluster
    every entry fits on that host. Raises ``ValueError`` naming what is missing.
    """
    per = ranks_per_worker
    need = workers_needed(process_on_nodes, per)
    if need > len(free):
        raise ValueError(
            f"the pool needs {need} worker processes but only {len(free)} free ones are available"
            + (f" ({sum(process_on_nodes)} ranks, {per} per worker)" if per > 1 else "")
        )
    by_host: dict[str, list[WorkerInfo]] = {}
    for info in sorted(free, key=lambda w: (w.host, _name_key(w.name), w.address)):
        by_host.setdefault(info.host, []).append(info)
    single_host = len(by_host) == 1
    used_hosts: set[str] = set()
    slots: list[Slot] = []
    for node, count in enumerate(process_on_nodes):
        workers = -(-count // per)
        candidates = [
            h
            for h, ws in by_host.items()
            if len(ws) >= workers and (single_host or h not in used_hosts)
        ]
        if not candidates:
            free_by_host = {h: len(ws) for h, ws in by_host.items()}
            raise ValueError(
                f"node {node} of the pool needs {workers} workers on one host; free workers by "
                f"host: {free_by_host}"
            )
        host = min(candidates, key=lambda h: len(by_host[h]))  # tightest fit first
        used_hosts.add(host)
        taken, by_host[host] = by_host[host][:workers], by_host[host][workers:]
        for rank in range(count):
            info = taken[rank // per]
            slots.append(
                Slot(
                    index=len(slots),
                    address=info.address,
                    host=info.host,
                    node=node,
                    device=info.device,
                    name=str(info.name),
                    worker_id=info.worker_id,
                )
            )
    return slots


def _name_key(name: str) -> tuple:
    text = str(name)
    digits = "".join(ch for ch in text if ch.isdigit())
    return (text.rstrip("0123456789"), int(digits) if digits.isdigit() else -1, text)
