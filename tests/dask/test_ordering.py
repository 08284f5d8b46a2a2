"""Per-rank call order on the Dask backend: issue order, also behind a slow input."""

from __future__ import annotations

import time

import hybridflow_dask as hf


class Recorder(hf.Worker):
    def __init__(self) -> None:
        self.log: list = []

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def record(self, item):
        self.log.append(item)
        return item

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def history(self):
        return list(self.log)

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def slow(self, seconds, value):
        time.sleep(seconds)
        return value


def test_300_nonblocking_calls_run_in_issue_order(hf_dask_backend, hf_worker_group):
    group = hf_worker_group(Recorder, [2], backend=hf_dask_backend)
    futures = [group.record(i) for i in range(300)]
    assert group.history() == [list(range(300))] * 2
    assert hf.get(futures[-1]) == [299, 299]


def test_call_waiting_for_a_slow_input_stays_ahead_of_later_calls(hf_dask_backend, hf_worker_group):
    producer = hf_worker_group(Recorder, [1], backend=hf_dask_backend)
    consumer = hf_worker_group(Recorder, [1], backend=hf_dask_backend)
    slow_value = producer.slow(1.0, "from-producer")  # a list with one backend future
    consumer.record(slow_value[0])  # must wait for the producer's result...
    consumer.record("issued-later")  # ...and this one, ready at once, must not overtake it
    assert consumer.history() == [["from-producer", "issued-later"]]


def test_failed_input_does_not_block_later_calls(hf_dask_backend, hf_worker_group):
    producer = hf_worker_group(Boom, [1], backend=hf_dask_backend)
    consumer = hf_worker_group(Recorder, [1], backend=hf_dask_backend)
    bad = producer.explode()
    never = consumer.record(bad[0])  # its input fails, so this call never runs
    consumer.record("after")
    assert consumer.history() == [["after"]]
    try:
        hf.get(never)
    except ZeroDivisionError:
        pass
    else:  # pragma: no cover - the assertion below explains
        raise AssertionError("a call whose input failed must fail too")


class Boom(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def explode(self):
        return 1 / 0


def test_a_call_that_cannot_be_sent_does_not_block_later_calls(hf_dask_backend, hf_worker_group):
    import threading

    group = hf_worker_group(Recorder, [1], backend=hf_dask_backend)
    group.record("before")
    try:
        group.record(threading.Lock())  # cannot be pickled: fails in the driver
    except Exception:
        pass
    else:  # pragma: no cover - the assertion below explains
        raise AssertionError("an unpicklable argument must fail the call")
    group.record("after")
    assert group.history() == [["before", "after"]]


def test_a_group_made_again_under_the_same_name_is_not_torn_down_by_the_old_one(
    hf_dask_backend, hf_worker_group
):
    producer = hf_worker_group(Recorder, [1], backend=hf_dask_backend)
    old = hf_worker_group(Recorder, [1], backend=hf_dask_backend, name_prefix="again")
    old.record(producer.slow(1.0, "late")[0])  # keeps the old instance busy past shutdown
    old.shutdown()
    new = hf_worker_group(Recorder, [1], backend=hf_dask_backend, name_prefix="again")
    new.record("fresh")
    time.sleep(1.5)  # the old group's teardown runs now, after the new instance exists
    assert new.history() == [["fresh"]]
