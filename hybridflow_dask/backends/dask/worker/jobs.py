"""The jobs an instance's actor runs: building the instance, and one method call.

Both end in the instance's own thread (see ``actor``) with the error annotated with the
group, method and rank; a call's result is captured there too, as the method returns,
when it is to be kept or written later (see ``wire.snapshot``).
"""

from __future__ import annotations

import inspect
from typing import Any

from ...base import InstanceRef
from ...hosting import annotate_error, explain_init_error
from ..wire.snapshot import snapshot
from .actor import Actor
from .call_log import CallRecord

__all__ = ["Construct", "Invoke"]


class Construct:
    """The job that builds an instance in its actor's thread."""

    method = "__init__"

    def __init__(
        self, cls: type, args: tuple, kwargs: dict, record: CallRecord | None = None
    ) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs
        self.record = record

    def __call__(self, actor: Actor) -> None:
        if _has_coroutines(self.cls):
            actor.start_loop()  # the loop lives as long as the instance, from its start
        try:
            actor.obj = self.cls(*self.args, **self.kwargs)
        except BaseException as exc:
            raise annotate_error(explain_init_error(exc), actor.ref, "__init__")  # noqa: B904


class Invoke:
    """The job that runs one method call in its actor's thread.

    ``snapshot``: its result is copied as the method returns (see ``snapshot``), because
    it is kept here or written later by Dask's comm, after the next call may have run.
    """

    def __init__(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        snapshot: bool,
        record: CallRecord | None = None,
    ) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs
        self.record = record  # stamped by the actor as the method starts and ends
        self.capture = self._snapshot if snapshot else None
        self._ref: InstanceRef | None = None

    def __call__(self, actor: Actor) -> Any:
        self._ref = actor.ref
        try:
            return getattr(actor.obj, self.method)(*self.args, **self.kwargs)
        except BaseException as exc:
            raise annotate_error(exc, actor.ref, self.method)  # noqa: B904

    def _snapshot(self, result: Any) -> Any:
        ref = self._ref
        assert ref is not None
        try:
            return snapshot(result, f"the result of {ref.group}.{self.method} (rank {ref.rank})")
        except TypeError as exc:
            raise annotate_error(exc, ref, self.method) from exc.__cause__


def _has_coroutines(cls: type) -> bool:
    return any(inspect.iscoroutinefunction(getattr(cls, name, None)) for name in dir(cls))
