"""RayBackend's own behaviours on a real local Ray instance (the contract's are the kit's)."""

from __future__ import annotations

import itertools
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'hybridflow-dask[ray]')")

import torch  # noqa: E402
from ray_workers import AsyncEcho, Echo  # noqa: E402

import hybridflow_dask as hf  # noqa: E402
from hybridflow_dask import runtime  # noqa: E402
from hybridflow_dask.backends.ray import RayBackend, RayFuture  # noqa: E402
from hybridflow_dask.backends.ray import futures as ray_futures  # noqa: E402
from hybridflow_dask.backends.ray.call_names import call_name, read_call_name  # noqa: E402
from hybridflow_dask.backends.ray.worker.slot_actor import CALL_THREADS  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture
def backend(ray_backend: RayBackend) -> RayBackend:
    return ray_backend


@pytest.fixture
def groups(backend: RayBackend) -> Iterator[Any]:
    made: list[hf.WorkerGroup] = []

    def make(pool: Any, factor: float = 1.0, **kw: Any) -> hf.WorkerGroup:
        pool = pool if isinstance(pool, hf.ResourcePool) else hf.ResourcePool(pool)
        group = hf.WorkerGroup(pool, hf.ClassWithInitArgs(Echo, factor), backend=backend, **kw)
        made.append(group)
        return group

    yield make
    for group in reversed(made):
        group.shutdown()


def test_the_readme_example_runs_on_ray_and_a_to_b_never_passes_the_driver(
    ray_backend, monkeypatch, capsys
):
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Twenty lines") :], re.S)
    assert code is not None
    main = 'if __name__ == "__main__":  # Dask starts worker processes that import this module\n'
    assert main in code.group(1)
    # The one change: a RayBackend as the default backend. The session's, so its hosts
    # serve the later tests; its closing hf.shutdown() only forgets it here, and the
    # example's groups are shut down below.
    program = code.group(1).replace(main, main + "    hf.init(backend)\n")
    # (the default backend is put back as it was, unset, when the test ends)
    monkeypatch.setattr(runtime, "_default", runtime._default)
    monkeypatch.setattr(hf, "shutdown", lambda: setattr(runtime, "_default", None))
    calls: list[tuple[str, Any]] = []
    fetched: list[Any] = []
    real_call, real_get = RayBackend.call, ray.get

    def record_call(self: RayBackend, ref: Any, *args: Any, **kwargs: Any) -> Any:
        future = real_call(self, ref, *args, **kwargs)
        calls.append((ref.group, future.ref))
        return future

    def record_get(refs: Any, *args: Any, **kwargs: Any) -> Any:
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    monkeypatch.setattr(RayBackend, "call", record_call)
    monkeypatch.setattr(ray_futures.ray, "get", record_get)
    names = {"__name__": "__main__", "backend": ray_backend}
    try:
        exec(compile(program, "README.md", "exec"), names)
    finally:
        for group in ("b", "a"):
            if group in names:
                names[group].shutdown()
    assert "tensor([ -0., -10., -20., -30., -40., -50., -60.])" in capsys.readouterr().out
    made_by_a = {ref for group, ref in calls if group == names["a"].name_prefix}
    assert made_by_a and not made_by_a & set(fetched), "the driver fetched a's results"


def test_a_long_call_does_not_hold_up_routing_on_its_slot(groups, backend):
    pool = hf.ResourcePool([1])
    slow, other = groups(pool), groups(pool)
    pids = slow.pid()
    assert pids == other.pid(), "groups on one pool must share the slot actor"
    sleeping = slow.sleep(3.0)
    start = time.monotonic()
    routed = backend.submit(os.getpid, slot=slow.workers[0].slot, label="t.pid")
    assert backend.gather([routed]) == pids
    assert time.monotonic() - start < 2.0, "a routing function waited for a method to end"
    assert hf.get(sleeping) == [3.0]


def test_colocated_instances_run_every_call_on_their_slot_actors_one_thread(groups):
    pool = hf.ResourcePool([1])
    first, second = groups(pool), groups(pool)
    (thread,) = set(first.thread() + second.thread() + first.thread())
    assert not thread.startswith("hf-"), f"a call was handed to a thread of its own ({thread})"


def test_an_instance_with_async_methods_gets_a_thread_of_its_own(backend):
    group = hf.WorkerGroup(hf.ResourcePool([1]), AsyncEcho, backend=backend)
    try:
        (name,) = group.thread()
        assert name.startswith("hf-"), f"its calls ran on the slot actor's thread ({name})"
        assert group.nap(0.01) == [0.01]
    finally:
        group.shutdown()


def test_more_calls_than_a_slot_actor_has_threads_wait_in_ray_and_run_in_order(groups, backend):
    group = groups([1])
    ref = group.workers[0]
    group.sleep(1.0)  # every later call waits for its turn, holding a thread or in Ray's queue
    calls = CALL_THREADS + 50
    futures = [backend.call(ref, "count", (), {}, label="t.count") for _ in range(calls)]
    assert backend.gather(futures) == list(range(1, calls + 1))


