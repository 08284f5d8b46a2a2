"""``LocalBackend``: every instance in the driver process, calls run inline in rank order.

The in-process sibling of the Dask backend, small enough to read in one sitting: for unit
tests, for stepping through worker code with ``pdb``, and to keep the ``Backend``
interface honest. It behaves like a remote backend in what a worker can observe:
arguments are copied when the call is made and results when the method returns, through
pickle as a remote backend's would travel (a worker mutating its shard never changes the
caller's batch, a caller or an instance changing a tensor afterwards never changes what
the other got, and an argument that cannot be pickled is refused at the call, naming the
group, method and rank, as ``DaskBackend`` refuses it), each rank's environment is in
``os.environ`` while that rank's code runs, and calls from several driver threads run one
at a time (an instance never sees two of its calls at once, nor a reply torn by another).
Ranks run one after another, so collectives between ranks (``torch.distributed``) cannot
work here; use ``DaskBackend`` for those. ``docs/backends.md`` walks through the contract
it implements (``backends/base.py``).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .base import InstanceRef, Slot
from .hosting import InstanceTable, PickleCopy, find_free_port

__all__ = ["LocalBackend", "LocalFuture"]


class LocalFuture:
    """An already-finished result (or error) of an inline call."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return True

    def __repr__(self) -> str:
        state = "error" if self._error is not None else "finished"
        return f"<LocalFuture {state}>"


class LocalBackend:
    """Runs every rank in this process; see the module docstring."""

    #: What ranks see as ``WG_BACKEND``.
    name = "local"
    #: Instances live in the driver's process: the conformance kit skips the tests that
    #: kill a worker process or attach a second driver.
    in_process = True

    def __init__(self) -> None:
        self._table = InstanceTable()
        self._groups: dict[str, list[InstanceRef]] = {}
        self._host = socket.gethostname()
        self._closed = False
        self._copy = PickleCopy()
        #: One call at a time, from whichever thread: copies in, method, copy out.
        self._calls = threading.RLock()

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` was called (the core refuses this backend's futures then)."""
        return self._closed

    # -- placement --------------------------------------------------------------------

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        self._check_open()
        if use_gpu:
            import torch

            if not torch.cuda.is_available():
                raise ValueError("use_gpu=True but this process sees no CUDA device")
        device = f"cuda:{_current_gpu()}" if use_gpu else "cpu"
        return [
            Slot(index=i, address="local", host="127.0.0.1", node=node, device=device, name=name)
            for i, node in enumerate(
                n for n, count in enumerate(process_on_nodes) for _ in range(count)
            )
        ]

    def release(self, slots: Sequence[Slot]) -> None:
        pass

    def free_port(self, slot: Slot) -> int:
        self._check_open()
        return find_free_port("127.0.0.1")  # every rank lives in this process

    # -- instances and calls ------------------------------------------------------------

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict[str, str]
    ) -> LocalFuture:
        self._check_open()
        self._groups.setdefault(ref.group, []).append(ref)
        label = f"{ref.group}.__init__"
        return self._run(lambda a, k: self._table.create(ref, cls, a, k, env), args, kwargs, label)

    def call(
        self,
        ref: InstanceRef,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool = False,
    ) -> LocalFuture:
        self._check_open()
        where = f"{label} for rank {ref.rank}"
        return self._run(lambda a, k: self._table.invoke(ref, method, a, k), args, kwargs, where)

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> LocalFuture:
        self._check_open()
        return self._run(lambda a, k: fn(*a, **k), args, {}, label)

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Each future's value (the first error raised); other values as they are."""
        self._check_open()
        return [f.result() if isinstance(f, LocalFuture) else f for f in futures]

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, LocalFuture)

    def alive(self, slot: Slot) -> bool:
        return not self._closed

    def replace(self, slot: Slot) -> Slot:
        self._check_open()
        return slot  # the driver process is every slot; it cannot die under its own feet

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        for ref in refs:
            self._table.remove(ref.key)
            group = self._groups.get(ref.group)
            if group is not None and ref in group:
                group.remove(ref)
                if not group:
                    del self._groups[ref.group]

    def lookup(self, group: str) -> list[InstanceRef]:
        self._check_open()
        return list(self._groups.get(group, []))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in self._table.names():
            self._table.remove(name)
        self._groups.clear()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ----------------------------------------------------------------------

    def _run(
        self, fn: Callable[[tuple, dict], Any], args: tuple, kwargs: dict, where: str
    ) -> LocalFuture:
        """Copies in (refused at once if they cannot travel), the call, a copy out."""
        with self._calls:
            failed = next((f for f in (*args, *kwargs.values()) if _failed(f)), None)
            if failed is not None:  # an input's error, as a remote gather would raise it
                return failed
            what = f"the arguments of {where}"
            a = self._copy.copy(tuple(_resolve(v) for v in args), what)
            k = self._copy.copy({key: _resolve(v) for key, v in kwargs.items()}, what)
            try:
                return LocalFuture(self._copy.copy(fn(a, k), f"the result of {where}"))
            except Exception as exc:
                return LocalFuture(error=exc)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LocalBackend is shut down")


def _current_gpu() -> str:
    """The driver's current GPU as ``CUDA_VISIBLE_DEVICES`` names it (``Slot.device``)."""
    import torch

    index = torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [v for v in visible if v]
    return visible[index] if index < len(visible) else str(index)


def _resolve(value: Any) -> Any:
    return value.result() if isinstance(value, LocalFuture) else value


def _failed(value: Any) -> LocalFuture | None:
    return value if isinstance(value, LocalFuture) and value._error is not None else None
