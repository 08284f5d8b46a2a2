"""An instance on a Dask worker behaves at least as well as a Ray actor, on both call paths.

Each test reproduces a way the old worker side (shared task threads, ``os.environ``
switching, zero-copy hand-over, a loop run only during calls) went wrong, on real
clusters, for the direct path and for the task path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import dask
import pytest
import torch
from distributed import Client, LocalCluster

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError
from hybridflow_dask.backends.dask.internals import workers_of

PATHS = ["direct", "task"]


def make_backend(path: str, **kwargs) -> DaskBackend:
    with dask.config.set({"hybridflow.call-path": path, "hybridflow.call-timeout": "60s"}):
        return DaskBackend(**kwargs)


@pytest.fixture(scope="module", params=PATHS)
def path_backend(request, hf_dask_cluster):
    with dask.config.set({"hybridflow.fresh-processes": False}):  # the session's workers
        backend = make_backend(request.param, cluster=hf_dask_cluster)
    assert backend.call_path == request.param
    yield backend
    backend.shutdown()


class Producer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data):
        return hf.DataProto.from_dict({"x": data.batch["x"] * 1}, meta_info={"owner": "producer"})

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def slow_make(self, data):
        time.sleep(3)
        return hf.DataProto.from_dict({"x": data.batch["x"] * 1})

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def spoil(self, data):
        data.batch["x"].mul_(0)
        data.meta_info["owner"] = "consumer"
        return data

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, materialize_futures=False)
    def resolve_itself(self, data):
        return data.get()

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def copy(self, data):
        return data

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def ping(self):
        return "pong"


def rows(n: int) -> hf.DataProto:
    return hf.DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32) + 1})


# -- 1: materialize_futures=False on one-thread workers ------------------------------------


def test_a_rank_resolving_its_own_future_on_single_threaded_workers_does_not_deadlock(
    path_backend, hf_worker_group
):
    # Two producer ranks feed one consumer rank: the consumer's rows must be re-split
    # by tasks pinned to its own one-thread worker while its method waits for them. The
    # session's workers have one thread each (it only reads, so it shares them).
    producer = hf_worker_group(Producer, [2], backend=path_backend)
    consumer = hf_worker_group(Consumer, [1], backend=path_backend)
    address = consumer._refs[0].slot.address
    assert workers_of(path_backend.client)[address]["nthreads"] == 1
    out = consumer.resolve_itself(producer.make(rows(6)))  # a deadlock: the 60 s call-timeout
    assert torch.equal(out.batch["x"], torch.arange(6, dtype=torch.float32) + 1)
    assert consumer.ping() == ["pong"]  # the instance is not wedged


# -- 2: an input lost with its worker on an attached cluster -------------------------------


@pytest.fixture
def plain_cluster():
    """An attached cluster with Dask's defaults (no no-workers timeout)."""
    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0"
    )
    yield cluster
    cluster.close()


@pytest.mark.cluster
@pytest.mark.parametrize("path", PATHS)
def test_an_input_lost_with_its_worker_fails_the_chain_but_not_the_consumer(path, plain_cluster):
    backend = make_backend(path, cluster=plain_cluster)
    try:
        producer = hf.WorkerGroup(hf.ResourcePool([1]), Producer, backend=backend)
        consumer = hf.WorkerGroup(hf.ResourcePool([1]), Consumer, backend=backend)
        assert producer._refs[0].slot.address != consumer._refs[0].slot.address
        pid = _pid_of(backend, producer)
        chained = consumer.execute_all_async("copy", producer.slow_make(rows(4)))
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            hf.get(chained)
        start = time.monotonic()
        assert consumer.ping() == ["pong"]  # not wedged behind the call that cannot run
        assert time.monotonic() - start < 10
    finally:
        backend.shutdown()


@pytest.mark.cluster
@pytest.mark.parametrize("path", PATHS)
def test_a_kept_result_whose_worker_died_fails_its_gather_naming_the_rank(path, plain_cluster):
    """The result is finished and kept on its worker when the worker is killed: gathering
    it is a WorkerLostError within 5 s (not Dask's cancellation, and on the task path not
    a wait for the dead worker to recompute it)."""
    backend = make_backend(path, cluster=plain_cluster)
    try:
        producer = hf.WorkerGroup(hf.ResourcePool([1]), Producer, backend=backend)
        kept = producer.make(rows(1 << 18))  # 1 MiB: kept on the worker, fetched on gather
        deadline = time.monotonic() + 10
        while not all(part.done() for part in kept.parts):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(_pid_of(backend, producer), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match=r"rank 0 of worker group"):
            hf.get(kept)
        assert time.monotonic() - start < 5
    finally:
        backend.shutdown()


def _pid_of(backend: DaskBackend, group: hf.WorkerGroup) -> int:
    address = group._refs[0].slot.address
    return backend.client.run(os.getpid, workers=[address])[address]


# -- 3: a colocated consumer cannot change the producer's stored result --------------------


