"""A blocking call's replies in the driver: each rank settled once, the call settled when
all are in (or at its first failure), its ranks tracked and forgotten together.

These exercise the driver's own objects directly (``Replies``, ``RankReply``,
``Liveness``), with real threads; the calls they stand for are exercised end to end in
``test_group_calls.py``, ``test_failures.py`` and ``test_stopped_workers.py``.
"""

from __future__ import annotations

import gc
import socket
import threading
import time

import pytest

from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.dask.driver.call_path import RankCall, RankCalls
from hybridflow_dask.backends.dask.driver.gather import wait_some
from hybridflow_dask.backends.dask.driver.liveness import Liveness
from hybridflow_dask.backends.dask.driver.replies import (
    RankReplies,
    RankReply,
    Replies,
    all_values,
    one_call,
)
from hybridflow_dask.backends.dask.wire.keys import key_of, task_keys
from hybridflow_dask.backends.dask.wire.messages import Framed, read_message, write_message
from hybridflow_dask.errors import ProtocolError


def _call(count: int, deadline: float | None = None) -> tuple[Replies, list[RankReply]]:
    """A blocking call of ``step`` to ``count`` ranks of group ``g``, not sent anywhere."""
    refs = _refs(count)
    calls = RankCalls(refs, [r.key for r in refs], [1] * count, (), {}, shared=True)
    replies = Replies(calls, task_keys("g.step", count), deadline)
    return replies, list(RankReplies(replies))


def test_a_rank_is_settled_once_and_a_later_outcome_changes_nothing():
    replies, (first, second) = _call(2)
    first.set_result("value")
    first.set_exception(RuntimeError("a late report of a broken lane"))
    assert first.done() and first.result() == "value" and first.exception() is None
    assert first.status == "finished" and second.status == "pending"
    assert not replies.over  # one of two is in
    second.set_result(None)
    assert replies.over and replies.all_ok()


def test_a_call_is_settled_at_its_first_failure_with_the_rest_still_pending():
    replies, ranks = _call(3)
    ranks[0].set_result(1)
    ranks[2].set_exception(ValueError("rank 2 failed"))
    assert replies.over and not replies.all_ok()
    assert ranks[2].status == "error" and isinstance(ranks[2].exception(), ValueError)
    with pytest.raises(ValueError, match="rank 2 failed"):
        ranks[2].result()
    assert ranks[0].result() == 1 and ranks[0].exception() is None  # its own outcome
    assert not ranks[1].done()


def test_settling_ranks_in_bulk_counts_each_once_and_keeps_a_failure_already_in():
    replies, ranks = _call(4)
    ranks[1].set_result("first")
    replies.settle_all([0, 1, 2], ["a", "again", "c"])
    assert [r.done() for r in ranks] == [True, True, True, False]
    assert ranks[1].result() == "first"  # settled before: unchanged
    assert not replies.over
    replies.settle_all([3], ["d"])
    assert replies.all_ok() and [r.result() for r in ranks] == ["a", "first", "c", "d"]


def test_settling_a_run_of_ranks_and_ranks_spread_apart_gives_each_its_own_value():
    replies, ranks = _call(6)
    replies.settle_all([1, 2, 3], ["b", "c", "d"])  # a process's consecutive ranks
    assert [r.done() for r in ranks] == [False, True, True, True, False, False]
    replies.settle_all([0, 5], ["a", "f"])  # another process's, not consecutive
    assert not replies.over
    replies.settle_all([4], ["e"])
    assert replies.all_ok() and [r.result() for r in ranks] == ["a", "b", "c", "d", "e", "f"]


def test_waiting_for_one_rank_returns_once_another_thread_settles_it():
    replies, (waited, other) = _call(2)
    threading.Timer(0.2, waited.set_result, ("late",)).start()
    start = time.monotonic()
    assert waited.result(timeout=10) == "late"
    assert 0.15 < time.monotonic() - start < 5
    assert not other.done() and not replies.over


def test_waiting_for_a_rank_that_never_answers_ends_at_its_timeout():
    _, (rank,) = _call(1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="not settled"):
        rank.result(timeout=0.2)
    assert time.monotonic() - start < 5


def test_a_wait_for_a_calls_earlier_ranks_after_a_later_one_failed_sleeps_until_they_settle():
    """The first failure in rank order waits for the ranks before it: that wait sleeps
    (it does not return at once, over and over, because the call as a whole failed)."""
    _, ranks = _call(3)
    ranks[2].set_exception(ValueError("rank 2 failed"))
    start, cpu = time.monotonic(), time.thread_time()
    wait_some(None, ranks[:2], 0.3)
    assert time.monotonic() - start >= 0.25  # it waited out its timeout...
    assert time.thread_time() - cpu < 0.1  # ...asleep
    threading.Timer(0.1, lambda: [r.set_result(r.index) for r in ranks[:2]]).start()
    start = time.monotonic()
    wait_some(None, ranks[:2], 10)
    assert time.monotonic() - start < 5 and [r.result() for r in ranks[:2]] == [0, 1]


def test_a_wait_for_some_ranks_ends_as_soon_as_one_of_them_fails():
    _, ranks = _call(3)
    threading.Timer(0.1, ranks[1].set_exception, (KeyError("rank 1"),)).start()
    start = time.monotonic()
    wait_some(None, ranks, 10)
    assert time.monotonic() - start < 5
    assert isinstance(ranks[1].exception(), KeyError) and not ranks[0].done()