def test_a_call_given_no_arguments_is_said_by_its_task_name(groups, backend):
    group = groups([1])
    ref = group.workers[0]
    (named,) = group.task_name()
    (carried,) = group.task_name("an argument")  # the call's message is its argument
    key, driver, seq, method = read_call_name(named)
    assert (key, driver, method) == (ref.key, backend.driver_id, "task_name")
    assert seq >= 1
    assert carried != named and carried.endswith(".call"), carried


def test_calls_with_and_without_arguments_run_in_the_order_they_were_made(groups, backend):
    ref = groups([1]).workers[0]
    steps = [1 if i % 3 else 5 for i in range(60)]  # ``()`` for 1: said by the task's name
    futures = [
        backend.call(ref, "tally", () if step == 1 else (step,), {}, label="t.tally")
        for step in steps
    ]
    assert backend.gather(futures) == list(itertools.accumulate(steps))


def test_a_call_name_keeps_an_instance_key_with_spaces():
    name = call_name("my group:0#a1 b2", "driver-1234abcd", 17, "generate")
    assert read_call_name(name) == ("my group:0#a1 b2", "driver-1234abcd", 17, "generate")


def test_a_result_is_captured_before_the_next_call_changes_it(groups):
    group = groups([1])
    early = group.big_state()  # 4 MiB: serialized by Ray only after the coroutine ends
    group.bump()  # the next call changes the very tensor in place
    (value,) = hf.get(early)
    assert float(value.sum()) == 0.0, "a later call changed a result already returned"


def test_a_result_of_an_instance_on_a_thread_of_its_own_is_captured_as_it_returns(backend):
    # Ray stores it after that thread has gone on to the next call: it is copied first
    group = hf.WorkerGroup(hf.ResourcePool([1]), AsyncEcho, backend=backend)
    try:
        early = group.big_state()
        group.bump()
        (value,) = hf.get(early)
        assert float(value.sum()) == 0.0, "a later call changed a result already returned"
    finally:
        group.shutdown()


def test_large_arguments_are_captured_when_the_call_is_made(groups, backend):
    group = groups([1])
    tensor = torch.ones(1 << 20)
    ref = group.workers[0]
    future = backend.call(ref, "total", (tensor,), {}, label="t.total")
    tensor.add_(1)
    assert backend.gather([future]) == [float(1 << 20)]


def test_numpy_arguments_arrive_writable(groups):
    group = groups([1])
    array = np.zeros(1 << 18)  # 2 MiB: Ray hands it out of its object store
    assert group.add_in_place(array) == [float(1 << 18)]
    assert array.sum() == 0.0, "the caller's array changed"


def test_a_future_resolved_inside_a_method_may_route_through_its_own_slot(groups):
    pool = hf.ResourcePool([1])
    producer, consumer = groups([1, 1]), groups(pool)
    future = producer.scale(hf.DataProto.from_dict({"x": torch.arange(4.0)}))
    # 2 parts, resolved in the consumer's host: the routing runs next to the parts while
    # the consumer's own method waits for it
    assert consumer.resolve(future) == [[0.0, 1.0, 2.0, 3.0]]


def test_submit_runs_on_the_slot_it_names(groups, backend):
    group = groups([2])
    pids = group.pid()
    for rank, ref in enumerate(group.workers):
        future = backend.submit(os.getpid, slot=ref.slot, label="t.pid")
        assert isinstance(future, RayFuture)
        assert backend.gather([future]) == [pids[rank]]


def test_a_pool_the_cluster_cannot_hold_is_a_value_error_saying_what_is_missing(backend):
    with pytest.raises(ValueError, match="hf_slot"):
        backend.place([100], False, "too_big")
    with pytest.raises(ValueError, match="use_gpu=True"):
        backend.place([1], True, "no_gpu")


def test_free_port_can_be_bound_on_the_slot_hosts_address(groups, backend):
    slot = groups([1]).workers[0].slot
    port = backend.free_port(slot)
    with socket.socket() as sock:  # the slot actor runs on this machine
        sock.bind((slot.host, port))


def test_a_second_driver_process_attaches_by_address_and_its_shutdown_only_disconnects(
    groups, backend
):
    group = groups([2], name_prefix=f"shared_{os.getpid()}")
    group.count()
    address = ray.get_runtime_context().gcs_address
    script = textwrap.dedent(
        f"""
        import ray
        import hybridflow_dask as hf
        from hybridflow_dask.backends.ray import RayBackend
        from ray_workers import Echo

        backend = RayBackend(address={address!r}, log_to_driver=False)
        group = hf.WorkerGroup.from_detached(
            name_prefix={group.name_prefix!r}, cls_with_init=hf.ClassWithInitArgs(Echo),
            backend=backend,
        )
        print("COUNT", group.count())
        backend.shutdown()
        print("INITIALIZED", ray.is_initialized())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "COUNT [2, 2]" in proc.stdout, proc.stdout
    assert "INITIALIZED False" in proc.stdout
    assert group.count() == [3, 3], "the second driver's shutdown stopped the first's ranks"


@pytest.mark.cluster
def test_an_address_where_no_ray_answers_is_one_line_and_exit_2():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    address = f"127.0.0.1:{closed}"
    argv = ["demo", "--backend", "ray", "--address", address, "--steps", "1"]
    code = "import sys; from hybridflow_dask.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"no Ray cluster answers at {address}" in lines[0], lines
