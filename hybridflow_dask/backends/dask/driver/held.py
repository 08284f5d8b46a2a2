"""Plain and small results of non-blocking calls, held by the driver instead of a worker.

A non-blocking call whose method returns ``None``, a bool, a number or a short string,
or any value whose wire form is at most ``hybridflow.hold-threshold`` (a few rows of a
``DataProto`` each, as a batch split among hundreds of ranks gives them), sends that value
back with its reply, and the worker keeps nothing: no Dask key, so the scheduler does no
work to register it and later release it, and reading it fetches nothing. That
bookkeeping was most of what a burst of non-blocking calls cost the driver, whose process
also runs an owned cluster's scheduler, and the registration most of such a call's time.
A small value is held as its wire form (``Sealed``): each read is a copy of its own, as a
fetch from a worker would be. Such a result becomes a Dask key only once another process
needs it: passed to a later call or task, it is first handed back to the worker that made
it (``DirectPath._promote``), so everything downstream sees an ordinary Dask key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from distributed import Future

from ..internals import Releases, wait_future
from ..wire.snapshot import Sealed

__all__ = ["NOT_HELD", "CallFuture", "handed_back", "held_from", "held_value", "holding"]

#: A ``CallFuture``'s ``held`` until (unless) its value comes back with its reply.
NOT_HELD: Any = object()


class CallFuture(Future):
    """The future of one rank of a non-blocking direct call.

    Its value is either on a worker under its key, as for any Dask future, or, when it is
    plain or small, ``held`` here (not a Dask key until ``promoted``). ``result()``
    answers either way; Dask's own functions (``Client.gather``, ``Client.submit``) know
    only the first kind: pass these futures to ``hf.get``, the backend, or a later call.
    """

    __slots__ = ("_releases", "held", "promoted")

    def __init__(self, key: str, client: Any, releases: Releases) -> None:
        super().__init__(key, client)
        self._releases = releases
        self.held: Any = NOT_HELD
        #: The hand-over of a held value to its worker, once started (the client's loop).
        self.promoted: asyncio.Future | None = None

    def result(self, timeout: float | None = None) -> Any:
        if not self.done() and not self.client.sync(wait_future, self, timeout):
            raise TimeoutError(f"{self.key} was not done within {timeout}s")
        if self.held is not NOT_HELD:
            return held_value(self.held)
        return super().result(timeout)

    def release(self) -> None:
        """Dropped (also by the garbage collector): released with others in one batch,
        and without a word to the scheduler while no worker keeps the value."""
        self._releases.release(self, local=self.held is not NOT_HELD and self.promoted is None)

    def __reduce__(self) -> Any:  # elsewhere it is an ordinary Dask future of the key
        return Future, (self.key,)


def held_from(reply: dict | None) -> Any:
    """What the driver holds of a non-blocking call's reply: its plain value, its small
    value sealed, or ``NOT_HELD`` (its worker keeps it)."""
    if not reply:
        return NOT_HELD
    if "value" in reply:
        return reply["value"]
    if "sealed" in reply:
        return Sealed(*reply["sealed"])
    return NOT_HELD


def handed_back(held: Any) -> Any:
    """A held result as the message handing it back to its worker carries it."""
    return held.packed() if type(held) is Sealed else held


def held_value(held: Any) -> Any:
    """A held result as its reader gets it: a plain one as it is, a sealed one opened."""
    return held.open() if type(held) is Sealed else held


def holding(futures: Iterable[Any]) -> list[CallFuture]:
    """The futures among ``futures`` whose value the driver holds (kept by a worker too
    once ``promoted``)."""
    return [f for f in futures if type(f) is CallFuture and f.held is not NOT_HELD]