def test_one_call_names_the_call_only_when_every_future_is_one_of_its_ranks():
    replies, ranks = _call(3)
    _, (stranger,) = _call(1)
    assert one_call(ranks) is replies and one_call(ranks[1:]) is replies
    assert one_call([*ranks, stranger]) is None and one_call([]) is None
    assert one_call([object()]) is None


def test_all_values_reads_a_call_answered_in_full_only_for_all_its_ranks_in_order():
    replies, ranks = _call(3)
    replies.settle_all([0, 1], ["a", "b"])
    assert all_values(replies, ranks) is None  # rank 2 still out
    replies.settle(2, "c", None)
    assert all_values(replies, ranks) == ["a", "b", "c"]
    assert all_values(replies, ranks[::-1]) is None and all_values(replies, ranks[1:]) is None
    failed, (good, bad) = _call(2)
    failed.settle(0, "a", None)
    failed.settle(1, None, KeyError("rank 1"))
    assert all_values(failed, [good, bad]) is None


def test_a_call_answered_in_full_is_read_without_a_future_per_rank():
    calls = [RankCall(ref, 1, (), {}) for ref in _refs(3)]
    replies = Replies(calls, task_keys("g.step", 3))
    ranks = RankReplies(replies)
    replies.settle_all([0, 1, 2], ["a", "b", "c"])
    assert one_call(ranks) is replies and all_values(replies, ranks) == ["a", "b", "c"]
    assert ranks._made is None  # no rank was looked at one by one
    assert [r.result() for r in ranks] == ["a", "b", "c"] and ranks[1] is ranks[1]


def test_a_calls_keys_are_made_when_asked_and_the_same_on_both_ends():
    first, second = task_keys("actor-rollout.step", 3), task_keys("actor-rollout.step", 2)
    keys = [*first, *second]
    assert len(set(keys)) == 5 and all(k.startswith("actor_rollout.step-") for k in keys)
    assert all(len(k.rsplit("-", 1)[1]) == 32 for k in keys)
    # a worker makes rank i's key from the call's (head, first) and i
    assert [key_of((first.head, first.first), i) for i in range(3)] == list(first)
    with pytest.raises(IndexError):
        first[3]


def _refs(count: int) -> list[InstanceRef]:
    slot = Slot(0, "tcp://10.0.0.1:1", "10.0.0.1", worker_id="worker-a")
    return [InstanceRef("g", rank, slot) for rank in range(count)]


def test_a_blocking_call_is_tracked_as_one_entry_forgotten_once_the_call_is_dropped():
    live = Liveness()
    replies, ranks = _call(3, deadline=123.0)
    refs = [part.ref for part in replies.calls]
    live.track_calls(ranks, replies.calls, deadline=123.0)
    assert live.placed(ranks[2]) == (refs[2].slot, refs[2])
    assert live.issued(ranks[1]) == (refs[1], 1)
    assert live.deadline(ranks) == 123.0
    assert len(live._blocking) == 1 and not live._tasks and not live._calls and not live._refs
    del replies, ranks
    gc.collect()  # (no cycle holds them: freed at once; collect only makes sure)
    assert not live._blocking


def test_a_dead_worker_reports_only_the_ranks_of_a_call_that_were_still_pending():
    live = Liveness()
    replies, ranks = _call(3)
    refs = [part.ref for part in replies.calls]
    live.seen(refs[0].slot.address, "worker-a")
    live.track_calls(ranks, replies.calls, deadline=None)
    ranks[0].set_result(None)
    assert live.on_worker_removed({"worker": refs[0].slot.address}) == refs[0].slot.address
    assert sorted(ref.rank for ref, _ in live.pending_with(refs[0].slot.address)) == [1, 2]
    assert {method for _, method in live.pending_with(refs[0].slot.address)} == {"step"}
    assert live.stranded() == []  # a blocking call's ranks fail through their messages
    assert str(live.lost(ranks[1])).startswith("the Dask worker tcp://10.0.0.1:1")


def test_a_message_naming_frames_it_does_not_carry_is_refused():
    """A frameless message is read without walking its values, unless its pickle could
    hold a ``Framed`` value: one that names frames it does not carry is still refused."""
    sender, receiver = socket.socketpair()
    stream = receiver.makefile("rb", buffering=1 << 16)
    plain = {"op": "calls", "replies": [{"status": "OK", "result": None}] * 4}
    try:
        write_message(sender.sendall, plain)
        write_message(sender.sendall, {"op": "calls", "result": Framed({}, 1)})
        assert read_message(stream) == (plain, False)
        with pytest.raises(ProtocolError, match="carries 0 frames but its values name 1"):
            read_message(stream)
    finally:
        sender.close()
        receiver.close()


def test_a_calls_columns_give_each_rank_its_own_part():
    refs = _refs(3)
    keys = [ref.key for ref in refs]
    shared = RankCalls(refs, keys, [4, 5, 6], (1,), {"x": 2}, shared=True)
    assert list(shared) == [RankCall(ref, seq, (1,), {"x": 2}) for ref, seq in zip(refs, [4, 5, 6])]
    assert shared[0].args is shared[2].args  # the very same objects: packed once
    args, kwargs = [(0,), (1,), (2,)], [{}, {"y": 1}, {}]
    own = RankCalls(refs, keys, [7, 8, 9], args, kwargs, shared=False)
    assert own[1] == RankCall(refs[1], 8, (1,), {"y": 1})
    assert own[-1].seq == 9 and len(own) == 3
    assert own[1:] == [own[1], own[2]]
