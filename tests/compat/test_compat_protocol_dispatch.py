"""verl parity: DP dispatch of TensorDicts, futures and padding.

Every test runs the ranks inline with ``LocalBackend`` (the tests are about the dispatch
functions, not about processes).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from hybridflow_dask import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    Dispatch,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from hybridflow_dask.decorators import collect_dp_compute_data_proto, dispatch_dp_compute_data_proto


def batch_of(n: int, *, auto_padding: bool = False) -> DataProto:
    return DataProto.from_dict({"idx": torch.arange(n)}, auto_padding=auto_padding)


def tensordict_of(n: int) -> TensorDict:
    """Tensors, a nested TensorDict, per-row objects and one shared non-tensor value."""
    td = TensorDict(
        {"x": torch.arange(n, dtype=torch.float32), "inner": {"y": torch.arange(2 * n).view(n, 2)}},
        batch_size=[n],
    )
    td.set("name", NonTensorStack.from_list([f"row{i}" for i in range(n)]))
    td.set_non_tensor("tag", "shared")
    return td


def repacking_dispatch(worker_group, *args, **kwargs):
    """A verl-style custom mode: calls the built-in split, then re-packs its result."""
    split_args, split_kwargs = dispatch_dp_compute_data_proto(worker_group, *args, **kwargs)
    return list(split_args), dict(split_kwargs)


class DataWorker(Worker):
    """Records the rows each call gave it; returns its rows tagged with its rank."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []
        self._register_dispatch_collect_info(
            "mesh", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double_td(self, td: TensorDict) -> TensorDict:
        self.seen.append(td["x"].long().tolist())
        out = td.clone()
        out["x"] = td["x"] * 2
        out["rank"] = torch.full((td.batch_size[0],), self.rank)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_td_later(self, td: TensorDict) -> TensorDict:
        return self.double_td(td)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("mesh"))
    def mesh_td(self, td: TensorDict) -> TensorDict:
        return self.double_td(td)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"idx": data.batch["idx"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def pair(self, first: DataProto, second: DataProto) -> DataProto:
        return DataProto.from_dict({"idx": first.batch["idx"], "other": second.batch["idx"]})

    @register(
        dispatch_mode={
            "dispatch_fn": repacking_dispatch,
            "collect_fn": collect_dp_compute_data_proto,
        }
    )
    def wrapped(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"idx": data.batch["idx"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict:
        self.seen.append(data.batch["idx"].tolist())
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rows_seen(self) -> list[list[int]]:
        seen, self.seen = self.seen, []
        return seen


@pytest.fixture
def group(hf_local_backend, hf_worker_group):
    return hf_worker_group(DataWorker, [4], backend=hf_local_backend)


def check_doubled(out: TensorDict, n: int) -> None:
    assert isinstance(out, TensorDict)
    assert out.batch_size == torch.Size([n])
    assert out["x"].tolist() == [2.0 * i for i in range(n)]
    assert out["inner", "y"].tolist() == [[2 * i, 2 * i + 1] for i in range(n)]
    assert out["name"] == [f"row{i}" for i in range(n)]
    assert out.get("tag").data == "shared"


# ---- TensorDict arguments to DP modes -----------------------------------------------------------


def test_tensordict_argument_is_chunked_and_results_concatenated(group):
    out = group.double_td(tensordict_of(8))
    check_doubled(out, 8)
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_tensordict_padding_follows_dataproto_rules(group):
    with pytest.raises(ValueError, match="7 rows, not divisible by 4 ranks"):
        group.double_td(tensordict_of(7))
    flagged = tensordict_of(7)
    flagged.set_non_tensor("_verl_auto_padding", True)  # DataProto's per-batch flag
    check_doubled(group.double_td(flagged), 7)
    DataProtoConfig.auto_padding = True  # the global switch (reset by conftest)
    check_doubled(group.double_td(tensordict_of(5)), 5)
    # padding repeats the last row, as for a DataProto
    assert group.rows_seen()[3] == [[6, 6], [4, 4]]


def test_tensordict_future_feeds_the_next_call_and_nd_mesh_collects(group):
    DataProtoConfig.auto_padding = True
    future = group.double_td_later(tensordict_of(7))
    assert isinstance(future, DataProtoFuture)
    check_doubled(future.get(), 7)
    twice = group.double_td(future)  # a TensorDict future feeds the next call
    assert twice["x"].tolist() == [4.0 * i for i in range(7)]
    assert twice["name"] == [f"row{i}" for i in range(7)]
    out = group.mesh_td(tensordict_of(6))  # dp size 2, collected from ranks 0 and 2
    check_doubled(out, 6)
    assert out["rank"].tolist() == [0, 0, 0, 2, 2, 2]


# ---- DataProtoFutures of different lengths ------------------------------------------------------


def test_futures_of_different_lengths_fail_naming_both(group):
    six = group.produce(batch_of(6, auto_padding=True))
    eight = group.produce(batch_of(8))
    assert isinstance(six, DataProtoFuture) and isinstance(eight, DataProtoFuture)
    with pytest.raises(ValueError, match="#0: 6 rows, #1: 8 rows"):
        group.pair(six, eight)
    with pytest.raises(ValueError, match="'first': 8 rows, 'second': 6 rows"):
        group.pair(first=eight, second=six)
    with pytest.raises(ValueError, match="#0: 6 rows, #1: 8 rows"):
        group.pair(six, batch_of(8))


def test_futures_of_equal_lengths_pair_row_by_row(group):
    first = group.produce(batch_of(6, auto_padding=True))
    second = group.produce(batch_of(6, auto_padding=True))
    out = group.pair(first, second)
    assert out.batch["idx"].tolist() == list(range(6))
    assert out.batch["other"].tolist() == list(range(6))


# ---- a custom dispatch function wrapping a built-in one keeps the padding -----------------------


def test_custom_dispatch_repacking_the_builtin_split_keeps_padding(group):
    out = group.wrapped(batch_of(7, auto_padding=True))
    assert out.batch["idx"].tolist() == list(range(7))


def test_builtin_dispatch_carries_the_pad_size_in_kwargs_like_verl(group):
    from hybridflow_dask.protocol import PADDING_SIZE_KEY

    _, kwargs = dispatch_dp_compute_data_proto(group, batch_of(7, auto_padding=True))
    assert kwargs[PADDING_SIZE_KEY] == 1
    _, kwargs = dispatch_dp_compute_data_proto(group, batch_of(8))
    assert PADDING_SIZE_KEY not in kwargs


# ---- DP_COMPUTE_METRIC with padding -------------------------------------------------------------


def test_metric_drops_entries_of_ranks_given_padding(group):
    DataProtoConfig.auto_padding = True
    assert group.metric(batch_of(7)) == [
        {"rank": 0, "rows": 2},
        {"rank": 1, "rows": 2},
        {"rank": 2, "rows": 2},
    ]
    assert group.rows_seen()[3] == [[6, 6]]  # the padding row repeats the last row
    # 5 rows: ranks 2 ([4, pad]) and 3 ([pad, pad]) got padding; 0 and 1 only real rows
    assert [m["rank"] for m in group.metric(batch_of(5))] == [0, 1]
    assert group.rows_seen()[2:] == [[[4, 4]], [[4, 4]]]
    assert len(group.metric(batch_of(8))) == 4


def test_metric_with_a_future_input_drops_padded_ranks_too(group):
    DataProtoConfig.auto_padding = True
    future = group.produce(batch_of(7))
    assert [m["rank"] for m in group.metric(future)] == [0, 1, 2]
    assert group.rows_seen()[3] == [[6, 6]]
