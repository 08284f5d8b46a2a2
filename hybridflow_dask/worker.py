"""``Worker``: the base class of every role; ``ClassWithInitArgs``: how to build one later."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from .decorators import Dispatch, Execute, register

__all__ = ["RANK_ENV_KEYS", "ClassWithInitArgs", "Worker"]

#: Variables set in the hosting process before a rank's ``__init__`` body runs.
RANK_ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class ClassWithInitArgs:
    """A worker class and the arguments to construct it with, on whichever slot it lands."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a class, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__name__})"


class Worker:
    """Knows its place in the group: rank, world size, local rank, rendezvous address.

    The backend puts ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` in ``os.environ`` before constructing the class,
    so ``torch.distributed.init_process_group()`` works in a subclass ``__init__`` with
    the default ``env://`` method. ``__new__`` reads them, so subclasses need not call
    ``super().__init__()`` for the attributes to exist.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        obj = super().__new__(cls)
        env = os.environ
        obj._rank = int(env.get("RANK", 0))
        obj._world_size = int(env.get("WORLD_SIZE", 1))
        obj._local_rank = int(env.get("LOCAL_RANK", 0))
        obj._local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
        obj._master_addr = env.get("MASTER_ADDR")
        obj._master_port = env.get("MASTER_PORT")
        obj._dispatch_info: dict[str, tuple[int, bool]] = {}
        return obj

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        return self._master_addr, self._master_port

    def get_cuda_visible_devices(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def _register_dispatch_collect_info(
        self, mesh_name: str, dp_rank: int, is_collect: bool
    ) -> None:
        """Declare this rank's DP index and whether its output is collected, for N-d dispatch."""
        if mesh_name in self._dispatch_info:
            raise ValueError(f"mesh {mesh_name!r} is already registered on rank {self.rank}")
        if not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be a non-negative int, got {dp_rank!r}")
        self._dispatch_info[mesh_name] = (dp_rank, bool(is_collect))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> tuple[int, bool] | None:
        return self._dispatch_info.get(mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _process_info(self) -> dict[str, Any]:
        """Where this rank runs: for tests, the dashboard and failure drills."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "rank": self.rank,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(
        self, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Run ``func(self, *shards)`` on every rank: a one-off DP computation."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` on rank 0 only."""
        return func(*args, **kwargs)
