"""The jobs an instance runs: building it, and one method call.

Both run where the instance lives (its actor's thread, or inline) and end with the
error annotated with the group, method and rank. A call's result is captured as the
method returns when the call says it outlives the return (``snapshot``), before the
instance's next call can change it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

from ..base import InstanceRef
from .copies import CopyPolicy
from .failures import annotate_error, explain_init_error

__all__ = ["Construct", "Hosted", "Invoke", "Record"]


class Hosted(Protocol):
    """What a job needs of the place its instance lives (``Actor``, or inline)."""

    ref: InstanceRef
    obj: Any

    def start_loop(self) -> None:
        """Give the instance an event loop of its own, from now until it is destroyed."""
        ...


class Record(Protocol):
    """A call's phase times, stamped as it goes (see the Dask backend's call log)."""

    inputs: float | None
    start: float | None
    stop: float | None


class Construct:
    """The job that builds an instance."""

    method = "__init__"

    def __init__(self, cls: type, args: tuple, kwargs: dict, record: Record | None = None) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs
        self.record = record
        self.capture = None

    def __call__(self, hosted: Hosted) -> None:
        if has_coroutines(self.cls):
            hosted.start_loop()  # the loop lives as long as the instance, from its start
        try:
            hosted.obj = self.cls(*self.args, **self.kwargs)
        except BaseException as exc:
            raise annotate_error(explain_init_error(exc), hosted.ref, "__init__")  # noqa: B904


class Invoke:
    """The job that runs one method call.

    ``copy``: the result is copied with it as the method returns (a snapshot), because it
    is kept, or written out after the next call may have run; ``None``: handed over as is.
    """

    def __init__(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        copy: CopyPolicy | None,
        record: Record | None = None,
    ) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs
        self.record = record  # stamped by the actor as the method starts and ends
        self._copy = copy
        self._ref: InstanceRef | None = None

    @property
    def capture(self) -> Callable[[Any], Any] | None:
        """The snapshot, or ``None``. Made on each access: a bound method kept in an
        attribute of its own object is a reference cycle, and would hold the call's
        inputs (a batch) until the garbage collector's next full pass."""
        return self._snapshot if self._copy is not None else None

    def __call__(self, hosted: Hosted) -> Any:
        self._ref = hosted.ref
        try:
            return getattr(hosted.obj, self.method)(*self.args, **self.kwargs)
        except BaseException as exc:
            raise annotate_error(exc, hosted.ref, self.method)  # noqa: B904

    def _snapshot(self, result: Any) -> Any:
        ref, copy = self._ref, self._copy
        assert ref is not None and copy is not None  # set by __call__, before any result
        try:
            return copy.copy(result, f"the result of {ref.group}.{self.method} (rank {ref.rank})")
        except TypeError as exc:
            raise annotate_error(exc, ref, self.method) from exc.__cause__


def has_coroutines(cls: type) -> bool:
    return any(inspect.iscoroutinefunction(getattr(cls, name, None)) for name in dir(cls))
