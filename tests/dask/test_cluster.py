"""The Dask backend against real clusters: placement, names, torch.distributed, defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from stream_helpers import wait_for_streamed

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.backends.dask.driver.cluster import choose_local_cluster


class Gloo(hf.Worker):
    def __init__(self) -> None:
        super().__init__()
        dist.init_process_group("gloo")  # env:// from the rank env the backend set

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float):
        tensor = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(tensor)
        return tensor.item(), dist.get_rank(), dist.get_world_size(), os.getpid()


class Colocated(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def default_group(self):
        return dist.is_initialized() and dist.get_world_size(), os.getpid()


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return x


def test_gloo_all_reduce_across_two_worker_processes(hf_dask_backend, hf_worker_group):
    pool = hf.ResourcePool([2])
    group = hf_worker_group(Gloo, pool, backend=hf_dask_backend)
    results = group.all_reduce(1.0)
    assert [r[0] for r in results] == [3.0, 3.0]  # 1*1 + 1*2 on both ranks
    assert [r[1:3] for r in results] == [(0, 2), (1, 2)]
    assert results[0][3] != results[1][3]  # two processes
    # A second group on the same pool lives in the same processes and sees their
    # default process group.
    other = hf_worker_group(Colocated, pool, backend=hf_dask_backend)
    assert [pid for _, pid in other.default_group()] == [r[3] for r in results]
    assert [size for size, _ in other.default_group()] == [2, 2]
    group.execute_all_sync(
        "execute_with_func_generator", _destroy_pg, hf.DataProto.from_dict({"x": torch.zeros(2)})
    )


def _destroy_pg(worker, data):
    dist.destroy_process_group()
    return data


@pytest.mark.cluster
def test_pool_larger_than_an_external_cluster_is_a_value_error():
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
    ) as cluster:
        with DaskBackend(cluster=cluster) as backend:
            with pytest.raises(ValueError, match=r"needs 3 worker processes but only 2"):
                hf.WorkerGroup(hf.ResourcePool([3]), Echo, backend=backend)
            # nothing was taken: a pool that fits still works afterwards
            with hf.WorkerGroup(hf.ResourcePool([2]), Echo, backend=backend) as group:
                assert group.echo(7) == [7, 7]
        assert len(cluster.scheduler_info["workers"]) == 2  # the external cluster is left running


def test_use_gpu_on_a_cpu_cluster_is_a_value_error(hf_dask_backend):
    with pytest.raises(ValueError, match=r"use_gpu=True.*no worker of this cluster has one"):
        hf.WorkerGroup(hf.ResourcePool([1], use_gpu=True), Echo, backend=hf_dask_backend)


@pytest.mark.cluster
def test_worker_names_and_task_keys_are_visible_to_the_scheduler(hf_worker_group):
    with DaskBackend() as backend:
        group = hf_worker_group(Echo, [2], backend=backend, name_prefix="critic")
        group.echo(1)

        def names_and_prefixes(dask_scheduler):
            names = sorted(str(ws.name) for ws in dask_scheduler.workers.values())
            prefixes = sorted(dask_scheduler.task_prefixes)
            return names, prefixes

        names, _ = backend.client.run_on_scheduler(names_and_prefixes)
        shown = wait_for_streamed(backend.client, {"critic.echo", "critic.__init__"})
        group.shutdown()
    assert names == ["hf-slot-0", "hf-slot-1"]
    assert {"critic.echo", "critic.__init__"} <= shown


@pytest.mark.parametrize(
    ("gpus", "cuda_ok", "kind"),
    [
        (0, True, "LocalCluster"),
        (0, False, "LocalCluster"),
        (2, True, "LocalCUDACluster"),
        (2, False, "LocalCluster"),
    ],
)
def test_local_cluster_choice_from_the_gpu_probe(gpus, cuda_ok, kind):
    choice = choose_local_cluster(
        gpus, "NVML", cuda_ok, "dask-cuda is importable" if cuda_ok else "missing"
    )
    assert choice.kind == kind
    assert choice.gpus == gpus
    if gpus and not cuda_ok:
        assert "hybridflow-dask[cuda]" in choice.reason


#: A driver script's head: the package and a worker class (the test adds its body).
ECHO_SCRIPT = """
import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend
from hybridflow_dask.runtime import default_backend

class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return x
"""


def run_driver_script(folder, body: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``ECHO_SCRIPT`` followed by ``body`` as a driver program of its own."""
    script = folder / "driver.py"
    script.write_text(ECHO_SCRIPT + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.cluster
def test_default_backend_starts_a_local_dask_cluster_and_closes_it_at_exit(tmp_path):
    body = """
        if __name__ == "__main__":
            group = hf.WorkerGroup(hf.ResourcePool([1]), Echo)
            print(type(default_backend()).__name__, group.echo(5))
        """
    done = run_driver_script(tmp_path, body, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "DaskBackend [5]" in done.stdout


def test_dataproto_travels_with_the_registered_serializer(hf_dask_backend):
    from distributed.protocol import serialize

    data = hf.DataProto.from_dict({"x": torch.randn(1024, 16)}, non_tensors={"s": ["a"] * 1024})
    header, _ = serialize(data, serializers=("dask", "pickle"))
    assert header["serializer"] == "dask"

    size, total = hf_dask_backend.client.submit(_size_and_sum, data, pure=False).result()
    assert size >= 1024 * 16 * 4
    assert total == pytest.approx(float(data.batch["x"].sum()))


def _size_and_sum(data):
    # At module level, so that Dask pickles the task with plain pickle. A local function
    # sends Dask's pickler down its fallback, which recurses to the recursion limit on any
    # object whose Dask serializer yields memoryviews (a tensor, a DataProto) before it
    # gives up and uses cloudpickle; finalizers that a garbage collection ran at that depth
    # could not even be reported (pytest's hook hit the limit), which failed a CI run.
    from dask.sizeof import sizeof

    return sizeof(data), float(data.batch["x"].sum())


@pytest.mark.cluster
@pytest.mark.gpu
def test_local_cuda_cluster_pins_one_worker_per_gpu():
    """Runs only with a GPU: the owned cluster is a LocalCUDACluster, one worker per device."""
    with DaskBackend() as backend:
        assert backend.choice.kind == "LocalCUDACluster"
        n = torch.cuda.device_count()
        with hf.WorkerGroup(hf.ResourcePool([n], use_gpu=True), Echo, backend=backend) as group:
            devices = [info["cuda_visible_devices"].split(",")[0] for info in group._process_info()]
            assert sorted(devices) == [str(i) for i in range(n)]


@pytest.mark.cluster
def test_a_script_that_starts_a_backend_when_imported_fails_at_once_naming_the_guard(tmp_path):
    # Each worker process imports the driver script, makes a backend there and dies; the
    # driver says so as soon as the nanny gives up, instead of waiting out its 120 s.
    body = """
        backend = DaskBackend(n_workers=1)
        group = hf.WorkerGroup(hf.ResourcePool([1]), Echo, backend=backend)
        """
    done = run_driver_script(tmp_path, body, timeout=90)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: worker processes ['hf-slot-0'] of the local cluster")
    assert 'if __name__ == "__main__":' in last
