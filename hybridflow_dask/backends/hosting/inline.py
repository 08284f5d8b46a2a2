"""Instances run inline, in the caller's thread: the same jobs, no actor threads.

For in-process backends (``LocalBackend``, the guide's ``TinyBackend``): ``__init__`` and
each method run where the driver called them, so ``pdb`` steps straight into worker code.
An ``async def`` method runs to completion on the instance's own loop before the call
returns, which is the "starts in call order" rule in its simplest form.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any

from ..base import InstanceRef
from .environment import EnvSwitch
from .failures import annotate_error
from .jobs import Construct, Invoke

__all__ = ["InstanceTable"]


class _Inline:
    """One instance living inline (what a job needs of its host)."""

    def __init__(self, ref: InstanceRef, env: dict[str, str]) -> None:
        self.ref = ref
        self.env = dict(env)
        self.obj: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def start_loop(self) -> None:
        if self.loop is None:
            self.loop = asyncio.new_event_loop()


class InstanceTable:
    """The instances living in this process, by ``InstanceRef.key``."""

    def __init__(self) -> None:
        self._instances: dict[str, _Inline] = {}
        self._env = EnvSwitch()
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        """The instance object itself."""
        return self._get(name).obj

    def create(self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict) -> None:
        hosted = _Inline(ref, env)
        with self._env.use(hosted.env):
            Construct(cls, args, kwargs)(hosted)
        with self._lock:
            self._instances[ref.key] = hosted

    def invoke(self, ref: InstanceRef, method: str, args: tuple, kwargs: dict) -> Any:
        hosted = self._get(ref.key)
        job = Invoke(method, args, kwargs, copy=None)
        with self._env.use(hosted.env):
            result = job(hosted)
            if inspect.isawaitable(result):
                hosted.start_loop()
                assert hosted.loop is not None
                result = hosted.loop.run_until_complete(_awaited(result, ref, method))
            return result

    def remove(self, name: str) -> None:
        with self._lock:
            hosted = self._instances.pop(name, None)
        if hosted is not None and hosted.loop is not None:
            hosted.loop.close()

    def names(self) -> list[str]:
        return list(self._instances)

    def _get(self, name: str) -> _Inline:
        try:
            return self._instances[name]
        except KeyError:
            raise LookupError(
                f"instance {name.split('#')[0]!r} is not in this worker process: its group "
                "was shut down, or the worker restarted (see WorkerGroup.recover)"
            ) from None


async def _awaited(awaitable: Any, ref: InstanceRef, method: str) -> Any:
    """The coroutine's result, its error annotated like a method's own."""
    try:
        return await awaitable
    except BaseException as exc:
        raise annotate_error(exc, ref, method)  # noqa: B904
