"""The worker classes and functions the conformance kit runs on a backend's slots.

A module of their own (not the test module) so that a backend's hosting processes import
only this and the package when they unpickle them by reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from typing import Any

import torch

from ..decorators import Dispatch, register
from ..protocol import DataProto, DataProtoFuture
from ..worker import Worker

__all__ = ["ENV_KEYS", "Probe", "add", "double"]

#: What the kit reads back from each rank's ``os.environ``.
ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WG_PREFIX",
    "WG_BACKEND",
    "KIT_ROLE",
    "KIT_ONLY_B",
)


def add(a: Any, b: Any) -> Any:
    """A plain function for ``Backend.submit``."""
    return a + b


def double(x: Any) -> Any:
    """Another one: ``x * 2`` (a tensor's values, or a number)."""
    return x * 2


class Probe(Worker):
    """Reports what the backend gave it: environment, process, call order, copies."""

    def __init__(self, driver_pid: int = 0, fail_on_rank: int = -1) -> None:
        super().__init__()
        if self.rank == fail_on_rank:
            raise ValueError(f"kit: __init__ fails on rank {self.rank} as asked")
        self.driver_pid = driver_pid
        self.init_env = _env()
        self.seen: list[Any] = []
        self.state = torch.arange(4.0)
        self.stored: Any = None
        self.ticks = 0
        self._ticker: asyncio.Task | None = None
        self._busy = 0
        self._overlaps = 0
        self._lock = threading.Lock()

    # -- environment and process ----------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def env_at_init(self) -> dict[str, str | None]:
        return self.init_env

    @register(Dispatch.ONE_TO_ALL)
    def env_now(self) -> dict[str, str | None]:
        return _env()

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def exit_process(self) -> None:
        """SIGKILL the hosting process (what a crash looks like), never the driver's."""
        if os.getpid() == self.driver_pid:
            raise RuntimeError(
                "kit: refusing to kill the driver's own process; this backend hosts instances "
                "in the driver, so declare in_process = True on it"
            )
        os.kill(os.getpid(), signal.SIGKILL)

    # -- calls and order ----------------------------------------------------------------

    def record(self, item: Any) -> Any:
        """Append ``item`` to what this instance has seen; at most one call inside."""
        with self._lock:
            self._busy += 1
            if self._busy > 1:
                self._overlaps += 1
        try:
            time.sleep(0.001)
            self.seen.append(item)
            return item
        finally:
            with self._lock:
                self._busy -= 1

    def history(self) -> list[Any]:
        return list(self.seen)

    def overlaps(self) -> int:
        return self._overlaps

    @register(Dispatch.ONE_TO_ALL)
    def rank_and(self, value: Any) -> tuple[int, Any]:
        return self.rank, value

    def fail(self, ranks: tuple[int, ...]) -> None:
        if self.rank in ranks:
            raise (ValueError if self.rank == min(ranks) else KeyError)(
                f"kit: failing on rank {self.rank} as asked"
            )

    # -- async methods ------------------------------------------------------------------

    async def start_ticker(self) -> int:
        """Start a task that keeps counting on this instance's loop after the call returns."""

        async def tick() -> None:
            while True:
                self.ticks += 1
                await asyncio.sleep(0.001)

        self._ticker = asyncio.get_running_loop().create_task(tick())
        await asyncio.sleep(0)
        return id(asyncio.get_running_loop())

    async def record_async(self, item: Any) -> Any:
        """Append ``item`` before the first ``await`` (the body's start), then yield."""
        self.seen.append(item)
        await asyncio.sleep(0.002)
        return item

    async def ticks_after(self, seconds: float) -> tuple[int, int, bool]:
        before = self.ticks
        await asyncio.sleep(seconds)
        alive = self._ticker is not None and not self._ticker.done()
        return id(asyncio.get_running_loop()), self.ticks - before, alive

    # -- copies -------------------------------------------------------------------------

    def store(self, value: Any) -> None:
        self.stored = value

    def load(self) -> Any:
        return self.stored

    def get_state(self) -> torch.Tensor:
        return self.state

    def bump_state_in_place(self) -> None:
        self.state.add_(100)

    def mutate_input(self, value: torch.Tensor) -> float:
        value.add_(1000)
        return float(value.sum())

    # -- data ---------------------------------------------------------------------------

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def mark(self, data: DataProto) -> DataProto:
        """The rows it got, each tagged with this rank; records which rows those were."""
        self.seen.append(data.batch["idx"].tolist())
        out = data.select(batch_keys=["idx"], deepcopy=True)
        out.batch["by_rank"] = torch.full((len(data),), self.rank)
        return out

    @register(Dispatch.ONE_TO_ALL, materialize_futures=False)
    def resolve_here(self, data: Any) -> dict[str, Any]:
        """Resolve a ``DataProtoFuture`` inside the hosting process."""
        got = data.get() if isinstance(data, DataProtoFuture) else data
        return {
            "was_future": isinstance(data, DataProtoFuture),
            "idx": got.batch["idx"].tolist(),
            "pid": os.getpid(),
        }


def _env() -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in ENV_KEYS}
