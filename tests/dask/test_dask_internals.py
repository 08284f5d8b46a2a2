"""Canaries for the private Dask APIs the backend relies on (one module: dask_internals)."""

from __future__ import annotations

import asyncio
import time

import dask
import torch
from distributed import Client, get_client
from distributed.protocol import dumps, loads, to_serialize
from distributed.protocol.serialize import Serialized

from hybridflow_dask.backends.dask.internals import adopt_future, load_serialized, workers_of
from hybridflow_dask.backends.dask.wire.messages import pack


class Box:
    """Hides a future from Dask's argument traversal, as a DataProtoFuture does."""

    def __init__(self, future):
        self.future = future


def _inc(x):
    return x + 1


def _read_boxed(box):
    client = get_client()
    return client.gather([adopt_future(client, box.future.key)], direct=True)[0]


def test_a_worker_can_adopt_a_future_that_travelled_inside_an_argument(hf_dask_backend):
    client = hf_dask_backend.client
    workers = sorted(workers_of(client))
    made = client.submit(_inc, 1, workers=workers[:1], pure=False)
    made.result()
    read = client.submit(_read_boxed, Box(made), workers=workers[1:2], pure=False)
    assert read.result(timeout=30) == 2


def test_the_workers_asked_for_are_all_there_while_the_clients_own_refresh_runs(
    hf_dask_backend,
):
    address = hf_dask_backend.client.scheduler.address
    expected = set(workers_of(hf_dask_backend.client))
    refresh = {"distributed.client.scheduler-info-interval": "5ms"}
    with dask.config.set(refresh), Client(address, set_as_default=False) as client:
        answers = [set(workers_of(client)) for _ in range(300)]
    assert expected and all(answer == expected for answer in answers)


# ---- what the direct call path relies on --------------------------------------------------


def _answer(**kwargs):
    return {"status": "OK", "echo": kwargs}


def _install_handler(dask_worker):
    from hybridflow_dask.backends.dask.internals import add_handlers

    add_handlers(dask_worker, {"hf_canary": _answer})


def test_a_worker_answers_a_handler_added_to_its_table(hf_dask_backend):
    client = hf_dask_backend.client
    address = sorted(workers_of(client))[0]
    client.run(_install_handler, workers=[address])

    async def ask():
        return await client.rpc(address).hf_canary(x=1)

    assert client.sync(ask) == {"status": "OK", "echo": {"x": 1}}


def _worker_seen_from_a_thread_of_our_own(dask_worker):
    import threading

    from distributed import get_worker

    from hybridflow_dask.backends.dask.internals import enter_worker

    seen = {}

    def run():
        try:
            get_worker()
        except ValueError:
            seen["before"] = None
        enter_worker(dask_worker)
        seen["after"] = get_worker().address

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(5)
    return seen


def test_a_thread_of_our_own_can_enter_the_worker_for_dasks_worker_api(hf_dask_backend):
    client = hf_dask_backend.client
    address = sorted(workers_of(client))[0]
    seen = client.run(_worker_seen_from_a_thread_of_our_own, workers=[address])[address]
    assert seen == {"before": None, "after": address}


async def _keep(key, client_id, dask_worker=None):
    """Runs on the worker's event loop (``client.run`` awaits coroutine functions there)."""
    from hybridflow_dask.backends.dask.internals import register_keys

    dask_worker.update_data(data={key: 41})
    await register_keys(dask_worker, {key: 28}, client_id)


def test_a_key_stored_on_a_worker_and_registered_is_an_ordinary_future(hf_dask_backend):
    from distributed import wait

    from hybridflow_dask.backends.dask.internals import (
        finish_future,
        pending_future,
        submit_as,
    )

    client = hf_dask_backend.client
    workers = sorted(workers_of(client))
    key = "canary.kept-0123456789abcdef0123456789abcdef"
    future = pending_future(client, key)
    assert future.status == "pending"  # nothing computes it: we set its outcome
    client.run(_keep, key, client.id, workers=workers[:1])
    client.loop.add_callback(finish_future, future)
    with client.as_current():
        wait([future], timeout=10)
    assert future.status == "finished"
    assert client.who_has([future])[key] == (workers[0],)
    assert client.gather(future, direct=True) == 41
    # a task on another worker takes it as an input (moved worker to worker)
    assert client.submit(_inc, future, workers=workers[1:2], pure=False).result() == 42
    # a task submitted later under a key handed out earlier fulfils that future
    later = pending_future(client, "canary.later-0123456789abcdef0123456789abcdef")

    async def submit_later():
        submit_as(client, later, _inc, 1, pure=False)

    client.sync(submit_later)
    assert later.result(timeout=10) == 2
    del future  # released: the key leaves the workers' memory
    deadline = time.monotonic() + 10
    while key in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks)):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _slow(x, seconds):
    time.sleep(seconds)
    return x


