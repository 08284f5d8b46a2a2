"""What a driver does when ``hybridflow.call-timeout`` passes: withdraw, then say what ran.

The calls it waited for are withdrawn on their workers at once: one that had not started
never will (the worker also refuses, by itself, to start a call after its deadline, which
covers a worker too stopped to hear the withdrawal), one that had started may still
finish. The error names the ranks in each state, as far as the workers could answer
within ``ANSWER_WAIT_S``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any

from ....errors import CallTimeoutError
from ...base import InstanceRef

__all__ = ["ANSWER_WAIT_S", "timed_out"]

#: How long the driver waits for workers to say whether a timed-out call had started.
ANSWER_WAIT_S = 0.5


def timed_out(
    pending: Sequence[Any],
    limit: float | None,
    issued: Callable[[Any], tuple[InstanceRef, int] | None],
    withdraw: Callable[[InstanceRef, int], Any],
) -> CallTimeoutError:
    """The error for ``pending`` calls still unfinished at their limit (``limit``: the
    setting now, for the message), once each was withdrawn (``withdraw(ref, seq)``
    returns a future of "it will not run")."""
    asked: list[tuple[InstanceRef, Any]] = []
    for future in pending:
        call = issued(future)
        if call is not None:
            asked.append((call[0], withdraw(*call)))
    queued: list[InstanceRef] = []
    running: list[InstanceRef] = []
    unknown: list[InstanceRef] = []
    until = time.monotonic() + ANSWER_WAIT_S
    for ref, answer in asked:
        try:
            prevented = answer.result(max(until - time.monotonic(), 0.0))
        except (concurrent.futures.TimeoutError, TimeoutError, Exception):
            unknown.append(ref)
            continue
        (queued if prevented else running).append(ref)
    what = _label(pending[0]) if pending else "the call"
    parts = []
    if queued:
        parts.append(f"{what} on {_ranks(queued)} had not started: withdrawn, it will not run")
    if running:
        parts.append(f"{what} on {_ranks(running)} was running: it may still finish there")
    if unknown:
        parts.append(
            f"{what} on {_ranks(unknown)}: the worker did not answer (stopped, hung or cut "
            "off?); if the call had not started there, it will not start"
        )
    if not parts:
        parts.append(f"{len(pending)} call(s) unfinished")
    setting = "hybridflow.call-timeout" + ("" if limit is None else f"={limit:g}s")
    return CallTimeoutError(
        f"{what} passed {setting}: " + "; ".join(parts),
        queued=tuple(r.rank for r in queued),
        running=tuple(r.rank for r in running),
        unknown=tuple(r.rank for r in unknown),
    )


def _ranks(refs: list[InstanceRef]) -> str:
    ranks = sorted({r.rank for r in refs})
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(map(str, ranks))}"


def _label(future: Any) -> str:
    return str(getattr(future, "key", "the call")).rsplit("-", 1)[0]
