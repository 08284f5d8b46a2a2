"""Mapping a pool's ``process_on_nodes`` onto Dask workers: a pure function, tested alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...base import Slot

__all__ = ["WorkerInfo", "assign_slots"]


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


def assign_slots(process_on_nodes: Sequence[int], free: Sequence[WorkerInfo]) -> list[Slot]:
    """One free worker per rank; the ranks of one node entry share a host.

    Entries go to distinct hosts when the cluster has several; on a one-host cluster
    every entry fits on that host. Raises ``ValueError`` naming what is missing.
    """
    need = sum(process_on_nodes)
    if need > len(free):
        raise ValueError(
            f"the pool needs {need} worker processes but only {len(free)} free ones are available"
        )
    by_host: dict[str, list[WorkerInfo]] = {}
    for info in sorted(free, key=lambda w: (w.host, _name_key(w.name), w.address)):
        by_host.setdefault(info.host, []).append(info)
    single_host = len(by_host) == 1
    used_hosts: set[str] = set()
    slots: list[Slot] = []
    for node, count in enumerate(process_on_nodes):
        candidates = [
            h
            for h, ws in by_host.items()
            if len(ws) >= count and (single_host or h not in used_hosts)
        ]
        if not candidates:
            free_by_host = {h: len(ws) for h, ws in by_host.items()}
            raise ValueError(
                f"node {node} of the pool needs {count} workers on one host; free workers by "
                f"host: {free_by_host}"
            )
        host = min(candidates, key=lambda h: len(by_host[h]))  # tightest fit first
        used_hosts.add(host)
        taken, by_host[host] = by_host[host][:count], by_host[host][count:]
        for info in taken:
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
