"""Results on a Ray cluster as the core sees them, on both sides of a call.

A ``RayFuture`` is an ``ObjectRef`` plus where its value comes from (the group, method
and rank, or a routing function's label, and the slot), so a failure can name what was
lost. In a call's arguments a future travels as an ``Input``: the reference rides inside
the message instead of standing at the top level, and the slot actor awaits it itself
(Ray still fetches the object from wherever it lives, never through the driver); see
``host`` for why. ``translate`` turns Ray's errors into the contract's: a method's own
exception (``RayTaskError.cause``) with its notes, and ``WorkerLostError`` for a dead
actor or lost object. ``resolve_all`` is the gather both sides use; ``SlotRunner`` is the
runner a ``DataProtoFuture`` gets inside a slot actor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray
from ray import exceptions as rex

from ...protocol import DataProto, DataProtoFuture
from ..base import Slot, WorkerLostError

__all__ = [
    "Input",
    "RayFuture",
    "SlotRunner",
    "is_lost",
    "mark_inputs",
    "resolve_all",
    "translate",
    "writable",
]

#: How often a waiting gather looks again (for a shutdown by another thread).
POLL_S = 0.1

#: Ray's errors that mean the process or the data behind a future is gone.
_LOST = (
    rex.RayActorError,  # ActorDiedError, ActorUnavailableError
    rex.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError, ...
    rex.WorkerCrashedError,
    rex.NodeDiedError,
    rex.LocalRayletDiedError,
)


class RayFuture:
    """One result on the cluster: ``ref`` and where it was made (``slot``, ``origin``).

    ``origin`` names it in errors (``"grpo.generate on rank 1"``). Gathering goes through
    ``RayBackend.gather`` (``hybridflow_dask.get``); ``result()`` is there for people who
    hold one.
    """

    __slots__ = ("origin", "ref", "slot")

    def __init__(self, ref: ray.ObjectRef, slot: Slot | None, origin: str) -> None:
        self.ref = ref
        self.slot = slot
        self.origin = origin

    def result(self, timeout: float | None = None) -> Any:
        """The value, or the method's own exception (``WorkerLostError`` for a lost one)."""
        try:
            return ray.get(self.ref, timeout=timeout)
        except rex.GetTimeoutError:
            raise TimeoutError(f"{self.origin} did not finish within {timeout}s") from None
        except Exception as exc:
            raise translate(exc, self) from _chained(exc)

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0, fetch_local=False)
        return bool(ready)

    def __getstate__(self) -> tuple:
        return self.ref, self.slot, self.origin

    def __setstate__(self, state: tuple) -> None:
        self.ref, self.slot, self.origin = state

    def __repr__(self) -> str:
        return f"<RayFuture {self.origin} {self.ref.hex()[:12]}>"


class Input:
    """A future standing in a call's arguments: awaited by the host where the call runs."""

    __slots__ = ("origin", "ref", "slot")

    def __init__(self, future: RayFuture) -> None:
        self.ref, self.slot, self.origin = future.ref, future.slot, future.origin

    def __getstate__(self) -> tuple:
        return self.ref, self.slot, self.origin

    def __setstate__(self, state: tuple) -> None:
        self.ref, self.slot, self.origin = state


def is_lost(exc: BaseException) -> bool:
    """Whether a Ray error says the process or the object behind a future is gone."""
    return isinstance(exc, _LOST)


def translate(exc: BaseException, where: RayFuture | Input | str) -> BaseException:
    """The contract's error for what ``ray.get`` raised on ``where``'s value.

    A method's exception comes back as itself (Ray pickled it with its notes, its
    ``hybridflow_origin`` and ``remote_traceback``); a dead actor, node or lost object is
    a ``WorkerLostError`` naming the rank (the group and ``rank N`` are in ``origin``).
    """
    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause
        if isinstance(cause, BaseException):
            return translate(cause, where) if isinstance(cause, _LOST) else cause
        return RuntimeError(str(exc))
    if isinstance(exc, _LOST):
        origin = where if isinstance(where, str) else where.origin
        slot = None if isinstance(where, str) else where.slot
        place = f" ({slot.address} on {slot.host})" if slot is not None else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return WorkerLostError(
            f"the worker process behind {origin}{place} is gone: {reason} (Ray: "
            f"{type(exc).__name__}); WorkerGroup.recover() rebuilds a lost rank"
        )
    return exc


def _chained(exc: BaseException) -> BaseException | None:
    """What a translated error is raised ``from``: Ray's own error for a lost worker
    (its reason), nothing for a method's exception (it is the original)."""
    return exc if is_lost(exc) else None


