"""``Worker``: the base class of every role; ``ClassWithInitArgs``: how to build one later."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from typing import Any

from .decorators import Dispatch, Execute, register

__all__ = ["GROUP_ENV_KEYS", "RANK_ENV_KEYS", "ClassWithInitArgs", "Worker", "WorkerHelper"]

#: Variables set in the hosting process before a rank's ``__init__`` body runs.
RANK_ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)

#: Set as well, under the names verl's Ray workers find them (code reads them to tell
#: which group it is in, or how many ranks share its node).
GROUP_ENV_KEYS = ("WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE")


class ClassWithInitArgs:
    """A worker class and the arguments to construct it with, on whichever slot it lands.

    ``update_options`` and ``set_additional_resource`` exist because verl code calls them
    on ``RayClassWithInitArgs``; the options are kept (``options``) but Ray actor options
    mean nothing to Dask, so they change nothing.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a class, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.fused_worker_used = False
        self._options: dict[str, Any] = {}
        self._additional_resource: dict[str, Any] = {}

    def __call__(self) -> Any:
        return self.cls(*self.args, **self.kwargs)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self._options)

    def update_options(self, options: dict[str, Any]) -> None:
        """Record Ray-style actor options (verl API); they do not affect placement here."""
        if not isinstance(options, dict):
            raise TypeError(f"update_options takes a dict, got {type(options).__name__}")
        self._options.update(options)

    def set_additional_resource(self, additional_resource: dict[str, Any]) -> None:
        """Record Ray custom resources (verl API); Dask placement comes from the pool."""
        if not isinstance(additional_resource, dict):
            raise TypeError(
                f"set_additional_resource takes a dict, got {type(additional_resource).__name__}"
            )
        self._additional_resource = dict(additional_resource)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__name__})"


