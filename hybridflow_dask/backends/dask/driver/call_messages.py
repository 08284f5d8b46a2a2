"""What one direct call's messages are made of, rank by rank and process by process.

The direct path (``direct_path``) decides where each message goes and what becomes of
its reply; this module holds what those messages carry: each rank's packed arguments
(``Made``, shared by ranks given the very same objects), a call's ranks by index
(``CallParts``), and the batches that carry several ranks of one worker process as one
message (``LaneBatch`` on the socket lane, ``StreamBatch`` on the Dask stream), with the
rows of a ``DP_COMPUTE_PROTO`` call packed once per process where they can be
(``wire.row_pieces``). A rank's own ``Message`` is made only when it travels by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

from distributed import Future
from distributed.protocol.serialize import Serialized

from ....protocol import DataProtoFuture
from ...base import InstanceRef, Slot
from ..wire.keys import KeyRun
from ..wire.row_pieces import Piece
from .call_path import RankCall, RankCalls, all_are, same_arguments
from .replies import Replies

__all__ = [
    "IN_PIECE",
    "UNMADE",
    "CallParts",
    "LaneBatch",
    "Made",
    "Message",
    "SharedArguments",
    "StreamBatch",
    "each_message",
    "nested_futures",
    "one_part",
    "packed_bytes",
    "process_runs",
]


class Message:
    """One message to a worker and what to do with its reply."""

    __slots__ = ("address", "future", "inputs", "known", "msg", "op", "ref", "seq", "slot")

    def __init__(
        self,
        op: str,
        slot: Slot,
        ref: InstanceRef | None,
        seq: int | None,
        msg: dict,
        inputs: list[Future],
        future: Any,
    ) -> None:
        self.op, self.slot, self.ref, self.seq = op, slot, ref, seq
        self.address = slot.address
        self.msg, self.inputs, self.future = msg, inputs, future
        #: Futures the worker will ask the scheduler about itself: they must be done first.
        self.known: list[Future] = []


class Made(NamedTuple):
    """What a rank's message is made of: ranks given the very same arguments share one."""

    #: ``(args, kwargs)`` as the message carries them (packed, unless plain).
    packed: tuple[Any, Any]
    #: The futures among them (the worker resolves their keys).
    inputs: list[Future]
    #: Those inside its ``DataProtoFuture``s (its rank resolves them itself).
    known: list[Future]


#: What ``CallParts.made`` holds for a rank whose rows travel in its process's piece.
IN_PIECE = Made((None, None), [], [])
#: (Only while ``DirectPath._parts`` fills ``CallParts.made`` in.)
UNMADE = Made((None, None), [], [])


