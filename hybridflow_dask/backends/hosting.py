"""What runs inside the process that hosts instances, shared by every backend.

Keeps the per-process table of instances, puts each rank's environment in place before
the class body runs, runs ``async def`` methods to completion on the instance's own
event loop, and names the group, method and rank on any exception a method raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import pickle
import socket
import threading
from collections.abc import Iterator
from typing import Any

from .base import InstanceRef
from .tracebacks import remote_traceback

__all__ = [
    "EnvSwitch",
    "InstanceTable",
    "annotate_error",
    "explain_init_error",
    "find_free_port",
    "sendable",
]

_INIT_TWICE = "default process group twice"


class EnvSwitch:
    """Puts one instance's environment in ``os.environ`` at a time.

    Switching to an instance first takes back the variables the previous one set and this
    one does not (restoring what the process had), so instances sharing a process (the
    ranks of colocated groups) never see each other's extra variables.
    """

    def __init__(self) -> None:
        self._original: dict[str, str | None] = {}
        self._applied: set[str] = set()

    @contextlib.contextmanager
    def use(self, env: dict[str, str]) -> Iterator[None]:
        """``env`` while the block runs, the process's own variables again afterwards."""
        self.switch(env)
        try:
            yield
        finally:
            self.switch({})

    def switch(self, env: dict[str, str]) -> None:
        """Make ``env`` the extra variables in place, taking back the previous ones."""
        for key in self._applied - env.keys():
            original = self._original.pop(key)
            if original is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = original
        for key in env.keys() - self._applied:
            self._original[key] = os.environ.get(key)
        os.environ.update(env)
        self._applied = set(env)


def annotate_error(exc: BaseException, ref: InstanceRef, method: str) -> BaseException:
    """Name where ``exc`` came from and keep the traceback text across pickling."""
    where = f"raised by {ref.group}.{method} on rank {ref.rank} (worker {ref.slot.address})"
    if not hasattr(exc, "remote_traceback"):
        with contextlib.suppress(Exception):
            exc.remote_traceback = remote_traceback(exc)  # type: ignore[attr-defined]
    exc.hybridflow_origin = (ref.group, method, ref.rank)  # type: ignore[attr-defined]
    if hasattr(exc, "add_note"):
        exc.add_note(where)
    return exc


def sendable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling both ways, else a ``RuntimeError`` that keeps its
    type's name, message, notes (the group, method and rank) and remote traceback.

    An exception whose class cannot be rebuilt from its ``args`` (an ``__init__`` with
    other parameters) pickles fine and fails only where it is unpickled: it is checked
    here, where its caller can still be told, not on the driver's side of the wire.
    """
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception as why:
        stand_in = RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        for name in ("remote_traceback", "hybridflow_origin", "__notes__"):
            if hasattr(exc, name):
                setattr(stand_in, name, getattr(exc, name))
        if hasattr(stand_in, "add_note"):  # Python 3.11+
            stand_in.add_note(f"(sent as a RuntimeError: the original cannot be pickled: {why!r})")
        return stand_in
    return exc


def explain_init_error(exc: BaseException) -> BaseException:
    """Say why ``init_process_group`` fails in a colocated instance, and the ways out.

    Groups on one pool share each rank's process, so the second group's unguarded
    ``torch.distributed.init_process_group()`` finds the first one's default group.
    """
    if _INIT_TWICE not in str(exc):
        return exc
    message = (
        "torch.distributed is already initialized in this process: worker groups on the same "
        "ResourcePool share each rank's process (and its default process group, which has the "
        "pool's rank layout). Guard the call with `if not torch.distributed.is_initialized():` "
        "as verl's workers do, fuse the roles into one class with create_colocated_worker_cls, "
        "or put the groups on separate pools."
    )
    try:
        clear = type(exc)(message)
    except Exception:  # an exception type with another constructor
        clear = RuntimeError(message)
    clear.__cause__ = exc
    return clear


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host``: the address the rendezvous (``MASTER_ADDR``) will use.

    Binding ``host`` alone, never the wildcard address, so not even for this instant does
    the probe open a port on every interface of the machine.
    """
    host = host.strip("[]")  # an IPv6 address as URLs write it
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        return sock.getsockname()[1]


class InstanceTable:
    """The instances living in this process, by instance name."""

    def __init__(self) -> None:
        self._instances: dict[str, Any] = {}
        self._envs: dict[str, dict[str, str]] = {}
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._env = EnvSwitch()
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        try:
            return self._instances[name]
        except KeyError:
            raise LookupError(
                f"instance {name.split('#')[0]!r} is not in this worker process: its group "
                "was shut down, or the worker restarted (see WorkerGroup.recover)"
            ) from None

    def create(self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict) -> None:
        with self._env.use(env):
            try:
                obj = cls(*args, **kwargs)
            except BaseException as exc:
                raise annotate_error(explain_init_error(exc), ref, "__init__")  # noqa: B904
        with self._lock:
            self._instances[ref.key] = obj
            self._envs[ref.key] = dict(env)

    def invoke(self, ref: InstanceRef, method: str, args: tuple, kwargs: dict) -> Any:
        obj = self.get(ref.key)
        with self._env.use(self._envs[ref.key]):
            try:
                result = getattr(obj, method)(*args, **kwargs)
                if inspect.isawaitable(result):
                    result = self._loop(ref.key).run_until_complete(result)
                return result
            except BaseException as exc:
                annotate_error(exc, ref, method)
                raise

    def remove(self, name: str) -> None:
        with self._lock:
            self._instances.pop(name, None)
            self._envs.pop(name, None)
            loop = self._loops.pop(name, None)
        if loop is not None:
            loop.close()

    def names(self) -> list[str]:
        return list(self._instances)

    def _loop(self, name: str) -> asyncio.AbstractEventLoop:
        with self._lock:
            loop = self._loops.get(name)
            if loop is None:
                loop = self._loops[name] = asyncio.new_event_loop()
            return loop