class WorkerHelper:
    """Address helpers verl's workers call to set up their own rendezvous."""

    @staticmethod
    def _get_node_ip() -> str:
        """This host's address: ``MY_HOST_IP``/``MY_HOST_IPV6`` if set, else the routed one."""
        from_env = os.environ.get("MY_HOST_IP") or os.environ.get("MY_HOST_IPV6")
        if from_env:
            return from_env
        try:  # a UDP connect sends nothing; it only asks the kernel for the outgoing route
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect(("10.254.254.254", 1))
                return sock.getsockname()[0]
        except OSError:
            pass
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    @staticmethod
    def _get_free_port(host: str = "127.0.0.1") -> int:
        """A port free on ``host``'s interface, or on loopback when ``host`` is no address
        of this machine (``MY_HOST_IP`` behind NAT): never bound on all interfaces, not
        even for the moment it takes to ask."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family) as sock:
                sock.bind((host, 0))
                return sock.getsockname()[1]
        except OSError:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                return sock.getsockname()[1]

    def get_available_master_addr_port(self) -> tuple[str, str]:
        """``(ip, port)`` on this host, for a rendezvous of the worker's own making."""
        ip = self._get_node_ip().strip("[]")
        return ip, str(self._get_free_port(ip))

    def get_availale_master_addr_port(self) -> tuple[str, str]:
        """verl's misspelled name, kept (with its deprecation warning) for old callers."""
        warnings.warn(
            "get_availale_master_addr_port is misspelled; use get_available_master_addr_port",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.get_available_master_addr_port()


class Worker(WorkerHelper):
    """Knows its place in the group: rank, world size, local rank, rendezvous address.

    The backend puts ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (and ``WG_PREFIX``, ``WG_BACKEND``,
    ``RAY_LOCAL_RANK``, ``RAY_LOCAL_WORLD_SIZE``; on GPU slots ``CUDA_VISIBLE_DEVICES``)
    in ``os.environ`` before constructing the class, so
    ``torch.distributed.init_process_group()`` works in a subclass ``__init__`` with the
    default ``env://`` method. ``__new__`` reads them, so subclasses need not call
    ``super().__init__()`` for the attributes to exist.
    """

    fused_worker_attr_name = "fused_worker_dict"

    # Set on every instance by ``__new__`` (annotations only: no class attributes).
    _rank: int
    _world_size: int
    _local_rank: int
    _local_world_size: int
    _master_addr: str | None
    _master_port: str | None
    _dispatch_dp_rank: dict[str, int]
    _collect_dp_rank: dict[str, bool]
    fused_worker_dict: dict[str, Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        obj = super().__new__(cls)
        env = os.environ
        obj._rank = int(env.get("RANK", 0))
        obj._world_size = int(env.get("WORLD_SIZE", 1))
        obj._local_rank = int(env.get("LOCAL_RANK", 0))
        obj._local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
        obj._master_addr = env.get("MASTER_ADDR")
        obj._master_port = env.get("MASTER_PORT")
        obj._dispatch_dp_rank = {}
        obj._collect_dp_rank = {}
        obj.fused_worker_dict = {}
        return obj

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        if cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(cuda_visible_devices)

    @classmethod
    def env_keys(cls) -> list[str]:
        """The variables that describe a rank (verl's list, device visibility included)."""
        return [
            "WORLD_SIZE",
            "RANK",
            "LOCAL_WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "CUDA_VISIBLE_DEVICES",
        ]

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

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """Another role fused into the same process (``None`` if there is no such role)."""
        return self.fused_worker_dict.get(worker_name)

    # -- N-d dispatch: which DP rank this rank is, and whether its output is collected ----

    def _register_dispatch_collect_info(
        self, mesh_name: str, dp_rank: int, is_collect: bool
    ) -> None:
        """Declare this rank's DP index and whether its output is collected, for N-d dispatch."""
        if mesh_name in self._dispatch_dp_rank or mesh_name in self._collect_dp_rank:
            raise ValueError(f"mesh {mesh_name!r} is already registered on rank {self.rank}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be a non-negative int, got {dp_rank!r}")
        self._dispatch_dp_rank[mesh_name] = dp_rank
        self._collect_dp_rank[mesh_name] = bool(is_collect)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        """This rank's DP index on ``mesh_name`` (the group gathers one per rank)."""
        self._check_mesh(mesh_name)
        return self._dispatch_dp_rank[mesh_name]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return self.query_collect_info(mesh_name)

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output on ``mesh_name`` is part of the collected result."""
        self._check_mesh(mesh_name)
        return self._collect_dp_rank[mesh_name]

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """Every registered mesh: ``{"dispatch_dp_rank": {...}, "collect_dp_rank": {...}}``."""
        return {
            "dispatch_dp_rank": dict(self._dispatch_dp_rank),
            "collect_dp_rank": dict(self._collect_dp_rank),
        }

    def set_dispatch_collect(
        self,
        mesh_name: str,
        dispatch_dp_rank: dict[str, int],
        collect_dp_rank: dict[str, bool],
    ) -> None:
        """Register ``mesh_name`` from dicts shaped like ``get_dispatch_collect``'s halves.

        The entry for ``mesh_name`` is used, or the only entry of a one-entry dict (how a
        fused role hands its layout to another under a new name).
        """
        dp_rank = _entry_for(mesh_name, dispatch_dp_rank, "dispatch_dp_rank")
        is_collect = _entry_for(mesh_name, collect_dp_rank, "collect_dp_rank")
        self._register_dispatch_collect_info(mesh_name, dp_rank, is_collect)

    def _check_mesh(self, mesh_name: str) -> None:
        if mesh_name not in self._dispatch_dp_rank:
            raise ValueError(
                f"mesh {mesh_name!r} is not registered on rank {self.rank} of "
                f"{type(self).__name__}; call self._register_dispatch_collect_info("
                f"{mesh_name!r}, dp_rank, is_collect) in __init__ (registered: "
                f"{sorted(self._dispatch_dp_rank)})"
            )

    # -- built-in methods every group gets ------------------------------------------------

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


def _entry_for(mesh_name: str, table: dict[str, Any], what: str) -> Any:
    if not isinstance(table, dict):
        raise TypeError(f"{what} must be a dict of mesh name to value, got {table!r}")
    if mesh_name in table:
        return table[mesh_name]
    if len(table) == 1:
        return next(iter(table.values()))
    raise ValueError(
        f"{what} has no entry for mesh {mesh_name!r} and {len(table)} others "
        f"({sorted(table)}); pass {{{mesh_name!r}: value}}"
    )
