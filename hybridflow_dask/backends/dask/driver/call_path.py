"""What ``DaskBackend`` needs of a way for calls to travel: the call-path interface.

The backend writes each guarantee once, in its own flow (a rank that died fails the call
before anything is sent, a call that could not be sent is withdrawn so later calls go
ahead, every result's worker is remembered for liveness, one gather for every kind of
future), and leaves to the path only how a call travels:

- ``DirectPath`` (the default): a message to a handler the worker's plugin added, over
  one long-lived stream per worker, or over the socket lane for blocking calls;
- ``TaskPath`` (``hybridflow.call-path: task``): a Dask task pinned to the rank's worker,
  public Dask APIs only.

Either way a call's arguments are captured when it is made and its result when the
method returns (see ``wire.snapshot``), and what the driver holds is an ordinary
``distributed.Future`` (or, for a blocking call on the direct path, a ``RankReply``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, overload

from distributed import Future

from ...base import InstanceRef, Slot

__all__ = ["CallPath", "RankCall", "RankCalls", "all_are", "same_arguments", "same_objects"]


class RankCall(NamedTuple):
    """One rank's part of a call: its instance, its number there, its arguments."""

    ref: InstanceRef
    seq: int
    args: tuple
    kwargs: dict


class RankCalls(Sequence[RankCall]):
    """One call's ranks as columns: their instances (and those instances' keys), their
    numbers there, and their arguments, or one tuple and dict that every rank shares
    (``ONE_TO_ALL``). A call to hundreds of ranks then makes no object per rank on its
    way out, and each process's batch is zipped from the columns in C; a rank's
    ``RankCall`` is made when it is looked at (a rank sent alone, a failure)."""

    __slots__ = ("args", "keys", "kwargs", "refs", "seqs", "shared")

    def __init__(
        self,
        refs: Sequence[InstanceRef],
        keys: Sequence[str],
        seqs: Sequence[int],
        args: Any,
        kwargs: Any,
        *,
        shared: bool,
    ) -> None:
        self.refs, self.keys, self.seqs = refs, keys, seqs
        #: With ``shared``, the one tuple and dict; else a tuple and a dict per rank.
        self.args, self.kwargs = args, kwargs
        self.shared = shared

    def __len__(self) -> int:
        return len(self.refs)

    @overload
    def __getitem__(self, index: int) -> RankCall: ...

    @overload
    def __getitem__(self, index: slice) -> list[RankCall]: ...

    def __getitem__(self, index: int | slice) -> RankCall | list[RankCall]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        if self.shared:
            return RankCall(self.refs[index], self.seqs[index], self.args, self.kwargs)
        return RankCall(self.refs[index], self.seqs[index], self.args[index], self.kwargs[index])

    def __iter__(self) -> Iterator[RankCall]:
        return (self[i] for i in range(len(self)))


def same_objects(a: tuple | dict, b: tuple | dict) -> bool:
    """Whether ``a`` and ``b`` hold the very same objects, position by position (or key
    by key): ranks of one call given the same arguments share what is made of them."""
    if a is b or (not a and not b):
        return True
    if type(a) is dict:
        return type(b) is dict and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def all_are(values: Iterable[Any], obj: Any) -> bool:
    """Whether every one of ``values`` is ``obj`` itself (a call's ranks given the very
    same arguments, as ``ONE_TO_ALL`` hands them): in C, as it runs for every rank."""
    return all(map(operator.is_, values, itertools.repeat(obj)))


def same_arguments(args: tuple, kwargs: dict, other_args: tuple, other_kwargs: dict) -> bool:
    """``same_objects`` for both a rank's arguments and keyword arguments, without a
    call per rank when they are the very same tuple and dict (``ONE_TO_ALL``'s)."""
    return (args is other_args or same_objects(args, other_args)) and (
        kwargs is other_kwargs or same_objects(kwargs, other_kwargs)
    )


class CallPath(Protocol):
    """How creations, calls, withdrawals and teardowns reach an instance."""

    #: ``"direct"`` or ``"task"``: what ``DaskBackend.call_path`` reports.
    name: str

    def port(self, slot: Slot) -> int:
        """A TCP port free on ``slot``'s host, asked of its worker."""
        ...

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict, seq: int
    ) -> Any:
        """Build the instance on ``ref.slot`` as call number ``seq``."""
        ...

    def call(
        self,
        calls: RankCalls,
        method: str,
        *,
        label: str,
        blocking: bool,
        deadline: float | None = None,
    ) -> Sequence[Any]:
        """Send ``method`` to each rank of ``calls`` (one future each, in order); their
        arguments are captured before this returns. ``deadline`` (``time.time()``): no
        worker starts its part after it."""
        ...

    def skip(self, ref: InstanceRef, seq: int) -> None:
        """Call number ``seq`` will never come (or must not run): later calls go ahead."""
        ...

    def withdraw(self, ref: InstanceRef, seq: int) -> Any:
        """Like ``skip``, answered: a future of whether the call will not run (``False``:
        it had started)."""
        ...

    def destroy(self, ref: InstanceRef, seq: int) -> Any:
        """Drop the instance after every call issued before ``seq``."""
        ...

    def fetch(self, futures: Sequence[Future]) -> dict[str, Any]:
        """Values of finished ``futures`` this path can fetch faster than Dask's gather
        (the rest are left out, for Dask to gather)."""
        ...

    def plain_result(self, future: Future, default: Any) -> Any:
        """``future``'s value if it came back with its reply, else ``default``."""
        ...

    def submit_when_known(
        self, futures: Sequence[Future], submit: Callable[[Future | None], Future], label: str
    ) -> Future:
        """A task that depends on ``futures``, sent once the scheduler knows their keys:
        ``submit(None)`` at once when it does, else ``submit(pending)`` later, where
        ``pending`` is the future this returns now."""
        ...

    def close(self) -> None:
        """Stop sending; end what is still in flight."""
        ...
