"""Dispatch modes end to end, on every backend: what a verl user's driver relies on."""

from __future__ import annotations

import asyncio
import os

import torch
from core_helpers import make_batch, rows

import hybridflow_dask as hf
from hybridflow_dask import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from hybridflow_dask.decorators import get_predefined_dispatch_fn

# ---- custom dispatch modes (module level: Dask workers import this module too) -------


def dispatch_two_over_four(worker_group, *args, **kwargs):
    """Every argument is a list of 2 inputs; rank ``r`` gets input ``r % 2``."""
    n = worker_group.world_size
    return (
        tuple([arg[r % 2] for r in range(n)] for arg in args),
        {key: [value[r % 2] for r in range(n)] for key, value in kwargs.items()},
    )


def collect_by_input(worker_group, output):
    """Group the ranks' outputs by the input they were given."""
    return {"input0": output[0::2], "input1": output[1::2]}


def dispatch_reversed(worker_group, *args, **kwargs):
    """Rank ``r`` gets item ``n - 1 - r`` of each per-rank list."""
    return tuple(list(reversed(arg)) for arg in args), {
        key: list(reversed(value)) for key, value in kwargs.items()
    }


def collect_reversed(worker_group, output):
    return list(reversed(output))


def dispatch_broadcast(worker_group, *args, **kwargs):
    n = worker_group.world_size
    return tuple([arg] * n for arg in args), {key: [v] * n for key, v in kwargs.items()}


def collect_flat(worker_group, output):
    return tuple(item for result in output for item in result)


REVERSED = register_dispatch_mode("CORE_TEST_REVERSED", dispatch_reversed, collect_reversed)


# ---- workers ----------------------------------------------------------------------------


