"""Canaries for the private Dask APIs the backend relies on (one module: dask_internals)."""

from __future__ import annotations

import time

from distributed import get_client

from hybridflow_dask.backends.dask.internals import adopt_future


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
    workers = sorted(client.scheduler_info()["workers"])
    made = client.submit(_inc, 1, workers=workers[:1], pure=False)
    made.result()
    read = client.submit(_read_boxed, Box(made), workers=workers[1:2], pure=False)
    assert read.result(timeout=30) == 2


# ---- what the direct call path relies on --------------------------------------------------


def _answer(**kwargs):
    return {"status": "OK", "echo": kwargs}


def _install_handler(dask_worker):
    from hybridflow_dask.backends.dask.internals import add_handlers

    add_handlers(dask_worker, {"hf_canary": _answer})


def test_a_worker_answers_a_handler_added_to_its_table(hf_dask_backend):
    client = hf_dask_backend.client
    address = sorted(client.scheduler_info()["workers"])[0]
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
    address = sorted(client.scheduler_info()["workers"])[0]
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
    workers = sorted(client.scheduler_info()["workers"])
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
