"""Worker classes the Ray tests run (a module of their own: slot actors import it)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import torch

import hybridflow_dask as hf


class Echo(hf.Worker):
    """Reports its process, keeps state, sleeps, changes what it is given."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor
        self.state = torch.zeros(1 << 20)  # 4 MiB: large enough for Ray's object store
        self.calls = 0

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def thread(self) -> str:
        return threading.current_thread().name

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def count(self) -> int:
        self.calls += 1
        return self.calls

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def tally(self, step: int = 1) -> int:
        self.calls += step
        return self.calls

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def task_name(self, *ignored: Any) -> str:
        import ray

        return ray.get_runtime_context().get_task_name()

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @hf.register(hf.Dispatch.ONE_TO_ALL, blocking=False)
    def big_state(self) -> torch.Tensor:
        return self.state

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def bump(self) -> None:
        self.state.add_(1)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def total(self, value: Any) -> float:
        return float(value.sum())

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def add_in_place(self, array: np.ndarray) -> float:
        array += 1  # numpy from Ray's object store is read-only unless the host copies it
        return float(array.sum())

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def scale(self, data: hf.DataProto) -> hf.DataProto:
        return hf.DataProto.from_dict({"x": data.batch["x"] * self.factor})

    @hf.register(hf.Dispatch.ONE_TO_ALL, materialize_futures=False)
    def resolve(self, data: Any) -> list[float]:
        return hf.get(data).batch["x"].tolist()


class AsyncEcho(Echo):
    """An ``Echo`` with an ``async def`` method: its calls may overlap."""

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    async def nap(self, seconds: float) -> float:
        import asyncio

        await asyncio.sleep(seconds)
        return seconds