class CallParts:
    """One call's ranks, by index: what each one's message is made of, and its future.

    A rank's ``Message`` (a dict and a few objects) is made only when the rank travels
    by itself (the Dask comm, a lane of its own, a lane that broke); a batch of ranks to
    one process is written straight from here, so a call to hundreds of light ranks
    makes no message per rank.
    """

    __slots__ = (
        "calls",
        "common",
        "futures",
        "keys",
        "made",
        "pack",
        "pieces",
        "plain",
        "replies",
        "shared",
    )

    def __init__(
        self,
        calls: RankCalls,
        keys: KeyRun,
        common: dict[str, Any],
        made: list[Made],
        futures: Sequence[Any],
        replies: Replies | None,
        *,
        shared: bool = False,
        plain: bool = False,
        pieces: dict[int, tuple[Made, Piece]] | None = None,
        pack: Callable[[int], Made] | None = None,
    ) -> None:
        self.calls, self.keys, self.common = calls, keys, common
        #: Each rank's ``Made`` (the very same one for ranks given the same arguments;
        #: ``IN_PIECE`` for a rank whose rows travel in its process's piece).
        self.made = made
        #: The pieces of rows, by the first index of the ranks they carry.
        self.pieces = pieces or {}
        #: Packs rank ``index``'s own arguments (a rank of a piece sent by itself after all).
        self.pack = pack
        #: Whether every rank's is the very same one.
        self.shared = shared
        #: Whether no rank has future inputs (every rank may go on a lane).
        self.plain = plain
        self.futures = futures
        #: A blocking call's record (its ranks' futures are ``RankReply``s of it).
        self.replies = replies

    def message(self, index: int) -> Message:
        """Rank ``index``'s own message."""
        calls = self.calls
        ref, seq = calls.refs[index], calls.seqs[index]
        (args, kwargs), inputs, known = self._own(index)
        msg = self.common.copy()
        msg["instance"], msg["seq"], msg["key"] = calls.keys[index], seq, self.keys[index]
        msg["args"], msg["kwargs"] = args, kwargs
        message = Message("hf_call", ref.slot, ref, seq, msg, inputs, self.futures[index])
        message.known = known
        return message

    def _own(self, index: int) -> Made:
        """Rank ``index``'s ``Made``; packed now for a rank of a piece that travels
        without it after all (its lane broke, it failed, its batch is not its piece's)."""
        made = self.made[index]
        if made is IN_PIECE:
            made = self.made[index] = cast(Callable[[int], Made], self.pack)(index)
        return made

    def batch_msg(self, indices: Sequence[int]) -> dict:
        """One lane message for the ranks ``indices`` (of one process); the lane's reader
        gives each rank its own copy of arguments the batch carries once."""
        common = self.common
        return {
            "op": "calls",
            "driver": common["driver"],
            "method": common["method"],
            "deadline": common["deadline"],
            **self.batch_parts(indices, share_packed=True),
        }

    def batch_parts(self, indices: Sequence[int], *, share_packed: bool) -> dict:
        """What a batch carries of the ranks ``indices``: when every one has the very
        same arguments (plain ones, unless ``share_packed``), those once and each rank's
        ``(instance, seq, index)`` (its key made there from the call's first key and its
        index: see ``KeyRun``), zipped from the columns in C; else each rank's own part."""
        calls, keys, made = self.calls, self.keys, self.made
        piece = self.pieces.get(indices[0])
        if piece is not None and len(indices) == len(piece[1].bounds):
            return {
                "args": piece[0].packed[0],
                "kwargs": piece[0].packed[1],
                "keys": (keys.head, keys.first),
                "calls": list(
                    zip(
                        map(calls.keys.__getitem__, indices),
                        map(calls.seqs.__getitem__, indices),
                        indices,
                    )
                ),
                "rows": piece[1].bounds,
            }
        if self.pieces:
            for index in indices:
                self._own(index)
        first = made[indices[0]]
        if (self.shared or all(made[i] is first for i in indices)) and (
            share_packed or _travels_plain(first)
        ):
            instances = map(calls.keys.__getitem__, indices)
            return {
                "args": first.packed[0],
                "kwargs": first.packed[1],
                "keys": (keys.head, keys.first),
                "calls": list(zip(instances, map(calls.seqs.__getitem__, indices), indices)),
            }
        return {
            "calls": [
                {
                    "instance": calls.keys[i],
                    "seq": calls.seqs[i],
                    "key": keys[i],
                    "args": made[i].packed[0],
                    "kwargs": made[i].packed[1],
                }
                for i in indices
            ]
        }


class LaneBatch:
    """Several ranks of one call to one worker process, sent and answered as one."""

    __slots__ = ("indices", "parts")

    def __init__(self, parts: CallParts, indices: Sequence[int]) -> None:
        self.parts, self.indices = parts, indices

    def messages(self) -> list[Message]:
        """Each rank's own message (its lane broke: each is handled by itself)."""
        return [self.parts.message(index) for index in self.indices]


