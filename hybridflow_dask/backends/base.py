"""The narrow boundary between the programming model and whatever runs the workers.

A backend speaks plain terms only: slots (places where instances live), classes and
arguments, method names, futures. WorkerGroups, dispatch modes and padding live above
this line and are the same code for every backend.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "Backend",
    "BackendFuture",
    "FutureList",
    "InstanceRef",
    "Slot",
    "WorkerLostError",
]


@dataclass(frozen=True)
class Slot:
    """One place a rank can live: a worker process (and the device it owns, if any).

    ``address`` is backend specific (a Dask worker address, or ``"local"``); ``host`` is
    what ``MASTER_ADDR`` is taken from; ``node`` is the index into the pool's
    ``process_on_nodes`` this slot was placed for.
    """

    index: int
    address: str
    host: str
    node: int = 0
    device: str = "cpu"
    name: str = ""
    #: The process behind the slot, where the backend can tell incarnations apart (a
    #: worker restarted at the same address is a different process).
    worker_id: str = ""


@dataclass(frozen=True)
class InstanceRef:
    """A handle on one rank's instance: which group it belongs to and where it lives."""

    group: str
    rank: int
    slot: Slot
    cls_name: str = ""
    #: Tells apart instances that reuse a group name and rank (a group made again, a
    #: recovered rank), so a late teardown of the old one never touches the new one.
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def name(self) -> str:
        """``"{group}/{rank}"``: how people see the rank."""
        return f"{self.group}/{self.rank}"

    @property
    def key(self) -> str:
        """Unique per instance: what backends index instances and call order by."""
        return f"{self.name}#{self.uid}"


class FutureList(list):
    """The per-rank futures of a non-blocking call, remembering the backend that made them.

    A plain list to the caller; ``hybridflow_dask.get`` gathers it through the backend,
    which can fail fast when a worker dies instead of waiting on each future in turn.
    """

    def __init__(self, futures: Any, backend: Backend) -> None:
        super().__init__(futures)
        self.backend = backend

    def __reduce__(self) -> tuple:
        return (list, (list(self),))


class WorkerLostError(RuntimeError):
    """The process hosting a rank died; the group's pending and later calls fail with this."""


@runtime_checkable
class BackendFuture(Protocol):
    """What the core needs of a backend's future: a way to wait for its value."""

    def result(self, timeout: float | None = None) -> Any: ...


@runtime_checkable
class Backend(Protocol):
    """Runs stateful instances on slots and methods on instances, returning futures.

    Arguments handed to ``create``/``call``/``submit`` may contain this backend's futures
    (top level of ``args``, or values of ``kwargs``); the backend resolves them where the
    call runs, so data never needs to pass through the driver.
    """

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        """Reserve one slot per rank of a pool; ``process_on_nodes[i]`` ranks share a host."""
        ...

    def release(self, slots: Sequence[Slot]) -> None:
        """Give slots back once no group uses them."""
        ...

    def free_port(self, slot: Slot) -> int:
        """A TCP port that is free on ``slot``'s host, for ``MASTER_PORT``."""
        ...

    def create(
        self,
        ref: InstanceRef,
        cls: type,
        args: tuple,
        kwargs: dict,
        env: dict[str, str],
    ) -> BackendFuture:
        """Construct ``cls(*args, **kwargs)`` on ``ref.slot`` with ``env`` in ``os.environ``."""
        ...

    def call(
        self,
        ref: InstanceRef,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool = False,
    ) -> BackendFuture:
        """Call ``method`` on the instance; calls to one instance run in issue order.

        ``blocking`` says the caller gathers the result at once, so a backend may hand the
        value back with its reply instead of keeping it where it was computed.
        """
        ...

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> BackendFuture:
        """Run a plain function (row routing, small bookkeeping) near its inputs."""
        ...

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Materialize futures in the driver, raising the first failure."""
        ...

    def is_future(self, obj: Any) -> bool:
        """Whether ``obj`` is one of this backend's futures."""
        ...

    def alive(self, slot: Slot) -> bool:
        """Whether the process behind ``slot`` is still the one instances were made in."""
        ...

    def replace(self, slot: Slot) -> Slot:
        """A live slot on the same host as a dead one, to re-create its instances on."""
        ...

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        """Drop instances (a group's shutdown)."""
        ...

    def lookup(self, group: str) -> list[InstanceRef]:
        """Instances of a named group made earlier, possibly by another driver."""
        ...

    def shutdown(self) -> None:
        """Stop what this backend started; idempotent."""
        ...
