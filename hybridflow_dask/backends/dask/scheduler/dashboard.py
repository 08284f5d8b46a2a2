"""The worker-group page on the Dask dashboard: a scheduler plugin that serves it.

``GroupMonitor`` is registered through ``client.register_plugin`` (no preload, no config),
so it works on a cluster the backend starts and on one it attaches to by address. When it
starts on the scheduler it adds two routes to the dashboard's running web server
(tornado's ``Application.add_handlers``):

- ``/hybridflow``: an HTML table per worker group, refreshing every 2 s;
- ``/hybridflow/groups.json``: the same data as JSON.

Groups are the ``hybridflow-group-*`` datasets the backend publishes; a rank is alive while
its worker address is still in ``scheduler.workers``. Call counts and latencies come from
two sources, counted alike:

- calls sent as tasks: the scheduler's transitions of keys ``"{group}.{method}-<uuid hex>"``;
- calls sent straight to a worker (no task): the ``hybridflow-call`` event the worker logs
  when a call finishes (``Worker.log_event``), which reaches ``SchedulerPlugin.log_event``.
  Each such call is also handed to Dask's ``TaskStreamPlugin`` as the record of a finished
  task, through its ``transition`` hook, so the dashboard's task stream shows direct calls
  as ``group.method`` bars next to ordinary tasks.

The scheduler needs ``hybridflow_dask`` importable to load the plugin.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from distributed import Client, SchedulerPlugin
from distributed.diagnostics.task_stream import TaskStreamPlugin
from distributed.protocol import deserialize
from tornado import web

from ...base import InstanceRef
from ..wire.keys import CALL_TOPIC, GROUP_DATASET
from .dashboard_page import (
    CallStats,
    group_view,
    is_internal,
    label_of,
    locate,
    method_name,
    render_html,
)

__all__ = [
    "PLUGIN_NAME",
    "GroupMonitor",
    "register_group_monitor",
]

logger = logging.getLogger(__name__)

PLUGIN_NAME = "hybridflow-groups"
PAGE_ROUTE, JSON_ROUTE = "hybridflow", "hybridflow/groups.json"
#: The task stream's lane (its "thread") for direct calls on each worker.
DIRECT_LANE = "hybridflow-direct"


class GroupMonitor(SchedulerPlugin):
    """Counts backend calls per (group, method) and serves the page that lists groups.

    Everything runs on the scheduler's event loop (transitions and HTTP handlers alike),
    so no locking is needed.
    """

    idempotent = True  # a second backend on the same cluster keeps the first one's counts

    def __init__(self) -> None:
        self.stats = CallStats()
        self.scheduler: Any = None
        self._decoded: dict[str, tuple[Any, list[InstanceRef]]] = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        add_routes(scheduler)
        # The dashboard adds this plugin when its task stream is first drawn; adding it now
        # (as the dashboard does) also keeps the direct calls made before that.
        if TaskStreamPlugin.name not in scheduler.plugins:
            scheduler.add_plugin(TaskStreamPlugin(scheduler))

    # -- what the scheduler tells us ------------------------------------------------------

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if start != "processing" and finish not in ("processing", "erred"):
            return
        if start == "erred" or self.scheduler is None:
            return
        where = self._locate(key)
        if where is None:
            return
        stats = self.stats.get(*where)
        if finish == "processing":
            stats.running += 1
            return
        if start == "processing":
            stats.running = max(0, stats.running - 1)
        if finish in ("memory", "erred"):
            duration = _compute_time(kwargs.get("startstops"))
            self.stats.finished(*where, duration, finish == "erred")

    def update_graph(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        self.stats.forget(self._published)

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != CALL_TOPIC or self.scheduler is None:
            return
        calls = msg.get("calls") if isinstance(msg, dict) else None
        if not isinstance(calls, (list, tuple)):
            logger.debug("ignoring a malformed %s event: %r", CALL_TOPIC, msg)
            return
        for entry in calls:
            call = _direct_call(entry)
            if call is None:
                logger.debug("ignoring a malformed call in a %s event: %r", CALL_TOPIC, entry)
                continue
            self._record(call)

    def _record(self, call: dict[str, Any]) -> None:
        if not self._published(call["group"]):
            return  # a group already shut down (or never published): like a task's call
        name = call["method"]
        self.stats.finished(
            call["group"],
            method_name(name),
            is_internal(name),
            call["stop"] - call["start"],
            call["status"] != "OK",
        )
        self._to_task_stream(call)

    def _to_task_stream(self, call: dict[str, Any]) -> None:
        """Hand the call to Dask's task stream as the record of a finished task."""
        stream = self.scheduler.plugins.get(TaskStreamPlugin.name)
        if stream is None:
            return
        ok = call["status"] == "OK"
        stream.transition(
            _stream_key(call),
            "processing",
            "memory" if ok else "erred",
            worker=call["worker"],
            thread=DIRECT_LANE,
            startstops=({"action": "compute", "start": call["start"], "stop": call["stop"]},),
            status="OK" if ok else "error",
            nbytes=call["nbytes"],
            metadata={},
            stimulus_id=f"{CALL_TOPIC}-{call['stop']}",
        )

    # -- the page's data ------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """Every published group with its ranks' liveness and its call statistics."""
        groups = self.groups()
        self.stats.forget(groups.__contains__)
        live = {addr: str(ws.name) for addr, ws in self.scheduler.workers.items()}
        return [group_view(name, refs, live, self.stats) for name, refs in sorted(groups.items())]

    def groups(self) -> dict[str, list[InstanceRef]]:
        """The groups the backends published, decoded once per publication."""
        datasets = self._datasets()
        out: dict[str, list[InstanceRef]] = {}
        for name, entry in list(datasets.items()):
            if not (isinstance(name, str) and name.startswith(GROUP_DATASET)):
                continue
            data = entry.get("data")
            cached = self._decoded.get(name)
            if cached is None or cached[0] is not data:
                cached = (data, _decode(name, data))
                self._decoded[name] = cached
            out[name[len(GROUP_DATASET) :]] = cached[1]
        for name in [n for n in self._decoded if n not in datasets]:
            del self._decoded[name]
        return out

    def _datasets(self) -> dict:
        publish = self.scheduler.extensions.get("publish") if self.scheduler else None
        return publish.datasets if publish is not None else {}

    def _published(self, group: str) -> bool:
        return GROUP_DATASET + group in self._datasets()

    def _locate(self, key: Any) -> tuple[str, str, bool] | None:
        label = label_of(key)
        if label is None:
            return None
        # Keys carry the group name with hyphens made underscores (see ``task_key``).
        real = {
            name[len(GROUP_DATASET) :].replace("-", "_"): name[len(GROUP_DATASET) :]
            for name in self._datasets()
            if isinstance(name, str) and name.startswith(GROUP_DATASET)
        }
        found = locate(label, real.__contains__)
        return None if found is None else (real[found[0]], *found[1:])