class Calculator(Worker):
    """Stateful and rank-aware, so every result shows which rank made it."""

    def __init__(self, base: int = 0) -> None:
        super().__init__()
        self.base = base
        self.calls = 0

    def add(self, x: int, y: int = 0) -> int:  # not registered: reached via execute_*
        self.calls += 1
        return self.base + self.rank * 100 + x + y

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def call_count(self) -> int:
        return self.calls

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def broadcast_add(self, x: int, y: int = 0) -> int:
        return self.add(x, y)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def broadcast_add_later(self, x: int) -> int:
        return self.add(x)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def pass_through(self, x: int, y: int = 0) -> tuple[int, int, int]:
        self.calls += 1
        return self.rank, x, y

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def on_rank_zero(self, x: int) -> tuple[int, int]:
        self.calls += 1
        return self.rank, x

    @register(execute_mode=Execute.RANK_ZERO)
    def execute_on_rank_zero(self, x: int) -> tuple[int, int]:
        self.calls += 1
        return self.rank, x

    @register(dispatch_mode={"dispatch_fn": dispatch_two_over_four, "collect_fn": collect_by_input})
    def two_over_four(self, x: str, suffix: str = "") -> str:
        return f"{x}{suffix}@{self.rank}"

    @register(dispatch_mode=REVERSED)
    def reversed_tag(self, x: str) -> tuple[int, str]:
        return self.rank, x

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def per_rank(self, x: int, y: int = 0) -> int:
        self.calls += 1
        return self.rank * 1000 + x * 10 + y

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def shard_metrics(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data), "idx": data.batch["idx"].tolist()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def async_scale(self, x: int) -> int:
        await asyncio.sleep(0.001)
        return x * (self.rank + 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def async_scale_later(self, x: int) -> int:
        await asyncio.sleep(0.001)
        return x * (self.rank + 1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def async_double(self, data: DataProto) -> DataProto:
        await asyncio.sleep(0.001)
        return DataProto.from_dict({"obs": data.batch["obs"] * 2, "idx": data.batch["idx"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    async def async_double_later(self, data: DataProto) -> DataProto:
        return await self.async_double(data)


class MeshWorker(Worker):
    """4 ranks as a 2 (DP) x 2 (TP) mesh: ranks 0,1 form DP group 0, ranks 2,3 group 1."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info(
            "mesh", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0
        )
        self.seen: list[list[int]] = []

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("mesh"))
    def tagged(self, data: DataProto) -> DataProto:
        self.seen.append(data.batch["idx"].tolist())
        return DataProto.from_dict(
            {"idx": data.batch["idx"], "rank": torch.full((len(data),), self.rank)}
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def chunks_seen(self) -> list[list[int]]:
        return self.seen


def rank_and_arg(x: int) -> tuple[str, int]:
    """Runs on a worker: shows which rank's environment it ran in."""
    return os.environ["RANK"], x


def shard_times_ten(worker: Worker, data: DataProto) -> DataProto:
    return DataProto.from_dict(
        {"obs": data.batch["obs"] * 10, "rank": torch.full((len(data),), worker.rank)}
    )


# ---- execute_* ----------------------------------------------------------------------------


def test_execute_all_sync_and_async(backend, hf_worker_group):
    wg = hf_worker_group(ClassWithInitArgs(Calculator, base=1), [4], backend=backend)
    assert wg.execute_all_sync("add", 5) == [6, 106, 206, 306]
    assert wg.execute_all_sync("add", [10, 20, 30, 40], y=[1, 2, 3, 4]) == [12, 123, 234, 345]
    futures = wg.execute_all_async("add", 7)
    assert len(futures) == 4
    assert all(backend.is_future(f) for f in futures)
    assert hf.get(futures) == [8, 108, 208, 308]
    assert hf.get(wg.execute_all("add", 0)) == [1, 101, 201, 301]
    assert wg.call_count() == [4, 4, 4, 4]


def test_execute_rank_zero_sync_and_async(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.execute_rank_zero_sync("add", 5, y=1) == 6
    future = wg.execute_rank_zero_async("add", 7)
    assert backend.is_future(future)
    assert hf.get(future) == 7
    # A list of world_size values is not split for rank 0: it gets the whole list.
    assert wg.execute_rank_zero_sync("pass_through", [1, 2, 3, 4]) == (0, [1, 2, 3, 4], 0)
    assert wg.call_count() == [3, 0, 0, 0]


# ---- built-in dispatch modes --------------------------------------------------------------


def test_one_to_all_broadcasts_and_lists_results(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.broadcast_add(3, y=1) == [4, 104, 204, 304]


def test_one_to_all_non_blocking_returns_backend_futures(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    futures = wg.broadcast_add_later(2)
    assert isinstance(futures, list) and len(futures) == 4
    assert all(backend.is_future(f) for f in futures)
    assert hf.get(futures) == [2, 102, 202, 302]


def test_all_to_all_splits_per_rank_lists(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.pass_through([10, 11, 12, 13], y=[0, 1, 2, 3]) == [
        (0, 10, 0),
        (1, 11, 1),
        (2, 12, 2),
        (3, 13, 3),
    ]
    # A plain value (or a list of another length) reaches every rank whole.
    assert wg.pass_through(5, y=[1, 2]) == [(r, 5, [1, 2]) for r in range(4)]


def test_rank_zero_mode_runs_only_rank_zero(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.on_rank_zero(9) == (0, 9)
    # Execute.RANK_ZERO with the default ALL_TO_ALL dispatch: rank 0 gets the arguments as
    # given, a list of world_size items included (as verl's execute_rank_zero does).
    assert wg.execute_on_rank_zero(8) == (0, 8)
    assert wg.execute_on_rank_zero([1, 2, 3, 4]) == (0, [1, 2, 3, 4])
    assert wg.call_count() == [3, 0, 0, 0]


def test_dict_dispatch_mode_duplicates_two_inputs_over_four_ranks(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.two_over_four(["a", "b"], suffix=["!", "?"]) == {
        "input0": ["a!@0", "a!@2"],
        "input1": ["b?@1", "b?@3"],
    }


def test_register_dispatch_mode_adds_a_dispatch_member(backend, hf_worker_group):
    assert Dispatch.CORE_TEST_REVERSED is REVERSED
    assert Dispatch.from_name("CORE_TEST_REVERSED") is REVERSED
    wg = hf_worker_group(Calculator, [4], backend=backend)
    # rank r got item 3 - r; the collect function put the results back in item order.
    assert wg.reversed_tag(["w", "x", "y", "z"]) == [(3, "w"), (2, "x"), (1, "y"), (0, "z")]


def test_update_dispatch_mode_changes_groups_made_afterwards(backend, hf_worker_group):
    original = get_predefined_dispatch_fn(REVERSED)
    update_dispatch_mode(REVERSED, dispatch_broadcast, collect_flat)
    try:
        wg = hf_worker_group(Calculator, [4], backend=backend)
        assert wg.reversed_tag("q") == (0, "q", 1, "q", 2, "q", 3, "q")
    finally:
        update_dispatch_mode(REVERSED, original["dispatch_fn"], original["collect_fn"])
    assert get_predefined_dispatch_fn(REVERSED) == original


def test_execute_func_rank_zero_runs_the_function_on_rank_zero(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.execute_func_rank_zero(rank_and_arg, 5) == ("0", 5)
    assert wg.execute_func_rank_zero(rank_and_arg, x=6) == ("0", 6)


def test_execute_with_func_generator_sends_the_function_with_split_data(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    batch = make_batch(8)
    out = wg.execute_with_func_generator(shard_times_ten, batch)
    assert torch.equal(out.batch["obs"], batch.batch["obs"] * 10)
    assert rows(out, "rank") == [0, 0, 1, 1, 2, 2, 3, 3]


def test_dp_compute_takes_per_rank_lists(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.per_rank([1, 2, 3, 4], y=[5, 6, 7, 8]) == [15, 1026, 2037, 3048]


def test_dp_compute_metric_splits_data_and_lists_results(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    metrics = wg.shard_metrics(make_batch(8))
    assert metrics == [
        {"rank": 0, "rows": 2, "idx": [0, 1]},
        {"rank": 1, "rows": 2, "idx": [2, 3]},
        {"rank": 2, "rows": 2, "idx": [4, 5]},
        {"rank": 3, "rows": 2, "idx": [6, 7]},
    ]


# ---- async methods ------------------------------------------------------------------------


def test_async_methods_blocking(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    assert wg.async_scale(3) == [3, 6, 9, 12]
    batch = make_batch(8)
    out = wg.async_double(batch)
    assert torch.equal(out.batch["obs"], batch.batch["obs"] * 2)
    assert rows(out) == list(range(8))


def test_async_methods_non_blocking(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [4], backend=backend)
    futures = wg.async_scale_later(2)
    assert all(backend.is_future(f) for f in futures)
    assert hf.get(futures) == [2, 4, 6, 8]
    batch = make_batch(8)
    future = wg.async_double_later(batch)
    assert isinstance(future, DataProtoFuture)
    out = hf.get(future)
    assert torch.equal(out.batch["obs"], batch.batch["obs"] * 2)


# ---- N-d mesh -------------------------------------------------------------------------


def test_nd_mesh_replicates_within_dp_group_and_collects_marked_ranks(backend, hf_worker_group):
    wg = hf_worker_group(MeshWorker, [4], backend=backend)
    out = wg.tagged(make_batch(6))
    # DP size 2: rows 0-2 go to DP group 0 (ranks 0, 1), rows 3-5 to group 1 (ranks 2, 3);
    # only the even ranks' outputs are collected.
    assert rows(out) == [0, 1, 2, 3, 4, 5]
    assert rows(out, "rank") == [0, 0, 0, 2, 2, 2]
    seen = wg.chunks_seen()
    assert seen[0] == seen[1] == [[0, 1, 2]]
    assert seen[2] == seen[3] == [[3, 4, 5]]


def test_nd_mesh_with_uneven_batch_pads_and_unpads(backend, hf_worker_group):
    wg = hf_worker_group(MeshWorker, [4], backend=backend)
    out = wg.tagged(make_batch(5, auto_padding=True))
    assert rows(out) == [0, 1, 2, 3, 4]
    seen = wg.chunks_seen()
    assert seen[0] == seen[1]
    assert seen[2] == seen[3]


def test_registered_methods_are_bound_with_their_names(backend, hf_worker_group):
    wg = hf_worker_group(Calculator, [2], backend=backend)
    for name in ("broadcast_add", "pass_through", "per_rank", "async_scale", "_process_info"):
        assert getattr(wg, name).__name__ == name
    assert not hasattr(wg, "add")  # not registered: reachable only through execute_*
