"""How an instance's inputs and results are copied: one policy per backend, one rule.

A value needs a copy exactly where two parties could otherwise share its memory: an input
that is the very object a colocated producer keeps (a consumer changing it in place would
change the producer's stored result), and a result that outlives its method's return
(kept for later, or written out after the instance's next call may have changed it).
Which values those are is decided once, in ``serve``; how to copy is the backend's
policy: Dask's serializers for the Dask backend (the way the value would travel), a
pickle round trip for the others.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Protocol

import cloudpickle

__all__ = ["CopyPolicy", "PickleCopy"]

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)  # nothing to copy


class CopyPolicy(Protocol):
    """Makes a copy of a value that shares no mutable memory with it."""

    def copy(self, value: Any, what: str) -> Any:
        """The copy; ``TypeError`` naming ``what`` when the value cannot travel at all."""
        ...


class PickleCopy:
    """Copies through pickle, as a value crossing to another process would be.

    Pickle protocol 5 hands large buffers (numpy arrays) out of band; each is copied once
    and the copy read back from it. What plain pickle refuses (a lambda, a class defined
    in a function) goes through cloudpickle, as Dask and Ray send it; a value neither can
    pickle could not reach another process either: ``TypeError`` naming ``what``, so an
    in-process backend refuses what a remote one refuses. A ``DataProtoFuture`` is a
    handle on results, not data: it stays itself.
    """

    def copy(self, value: Any, what: str) -> Any:
        if isinstance(value, _IMMUTABLE):
            return value
        from ...protocol.future import DataProtoFuture

        handles: list[Any] = []
        try:
            data, buffers = _dump(value, pickle.Pickler, handles, DataProtoFuture)
        except Exception:
            handles.clear()
            try:
                data, buffers = _dump(value, cloudpickle.CloudPickler, handles, DataProtoFuture)
            except Exception as exc:
                raise TypeError(
                    f"{what} cannot be sent to a worker: {exc!r}; pass picklable values "
                    "(tensors, arrays, DataProto, plain Python objects)"
                ) from exc
        unpickler = pickle.Unpickler(io.BytesIO(data), buffers=buffers)
        unpickler.persistent_load = handles.__getitem__  # type: ignore[method-assign]
        return unpickler.load()


def _dump(
    value: Any, pickler_class: type[pickle.Pickler], handles: list[Any], kept: type
) -> tuple[bytes, list[bytearray]]:
    """``value`` pickled with ``pickler_class``, objects of type ``kept`` by reference
    (into ``handles``), and copies of its out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = pickler_class(out, protocol=5, buffer_callback=buffers.append)

    def persistent_id(obj: Any) -> int | None:
        if isinstance(obj, kept):
            handles.append(obj)
            return len(handles) - 1
        return None

    pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    pickler.dump(value)
    return out.getvalue(), [bytearray(b.raw()) for b in buffers]
