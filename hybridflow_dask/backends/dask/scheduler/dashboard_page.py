"""The worker-group page's model and HTML: call statistics per (group, method), rendered.

Pure Python, no Dask import: the scheduler plugin in ``dashboard`` feeds it call
outcomes and group membership, and this module turns them into the JSON and HTML the
page serves, so both can be tested without a cluster. Whoever can publish a dataset on the
scheduler chooses the names shown, so the HTML comes from a Jinja2 template with
autoescaping on (as Dask's own pages are made): no value reaches the page unescaped.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2
import markupsafe

from ...base import InstanceRef
from ..wire.keys import CALL_PHASES
from .rank_view import (
    ATTENTION_SHOWN,
    FOLD_ABOVE,
    PROCESSES_SHOWN,
    RANK_WINDOW,
    RankStats,
    attention,
    fold,
    percentile,
    rank_fields,
    slow_ranks,
    stats_of,
)

__all__ = [
    "PHASES",
    "WINDOW",
    "CallStats",
    "EventLog",
    "InFlight",
    "MethodStats",
    "group_view",
    "is_internal",
    "label_of",
    "locate",
    "method_name",
    "percentile",
    "render_html",
    "straggling",
]

#: How many recent durations each (group, method) keeps for its percentiles, per phase.
WINDOW = 1000
#: The phases of a call, in the order they happen on the worker.
PHASES = tuple(CALL_PHASES)
#: How many recent events (errors, deaths, lost calls, recoveries) the page keeps.
EVENTS_KEPT = 500
#: A running call is a straggler once it has run this many times its method's median ...
STRAGGLER_FACTOR = 3.0
#: ... and at least this long (seconds).
STRAGGLER_MIN_S = 1.0
#: Label suffixes of the tasks that move rows between ranks (``DataProtoFuture`` routing).
ROUTING = frozenset({"route", "rows", "assemble"})
#: Tasks the backend sends for its own bookkeeping rather than for a user's call.
BOOKKEEPING = frozenset({"__del__", "__skip__"})

_KEY = re.compile(r"^(?P<label>.+)-[0-9a-f]{32}$")


def label_of(key: object) -> str | None:
    """``"{group}.{method}"`` of a backend task key ``"{group}.{method}-<uuid hex>"``."""
    if not isinstance(key, str) or "." not in key:
        return None
    match = _KEY.match(key)
    return match.group("label") if match else None


def locate(label: str, is_group: Callable[[str], bool]) -> tuple[str, str, bool] | None:
    """``(group, name, internal)`` for a label whose group ``is_group`` recognizes.

    Group names may contain dots, so every dot is tried as the group/method boundary.
    ``internal`` marks routing and bookkeeping tasks, listed apart from user methods.
    """
    cut = label.find(".")
    while cut != -1:
        group, rest = label[:cut], label[cut + 1 :]
        if rest and is_group(group):
            return group, method_name(rest), is_internal(rest)
        cut = label.find(".", cut + 1)
    return None


def is_internal(name: str) -> bool:
    """Whether ``name`` (what follows the group in a label) is routing or bookkeeping."""
    return name in BOOKKEEPING or name.rsplit(".", 1)[-1] in ROUTING


def method_name(name: str) -> str:
    """The one spelling the page uses for a user method: the fused group's.

    A call through a role view of a fused group (``spawn``) is labelled
    ``"{group}.{role}.{method}"`` while the same method called on the fused group is
    ``"{group}.{role}_{method}"``; Python names hold no dots, so a dot in a user method's
    name can only be that role boundary and becomes ``_``. Internal names keep theirs.
    """
    return name if is_internal(name) else name.replace(".", "_")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass
class MethodStats:
    """Outcomes of one (group, method): every finished call counts, errors included.

    Each phase of a call keeps its own window of durations: ``queue`` (waiting its turn
    behind the instance's earlier calls), ``inputs`` (fetching its input futures), ``run``
    (the method itself) and ``reply`` (handing the result back or keeping it).
    """

    calls: int = 0
    errors: int = 0
    phases: dict[str, deque] = field(
        default_factory=lambda: {p: deque(maxlen=WINDOW) for p in PHASES}
    )
    last_error: dict[str, Any] | None = None
    #: rank -> when (scheduler clock) its latest call of this method finished.
    finished_at: dict[Any, float] = field(default_factory=dict)

    def summary(self, running: int = 0) -> dict[str, Any]:
        run = sorted(self.phases["run"])
        return {
            "calls": self.calls,
            "errors": self.errors,
            "running": running,
            "p50_ms": _ms(percentile(run, 0.5)),
            "p90_ms": _ms(percentile(run, 0.9)),
            "split_p50_ms": {p: _ms(percentile(sorted(self.phases[p]), 0.5)) for p in PHASES},
            "last_error": self.last_error,
        }

    def typical_run(self) -> float:
        return percentile(sorted(self.phases["run"]), 0.5) or 0.0


class CallStats:
    """Counters per group, then per method name; internal tasks kept in their own table."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[dict[str, MethodStats], dict[str, MethodStats]]] = {}
        #: group -> rank -> that rank's user calls (what the page folds and ranks by).
        self.ranks: dict[str, dict[Any, RankStats]] = {}

    def get(self, group: str, name: str, internal: bool) -> MethodStats:
        tables = self.groups.get(group)
        if tables is None:
            tables = self.groups[group] = ({}, {})
        table = tables[1] if internal else tables[0]
        stats = table.get(name)
        if stats is None:
            stats = table[name] = MethodStats()
        return stats

    def finished(
        self,
        group: str,
        name: str,
        internal: bool,
        phases: Mapping[str, float],
        error: Mapping[str, Any] | None = None,
        *,
        rank: Any = None,
        when: float | None = None,
    ) -> None:
        """One finished call: its phase durations (seconds) and its error, if it failed."""
        self.sampled(group, name, internal, phases)
        self._count(group, name, internal, 1, phases.get("run"), error, rank, when)

    def folded(
        self,
        group: str,
        name: str,
        internal: bool,
        rank: Any,
        count: int,
        run: float,
        *,
        when: float,
    ) -> None:
        """``count`` good calls of one rank, folded (their phases come as samples): the
        longest ``run`` joins the rank's window."""
        self._count(group, name, internal, count, run, None, rank, when)

    def sampled(self, group: str, name: str, internal: bool, phases: Mapping[str, float]) -> None:
        """A call's phase durations, into its method's windows."""
        windows = self.get(group, name, internal).phases
        for phase, seconds in phases.items():
            windows[phase].append(max(0.0, seconds))

    def _count(
        self,
        group: str,
        name: str,
        internal: bool,
        count: int,
        run: float | None,
        error: Mapping[str, Any] | None,
        rank: Any,
        when: float | None,
    ) -> None:
        """``count`` calls of one rank ended, the latest with ``error``."""
        stats = self.get(group, name, internal)
        stats.calls += count
        if error is not None:
            stats.errors += 1
            stats.last_error = {"rank": rank, "time": when, **error}
        if rank is None:
            return
        try:
            if when is not None:
                stats.finished_at[rank] = when
            if internal:
                return
            ranks = self.ranks.setdefault(group, {})
            per_rank = ranks.get(rank)
            if per_rank is None:
                per_rank = ranks[rank] = RankStats()
        except TypeError:  # an unhashable rank from a malformed event: no statistics
            return
        per_rank.finished(name, run, error, when, count=count)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the groups ``keep`` rejects (shut down), so a long-lived scheduler stays small."""
        for group in [g for g in self.groups if not keep(g)]:
            del self.groups[group]
        for group in [g for g in self.ranks if not keep(g)]:
            del self.ranks[group]

    def method(self, group: str, name: str) -> MethodStats | None:
        return self.groups.get(group, ({}, {}))[0].get(name)

    def tables(
        self, group: str, running: Mapping[str, int] | None = None
    ) -> tuple[dict[str, dict], dict[str, dict]]:
        methods, inner = self.groups.get(group, ({}, {}))
        running = running or {}
        names = sorted(set(methods) | set(running))
        empty = MethodStats()
        return (
            {n: methods.get(n, empty).summary(running.get(n, 0)) for n in names},
            {name: s.summary() for name, s in sorted(inner.items())},
        )


class InFlight:
    """The calls workers reported as still pending, by ``(worker, key)``.

    A worker reports a call that has been pending for a while (``call_log``), and again
    when its state changes (``inputs`` -> ``queued`` -> ``running``); its finished record
    removes it, and so does its worker's death.
    """

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], dict[str, Any]] = {}

    def report(self, entry: Mapping[str, Any], now: float) -> None:
        running_for = entry.get("running_for")
        self.calls[(entry["worker"], entry["key"])] = {
            "group": entry["group"],
            "method": method_name(entry["method"]),
            "rank": entry["rank"],
            "worker": entry["worker"],
            "key": entry["key"],
            "state": entry["state"],
            "since": now - float(entry["age"]),
            "started": None if running_for is None else now - float(running_for),
        }

    def done(self, worker: str, key: str) -> None:
        self.calls.pop((worker, key), None)

    def lost(self, worker: str) -> list[dict[str, Any]]:
        """The calls pending on a worker that died; forgotten here."""
        gone = [k for k in self.calls if k[0] == worker]
        return [self.calls.pop(k) for k in gone]

    def forget(self, keep: Callable[[str], bool]) -> None:
        for k in [k for k, c in self.calls.items() if not keep(c["group"])]:
            del self.calls[k]

    def of_group(self, group: str) -> list[dict[str, Any]]:
        return [c for c in self.calls.values() if c["group"] == group]


class EventLog:
    """Recent errors, worker deaths, lost calls and recoveries, newest last, bounded."""

    def __init__(self, size: int = EVENTS_KEPT) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, kind: str, when: float, **fields: Any) -> None:
        self.events.append({"time": when, "kind": kind, **fields})

    def recent(self) -> list[dict[str, Any]]:
        return list(reversed(self.events))


def straggling(call: Mapping[str, Any], stats: MethodStats | None, now: float) -> bool:
    """Whether a running call is far slower than its peers on the same call: another rank
    finished this method after this one started, and this one has run ``STRAGGLER_FACTOR``
    times that method's median (and at least ``STRAGGLER_MIN_S``)."""
    if call["started"] is None or stats is None:
        return False
    seconds = now - call["started"]
    if seconds < max(STRAGGLER_MIN_S, STRAGGLER_FACTOR * stats.typical_run()):
        return False
    return any(r != call["rank"] and t >= call["since"] for r, t in stats.finished_at.items())


def group_view(
    name: str,
    refs: Iterable[InstanceRef],
    workers: Mapping[str, Mapping[str, Any]],
    stats: CallStats,
    inflight: Iterable[Mapping[str, Any]] = (),
    now: float = 0.0,
) -> dict[str, Any]:
    """One group as the page shows it; ``workers`` maps the addresses of workers now up to
    what the scheduler knows of them (``name``, ``pid``).

    ``ranks`` lists every rank; ``hosts`` folds them per host and worker process, and
    ``attention`` names the ranks the page lists first (``rank_view``).
    """
    refs = sorted(refs, key=_rank_order)
    pending = []
    by_rank: dict[str, list[dict[str, Any]]] = {}
    for call in inflight:
        started = call["started"]
        entry = {
            "rank": call["rank"],
            "method": call["method"],
            "state": call["state"],
            "seconds": round(now - (started if started is not None else call["since"]), 3),
            "straggler": straggling(call, stats.method(name, call["method"]), now),
        }
        pending.append(entry)
        by_rank.setdefault(repr(call["rank"]), []).append(entry)
    pending.sort(key=lambda c: (c["method"], repr(c["rank"])))
    counts: dict[str, int] = {}
    for call in pending:
        counts[call["method"]] = counts.get(call["method"], 0) + 1
    methods, internal = stats.tables(name, counts)
    rank_stats = stats.ranks.get(name, {})
    slow = slow_ranks(rank_stats)
    ranks = []
    for r in refs:
        seen = workers.get(r.slot.address)
        ranks.append(
            {
                "rank": r.rank,
                "address": r.slot.address,
                "host": r.slot.host,
                "worker_name": (seen or {}).get("name") or r.slot.name,
                "pid": (seen or {}).get("pid"),
                "device": r.slot.device,
                "alive": seen is not None,
                "pending": by_rank.get(repr(r.rank), []),
                **rank_fields(stats_of(rank_stats, r.rank)),
                "slow": stats_of(slow, r.rank),
            }
        )
    return {
        "name": name,
        "class": next((r.cls_name for r in refs if r.cls_name), ""),
        "world_size": len(refs),
        "folded": len(refs) > FOLD_ABOVE,
        "ranks": ranks,
        "attention": attention(ranks),
        "hosts": fold(ranks, rank_stats),
        "pending": pending,
        "methods": methods,
        "internal": internal,
    }


def _rank_order(ref: InstanceRef) -> tuple[int, int, str]:
    """Ranks in order; anything else a publisher put there last, so it cannot break the page."""
    rank = ref.rank
    if isinstance(rank, int) and not isinstance(rank, bool):
        return 0, rank, ""
    return 1, 0, repr(rank)


# -- HTML -------------------------------------------------------------------------------

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       margin: 0; background: #f4f5f7; color: #1f2933; font-size: 14px; }
header { background: #2b2b2b; color: #fff; padding: 12px 24px; display: flex;
         align-items: baseline; gap: 24px; }
header h1 { font-size: 18px; margin: 0; font-weight: 600; }
header h1 span { color: #ecb172; }
header a { color: #ecb172; text-decoration: none; }
header .meta { color: #b8bcc2; font-size: 13px; margin-left: auto; }
main { padding: 16px 24px; }
a { color: #1f6fb2; }
.group, .events { background: #fff; border-radius: 6px; box-shadow: 0 1px 3px rgba(0,0,0,.12);
         margin-bottom: 16px; padding: 12px 16px 16px; }
.group h2, .events h2 { font-size: 16px; margin: 0 0 10px;
         font-family: ui-monospace, Menlo, monospace; }
.badge { display: inline-block; border-radius: 10px; padding: 1px 9px; font-size: 12px;
         font-weight: 500; margin-left: 8px; background: #e6e9ee; color: #3e4c59;
         font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
.badge.slow { background: #fde7c8; color: #8a4b00; }
.cols { display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }
.cols > div { flex: 1 1 480px; min-width: 0; }
h3 { font-size: 12px; text-transform: uppercase; letter-spacing: .05em; color: #7b8794;
     margin: 4px 0 6px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid #e4e7eb;
         vertical-align: top; }
th { font-weight: 600; color: #52606d; background: #f9fafb; font-size: 12px;
     white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap;
                 width: 5.5em; }
td.mono { font-family: ui-monospace, Menlo, monospace; font-size: 13px; }
.alive { color: #1b873f; font-weight: 600; }
.dead { color: #c62828; font-weight: 600; }
.err { color: #c62828; font-weight: 600; }
.run { color: #1f6fb2; font-weight: 600; }
.slow { color: #b35c00; font-weight: 700; }
.muted { color: #9aa5b1; }
.ok { color: #1b873f; margin: 4px 0 10px; }
table.attention { margin-bottom: 12px; }
tr.host td { background: #f9fafb; font-weight: 600; }
tr.proc td:first-child { padding-left: 24px; }
.nowrap { white-space: nowrap; }
.lasterr td { border-bottom: 1px solid #e4e7eb; color: #8a1c1c; font-size: 12px;
              padding-top: 0; }
details { margin-top: 8px; color: #52606d; }
pre { white-space: pre-wrap; font-size: 12px; background: #f9fafb; padding: 8px;
      border-radius: 4px; margin: 6px 0 0; max-height: 320px; overflow: auto; }
.empty { color: #7b8794; padding: 32px; text-align: center; }
"""


#: Every ``{{ value }}`` is escaped (autoescape), so a group, rank, host, method name or
#: error message from a published dataset or a worker's event can never become markup.
_TEMPLATE = """\
{% macro ms(value) %}
{%- if value is none %}<span class="muted">-</span>{% else %}{{ value|ms }}{% endif -%}
{% endmacro %}
{% macro method_table(methods, split) %}
{% if methods %}
<table><tr><th>method</th><th class="num">calls</th><th class="num">errors</th>
<th class="num">running</th><th class="num">run p50</th><th class="num">run p90</th>
{% if split %}{% for phase in split_phases %}<th class="num">{{ phase }}</th>{% endfor %}
{% endif %}</tr>
{% for name, s in methods.items() %}
<tr><td class="mono">{{ name }}</td><td class="num">{{ s["calls"] }}</td>
<td class="num">
{%- if s["errors"] %}<span class="err">{{ s["errors"] }}</span>{% else %}0{% endif -%}
</td><td class="num">
{%- if s["running"] %}<span class="run">{{ s["running"] }}</span>{% else %}0{% endif -%}
</td><td class="num">{{ ms(s["p50_ms"]) }}</td><td class="num">{{ ms(s["p90_ms"]) }}</td>
{% if split %}{% for phase in split_phases %}
<td class="num">{{ ms(s["split_p50_ms"][phase]) }}</td>{% endfor %}{% endif %}</tr>
{% if s["last_error"] %}{% set e = s["last_error"] %}
{% set columns = 6 + split_phases|length if split else 6 %}
<tr class="lasterr"><td colspan="{{ columns }}">last error (rank {{ e["rank"] }},
{{ e["time"]|clock }}): {{ e["type"] }}: {{ e["message"]|truncate(300) }}</td></tr>
{% endif %}
{% endfor %}
</table>
{% else %}
<p class="muted">no calls yet</p>
{% endif %}
{% endmacro %}
{% macro worker_links(address, title, alive) %}
{%- if alive %}<a href="{{ info_url }}worker/{{ address|quote }}.html"
 title="{{ title }}">{{ address }}</a>&nbsp;&middot;
<a href="{{ info_url }}logs/{{ address|quote }}.html">logs</a>
{%- else %}{{ address }}{% endif %}
{%- endmacro %}
{% macro pending_call(c) -%}
<span class="{{ 'slow' if c['straggler'] else 'run' }}">{{ c["method"] }}
{{ c["state"] }} {{ c["seconds"]|seconds }}{% if c["straggler"] %} straggler{% endif %}</span>
{%- endmacro %}
{% macro fold_cells(f) %}
<td class="num">{{ f["ranks"] }}</td><td class="num">
{%- if f["dead"] %}<span class="err">{{ f["alive"] }}</span>{% else %}{{ f["alive"] }}{% endif -%}
</td><td class="num">{{ f["calls"] }}</td><td class="num">
{%- if f["errors"] %}<span class="err">{{ f["errors"] }}</span>{% else %}0{% endif -%}
</td><td class="num">
{%- if f["pending"] %}<span class="run">{{ f["pending"] }}</span>{% else %}0{% endif -%}
</td><td class="num">{{ ms(f["p50_ms"]) }}</td><td class="num">{{ ms(f["p99_ms"]) }}</td>
{% endmacro %}
{% macro folded_ranks(group) %}
{% set dead, more_dead = dead_processes(group) %}
{% set listed, more = attention_rows(group) %}
{% for w in dead %}
<p class="err">dead: worker {{ w["address"] }} ({{ w["worker_name"] }}) on {{ w["host"] }},
ranks {{ w["first_rank"] }}{% if w["ranks"] > 1 %}&ndash;{{ w["last_rank"] }}{% endif %}</p>
{% endfor %}
{% if more_dead %}<p class="err">and {{ more_dead }} more dead worker processes</p>{% endif %}
{% if listed %}
<table class="attention"><tr><th class="num">rank</th><th>why first</th><th>worker</th>
<th class="num">pid</th></tr>
{% for r in listed %}
<tr><td class="num">{{ r["rank"] }}</td><td>
{% for e in r["failing"] %}<span class="err">{{ e["method"] }} failed</span>
({{ e["time"]|clock }}): {{ e["type"] }}: {{ e["message"]|truncate(160) }}<br>
{% endfor %}
{% for c in r["pending"] %}{{ pending_call(c) }}<br>
{% endfor %}
{% if r["slow"] %}{% set w = r["slow"] %}<span class="slow">slow {{ w["method"] }}</span>:
p50 {{ w["p50_ms"]|ms }} ms, the ranks' p50 {{ w["ranks_p50_ms"]|ms }} ms<br>{% endif %}
</td><td class="mono nowrap">{{ worker_links(r["address"], r["worker_name"], r["alive"]) }}</td>
<td class="num">{{ r["pid"] if r["pid"] is not none else "-" }}</td></tr>
{% endfor %}
</table>
{% if more %}
<p class="muted">and {{ more }} more ranks to look at: every rank is in the
<a href="{{ json_url }}">JSON</a></p>
{% endif %}
{% elif not dead %}
<p class="ok">all {{ group["world_size"] }} ranks alive: no failing method, no straggler,
no slow rank</p>
{% endif %}
{% set processes = group["hosts"]|sum(attribute="processes") %}
<table class="folds"><tr><th>host / worker process</th><th class="num">ranks</th>
<th class="num">alive</th><th class="num">calls</th><th class="num">errors</th>
<th class="num">pending</th><th class="num">run p50</th><th class="num">run p99</th></tr>
{% for h in group["hosts"] %}
<tr class="host"><td class="mono">{{ h["host"] }}
<span class="muted">{{ h["processes"] }} process{{ "es" if h["processes"] != 1 }}</span></td>
{{ fold_cells(h) }}</tr>
{% if processes <= processes_shown %}{% for w in h["workers"] %}
<tr class="proc"><td class="mono nowrap">{{ worker_links(w["address"], w["worker_name"],
w["alive"]) }} &middot; pid {{ w["pid"] if w["pid"] is not none else "-" }} &middot;
ranks {{ w["first_rank"] }}{% if w["ranks"] > 1 %}&ndash;{{ w["last_rank"] }}{% endif %}</td>
{{ fold_cells(w) }}</tr>
{% endfor %}{% endif %}
{% endfor %}
</table>
<p class="muted">run p50/p99: each rank's last {{ rank_window }} runs per method
(construction left out); ms</p>
{% endmacro %}
<!DOCTYPE html><html><head><meta charset='utf-8'>
<meta http-equiv="refresh" content="{{ refresh_s }}">
<title>hybridflow worker groups</title>
<style>{{ style }}</style></head><body><header>
<h1><span>hybridflow</span> worker groups</h1>
<a href="{{ status_url }}">Dask dashboard</a>
<a href="{{ json_url }}">JSON</a>
<span class="meta">{{ groups|length }} groups &middot; {{ ranks }} ranks
{%- if dead %} &middot; <span class="err">{{ dead }} dead</span>{% endif %}
{%- if stragglers %} &middot; <span class="slow">{{ stragglers }} straggling</span>{% endif %}
 &middot; scheduler {{ scheduler }} &middot; {{ updated }}</span>
</header><main>
{% for group in groups %}
{% set dead_ranks = group["ranks"]|rejectattr("alive")|list|length %}
{% set slow = group["pending"]|selectattr("straggler")|list|length %}
{% set badges = [group["class"] or "?", "world size %s"|format(group["world_size"])] %}
<section class="group"><h2>{{ group["name"] -}}
{% for text in badges %}<span class="badge">{{ text }}</span>{% endfor %}
{%- if dead_ranks %}<span class="badge dead">{{ dead_ranks }} dead</span>{% endif %}
{%- if slow %}<span class="badge slow">{{ slow }} straggling</span>{% endif %}</h2>
<div class="cols"><div><h3>Ranks</h3>
{% if group["folded"] %}{{ folded_ranks(group) }}{% else %}
<table><tr><th class="num">rank</th><th>worker</th><th class="num">pid</th><th>host</th>
<th>device</th><th>state</th><th>now</th></tr>
{% for r in group["ranks"] %}
{% set state = "alive" if r["alive"] else "dead" %}
<tr><td class="num">{{ r["rank"] }}</td>
<td class="mono nowrap">{{ worker_links(r["address"], r["worker_name"], r["alive"]) }}</td>
<td class="num">{{ r["pid"] if r["pid"] is not none else "-" }}</td>
<td>{{ r["host"] }}</td><td>{{ r["device"] }}</td>
<td><span class="{{ state }}">{{ state }}</span></td><td>
{% for c in r["pending"] %}{{ pending_call(c) }}<br>
{% else %}<span class="muted">idle</span>{% endfor %}</td></tr>
{% endfor %}
</table>
{% endif %}</div><div><h3>Methods (per rank call, ms)</h3>
{{ method_table(group["methods"], true) }}
{% if group["internal"] %}
<details><summary>routing and bookkeeping tasks</summary>
{{ method_table(group["internal"], false) }}
</details>
{% endif %}
</div></div></section>
{% else %}
<p class="empty">No worker groups on this cluster right now.</p>
{% endfor %}
<section class="events"><h2>Events</h2>
{% if events %}
<table><tr><th>time</th><th>event</th><th>where</th><th>worker</th><th>what</th></tr>
{% for e in events %}
<tr><td class="mono">{{ e["time"]|clock }}</td>
<td><span class="{{ 'err' if e['kind'] in ('error', 'worker-lost', 'lost') else 'run' }}">
{{- e["kind"] }}</span></td>
<td class="mono">{{ e["group"] or "" }}{% if e["method"] %}.{{ e["method"] }}{% endif %}
{%- if e["rank"] is not none %} rank {{ e["rank"] }}{% endif %}</td>
<td class="mono">{{ e["worker"] or "" }}</td>
<td>{% if e["type"] %}<b>{{ e["type"] }}</b>: {% endif %}{{ e["message"] }}
{% if e["traceback"] %}<details><summary>traceback</summary><pre>{{ e["traceback"] }}</pre>
</details>{% endif %}</td></tr>
{% endfor %}
</table>
{% else %}
<p class="muted">no errors, deaths or recoveries so far</p>
{% endif %}
</section>
</main></body></html>
"""


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )
    env.filters["ms"] = lambda value: f"{value:,.1f}"
    env.filters["seconds"] = lambda value: f"{value:,.1f} s"
    env.filters["clock"] = lambda value: (
        "-" if value is None else time.strftime("%H:%M:%S", time.localtime(value))
    )
    env.filters["quote"] = lambda value: urllib.parse.quote(str(value), safe="")
    return env


def _dead_processes(group: Mapping[str, Any]) -> tuple[list[dict], int]:
    """The group's worker processes with dead ranks (a death takes all of a process's
    ranks: one line each), the first ``ATTENTION_SHOWN``, and how many more there are."""
    dead = [{**w, "host": h["host"]} for h in group["hosts"] for w in h["workers"] if w["dead"]]
    return dead[:ATTENTION_SHOWN], max(0, len(dead) - ATTENTION_SHOWN)


def _attention_rows(group: Mapping[str, Any]) -> tuple[list[dict], int]:
    """The live ranks to list first (dead ones are on their process's line), the first
    ``ATTENTION_SHOWN``, and how many more there are."""
    rows = [group["ranks"][a["index"]] for a in group["attention"] if "dead" not in a["reasons"]]
    return rows[:ATTENTION_SHOWN], max(0, len(rows) - ATTENTION_SHOWN)


def _page_template() -> jinja2.Template:
    env = _environment()
    env.globals.update(dead_processes=_dead_processes, attention_rows=_attention_rows)
    return env.from_string(_TEMPLATE)


_PAGE = _page_template()


def render_html(
    groups: list[dict],
    *,
    scheduler: str,
    updated: str,
    status_url: str,
    json_url: str,
    info_url: str = "/info/",
    events: list[dict] | None = None,
    refresh_s: int = 2,
) -> str:
    """The whole page, from a template that escapes every value it is given."""
    return _PAGE.render(
        groups=groups,
        ranks=sum(g["world_size"] for g in groups),
        dead=sum(not r["alive"] for g in groups for r in g["ranks"]),
        stragglers=sum(c["straggler"] for g in groups for c in g["pending"]),
        events=[_event_row(e) for e in events or ()],
        scheduler=scheduler,
        updated=updated,
        status_url=status_url,
        json_url=json_url,
        info_url=info_url,
        refresh_s=int(refresh_s),
        split_phases=[phase for phase in PHASES if phase != "run"],
        processes_shown=PROCESSES_SHOWN,
        rank_window=RANK_WINDOW,
        style=markupsafe.Markup(_STYLE),
    )


def _event_row(event: Mapping[str, Any]) -> dict[str, Any]:
    """Every field the template reads, present (``None`` or empty where an event has none)."""
    fields = ("group", "method", "rank", "worker", "type", "message", "traceback")
    return {"time": event.get("time"), "kind": event.get("kind", "?")} | {
        f: event.get(f) for f in fields
    }
