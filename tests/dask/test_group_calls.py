"""A call to several ranks travels together: one message per worker process (on its lane
when blocking, on its Dask stream when not and every rank is handed the same plain
arguments)."""

from __future__ import annotations

import os
import time

import dask
import numpy as np
import pytest
import torch
from distributed.protocol.serialize import Serialized

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.driver import direct_path
from hybridflow_dask.backends.dask.driver.channel import Channel
from hybridflow_dask.backends.dask.driver.lane import Lane
from hybridflow_dask.decorators.dispatch import dispatch_dp_compute_data_proto

pytestmark = pytest.mark.cluster


def each_rank(worker_group, outputs):
    """A collect that keeps the ranks' results apart."""
    return list(outputs)


class Light(hf.Worker):
    def __init__(self) -> None:
        super().__init__()
        self.state = torch.zeros(3)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def add_rank_in_place(self, tensor):
        tensor += self.rank  # changes this rank's input only
        return tensor, os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def grow_state(self):
        self.state += 1
        return self.state  # the instance keeps changing it in later calls

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def fail_on(self, rank):
        if self.rank == rank:
            raise KeyError(f"rank {rank} fails")
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def fail_or_sleep(self, failing, sleeping, seconds):
        if self.rank == failing:
            raise KeyError(f"rank {failing} fails")
        if self.rank == sleeping:
            time.sleep(seconds)
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def array_or_none(self):
        return None if self.rank % 2 else np.full(3, self.rank)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def plain_or_tensor(self):
        return self.rank if self.rank % 3 else torch.full((2,), float(self.rank))

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def rank_later(self, failing):
        if self.rank == failing:
            raise KeyError(f"rank {failing} fails")
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def grow_later(self):
        self.state += 1

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def add_rank_later(self, tensor):
        tensor += self.rank  # changes this rank's input only
        return tensor

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_later(self, data: hf.DataProto) -> hf.DataProto:
        return self.double(data)

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict(
            {"x": data.batch["x"] * 2, "r": data.batch["x"] * 0 + self.rank}
        )

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def rows_held(self, data: hf.DataProto) -> hf.DataProto:
        """The bytes of memory behind this rank's rows, then zeroes them in place."""
        x = data.batch["x"]
        held = x.untyped_storage().nbytes()
        x.zero_()
        self.kept = data  # held on to, as a trainer might
        return hf.DataProto.from_dict({"held": torch.full((len(data),), float(held))})

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def rows_held_later(self, data: hf.DataProto) -> hf.DataProto:
        return self.rows_held(data)

    @hf.register(
        dispatch_mode={"dispatch_fn": dispatch_dp_compute_data_proto, "collect_fn": each_rank}
    )
    def own_meta(self, data: hf.DataProto) -> hf.DataProto:
        """Each rank's rows and a meta_info of its own; the rank the batch's
        ``meta_info["extra_on"]`` names adds a key, the rank 100 above it fails."""
        extra_on = data.meta_info.get("extra_on", -1)
        out = {"x": data.batch["x"] + 0.5}
        if self.rank == extra_on:
            out["extra"] = data.batch["x"]
        if self.rank == extra_on + 100:
            raise KeyError(f"rank {self.rank} fails")
        return hf.DataProto.from_dict(out, meta_info={"metrics": {"rank": self.rank}})

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def tagged(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict(
            {"x": data.batch["x"], "r": data.batch["x"] * 0 + self.rank},
            non_tensors={"tag": data.non_tensor_batch["tag"]},
            meta_info={"seen": data.meta_info.get("step")},
        )


@pytest.fixture
def light_group(hf_dask_cluster):
    with dask.config.set({"hybridflow.fresh-processes": False}):
        backend = DaskBackend(cluster=hf_dask_cluster, ranks_per_worker=4)
    with backend:
        group = hf.WorkerGroup(hf.ResourcePool([8]), hf.ClassWithInitArgs(Light), backend=backend)
        yield group
        group.shutdown()


def _messages_sent(monkeypatch, owner: type, method: str) -> list[dict]:
    """Every message ``owner.method`` sends from now on (a lane's ``request``, a Dask
    stream's ``send``: the message is the first argument)."""
    sent: list[dict] = []
    original = getattr(owner, method)

    def spy(self, msg, *args, **kwargs):
        sent.append(msg)
        return original(self, msg, *args, **kwargs)

    monkeypatch.setattr(owner, method, spy)
    return sent


def test_a_group_call_sends_one_lane_message_per_worker_process(light_group, monkeypatch):
    light_group.fail_on(-1)  # lanes open
    sent = _messages_sent(monkeypatch, Lane, "request")
    assert light_group.fail_on(-1) == list(range(8))
    assert len(sent) == 2  # 8 ranks on 2 processes
    assert [len(msg["calls"]) for msg in sent] == [4, 4]


def test_a_non_blocking_call_with_plain_arguments_is_one_stream_message_per_process(
    light_group, monkeypatch
):
    sent = _messages_sent(monkeypatch, Channel, "send")
    futures = light_group.rank_later(-1)
    assert hf.get(futures) == list(range(8))
    calls = [msg for msg in sent if msg["op"] in ("hf_call", "hf_calls")]
    assert [(msg["op"], len(msg["calls"])) for msg in calls] == [("hf_calls", 4)] * 2
    assert [i for msg in calls for _, _, i in msg["calls"]] == list(range(8))


def test_a_non_blocking_batch_with_a_tensor_gives_each_rank_its_own_copy(light_group, monkeypatch):
    """Ranks handed the very same tensor travel in one batch per process, each part with
    its own copy: no rank sees another's change in place, nor the caller."""
    sent = _messages_sent(monkeypatch, Channel, "send")
    tensor = torch.ones(3)
    out = hf.get(light_group.add_rank_later(tensor))
    assert [t.tolist() for t in out] == [[1.0 + rank] * 3 for rank in range(8)]
    calls = [msg for msg in sent if msg["op"].startswith("hf_call")]
    assert [(msg["op"], len(msg["calls"])) for msg in calls] == [("hf_calls", 4)] * 2
    assert tensor.tolist() == [1.0, 1.0, 1.0]


def test_a_non_blocking_batch_of_split_data_gives_each_rank_its_rows_and_futures_go_alone(
    light_group, monkeypatch
):
    """``DP_COMPUTE_PROTO`` hands each rank its own rows: one batch per process; a call
    given the futures of another waits for them rank by rank, each rank's message alone."""
    sent = _messages_sent(monkeypatch, Channel, "send")
    data = hf.DataProto.from_dict({"x": torch.arange(16.0)})
    first = light_group.double_later(data)
    assert hf.get(first).batch["x"].tolist() == [2.0 * i for i in range(16)]
    calls = [msg for msg in sent if msg["op"].startswith("hf_call")]
    assert [(msg["op"], len(msg["calls"])) for msg in calls] == [("hf_calls", 4)] * 2
    del sent[:]
    second = light_group.double_later(first)
    out = hf.get(second)
    assert out.batch["x"].tolist() == [4.0 * i for i in range(16)]
    assert out.batch["r"].tolist() == [float(i // 2) for i in range(16)]
    assert [msg["op"] for msg in sent if msg["op"].startswith("hf_call")] == ["hf_call"] * 8


def test_one_ranks_error_in_a_non_blocking_batch_is_that_ranks_alone(light_group):
    futures = light_group.rank_later(5)
    with pytest.raises(KeyError, match="rank 5 fails") as caught:
        hf.get(futures)
    assert caught.value.hybridflow_origin == (light_group.name_prefix, "rank_later", 5)
    assert hf.get([f for i, f in enumerate(futures) if i != 5]) == [0, 1, 2, 3, 4, 6, 7]
    assert hf.get(light_group.rank_later(-1)) == list(range(8))  # every rank goes on


def test_non_blocking_batches_and_blocking_calls_run_in_the_order_made(light_group):
    """Each rank runs its calls in the order the driver made them, whichever way each
    travelled (a batch on the Dask stream, a batch on the lane)."""
    seen = []
    for later in (2, 1, 3):
        for _ in range(later):
            light_group.grow_later()
        seen.append([t.tolist() for t in light_group.grow_state()])
    assert seen == [[[3.0] * 3] * 8, [[5.0] * 3] * 8, [[9.0] * 3] * 8]


def test_the_flat_dispatch_sends_each_rank_its_own_lane_message(hf_dask_cluster, monkeypatch):
    """``hybridflow.group-messages: false``: a message per rank, the same results."""
    with dask.config.set({"hybridflow.fresh-processes": False, "hybridflow.group-messages": False}):
        backend = DaskBackend(cluster=hf_dask_cluster, ranks_per_worker=4)
    with backend:
        group = hf.WorkerGroup(hf.ResourcePool([8]), hf.ClassWithInitArgs(Light), backend=backend)
        try:
            group.fail_on(-1)  # lanes open
            sent = _messages_sent(monkeypatch, Lane, "request")
            assert group.fail_on(-1) == list(range(8))
            assert len(sent) == 8 and all("calls" not in msg for msg in sent)
            assert sorted(msg["seq"] for msg in sent) == [3] * 8  # creation, two calls
            with pytest.raises(KeyError, match="rank 5 fails"):
                group.fail_on(5)
        finally:
            group.shutdown()


def test_ranks_sharing_an_argument_in_one_process_each_get_their_own_copy(light_group):
    sent = torch.ones(3)
    results = light_group.add_rank_in_place(sent)
    assert [r[0].tolist() for r in results] == [[1.0 + rank] * 3 for rank in range(8)]
    assert len({pid for _, pid in results}) == 2  # light ranks: two processes
    assert sent.tolist() == [1.0, 1.0, 1.0]  # and the caller's tensor is untouched


def test_results_of_a_batch_are_captured_as_each_method_returns(light_group):
    first = light_group.grow_state()
    second = light_group.grow_state()
    assert [t.tolist() for t in first] == [[1.0] * 3] * 8
    assert [t.tolist() for t in second] == [[2.0] * 3] * 8


def test_one_ranks_error_in_a_batch_names_that_rank_and_keeps_its_type(light_group):
    with pytest.raises(KeyError, match="rank 5 fails") as caught:
        light_group.fail_on(5)
    assert caught.value.hybridflow_origin == (light_group.name_prefix, "fail_on", 5)
    assert light_group.fail_on(-1) == list(range(8))  # every rank goes on


def test_plain_and_serialized_results_of_one_batch_each_reach_their_rank(light_group):
    """A batch whose results are all plain comes back as bare values; one with a tensor
    among them, rank by rank: either way each rank's own result, in rank order."""
    assert light_group.fail_on(-1) == list(range(8))  # all plain
    mixed = light_group.plain_or_tensor()
    assert [r.tolist() if isinstance(r, torch.Tensor) else r for r in mixed] == [
        [0.0, 0.0],
        1,
        2,
        [3.0, 3.0],
        4,
        5,
        [6.0, 6.0],
        7,
    ]


def test_results_that_answer_equality_elementwise_are_gathered_as_they_are(light_group):
    """numpy arrays among ``None``s: the driver's count of what it gathered must not ask
    an array whether it equals ``None`` (numpy answers element by element)."""
    out = light_group.array_or_none()
    assert [None if r is None else r.tolist() for r in out] == [
        None if rank % 2 else [rank] * 3 for rank in range(8)
    ]


def test_different_arguments_per_rank_in_one_batch_reach_their_ranks(light_group):
    data = hf.DataProto.from_dict({"x": torch.arange(16.0)})
    out = light_group.double(data)
    assert out.batch["x"].tolist() == [2.0 * i for i in range(16)]
    assert out.batch["r"].tolist() == [float(i // 2) for i in range(16)]


def test_a_failing_rank_ends_the_wait_early_but_earlier_ranks_are_still_waited_for(light_group):
    """The call's wait ends on the first failure, as the failure of the lowest failing
    rank: a slow rank after it is not waited for, a slow rank before it is."""
    light_group.fail_on(-1)
    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 0 fails"):
        light_group.fail_or_sleep(0, 7, 5.0)
    assert time.monotonic() - start < 3.0  # rank 7's five seconds were not waited for

    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 5 fails"):
        light_group.fail_or_sleep(5, 1, 1.0)
    assert time.monotonic() - start >= 1.0  # rank 1 (before it in rank order) finished first


def test_the_driver_sleeps_while_it_waits_for_ranks_before_a_failed_one(light_group):
    """Rank 4 (the second process's first) fails at once, rank 1 takes 1.5 s: the
    driver waits for rank 1 without spinning on the call that already failed."""
    light_group.fail_on(-1)
    start, cpu = time.monotonic(), time.process_time()
    with pytest.raises(KeyError, match="rank 4 fails"):
        light_group.fail_or_sleep(4, 1, 1.5)
    assert time.monotonic() - start >= 1.5
    assert time.process_time() - cpu < 0.75  # (a busy wait would spend the 1.5 s)
    assert light_group.fail_on(-1) == list(range(8))  # and the group goes on


def test_a_dp_call_sends_each_process_its_ranks_rows_as_one_piece(light_group, monkeypatch):
    """The ranks of one process given consecutive rows of one batch: one packing of their
    rows per process (each rank's bounds within it), not one per rank, on the lane
    (blocking) and on the Dask stream (non-blocking), and each rank gets its own rows."""
    data = hf.DataProto.from_dict(
        {"x": torch.arange(16.0)},
        non_tensors={"tag": np.array([f"row{i}" for i in range(16)], dtype=object)},
        meta_info={"step": 3},
    )
    light_group.fail_on(-1)  # lanes open
    sent = _messages_sent(monkeypatch, Lane, "request")
    out = light_group.tagged(data)
    assert out.batch["x"].tolist() == list(range(16))
    assert out.batch["r"].tolist() == [float(i // 2) for i in range(16)]
    assert list(out.non_tensor_batch["tag"]) == [f"row{i}" for i in range(16)]
    assert out.meta_info["seen"] == 3
    assert [msg["rows"] for msg in sent] == [[(0, 2), (2, 4), (4, 6), (6, 8)]] * 2
    # the rows packed once per process; each rank's part only its instance and number
    assert all(isinstance(msg["args"], Serialized) for msg in sent)
    assert all(type(part) is tuple for msg in sent for part in msg["calls"])
    streamed = _messages_sent(monkeypatch, Channel, "send")
    later = hf.get(light_group.double_later(data))
    assert later.batch["r"].tolist() == [float(i // 2) for i in range(16)]
    calls = [msg for msg in streamed if msg["op"] == "hf_calls"]
    assert [msg["rows"] for msg in calls] == [[(0, 2), (2, 4), (4, 6), (6, 8)]] * 2


@pytest.mark.parametrize("blocking", [True, False])
def test_each_rank_of_a_piece_holds_only_its_own_rows_in_memory_of_its_own(light_group, blocking):
    """A rank's rows are copied out of its process's piece: a rank keeping them keeps
    only its own rows' memory, and changing them in place leaves the caller's batch as
    it was."""
    data = hf.DataProto.from_dict({"x": torch.arange(1.0, 65.0)})  # 8 rows per rank
    out = light_group.rows_held(data) if blocking else hf.get(light_group.rows_held_later(data))
    assert out.batch["held"].tolist() == [8 * 4.0] * 64  # 8 float32 rows, not 32
    assert data.batch["x"].tolist() == list(range(1, 65))  # the caller's batch untouched


def test_rows_with_auto_padding_reach_their_ranks_as_pieces(light_group):
    """15 rows over 8 ranks with auto padding: the padded batch is cut and sent by
    process, and the padding's rows are dropped from the result."""
    data = hf.DataProto.from_dict({"x": torch.arange(15.0)}, auto_padding=True)
    out = light_group.double(data)
    assert out.batch["x"].tolist() == [2.0 * i for i in range(15)]
    assert out.batch["r"].tolist()[:14] == [float(i // 2) for i in range(14)]


def _joined_replies(monkeypatch) -> list[list]:
    """The bounds of every joined reply the driver reads from now on."""
    read: list[list] = []
    original = direct_path.results_of

    def spy(rows, metas, bounds):
        read.append(list(bounds))
        return original(rows, metas, bounds)

    monkeypatch.setattr(direct_path, "results_of", spy)
    return read


def test_a_pieces_results_come_back_joined_and_each_rank_keeps_its_own_meta_info(
    light_group, monkeypatch
):
    """Every rank of a piece returning a DataProto: one joined reply per process, read
    into each rank's own result (its rows, its meta_info), as rank-by-rank replies were."""
    light_group.fail_on(-1)  # lanes open
    read = _joined_replies(monkeypatch)
    data = hf.DataProto.from_dict({"x": torch.arange(16.0)})
    out = light_group.own_meta(data)
    assert [r.batch["x"].tolist() for r in out] == [[2 * r + 0.5, 2 * r + 1.5] for r in range(8)]
    assert [r.meta_info for r in out] == [{"metrics": {"rank": r}} for r in range(8)]
    assert read == [[(0, 2), (2, 4), (4, 6), (6, 8)]] * 2
    merged = light_group.double(data)  # DP_COMPUTE_PROTO's own collect: the rows in order
    assert merged.batch["r"].tolist() == [float(i // 2) for i in range(16)]


def test_results_of_a_piece_that_cannot_be_joined_or_failed_come_back_rank_by_rank(
    light_group, monkeypatch
):
    light_group.fail_on(-1)
    read = _joined_replies(monkeypatch)
    data = hf.DataProto.from_dict({"x": torch.arange(16.0)}, meta_info={"extra_on": 5})
    out = light_group.own_meta(data)  # rank 5 returns one more key
    assert sorted(out[5].batch.keys()) == ["extra", "x"]
    assert [sorted(r.batch.keys()) for i, r in enumerate(out) if i != 5] == [["x"]] * 7
    assert read == [[(0, 2), (2, 4), (4, 6), (6, 8)]]  # the first process's alone
    with pytest.raises(KeyError, match="rank 3 fails") as caught:
        data.meta_info["extra_on"] = -97
        light_group.own_meta(data)
    assert caught.value.hybridflow_origin == (light_group.name_prefix, "own_meta", 3)
