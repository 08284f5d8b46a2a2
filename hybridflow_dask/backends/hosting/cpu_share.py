"""Light ranks keep to the CPU of the thread that hands them their calls.

Several ranks of one group in one process (light ranks: a testing and simulation aid)
run their calls one at a time, each in its own thread, so a group call to k of them is k
hand-offs from thread to thread. Two things make a hand-off dear, and both are avoided:

- **another CPU**: waking a thread on the other CPU costs, on a virtual machine, several
  times a wake-up on the same one. Only one light rank runs at a time anyway, so their
  threads keep to the CPU the calls arrive on: the delivering thread says where that is,
  and they follow when the kernel moves it (one system call per thread then);
- **preemption on wake-up**: a woken thread on the same CPU preempts the one that woke
  it, finds the GIL still held and sleeps again (two context switches for nothing, per
  rank). Light ranks' threads run under ``SCHED_BATCH``, the kernel's policy for threads
  that wait for the running one to block instead.

On a 2-core VM this serves 8 light ranks in ~100 µs instead of ~200-300 (in-process,
no-op calls). A thread a light rank starts inherits both (the kernel's rule): another
reason light ranks are for tests and simulations, never for real training, where a
process hosts one rank of a group and nothing here applies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable

__all__ = ["CpuShare", "current_cpu"]


def _cpu_reader() -> Callable[[], int] | None:
    """The C library's ``sched_getcpu`` (Linux), or ``None`` where there is none."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        reader = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (AttributeError, OSError):
        return None
    reader.restype = ctypes.c_int
    reader.argtypes = []
    return reader


_read_cpu = _cpu_reader()


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now, or ``None`` where that cannot be read."""
    if _read_cpu is None:
        return None
    cpu = _read_cpu()
    return cpu if cpu >= 0 else None


class CpuShare:
    """The threads of one process's light ranks, kept on one CPU (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[int] = set()  # native thread ids
        self._cpu: int | None = None

    def join(self, thread: int) -> None:
        """``thread`` (a native id) keeps to the shared CPU from now on."""
        with self._lock:
            self._threads.add(thread)
            if self._cpu is not None:
                _pin(thread, {self._cpu})
        _no_wakeup_preemption(thread)

    def leave(self, thread: int) -> None:
        """``thread`` is ending (its rank left the process): no longer moved."""
        with self._lock:
            self._threads.discard(thread)

    def follow(self) -> None:
        """Called by the thread delivering a call: the ranks' threads move to its CPU."""
        cpu = current_cpu()
        if cpu is None or cpu == self._cpu:
            return
        with self._lock:
            self._cpu = cpu
            for thread in list(self._threads):
                if not _pin(thread, {cpu}):
                    self._threads.discard(thread)

    def __len__(self) -> int:
        return len(self._threads)


def _pin(thread: int, cpus: set[int]) -> bool:
    """Set a thread's CPU mask; ``False`` when the thread is gone."""
    try:
        os.sched_setaffinity(thread, cpus)
    except ProcessLookupError:
        return False
    except OSError:  # not allowed (a container's mask): the thread runs where it did
        pass
    return True


def _no_wakeup_preemption(thread: int) -> None:
    """Linux's ``SCHED_BATCH`` for ``thread``: woken, it waits for the running thread to
    block instead of preempting it (which, while that thread holds the GIL, only costs
    two context switches: it wakes, finds the GIL taken and sleeps again)."""
    with contextlib.suppress(OSError):  # gone, or not allowed: the default policy stays
        os.sched_setscheduler(thread, os.SCHED_BATCH, os.sched_param(0))
