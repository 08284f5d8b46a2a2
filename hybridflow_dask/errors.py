"""The library's own failures, as one tree, raised alike by every backend.

::

    HybridFlowError
    ├── WorkerLostError (RuntimeError)          a rank's process died; recover() rebuilds it
    │   └── WorkerUnreachableError (ConnectionError)
    │                                           its host stopped answering (a cut link): it
    │                                           may be alive, but the driver gave up on it
    ├── SchedulerLostError (ConnectionError)    the scheduler went away and did not come back
    ├── SchedulerUnreachableError (ConnectionError)
    │                                           no scheduler answered at the address given
    ├── CallTimeoutError (TimeoutError)         hybridflow.call-timeout passed; says which
    │                                           ranks' calls were withdrawn (will not run)
    │                                           and which were running (may still finish)
    ├── CallWithdrawnError (RuntimeError)       a call the driver reported failed (its limit
    │                                           passed, its input failed, its link broke):
    │                                           the worker refused to run it
    └── ProtocolError (ValueError)              a peer broke the wire's framing or limits
        └── LaneRefused (ConnectionError)       a lane peer did not prove its token

The standard-library second bases are the ones code already catches (``except
TimeoutError`` keeps working for a call timeout). An exception raised by a worker method
keeps its own type and gains a note naming the group, method and rank: it is the user's
error, not the library's. This module imports nothing, so every backend and the core
can raise these classes without depending on each other.
"""

from __future__ import annotations

__all__ = [
    "CallTimeoutError",
    "CallWithdrawnError",
    "HybridFlowError",
    "LaneRefused",
    "ProtocolError",
    "SchedulerLostError",
    "SchedulerUnreachableError",
    "WorkerLostError",
    "WorkerUnreachableError",
]


class HybridFlowError(Exception):
    """Root of every failure of the library itself: ``except HybridFlowError`` catches a
    lost or unreachable worker or scheduler, a call timeout and a protocol error."""


class WorkerLostError(HybridFlowError, RuntimeError):
    """The process hosting a rank died; the group's pending and later calls fail with this.

    Backends raise it (never a hang, a cancellation or their own error type) and name the
    group and rank in the message, so the caller knows to ``WorkerGroup.recover()``.
    """


class WorkerUnreachableError(WorkerLostError, ConnectionError):
    """A rank's worker stopped answering within ``hybridflow.unreachable-timeout`` (its
    host's link is down, or the host is gone). Handled as a lost worker (``recover()``
    replaces it); calls reported failed with it never run when the link comes back."""


class SchedulerLostError(HybridFlowError, ConnectionError):
    """The scheduler a backend worked with went away and did not come back within
    ``timeout`` seconds (``hybridflow.scheduler-timeout``).

    Its workers leave with it, and the groups' instances and results with them: a job
    resumes by starting again (a new backend, new groups) from its last checkpoint.
    """

    def __init__(self, address: str, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        super().__init__(
            f"the scheduler at {address} is gone (no connection for {timeout:g} s): the "
            "worker groups on its cluster are lost with it (their instances and results "
            "lived in workers that leave with their scheduler). Restart the job on a new "
            "cluster from its last checkpoint; wait longer for a scheduler that restarts "
            "with hybridflow.scheduler-timeout"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.address, self.timeout))


class SchedulerUnreachableError(HybridFlowError, ConnectionError):
    """No scheduler answered at ``address`` within ``timeout`` seconds, or TLS failed.

    ``reason`` is the cause in words; a TLS one starts with ``TLS``. ``message`` replaces
    the default text (a backend whose cluster is not Dask's says what to start instead).
    """

    def __init__(self, address: str, timeout: float, why: str, message: str = "") -> None:
        self.address = address
        self.timeout = timeout
        self.reason = why
        self._message = message
        if message:
            super().__init__(message)
            return
        if why.startswith("TLS"):  # it says what to check; the generic advice would mislead
            super().__init__(f"cannot connect to the Dask scheduler at {address} ({why})")
            return
        super().__init__(
            f"no Dask scheduler answered at {address} within {timeout:g} s ({why}): check that "
            "`dask scheduler` runs there and that host and port are right "
            "and reachable from this machine (wait longer with hybridflow.connect-timeout)"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.address, self.timeout, self.reason, self._message))


class CallTimeoutError(HybridFlowError, TimeoutError):
    """A call passed ``hybridflow.call-timeout``. Calls of it that had not started are
    withdrawn on their workers (they never run); running ones may still finish there.

    ``queued`` and ``running`` are the ranks in each state, as far as the driver could
    tell (a stopped worker cannot say: its ranks are in ``unknown``, and any of its calls
    that had not started will not start).
    """

    def __init__(
        self,
        message: str,
        *,
        queued: tuple[int, ...] = (),
        running: tuple[int, ...] = (),
        unknown: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.queued, self.running, self.unknown = queued, running, unknown

    def __reduce__(self) -> tuple:
        state = {"queued": self.queued, "running": self.running, "unknown": self.unknown}
        return (_rebuild_timeout, (str(self), state))


class CallWithdrawnError(HybridFlowError, RuntimeError):
    """The worker refused to run a call its driver had reported failed (or was about to):
    its limit passed before its turn came, or the driver withdrew it."""


class ProtocolError(HybridFlowError, ValueError):
    """A message that breaks the wire's framing or its limits: its sender is dropped."""


class LaneRefused(ProtocolError, ConnectionError):
    """The other end of a lane did not prove its token (or broke off while opening)."""


def _rebuild_timeout(message: str, state: dict) -> CallTimeoutError:
    return CallTimeoutError(message, **state)
