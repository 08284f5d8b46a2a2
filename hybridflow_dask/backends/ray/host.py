"""The cluster side of the Ray backend: one ``SlotHost`` actor per slot, and the registry.

A ``SlotHost`` is an async Ray actor living in one placement-group bundle. It hosts every
instance placed on its slot (the ranks of colocated groups), each in an ``Actor`` of its
own (the same per-instance runner the Dask backend uses: a thread, an event loop for
``async def`` methods, an environment switched in while it runs, calls taken in the
driver's sequence order). The actor's own event loop only receives messages, awaits
inputs and hands calls over, so a long method never holds up a routing function, the
fetching of other calls' inputs, or the ``watch`` call the driver uses to see this
process die. (Colocated instances with different environments still take turns: there
is one ``os.environ`` per process, and the ``EnvGate`` lets only calls of equal
environments run at once.)

Three things are done here rather than left to Ray, each for a reason:

- **inputs** arrive as ``Input`` references and are awaited here, not resolved by Ray
  before the task starts: a call whose input failed must still take its turn (and give
  it up), or every later call on its instance would wait for it forever;
- **order** comes from the driver's sequence numbers, not from Ray's actor queue: Ray
  keeps submission order only for single-threaded actors, which would run colocated
  instances and routing functions one at a time (and deadlock a method that resolves a
  future routed through its own slot);
- **results** are copied in the instance's thread as the method returns: Ray serializes
  an async actor's return value after the coroutine has finished, by when the instance's
  next call may be changing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import inspect
import os
import socket
from typing import Any

import ray

from ..base import InstanceRef
from ..dask.worker.actor import Actor, EnvGate
from ..hosting import annotate_error, explain_init_error, find_free_port, sendable
from .futures import Input, has_inputs, is_lost, translate, writable

__all__ = ["SlotHost"]

#: Threads that run routing functions (``Backend.submit``) in one host.
FN_THREADS = 4
#: How long a call waits for its instance to be created (its create may still be
#: fetching large arguments when the call arrives).
BIRTH_WAIT_S = 60.0
#: Destroyed instance keys remembered, so a late call fails at once instead of waiting.
GONE_KEPT = 10_000

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class SlotHost:
    """Every instance on one slot; made a Ray actor by the backend (``ray.remote``)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.actors: dict[str, Actor] = {}
        self.gate = EnvGate()
        self._gone: dict[str, None] = {}
        self._born: dict[str, asyncio.Event] = {}
        self._running = 0  # calls handed to an instance and not finished
        self._forever = asyncio.Event()  # never set: what watch waits on
        self._fns = concurrent.futures.ThreadPoolExecutor(FN_THREADS, thread_name_prefix="hf-fn")
        self._node_ip = ray.util.get_node_ip_address()

    def __repr__(self) -> str:  # Ray prefixes the process's output lines with it
        return f"SlotHost({self.address})"

    # -- the driver's questions ------------------------------------------------------------

    async def describe(self) -> dict[str, Any]:
        """Where this host runs: node address, pid, GPUs, actor id."""
        context = ray.get_runtime_context()
        return {
            "host": self._node_ip,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "actor_id": context.get_actor_id(),
        }

    async def watch(self) -> None:
        """Never returns while the process lives: Ray fails it when the process dies,
        which is how the driver learns of the death without asking."""
        await self._forever.wait()

    async def free_port(self) -> int:
        return find_free_port(self._node_ip)

    async def instance_count(self) -> int:
        return len(self.actors)

    # -- instances and calls -----------------------------------------------------------------

    async def create(
        self,
        ref: InstanceRef,
        cls: type,
        args: tuple,
        kwargs: dict,
        env: dict[str, str],
        driver: str,
        seq: int,
    ) -> None:
        """Build ``cls(*args, **kwargs)`` in a new ``Actor`` with ``env`` in place."""
        actor = Actor(ref, env, self.gate)
        old = self.actors.pop(ref.key, None)
        self.actors[ref.key] = actor
        self._gone.pop(ref.key, None)
        born = self._born.pop(ref.key, None)
        if born is not None:
            born.set()
        if old is not None:
            old.stop()
        try:
            args, kwargs = await _resolve(args), await _resolve(kwargs)
            await asyncio.wrap_future(actor.submit(driver, seq, _Construct(cls, args, kwargs)))
        except BaseException as exc:
            self._forget(ref.key)
            raise sendable(exc) from None

    async def call(self, message: tuple[str, str, int, str, tuple, dict]) -> Any:
        """Run one method at its turn; its result, captured as the method returned.

        ``message`` is ``(key, driver, seq, method, args, kwargs)``: one argument, as Ray
        handles each argument of a call on its own (a quarter of a no-op call's cost).
        """
        key, driver, seq, method, args, kwargs = message
        actor = await self._actor(key)
        try:
            args, kwargs = await _resolve(args), await _resolve(kwargs)
        except BaseException as exc:
            actor.skip(driver, seq)  # its turn passes: later calls go ahead
            raise sendable(exc) from None
        self._running += 1
        try:
            return await asyncio.wrap_future(actor.submit(driver, seq, _Call(method, args, kwargs)))
        except BaseException as exc:
            raise sendable(exc) from None
        finally:
            self._running -= 1

    async def skip(self, key: str, driver: str, seq: int) -> None:
        """Call ``seq`` never came (its message could not be sent): later calls go ahead."""
        actor = self.actors.get(key)
        if actor is not None:
            actor.skip(driver, seq)

    async def destroy(self, key: str, driver: str, seq: int) -> None:
        """Drop the instance after the calls issued before this."""
        actor = self.actors.get(key)
        if actor is None:
            return
        try:
            await asyncio.wrap_future(actor.close(driver, seq))
        finally:
            self._forget(key)

    async def run(self, fn: Any, args: tuple, label: str) -> Any:
        """A plain function (row routing) on this host's threads, next to its inputs."""
        values = await _resolve(args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._fns, lambda: fn(*values))

    async def reset(self) -> bool:
        """Drop every instance: the slot was given back, to be kept for the next pool
        (``RayBackend(reuse_processes=True)``). ``False`` when a call is still running
        (its thread would keep the process busy): the driver stops the host instead."""
        for key in list(self.actors):
            self._forget(key)
        return self._running == 0

    # -- internals -------------------------------------------------------------------------

    async def _actor(self, key: str) -> Actor:
        actor = self.actors.get(key)
        if actor is not None:
            return actor
        if key not in self._gone:  # its create may still be on its way
            born = self._born.setdefault(key, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(born.wait(), BIRTH_WAIT_S)
            self._born.pop(key, None)
            actor = self.actors.get(key)
            if actor is not None:
                return actor
        raise LookupError(
            f"instance {key.split('#')[0]!r} is not in slot host {self.address}: its group "
            "was shut down, or its process was replaced (see WorkerGroup.recover)"
        )

    def _forget(self, key: str) -> None:
        actor = self.actors.pop(key, None)
        self._gone[key] = None
        while len(self._gone) > GONE_KEPT:
            self._gone.pop(next(iter(self._gone)))
        if actor is not None:
            actor.stop()


class _Construct:
    """The job that builds an instance in its actor's thread."""

    method = "__init__"

    def __init__(self, cls: type, args: tuple, kwargs: dict) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def __call__(self, actor: Actor) -> None:
        if any(inspect.iscoroutinefunction(getattr(self.cls, n, None)) for n in dir(self.cls)):
            actor.start_loop()  # the loop lives as long as the instance, from its start
        try:
            actor.obj = self.cls(*self.args, **self.kwargs)
        except BaseException as exc:
            raise annotate_error(explain_init_error(exc), actor.ref, "__init__")  # noqa: B904


class _Call:
    """The job that runs one method in its actor's thread; ``capture`` copies the
    result there, before the instance's next call can change it."""

    def __init__(self, method: str, args: tuple, kwargs: dict) -> None:
        self.method, self.args, self.kwargs = method, args, kwargs

    def __call__(self, actor: Actor) -> Any:
        try:
            return getattr(actor.obj, self.method)(*self.args, **self.kwargs)
        except BaseException as exc:
            raise annotate_error(exc, actor.ref, self.method)  # noqa: B904

    @staticmethod
    def capture(result: Any) -> Any:
        if isinstance(result, _PLAIN):
            return result
        try:
            return copy.deepcopy(result)
        except Exception:  # cannot be copied: Ray serializes it as it is
            return result


async def _resolve(values: Any) -> Any:
    """A call's ``args`` or ``kwargs`` with each ``Input`` awaited (fetched by Ray from
    wherever it lives) and read-only arrays made writable."""
    if not has_inputs(values):
        return writable(values)
    items = list(values.items()) if isinstance(values, dict) else list(enumerate(values))
    inputs = [(k, v) for k, v in items if isinstance(v, Input)]
    got = await asyncio.gather(*(_fetch(v) for _, v in inputs), return_exceptions=True)
    for value in got:  # the first failure in argument order
        if isinstance(value, BaseException):
            raise value
    found = {k: value for (k, _), value in zip(inputs, got)}
    if isinstance(values, dict):
        return writable({k: found.get(k, v) for k, v in values.items()})
    return writable(tuple(found.get(i, v) for i, v in enumerate(values)))


async def _fetch(item: Input) -> Any:
    try:
        return await item.ref
    except Exception as exc:
        error = translate(exc, item)
        if is_lost(exc):
            raise error from exc
        raise error from None