def test_a_colocated_consumer_changing_its_input_never_changes_the_producers_result(
    path_backend, hf_worker_group
):
    pool = hf.ResourcePool([2])
    producer = hf_worker_group(Producer, pool, backend=path_backend)
    consumer = hf_worker_group(Consumer, pool, backend=path_backend)
    made = producer.make(rows(4))
    spoiled = consumer.spoil(made)
    assert torch.equal(spoiled.batch["x"], torch.zeros(4))
    kept = hf.get(made)
    assert torch.equal(kept.batch["x"], torch.arange(4, dtype=torch.float32) + 1)
    assert kept.meta_info["owner"] == "producer"
    again = consumer.copy(made)  # another consumer of the same result sees it intact too
    assert torch.equal(again.batch["x"], torch.arange(4, dtype=torch.float32) + 1)


# -- 4: colocated instances running at once never see each other's environment -------------


class EnvReader(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def read_many(self, times: int) -> list[str]:
        seen = []
        for _ in range(times):
            seen.append(os.environ.get("WHO", "<unset>"))
            time.sleep(0.002)
        return seen


@pytest.fixture(scope="module")
def two_thread_worker():
    """One worker process with two task threads, shared by the paths (the test only reads)."""
    cluster = LocalCluster(
        n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1", dashboard_address=":0"
    )
    yield cluster
    cluster.close()


@pytest.mark.cluster
@pytest.mark.parametrize("path", PATHS)
def test_colocated_instances_called_at_once_never_see_each_others_environment(
    path, two_thread_worker
):
    backend = make_backend(path, cluster=two_thread_worker)
    try:
        pool = hf.ResourcePool([1])
        a = hf.WorkerGroup(pool, EnvReader, backend=backend, worker_env={"WHO": "a"})
        b = hf.WorkerGroup(pool, EnvReader, backend=backend, worker_env={"WHO": "b"})
        futures = []
        for _ in range(10):
            futures.append(("a", a.read_many(20)))
            futures.append(("b", b.read_many(20)))
        for who, future in futures:
            assert set(hf.get(future)[0]) == {who}
    finally:
        backend.shutdown()


# -- 5: async instances keep a running loop; their calls overlap ---------------------------


class Ticker(hf.Worker):
    def __init__(self) -> None:
        self.ticks = 0
        self.task = None

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    async def start(self) -> None:
        async def tick():
            while True:
                self.ticks += 1
                await asyncio.sleep(0.01)

        self.task = asyncio.get_running_loop().create_task(tick())

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    async def count(self) -> int:
        return self.ticks

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    async def nap(self, seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def thread_name(self) -> str:
        return threading.current_thread().name


def test_an_async_instance_keeps_its_loop_running_between_calls(path_backend, hf_worker_group):
    group = hf_worker_group(Ticker, [1], backend=path_backend)
    group.start()
    first = group.count()[0]
    time.sleep(1.0)
    # a loop that ran only during calls would have ticked once or twice meanwhile
    assert group.count()[0] - first >= 30


def test_async_calls_to_one_instance_overlap(path_backend, hf_worker_group):
    group = hf_worker_group(Ticker, [1], backend=path_backend)
    group.count()  # created and warm
    start = time.monotonic()
    naps = [group.nap(0.6) for _ in range(4)]
    assert [hf.get(n)[0] for n in naps] == [0.6] * 4
    assert time.monotonic() - start < 2.0  # four 0.6 s naps one after another take 2.4 s


def test_methods_run_in_the_instances_own_thread(path_backend, hf_worker_group):
    group = hf_worker_group(Ticker, [2], backend=path_backend)
    names = group.thread_name()
    assert all(name.startswith(f"hf-{group.name_prefix}/") for name in names), names


# -- 6: two backends on one client both learn of a dead worker ------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("path", PATHS)
def test_two_backends_on_one_client_both_detect_a_dead_worker(path, plain_cluster):
    client = Client(plain_cluster, set_as_default=False)
    first = make_backend(path, client=client)
    second = make_backend(path, client=client)
    try:
        g1 = hf.WorkerGroup(hf.ResourcePool([1]), Consumer, backend=first)
        address = g1._refs[0].slot.address
        pid = client.run(os.getpid, workers=[address])[address]
        second.shutdown()  # one backend leaving must not cut the other off
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerLostError):
            g1.ping()
        assert time.monotonic() - start < 5
    finally:
        first.shutdown()
        second.shutdown()
        client.close()


# -- 7: nothing is left on the worker after a group with a failed pending call is gone -------


class Flaky(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def fail_later(self):
        time.sleep(0.05)
        raise RuntimeError("planned failure")


def _actors(dask_worker) -> int:
    return len(dask_worker.plugins["hybridflow-instances"].instances)


def test_a_group_shut_down_with_a_failing_call_pending_leaves_nothing_on_the_worker(
    path_backend,
):
    pool = hf.ResourcePool([1])
    for _ in range(10):
        group = hf.WorkerGroup(pool, Flaky, backend=path_backend)
        pending = group.fail_later()
        group.shutdown()
        with pytest.raises((RuntimeError, LookupError)):
            hf.get(pending)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sum(path_backend.client.run(_actors).values()) == 0:
            break
        time.sleep(0.1)
    assert sum(path_backend.client.run(_actors).values()) == 0


# -- 8: a future of a backend that was shut down ------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("path", PATHS)
def test_getting_a_pending_future_after_shutdown_says_the_backend_was_shut_down(path):
    backend = make_backend(path, n_workers=1)
    group = hf.WorkerGroup(hf.ResourcePool([1]), Producer, backend=backend)
    pending = group.slow_make(rows(2))
    backend.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        hf.get(pending)