def test_waiting_for_futures_in_order_returns_when_all_are_done_or_at_the_timeout(
    hf_dask_backend,
):
    """``wait_all`` reads each future's state and waits on its event (the client's
    ``FutureState``), one future after another."""
    from hybridflow_dask.backends.dask.internals import wait_all

    client = hf_dask_backend.client
    quick = [client.submit(_slow, i, 0, pure=False) for i in range(5)]
    slow = client.submit(_slow, 9, 3.0, pure=False)
    start = time.monotonic()
    client.sync(wait_all, [*quick, slow], 0.5)  # times out on the slow one
    assert 0.4 < time.monotonic() - start < 2.5
    assert all(f.done() for f in quick) and not slow.done()
    client.sync(wait_all, [*quick, slow], 30)
    assert slow.done() and slow.result() == 9
    start = time.monotonic()
    client.sync(wait_all, [*quick, slow], 30)  # all done already: no wait at all
    assert time.monotonic() - start < 0.5


def test_an_owned_cluster_class_overrides_methods_dask_still_has():
    """The overrides must replace methods of these names and arguments, or they do nothing."""
    import inspect

    from distributed import LocalCluster
    from distributed.deploy.spec import SpecCluster

    from hybridflow_dask.backends.dask.internals import owned_cluster_class

    status = inspect.signature(SpecCluster._update_worker_status)
    assert list(status.parameters) == ["self", "op", "msg"]
    # What the override skips: SpecCluster's cull of nannies whose worker stayed away.
    assert "lost-worker-timeout" in inspect.getsource(SpecCluster._update_worker_status)
    assert list(inspect.signature(LocalCluster._new_worker_name).parameters) == [
        "self",
        "worker_number",
    ]
    owned = owned_cluster_class(LocalCluster, "slot-")
    assert issubclass(owned, LocalCluster)
    assert owned._new_worker_name(None, 3) == "slot-3"
    assert "_new_worker_name" not in vars(owned_cluster_class(LocalCluster))


def _scheduler_side(dask_scheduler):
    """Runs on the scheduler: each scheduler-side helper, for real."""
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    from hybridflow_dask.backends.dask.internals import (
        keep_task_stream,
        published_datasets,
        record_finished_task,
    )

    keep_task_stream(dask_scheduler)
    key = "canary.call-" + "0" * 32
    record_finished_task(
        dask_scheduler,
        key,
        ok=True,
        worker="tcp://w:1",
        thread="lane",
        spans=[("transfer", 1.0, 1.5), ("compute", 1.5, 2.0)],
        nbytes=8,
    )
    stream = dask_scheduler.plugins[TaskStreamPlugin.name]
    (record,) = [r for r in stream.buffer if r["key"] == key]
    return {
        "published": sorted(k for k in published_datasets(dask_scheduler) if k.startswith("can")),
        "startstops": [s["action"] for s in record["startstops"]],
        "worker": record["worker"],
        "fields": sorted(record),
    }


def test_the_scheduler_side_helpers_read_datasets_and_draw_in_the_task_stream(hf_dask_backend):
    client = hf_dask_backend.client
    client.publish_dataset(canary=[1, 2], override=True)
    try:
        seen = client.run_on_scheduler(_scheduler_side)
    finally:
        client.unpublish_dataset("canary")
    assert seen == {
        "published": ["canary"],
        "startstops": ["transfer", "compute"],
        "worker": "tcp://w:1",
        "fields": ["key", "nbytes", "startstops", "status", "thread", "worker"],
    }


def _stream_length(dask_scheduler):
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    return dask_scheduler.plugins[TaskStreamPlugin.name].buffer.maxlen


def test_the_task_stream_the_monitor_starts_keeps_hybridflows_bound(hf_dask_backend):
    """Every direct call adds a record: the stream keeps ``hybridflow.task-stream-length``
    of them (the shipped default), not Dask's 100,000."""
    assert dask.config.get("hybridflow.task-stream-length") == 10_000
    assert hf_dask_backend.client.run_on_scheduler(_stream_length) == 10_000


def test_a_page_added_to_the_dashboards_navigation_shows_on_dasks_pages(hf_dask_backend):
    import urllib.request

    with urllib.request.urlopen(hf_dask_backend.dashboard_link, timeout=10) as response:
        status = response.read().decode()
    assert '<a href="hybridflow">Hybridflow</a>' in status  # added by the group monitor


def _unknown_key_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if "but key is unknown" in str(w.message)]


def test_reading_a_published_value_does_not_make_the_scheduler_warn_of_pending_keys(
    hf_dask_backend,
):
    """``lookup`` reads the group registry on every new group; ``Client.get_dataset`` would
    re-announce every key the driver holds, and the (in-process) scheduler warned for each
    key it did not know yet: a result still on its way, or one whose call failed."""
    import warnings

    from hybridflow_dask.backends.dask.internals import pending_future, published_value

    client = hf_dask_backend.client
    client.publish_dataset(canary_published=["a", "b"], override=True)
    pending = pending_future(client, "canary-not-known-to-the-scheduler")
    try:
        assert published_value(client, "canary_published", None) == ["a", "b"]
        assert published_value(client, "canary_never_published", []) == []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client.get_dataset("canary_published")  # Dask's way: the warning, as control
            deadline = time.monotonic() + 5
            while not _unknown_key_warnings(caught) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _unknown_key_warnings(caught), "get_dataset no longer re-announces keys"
            caught.clear()
            published_value(client, "canary_published", None)
            time.sleep(1.0)  # as long as the control's warning took, several times over
            assert _unknown_key_warnings(caught) == []
    finally:
        client.unpublish_dataset("canary_published")
        del pending


