"""verl parity: DataProto methods behave as a verl user expects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow_dask import DataProto
from hybridflow_dask.protocol import union_numpy_dict

# ---- unfold_column_chunks -----------------------------------------------------------------------


def test_unfold_column_chunks_splits_dim1_into_rows_and_repeats_the_rest():
    data = DataProto.from_dict(
        {"group": torch.arange(12).view(2, 6), "prompt": torch.tensor([10, 20])},
        {"answers": [["a", "b", "c", "d"], ["e", "f", "g", "h"]], "uid": ["u0", "u1"]},
        meta_info={"step": 7},
    )
    out = data.unfold_column_chunks(2, split_keys=["group", "answers"])
    assert len(out) == 4
    assert out.batch["group"].tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert out.batch["prompt"].tolist() == [10, 10, 20, 20]
    assert [list(c) for c in out.non_tensor_batch["answers"]] == [
        ["a", "b"],
        ["c", "d"],
        ["e", "f"],
        ["g", "h"],
    ]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1"]
    assert out.meta_info == {"step": 7}
    assert len(data) == 2 and data.batch["group"].shape == (2, 6)  # input untouched


def test_unfold_column_chunks_without_split_keys_repeats_every_key():
    data = DataProto.from_dict({"x": torch.arange(6).view(3, 2)}, {"n": np.arange(3)})
    out = data.unfold_column_chunks(2)
    assert out.batch["x"].tolist() == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]
    assert out.non_tensor_batch["n"].tolist() == [0, 0, 1, 1, 2, 2]


def test_unfold_column_chunks_splits_a_2d_numpy_key_and_refuses_bad_input():
    data = DataProto.from_dict({"x": torch.zeros(2, 4)}, {"m": np.arange(8).reshape(2, 4)})
    out = data.unfold_column_chunks(4, split_keys=["x", "m"])
    assert out.non_tensor_batch["m"].tolist() == [[i] for i in range(8)]
    assert out.batch["x"].shape == (8, 1)
    with pytest.raises(ValueError, match="second dimension 4 is not divisible by n_split=3"):
        data.unfold_column_chunks(3, split_keys=["x"])
    with pytest.raises(KeyError, match="nope"):
        data.unfold_column_chunks(2, split_keys=["nope"])
    with pytest.raises(ValueError, match="n_split"):
        data.unfold_column_chunks(0)


def test_unfold_column_chunks_of_list_rows_gives_cells_that_compare_like_verls():
    """Rows that are lists unfold into a 2-d object array, one row of cells per piece, so
    ``==`` compares cell by cell (a 1-d array of lists would broadcast against the rows)."""
    data = DataProto.from_dict(
        {"obs": torch.tensor([[1, 2, 1, 2], [3, 4, 3, 4], [5, 6, 5, 6]])},
        {"labels": [["a1", "a2"], ["b1", "b2"], ["c1", "c2"]]},
    )
    out = data.unfold_column_chunks(2, split_keys=["obs", "labels"])
    labels = out.non_tensor_batch["labels"]
    expected = [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]
    assert labels.dtype == object and labels.shape == (6, 1)
    assert (labels == expected).all()
    assert (labels == np.array(expected, dtype=object)).all()
    assert not (labels == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["x"]]).all()
    assert out.batch["obs"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    # The same column given as a 2-d object array (verl's layout) unfolds to the same cells.
    as_2d = DataProto.from_dict(
        {"obs": data.batch["obs"]}, {"labels": np.array(data.non_tensor_batch["labels"].tolist())}
    )
    again = as_2d.unfold_column_chunks(2, split_keys=["labels"]).non_tensor_batch["labels"]
    assert again.tolist() == labels.tolist() == expected


# ---- concat merges metrics and refuses conflicting meta_info ------------------------------------


def test_concat_merges_metrics_of_every_part_into_lists():
    parts = [
        DataProto.from_dict({"a": torch.zeros(1)}, meta_info={"flag": True}),
        DataProto.from_dict({"a": torch.ones(1)}, meta_info={"metrics": {"loss": 0.5}}),
        DataProto.from_dict(
            {"a": torch.ones(1)}, meta_info={"metrics": {"loss": 0.25}, "flag": True}
        ),
    ]
    meta = DataProto.concat(parts).meta_info
    assert meta == {"flag": True, "metrics": {"loss": [0.5, 0.25]}}


def test_concat_conflicting_meta_info_names_key_and_both_values():
    parts = [
        DataProto.from_dict({"a": torch.zeros(1)}, meta_info={"temperature": 0.7}),
        DataProto.from_dict({"a": torch.ones(1)}, meta_info={"temperature": 1.0}),
    ]
    with pytest.raises(ValueError, match=r"'temperature' is 0\.7 in item #0 but 1\.0 in item #1"):
        DataProto.concat(parts)


# ---- union of self-containing object arrays terminates ------------------------------------------


def _self_containing(tail: int) -> np.ndarray:
    array = np.empty(2, dtype=object)
    array[0] = array
    array[1] = tail
    return array


def test_union_numpy_dict_with_self_containing_arrays_terminates():
    merged = union_numpy_dict({"k": _self_containing(1)}, {"k": _self_containing(1)})
    assert merged["k"][1] == 1
    with pytest.raises(ValueError, match="'k' holds different values"):
        union_numpy_dict({"k": _self_containing(1)}, {"k": _self_containing(2)})


def test_dataproto_union_with_self_containing_arrays_terminates():
    first = DataProto(non_tensor_batch={"k": _self_containing(1)})
    second = DataProto(non_tensor_batch={"k": _self_containing(1), "other": np.arange(2)})
    assert first.union(second) is first
    assert first.non_tensor_batch["other"].tolist() == [0, 1]


# ---- num_batch_dims other than 1 is refused -----------------------------------------------------


def test_from_dict_refuses_two_batch_dims():
    with pytest.raises(ValueError, match="num_batch_dims=2 is not supported"):
        DataProto.from_dict({"a": torch.zeros(2, 3, 4)}, num_batch_dims=2)


def test_two_dim_batch_is_refused_everywhere():
    from tensordict import TensorDict

    two_dims = TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3])
    with pytest.raises(ValueError, match="exactly one batch dimension"):
        DataProto(batch=two_dims)
    with pytest.raises(ValueError, match="num_batch_dims=2 is not supported"):
        DataProto.from_tensordict(two_dims, num_batch_dims=2)