class StreamBatch:
    """Several ranks of one non-blocking call to one worker process, on its Dask stream
    as one message (``hf_calls``). Ranks handed the very same plain arguments share them
    (the message carries them once, and each rank's ``(instance, number, index)``);
    otherwise each rank's part carries its own, which Dask's comm serializes part by part,
    so no two ranks read the same objects. Its reply holds each rank's, in order."""

    __slots__ = ("address", "indices", "inputs", "known", "msg", "op", "parts", "ref", "slot")

    def __init__(self, parts: CallParts, indices: Sequence[int], slot: Slot) -> None:
        self.parts, self.indices, self.slot = parts, indices, slot
        self.address = slot.address
        self.op, self.ref, self.inputs, self.known = "hf_calls", None, (), ()
        # (Dask's comm hands every rank the same objects for what the batch carries once)
        self.msg = {**parts.common, **parts.batch_parts(indices, share_packed=False)}

    def messages(self) -> list[Message]:
        """Each rank's own message (to fail or withdraw each by itself)."""
        return [self.parts.message(index) for index in self.indices]

    def answers(self, reply: dict | None, error: BaseException | None) -> list[dict | None]:
        """Each rank's reply: its own, or the batch's when the batch failed as a whole
        (``None`` each when the stream broke: ``error``)."""
        count = len(self.indices)
        if error is not None or reply is None:
            return [None] * count
        replies = reply.get("replies")  # (a tuple, as Dask's comm decodes a list)
        if isinstance(replies, (list, tuple)) and len(replies) == count:
            return list(replies)
        if reply.get("status") == "OK":  # good, but not one reply per rank: not ours
            broken = RuntimeError(f"a batch of {count} ranks was answered with {reply!r}")
            reply = {"status": "error", "exception": broken}
        return [reply] * count


def each_message(message: Message | StreamBatch) -> Sequence[Message]:
    """The ranks' own messages: a batch's each, or the message itself."""
    if isinstance(message, StreamBatch):
        return message.messages()
    return (message,)


def _travels_plain(made: Made) -> bool:
    """Whether a rank's arguments travel as they are (plain values, not packed)."""
    return not isinstance(made.packed[0], Serialized)


class SharedArguments:
    """What was made of the last argument objects seen (their packing, input futures),
    for ranks given the very same ones (``ONE_TO_ALL`` hands every rank the same)."""

    __slots__ = ("args", "kwargs", "made")

    def __init__(self) -> None:
        self.args: tuple | None = None
        self.kwargs: dict | None = None
        self.made: Any = None

    def get(self, args: tuple, kwargs: dict) -> Any:
        if self.args is None or self.kwargs is None:
            return None
        if same_arguments(args, kwargs, self.args, self.kwargs):
            return self.made
        return None

    def keep(self, args: tuple, kwargs: dict, made: Any) -> Any:
        self.args, self.kwargs, self.made = args, kwargs, made
        return made


def one_part(calls: RankCalls) -> RankCall | None:
    """The first of ``calls`` when every one has its very same arguments (``ONE_TO_ALL``:
    the same tuple and dict), else ``None``. (In C: it runs for every rank of a call.)"""
    if not calls:
        return None
    first = calls[0]
    if calls.shared or (all_are(calls.args, first.args) and all_are(calls.kwargs, first.kwargs)):
        return first
    return None


def process_runs(refs: Sequence[InstanceRef]) -> list[tuple[Slot, range]]:
    """The ranks ``refs`` as runs of consecutive ranks in one worker process: the slot of
    each run's first, and the run's indices (a process's ranks are usually consecutive,
    so a call looks up each process's lane once)."""
    runs: list[tuple[Slot, range]] = []
    start, address, worker = 0, None, None
    slot: Slot | None = None
    for index, ref in enumerate(refs):
        here = ref.slot
        if here.address != address or here.worker_id != worker:
            if slot is not None:
                runs.append((slot, range(start, index)))
            slot, start, address, worker = here, index, here.address, here.worker_id
    if slot is not None:
        runs.append((slot, range(start, len(refs))))
    return runs


def packed_bytes(made: Made) -> int:
    """The bytes of a rank's packed arguments the driver sends (none when plain)."""
    args, kwargs = made.packed
    if isinstance(args, Serialized):
        return _frame_bytes(args) + _frame_bytes(kwargs)
    return 0


def nested_futures(values: Any) -> list[Future]:
    """Futures inside ``DataProtoFuture`` arguments (a rank resolves those itself)."""
    found: list[Future] = []
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, DataProtoFuture):
            found += [f for f in (*value.parts, value.pad) if isinstance(f, Future)]
    return found


def _frame_bytes(packed: Serialized) -> int:
    return sum(memoryview(frame).nbytes for frame in packed.frames)
