"""The registry: a small detached actor that keeps each group's ``InstanceRef``s, so that
``lookup`` (``WorkerGroup.from_detached``) works from any driver on the cluster."""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["REGISTRY_NAME", "RegistryActor"]

#: The registry actor's name in the namespace.
REGISTRY_NAME = "hybridflow-registry"


def _registry_class() -> Any:
    """The registry: each group's ``InstanceRef``s by rank, so ``lookup`` works from any
    driver on the cluster. Defined in a function so Ray ships the class by value and its
    process imports nothing but Ray (it starts in a second, not after torch); it keeps
    the refs pickled, with the uid that tells a rank's incarnations apart."""

    class Registry:
        def __init__(self) -> None:
            self.groups: dict[str, dict[int, tuple[str, bytes]]] = {}

        def put(self, group: str, rank: int, uid: str, blob: bytes) -> None:
            """Add an instance; it replaces an earlier one of that rank (a recovered one)."""
            self.groups.setdefault(group, {})[rank] = (uid, blob)

        def get(self, group: str) -> list[bytes]:
            return [blob for _, blob in self.groups.get(group, {}).values()]

        def drop(self, group: str, uids: list[str]) -> None:
            """Forget these instances (and the group once it has none)."""
            members = self.groups.get(group, {})
            for rank, (uid, _) in list(members.items()):
                if uid in uids:
                    del members[rank]
            if not members:
                self.groups.pop(group, None)

    return ray.remote(Registry)


RegistryActor: Any = _registry_class()