def _direct_call(msg: Any) -> dict[str, Any] | None:
    """A ``hybridflow-call`` event's fields, checked, or ``None`` when it is malformed."""
    if not isinstance(msg, dict):
        return None
    try:
        call = {
            "key": str(msg["key"]),
            "group": str(msg["group"]),
            "method": str(msg["method"]),
            "worker": str(msg["worker"]),
            "start": float(msg["start"]),
            "stop": float(msg["stop"]),
            "status": str(msg.get("status", "OK")),
            "nbytes": int(msg.get("nbytes") or 0),
        }
    except (KeyError, TypeError, ValueError):
        return None
    if call["stop"] < call["start"]:
        return None
    return call


def _stream_key(call: dict[str, Any]) -> str:
    """The call's key if the task stream would name it ``group.method``, else one that does.

    The task stream names a bar after ``key_split(key)``: a key shaped like a task's,
    ``"{group}.{method}-<uuid hex>"``, shows as ``group.method`` (hyphens of the label made
    underscores, as ``task_key`` does).
    """
    label = f"{call['group']}.{call['method']}".replace("-", "_")
    key = call["key"]
    if label_of(key) == label:
        return key
    return f"{label}-{uuid.uuid5(uuid.NAMESPACE_OID, key).hex}"


def _compute_time(startstops: Any) -> float | None:
    """Seconds the task computed on its worker, from the worker's ``startstops`` report."""
    if not startstops:
        return None
    spans = [s["stop"] - s["start"] for s in startstops if s.get("action") == "compute"]
    return sum(spans) if spans else None


