"""verl parity: ``all_gather_data_proto`` over a real gloo group.

Two processes (torch.multiprocessing spawn) form a gloo process group; each gathers its
own DataProto and writes what it got to a file the test reads back.
"""

from __future__ import annotations

import pickle
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

import hybridflow_dask as hf

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_data(rank: int, rows: int) -> hf.DataProto:
    return hf.DataProto.from_dict(
        {
            "obs": torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 100 * rank,
            "nested": TensorDict({"ids": torch.full((rows,), rank)}, batch_size=[rows]),
        },
        {"uid": [f"r{rank}-{i}" for i in range(rows)]},
        meta_info={"rank": rank},
    )


def _gather_in_process(rank: int, port: int, out_dir: str, rows_by_rank: list[int]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        data = _rank_data(rank, rows_by_rank[rank])
        try:
            returned = hf.all_gather_data_proto(data, dist.group.WORLD)
            result = {
                "returned": returned,
                "obs": data.batch["obs"].tolist(),
                "ids": data.batch["nested", "ids"].tolist(),
                "uid": data.non_tensor_batch["uid"].tolist(),
                "meta": data.meta_info,
                "len": len(data),
            }
        except ValueError as exc:
            result = {"error": str(exc)}
        (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, rows_by_rank: list[int]) -> list[dict]:
    mp.spawn(
        _gather_in_process,
        args=(_free_port(), str(tmp_path), rows_by_rank),
        nprocs=WORLD,
        join=True,
    )
    return [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


@pytest.mark.cluster
def test_all_gather_data_proto_gathers_every_ranks_rows_in_place_over_gloo(tmp_path):
    results = _run(tmp_path, [2, 2])
    expected_obs = torch.cat([_rank_data(r, 2).batch["obs"] for r in range(WORLD)]).tolist()
    for rank, got in enumerate(results):
        assert got["returned"] is None  # in place, like torch.distributed.all_gather
        assert got["len"] == 4
        assert got["obs"] == expected_obs
        assert got["ids"] == [0, 0, 1, 1]
        assert got["uid"] == ["r0-0", "r0-1", "r1-0", "r1-1"]
        assert got["meta"] == {"rank": rank}  # meta_info is not gathered


@pytest.mark.cluster
def test_all_gather_data_proto_refuses_unequal_rows_on_every_rank(tmp_path):
    results = _run(tmp_path, [2, 3])
    for got in results:
        assert "rank 0 has 2 rows, rank 1 has 3" in got["error"]


def test_all_gather_data_proto_is_exported_at_the_top_level_like_verl():
    from hybridflow_dask.protocol import all_gather_data_proto

    assert hf.all_gather_data_proto is all_gather_data_proto
