"""The /hybridflow dashboard page: groups, ranks, liveness and per-method call statistics."""

from __future__ import annotations

import html
import json
import time
import urllib.request

import pytest
from stream_helpers import wait_for_streamed

import hybridflow_dask as hf
from hybridflow_dask.backends.base import InstanceRef, Slot
from hybridflow_dask.backends.dask.driver import backend as dask_backend
from hybridflow_dask.backends.dask.scheduler import dashboard as dask_dashboard
from hybridflow_dask.backends.dask.scheduler.dashboard_page import (
    CallStats,
    group_view,
    label_of,
    locate,
    percentile,
    render_html,
)
from hybridflow_dask.backends.dask.wire.call_events import calls_event
from hybridflow_dask.backends.dask.wire.keys import CALL_TOPIC, GROUP_DATASET


class Pinger(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def ping(self, x):
        return x

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def boom(self):
        raise ValueError("boom")


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return (self.rank, x)


def fetch(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers.get("Content-Type", ""), response.read().decode()


def groups_json(backend) -> dict[str, dict]:
    kind, body = fetch(backend.groups_page + "/groups.json")
    assert kind.startswith("application/json")
    return {g["name"]: g for g in json.loads(body)["groups"]}


def groups_once_counted(backend, counted) -> dict[str, dict]:
    """The page's groups once ``counted(groups)`` holds: workers report direct calls in
    batches every 250 ms, so the counts trail the calls by that much."""
    deadline = time.monotonic() + 10
    while True:
        groups = groups_json(backend)
        if counted(groups) or time.monotonic() > deadline:
            return groups
        time.sleep(0.05)


def test_page_lists_groups_ranks_and_exact_call_counts(hf_dask_backend, hf_worker_group):
    pingers = hf_worker_group(Pinger, [2], backend=hf_dask_backend)
    echoes = hf_worker_group(Echo, [2], backend=hf_dask_backend)
    for i in range(3):
        pingers.ping(i)
    echoes.echo("x")
    with pytest.raises(ValueError, match="boom"):
        pingers.boom()

    def counted(groups: dict) -> bool:
        calls = {
            name: sum(m["calls"] for m in groups[name]["methods"].values())
            for name in (pingers.name_prefix, echoes.name_prefix)
            if name in groups
        }
        # __init__ x2, ping x6, boom x2; __init__ x2, echo x2
        return calls == {pingers.name_prefix: 10, echoes.name_prefix: 4}

    groups = groups_once_counted(hf_dask_backend, counted)
    for group, cls in ((pingers, "Pinger"), (echoes, "Echo")):
        seen = groups[group.name_prefix]
        assert seen["class"] == cls
        assert seen["world_size"] == 2
        assert [r["rank"] for r in seen["ranks"]] == [0, 1]
        assert [r["address"] for r in seen["ranks"]] == [s.address for s in group._rank_slots()]
        assert all(r["alive"] for r in seen["ranks"])
        assert all(r["device"] == "cpu" for r in seen["ranks"])
        assert seen["methods"]["__init__"]["calls"] == 2

    ping = groups[pingers.name_prefix]["methods"]["ping"]
    assert (ping["calls"], ping["errors"], ping["running"]) == (6, 0, 0)
    assert isinstance(ping["p50_ms"], float) and ping["p50_ms"] >= 0
    assert ping["p90_ms"] >= ping["p50_ms"]
    assert groups[pingers.name_prefix]["methods"]["boom"]["calls"] == 2
    assert groups[pingers.name_prefix]["methods"]["boom"]["errors"] == 2
    assert groups[echoes.name_prefix]["methods"]["echo"]["calls"] == 2
    assert "ping" not in groups[echoes.name_prefix]["methods"]

    kind, page = fetch(hf_dask_backend.groups_page)
    assert kind.startswith("text/html")
    assert page.startswith("<!DOCTYPE html>") and 'http-equiv="refresh"' in page
    assert pingers.name_prefix in page and echoes.name_prefix in page


def test_a_shut_down_group_leaves_the_page(hf_dask_backend, hf_worker_group):
    group = hf_worker_group(Echo, [1], backend=hf_dask_backend)
    group.echo(1)
    assert group.name_prefix in groups_json(hf_dask_backend)
    group.shutdown()
    assert group.name_prefix not in groups_json(hf_dask_backend)


def test_page_works_on_a_cluster_attached_by_address(hf_dask_backend, hf_worker_group):
    address = hf_dask_backend.client.scheduler.address
    with dask_backend.DaskBackend(address=address) as attached:
        group = hf_worker_group(Echo, [2], backend=attached)
        group.echo("a")
        group.echo("b")
        seen = groups_once_counted(
            attached,
            lambda g: g[group.name_prefix]["methods"].get("echo", {}).get("calls") == 4,
        )[group.name_prefix]
        assert seen["methods"]["echo"]["calls"] == 4
        assert [r["address"] for r in seen["ranks"]] == [s.address for s in group._rank_slots()]
        assert group.name_prefix in fetch(attached.groups_page)[1]
        group.shutdown()


def test_routes_are_added_once_at_run_time(hf_dask_cluster):
    app = hf_dask_cluster.scheduler.http_application
    assert app.reverse_url("hybridflow-page").endswith("/hybridflow")
    assert dask_dashboard.add_routes(hf_dask_cluster.scheduler)  # a no-op the second time
    routers = [getattr(rule.target, "named_rules", {}) for rule in app.default_router.rules]
    assert sum("hybridflow-page" in named for named in routers) == 1


def test_keys_are_split_into_group_and_method():
    groups = {"actor", "critic.v2"}.__contains__
    assert label_of(f"actor.generate-{'a1' * 16}") == "actor.generate"
    assert label_of("sum-" + "0" * 32) is None  # a user's task, not a group call
    assert label_of(("x", 0)) is None
    assert locate("actor.generate", groups) == ("actor", "generate", False)
    assert locate("critic.v2.update", groups) == ("critic.v2", "update", False)
    assert locate("actor.__init__", groups) == ("actor", "__init__", False)
    assert locate("actor.__skip__", groups) == ("actor", "__skip__", True)
    assert locate("actor.generate.route", groups) == ("actor", "generate.route", True)
    assert locate("actor.assemble", groups) == ("actor", "assemble", True)
    assert locate("other.generate", groups) is None


def test_percentiles_use_a_bounded_window():
    assert percentile([], 0.5) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 11)], 0.9) == 9.0
    stats = CallStats()
    for i in range(5000):
        stats.finished("g", "m", False, {"run": i / 1000})
    summary = stats.tables("g")[0]["m"]
    assert summary["calls"] == 5000
    assert 4000 <= summary["p50_ms"] <= 5000  # only the last 1000 durations count


