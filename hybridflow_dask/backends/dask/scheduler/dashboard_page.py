"""The worker-group page's model and HTML: call statistics per (group, method), rendered.

Pure Python, no Dask import: the scheduler plugin in ``dashboard`` feeds it call
outcomes and group membership, and this module turns them into the JSON and HTML the
page serves, so both can be tested without a cluster. Whoever can publish a dataset on the
scheduler chooses the names shown, so the HTML comes from a Jinja2 template with
autoescaping on (as Dask's own pages are made): no value reaches the page unescaped.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2
import markupsafe

from ...base import InstanceRef

__all__ = [
    "WINDOW",
    "CallStats",
    "MethodStats",
    "group_view",
    "is_internal",
    "label_of",
    "locate",
    "method_name",
    "percentile",
    "render_html",
]

#: How many recent durations each (group, method) keeps for its percentiles.
WINDOW = 1000
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


def percentile(ordered: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (``None`` when empty)."""
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered) - 1e-9) - 1))
    return ordered[index]


@dataclass
class MethodStats:
    """Outcomes of one (group, method): every finished call counts, errors included."""

    calls: int = 0
    errors: int = 0
    running: int = 0
    durations: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.durations)
        p50, p90 = percentile(ordered, 0.5), percentile(ordered, 0.9)
        return {
            "calls": self.calls,
            "errors": self.errors,
            "running": self.running,
            "p50_ms": None if p50 is None else round(p50 * 1e3, 3),
            "p90_ms": None if p90 is None else round(p90 * 1e3, 3),
        }


class CallStats:
    """Counters per group, then per method name; internal tasks kept in their own table."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[dict[str, MethodStats], dict[str, MethodStats]]] = {}

    def get(self, group: str, name: str, internal: bool) -> MethodStats:
        methods, inner = self.groups.setdefault(group, ({}, {}))
        table = inner if internal else methods
        stats = table.get(name)
        if stats is None:
            stats = table[name] = MethodStats()
        return stats

    def finished(
        self, group: str, name: str, internal: bool, duration: float | None, error: bool
    ) -> None:
        stats = self.get(group, name, internal)
        stats.calls += 1
        stats.errors += bool(error)
        if duration is not None:
            stats.durations.append(duration)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the groups ``keep`` rejects (shut down), so a long-lived scheduler stays small."""
        for group in [g for g in self.groups if not keep(g)]:
            del self.groups[group]

    def tables(self, group: str) -> tuple[dict[str, dict], dict[str, dict]]:
        methods, inner = self.groups.get(group, ({}, {}))
        return (
            {name: s.summary() for name, s in sorted(methods.items())},
            {name: s.summary() for name, s in sorted(inner.items())},
        )


