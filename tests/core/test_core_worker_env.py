"""The rank environment a Worker sees: set before its ``__init__`` body, kept in its methods."""

from __future__ import annotations

import os

from hybridflow_dask import Dispatch, ResourcePool, Worker, register
from hybridflow_dask.worker import RANK_ENV_KEYS


class EnvWorker(Worker):
    def __init__(self) -> None:
        # Read before super().__init__(): torch.distributed.init_process_group() would run here.
        self.env_in_init = {key: os.environ.get(key) for key in RANK_ENV_KEYS}
        self.flag_in_init = os.environ.get("CORE_TEST_FLAG")
        super().__init__()

    def flags(self) -> tuple[str | None, str | None]:
        return self.flag_in_init, os.environ.get("CORE_TEST_FLAG")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env_views(self) -> dict:
        addr, port = self.get_master_addr_port()
        return {
            "init": self.env_in_init,
            "method": {key: os.environ.get(key) for key in RANK_ENV_KEYS},
            "attrs": {
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": addr,
                "MASTER_PORT": port,
            },
        }


def test_rank_env_is_set_before_init_body_and_in_methods(backend, hf_worker_group):
    driver_env = {key: os.environ.get(key) for key in RANK_ENV_KEYS}
    wg = hf_worker_group(EnvWorker, [4], backend=backend)
    views = wg.env_views()
    for rank, view in enumerate(views):
        assert view["init"] == view["method"] == view["attrs"], f"rank {rank}: {view}"
        env = view["init"]
        assert env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(rank)
        assert env["LOCAL_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"]
        assert 0 < int(env["MASTER_PORT"]) < 65536
    assert len({(v["init"]["MASTER_ADDR"], v["init"]["MASTER_PORT"]) for v in views}) == 1
    # The driver's own environment is left alone (LocalBackend restores it after each call).
    assert {key: os.environ.get(key) for key in RANK_ENV_KEYS} == driver_env


def test_groups_on_one_pool_share_the_rendezvous(backend, hf_worker_group):
    pool = ResourcePool([2])
    first = hf_worker_group(EnvWorker, pool, backend=backend)
    second = hf_worker_group(EnvWorker, pool, backend=backend)
    pairs = {
        (view["method"]["MASTER_ADDR"], view["method"]["MASTER_PORT"])
        for view in first.env_views() + second.env_views()
    }
    assert len(pairs) == 1


def test_process_on_nodes_sets_local_ranks(backend, hf_worker_group):
    # On a one-host Dask cluster both node entries fit on that host.
    pool = ResourcePool([2, 2])
    assert pool.local_rank_list() == [0, 1, 0, 1]
    assert pool.local_world_size_list() == [2, 2, 2, 2]
    wg = hf_worker_group(EnvWorker, pool, backend=backend)
    envs = [view["method"] for view in wg.env_views()]
    assert [env["RANK"] for env in envs] == ["0", "1", "2", "3"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1", "0", "1"]
    assert [env["LOCAL_WORLD_SIZE"] for env in envs] == ["2", "2", "2", "2"]
    assert {env["WORLD_SIZE"] for env in envs} == {"4"}


def test_worker_env_adds_variables_to_every_rank(backend, hf_worker_group):
    wg = hf_worker_group(EnvWorker, [2], backend=backend, worker_env={"CORE_TEST_FLAG": "on"})
    assert wg.execute_all_sync("flags") == [("on", "on"), ("on", "on")]


class FlagReader(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def flag(self) -> str | None:
        return os.environ.get("CORE_TEST_FLAG")


def test_worker_env_of_one_group_is_not_seen_by_a_colocated_group(backend, hf_worker_group):
    pool = ResourcePool([2])
    flagged = hf_worker_group(EnvWorker, pool, backend=backend, worker_env={"CORE_TEST_FLAG": "on"})
    plain = hf_worker_group(FlagReader, pool, backend=backend)
    assert [f[1] for f in flagged.execute_all_sync("flags")] == ["on", "on"]
    assert plain.flag() == [None, None]  # same process, but not this group's variable
    assert [f[1] for f in flagged.execute_all_sync("flags")] == ["on", "on"]
