"""The library across real hosts: three network namespaces (each its own address and PID
namespace) running ``dask worker``, the scheduler in a fourth, the driver in the machine's
own namespace attached by address. These tests only read, so they share one set of hosts."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest
import torch
from distributed import get_worker

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.examples.grpo import GRPOConfig, run_demo

ROW_FLOATS = 256 * 1024  # one row of the chain's batch: 1 MiB of float32


class Where(hf.Worker):
    """Reports where it runs and keeps what it was given, in order."""

    def __init__(self) -> None:
        self.log: list = []

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def where(self):
        return {
            "address": get_worker().address,
            "pid": os.getpid(),
            "master": os.environ["MASTER_ADDR"],
        }

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def record(self, item):
        self.log.append(item)
        return item

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def history(self):
        return list(self.log)

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def total(self, tensor):
        return float(tensor.sum())

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def fail(self, message):
        raise ValueError(message)


class Producer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def widen(self, data):
        """Each input row becomes a 1 MiB row, made here (not sent by the driver)."""
        rows = data.batch["idx"].to(torch.float32)
        return hf.DataProto.from_dict({"x": rows[:, None].expand(-1, ROW_FLOATS).contiguous()})


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def row_means(self, data):
        return hf.DataProto.from_dict({"mean": data.batch["x"].mean(dim=1)})


@pytest.fixture(scope="module")
def hosts(hf_module_hosts):
    return hf_module_hosts(3)


@pytest.fixture(scope="module")
def backend(hosts):
    backend = DaskBackend(address=hosts.scheduler_address)
    yield backend
    backend.shutdown()


def hosts_of(hosts, addresses) -> list[int]:
    return [hosts.host_of(a) for a in addresses]


def test_grpo_demo_trains_with_its_ranks_on_three_hosts(backend):
    config = GRPOConfig(prompts_per_step=24, seed=0)
    result = run_demo(3, world_size=3, nodes=3, config=config, backend=backend)
    assert [s["step"] for s in result["steps"]] == [1, 2, 3]
    # gloo all-reduced the gradients across the three hosts: the ranks stayed identical
    first, *others = result["param_checksums"]
    assert others == [first, first]
    assert first != result["initial_checksum"]


def test_each_rank_runs_on_its_own_host_and_rendezvous_at_rank_zeros(
    hosts, backend, hf_worker_group
):
    group = hf_worker_group(Where, [1, 1, 1], backend=backend)
    seen = group.where()
    assert sorted(hosts_of(hosts, [s["address"] for s in seen])) == [0, 1, 2]
    rank0_ip = seen[0]["address"].split("://")[1].rsplit(":", 1)[0]
    assert {s["master"] for s in seen} == {rank0_ip}
    # own PID namespaces: each host's worker is an early pid there, invisible to the others
    assert all(s["pid"] < 100 for s in seen)


def test_lanes_to_other_hosts_are_tcp_even_though_they_offer_a_local_socket(
    backend, hf_worker_group
):
    group = hf_worker_group(Where, [1, 1, 1], backend=backend)
    group.where()
    for ref in group._refs:  # each worker offers one, reachable in its own namespace only
        offer = backend._direct._ask("hf_lane", ref.slot, 10, driver=backend.driver_id)
        assert offer[3] is not None
    opened = [lane for lane in (backend._direct._lanes or {}).values() if lane is not None]
    assert len(opened) >= 3
    assert all(lane._raw.family == socket.AF_INET for lane in opened), opened


def test_calls_on_ranks_on_other_hosts_run_in_issue_order(backend, hf_worker_group):
    group = hf_worker_group(Where, [1, 1, 1], backend=backend)
    futures = [group.record(i) for i in range(200)]
    assert group.history() == [list(range(200))] * 3
    assert hf.get(futures[-1]) == [199] * 3


def test_arguments_are_snapshots_when_the_call_crosses_hosts(backend, hf_worker_group):
    group = hf_worker_group(Where, [1, 1], backend=backend)
    tensor = torch.ones(1 << 20)
    pending = group.total(tensor)
    tensor.zero_()  # after the call was made: the workers must not see it
    assert hf.get(pending) == [float(1 << 20)] * 2


def test_a_remote_error_names_group_method_and_rank_across_hosts(backend, hf_worker_group):
    group = hf_worker_group(Where, [1, 1], backend=backend, name_prefix="remote_err")
    with pytest.raises(ValueError, match="nope") as info:
        group.fail("nope")
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "remote_err" in notes and "fail" in notes and "rank 0" in notes


def test_groups_on_one_pool_share_each_ranks_process_on_every_host(hosts, backend, hf_worker_group):
    pool = hf.ResourcePool([1, 1])
    a = hf_worker_group(Where, pool, backend=backend)
    b = hf_worker_group(Where, pool, backend=backend)
    where_a, where_b = a.where(), b.where()
    assert [w["address"] for w in where_a] == [w["address"] for w in where_b]
    assert [w["pid"] for w in where_a] == [w["pid"] for w in where_b]
    assert len(set(hosts_of(hosts, [w["address"] for w in where_a]))) == 2


def test_a_64_mib_chain_between_hosts_moves_worker_to_worker(hosts, backend, hf_worker_group):
    producer = hf_worker_group(Producer, [1, 1], backend=backend)
    consumer = hf_worker_group(Consumer, [1], backend=backend)
    rows = 64  # 64 MiB once widened
    batch = hf.DataProto.from_dict({"idx": torch.arange(rows)})
    consumer.row_means(producer.widen(batch))  # warm: connections, imports
    before = hosts.driver_bytes()
    links_before = [hosts.link_bytes(i)["received"] for i in range(3)]
    out = consumer.row_means(producer.widen(batch))
    after = hosts.driver_bytes()
    links_after = [hosts.link_bytes(i)["received"] for i in range(3)]
    assert torch.equal(out.batch["mean"], torch.arange(rows, dtype=torch.float32))
    through_driver = sum(after.values()) - sum(before.values())
    assert through_driver < 1 << 20, f"{through_driver} bytes went through the driver's link"
    # the consumer's host received the half that was not already there: >= 32 MiB
    assert max(b - a for a, b in zip(links_before, links_after)) >= 32 << 20


def test_dashboard_shows_each_ranks_host(hosts, backend, hf_worker_group):
    group = hf_worker_group(Where, [1, 1, 1], backend=backend, name_prefix="dash_hosts")
    group.where()
    with urllib.request.urlopen(backend.groups_page + "/groups.json", timeout=10) as response:
        groups = {g["name"]: g for g in json.loads(response.read())["groups"]}
    ranks = groups["dash_hosts"]["ranks"]
    assert sorted(hosts_of(hosts, [r["address"] for r in ranks])) == [0, 1, 2]
    assert sorted(r["host"] for r in ranks) == sorted(hosts.addresses)
