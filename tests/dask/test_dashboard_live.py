"""The /hybridflow page during a run: calls in flight, stragglers, the time split, errors
with tracebacks, worker deaths, lost calls and recoveries, pids, logs and the link from
Dask's own pages. Every test drives real workers and reads the served page and JSON."""

from __future__ import annotations

import html
import json
import os
import signal
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from call_paths import PATHS, backend_on

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, WorkerLostError

#: The page refreshes every 2 s: what it shows must be there within that.
REFRESH_S = 2.0


class Napper(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self):
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds_by_rank):
        time.sleep(seconds_by_rank[self.rank])
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def quick(self):
        return self.rank

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def fail(self, step):
        raise ValueError(f"bad batch at step {step}")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def chat(self, text):
        print(f"{text} from rank {self.rank}")
        return self.rank


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def page_json(backend) -> dict[str, Any]:
    return json.loads(fetch(backend.groups_page + "/groups.json"))


def wait_for(backend, seen: Callable[[dict], Any], within: float) -> tuple[Any, float]:
    """The first truthy ``seen(json)`` and the seconds it took; fails after ``within``."""
    start = time.monotonic()
    while True:
        found = seen(page_json(backend))
        if found:
            return found, time.monotonic() - start
        assert time.monotonic() - start < within, f"not on the page within {within} s"
        time.sleep(0.1)


def group_of(body: dict, name: str) -> dict | None:
    return next((g for g in body["groups"] if g["name"] == name), None)


def test_a_sleeping_rank_shows_as_running_and_is_flagged_a_straggler(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Napper, [2], backend=hf_dask_backend)
    name = group.name_prefix
    hf.get(group.nap([0.0, 0.0]))  # a typical nap: both ranks at once
    # Rank 0 naps a little, so that it surely finishes after rank 1's call reached its
    # worker (a peer that finished before the straggler's call even arrived does not
    # count): with 0 s, a busy machine could deliver rank 1's part later than that.
    pending = group.nap([0.3, 4.0])

    def rank1_running(body: dict) -> dict | None:
        g = group_of(body, name)
        rows = [] if g is None else g["ranks"][1]["pending"]
        return next((c for c in rows if c["method"] == "nap" and c["state"] == "running"), None)

    call, waited = wait_for(hf_dask_backend, rank1_running, within=REFRESH_S)
    assert waited <= REFRESH_S and call["seconds"] >= 0.5
    later, _ = wait_for(
        hf_dask_backend, lambda b: (c := rank1_running(b)) and c["straggler"] and c, within=3.0
    )
    assert later["seconds"] > call["seconds"]  # its time so far keeps growing
    body = page_json(hf_dask_backend)
    g = group_of(body, name)
    assert g["ranks"][0]["pending"] == []  # rank 0 finished long ago
    assert g["methods"]["nap"]["running"] == 1
    shown = html.unescape(fetch(hf_dask_backend.groups_page))
    assert "straggler" in shown and "1 straggling" in shown

    assert hf.get(pending) == [0, 1]
    done, _ = wait_for(
        hf_dask_backend,
        lambda b: (x := group_of(b, name)) and x["methods"]["nap"]["calls"] == 4 and x,
        within=REFRESH_S,
    )
    assert done["pending"] == [] and done["methods"]["nap"]["running"] == 0


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_call_path_reports_calls_in_flight_counts_and_errors(
    path, hf_dask_cluster, hf_worker_group
):
    with backend_on(path, hf_dask_cluster) as backend:
        group = hf_worker_group(Napper, [2], backend=backend)
        name = group.name_prefix
        pending = group.nap([0.0, 1.5])
        wait_for(
            backend,
            lambda b: (
                (g := group_of(b, name))
                and [c for c in g["ranks"][1]["pending"] if c["state"] == "running"]
            ),
            within=REFRESH_S,
        )
        assert hf.get(pending) == [0, 1]
        with pytest.raises(ValueError):
            group.fail(3)
        methods, _ = wait_for(
            backend,
            lambda b: (
                (g := group_of(b, name))
                and g["methods"].get("fail", {}).get("errors") == 2
                and g["methods"]
            ),
            within=REFRESH_S,
        )
        assert [methods[m]["calls"] for m in ("__init__", "nap", "fail")] == [2, 2, 2]
        assert methods["nap"]["p90_ms"] >= 1500  # rank 1's nap, run time alone
        assert methods["nap"]["running"] == 0