def group_view(
    name: str, refs: Iterable[InstanceRef], live: Mapping[str, str], stats: CallStats
) -> dict[str, Any]:
    """One group as the page shows it; ``live`` maps worker addresses now up to their names."""
    refs = sorted(refs, key=_rank_order)
    methods, internal = stats.tables(name)
    return {
        "name": name,
        "class": next((r.cls_name for r in refs if r.cls_name), ""),
        "world_size": len(refs),
        "ranks": [
            {
                "rank": r.rank,
                "address": r.slot.address,
                "host": r.slot.host,
                "worker_name": live.get(r.slot.address) or r.slot.name,
                "device": r.slot.device,
                "alive": r.slot.address in live,
            }
            for r in refs
        ],
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
.group { background: #fff; border-radius: 6px; box-shadow: 0 1px 3px rgba(0,0,0,.12);
         margin-bottom: 16px; padding: 12px 16px 16px; }
.group h2 { font-size: 16px; margin: 0 0 10px; font-family: ui-monospace, Menlo, monospace; }
.badge { display: inline-block; border-radius: 10px; padding: 1px 9px; font-size: 12px;
         font-weight: 500; margin-left: 8px; background: #e6e9ee; color: #3e4c59;
         font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
.cols { display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }
.cols > div { flex: 1 1 420px; }
h3 { font-size: 12px; text-transform: uppercase; letter-spacing: .05em; color: #7b8794;
     margin: 4px 0 6px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid #e4e7eb; }
th { font-weight: 600; color: #52606d; background: #f9fafb; font-size: 12px; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.mono { font-family: ui-monospace, Menlo, monospace; font-size: 13px; }
.alive { color: #1b873f; font-weight: 600; }
.dead { color: #c62828; font-weight: 600; }
.err { color: #c62828; font-weight: 600; }
.muted { color: #9aa5b1; }
details { margin-top: 8px; color: #52606d; }
.empty { color: #7b8794; padding: 32px; text-align: center; }
"""


#: Every ``{{ value }}`` is escaped (autoescape), so a group, rank, host or method name
#: from a published dataset or a worker's event can never become markup on the page.
_TEMPLATE = """\
{% macro ms(value) %}
{%- if value is none %}<span class="muted">-</span>{% else %}{{ value|ms }}{% endif -%}
{% endmacro %}
{% macro method_table(methods) %}
{% if methods %}
<table><tr><th>method</th><th class="num">calls</th><th class="num">errors</th>
<th class="num">running</th><th class="num">p50 ms</th><th class="num">p90 ms</th></tr>
{% for name, s in methods.items() %}
<tr><td class="mono">{{ name }}</td><td class="num">{{ s["calls"] }}</td>
<td class="num">
{%- if s["errors"] %}<span class="err">{{ s["errors"] }}</span>{% else %}0{% endif -%}
</td><td class="num">{{ s["running"] }}</td>
<td class="num">{{ ms(s["p50_ms"]) }}</td><td class="num">{{ ms(s["p90_ms"]) }}</td></tr>
{% endfor %}
</table>
{% else %}
<p class="muted">no calls yet</p>
{% endif %}
{% endmacro %}
<!DOCTYPE html><html><head><meta charset='utf-8'>
<meta http-equiv="refresh" content="{{ refresh_s }}">
<title>hybridflow worker groups</title>
<style>{{ style }}</style></head><body><header>
<h1><span>hybridflow</span> worker groups</h1>
<a href="{{ status_url }}">Dask dashboard</a>
<a href="{{ json_url }}">JSON</a>
<span class="meta">{{ groups|length }} groups &middot; {{ ranks }} ranks
{%- if dead %} &middot; <span class="err">{{ dead }} dead</span>{% endif %} &middot;
scheduler {{ scheduler }} &middot; {{ updated }}</span>
</header><main>
{% for group in groups %}
{% set dead_ranks = group["ranks"]|rejectattr("alive")|list|length %}
{% set badges = [group["class"] or "?", "world size %s"|format(group["world_size"])] %}
<section class="group"><h2>{{ group["name"] -}}
{% for text in badges %}<span class="badge">{{ text }}</span>{% endfor %}
{%- if dead_ranks %}<span class="badge dead">{{ dead_ranks }} dead</span>{% endif %}</h2>
<div class="cols"><div><h3>Ranks</h3>
<table><tr><th class="num">rank</th><th>worker address</th><th>host</th>
<th>worker name</th><th>device</th><th>state</th></tr>
{% for r in group["ranks"] %}
{% set state = "alive" if r["alive"] else "dead" %}
<tr><td class="num">{{ r["rank"] }}</td><td class="mono">{{ r["address"] }}</td>
<td>{{ r["host"] }}</td><td>{{ r["worker_name"] }}</td><td>{{ r["device"] }}</td>
<td><span class="{{ state }}">{{ state }}</span></td></tr>
{% endfor %}
</table></div><div><h3>Methods (per rank call)</h3>
{{ method_table(group["methods"]) }}
{% if group["internal"] %}
<details><summary>routing and bookkeeping tasks</summary>
{{ method_table(group["internal"]) }}
</details>
{% endif %}
</div></div></section>
{% else %}
<p class="empty">No worker groups on this cluster right now.</p>
{% endfor %}
</main></body></html>
"""


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
    )
    env.filters["ms"] = lambda value: f"{value:,.1f}"
    return env


_PAGE = _environment().from_string(_TEMPLATE)


def render_html(
    groups: list[dict],
    *,
    scheduler: str,
    updated: str,
    status_url: str,
    json_url: str,
    refresh_s: int = 2,
) -> str:
    """The whole page, from a template that escapes every value it is given."""
    return _PAGE.render(
        groups=groups,
        ranks=sum(g["world_size"] for g in groups),
        dead=sum(not r["alive"] for g in groups for r in g["ranks"]),
        scheduler=scheduler,
        updated=updated,
        status_url=status_url,
        json_url=json_url,
        refresh_s=int(refresh_s),
        style=markupsafe.Markup(_STYLE),
    )
