"""The worker-group page on the Dask dashboard: a scheduler plugin that serves it.

``GroupMonitor`` is registered through ``client.register_plugin`` (no preload, no config),
so it works on a cluster the backend starts and on one it attaches to by address. When it
starts on the scheduler it adds two routes to the dashboard's running web server
(tornado's ``Application.add_handlers``):

- ``/hybridflow``: an HTML table per worker group, refreshing every 2 s;
- ``/hybridflow/groups.json``: the same data as JSON.

It also adds a "Hybridflow" tab to the navigation bar of Dask's own pages.

Groups are the ``hybridflow-group-*`` datasets the backend publishes; a rank is alive while
its worker address is still in ``scheduler.workers``. What the page knows of calls comes
from the workers that host them, on every call path: the ``hybridflow-call`` events each
worker logs (``worker.call_log``) with every finished call's phase times and error, and
with the calls pending there for more than half a second (fetching inputs, queued behind
earlier calls, or running). Calls on the direct path are also handed to Dask's
``TaskStreamPlugin`` as records of finished tasks, so the task stream shows them as
``group.method`` bars: the method as compute, fetching inputs and replying as transfers.
Routing and bookkeeping tasks are counted from the scheduler's transitions.

Events (errors with their tracebacks, workers that left while hosting ranks, calls a
driver lost with a worker, ranks ``recover()`` rebuilt) are kept for the plugin's life,
the most recent ``EVENTS_KEPT``.

The scheduler needs ``hybridflow_dask`` importable to load the plugin.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from distributed import Client, SchedulerPlugin
from distributed.protocol import deserialize
from tornado.web import RedirectHandler, RequestHandler, url

from ...base import InstanceRef
from ..config import task_stream_length
from ..internals import (
    add_dashboard_page,
    keep_task_stream,
    published_datasets,
    record_finished_task,
)
from ..wire.call_events import FinishedCall, FoldedCalls, call_entries, sampled_calls
from ..wire.keys import CALL_PHASES, CALL_STAMPS, CALL_TOPIC, EVENT_TOPIC, GROUP_DATASET
from .dashboard_page import (
    CallStats,
    EventLog,
    InFlight,
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
    """Counts backend calls per (group, method), keeps recent events, serves the page.

    Everything runs on the scheduler's event loop (hooks and HTTP handlers alike), so no
    locking is needed.
    """

    idempotent = True  # a second backend on the same cluster keeps the first one's counts

    def __init__(self) -> None:
        self.stats = CallStats()
        self.inflight = InFlight()
        self.events = EventLog()
        self.scheduler: Any = None
        self._decoded: dict[str, tuple[Any, list[InstanceRef]]] = {}
        #: address -> what the page shows of a worker; kept after it leaves, for its events.
        self._workers: dict[str, dict[str, Any]] = {}
        self._drawn = StreamBudget(STREAM_BARS_PER_S)

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        add_routes(scheduler)
        add_dashboard_page(scheduler, PAGE_ROUTE)  # a "Hybridflow" tab on Dask's own pages
        for address in scheduler.workers:
            self.add_worker(scheduler, address)
        # The dashboard adds this plugin when its task stream is first drawn; adding it now
        # (as the dashboard does) also keeps the direct calls made before that.
        keep_task_stream(scheduler, task_stream_length())

    # -- what the scheduler tells us ------------------------------------------------------

    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None:
            self._workers[worker] = {"name": str(ws.name), "pid": ws.pid}

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left: each rank it hosted, with the calls it had in flight, is an event."""
        lost = self.inflight.lost(worker)
        self._drawn.forget(worker)
        seen = self._workers.pop(worker, {})
        who = f"worker {seen.get('name', worker)} (pid {seen.get('pid', '?')})"
        now = time.time()
        for group, refs in self.groups().items():
            for ref in refs:
                if ref.slot.address != worker:
                    continue
                calls = [c for c in lost if c["group"] == group and c["rank"] == ref.rank]
                doing = ", ".join(f"{c['method']} ({c['state']})" for c in calls)
                self.events.add(
                    "worker-lost",
                    now,
                    group=group,
                    rank=ref.rank,
                    worker=worker,
                    message=f"{who} left the cluster; "
                    + (f"calls in flight there: {doing}" if doing else "no call known in flight"),
                )

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Routing and bookkeeping tasks; calls themselves are reported by their workers."""
        if start != "processing" or finish not in ("memory", "erred") or self.scheduler is None:
            return
        where = self._locate(key)
        if where is None or not where[2]:
            return
        duration = _compute_time(kwargs.get("startstops"))
        error = None
        if finish == "erred":
            error = {"type": "task error", "message": str(kwargs.get("exception_text", ""))}
        self.stats.finished(*where, {} if duration is None else {"run": duration}, error)

    def update_graph(self, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        self.stats.forget(self._published)

    def log_event(self, topic: str, msg: Any) -> None:
        if self.scheduler is None or not isinstance(msg, dict):
            return
        if topic == EVENT_TOPIC:
            self._driver_event(msg)
        if topic != CALL_TOPIC:
            return
        now = time.time()
        for entry in _listed(msg, "pending"):
            if _pending_call(entry) and self._published(entry["group"]):
                self.inflight.report(entry, now)
        self._record(call_entries(msg), sampled_calls(msg), now)

    def _record(
        self,
        entries: list[FinishedCall | FoldedCalls],
        samples: list[FinishedCall],
        now: float,
    ) -> None:
        """Count one event's calls (rows and folds, in order) and add its samples' phase
        times; each (group, method) is looked up once per event."""
        datasets = self._datasets()
        places: dict[tuple[str, str], tuple[str, str, bool] | None] = {}

        def place_of(group: str, method: str) -> tuple[str, str, bool] | None:
            place = places.get((group, method), _UNSEEN)
            if place is _UNSEEN:
                published = GROUP_DATASET + group in datasets
                place = places[group, method] = (
                    (group, method_name(method), is_internal(method))
                    if published  # else a group shut down (or never published): ignored
                    else None
                )
            return place

        for entry in entries:
            place = place_of(entry.group, entry.method)
            if place is None:
                continue
            if isinstance(entry, FoldedCalls):
                for rank, count, run in entry.ranks:
                    self.stats.folded(*place, rank, count, run, when=now)
            else:
                self._finished(entry, place, now)
        for call in samples:
            place = place_of(call.group, call.method)
            if place is not None:
                self.stats.sampled(*place, _phases(call))
                self._draw(call, now)

    def _finished(self, call: FinishedCall, place: tuple[str, str, bool], now: float) -> None:
        """A call sent as a row of its own: counted, its phases kept, its error an event."""
        group, name, internal = place
        self.inflight.done(call.worker, call.key)
        error = None if call.ok else _error(call.error)
        self.stats.finished(group, name, internal, _phases(call), error, rank=call.rank, when=now)
        if error is not None:
            self.events.add(
                "error", now, group=group, method=name, rank=call.rank, worker=call.worker, **error
            )
        self._draw(call, now)

    def _draw(self, call: FinishedCall, now: float) -> None:
        if call.path != "task" and self._drawn.take(call.worker, now):
            self._to_task_stream(call)  # (a task's own record is already in the stream)

    def _driver_event(self, msg: dict[str, Any]) -> None:
        kind = msg.get("kind")
        if kind not in DRIVER_EVENTS:
            logger.debug("ignoring a malformed %s event: %r", EVENT_TOPIC, msg)
            return
        fields = {k: msg[k] for k in ("group", "method", "rank", "worker") if k in msg}
        message = str(msg.get("message", ""))
        self.events.add(str(kind), time.time(), message=message, **fields)
        if kind == "lost":
            self._count_lost(msg, message)

    def _count_lost(self, msg: dict[str, Any], message: str) -> None:
        """Calls a driver lost with their worker failed: each counts as a call and an error."""
        count, group, method = msg.get("count"), msg.get("group"), msg.get("method")
        if not (isinstance(count, int) and isinstance(group, str) and isinstance(method, str)):
            return
        if not self._published(group):
            return
        error = {"type": "WorkerLostError", "message": message, "traceback": ""}
        for _ in range(min(count, LOST_COUNTED)):
            self.stats.finished(group, method_name(method), False, {}, error, rank=msg.get("rank"))

    def _to_task_stream(self, call: FinishedCall) -> None:
        """Hand the call to Dask's task stream as the record of a finished task: fetching
        its inputs and replying as transfers, the method as compute, its wait as a gap."""
        received, inputs, start, stop, replied = call.stamps
        spans = [
            ("transfer", received, inputs),
            ("compute", start, stop),
            ("transfer", stop, replied),
        ]
        record_finished_task(
            self.scheduler,
            _stream_key(call),
            ok=call.ok,
            worker=call.worker,
            thread=DIRECT_LANE,
            spans=[(action, a, b) for action, a, b in spans if b > a or action == "compute"],
            nbytes=call.nbytes,
        )

    # -- the page's data ------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """Every published group with its ranks' liveness, calls in flight and statistics."""
        groups = self.groups()
        self.stats.forget(groups.__contains__)
        self.inflight.forget(groups.__contains__)
        workers = {
            addr: {"name": str(ws.name), "pid": ws.pid}
            for addr, ws in self.scheduler.workers.items()
        }
        now = time.time()
        return [
            group_view(name, refs, workers, self.stats, self.inflight.of_group(name), now)
            for name, refs in sorted(groups.items())
        ]

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
        return published_datasets(self.scheduler) if self.scheduler else {}

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