def test_time_waiting_behind_earlier_calls_is_queue_time_not_run_time(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Napper, [1], backend=hf_dask_backend)
    first = group.nap([1.0])
    second = group.quick()  # waits its turn behind the nap on the same instance
    hf.get([first, second])
    quick, _ = wait_for(
        hf_dask_backend,
        lambda b: (
            (g := group_of(b, group.name_prefix))
            and g["methods"].get("quick", {}).get("calls") == 1
            and g["methods"]["quick"]
        ),
        within=REFRESH_S,
    )
    assert quick["split_p50_ms"]["queue"] >= 500  # it waited most of the nap
    assert quick["p50_ms"] < 200  # while running took next to nothing
    assert set(quick["split_p50_ms"]) == {"inputs", "queue", "run", "reply"}


def test_a_failing_methods_latest_error_is_on_the_page_and_in_its_json(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Napper, [2], backend=hf_dask_backend)
    for step in (5, 10):
        with pytest.raises(ValueError, match=f"step {step}"):
            group.fail(step)

    def errors_counted(body: dict) -> dict | None:
        g = group_of(body, group.name_prefix)
        fail = None if g is None else g["methods"].get("fail")
        return fail if fail and fail["errors"] == 4 else None

    fail, _ = wait_for(hf_dask_backend, errors_counted, within=REFRESH_S)
    assert fail["last_error"]["type"] == "ValueError"
    assert "bad batch at step 10" in fail["last_error"]["message"]
    events = [
        e
        for e in page_json(hf_dask_backend)["events"]
        if e["kind"] == "error" and e.get("group") == group.name_prefix
    ]
    assert len(events) == 4 and {e["rank"] for e in events} == {0, 1}
    newest = events[0]  # newest first
    assert newest["method"] == "fail" and "step 10" in newest["message"]
    assert 'raise ValueError(f"bad batch at step {step}")' in newest["traceback"]
    shown = html.unescape(fetch(hf_dask_backend.groups_page))
    assert "bad batch at step 10" in shown and "traceback" in shown


def test_ranks_show_their_pid_and_link_to_their_workers_pages_and_logs(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Napper, [2], backend=hf_dask_backend)
    pids = group.pid()
    assert group.chat("hello") == [0, 1]
    body = page_json(hf_dask_backend)
    ranks = group_of(body, group.name_prefix)["ranks"]
    assert [r["pid"] for r in ranks] == pids

    page = fetch(hf_dask_backend.groups_page)
    base = hf_dask_backend.groups_page[: -len("hybridflow")]
    for rank in ranks:
        quoted = urllib.parse.quote(rank["address"], safe="")
        assert f'href="/info/worker/{quoted}.html"' in page
        assert f'href="/info/logs/{quoted}.html"' in page
        # The rank's print is on its worker's Dask log page, under the rank's name.
        logs = html.unescape(fetch(f"{base}info/logs/{quoted}.html"))
        label = f"hybridflow.{group.name_prefix}[{rank['rank']}]"
        assert f"{label} - INFO - hello from rank {rank['rank']}" in logs


@pytest.fixture(scope="module")
def own_backend():
    """Its own cluster: this module kills a worker, which the shared one must not lose."""
    backend = DaskBackend(n_workers=2)
    yield backend
    backend.shutdown()


@pytest.mark.cluster
def test_a_killed_workers_lost_calls_and_the_recovery_are_events(own_backend, hf_worker_group):
    group = hf_worker_group(Napper, [2], backend=own_backend, name_prefix="victim")
    pids = group.pid()
    pending = group.nap([0.0, 30.0])
    wait_for(
        own_backend,
        lambda b: (g := group_of(b, "victim")) and g["ranks"][1]["pending"],
        within=REFRESH_S,
    )
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        hf.get(pending)
    assert group.recover() == [1]

    def kinds(body: dict) -> dict[str, dict] | None:
        found = {e["kind"]: e for e in body["events"] if e.get("group") == "victim"}
        return found if {"worker-lost", "lost", "recovered"} <= set(found) else None

    events, _ = wait_for(own_backend, kinds, within=10)
    assert events["worker-lost"]["rank"] == 1
    assert "nap (running)" in events["worker-lost"]["message"]
    assert (events["lost"]["rank"], events["lost"]["method"]) == (1, "nap")
    assert "WorkerLostError" in events["lost"]["message"]
    nap = group_of(page_json(own_backend), "victim")["methods"]["nap"]
    assert (nap["calls"], nap["errors"]) == (2, 1)  # rank 0's nap, and rank 1's lost one
    assert nap["last_error"]["type"] == "WorkerLostError"
    assert events["recovered"]["rank"] == 1
    assert events["recovered"]["worker"] == group._rank_slots()[1].address
    shown = html.unescape(fetch(own_backend.groups_page))
    assert "worker-lost" in shown and "recovered" in shown
