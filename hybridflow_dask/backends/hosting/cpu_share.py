"""Light ranks keep to the CPU of the thread that hands them their calls.

Several ranks of one group in one process (light ranks: a testing and simulation aid)
run their calls one at a time, each in its own thread, so a group call to k of them is k
hand-offs from thread to thread. A hand-off between threads on two CPUs wakes the other
CPU, which on a virtual machine costs several times a hand-off on one CPU (measured on a
2-core VM: 8 light ranks served in ~300 µs across CPUs, ~160 µs on one). Since only one
light rank runs at a time anyway, nothing is lost by keeping their threads on the CPU the
calls arrive on; each call's delivering thread says where that is, and the threads follow
it when the kernel moves it (rarely: one system call per thread then).

A thread of one of those ranks starts its own threads with its CPU mask (the kernel's
rule), so a light rank's torch or data-loader threads share that CPU too: another reason
light ranks are for tests and simulations, never for real training, where a process hosts
one rank of a group and nothing here applies.
"""

from __future__ import annotations

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

    @property
    def cpu(self) -> int | None:
        """The CPU the threads keep to now (``None``: none chosen yet)."""
        return self._cpu

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
