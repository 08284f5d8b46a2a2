"""Unit tests for DataProto and its helpers, following verl's semantics."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
from protocol_helpers import (
    assert_arrays_equal,
    assert_dataproto_equal,
    assert_tensors_equal,
    make_dataproto,
)
from tensordict import TensorDict

from hybridflow_dask.protocol import (
    AUTO_PADDING_ENV,
    AUTO_PADDING_KEY,
    DataProto,
    DataProtoConfig,
    DataProtoItem,
    collate_fn,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from hybridflow_dask.protocol import data_proto as data_proto_module


def rows(dp: DataProto) -> list:
    return dp.batch["ids"][:, 0].div(4, rounding_mode="floor").tolist()


# ---------------------------------------------------------------------- construction


def test_from_dict_builds_batch_non_tensors_and_meta():
    dp = make_dataproto(5)
    assert len(dp) == 5
    assert dp.batch.batch_size == torch.Size([5])
    assert dp.batch["logp"].dtype == torch.bfloat16
    assert dp.non_tensor_batch["uid"].dtype == object
    assert dp.meta_info == {"temperature": 1.0}


def test_from_dict_converts_lists_to_one_row_per_element():
    dp = DataProto.from_dict(
        {"x": torch.zeros(3)},
        {"names": ["a", "b", "c"], "pairs": [[1, 2], [3, 4], [5, 6]], "t": ("p", "q", "r")},
    )
    assert dp.non_tensor_batch["names"].dtype == object
    assert dp.non_tensor_batch["pairs"].shape == (3,)
    assert dp.non_tensor_batch["pairs"][1] == [3, 4]
    assert dp.non_tensor_batch["t"].tolist() == ["p", "q", "r"]


def test_from_dict_does_not_modify_callers_dicts():
    non_tensors = {"names": ["a", "b"]}
    meta = {"k": 1}
    DataProto.from_dict({"x": torch.zeros(2)}, non_tensors, meta, auto_padding=True)
    assert non_tensors == {"names": ["a", "b"]}
    assert meta == {"k": 1}


def test_from_dict_without_tensors_has_no_batch():
    dp = DataProto.from_dict(non_tensors={"a": np.arange(4)})
    assert dp.batch is None
    assert len(dp) == 4


def test_empty_dataproto_has_length_zero():
    assert len(DataProto()) == 0
    assert len(DataProto.from_dict()) == 0


def test_from_dict_tensor_batch_mismatch_names_both_keys():
    with pytest.raises(ValueError, match=r"'a' has \[3\], 'b' has \[4\]"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})


def test_from_dict_non_tensor_length_mismatch_names_key_and_lengths():
    with pytest.raises(
        ValueError, match=r"non_tensor_batch\['uid'\] has length 2 but batch has length 3"
    ):
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": np.array(["x", "y"], dtype=object)})


def test_non_tensors_disagreeing_without_batch_names_both_keys():
    with pytest.raises(
        ValueError, match=r"'b'\] has length 3 but non_tensor_batch\['a'\] has length 2"
    ):
        DataProto.from_dict(non_tensors={"a": np.zeros(2), "b": np.zeros(3)})


def test_from_dict_rejects_non_list_non_array_value():
    with pytest.raises(TypeError, match="'uid'"):
        DataProto.from_dict({"a": torch.zeros(2)}, {"uid": "not-a-list"})


def test_constructor_rejects_list_in_non_tensor_batch():
    with pytest.raises(TypeError, match=r"non_tensor_batch\['uid'\] is a list"):
        DataProto(batch=None, non_tensor_batch={"uid": ["a", "b"]})


def test_from_dict_rejects_non_tensor_in_tensors():
    with pytest.raises(TypeError, match="'a'"):
        DataProto.from_dict({"a": [1, 2, 3]})


def test_constructor_rejects_non_tensordict_batch():
    with pytest.raises(TypeError, match="batch must be a TensorDict"):
        DataProto(batch={"a": torch.zeros(2)})


def test_from_dict_accepts_only_one_batch_dim():
    with pytest.raises(ValueError, match="num_batch_dims=2 is not supported"):
        DataProto.from_dict({"a": torch.zeros(2, 3, 4), "b": torch.ones(2, 3)}, num_batch_dims=2)
    with pytest.raises(ValueError, match="num_batch_dims=2 is not supported"):
        DataProto.from_dict({"a": torch.zeros(2, 3)}, {"n": np.zeros(2)}, num_batch_dims=2)
    with pytest.raises(ValueError, match="num_batch_dims"):
        DataProto.from_dict({"a": torch.zeros(2, 3)}, num_batch_dims=0)


def test_from_single_dict_splits_by_type():
    dp = DataProto.from_single_dict(
        {"a": torch.zeros(2), "b": np.array(["x", "y"], dtype=object)}, meta_info={"m": 1}
    )
    assert list(dp.batch.keys()) == ["a"]
    assert list(dp.non_tensor_batch) == ["b"]
    assert dp.meta_info == {"m": 1}
    with pytest.raises(TypeError, match="'c'"):
        DataProto.from_single_dict({"a": torch.zeros(2), "c": [1, 2]})


def test_check_consistency_after_manual_edit():
    dp = make_dataproto(4)
    dp.non_tensor_batch["bad"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"'bad'\] has length 3 but batch has length 4"):
        dp.check_consistency()


def test_tensordict_round_trip():
    dp = make_dataproto(4, meta_info={"step": 3, "cfg": {"lr": 0.1}})
    td = dp.to_tensordict()
    assert isinstance(td, TensorDict)
    back = DataProto.from_tensordict(td)
    assert_tensors_equal(back.batch["obs"], dp.batch["obs"])
    assert back.non_tensor_batch["uid"].tolist() == dp.non_tensor_batch["uid"].tolist()
    assert back.meta_info == {"step": 3, "cfg": {"lr": 0.1}}
    with pytest.raises(TypeError):
        DataProto.from_tensordict({"a": 1})


def test_to_tensordict_refuses_key_clash():
    dp = make_dataproto(2, meta_info={"obs": 1})
    with pytest.raises(ValueError, match="'obs'"):
        dp.to_tensordict()


# ---------------------------------------------------------------------- padding config


def test_padding_flag_from_dict(monkeypatch):
    assert DataProtoConfig.auto_padding is False
    dp = make_dataproto(3)
    assert not dp.is_padding_enabled()
    padded = make_dataproto(3, auto_padding=True)
    assert padded.meta_info[AUTO_PADDING_KEY] is True
    assert DataProtoConfig.auto_padding_key == AUTO_PADDING_KEY
    assert padded.is_padding_enabled()


def test_padding_flag_from_class_attribute():
    DataProtoConfig.auto_padding = True
    assert make_dataproto(3).is_padding_enabled()
    DataProtoConfig.auto_padding = False
    assert not make_dataproto(3).is_padding_enabled()


@pytest.mark.parametrize(
    ("value", "on"), [("1", True), ("true", True), ("TRUE", True), ("0", False), ("no", False)]
)
def test_padding_flag_from_env(monkeypatch, value, on):
    monkeypatch.setenv(AUTO_PADDING_ENV, value)
    assert DataProtoConfig.auto_padding is on
    assert make_dataproto(3).is_padding_enabled() is on


# ---------------------------------------------------------------------- indexing


def test_getitem_int_returns_item():
    dp = make_dataproto(4)
    item = dp[1]
    assert isinstance(item, DataProtoItem)
    assert item.batch.batch_size == torch.Size([])
    assert item.non_tensor_batch["uid"] == "uid-1"
    assert dp[-1].non_tensor_batch["uid"] == "uid-3"
    assert dp[np.int64(2)].non_tensor_batch["uid"] == "uid-2"
    with pytest.raises(IndexError, match="index 4 is out of range for a DataProto of length 4"):
        dp[4]


def test_getitem_slice_and_step():
    dp = make_dataproto(6)
    assert rows(dp[1:4]) == [1, 2, 3]
    assert rows(dp[::2]) == [0, 2, 4]
    assert rows(dp[::-2]) == [5, 3, 1]
    assert dp[::-1].non_tensor_batch["uid"].tolist() == [f"uid-{i}" for i in range(5, -1, -1)]
    assert rows(dp.slice(2)) == [2, 3, 4, 5]
    assert rows(dp.slice(1, 5, 2)) == [1, 3]
    with pytest.raises(ValueError, match="step"):
        dp.slice(0, 3, 0)


@pytest.mark.parametrize(
    "index",
    [[3, 0, 3], np.array([3, 0, 3]), torch.tensor([3, 0, 3]), (3, 0, 3), [-3, 0, -3]],
)
def test_getitem_index_lists(index):
    dp = make_dataproto(6)
    out = dp[index]
    assert rows(out) == [3, 0, 3]
    assert out.non_tensor_batch["uid"].tolist() == ["uid-3", "uid-0", "uid-3"]


@pytest.mark.parametrize(
    "mask",
    [
        [True, False, True, False, False, True],
        np.array([True, False, True, False, False, True]),
        torch.tensor([True, False, True, False, False, True]),
    ],
)
def test_getitem_boolean_mask(mask):
    out = make_dataproto(6)[mask]
    assert rows(out) == [0, 2, 5]
    assert out.non_tensor_batch["score"].tolist() == [0.0, 1.0, 2.5]


def test_select_idxs_errors_name_lengths():
    dp = make_dataproto(4)
    with pytest.raises(ValueError, match="mask has length 3 but the DataProto has length 4"):
        dp.select_idxs([True, False, True])
    with pytest.raises(IndexError, match="index 9 is out of range for a DataProto of length 4"):
        dp.select_idxs([0, 9])
    with pytest.raises(TypeError):
        dp.select_idxs([0.5, 1.0])
    with pytest.raises(TypeError):
        dp["obs"]
    assert len(dp.select_idxs([])) == 0


def test_select_idxs_copies_and_keeps_meta():
    dp = make_dataproto(4, meta_info={"k": 1})
    out = dp.select_idxs([0, 1])
    out.batch["obs"].zero_()
    out.meta_info["k"] = 2
    assert dp.batch["obs"].abs().sum() > 0
    assert dp.meta_info["k"] == 1


def test_iteration_yields_items():
    dp = make_dataproto(3)
    assert [item.non_tensor_batch["uid"] for item in dp] == ["uid-0", "uid-1", "uid-2"]


def test_non_tensor_only_indexing():
    dp = DataProto.from_dict(non_tensors={"a": np.arange(5)})
    assert dp[1:3].non_tensor_batch["a"].tolist() == [1, 2]
    assert dp[[4, 0]].non_tensor_batch["a"].tolist() == [4, 0]


# ---------------------------------------------------------------------- keys


def test_select_keys():
    dp = make_dataproto(4, meta_info={"a": 1, "b": 2})
    out = dp.select(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(out.batch.keys()) == ["obs"]
    assert list(out.non_tensor_batch) == ["uid"]
    assert out.meta_info == {"a": 1}
    assert out.batch["obs"].data_ptr() == dp.batch["obs"].data_ptr()
    whole = dp.select()
    whole.non_tensor_batch["extra"] = np.zeros(4)
    whole.batch["extra"] = torch.zeros(4)
    assert "extra" not in dp.non_tensor_batch
    assert "extra" not in dp.batch


def test_select_deepcopy_shares_nothing():
    dp = make_dataproto(4, meta_info={"cfg": {"lr": 1}})
    out = dp.select(deepcopy=True)
    out.batch["obs"].zero_()
    out.non_tensor_batch["score"][:] = -1
    out.meta_info["cfg"]["lr"] = 2
    assert dp.batch["obs"].abs().sum() > 0
    assert dp.non_tensor_batch["score"][1] == 0.5
    assert dp.meta_info["cfg"]["lr"] == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_keys": ["nope"]}, "nope"),
        ({"non_tensor_batch_keys": ["ghost"]}, "ghost"),
        ({"meta_info_keys": ["missing"]}, "missing"),
    ],
)
def test_select_unknown_key_is_key_error(kwargs, name):
    with pytest.raises(KeyError, match=name):
        make_dataproto(3).select(**kwargs)


def test_pop_moves_keys():
    dp = make_dataproto(4, meta_info={"a": 1, "b": 2})
    popped = dp.pop(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(popped.batch.keys()) == ["obs"]
    assert len(popped) == 4
    assert "obs" not in dp.batch
    assert "uid" not in dp.non_tensor_batch
    assert dp.meta_info == {"b": 2}
    assert popped.meta_info == {"a": 1}


def test_pop_unknown_key_leaves_self_intact():
    dp = make_dataproto(4)
    with pytest.raises(KeyError, match="ghost"):
        dp.pop(batch_keys=["obs"], non_tensor_batch_keys=["ghost"])
    assert "obs" in dp.batch


def test_rename_batch_and_non_tensor_keys():
    dp = make_dataproto(3)
    out = dp.rename(["obs", "uid"], ["observation", "sample_id"])
    assert out is dp
    assert "observation" in dp.batch and "obs" not in dp.batch
    assert "sample_id" in dp.non_tensor_batch and "uid" not in dp.non_tensor_batch
    dp.rename("observation", "obs")
    assert "obs" in dp.batch


def test_rename_swaps_and_errors():
    dp = make_dataproto(3)
    obs = dp.batch["obs"]
    dp.rename(["obs", "ids"], ["ids", "obs"])
    assert dp.batch["ids"] is obs
    with pytest.raises(KeyError, match="'ghost'"):
        dp.rename("ghost", "x")
    with pytest.raises(ValueError, match="'mask' already exists"):
        dp.rename("obs", "mask")
    with pytest.raises(ValueError, match="2 old and 1 new"):
        dp.rename(["obs", "ids"], ["x"])


def test_union_merges_in_place():
    dp = make_dataproto(4, meta_info={"a": 1})
    extra = DataProto.from_dict(
        {"obs": dp.batch["obs"].clone(), "values": torch.ones(4)},
        {"tag": np.array(list("wxyz"), dtype=object)},
        {"b": 2},
    )
    out = dp.union(extra)
    assert out is dp
    assert {"obs", "values"} <= set(dp.batch.keys())
    assert dp.non_tensor_batch["tag"].tolist() == list("wxyz")
    assert dp.meta_info == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    ("other", "key"),
    [
        (lambda n: DataProto.from_dict({"obs": torch.zeros(n, 3)}), "obs"),
        (
            lambda n: DataProto.from_dict(non_tensors={"uid": np.array(["q"] * n, dtype=object)}),
            "uid",
        ),
        (lambda n: DataProto(meta_info={"temperature": 0.5}), "temperature"),
    ],
)
def test_union_conflict_names_key_and_leaves_self(other, key):
    dp = make_dataproto(4)
    before = dp.select(deepcopy=True)
    with pytest.raises(ValueError, match=repr(key)):
        dp.union(other(4))
    assert_dataproto_equal(dp, before)


def test_union_length_mismatch_names_lengths():
    with pytest.raises(ValueError, match="lengths 4 and 3"):
        make_dataproto(4).union(make_dataproto(3))


def test_union_helpers():
    td1 = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
    td2 = TensorDict({"a": torch.zeros(2), "b": torch.ones(2)}, batch_size=[2])
    assert union_tensor_dict(td1, td2) is td1
    assert set(td1.keys()) == {"a", "b"}
    with pytest.raises(ValueError, match="batch sizes"):
        union_tensor_dict(td1, TensorDict({}, batch_size=[3]))
    d1 = {"x": np.array(["a", None], dtype=object)}
    union_numpy_dict(d1, {"x": np.array(["a", None], dtype=object), "y": np.zeros(2)})
    assert set(d1) == {"x", "y"}
    with pytest.raises(ValueError, match="'x'"):
        union_numpy_dict(d1, {"x": np.array(["b", None], dtype=object)})


# ---------------------------------------------------------------------- chunk / split / concat


def test_chunk_equal_parts_are_views():
    dp = make_dataproto(6)
    parts = dp.chunk(3)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert parts[1].batch["obs"].data_ptr() == dp.batch["obs"][2:].data_ptr()


def test_chunk_not_divisible_without_padding_says_so():
    with pytest.raises(ValueError, match=r"length 5 .* 2 equal parts.*auto padding"):
        make_dataproto(5).chunk(2)


@pytest.mark.parametrize("bad", [0, -1])
def test_chunk_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="positive"):
        make_dataproto(4).chunk(bad)


def test_chunk_uneven_with_padding_like_array_split():
    dp = make_dataproto(10, auto_padding=True)
    assert [len(p) for p in dp.chunk(4)] == [3, 3, 2, 2]
    assert [len(p) for p in make_dataproto(2, auto_padding=True).chunk(4)] == [1, 1, 0, 0]
    DataProtoConfig.auto_padding = True
    assert [rows(p) for p in make_dataproto(5).chunk(3)] == [[0, 1], [2, 3], [4]]


def test_split():
    dp = make_dataproto(7)
    assert [len(p) for p in dp.split(3)] == [3, 3, 1]
    assert (
        DataProto.concat(dp.split(3)).non_tensor_batch["uid"].tolist()
        == dp.non_tensor_batch["uid"].tolist()
    )
    with pytest.raises(ValueError):
        dp.split(0)


def test_concat_round_trip_and_fresh_storage():
    dp = make_dataproto(6)
    out = DataProto.concat(dp.chunk(2))
    assert_dataproto_equal(out, dp)
    out.batch["obs"].zero_()
    assert dp.batch["obs"].abs().sum() > 0


def test_concat_merges_metrics_like_verl():
    parts = [
        DataProto.from_dict(
            {"a": torch.zeros(1)}, meta_info={"metrics": {"loss": 1.0, "acc": [0.1]}, "step": 3}
        ),
        DataProto.from_dict(
            {"a": torch.zeros(1)},
            meta_info={"metrics": {"loss": 2.0, "acc": [0.2, 0.3]}, "step": 3},
        ),
    ]
    meta = DataProto.concat(parts).meta_info
    assert meta["metrics"] == {"loss": [1.0, 2.0], "acc": [0.1, 0.2, 0.3]}
    assert meta["step"] == 3


def test_concat_errors():
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="batch keys differ"):
        DataProto.concat([make_dataproto(2), make_dataproto(2).select(batch_keys=["obs"])])
    with pytest.raises(ValueError, match="non_tensor_batch keys differ"):
        DataProto.concat(
            [make_dataproto(2), make_dataproto(2).select(non_tensor_batch_keys=["uid"])]
        )
    with pytest.raises(TypeError, match="#1"):
        DataProto.concat([make_dataproto(2), "x"])


def test_concat_non_tensor_only():
    a = DataProto.from_dict(non_tensors={"x": ["a", "b"]})
    b = DataProto.from_dict(non_tensors={"x": ["c"]})
    assert DataProto.concat([a, b]).non_tensor_batch["x"].tolist() == ["a", "b", "c"]


# ---------------------------------------------------------------------- reorder / repeat / padding


def test_reorder_in_place():
    dp = make_dataproto(4)
    assert dp.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert rows(dp) == [3, 1, 0, 2]
    assert dp.non_tensor_batch["uid"].tolist() == ["uid-3", "uid-1", "uid-0", "uid-2"]


def test_repeat():
    dp = make_dataproto(3)
    assert rows(dp.repeat(2)) == [0, 0, 1, 1, 2, 2]
    assert rows(dp.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    assert dp.repeat(2, interleave=False).non_tensor_batch["uid"].tolist()[3] == "uid-0"
    assert len(dp.repeat(0)) == 0
    with pytest.raises(ValueError):
        dp.repeat(-1)


@pytest.mark.parametrize(
    "counts", [[2, 0, 1], (2, 0, 1), np.array([2, 0, 1]), torch.tensor([2, 0, 1])]
)
def test_sample_level_repeat(counts):
    out = make_dataproto(3).sample_level_repeat(counts)
    assert rows(out) == [0, 0, 2]
    assert out.non_tensor_batch["uid"].tolist() == ["uid-0", "uid-0", "uid-2"]


def test_sample_level_repeat_errors():
    dp = make_dataproto(3)
    with pytest.raises(ValueError, match="2 entries but the DataProto has length 3"):
        dp.sample_level_repeat([1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        dp.sample_level_repeat([1, -1, 1])
    with pytest.raises(TypeError):
        dp.sample_level_repeat("abc")


def test_padding_last_and_first_in_place():
    dp = make_dataproto(3)
    dp.padding(2)
    assert rows(dp) == [0, 1, 2, 2, 2]
    assert dp.non_tensor_batch["uid"].tolist()[-1] == "uid-2"
    dp2 = make_dataproto(3)
    dp2.padding(1, padding_candidate="first")
    assert rows(dp2) == [0, 1, 2, 0]
    dp2.padding(0)
    assert len(dp2) == 4
    with pytest.raises(ValueError, match="padding_candidate"):
        dp2.padding(1, "middle")
    with pytest.raises(ValueError, match="empty"):
        DataProto().padding(1)


def test_pad_dataproto_to_divisor_cycles_leading_rows_and_keeps_input():
    dp = make_dataproto(3)
    before = dp.select(deepcopy=True)
    padded, pad = pad_dataproto_to_divisor(dp, 8)
    assert pad == 5
    assert rows(padded) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert_dataproto_equal(dp, before)
    assert rows(unpad_dataproto(padded, pad)) == [0, 1, 2]


def test_pad_dataproto_to_divisor_divisible_returns_new_object():
    dp = make_dataproto(4)
    padded, pad = pad_dataproto_to_divisor(dp, 2)
    assert pad == 0 and padded is not dp
    padded.meta_info["x"] = 1
    padded.batch["new"] = torch.zeros(4)
    assert "x" not in dp.meta_info and "new" not in dp.batch
    assert unpad_dataproto(padded, 0) is padded
    with pytest.raises(ValueError, match="positive"):
        pad_dataproto_to_divisor(dp, 0)
    with pytest.raises(ValueError, match="larger than the DataProto length 4"):
        unpad_dataproto(dp, 5)


def test_pad_empty_dataproto_warns_and_returns_empty(caplog):
    with caplog.at_level(logging.WARNING):
        padded, pad = pad_dataproto_to_divisor(DataProto(), 4)
    assert pad == 0 and len(padded) == 0
    assert "empty" in caplog.text


# ---------------------------------------------------------------------- fold / collate / iterate


def test_fold_unfold_round_trip_without_mutation():
    dp = make_dataproto(6)
    folded = fold_batch_dim(dp, 2)
    assert folded.batch.batch_size == torch.Size([2])
    assert folded.batch["obs"].shape == (2, 3, 3)
    assert folded.non_tensor_batch["uid"].shape == (2, 3)
    assert dp.batch.batch_size == torch.Size([6])
    assert dp.non_tensor_batch["uid"].shape == (6,)
    back = unfold_batch_dim(folded, batch_dims=2)
    assert_dataproto_equal(back, dp)
    with pytest.raises(ValueError, match="not divisible"):
        fold_batch_dim(dp, 4)


def test_collate_fn_stacks_items():
    dp = make_dataproto(3)
    out = collate_fn([dp[2], dp[0]])
    assert rows(out) == [2, 0]
    assert out.non_tensor_batch["uid"].tolist() == ["uid-2", "uid-0"]
    assert out.non_tensor_batch["score"].dtype == object


def test_list_of_dict_to_dict_of_list():
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3, "b": 4}]) == {
        "a": [1, 3],
        "b": [2, 4],
    }
    assert list_of_dict_to_dict_of_list([]) == {}
    with pytest.raises(KeyError, match="'c'"):
        list_of_dict_to_dict_of_list([{"a": 1}, {"c": 2}])


def test_make_iterator_epochs_and_seed():
    dp = make_dataproto(8, meta_info={"m": 1})
    batches = list(dp.make_iterator(mini_batch_size=4, epochs=2))
    assert len(batches) == 4
    assert rows(batches[0]) == [0, 1, 2, 3]
    assert batches[0].meta_info == {"m": 1}
    first = [rows(b) for b in dp.make_iterator(4, 1, seed=7, dataloader_kwargs={"shuffle": True})]
    again = [rows(b) for b in dp.make_iterator(4, 1, seed=7, dataloader_kwargs={"shuffle": True})]
    assert first == again
    assert sorted(row for batch in first for row in batch) == list(range(8))
    with pytest.raises(ValueError, match="not divisible by mini_batch_size 3"):
        dp.make_iterator(3, 1)


# ---------------------------------------------------------------------- misc


def test_to_device_in_place():
    dp = make_dataproto(2)
    assert dp.to("cpu") is dp
    assert dp.batch["obs"].device.type == "cpu"


def test_save_and_load_from_disk(tmp_path):
    dp = make_dataproto(5, meta_info={"k": [1, 2]})
    path = tmp_path / "dp.pkl"
    dp.save_to_disk(path)
    assert_dataproto_equal(DataProto.load_from_disk(path), dp)
    import pickle

    (tmp_path / "other.pkl").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(TypeError, match="not a DataProto"):
        DataProto.load_from_disk(tmp_path / "other.pkl")


def test_get_data_info_and_print_size(caplog):
    dp = make_dataproto(2, meta_info={"k": 1})
    info = dp.get_data_info()
    for word in ("obs", "bfloat16", "uid", "meta_info", "k: int"):
        assert word in info
    with caplog.at_level(logging.INFO, logger=data_proto_module.__name__):
        message = dp.print_size(prefix="rank0")
    assert message.startswith("rank0, Size of tensordict")
    assert message in caplog.text


def test_copy_and_deepcopy():
    dp = make_dataproto(3, meta_info={"cfg": {"a": 1}})
    shallow = copy.copy(dp)
    assert shallow.batch is dp.batch
    deep = copy.deepcopy(dp)
    assert_dataproto_equal(deep, dp)
    deep.batch["obs"].zero_()
    deep.meta_info["cfg"]["a"] = 2
    assert dp.batch["obs"].abs().sum() > 0 and dp.meta_info["cfg"]["a"] == 1


def test_no_equality_defined():
    assert DataProto.__eq__ is object.__eq__
    assert "len=3" in repr(make_dataproto(3))


def test_nested_tensordict_batch():
    td = TensorDict(
        {"a": torch.arange(4), "sub": TensorDict({"b": torch.arange(8).reshape(4, 2)}, [4, 2])},
        batch_size=[4],
    )
    dp = DataProto(batch=td, non_tensor_batch={"u": np.arange(4)})
    out = DataProto.concat([dp[[3, 1]], dp[0:1]])
    assert out.batch["sub", "b"][:, 0].tolist() == [6, 2, 0]
    assert_arrays_equal(out.non_tensor_batch["u"], np.array([3, 1, 0]))
    assert dp.select(batch_keys=[("sub", "b")]).batch["sub", "b"].shape == (4, 2)


def test_legacy_import_path_for_helpers():
    assert data_proto_module.pad_dataproto_to_divisor is pad_dataproto_to_divisor
    with pytest.raises(AttributeError):
        data_proto_module.no_such_name  # noqa: B018
