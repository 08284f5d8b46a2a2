"""The cluster side of the Ray backend: one ``SlotActor`` per slot.

A ``SlotActor`` is a Ray actor living in one placement-group bundle. It hosts every
instance placed on its slot (the ranks of colocated groups) in the backend-neutral
``hosting.Instances``: an actor each (its calls taken in the driver's sequence order, an
event loop for ``async def`` methods, an environment switched in while it runs), and the
one call flow every backend's calls go through. This module only translates Ray's actor
calls into that flow. Ray runs each actor call on a thread of its concurrency group:

- the default group has **one** thread, and the instances run on it: ``__init__`` and
  every call of an instance run right there (``Actor.drive``), in the order Ray
  delivers them, which is the driver's (Ray keeps a caller's order on a group of one
  thread). No hand-off to another thread: it was half of what a call cost the host (a
  plain Ray actor ran a burst of no-op calls at 2,200-2,400/s, one handing each call to a
  thread of its own at ~1,000/s). Colocated instances lose nothing by sharing it: their
  environments differ (``WG_PREFIX`` at least), so the ``EnvGate`` made them take turns
  on threads of their own too;
- ``calls``: instances whose class has ``async def`` methods, each on a thread of its
  own (their coroutine calls overlap, on a loop of their own): the driver sends their
  ``create``, ``call`` and ``destroy`` to this group (``THREADED``), whose thread waits
  for the instance's;
- ``control`` (the driver's short questions and ``skip``, which must get through while
  calls wait for the turn it gives up), ``fns`` (routing functions) and ``watch`` (the
  call the driver uses to see this process die).

So a long method never holds up a routing function or the driver's questions.

Three things are done here rather than left to Ray, each for a reason:

- **inputs** arrive as ``Input`` references and are fetched here (``ray.get`` in the
  call's thread), not resolved by Ray before the task starts: a call whose input failed
  must still take its turn (and give it up), or every later call on its instance would
  wait for it forever;
- **order** comes from the driver's sequence numbers, not from Ray's actor queue: Ray
  keeps a caller's order only on a group of one thread, and the ``calls`` group has many
  (a call that arrives early waits there for its turn, holding its thread);
- **results** of an instance with a thread of its own are copied in that thread as the
  method returns (the flow's ``"later"`` results): Ray stores the return value after
  the call's thread gets it, by when the instance's next call may be changing it. On
  the default thread Ray stores it as the task ends, in that thread, before the
  instance's next call can start: nothing to copy (``"now"``).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Literal

import ray

from ...base import InstanceRef
from ...hosting import Actor, Call, Instances, PickleCopy, Resolved, find_free_port
from ..call_names import read_call_name
from ..futures import Input, has_inputs, is_lost, translate, writable

__all__ = ["CALL_THREADS", "CONCURRENCY_GROUPS", "THREADED", "SlotActor"]

#: Threads per concurrency group of a slot actor (Ray makes them as the actor starts).
#: ``calls`` (the calls of instances with threads of their own) bounds the calls a host
#: has in flight at once for them (the rest wait in Ray's queue). The default group,
#: where every other instance runs, has one thread (``max_concurrency=1``, given where
#: the driver makes the actor).
CALL_THREADS = 128
CONCURRENCY_GROUPS = {"calls": CALL_THREADS, "control": 4, "fns": 4, "watch": 2}
#: The group the driver sends an instance's calls to when it has a thread of its own.
THREADED = "calls"
#: How long a call waits for its instance to be created (its create may still be
#: fetching large arguments when the call arrives).
BIRTH_WAIT_S = 60.0
#: Destroyed instance keys remembered, so a late call fails at once instead of waiting.
GONE_KEPT = 10_000


class SlotActor:
    """Every instance on one slot; made a Ray actor by the backend (``ray.remote``)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.instances = Instances(PickleCopy())
        self._lock = threading.Lock()
        self._gone: dict[str, None] = {}
        self._born: dict[str, threading.Event] = {}
        self._running = 0  # calls handed to an instance and not finished
        self._forever = threading.Event()  # never set: what watch waits on
        self._node_ip = ray.util.get_node_ip_address()

    def __repr__(self) -> str:  # Ray prefixes the process's output lines with it
        return f"SlotActor({self.address})"

    # -- the driver's questions ------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def describe(self) -> dict[str, Any]:
        """Where this host runs: node address, pid, GPUs, actor id."""
        context = ray.get_runtime_context()
        return {
            "host": self._node_ip,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "actor_id": context.get_actor_id(),
        }

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Never returns while the process lives: Ray fails it when the process dies,
        which is how the driver learns of the death without asking."""
        self._forever.wait()

    @ray.method(concurrency_group="control")
    def free_port(self) -> int:
        return find_free_port(self._node_ip)

    @ray.method(concurrency_group="control")
    def instance_count(self) -> int:
        return len(self.instances)

    # -- instances and calls -----------------------------------------------------------------

    def create(
        self,
        ref: InstanceRef,
        cls: type,
        args: tuple,
        kwargs: dict,
        env: dict[str, str],
        driver: str,
        seq: int,
        own_thread: bool = False,
    ) -> None:
        """Build ``cls(*args, **kwargs)`` with ``env`` in place: on this actor's one
        default thread, which runs every call of the instance too, or (``own_thread``,
        sent to the ``calls`` group) on a thread of its own."""
        with self._lock:
            self._gone.pop(ref.key, None)

        def resolve(args: tuple, kwargs: dict) -> Resolved:
            self._announce(ref.key)  # its actor is in the table: waiting calls may go on
            return _resolve(args, kwargs)

        call = Call(ref.key, driver, seq, "__init__", args, kwargs)
        try:
            built = self.instances.construct_now(ref, cls, env, call, resolve, own_thread)
            self._wait(self.instances.get(ref.key), built)
        except BaseException:
            self._forget(ref.key)
            raise
        finally:
            self._announce(ref.key)  # a create refused before its look-up wakes them too

    def call(self, message: tuple[str, str, int, str, tuple, dict]) -> Any:
        """Run one method at its turn; its result, captured as the method returned.

        ``message`` is ``(key, driver, seq, method, args, kwargs)``: one argument, as Ray
        handles each argument of a call on its own (a quarter of a no-op call's cost).
        On the default thread the instance runs it right here; a call for an instance
        with a thread of its own comes on the ``calls`` group, and waits for it.
        """
        return self._serve(*message)

    def call_named(self) -> Any:
        """``call`` for a method given no arguments: the call is said by this task's
        name (``call_names``), so Ray charges it for no argument at all."""
        key, driver, seq, method = read_call_name(ray.get_runtime_context().get_task_name())
        return self._serve(key, driver, seq, method, (), {})

    def destroy(self, key: str, driver: str, seq: int) -> None:
        """Drop the instance after the calls issued before this."""
        try:
            self._wait(self.instances.get(key), self.instances.close(key, driver, seq))
        finally:
            self._forget(key)

    @ray.method(concurrency_group="control")
    def skip(self, key: str, driver: str, seq: int) -> None:
        """Call ``seq`` never came (its message could not be sent): later calls go ahead."""
        self.instances.withdraw(key, driver, seq)

    @ray.method(concurrency_group="fns")
    def run(self, fn: Any, args: tuple, label: str) -> Any:
        """A plain function (row routing) on this host's threads, next to its inputs."""
        return fn(*_resolve_values(args))

    @ray.method(concurrency_group="control")
    def reset(self) -> bool:
        """Drop every instance: the slot was given back, to be kept for the next pool
        (``RayBackend(reuse_processes=True)``). ``False`` when a call is still running
        (its thread would keep the process busy): the driver stops the host instead."""
        for key in list(self.instances.keys()):
            self._forget(key)
        with self._lock:
            return self._running == 0

    # -- internals -------------------------------------------------------------------------

    def _serve(
        self, key: str, driver: str, seq: int, method: str, args: tuple, kwargs: dict
    ) -> Any:
        actor = self._actor(key)
        # (see the module's docstring for why the default thread's results are not copied)
        result: Literal["now", "later"] = "later" if actor.own_thread else "now"
        call = Call(key, driver, seq, method, args, kwargs, result=result)
        with self._lock:
            self._running += 1
        try:
            return self._wait(actor, self.instances.serve_now(call, _resolve))
        finally:
            with self._lock:
                self._running -= 1

    @staticmethod
    def _wait(actor: Actor | None, outcome: Any) -> Any:
        """``outcome``'s value; an instance on the lent thread has its calls run here."""
        if actor is not None and not actor.own_thread:
            actor.drive(outcome)
        return outcome.result()

    def _actor(self, key: str) -> Actor:
        actor = self.instances.get(key)
        if actor is None:
            with self._lock:  # its create may still be on its way
                gone = key in self._gone
                born = None if gone else self._born.setdefault(key, threading.Event())
            actor = self.instances.get(key)  # announced since the first look
            if actor is None and born is not None:
                born.wait(BIRTH_WAIT_S)
                actor = self.instances.get(key)
        if actor is not None:
            return actor
        raise LookupError(
            f"instance {key.split('#')[0]!r} is not in slot actor {self.address}: its group "
            "was shut down, or its process was replaced (see WorkerGroup.recover)"
        )

    def _announce(self, key: str) -> None:
        with self._lock:
            born = self._born.pop(key, None)
        if born is not None:
            born.set()

    def _forget(self, key: str) -> None:
        self.instances.forget(key)
        with self._lock:
            self._gone[key] = None
            while len(self._gone) > GONE_KEPT:
                self._gone.pop(next(iter(self._gone)))


def _resolve(args: tuple, kwargs: dict) -> Resolved:
    """Inputs fetched by Ray are this call's own copies: nothing the flow must copy."""
    if not args and not kwargs:  # (a call said by its task's name)
        return args, kwargs, ()
    return _resolve_values(args), _resolve_values(kwargs), ()


def _resolve_values(values: Any) -> Any:
    """A call's ``args`` or ``kwargs`` with each ``Input`` fetched by Ray from wherever it
    lives (in this thread, all at once), and read-only arrays made writable."""
    if not has_inputs(values):
        return writable(values)
    items = list(values.items()) if isinstance(values, dict) else list(enumerate(values))
    inputs = [(k, v) for k, v in items if isinstance(v, Input)]
    refs = [v.ref for _, v in inputs]
    ray.wait(refs, num_returns=len(refs), fetch_local=True)
    found = {k: _fetch(v) for k, v in inputs}  # the first failure in argument order
    if isinstance(values, dict):
        return writable({k: found.get(k, v) for k, v in values.items()})
    return writable(tuple(found.get(i, v) for i, v in enumerate(values)))


def _fetch(item: Input) -> Any:
    try:
        return ray.get(item.ref)
    except Exception as exc:
        error = translate(exc, item)
        if is_lost(exc):
            raise error from exc
        raise error from None
