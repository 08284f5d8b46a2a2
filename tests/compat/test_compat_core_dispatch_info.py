"""verl parity: verl's dispatch-info API on the group and on the Worker."""

from __future__ import annotations

import pytest
import torch

from hybridflow_dask import (
    DataProto,
    Dispatch,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)


class MeshWorker(Worker):
    """Four ranks as two DP groups of two; the second rank of each DP group is collected."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("train", self.rank // 2, self.rank % 2 == 1)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def tag(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"rank": torch.full((len(data),), self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def own_info(self) -> tuple:
        return self.query_collect_info("train"), self.get_dispatch_collect()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def copy_mesh(self, new_name: str) -> tuple[int, bool]:
        tables = self.get_dispatch_collect()
        self.set_dispatch_collect(
            new_name,
            {new_name: tables["dispatch_dp_rank"]["train"]},
            {new_name: tables["collect_dp_rank"]["train"]},
        )
        return self._query_dispatch_info(new_name), self.query_collect_info(new_name)


def test_trainer_style_dispatch_info_cache(hf_local_backend, hf_worker_group):
    wg = hf_worker_group(MeshWorker, [4], backend=hf_local_backend)
    # verl's trainer fills the cache itself: the attribute is a dict, the query gives ints.
    assert isinstance(wg._dispatch_info, dict)
    if "train" not in wg._dispatch_info:
        wg._dispatch_info["train"] = wg._query_dispatch_info("train")
    assert wg._dispatch_info["train"] == [0, 0, 1, 1]
    assert wg._query_collect_info("train") == [False, True, False, True]
    out = wg.tag(DataProto.from_dict({"x": torch.arange(4)}))
    assert out.batch["rank"].tolist() == [1, 1, 3, 3]
    assert wg._collect_info["train"] == [False, True, False, True]


def test_worker_side_dispatch_collect_helpers(hf_local_backend, hf_worker_group):
    wg = hf_worker_group(MeshWorker, [4], backend=hf_local_backend)
    info = wg.own_info()
    assert [collect for collect, _ in info] == [False, True, False, True]
    assert info[2][1] == {"dispatch_dp_rank": {"train": 1}, "collect_dp_rank": {"train": False}}
    assert wg.copy_mesh("copy") == [(0, False), (0, True), (1, False), (1, True)]
    assert wg._query_dispatch_info("copy") == [0, 0, 1, 1]


def test_unregistered_mesh_is_a_clear_error(hf_local_backend, hf_worker_group):
    wg = hf_worker_group(MeshWorker, [2], backend=hf_local_backend)
    with pytest.raises(ValueError, match=r"_register_dispatch_collect_info\('nope'"):
        wg._query_dispatch_info("nope")
