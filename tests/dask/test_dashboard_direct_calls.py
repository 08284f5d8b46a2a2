"""Direct calls (no Dask task) on the dashboard: the ``hybridflow-call`` events a worker logs
are counted on ``/hybridflow`` like task calls and drawn in Dask's task stream.

The events are logged from real worker processes of a real ``LocalCluster`` with
``Worker.log_event``, exactly as the direct call path does after each call.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from dask.utils import key_split
from distributed import Client
from distributed.diagnostics.task_stream import rectangles

from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.dask.internals import workers_of
from hybridflow_dask.backends.dask.scheduler.dashboard import register_group_monitor
from hybridflow_dask.backends.dask.wire.call_events import calls_event
from hybridflow_dask.backends.dask.wire.keys import CALL_TOPIC, GROUP_DATASET

WAIT_S = 15


def emit(events: list[dict[str, Any]], dask_worker: Any) -> int:
    """Runs on a worker: log the calls in one event, as the direct call path does."""
    calls = [{**event, "worker": dask_worker.address} for event in events]
    dask_worker.log_event(CALL_TOPIC, calls_event(calls))
    return len(events)


def emit_raw(events: list[dict[str, Any]], dask_worker: Any) -> None:
    """Runs on a worker: log events as they are, whatever they hold."""
    for event in events:
        dask_worker.log_event(CALL_TOPIC, event)


@pytest.fixture
def client(hf_dask_cluster: Any) -> Iterator[Client]:
    with Client(hf_dask_cluster, set_as_default=False) as c:
        register_group_monitor(c)
        yield c


@pytest.fixture
def group(client: Client) -> Iterator[tuple[str, list[str]]]:
    """A published two-rank group on two real workers, as the backend publishes one."""
    name = f"direct-{uuid.uuid4().hex[:6]}"
    workers = sorted(workers_of(client))[:2]
    refs = [
        InstanceRef(name, rank, Slot(rank, address, "127.0.0.1"), "Actor")
        for rank, address in enumerate(workers)
    ]
    client.publish_dataset(**{GROUP_DATASET + name: refs})
    yield name, workers
    client.unpublish_dataset(GROUP_DATASET + name)


def call(group: str, method: str, rank: int, start: float, seconds: float, ok: bool = True):
    return {
        "key": f"{group.replace('-', '_')}.{method}-{uuid.uuid4().hex}",
        "group": group,
        "method": method,
        "rank": rank,
        "start": start,
        "stop": start + seconds,
        "status": "OK" if ok else "error",
        "nbytes": 64,
    }


def groups_json(cluster: Any) -> dict[str, dict]:
    url = cluster.dashboard_link.replace("/status", "/hybridflow/groups.json")
    with urllib.request.urlopen(url, timeout=10) as response:
        return {g["name"]: g for g in json.loads(response.read())["groups"]}


def wait_for_calls(cluster: Any, group: str, method: str, calls: int) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        seen = groups_json(cluster)[group]["methods"].get(method, {})
        if seen.get("calls", 0) >= calls or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def stream_records(client: Client, keys: set[str]) -> list[dict]:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [r for r in client.get_task_stream() if r["key"] in keys]
        if len(found) >= len(keys) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_direct_calls_are_counted_like_task_calls(hf_dask_cluster, client, group):
    name, workers = group
    t0 = time.time()
    rank0 = [call(name, "generate", 0, t0 + i, s) for i, s in enumerate((0.010, 0.020, 0.030))]
    rank1 = [call(name, "generate", 1, t0, 0.040, ok=False), call(name, "score", 1, t0, 0.005)]
    assert client.run(emit, rank0, workers=[workers[0]]) == {workers[0]: 3}
    assert client.run(emit, rank1, workers=[workers[1]]) == {workers[1]: 2}

    generate = wait_for_calls(hf_dask_cluster, name, "generate", 4)
    assert (generate["calls"], generate["errors"], generate["running"]) == (4, 1, 0)
    assert generate["p50_ms"] == pytest.approx(20.0, abs=1e-3)
    assert generate["p90_ms"] == pytest.approx(40.0, abs=1e-3)
    score = wait_for_calls(hf_dask_cluster, name, "score", 1)
    assert (score["calls"], score["errors"]) == (1, 0)
    assert score["p50_ms"] == pytest.approx(5.0, abs=1e-3)


def test_direct_calls_appear_in_the_task_stream_as_group_method(client, group):
    name, workers = group
    t0 = time.time()
    ok, failed = call(name, "generate", 0, t0, 0.25), call(name, "generate", 1, t0, 0.1, ok=False)
    client.run(emit, [ok], workers=[workers[0]])
    client.run(emit, [failed], workers=[workers[1]])

    records = {r["key"]: r for r in stream_records(client, {ok["key"], failed["key"]})}
    assert set(records) == {ok["key"], failed["key"]}
    label = f"{name.replace('-', '_')}.generate"
    for event, worker, status in ((ok, workers[0], "OK"), (failed, workers[1], "error")):
        record = records[event["key"]]
        assert key_split(record["key"]) == label
        assert record["worker"] == worker
        assert record["status"] == status
        (span,) = record["startstops"]
        assert span == {"action": "compute", "start": event["start"], "stop": event["stop"]}

    # What the dashboard's task-stream plot draws from those records.
    drawn = rectangles(list(records.values()))
    assert drawn["name"] == [label, label]
    assert sorted(drawn["worker"]) == sorted(workers)
    assert sorted(drawn["duration"]) == pytest.approx([100.0, 250.0])
    colors = dict(zip(drawn["key"], drawn["color"]))
    assert colors[failed["key"]] == "black"  # as Dask draws a failed task
    assert colors[ok["key"]] != "black"


def test_role_view_calls_share_the_fused_spelling(hf_dask_cluster, client, group):
    name, workers = group
    t0 = time.time()
    events = [call(name, "actor.scale", 0, t0, 0.01), call(name, "actor_scale", 0, t0, 0.01)]
    client.run(emit, events, workers=[workers[0]])

    seen = wait_for_calls(hf_dask_cluster, name, "actor_scale", 2)
    assert seen["calls"] == 2
    assert "actor.scale" not in groups_json(hf_dask_cluster)[name]["methods"]


def test_events_of_unknown_groups_and_malformed_events_are_ignored(hf_dask_cluster, client, group):
    name, workers = group
    t0 = time.time()
    stranger = call("not-published", "generate", 0, t0, 0.01)
    broken = {"group": name, "method": "generate"}  # no key, no times
    marker = call(name, "marker", 0, t0, 0.01)  # logged last: once seen, the others were too
    garbage = [{"rows": b"\xc1 not msgpack"}, {"rows": msgpack.packb([[name]])}, {"rows": 3}]
    client.run(emit_raw, garbage, workers=[workers[0]])
    client.run(emit, [stranger, broken, marker], workers=[workers[0]])

    assert wait_for_calls(hf_dask_cluster, name, "marker", 1)["calls"] == 1
    groups = groups_json(hf_dask_cluster)
    assert "not-published" not in groups
    assert "generate" not in groups[name]["methods"]
    assert not [r for r in client.get_task_stream() if r["key"] == stranger["key"]]


def test_the_stream_draws_only_the_run_as_compute_and_inputs_and_reply_as_transfers(
    hf_dask_cluster, client, group
):
    name, workers = group
    t0 = time.time()
    phased = {
        **call(name, "train", 0, t0 + 0.3, 0.5),  # runs 0.3 s .. 0.8 s
        "received": t0,
        "inputs": t0 + 0.1,  # fetched inputs for 0.1 s, then queued for 0.2 s
        "replied": t0 + 0.9,  # replied for 0.1 s
    }
    client.run(emit, [phased], workers=[workers[0]])

    (record,) = stream_records(client, {phased["key"]})
    assert [s["action"] for s in record["startstops"]] == ["transfer", "compute", "transfer"]
    drawn = rectangles([record])
    label = f"{name.replace('-', '_')}.train"
    assert drawn["name"] == [f"transfer-{label}", label, f"transfer-{label}"]
    assert drawn["duration"] == pytest.approx([100.0, 500.0, 100.0], abs=1e-2)
    assert drawn["color"][0] == drawn["color"][2] == "red"  # Dask's colour for transfers

    train = wait_for_calls(hf_dask_cluster, name, "train", 1)
    assert train["p50_ms"] == pytest.approx(500.0, abs=1e-3)  # the run alone
    split = train["split_p50_ms"]
    assert split["inputs"] == pytest.approx(100.0, abs=1e-3)
    assert split["queue"] == pytest.approx(200.0, abs=1e-3)
    assert split["reply"] == pytest.approx(100.0, abs=1e-3)


def test_a_flood_of_calls_is_all_counted_but_drawn_only_up_to_the_streams_budget(
    hf_dask_cluster, client, group
):
    from hybridflow_dask.backends.dask.scheduler.dashboard import STREAM_BARS_PER_S

    name, workers = group
    t0 = time.time()
    flood = [call(name, "flood", 0, t0 + i * 1e-4, 5e-5) for i in range(3 * STREAM_BARS_PER_S)]
    client.run(emit, flood, workers=[workers[0]])
    assert wait_for_calls(hf_dask_cluster, name, "flood", len(flood))["calls"] == len(flood)
    keys = {c["key"] for c in flood}
    drawn = [r for r in client.get_task_stream() if r["key"] in keys]
    assert 0 < len(drawn) <= STREAM_BARS_PER_S + 1  # the rest were counted, not drawn
