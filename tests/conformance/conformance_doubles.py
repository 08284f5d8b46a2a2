"""Deliberately broken backends: each breaks one guarantee of the contract, so the tests
in ``test_conformance_kit_catches.py`` can show the kit fails them, saying what is wrong.

Each is a ``LocalBackend`` with one thing taken away; the class is its own factory
(``--hf-backend=conformance_doubles:ReorderingBackend``).
"""

from __future__ import annotations

import copy
from typing import Any

from hybridflow_dask.backends import LocalBackend, LocalFuture
from hybridflow_dask.backends.base import InstanceRef


class _Deferred(LocalFuture):
    """A call's result that exists once the backend has run its queue."""

    __slots__ = ("_backend", "_inner")

    def __init__(self, backend: ReorderingBackend) -> None:
        super().__init__()
        self._backend = backend
        self._inner: LocalFuture | None = None

    def result(self, timeout: float | None = None) -> Any:
        if self._inner is None:
            self._backend.run_queue()
        assert self._inner is not None
        return self._inner.result()


class ReorderingBackend(LocalBackend):
    """Breaks per-instance order: non-blocking calls wait in a queue that runs last-issued
    first (when anything is gathered or a blocking call comes). Arguments are still
    copied when the call is made, so only the order is wrong."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[tuple[_Deferred, InstanceRef, str, tuple, dict]] = []

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
        if blocking:
            self.run_queue()
            return super().call(ref, method, args, kwargs, label=label)
        deferred = _Deferred(self)
        args = tuple(_snapshot(a) for a in args)
        kwargs = {k: _snapshot(v) for k, v in kwargs.items()}
        self._queue.append((deferred, ref, method, args, kwargs))
        return deferred

    def run_queue(self) -> None:
        queue, self._queue = self._queue, []
        for deferred, ref, method, args, kwargs in reversed(queue):
            deferred._inner = LocalBackend.call(self, ref, method, args, kwargs, label="")


class SilentLossBackend(LocalBackend):
    """Breaks death detection: says it hosts instances in processes (so the kit's process
    tests run), and when one "dies" (the kit's kill) its later calls quietly return
    ``None`` instead of raising ``WorkerLostError``; ``alive`` stays ``True``."""

    in_process = False

    def __init__(self) -> None:
        super().__init__()
        self._lost: set[str] = set()

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
        if method == "exit_process":  # the process "dies" here: nobody is told
            self._lost.add(ref.key)
        if ref.key in self._lost:
            return LocalFuture(None)
        return super().call(ref, method, args, kwargs, label=label, blocking=blocking)


class _ByReference:
    """A copy policy that copies nothing."""

    def copy(self, value: Any, what: str) -> Any:
        return value


class NoSnapshotBackend(LocalBackend):
    """Breaks copy semantics: arguments and results are handed over by reference."""

    def __init__(self) -> None:
        super().__init__()
        self._copy = _ByReference()  # type: ignore[assignment]


class UnannotatedErrorsBackend(LocalBackend):
    """Breaks error annotation: a failure reaches the caller as a bare exception of its
    type, without the notes naming the group, method and rank."""

    def gather(self, futures: Any) -> list[Any]:
        try:
            return super().gather(futures)
        except Exception as exc:
            raise type(exc)(*exc.args) from None


def _snapshot(value: Any) -> Any:
    return value if isinstance(value, LocalFuture) else copy.deepcopy(value)


def _value(value: Any) -> Any:
    return value.result() if isinstance(value, LocalFuture) else value