def _decode(name: str, data: Any) -> list[InstanceRef]:
    """A published dataset's value: ``Serialized`` over TCP, ``Serialize`` in-process."""
    try:
        if hasattr(data, "header") and hasattr(data, "frames"):
            value = deserialize(data.header, data.frames)
        else:
            value = getattr(data, "data", data)
        return [r for r in value if isinstance(r, InstanceRef)]
    except Exception:
        logger.warning("could not decode the published group %s", name, exc_info=True)
        return []


# -- HTTP -------------------------------------------------------------------------------


class _MonitorHandler(web.RequestHandler):
    def initialize(self, dask_server: Any) -> None:
        self.scheduler = dask_server

    def monitor(self) -> GroupMonitor | None:
        plugin = self.scheduler.plugins.get(PLUGIN_NAME)
        if not isinstance(plugin, GroupMonitor):
            self.set_status(404)
            self.finish("the hybridflow group monitor is not registered on this scheduler")
            return None
        return plugin


class GroupsPage(_MonitorHandler):
    def get(self) -> None:
        monitor = self.monitor()
        if monitor is None:
            return
        app = self.application
        page = render_html(
            monitor.snapshot(),
            scheduler=self.scheduler.address,
            updated=time.strftime("%H:%M:%S"),
            status_url=app.reverse_url("hybridflow-page")[: -len(PAGE_ROUTE)] + "status",
            json_url=app.reverse_url("hybridflow-json"),
        )
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.write(page)


class GroupsJson(_MonitorHandler):
    def get(self) -> None:
        monitor = self.monitor()
        if monitor is None:
            return
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        # nosniff: a browser never reads the published names in it as HTML.
        self.set_header("X-Content-Type-Options", "nosniff")
        body = {"scheduler": self.scheduler.address, "groups": monitor.snapshot()}
        self.write(json.dumps(body, default=str))


def add_routes(scheduler: Any) -> bool:
    """Add the page's routes to the scheduler's running web server, once.

    Tornado looks handlers up per request, so routes added after the server started are
    served like the built-in ones. They go under the dashboard's prefix, if any.
    """
    app = getattr(scheduler, "http_application", None)
    if app is None:
        logger.info("scheduler %s has no web server; no hybridflow page", scheduler.address)
        return False
    try:
        app.reverse_url("hybridflow-page")
        return True  # added by an earlier registration of the plugin
    except KeyError:
        pass
    prefix = _http_prefix(app)
    kwargs = {"dask_server": scheduler}
    app.add_handlers(
        r".*$",
        [
            web.url(prefix + PAGE_ROUTE, GroupsPage, kwargs, name="hybridflow-page"),
            web.url(prefix + JSON_ROUTE, GroupsJson, kwargs, name="hybridflow-json"),
            (prefix + PAGE_ROUTE + "/", web.RedirectHandler, {"url": prefix + PAGE_ROUTE}),
        ],
    )
    logger.debug("serving %s%s on scheduler %s", prefix, PAGE_ROUTE, scheduler.address)
    return True


def _http_prefix(app: Any) -> str:
    """The dashboard's URL prefix, read off its ``health`` route (``/`` when there is none)."""
    for rule in app.wildcard_router.rules:
        pattern = getattr(getattr(rule.matcher, "regex", None), "pattern", "")
        if pattern.endswith("health$"):
            return pattern[: -len("health$")] or "/"
    return "/"


def register_group_monitor(client: Client) -> None:
    """Register the monitor on ``client``'s scheduler; a failure only costs the page."""
    try:
        client.register_plugin(GroupMonitor(), name=PLUGIN_NAME)
    except Exception as exc:  # e.g. the scheduler cannot import hybridflow_dask
        logger.warning(
            "the hybridflow dashboard page is unavailable on %s: %s", client.scheduler.address, exc
        )
