"""Faults only a network shows: a host's link cut during a call and between calls, the
driver cut off from the scheduler, a whole host lost, a slow link. Each row of the fault
table in docs/multi-node.md is one of these tests.

Three hosts of one worker each; the driver's bounds are made short here
(``unreachable-timeout`` and ``scheduler-timeout`` 3 s) so the module stays quick.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import dask
import pytest
import torch
from distributed import get_worker

import hybridflow_dask as hf
from hybridflow_dask.backends import (
    DaskBackend,
    SchedulerLostError,
    WorkerLostError,
    WorkerUnreachableError,
)
from hybridflow_dask.backends.dask.internals import workers_of
from hybridflow_dask.examples.grpo import GRPOConfig, run_demo

BOUND_S = 3.0
#: What finding a cut may take beyond the bound: the first probe starts a second into a
#: wait, probes run every half second and each may take 2 s to give up.
SLACK_S = 4.0


class Napper(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def address(self):
        return get_worker().address

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds):
        time.sleep(seconds)
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def touch(self, folder):
        (Path(folder) / f"rank{self.rank}").write_text("ran")
        return self.rank

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def double(self, data):
        return hf.DataProto.from_dict({"x": data.batch["x"] * 2})


@pytest.fixture(scope="module")
def bounds():
    with dask.config.set(
        {
            "hybridflow.unreachable-timeout": f"{BOUND_S}s",
            "hybridflow.scheduler-timeout": f"{BOUND_S}s",
        }
    ):
        yield


@pytest.fixture(scope="module")
def hosts(hf_module_hosts, bounds):
    return hf_module_hosts(3)


@pytest.fixture
def backend(hosts):
    backend = DaskBackend(address=hosts.scheduler_address)
    yield backend
    backend.shutdown()


@pytest.fixture(autouse=True)
def links_back(hosts):
    """Whatever a test cut, the next one starts with every link up and every host running
    (a host whose workers are still restarting is waited for)."""
    yield
    hosts.heal_driver()
    for i, host in enumerate(hosts.hosts):
        hosts.heal(i)
        hosts.clear_rate_limit(i)
        if not host.alive:
            hosts.restart_host(i)
    hosts.wait_for_workers(3)


def host_of_rank(hosts, group, rank: int) -> int:
    return hosts.host_of(group.address()[rank])


def workers_on(client, host_ip: str) -> set[str]:
    """Addresses of the workers on a host (a restarted worker listens on a new port)."""
    workers = workers_of(client)
    return {a for a, w in workers.items() if w["host"] == host_ip}


def test_a_host_cut_during_a_call_is_unreachable_within_the_bound_and_recovery_moves_on(
    hosts, backend
):
    group = hf.WorkerGroup(hf.ResourcePool([1, 1]), Napper, backend=backend)
    cut = host_of_rank(hosts, group, 1)
    spare = ({0, 1, 2} - {cut, host_of_rank(hosts, group, 0)}).pop()
    before = workers_on(backend.client, hosts.hosts[cut].address)
    pending = group.nap(1.0)
    hosts.cut(cut)
    start = time.monotonic()
    with pytest.raises(WorkerUnreachableError, match="unreachable") as info:
        hf.get(pending)
    took = time.monotonic() - start
    assert BOUND_S <= took < BOUND_S + SLACK_S, took
    assert "rank 1" in str(info.value) and isinstance(info.value, WorkerLostError)

    # the run goes on: Recovery rebuilds rank 1 on the spare host
    recovery = hf.Recovery([group], lambda rebuilt: None)
    assert recovery.run(lambda: hf.get(group.nap(0.0))) == [0, 1]
    assert host_of_rank(hosts, group, 1) == spare
    assert recovery.records[0].ranks[group.name_prefix] == [1]

    # the link comes back: the cut host's worker is replaced by a fresh process
    hosts.heal(cut)
    deadline = time.monotonic() + 60
    while workers_on(backend.client, hosts.hosts[cut].address) in (set(), before):
        assert time.monotonic() < deadline, "the cut host's worker never came back fresh"
        time.sleep(0.5)
    group.shutdown()
    hosts.wait_for_workers(3)
    everywhere = hf.WorkerGroup(hf.ResourcePool([1, 1, 1]), Napper, backend=backend)
    assert sorted(hosts.host_of(a) for a in everywhere.address()) == [0, 1, 2]
    everywhere.shutdown()


def test_a_call_made_after_the_cut_fails_within_the_bound_and_never_runs_later(
    hosts, backend, tmp_path
):
    group = hf.WorkerGroup(hf.ResourcePool([1, 1]), Napper, backend=backend)
    # a second driver's instances on every host: the cut worker is not restarted when its
    # link returns (it is not ours alone), so only a late delivery could run the call
    with DaskBackend(address=hosts.scheduler_address) as other_driver:
        other = hf.WorkerGroup(hf.ResourcePool([1, 1, 1]), Napper, backend=other_driver)
        cut = host_of_rank(hosts, group, 1)
        hosts.cut(cut)
        start = time.monotonic()
        with pytest.raises(WorkerUnreachableError):
            group.touch(str(tmp_path))
        assert time.monotonic() - start < BOUND_S + SLACK_S
        hosts.heal(cut)
        assert other.address()  # every host answers again (the cut one included)
        time.sleep(3)  # TCP would have retransmitted by now
        assert (tmp_path / "rank0").exists()
        assert not (tmp_path / "rank1").exists(), "a call reported failed ran on the worker"
        other.shutdown()
    group.shutdown()


def test_the_driver_cut_off_is_scheduler_lost_within_scheduler_timeout(hosts, backend):
    group = hf.WorkerGroup(hf.ResourcePool([1]), Napper, backend=backend)
    pending = group.nap(1.0)
    hosts.cut_driver()
    start = time.monotonic()
    try:
        with pytest.raises(SchedulerLostError):
            hf.get(pending)
        took = time.monotonic() - start
    finally:
        hosts.heal_driver()  # before the backend's teardown, which would wait out the cut
    assert BOUND_S <= took < BOUND_S + SLACK_S, took


def test_a_short_cut_of_the_driver_costs_nothing(hosts, backend):
    group = hf.WorkerGroup(hf.ResourcePool([1, 1]), Napper, backend=backend)
    pending = group.nap(0.5)
    hosts.cut_driver()
    time.sleep(1.0)  # below every bound
    hosts.heal_driver()
    assert hf.get(pending) == [0, 1]
    assert group.nap(0.0) is not None and hf.get(group.nap(0.0)) == [0, 1]
    group.shutdown()


def test_a_whole_host_lost_mid_run_is_rebuilt_elsewhere_and_the_demo_goes_on(
    hosts, backend, tmp_path
):
    def rank_host(rank: int) -> int:
        with urllib.request.urlopen(backend.groups_page + "/groups.json", timeout=10) as r:
            groups = json.loads(r.read())["groups"]
        [grpo] = [g for g in groups if g["name"].startswith("grpo_") and g["ranks"]]
        return hosts.host_of(grpo["ranks"][rank]["address"])

    killed = []

    def on_step(record):
        if record["step"] == 2:
            killed.append(rank_host(1))
            hosts.kill_host(killed[0])  # every process of that host, at once

    result = run_demo(
        6,
        world_size=2,
        nodes=2,
        config=GRPOConfig(seed=0),
        backend=backend,
        on_step=on_step,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
    )
    assert [s["step"] for s in result["steps"]] == list(range(1, 7))
    [recovery] = result["recoveries"]
    assert recovery["step"] == 3 and recovery["ranks"] == [1]
    first, second = result["param_checksums"]
    assert first == second != result["initial_checksum"]
    assert killed and not hosts.hosts[killed[0]].alive


def test_a_slow_link_is_not_a_death(hosts, backend):
    group = hf.WorkerGroup(hf.ResourcePool([1, 1]), Napper, backend=backend)
    slow = host_of_rank(hosts, group, 1)
    hosts.rate_limit(slow, "40mbit")  # 5 MB/s: 8 MiB each way takes longer than the bound
    x = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB, half to each rank
    start = time.monotonic()
    out = group.double(hf.DataProto.from_dict({"x": x}))
    assert time.monotonic() - start > BOUND_S  # it was slow, and nobody was declared lost
    assert torch.equal(out.batch["x"], x * 2)
    assert group.recover() == []  # no rank was lost
    group.shutdown()