def resolve_all(
    futures: Sequence[RayFuture],
    check: Callable[[], None] = lambda: None,
    on_lost: Callable[[RayFuture, BaseException], None] = lambda f, e: None,
) -> list[Any]:
    """The values of ``futures`` in order, raising the contract's way.

    A lost worker raises ``WorkerLostError`` as soon as it is seen (``on_lost`` is told
    which future and Ray's error first); a method's error is raised once every future
    before it is done, the first in list order. ``check`` runs between waits (a backend
    shut down by another thread raises there).
    """
    if not futures:
        return []
    refs = [f.ref for f in futures]
    try:  # the common case: every value arrives within the first wait
        return list(ray.get(refs, timeout=POLL_S))
    except Exception:  # still running, or failed: which one first, in list order, below
        pass
    unique = list(dict.fromkeys(refs))  # ray.wait refuses the same reference twice
    owner = {ref: f for ref, f in zip(refs, futures)}
    values: dict[ray.ObjectRef, Any] = {}
    errors: dict[ray.ObjectRef, BaseException] = {}
    order = {ref: i for i, ref in reversed(list(enumerate(refs)))}
    while True:
        done = [ref for ref in unique if ref not in values and ref not in errors]
        ready, waiting = ray.wait(done, num_returns=len(done), timeout=0, fetch_local=True)
        for ref in sorted(ready, key=order.__getitem__):
            try:
                values[ref] = ray.get(ref)
            except Exception as exc:
                error = translate(exc, owner[ref])
                if isinstance(error, WorkerLostError):
                    on_lost(owner[ref], exc)
                    raise error from _chained(exc)
                errors[ref] = error
        if errors:
            first = min(errors, key=order.__getitem__)
            if all(ref in values for ref in refs[: order[first]]):
                raise errors[first]
            waiting = [ref for ref in waiting if order[ref] < order[first]]
        if not waiting:
            return [values[ref] for ref in refs]
        check()
        ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S, fetch_local=True)


def mark_inputs(values: Any, runner: Callable[[DataProtoFuture], DataProtoFuture]) -> Any:
    """A call's ``args`` tuple or ``kwargs`` dict as it travels: each top-level
    ``RayFuture`` as an ``Input``, each ``DataProtoFuture`` given ``runner``'s view."""

    def one(value: Any) -> Any:
        if isinstance(value, RayFuture):
            return Input(value)
        if isinstance(value, DataProtoFuture):
            return runner(value)
        return value

    if isinstance(values, dict):
        return {k: one(v) for k, v in values.items()}
    return tuple(one(v) for v in values)


def has_inputs(values: Any) -> bool:
    items = values.values() if isinstance(values, dict) else values
    return any(isinstance(v, Input) for v in items)


def writable(value: Any, depth: int = 0) -> Any:
    """``value`` with read-only numpy arrays replaced by copies.

    Ray hands numeric numpy arrays out as read-only views of its object store; a worker
    method that changes its input in place (as it may on the Dask backend) would fail.
    Tensors and DataProto tensors already arrive writable. Containers are looked into a
    few levels deep.
    """
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if depth >= 3:
        return value
    if isinstance(value, DataProto):
        batch = value.non_tensor_batch
        for key, array in batch.items():
            if isinstance(array, np.ndarray) and not array.flags.writeable:
                batch[key] = array.copy()
        return value
    if type(value) in (list, tuple):
        return type(value)(writable(v, depth + 1) for v in value)
    if type(value) is dict:
        return {k: writable(v, depth + 1) for k, v in value.items()}
    return value


class SlotRunner:
    """The ``FutureRunner`` of a ``DataProtoFuture`` inside a slot actor.

    Routing functions go to the host of the slot they are asked for (found by its actor
    name), or to this host; gathering waits with ``resolve_all``. Picklable: it travels
    inside the argument it resolves.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"namespace": self.namespace}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.namespace = state["namespace"]
        self._handles = {}

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> RayFuture:
        handle = self._handle(slot)
        ref = handle.run.remote(fn, mark_inputs(args, self.view), label)
        return RayFuture(ref, slot, label)

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        picked = [f for f in futures if isinstance(f, RayFuture)]
        values = iter(resolve_all(picked))
        return [next(values) if isinstance(f, RayFuture) else f for f in futures]

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, RayFuture)

    def view(self, future: DataProtoFuture) -> DataProtoFuture:
        return future.with_runner(self)

    def _handle(self, slot: Slot | None) -> Any:
        if slot is None:
            return ray.get_runtime_context().current_actor
        handle = self._handles.get(slot.address)
        if handle is None:
            try:
                handle = ray.get_actor(slot.address, namespace=self.namespace)
            except ValueError:
                raise WorkerLostError(
                    f"the slot actor {slot.address} on {slot.host} is gone (no actor of that "
                    "name): the data routed there was lost with it"
                ) from None
            self._handles[slot.address] = handle
        return handle