def test_html_escapes_names_and_marks_dead_ranks():
    evil = "<script>alert(1)</script>"
    refs = [
        InstanceRef(evil, 0, Slot(0, "tcp://a:1", "a", name="w0"), "C<b>"),
        InstanceRef(evil, 1, Slot(1, "tcp://b:1", "b", name="w1"), "C<b>"),
    ]
    stats = CallStats()
    stats.finished(evil, "m&m", False, {"run": 0.01})
    view = group_view(evil, refs, {"tcp://a:1": {"name": "w0", "pid": 7}}, stats)
    assert [r["alive"] for r in view["ranks"]] == [True, False]
    page = render_html(
        [view], scheduler="tcp://s:1", updated="now", status_url="/status", json_url="/j"
    )
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "C&lt;b&gt;" in page and "m&amp;m" in page
    assert "1 dead" in page
    assert page.count('<span class="dead">dead</span>') == 1
    assert page.count('<span class="alive">alive</span>') == 1


def test_hyphenated_group_names_keep_group_and_method_in_dask_task_prefixes(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Echo, [1], backend=hf_dask_backend, name_prefix="actor-rollout")
    group.echo(1)

    assert "actor_rollout.echo" in wait_for_streamed(hf_dask_backend.client, {"actor_rollout.echo"})
    assert groups_json(hf_dask_backend)["actor-rollout"]["methods"]["echo"]["calls"] == 1


XSS = ("<script>alert(1)</script>", '"><img src=x onerror=alert(1)>')


@pytest.mark.parametrize("payload", XSS)
def test_served_page_escapes_every_published_field(hf_dask_backend, payload):
    """Anyone who can publish a dataset names the groups and ranks the page shows."""
    client = hf_dask_backend.client
    group = f"evil{payload}"
    slot = Slot(0, f"tcp://{payload}:1", f"host{payload}", device=f"dev{payload}", name=payload)
    refs = [InstanceRef(group, payload, slot, f"Cls{payload}")]  # the rank too: any object
    client.publish_dataset(**{GROUP_DATASET + group: refs}, override=True)
    try:
        now = time.time()
        call = {"key": "k", "group": group, "method": f"m{payload}", "worker": "w"}
        client.log_event(CALL_TOPIC, calls_event([{**call, "start": now, "stop": now + 0.001}]))
        deadline = time.monotonic() + 10
        while f"m{payload}" not in groups_json(hf_dask_backend)[group]["methods"]:
            assert time.monotonic() < deadline, "the logged call never reached the page"
            time.sleep(0.05)

        kind, page = fetch(hf_dask_backend.groups_page)
        assert kind.startswith("text/html")
        for raw in XSS:
            assert raw not in page
        assert "<script" not in page and "<img" not in page
        shown = html.unescape(page)
        for field in (group, f"Cls{payload}", payload, slot.address, slot.host, slot.device):
            assert field in shown
        assert f"m{payload}" in shown
    finally:
        client.unpublish_dataset(GROUP_DATASET + group)
