"""A call without arguments, said by its Ray task's name (both ends of the Ray backend).

Ray charges a call for each argument, whatever it is (here ~0.1-0.2 ms of CPU per call
on the driver and on the actor, in bare actors), while a task's name travels with it
anyway and the actor reads it cheaply. A slot actor's call must say which of its
instances it is for, from which driver, and its number there; a call that passes the
method nothing (``init_model()``, a no-op) says those in its task's name instead of in
an argument. The name reads as what the call is in Ray's own dashboard and state API:
``"<instance key> <method> <number> <driver>"``.
"""

from __future__ import annotations

__all__ = ["call_name", "read_call_name"]


def call_name(key: str, driver: str, seq: int, method: str) -> str:
    """The task name of call ``seq`` of ``method`` on instance ``key`` from ``driver``."""
    return f"{key} {method} {seq} {driver}"


def read_call_name(name: str) -> tuple[str, str, int, str]:
    """``(key, driver, seq, method)`` from ``call_name``'s name (a key may hold spaces;
    a method name, a number and a driver id never do)."""
    key, method, seq, driver = name.rsplit(" ", 3)
    return key, driver, int(seq), method
