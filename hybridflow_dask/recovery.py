"""Surviving a lost worker: run a step, and when a worker dies under it, recover and retry.

``Recovery`` is the loop every fault-tolerant driver writes by hand, in one place::

    recovery = hf.Recovery([trainer], restore)
    for step in range(1, steps + 1):
        metrics = recovery.run(lambda: train_step(step), step=step)

``run`` calls ``step_fn()``. When it fails because a worker died, ``run`` calls
``recover()`` on every given group (``WorkerGroup.recover``: the dead ranks are built
again from ``__init__`` on the process the nanny restarts), then ``restore(rebuilt)`` to
bring the ranks back to a known state (rejoin collectives, load the last checkpoint),
then ``step_fn()`` again, at most ``retries`` times per ``run``. Each recovery is kept in
``records``. Anything else ``step_fn`` raises is re-raised as it is.

It uses nothing but ``WorkerGroup.recover``, so it works on the cluster a ``DaskBackend``
starts and on one it attached to by address; the processes there must be restarted by
a nanny (``dask worker`` runs one by default).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from .backends.base import WorkerLostError
from .worker_group import WorkerGroup

__all__ = ["Recovery", "RecoveryRecord"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How often ``run`` looks for dead ranks while it waits out the grace period.
POLL_S = 0.05


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery: the step it happened in, what was rebuilt, and how long it took.

    ``ranks`` maps each group's name (``name_prefix``) to the ranks its ``recover()``
    rebuilt (an empty list for a group that lost none). ``seconds`` runs from the failure
    to the end of ``restore``: the time lost, not counting the retried step itself.
    ``error`` is the failure that started it, as ``"Type: message"``.
    """

    step: Any
    ranks: dict[str, list[int]]
    seconds: float
    error: str

    def to_dict(self) -> dict[str, Any]:
        """``{"step", "ranks", "seconds", "error"}``, ready for ``json.dumps``."""
        return {
            "step": self.step,
            "ranks": {name: list(ranks) for name, ranks in self.ranks.items()},
            "seconds": self.seconds,
            "error": self.error,
        }


class Recovery:
    """Retry a step after a lost worker: ``recover()`` every group, ``restore``, run again.

    ``groups``: the groups to recover, each the group that created its instances (not a
    ``spawn()`` view: pass the fused group itself). Groups that share a ``ResourcePool``
    live in the same processes, so a lost worker loses a rank of each: pass all of them.

    ``restore(rebuilt)``: called after every group recovered, with
    ``{group name: rebuilt ranks}`` (every given group, in the order given). It should
    put *all* ranks back in step: a rebuilt rank starts from ``__init__`` while the
    survivors kept their state and may have half-finished the failed step. Typically:
    set up collectives again on every rank, then load the last checkpoint on every rank.

    ``retries``: how many recoveries one ``run`` may do before it re-raises (0: none).

    ``grace_s``: a step can fail with a survivor's error rather than a
    ``WorkerLostError``: a collective (gloo, NCCL) breaks when a peer dies, sometimes
    before the driver hears of the death. So for any other exception ``run`` waits up to
    ``grace_s`` for a rank of the groups to be reported dead; if none is, the exception is
    re-raised untouched (after that wait). ``grace_s=0`` treats only a
    ``WorkerLostError`` (or an exception caused by one) as a lost worker.
    """

    def __init__(
        self,
        groups: WorkerGroup | Iterable[WorkerGroup],
        restore: Callable[[dict[str, list[int]]], Any],
        *,
        retries: int = 1,
        grace_s: float = 2.0,
    ) -> None:
        groups = [groups] if isinstance(groups, WorkerGroup) else list(groups)
        if not groups:
            raise ValueError("Recovery needs at least one WorkerGroup to recover")
        for group in groups:
            if not isinstance(group, WorkerGroup):
                raise TypeError(f"Recovery recovers WorkerGroups, got {type(group).__name__}")
            if not group._owner or group._pool is None:
                raise ValueError(
                    f"{group!r} is a spawned or attached view and cannot recover its ranks; "
                    "pass the group that created them (for roles, the fused group)"
                )
        if not callable(restore):
            raise TypeError(f"restore must be callable, got {type(restore).__name__}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a whole number >= 0, got {retries!r}")
        if not isinstance(grace_s, (int, float)) or grace_s < 0:
            raise ValueError(f"grace_s must be a number of seconds >= 0, got {grace_s!r}")
        self.groups: list[WorkerGroup] = groups
        self.restore = restore
        self.retries = retries
        self.grace_s = float(grace_s)
        #: Every recovery so far, oldest first.
        self.records: list[RecoveryRecord] = []
        self._runs = 0

    def run(self, step_fn: Callable[[], T], step: Any = None) -> T:
        """``step_fn()``'s result; after a lost worker, recover, restore and call it again.

        ``step`` labels the records (default: how many times ``run`` was called,
        counting this one). After ``retries`` recoveries in this call, the next failure
        is re-raised. An exception from ``recover()`` or ``restore`` propagates, with
        the step's failure as its context.
        """
        self._runs += 1
        label = self._runs if step is None else step
        attempt = 0
        while True:
            try:
                return step_fn()
            except Exception as exc:
                failed_at = time.monotonic()
                if attempt >= self.retries or not self._lost_a_worker(exc):
                    raise
                attempt += 1
                rebuilt = {group.name_prefix: group.recover() for group in self.groups}
                if not any(rebuilt.values()):
                    if hasattr(exc, "add_note"):  # Python 3.11+
                        exc.add_note(
                            f"hybridflow_dask.Recovery: no rank of the groups {list(rebuilt)} "
                            "had died, so nothing was recovered; pass every group on the lost "
                            "worker's pool"
                        )
                    raise
                self._restore(label, rebuilt, exc, failed_at)

    def dead_ranks(self) -> dict[str, list[int]]:
        """``{group name: ranks whose process is dead}`` for the groups that have any."""
        dead = {}
        for group in self.groups:
            backend = group.backend
            ranks = [ref.rank for ref in group.workers if not backend.alive(ref.slot)]
            if ranks:
                dead[group.name_prefix] = ranks
        return dead

    def _lost_a_worker(self, exc: BaseException) -> bool:
        if _caused_by_lost_worker(exc):
            return True
        deadline = time.monotonic() + self.grace_s
        while not self.dead_ranks():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _restore(
        self, step: Any, rebuilt: dict[str, list[int]], exc: Exception, failed_at: float
    ) -> None:
        logger.warning(
            "step %s: worker lost (%s); rebuilt %s, restoring", step, _describe(exc), rebuilt
        )
        self.restore(rebuilt)
        record = RecoveryRecord(step, rebuilt, time.monotonic() - failed_at, _describe(exc))
        self.records.append(record)
        logger.warning("step %s: recovered in %.2fs; running it again", step, record.seconds)


def _caused_by_lost_worker(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``WorkerLostError`` or was raised while handling one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, WorkerLostError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _describe(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
