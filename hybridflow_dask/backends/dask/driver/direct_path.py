"""The direct call path (the default): the driver talks to the worker's own handlers.

A call is one message from the driver to the handler the worker's ``InstancesPlugin`` added
(``hf_call``), answered when the method has run: no scheduler round trip and none of
Dask's batching intervals on the way. What the driver holds afterwards is still an
ordinary Dask future:

- a **blocking** call's result comes back in the reply (the caller gathers it at once);
  one without future inputs goes on the worker's socket lane (``socket_lane``): written
  by the calling thread, answered from the instance's thread, no event loop involved;
- a **non-blocking** call's result stays in the worker's memory and is registered with
  the scheduler under the call's key, so the driver's ``distributed.Future`` can be
  gathered, passed to any later call (on either path) or released like any other. A
  plain result (``None``, a number, a short string) comes back in the reply instead and
  is held by the driver (``held.CallFuture``): gathering it fetches nothing, and it
  becomes a Dask key, on the worker that made it, only when a later call or task needs
  it as an input.

Messages are started on the client's event loop; a call whose inputs are futures waits
there (never in the caller's thread) until they are in memory, then the worker fetches
them from wherever they live. Per-instance order is kept by the sequence number each
message carries, whatever order messages arrive in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from distributed import Future
from distributed.comm import CommClosedError

from ....errors import CallTimeoutError
from ...base import InstanceRef, Slot, WorkerLostError
from ..config import call_timeout, unreachable_timeout
from ..internals import (
    Releases,
    fail_future,
    finish_future,
    future_state,
    pending_future,
    wait_future,
)
from ..wire.keys import InputKey, swap_inputs, task_key, task_keys
from ..wire.lane_protocol import is_tls, lane_host
from ..wire.messages import LaneLimits, pack, plain_call, unpack
from ..wire.row_pieces import Piece, piece_of, results_of
from ..wire.snapshot import own_frames
from .call_messages import (
    IN_PIECE,
    UNMADE,
    CallParts,
    LaneBatch,
    Made,
    Message,
    SharedArguments,
    StreamBatch,
    each_message,
    nested_futures,
    one_part,
    packed_bytes,
    process_runs,
)
from .call_path import RankCall, RankCalls
from .channel import Channel
from .held import NOT_HELD, CallFuture, handed_back, held_from, held_value, holding
from .lane import Lane
from .liveness import Liveness, futures_in
from .replies import RankReplies, RankReply, Replies, ReplyFuture

__all__ = ["DirectPath"]

logger = logging.getLogger(__name__)

#: How often a call waiting for its inputs checks that their workers are alive.
INPUT_POLL_S = 0.1
#: How long a broken stream waits for the scheduler to confirm its worker died.
DEATH_WAIT_S = 2.0
#: How long withdrawing a call from a worker whose connection broke may take.
WITHDRAW_WAIT_S = 10.0
#: How long the driver waits for a worker to say where its socket lane listens.
LANE_ASK_TIMEOUT_S = 10.0


_UNASKED: Any = object()
#: How long a driver turned away from a worker's lane waits before it asks again (doubling
#: each time it is turned away, up to ``LANE_RETRY_MAX_S``); the Dask comm carries its
#: calls meanwhile.
LANE_RETRY_S = 1.0
LANE_RETRY_MAX_S = 60.0


@dataclass(frozen=True)
class _NotYet:
    """A lane that could not be opened: ask again at ``until`` (``time.monotonic()``)."""

    until: float
    wait: float


class DirectPath:
    """Sends creations, calls, skips and teardowns straight to the workers' handlers."""

    name = "direct"

    def __init__(
        self,
        client: Any,
        driver_id: str,
        live: Liveness,
        *,
        share: bool,
        lanes: bool,
        same_host_copy: bool,
        counts: dict[str, int],
        group_messages: bool = True,
        hold_threshold: int = 0,
    ) -> None:
        self.client = client
        #: Whether a call's parts for one process travel as one message.
        self._group = group_messages
        #: Up to how many bytes a non-blocking call's result comes back to be held here
        #: (none when colocated consumers share their producers' objects: kept there).
        self._hold = 0 if share else hold_threshold
        #: The backend's ``driver_bytes``: arguments this path sends count as "scattered".
        self._counts = counts
        self.driver_id = driver_id
        self._live = live
        self._share = share
        #: Each worker process's socket lane (by address and worker id), or ``None``: it has none.
        self._lanes: dict[tuple[str, str], Lane | _NotYet | None] | None = {} if lanes else None
        self._lanes_lock = threading.Lock()
        self._same_host_copy = same_host_copy
        self._closed = False
        self._releases = Releases(client)
        self._loop: asyncio.AbstractEventLoop = client.loop.asyncio_loop
        self._lock = threading.Lock()
        self._outbox: list[Message | StreamBatch] = []
        #: Keys the scheduler does not know yet (non-blocking calls in flight, tasks held back
        #: until their inputs are known), each with the event that says it now is (made
        #: when a task first waits for it: most keys are announced before anyone does).
        self._unknown: dict[str, asyncio.Event | None] = {}
        self._tasks: set[asyncio.Task] = set()
        self._channels: dict[str, Channel] = {}

    # -- what the backend asks (the caller's thread) --------------------------------------

    def create(
        self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict, seq: int
    ) -> ReplyFuture:
        args, kwargs, inputs = self._placeholders(args, kwargs)
        future = ReplyFuture(task_key(f"{ref.group}.__init__"))
        msg = {
            "ref": pack(ref, "the instance reference"),
            "cls": pack(cls, f"worker class {getattr(cls, '__name__', cls)!r}"),
            "args": pack(args, f"the arguments of {ref.group}.__init__"),
            "kwargs": pack(kwargs, f"the keyword arguments of {ref.group}.__init__"),
            "env": env,
            "driver": self.driver_id,
            "seq": seq,
            "key": future.key,
            "share": self._share,
        }
        self._post(Message("hf_create", ref.slot, ref, seq, msg, inputs, future))
        return future

    def call(
        self,
        calls: RankCalls,
        method: str,
        *,
        label: str,
        blocking: bool,
        deadline: float | None = None,
    ) -> Sequence[Any]:
        """One message per worker process, where it can: the ranks of a call without
        future inputs travel together (as one batch when the process hosts several of
        them), on the process's lane when the call blocks, else on its stream; a rank
        with future inputs travels alone on the stream, which writes every message
        posted in one turn of the loop at once. A rank's own message is made only when
        it travels by itself."""
        runs = process_runs(calls.refs)  # consecutive ranks of one worker process
        if not blocking:
            parts = self._parts(calls, method, label, blocking, deadline, runs)
            self._post_later(parts, runs)
            return parts.futures
        lanes: dict[tuple[str, str], Lane | None] = {}  # each process's, asked once
        for slot, _ in runs:
            process = (slot.address, slot.worker_id)
            if process not in lanes:
                lanes[process] = self._lane(slot)
        on_lanes = [(slot, run) for slot, run in runs if lanes[slot.address, slot.worker_id]]
        parts = self._parts(calls, method, label, blocking, deadline, on_lanes)
        batches: dict[Lane, list[int]] = {}  # each lane's ranks, by index
        made = parts.made
        for slot, run in runs:
            lane = lanes[slot.address, slot.worker_id]
            if lane is None:
                for index in run:
                    self._post(parts.message(index))
                continue
            if parts.plain:  # no rank has future inputs: all of them go on the lane
                batches.setdefault(lane, []).extend(run)
                continue
            for index in run:
                if made[index].inputs or made[index].known:
                    self._post(parts.message(index))
                else:
                    batches.setdefault(lane, []).append(index)
        together = list(batches.items())
        if not self._group:  # the flat dispatch: a message per rank
            together = [(lane, [i]) for lane, batch in together for i in batch]
        # The caller reads the replies itself when every one comes on a lane it can read,
        # one request per lane (it then writes nothing there before it reads).
        caller_reads = (
            sum(map(len, batches.values())) == len(calls)
            and len(together) == len(batches)
            and all(lane.callers_may_read for lane in batches)
        )
        sent = False
        try:
            for lane, batch in together:
                try:
                    if len(batch) == 1:
                        message = parts.message(batch[0])
                        lane.request(message.msg, message, read_by_caller=caller_reads)
                    else:
                        msg = parts.batch_msg(batch)
                        lane.request(msg, LaneBatch(parts, batch), read_by_caller=caller_reads)
                except ConnectionError:  # broke just now: the Dask comm reports what happened
                    for index in batch:
                        self._post(parts.message(index))
                    caller_reads = False  # a reply comes another way: the caller reads none
            sent = True
        finally:
            if not (sent and caller_reads):  # nobody waits on these lanes: their threads read
                for asked in batches:
                    asked.hand_over()
        if caller_reads and parts.replies is not None:
            parts.replies.lanes = tuple(batches)
        return parts.futures

    def _post_later(self, parts: CallParts, runs: list[tuple[Slot, range]]) -> None:
        """A non-blocking call's ranks onto their processes' streams: the ranks of one
        process together as one message, unless some rank waits for a future among its
        arguments (each then travels alone, when its inputs are ready)."""
        calls = parts.calls
        if not (self._group and parts.plain):
            for index in range(len(calls)):
                self._post(parts.message(index))
            return
        for slot, run in runs:
            if len(run) == 1:
                self._post(parts.message(run[0]))
            else:
                self._post(StreamBatch(parts, run, slot))

    def _parts(
        self,
        calls: RankCalls,
        method: str,
        label: str,
        blocking: bool,
        deadline: float | None,
        runs: Sequence[tuple[Slot, range]],
    ) -> CallParts:
        """What each rank's message is made of, and its future; every argument is packed
        before anything is sent. Ranks given the very same argument objects share one
        packing of them; the ranks of one of ``runs`` (a process's, sent together) given
        consecutive chunks of the same batches, one packing of their rows (``Piece``).
        A blocking call's ranks are answered in ``RankReply``s of one ``Replies``; a
        non-blocking call's results are held here when small, else kept by their
        workers and announced to the scheduler."""
        count = len(calls)
        keys = task_keys(label, count)
        replies = Replies(calls, keys, deadline) if blocking else None
        common = {  # what every rank's message says alike
            "driver": self.driver_id,
            "method": method,
            "keep": not blocking,
            "client": self.client.id,
            "share": self._share,
            "deadline": deadline,
        }
        if not blocking and self._hold:
            common["hold"] = self._hold
        one = one_part(calls)
        pieces: dict[int, tuple[Made, Piece]] = {}
        if one is not None:  # every rank has the very same arguments: packed once
            this = self._packed(one, label, for_later=not blocking)
            made = [this] * count
            sent = count * packed_bytes(this)
            plain = not (this.inputs or this.known)
        else:
            made = [UNMADE] * count
            sent = 0
            if self._group:
                pieces = self._pieces(calls, label, runs, for_later=not blocking)
                for start, (this, piece) in pieces.items():
                    made[start : start + len(piece.bounds)] = [IN_PIECE] * len(piece.bounds)
                    sent += packed_bytes(this)
            shared = SharedArguments()
            plain = True
            for index, call in enumerate(calls):
                if made[index] is IN_PIECE:
                    continue
                this = shared.get(call.args, call.kwargs)
                if this is None:
                    this = self._packed(call, label, for_later=not blocking)
                    shared.keep(call.args, call.kwargs, this)
                    plain = plain and not (this.inputs or this.known)
                made[index] = this
                sent += packed_bytes(this)
        if sent:
            with self._lock:
                self._counts["scattered"] += sent
        if replies is not None:
            futures: Sequence[Any] = RankReplies(replies)
        else:
            futures = [CallFuture(key, self.client, self._releases) for key in keys]
            for key in keys:
                self.expect(key)
        return CallParts(
            calls,
            keys,
            common,
            made,
            futures,
            replies,
            shared=one is not None,
            plain=plain,
            pieces=pieces,
            pack=(lambda i: self._packed(calls[i], label, for_later=not blocking))
            if pieces
            else None,
        )

    def _pieces(
        self, calls: RankCalls, label: str, runs: Sequence[tuple[Slot, range]], *, for_later: bool
    ) -> dict[int, tuple[Made, Piece]]:
        """The runs of ranks whose rows travel as one piece, by their first index, with
        the piece packed."""
        pieces = {}
        for _, run in runs:
            if len(run) < 2:
                continue
            piece = piece_of(calls.args[run.start : run.stop], calls.kwargs[run.start : run.stop])
            if piece is not None:
                first = RankCall(calls.refs[run.start], 0, piece.args, piece.kwargs)
                pieces[run.start] = (self._packed(first, label, for_later=for_later), piece)
        return pieces

    def _packed(self, call: RankCall, label: str, *, for_later: bool) -> Made:
        """A rank's arguments as its message carries them (packed unless plain), the
        futures among them, and those inside its ``DataProtoFuture``s. ``for_later``:
        sent after the call returns, when its caller may have changed them: copied now."""
        args, kwargs, inputs = self._placeholders(call.args, call.kwargs)
        known = nested_futures(args) + nested_futures(kwargs)
        if plain_call(args, kwargs):  # travel inside the message as they are
            return Made((args, kwargs), inputs, known)
        rank = call.ref.rank
        packed = (
            pack(args, f"the arguments of {label} for rank {rank}"),
            pack(kwargs, f"the keyword arguments of {label} for rank {rank}"),
        )
        if for_later:
            packed = (own_frames(packed[0]), own_frames(packed[1]))
        return Made(packed, inputs, known)

    def destroy(self, ref: InstanceRef, seq: int) -> ReplyFuture:
        future = ReplyFuture(task_key(f"{ref.group}.__del__"))
        msg = {"instance": ref.key, "driver": self.driver_id, "seq": seq}
        self._post(Message("hf_destroy", ref.slot, ref, None, msg, [], future))
        return future

    def skip(self, ref: InstanceRef, seq: int) -> None:
        self._post(self._skip_message(ref, seq, None))

    def withdraw(self, ref: InstanceRef, seq: int) -> ReplyFuture:
        answer = ReplyFuture("hf_skip")
        self._post(self._skip_message(ref, seq, answer))
        return answer

    def _skip_message(self, ref: InstanceRef, seq: int, answer: ReplyFuture | None) -> Message:
        """Call ``seq`` on ``ref`` must not run; ``answer`` (if any) hears whether it will not."""
        msg = {"instance": ref.key, "driver": self.driver_id, "seq": seq}
        return Message("hf_skip", ref.slot, ref, None, msg, [], answer)

    def abandon(self, address: str) -> None:
        """The worker at ``address`` is unreachable: reset the stream and lanes to it, so
        that nothing still queued for it (calls reported failed) is delivered when its
        link comes back. Its waiting messages fail as on a broken stream."""
        with self._lanes_lock:
            lanes = [k for k in (self._lanes or {}) if k[0] == address]
            dropped = [(self._lanes or {}).pop(k, None) for k in lanes]
        for lane in dropped:
            if isinstance(lane, Lane):
                lane.reset()

        def reset() -> None:
            channel = self._channels.pop(address, None)
            if channel is not None:
                channel.reset()

        self._loop.call_soon_threadsafe(reset)

    def port(self, slot: Slot) -> int:
        return self._ask("hf_port", slot)

    def _ask(self, op: str, slot: Slot, timeout: float | None = None, **msg: Any) -> Any:
        """The answer to a question for ``slot``'s worker (from the caller's thread)."""
        future = ReplyFuture(op)
        self._post(Message(op, slot, None, None, msg, [], future))
        return future.result(timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Close the streams and end the messages still in flight (from the caller's thread)."""
        self._closed = True
        with self._lanes_lock:
            lanes, self._lanes = list((self._lanes or {}).values()), None
        for lane in lanes:
            if isinstance(lane, Lane):
                lane.close()
        with contextlib.suppress(Exception):  # the loop may already be closed
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout)

    async def _close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        tasks = [*self._tasks, *(c.runner for c in channels)]
        for channel in channels:
            channel.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def fetch(self, futures: Sequence[Future]) -> dict[str, Any]:
        """The values of finished ``futures`` whose workers have a lane, fetched on it (a
        plain socket read into fresh memory: about three times faster than Dask's comm
        for tens of MiB here). Those it cannot fetch (not ours, no lane, moved away, an
        error on the way) are left out: Dask gathers them. Raises ``WorkerLostError``
        when a holder died. From the caller's thread."""
        by_slot: dict[Slot, tuple[InstanceRef | None, list[str]]] = {}
        for future in futures:
            placed = self._live.placed(future)
            if placed is not None:
                by_slot.setdefault(placed[0], (placed[1], []))[1].append(future.key)
        limit = call_timeout()
        deadline = None if limit is None else time.time() + limit
        asked: list[tuple[Slot, ReplyFuture]] = []
        for slot, (ref, keys) in by_slot.items():
            lane = self._lane(slot)
            if lane is None:
                continue
            answer = ReplyFuture("fetch")
            msg = {"op": "fetch", "keys": keys, "deadline": deadline}
            try:
                lane.request(msg, Message("hf_fetch", slot, ref, None, msg, [], answer))
            except ConnectionError:
                continue
            asked.append((slot, answer))
        values: dict[str, Any] = {}
        for slot, answer in asked:
            try:
                values.update(answer.result(limit))
            except concurrent.futures.TimeoutError:
                keys = by_slot[slot][1]
                raise CallTimeoutError(
                    f"fetching {len(keys)} result(s) ({keys[0].rsplit('-', 1)[0]}, ...) from "
                    f"the worker {slot.address} took longer than hybridflow.call-timeout="
                    f"{limit:g}s; is it hung?"
                ) from None
            except Exception as exc:
                if self._live.is_dead(slot):
                    raise
                logger.debug("fetching on a lane failed, Dask gathers instead: %r", exc)
        return values

    def plain_result(self, future: Future, default: Any) -> Any:
        """The result of ``future`` if it came back with its reply, else ``default``."""
        held = getattr(future, "held", NOT_HELD)
        return default if held is NOT_HELD else held_value(held)

    def submit_when_known(
        self, futures: Sequence[Future], submit: Callable[[Future | None], Future], label: str
    ) -> Future:
        """A task on results of non-blocking calls still in flight waits for their keys
        to be registered with the scheduler (which would ignore a task needing unknown
        keys), and a plain result the driver holds is kept by its worker first (or was):
        the task is submitted from the loop once they all are, into the future handed out
        now."""
        with self._lock:
            unknown = [f for f in futures if isinstance(f, Future) and f.key in self._unknown]
        if not unknown and not holding(futures):
            return submit(None)
        future = pending_future(self.client, task_key(label))
        self.expect(future.key)

        async def submit_later() -> None:
            try:
                for dep in unknown:
                    await self.until_known(dep)
                    if dep.status in ("error", "cancelled"):
                        fail_future(future, future_state(dep).exception)
                        return
                await self._promote(futures)
                submit(future)
            except Exception as exc:  # the client is closing, or the task cannot be sent
                fail_future(future, exc)
            finally:
                self.announce(future.key)

        asyncio.run_coroutine_threadsafe(submit_later(), self._loop)
        return future

    def expect(self, key: str) -> None:
        """``key`` will be known to the scheduler later; tasks needing it must wait."""
        with self._lock:
            self._unknown[key] = None

    def announce(self, key: str) -> None:
        """``key`` is known to the scheduler now (or never will be). Loop thread."""
        with self._lock:
            event = self._unknown.pop(key, None)
        if event is not None:
            event.set()

    async def until_known(self, future: Future) -> None:
        """Wait until ``future``'s key is known to the scheduler. Loop thread."""
        with self._lock:
            if future.key not in self._unknown:
                return
            event = self._unknown[future.key]
            if event is None:
                event = self._unknown[future.key] = asyncio.Event()
        await event.wait()

    # -- the socket lane (the caller's thread, then the lane's reader thread) -----------------

    def _lane(self, slot: Slot) -> Lane | None:
        """The lane to ``slot``'s worker process, opened on first use; ``None`` when it
        offers none (or is dead: the Dask comm then reports the loss)."""
        lanes = self._lanes
        if lanes is None:
            return None
        process = (slot.address, slot.worker_id)
        if self._live.is_dead(slot):  # forget its lane (closed, if it is not yet)
            dead = lanes.pop(process, None)
            if isinstance(dead, Lane):
                dead.close()
            return None
        lane = lanes.get(process, _UNASKED)
        if isinstance(lane, _NotYet):
            if time.monotonic() < lane.until:
                return None  # turned away a moment ago: the Dask comm, for now
        elif lane is None or (lane is not _UNASKED and not lane.broken):
            return lane
        with self._lanes_lock:
            lane = lanes.get(process, _UNASKED)
            due = isinstance(lane, _NotYet) and time.monotonic() >= lane.until
            if lane is _UNASKED or due or (isinstance(lane, Lane) and lane.broken):
                try:
                    lanes[process] = self._open_lane(slot)
                except Exception as exc:  # turned away (busy, token gone): try again later
                    wait = min(lane.wait * 2, LANE_RETRY_MAX_S) if due else LANE_RETRY_S
                    logger.debug("no socket lane to %s for %gs: %r", slot.address, wait, exc)
                    lanes[process] = _NotYet(time.monotonic() + wait, wait)
            lane = lanes[process]
        return lane if isinstance(lane, Lane) else None

    def _open_lane(self, slot: Slot) -> Lane | None:
        """A new lane to ``slot``'s worker; ``None`` when it offers none (not TCP or TLS).
        Raises when it could not be opened (the worker may let us in later)."""
        offer = self._ask("hf_lane", slot, LANE_ASK_TIMEOUT_S, driver=self.driver_id)
        if offer is None:
            return None
        port, token_id, token, local = offer
        host = lane_host(slot.address)
        tls = None
        if is_tls(slot.address):  # the worker's lane runs TLS: show our certificate
            tls = self.client.security.get_connection_args("client")["ssl_context"]
        return Lane(
            cast(str, host),  # a worker that offers a lane is on TCP or TLS: a host
            port,
            (token_id, token),
            self._lane_reply,
            self._lane_broken,
            same_host=self._same_host_copy,
            # a send that makes no progress that long: the worker's link is cut (a
            # call's own deadline bounds its writes too: see Lane.request)
            send_timeout=unreachable_timeout(),
            limits=LaneLimits.from_config(),
            tls=tls,
            local=local,
        )

    def _lane_reply(self, message: Message | LaneBatch, reply: dict) -> None:
        if isinstance(message, LaneBatch):  # one reply per rank, in the batch's order
            indices, replies = message.indices, message.parts.replies
            assert replies is not None  # (a batch is one blocking call's ranks)
            if "joined" in reply and reply.get("status") == "OK":  # a piece's rows, joined
                try:
                    rows, metas = unpack(reply["joined"])
                    joined = results_of(rows, metas, reply["bounds"])
                except Exception as exc:
                    unread = TypeError(f"the results of a batch cannot be read here: {exc!r}")
                    for index in indices:
                        replies.settle(index, None, unread)
                    return
                replies.settle_all(indices, joined)
                return
            results = reply.get("results")  # every rank's plain value, nothing else
            if (
                isinstance(results, list)
                and len(results) == len(indices)
                and reply.get("status") == "OK"
            ):
                replies.settle_all(indices, results)
                return
            answers = reply.get("replies")  # a failure or a serialized value among them
            if not isinstance(answers, list) or len(answers) != len(indices):
                answers = [reply] * len(indices)  # the batch as a whole failed
            method = message.parts.common["method"]
            for index, answer in zip(indices, answers):
                value, error = _lane_outcome(answer, method)
                replies.settle(index, value, error)
            return
        value, error = _lane_outcome(reply, message.msg.get("method", "a fetch"))
        if error is None:
            reply["result"] = value
        self._settle(message, reply, error)

    def _lane_broken(self, pending: list[Message]) -> None:
        """The lane ended with calls unanswered: handled as a broken Dask stream is."""
        error = ConnectionError("the socket lane closed")
        pending = [p for m in pending for p in (m.messages() if isinstance(m, LaneBatch) else [m])]
        for message in pending:
            try:
                self._loop.call_soon_threadsafe(self._answered, message, None, error)
            except RuntimeError:  # the loop is closed: so is this path
                self._settle(message, None, CommClosedError("the backend was shut down"))

    # -- the client's event loop -------------------------------------------------------------

    def _post(self, message: Message | StreamBatch) -> None:
        with self._lock:
            self._outbox.append(message)
            first = len(self._outbox) == 1
        if first:  # one wake-up of the loop sends every message posted meanwhile
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            messages, self._outbox = self._outbox, []
        for message in messages:
            if type(message) is Message and (message.inputs or message.known):
                self._spawn(self._send_when_ready(message))
            else:  # the common case: straight onto the stream, no task of its own
                self._send(message)

    def _spawn(self, coroutine: Any) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_when_ready(self, message: Message) -> None:
        # ``known``: futures inside a DataProtoFuture the rank resolves itself. Its worker
        # asks the scheduler for them by key, and a key the scheduler has not registered
        # yet (a re-split task submitted a moment ago) is ignored there, so the rank would
        # wait for good. Once done, every input is known to the scheduler (a direct result
        # is finished only after its worker registered it).
        try:
            inputs = (*message.inputs, *message.known)
            for dep in inputs:
                await self._wait_input(dep, message)
            await self._promote(inputs)
        except BaseException as exc:
            self._failed(message, exc)
            return
        self._send(message)

    def _send(self, message: Message | StreamBatch) -> None:
        if self._live.is_dead(message.slot):
            for one in each_message(message):
                self._failed(one, self._live.error(one.slot, one.ref))
            return
        channel = self._channels.get(message.address)
        if channel is None or channel.broken:
            channel = self._channels[message.address] = Channel(
                message.address, self.client.connection_args
            )
        channel.send({"op": message.op, **message.msg}, message, self._answered)

    def _answered(
        self, message: Message | StreamBatch, reply: dict | None, error: BaseException | None
    ) -> None:
        """A message's reply, or the error that its stream (or lane) broke. Loop thread.
        A batch's reply is its ranks' replies, each handled as a rank's own message's."""
        if isinstance(message, StreamBatch):
            futures = message.parts.futures
            for index, answer in zip(message.indices, message.answers(reply, error)):
                if answer is not None and answer.get("status") == "OK":  # the common case
                    self._settle_future(futures[index], answer, None)
                else:
                    self._answered(message.parts.message(index), answer, error)
            return
        if error is None:
            failure = _reply_error(cast(dict, reply))  # no error: there is a reply
            if (
                failure is not None
                and _broke_connection(failure)
                and message.inputs + message.known
            ):
                self._spawn(self._input_lost(message, failure))
            else:
                self._settle(message, reply, failure)
        elif self._closed:
            self._settle(message, None, CommClosedError("the backend was shut down"))
        else:
            self._spawn(self._lost(message, error))

    async def _lost(self, message: Message, error: BaseException) -> None:
        """The stream (or lane) broke. Either the worker died (the scheduler's word
        follows within milliseconds: wait for it, so liveness and ``recover()`` agree
        with the error), or only the connection did, and the worker, still running, must
        not run the call once it is reported failed: it is withdrawn there at once, over
        a fresh stream, and the error says how it ended. Until then ``message`` keeps its
        frames alive: the worker may still be copying them out of this process."""
        answer = self._withdraw(message)
        deadline = self._loop.time() + DEATH_WAIT_S
        while not self._live.is_dead(message.slot) and self._loop.time() < deadline:
            if answer is not None and answer.done():
                break  # it answered: alive
            await asyncio.sleep(0.01)
        if self._live.is_dead(message.slot):
            lost = self._live.error(message.slot, message.ref)
        else:
            lost = await self._withdrawn(message, answer)
        lost.__cause__ = error
        self._settle(message, None, lost)

    def _withdraw(self, message: Message) -> ReplyFuture | None:
        """Ask ``message``'s worker not to run its call; the answer says whether it will not."""
        if message.seq is None or message.ref is None:  # a question, not a call
            return None
        answer = ReplyFuture("hf_skip")
        self._send(self._skip_message(message.ref, message.seq, answer))
        return answer  # (sent now: this runs on the loop, where ``_post`` would wait a turn)

    async def _withdrawn(self, message: Message, answer: ReplyFuture | None) -> WorkerLostError:
        """The error for a call whose connection broke while its worker lives on."""
        what = message.msg.get("method", message.op)
        rank = message.ref.rank if message.ref else "?"
        broke = (
            f"the connection to the Dask worker {message.address} broke during {what} "
            f"(rank {rank}); the worker is alive"
        )
        if answer is None:
            return WorkerLostError(broke)
        try:
            prevented = await asyncio.wait_for(asyncio.wrap_future(answer), WITHDRAW_WAIT_S)
        except Exception:
            return WorkerLostError(
                f"{broke}, but it could not be told to drop the call either: the call may "
                "have run there"
            )
        if prevented:
            return WorkerLostError(f"{broke}; the call did not run there and will not")
        return WorkerLostError(
            f"{broke}; the call had already started there, and its result is lost"
        )

    async def _input_lost(self, message: Message, error: BaseException) -> None:
        """The worker could not get an input: when the input's holder died (the scheduler's
        word follows within milliseconds), the call fails naming that group and rank."""
        deadline = self._loop.time() + DEATH_WAIT_S
        inputs = [*message.inputs, *message.known]
        while self._loop.time() < deadline:
            lost = next(filter(None, map(self._live.lost_input, inputs)), None)
            if lost is not None:
                lost.__cause__ = error
                error = lost
                break
            await asyncio.sleep(0.01)
        self._settle(message, None, error)

    def _failed(self, message: Message, error: BaseException) -> None:
        """``message`` never ran: later calls on its instance must not wait for it."""
        if message.seq is not None:
            self._skip_now(message)
        self._settle(message, None, error)

    async def _wait_input(self, dep: Future, message: Message) -> None:
        while not await wait_future(dep, INPUT_POLL_S):
            lost = self._live.lost_input(dep)
            if lost is not None:
                raise lost
        if dep.status == "error":
            raise future_state(dep).exception
        if dep.status != "finished":
            raise self._live.lost_input(dep) or WorkerLostError(
                f"an input of {message.msg.get('method', message.op)} was {dep.status}"
            )

    def _skip_now(self, message: Message) -> None:
        if message.ref is not None and not self._live.is_dead(message.slot):
            self.skip(message.ref, cast(int, message.seq))  # numbered: it has a ref

    def _settle(self, message: Message, reply: dict | None, error: BaseException | None) -> None:
        if message.future is None:
            if error is not None:
                logger.debug("message %s to %s failed: %r", message.op, message.address, error)
            return
        self._settle_future(message.future, reply, error)

    def _settle_future(self, future: Any, reply: dict | None, error: BaseException | None) -> None:
        if type(future) is RankReply:
            future.replies.settle(future.index, reply.get("result") if reply else None, error)
            return
        if isinstance(future, ReplyFuture):
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(reply.get("result") if reply else None)
            return
        if error is not None:
            fail_future(future, error)
        else:
            future.held = held_from(reply)  # a plain or small result: the driver holds it
            finish_future(future)
        self.announce(future.key)

    async def _promote(self, futures: Sequence[Any]) -> None:
        """Plain results among (finished) ``futures`` that the driver holds, kept by the
        workers that made them under their keys (each once), so that another process
        can read them: an input of a later call or task is a Dask key. Loop thread."""
        for future in holding(futures):
            if future.promoted is None:
                future.promoted = asyncio.ensure_future(self._keep(future))
            await asyncio.shield(future.promoted)

    async def _keep(self, future: CallFuture) -> None:
        """Have ``future``'s worker keep its held value (a dead worker fails this as it
        would fail a call: the value was its)."""
        placed = self._live.placed(future)
        if placed is None:  # every call's future is tracked while it lives
            raise RuntimeError(f"no worker is known to have made {future.key}")
        answer = ReplyFuture("hf_keep")
        msg = {"key": future.key, "value": handed_back(future.held), "client": self.client.id}
        self._send(Message("hf_keep", placed[0], placed[1], None, msg, [], answer))
        await asyncio.wrap_future(answer)

    # -- helpers ----------------------------------------------------------------------------------

    def _placeholders(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[Future]]:
        """Futures among the arguments become ``InputKey``s the worker resolves itself."""
        inputs = futures_in(args) + futures_in(kwargs)
        if not inputs:
            return args, kwargs, []

        def swap(value: Any) -> Any:
            return InputKey(value.key) if isinstance(value, Future) else value

        return swap_inputs(args, swap), swap_inputs(kwargs, swap), inputs


def _reply_error(reply: dict) -> BaseException | None:
    """The error a worker's reply carries, or ``None`` for a good one."""
    if reply.get("status") == "OK":
        return None
    return reply.get("exception") or RuntimeError(str(reply))


def _lane_outcome(reply: dict, what: str) -> tuple[Any, BaseException | None]:
    """The value a lane's reply carries (unpacked), or its error."""
    error = _reply_error(reply)
    if error is not None:
        return None, error
    try:
        return unpack(reply.get("result")), None
    except Exception as exc:
        return None, TypeError(f"the result of {what} cannot be read here: {exc!r}")


def _broke_connection(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a connection that broke or data that went
    missing on the way, as when the worker holding an input dies during its transfer."""
    seen = 0
    cause: BaseException | None = error
    while cause is not None and seen < 8:
        if isinstance(cause, (CommClosedError, OSError, asyncio.CancelledError)):
            return True
        if isinstance(cause, concurrent.futures.CancelledError):
            return True
        if isinstance(cause, KeyError) and "no worker holds" in str(cause):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False