#: The most direct calls of one worker drawn in Dask's task stream per second. Every call
#: counts on the page; beyond this the stream could not show them apart anyway (a
#: thousand no-op bars a second on one row are one smear), while each drawn bar costs the
#: scheduler a record (hundreds of ranks calling at once are hundreds of bars per call).
STREAM_BARS_PER_S = 200


class StreamBudget:
    """How many calls each worker may still have drawn now: ``rate`` a second, refilled as
    time passes (a burst of up to one second's worth at once)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._left: dict[str, tuple[float, float]] = {}  # worker -> (tokens, when)

    def take(self, worker: str, now: float) -> bool:
        tokens, when = self._left.get(worker, (self.rate, now))
        tokens = min(self.rate, tokens + (now - when) * self.rate)
        if tokens < 1:
            self._left[worker] = (tokens, now)
            return False
        self._left[worker] = (tokens - 1, now)
        return True

    def forget(self, worker: str) -> None:
        self._left.pop(worker, None)


#: Each phase the page shows, with the indexes of its first and last stamp in a call's.
_PHASES = tuple(
    (name, CALL_STAMPS.index(begin), CALL_STAMPS.index(end))
    for name, (begin, end) in CALL_PHASES.items()
)
_UNSEEN: Any = object()


def _phases(call: FinishedCall) -> dict[str, float]:
    stamps = call.stamps
    return {phase: stamps[end] - stamps[begin] for phase, begin, end in _PHASES}


#: The most lost calls one event adds to a method's counts (a bound on a malformed event).
LOST_COUNTED = 100_000
#: What a driver reports (``EVENT_TOPIC``): calls it failed because their worker died, and
#: ranks ``WorkerGroup.recover()`` rebuilt.
DRIVER_EVENTS = frozenset({"lost", "recovered"})


def _listed(msg: dict[str, Any], field: str) -> list[Any]:
    entries = msg.get(field, ())
    if not isinstance(entries, (list, tuple)):
        logger.debug("ignoring a malformed %r in a %s event: %r", field, CALL_TOPIC, msg)
        return []
    return list(entries)


def _pending_call(msg: Any) -> bool:
    """Whether a pending-call report has what the page needs."""
    try:
        float(msg["age"])
        if msg.get("running_for") is not None:
            float(msg["running_for"])
        return all(isinstance(msg[k], str) for k in ("key", "group", "method", "worker", "state"))
    except (KeyError, TypeError, ValueError):
        return False


def _error(detail: Any) -> dict[str, str]:
    if not isinstance(detail, dict):
        return {"type": "error", "message": "", "traceback": ""}
    return {k: str(detail.get(k, "")) for k in ("type", "message", "traceback")}


def _stream_key(call: FinishedCall) -> str:
    """The call's key if the task stream would name it ``group.method``, else one that does.

    The task stream names a bar after ``key_split(key)``: a key shaped like a task's,
    ``"{group}.{method}-<uuid hex>"``, shows as ``group.method`` (hyphens of the label made
    underscores, as ``task_key`` does).
    """
    label = f"{call.group}.{call.method}".replace("-", "_")
    key = call.key
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


class _MonitorHandler(RequestHandler):
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
        prefix = app.reverse_url("hybridflow-page")[: -len(PAGE_ROUTE)]
        page = render_html(
            monitor.snapshot(),
            scheduler=self.scheduler.address,
            updated=time.strftime("%H:%M:%S"),
            status_url=prefix + "status",
            json_url=app.reverse_url("hybridflow-json"),
            info_url=prefix + "info/",
            events=monitor.events.recent(),
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
        body = {
            "scheduler": self.scheduler.address,
            "groups": monitor.snapshot(),
            "events": monitor.events.recent(),
        }
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
            url(prefix + PAGE_ROUTE, GroupsPage, kwargs, name="hybridflow-page"),
            url(prefix + JSON_ROUTE, GroupsJson, kwargs, name="hybridflow-json"),
            (prefix + PAGE_ROUTE + "/", RedirectHandler, {"url": prefix + PAGE_ROUTE}),
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
