"""Whose environment variables are in ``os.environ`` while an instance's code runs.

There is one ``os.environ`` per process, and colocated instances (the ranks of several
groups on one pool) share a process: each must see its own rank's variables and none of
another instance's extra ones.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["EnvGate", "EnvSwitch"]


class EnvSwitch:
    """Puts one instance's environment in ``os.environ`` at a time.

    Switching to an instance first takes back the variables the previous one set and this
    one does not (restoring what the process had), so instances sharing a process never
    see each other's extra variables. A variable both set to the same value is left as it
    is: light ranks of one group differ in their rank variables only, and setting a
    variable (``putenv``) is most of what a switch costs. What a switch between two
    environments changes is worked out once and kept (instances take turns: a few pairs).
    """

    #: The most switch plans kept (cleared past it: environments come and go).
    MAX_PLANS = 256

    def __init__(self) -> None:
        self._original: dict[str, str | None] = {}
        self._key: frozenset = frozenset()  # what this switch put in place
        self._plans: dict[tuple[frozenset, frozenset], _Plan] = {}

    @contextlib.contextmanager
    def use(self, env: dict[str, str]) -> Iterator[None]:
        """``env`` while the block runs, the process's own variables again afterwards."""
        self.switch(env)
        try:
            yield
        finally:
            self.switch({})

    def switch(self, env: dict[str, str], key: frozenset | None = None) -> None:
        """Make ``env`` the extra variables in place, taking back the previous ones
        (``key``: ``frozenset(env.items())``, if the caller has it)."""
        key = frozenset(env.items()) if key is None else key
        plans = self._plans
        plan = plans.get((self._key, key))
        if plan is None:
            if len(plans) >= self.MAX_PLANS:
                plans.clear()
            plan = plans[self._key, key] = _Plan(dict(self._key), env)
        original, environ = self._original, os.environ
        for name in plan.restore:
            value = original.pop(name)
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        for name, value in plan.new:
            original[name] = environ.get(name)
            environ[name] = value
        for name, value in plan.changed:
            environ[name] = value
        self._key = key


class _Plan:
    """What switching from the variables ``before`` to ``after`` does."""

    __slots__ = ("changed", "new", "restore")

    def __init__(self, before: dict[str, str], after: dict[str, str]) -> None:
        #: Set before and not after: the process's own value comes back.
        self.restore = [name for name in before if name not in after]
        #: Not set before: the process's own value is remembered first.
        self.new = [(name, value) for name, value in after.items() if name not in before]
        #: Set before to another value.
        self.changed = [
            (name, value)
            for name, value in after.items()
            if name in before and before[name] != value
        ]


class EnvGate:
    """Whose variables are in ``os.environ``; callers with equal variables share it.

    One per process. Calls of instances whose environments are equal run at the same time
    without any switching; a call that needs other variables waits until the running ones
    finish, then switches. So no call ever sees a colocated instance's variables, and the
    common case (one pool, one rank environment) costs a lock.

    Waiters are admitted in arrival order, each woken once, when its turn comes (with
    every waiter behind it that wants the same variables): many instances taking turns
    (light ranks, each with its own ``RANK``) cost one wake-up per call, not one per
    waiting thread, and a new caller never overtakes the queue.

    ``enter``/``leave`` rather than a context manager: they run around every call, where
    a generator-based ``with`` costs more than the rest of the gate together.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._switch = EnvSwitch()
        self._current: frozenset | None = None
        self._active = 0
        self._waiting: collections.deque[tuple[frozenset, dict[str, str], threading.Lock]] = (
            collections.deque()
        )

    def enter(
        self, key: frozenset, env: dict[str, str], turn: threading.Lock | None = None
    ) -> None:
        """Put ``env`` (``key``: ``frozenset(env.items())``, made once by its owner) in
        place, waiting for the calls under other variables to leave; ``leave`` after.

        ``turn``: a lock the caller holds and keeps for its waits (one thread's, reused
        from call to call: cheaper than a new event each time); ``None``: a new one.
        """
        with self._lock:
            if not self._waiting and (self._active == 0 or self._current == key):
                self._enter(key, env)
                return
            if turn is None:
                turn = threading.Lock()
                turn.acquire()
            self._waiting.append((key, env, turn))
        turn.acquire()  # released when admitted (the variables already switched)

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._waiting:
                self._admit()

    def _enter(self, key: frozenset, env: dict[str, str]) -> None:
        if self._current != key:
            self._switch.switch(env, key)
            self._current = key
        self._active += 1

    def _admit(self) -> None:
        """Let the first waiter in, and every other waiter that wants its variables."""
        key, env, turn = self._waiting.popleft()
        self._enter(key, env)
        admitted = [turn]
        rest: collections.deque = collections.deque()
        for waiter in self._waiting:
            if waiter[0] == key:
                self._active += 1
                admitted.append(waiter[2])
            else:
                rest.append(waiter)
        self._waiting = rest
        for waiter_turn in admitted:
            waiter_turn.release()
