"""What a driver holds until a direct message is answered: a rank's reply, a call's replies.

A blocking call to many ranks is answered rank by rank, and its caller waits for all of
them at once. ``Replies`` is that call: every rank's outcome in one place, settled under
one lock (in bulk when a worker process answers for several ranks together), with one
flag for "all in, or one failed" (and an event made only for a caller that must sleep
until then: most callers read the replies themselves), and what the call was (each
rank's part, its deadline): all the driver's liveness needs to know of its ranks, so
they are tracked as one entry. ``RankReply`` is one rank's view of it, the future the
call path hands out per rank: a few slots, no lock or condition of its own, so a call to
hundreds of ranks does not build hundreds of ``concurrent.futures.Future``s. The call
holds no reference to its ranks' futures, so it lives exactly as long as they do.

Other direct messages (a creation, a teardown, a question to a worker) are answered in a
``ReplyFuture``, a ``concurrent.futures.Future`` that ``asyncio.wrap_future`` and
``concurrent.futures.wait`` accept.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, overload

from ..wire.keys import KeyRun
from .call_path import RankCall
from .lane import Lane, read_replies

__all__ = [
    "REPLY_KINDS",
    "RankReplies",
    "RankReply",
    "Replies",
    "ReplyFuture",
    "all_values",
    "one_call",
]


class Replies:
    """The outcomes of one blocking call's ranks, by index, each settled once."""

    __slots__ = (
        "__weakref__",
        "_changed",
        "_done",
        "_errors",
        "_left",
        "_lock",
        "_settled",
        "_values",
        "_waiting",
        "calls",
        "count",
        "deadline",
        "failed",
        "keys",
        "lanes",
        "over",
    )

    def __init__(
        self, calls: Sequence[RankCall], keys: KeyRun, deadline: float | None = None
    ) -> None:
        #: Each rank's part (its instance, its number there, its arguments), by index.
        self.calls = calls
        #: Each rank's key, by index.
        self.keys = keys
        #: The call's deadline (``time.time()``), or ``None``.
        self.deadline = deadline
        #: How many ranks the call has.
        self.count = count = len(calls)
        self._left = count
        self._done = [False] * count
        self._values: list[Any] = [None] * count
        self._errors: dict[int, BaseException] = {}
        self._lock = threading.Lock()
        #: Told of every settled rank while someone waits for some ranks (``wait_parts``;
        #: made then: most calls are waited for as a whole).
        self._changed: threading.Condition | None = None
        self._waiting = 0
        #: True once every reply is in, or one is a failure (set after what it covers).
        self.over = False
        #: Set with ``over``; made by a caller that sleeps until then (``wait``).
        self._settled: threading.Event | None = None
        self.failed = False
        #: The lanes that carry every one of its messages, when the caller reads them.
        self.lanes: tuple[Lane, ...] = ()

    def is_over(self) -> bool:
        return self.over

    def wait(self, timeout: float) -> bool:
        """Whether the call settled within ``timeout`` seconds; its caller reads its
        lanes' replies itself meanwhile, when it can (``read_replies``)."""
        if self.over:
            return True
        if self.lanes:
            give_up = time.monotonic() + timeout
            read_replies(self.lanes, self.is_over, timeout)
            if self.over:
                return True
            timeout = max(give_up - time.monotonic(), 0.0)
        with self._lock:
            if self.over:
                return True
            if self._settled is None:
                self._settled = threading.Event()
            settled = self._settled
        return settled.wait(timeout)

    def hand_over(self) -> None:
        """Its replies are waited for elsewhere from now on: the lanes' threads read them."""
        lanes, self.lanes = self.lanes, ()
        for lane in lanes:
            lane.hand_over()

    def settle(self, index: int, value: Any, error: BaseException | None) -> None:
        """Rank ``index``'s outcome, once: whoever settles it later (a reply after a
        broken lane was reported, say) changes nothing."""
        with self._lock:
            if self._done[index]:
                return
            if error is None:
                self._values[index] = value
            else:
                self._errors[index] = error
                self.failed = True
            self._done[index] = True  # last: a reader without the lock sees it all
            self._left -= 1
            settled = self._told()
        if settled is not None:
            settled.set()

    def settle_all(self, indices: Sequence[int], values: Sequence[Any]) -> None:
        """``settle`` rank ``indices[i]`` with the good value ``values[i]``, for each
        ``i``, under one lock for all of them (as slices when the ranks are consecutive
        and none was settled yet: a process's ranks usually are, and it answers once)."""
        done, kept = self._done, self._values
        start, stop = indices[0], indices[-1] + 1
        run = stop - start == len(indices) and list(range(start, stop)) == list(indices)
        with self._lock:
            if run and not any(done[start:stop]):
                kept[start:stop] = values
                done[start:stop] = [True] * len(indices)  # (after the values: see settle)
                self._left -= len(indices)
            else:
                for index, value in zip(indices, values):
                    if not done[index]:
                        kept[index] = value
                        done[index] = True
                        self._left -= 1
            settled = self._told()
        if settled is not None:
            settled.set()

    def _told(self) -> threading.Event | None:
        """(Lock held, ranks just settled.) Wake whoever waits for some ranks; once the
        call is over, mark it so, and give the event a sleeping caller waits on, if any
        (set outside the lock)."""
        if self._waiting and self._changed is not None:
            self._changed.notify_all()
        if not self.over and (self.failed or self._left == 0):
            self.over = True
            return self._settled
        return None

    def is_done(self, index: int) -> bool:
        return self._done[index]

    def value(self, index: int) -> Any:
        return self._values[index]

    def error(self, index: int) -> BaseException | None:
        return self._errors.get(index) if self.failed else None

    def wait_parts(self, indices: Sequence[int], timeout: float | None) -> bool:
        """Whether the ranks ``indices`` all settled, or one of them failed, within
        ``timeout`` seconds (as ``concurrent.futures.wait`` with ``FIRST_EXCEPTION``).
        The lanes' threads read meanwhile: a caller waiting for some ranks reads none."""
        self.hand_over()
        done, errors = self._done, self._errors

        def over() -> bool:
            return all(done[i] for i in indices) or any(i in errors for i in indices)

        with self._lock:
            if self._changed is None:
                self._changed = threading.Condition(self._lock)
            self._waiting += 1
            try:
                return self._changed.wait_for(over, timeout)
            finally:
                self._waiting -= 1

    def all_ok(self) -> bool:
        """Whether every reply is in and none is a failure."""
        return self.over and not self.failed