def test_a_worker_says_its_own_id_through_the_clients_connection_pool(hf_dask_backend):
    import asyncio

    from hybridflow_dask.backends.dask.internals import worker_id_of

    client = hf_dask_backend.client
    ids = client.run(lambda dask_worker: dask_worker.id)
    address = sorted(ids)[0]
    asked = asyncio.run_coroutine_threadsafe(
        worker_id_of(client, address, 5.0), client.loop.asyncio_loop
    ).result(10)
    assert asked == ids[address]
    nowhere = asyncio.run_coroutine_threadsafe(
        worker_id_of(client, "tcp://127.0.0.1:9", 1.0), client.loop.asyncio_loop
    ).result(10)
    assert nowhere is None


async def _fetch(key, answer, dask_worker=None):
    from hybridflow_dask.backends.dask.internals import fetch_keys

    asked = []

    async def borrow(holder, keys):
        asked.append((holder, list(keys)))
        return None if answer is None else {k: answer for k in keys}

    return await fetch_keys(dask_worker, [key], borrow), asked


def test_fetching_a_key_held_elsewhere_asks_the_borrower_first_then_dask(hf_dask_backend):
    from distributed import wait

    from hybridflow_dask.backends.dask.internals import finish_future, pending_future

    client = hf_dask_backend.client
    workers = sorted(workers_of(client))
    key = "canary.fetched-0123456789abcdef0123456789abcdef"
    future = pending_future(client, key)
    client.run(_keep, key, client.id, workers=workers[:1])
    client.loop.add_callback(finish_future, future)
    with client.as_current():
        wait([future], timeout=10)
    for answer, expected in ((None, 41), (7, 7)):  # declined: through Dask; else its answer
        got = client.run(_fetch, key, answer, workers=workers[1:2])[workers[1]]
        assert got == ({key: expected}, [(workers[0], [key])])
    del future


def test_released_futures_are_forgotten_in_one_batch_and_kept_keys_by_the_scheduler_too(
    hf_dask_backend,
):
    from distributed import Future

    from hybridflow_dask.backends.dask.internals import Releases

    client = hf_dask_backend.client
    workers = sorted(workers_of(client))
    kept = "canary.released-kept-0123456789abcdef0123456789ab"
    local = "canary.released-local-0123456789abcdef0123456789a"
    client.run(_keep, kept, client.id, workers=workers[:1])
    releases = Releases(client)
    futures = {key: Future(key, client) for key in (kept, local)}

    def scheduler_knows(dask_scheduler, key=kept):
        return key in dask_scheduler.tasks

    assert client.run_on_scheduler(scheduler_knows)
    releases.release(futures[kept], local=False)
    releases.release(futures[local], local=True)
    releases.release(futures[local], local=True)  # once only, as Future.release
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        client.run_on_scheduler(scheduler_knows) or set(client.refcount) & set(futures)
    ):
        time.sleep(0.02)
    assert not set(client.refcount) & set(futures), "the client still counts references"
    assert not set(client.futures) & set(futures), "the client still holds their states"
    assert not client.run_on_scheduler(scheduler_knows), "the scheduler kept the released key"
    assert futures[kept].status == "cancelled"  # Dask's own release marks it so too


def test_a_message_read_with_its_values_serialized_loads_as_the_comm_would_have():
    """``read_serialized`` leaves a comm's values as ``Serialized``; ``load_serialized``
    decodes them as the comm would have: what the driver packs, and Dask's own split
    frames (a small shard here), off the loop past the offload threshold."""
    small, large = torch.arange(5000), torch.ones(3 << 20)  # 12 MiB: offloaded
    msg = {
        "op": "hf_calls",
        "args": pack((small,), "args"),
        "calls": ({"kwargs": pack({"x": "y"}, "kwargs")}, ("instance", 1, 0)),
        "split": to_serialize(large),
        "plain": (1, "two", None),
    }
    with dask.config.set({"distributed.comm.shard": "64 KiB"}):
        frames = dumps(msg)
    raw = loads(frames, deserialize=False)
    assert type(raw["args"]) is Serialized and type(raw["calls"][0]["kwargs"]) is Serialized
    got = asyncio.run(load_serialized(raw))
    assert torch.equal(got["args"][0], small) and torch.equal(got["split"], large)
    assert got["calls"] == ({"kwargs": {"x": "y"}}, ("instance", 1, 0))
    assert got["plain"] == (1, "two", None)
