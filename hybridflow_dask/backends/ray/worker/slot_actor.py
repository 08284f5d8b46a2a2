"""The cluster side of the Ray backend: one ``SlotActor`` per slot.

A ``SlotActor`` is an async Ray actor living in one placement-group bundle. It hosts every
instance placed on its slot (the ranks of colocated groups) in the backend-neutral
``hosting.Instances``: an actor each (a thread, an event loop for ``async def`` methods,
an environment switched in while it runs, calls taken in the driver's sequence order),
and the one call flow every backend's calls go through. This module only translates
Ray's actor calls into that flow. The actor's own event loop only receives messages, awaits
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
- **results** are copied in the instance's thread as the method returns (the flow's
  ``"kept"`` results): Ray serializes an async actor's return value after the coroutine
  has finished, by when the instance's next call may be changing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
from typing import Any

import ray

from ...base import InstanceRef
from ...hosting import Actor, Call, Instances, PickleCopy, Resolved, find_free_port
from ..futures import Input, has_inputs, is_lost, translate, writable

__all__ = ["SlotActor"]

#: Threads that run routing functions (``Backend.submit``) in one host.
FN_THREADS = 4
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
        self._gone: dict[str, None] = {}
        self._born: dict[str, asyncio.Event] = {}
        self._running = 0  # calls handed to an instance and not finished
        self._forever = asyncio.Event()  # never set: what watch waits on
        self._fns = concurrent.futures.ThreadPoolExecutor(FN_THREADS, thread_name_prefix="hf-fn")
        self._node_ip = ray.util.get_node_ip_address()

    def __repr__(self) -> str:  # Ray prefixes the process's output lines with it
        return f"SlotActor({self.address})"

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
        return len(self.instances)

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
        self._gone.pop(ref.key, None)
        call = Call(ref.key, driver, seq, "__init__", args, kwargs)
        construct = self.instances.construct(ref, cls, env, call, _resolve)
        building = asyncio.ensure_future(construct)
        await asyncio.sleep(0)  # it has put the actor in the table: waiting calls may go on
        born = self._born.pop(ref.key, None)
        if born is not None:
            born.set()
        try:
            await building
        except BaseException:
            self._forget(ref.key)
            raise

    async def call(self, message: tuple[str, str, int, str, tuple, dict]) -> Any:
        """Run one method at its turn; its result, captured as the method returned.

        ``message`` is ``(key, driver, seq, method, args, kwargs)``: one argument, as Ray
        handles each argument of a call on its own (a quarter of a no-op call's cost).
        """
        key, driver, seq, method, args, kwargs = message
        await self._actor(key)
        self._running += 1
        try:
            call = Call(key, driver, seq, method, args, kwargs)
            return await self.instances.serve(call, _resolve, _as_is)
        finally:
            self._running -= 1

    async def skip(self, key: str, driver: str, seq: int) -> None:
        """Call ``seq`` never came (its message could not be sent): later calls go ahead."""
        self.instances.withdraw(key, driver, seq)

    async def destroy(self, key: str, driver: str, seq: int) -> None:
        """Drop the instance after the calls issued before this."""
        try:
            await asyncio.wrap_future(self.instances.close(key, driver, seq))
        finally:
            self._forget(key)

    async def run(self, fn: Any, args: tuple, label: str) -> Any:
        """A plain function (row routing) on this host's threads, next to its inputs."""
        values = await _resolve_values(args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._fns, lambda: fn(*values))

    async def reset(self) -> bool:
        """Drop every instance: the slot was given back, to be kept for the next pool
        (``RayBackend(reuse_processes=True)``). ``False`` when a call is still running
        (its thread would keep the process busy): the driver stops the host instead."""
        for key in list(self.instances.keys()):
            self._forget(key)
        return self._running == 0

    # -- internals -------------------------------------------------------------------------

    async def _actor(self, key: str) -> Actor:
        actor = self.instances.get(key)
        if actor is not None:
            return actor
        if key not in self._gone:  # its create may still be on its way
            born = self._born.setdefault(key, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(born.wait(), BIRTH_WAIT_S)
            self._born.pop(key, None)
            actor = self.instances.get(key)
            if actor is not None:
                return actor
        raise LookupError(
            f"instance {key.split('#')[0]!r} is not in slot actor {self.address}: its group "
            "was shut down, or its process was replaced (see WorkerGroup.recover)"
        )

    def _forget(self, key: str) -> None:
        self.instances.forget(key)
        self._gone[key] = None
        while len(self._gone) > GONE_KEPT:
            self._gone.pop(next(iter(self._gone)))


async def _as_is(value: Any) -> tuple[Any, int]:
    """Ray serializes the result itself, once the call returns."""
    return value, 0


async def _resolve(args: tuple, kwargs: dict) -> Resolved:
    """Inputs fetched by Ray are this call's own copies: nothing the flow must copy."""
    return await _resolve_values(args), await _resolve_values(kwargs), ()


async def _resolve_values(values: Any) -> Any:
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