class RankReply:
    """One rank's part of a blocking call: a future of its value, settled by its call."""

    __slots__ = ("index", "replies")

    def __init__(self, replies: Replies, index: int) -> None:
        self.replies, self.index = replies, index

    @property
    def key(self) -> str:
        return self.replies.keys[self.index]

    def done(self) -> bool:
        return self.replies.is_done(self.index)

    def result(self, timeout: float | None = None) -> Any:
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self.replies.value(self.index)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        replies, index = self.replies, self.index
        if not replies.is_done(index) and not replies.wait_parts((index,), timeout):
            raise concurrent.futures.TimeoutError(f"{self.key} is not settled after {timeout}s")
        return replies.error(index)

    def set_result(self, value: Any) -> None:
        self.replies.settle(self.index, value, None)

    def set_exception(self, error: BaseException) -> None:
        self.replies.settle(self.index, None, error)

    @property
    def status(self) -> str:
        if not self.done():
            return "pending"
        return "error" if self.exception() is not None else "finished"


class RankReplies(Sequence[RankReply]):
    """A blocking call's futures, a ``RankReply`` per rank, made the first time one is
    looked at: a call answered in full is gathered straight from its ``Replies``."""

    __slots__ = ("_made", "replies")

    def __init__(self, replies: Replies) -> None:
        self.replies = replies
        self._made: list[RankReply] | None = None

    def __len__(self) -> int:
        return self.replies.count

    @overload
    def __getitem__(self, index: int) -> RankReply: ...

    @overload
    def __getitem__(self, index: slice) -> list[RankReply]: ...

    def __getitem__(self, index: int | slice) -> RankReply | list[RankReply]:
        return self._ranks()[index]

    def __iter__(self) -> Iterator[RankReply]:
        return iter(self._ranks())

    def _ranks(self) -> list[RankReply]:
        if self._made is None:
            self._made = [RankReply(self.replies, i) for i in range(len(self))]
        return self._made


def one_call(futures: Sequence[Any]) -> Replies | None:
    """The blocking call whose replies ``futures`` all are (all its ranks, or some), if any."""
    if type(futures) is RankReplies:
        return futures.replies
    first = futures[0] if futures else None
    if type(first) is not RankReply:
        return None
    # (two passes in C: this runs for every rank of every blocking call, twice)
    if set(map(type, futures)) == {RankReply} and set(map(_call_of, futures)) == {first.replies}:
        return first.replies
    return None


def all_values(call: Replies, futures: Sequence[Any]) -> list[Any] | None:
    """The values of ``futures`` when they are every rank of ``call`` in order and it was
    answered in full without a failure (the common blocking call), else ``None``."""
    if not call.all_ok() or len(futures) != call.count:
        return None
    in_order = type(futures) is RankReplies and futures.replies is call
    if not in_order and list(map(_index_of, futures)) != list(range(len(futures))):
        return None
    return list(call._values)


_call_of = operator.attrgetter("replies")
_index_of = operator.attrgetter("index")


class ReplyFuture(concurrent.futures.Future):
    """The outcome of a direct message that is not a blocking call's rank (a creation, a
    teardown, a question), never held by the scheduler."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    @property
    def status(self) -> str:
        if not self.done():
            return "pending"
        return "error" if self.exception() is not None else "finished"


#: What a direct message's caller holds until its reply: either kind.
REPLY_KINDS = (ReplyFuture, RankReply)
