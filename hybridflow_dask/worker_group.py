"""``WorkerGroup``: the driver's handle on one role's ranks.

Every ``@register``-ed method of the worker class becomes a method here. Calling it runs
``dispatch -> call every rank through the backend -> wait (if blocking) -> collect ->
unpad``. Nothing in this module knows which backend runs the ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from .backends.base import Backend, FutureList, InstanceRef, Slot
from .decorators import Dispatch, Execute, MethodSpec, get_method_spec, resolve_dispatch_mode
from .decorators.dispatch import DispatchFns
from .protocol import DataProto, DataProtoFuture, unpad_dataproto
from .resource_pool import ResourcePool
from .worker import RANK_ENV_KEYS, ClassWithInitArgs

__all__ = ["WorkerGroup", "bindable_methods", "registered_methods"]

logger = logging.getLogger(__name__)


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every method of ``cls`` and its bases that carries the register mark."""
    found: dict[str, MethodSpec] = {}
    for name in dir(cls):
        spec = get_method_spec(getattr(cls, name, None))
        if spec is not None:
            found[name] = spec
    return found


def bindable_methods(cls: type) -> dict[str, tuple[MethodSpec, DispatchFns]]:
    """The registered methods of ``cls`` with their dispatch functions.

    Raises ``ValueError`` for a method that cannot become a WorkerGroup method (its name
    is taken by a WorkerGroup attribute, or its dispatch mode has no functions), so a
    group fails before it places or creates anything.
    """
    reserved = set(dir(WorkerGroup))
    table = {}
    for name, spec in registered_methods(cls).items():
        if name in reserved:
            raise ValueError(
                f"{cls.__name__}.{name} is registered but WorkerGroup already has an "
                f"attribute {name!r}; rename the worker method"
            )
        try:
            fns = resolve_dispatch_mode(spec.dispatch_mode)
        except ValueError as exc:
            raise ValueError(f"{cls.__name__}.{name}: {exc}") from None
        table[name] = (spec, fns)
    return table


class WorkerGroup:
    """``world_size`` instances of one worker class, rank ``i`` on the pool's slot ``i``."""

    def __init__(
        self,
        resource_pool: ResourcePool,
        cls_with_init: ClassWithInitArgs,
        *,
        backend: Backend | None = None,
        name_prefix: str | None = None,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        if not isinstance(resource_pool, ResourcePool):
            raise TypeError(f"resource_pool must be a ResourcePool, got {resource_pool!r}")
        if isinstance(cls_with_init, type):
            cls_with_init = ClassWithInitArgs(cls_with_init)
        if not isinstance(cls_with_init, ClassWithInitArgs):
            raise TypeError(
                f"cls_with_init must be a ClassWithInitArgs (or a class), got {cls_with_init!r}"
            )
        env_extra = _check_env(worker_env)
        if backend is None:
            from .runtime import default_backend

            backend = default_backend()
        cls = cls_with_init.cls
        methods = bindable_methods(cls)  # a class that cannot be bound fails before placing
        prefix = name_prefix or f"{cls.__name__}_{uuid.uuid4().hex[:6]}"
        if backend.lookup(prefix):
            raise ValueError(
                f"a worker group named {prefix!r} already exists on this backend; pick another "
                "name_prefix or attach to it with WorkerGroup.from_detached"
            )
        slots = resource_pool.acquire(backend)
        try:
            addr, port = resource_pool.rendezvous(backend, slots)
            refs = [
                InstanceRef(prefix, rank, slot, cls.__name__) for rank, slot in enumerate(slots)
            ]
            envs = _rank_envs(resource_pool, refs, addr, port, env_extra)
            _create_instances(backend, cls_with_init, refs, envs)
        except BaseException:
            resource_pool.release()
            raise
        self._setup(backend, prefix, cls, refs, resource_pool, owner=True, methods=methods)
        self._cls_with_init = cls_with_init
        self._envs = envs
        logger.info("created worker group %s: %d x %s", prefix, len(refs), cls.__name__)

    def _setup(
        self,
        backend: Backend,
        prefix: str,
        cls: type,
        refs: list[InstanceRef],
        pool: ResourcePool | None,
        *,
        owner: bool,
        method_prefix: str = "",
        methods: dict[str, tuple[MethodSpec, DispatchFns]] | None = None,
        parent: WorkerGroup | None = None,
    ) -> None:
        self._backend = backend
        self.name_prefix = prefix
        self._cls = cls
        self._refs = refs
        self._pool = pool
        self._owner = owner
        self._method_prefix = method_prefix
        self._closed = False
        self._parent = parent  # a spawned role view is closed with the fused group
        self._dispatch_cache: dict[str, tuple[list[int], list[bool]]] = {}
        for name, (spec, fns) in (bindable_methods(cls) if methods is None else methods).items():
            setattr(self, name, self._make_method(name, spec, fns))

    # -- construction helpers ---------------------------------------------------------

    @classmethod
    def from_detached(
        cls,
        name_prefix: str,
        cls_with_init: ClassWithInitArgs | type | None = None,
        *,
        backend: Backend | None = None,
    ) -> WorkerGroup:
        """Attach to a group created earlier (by this or another driver) under ``name_prefix``."""
        if backend is None:
            from .runtime import default_backend

            backend = default_backend()
        refs = sorted(backend.lookup(name_prefix), key=lambda r: r.rank)
        if not refs:
            raise ValueError(f"no worker group named {name_prefix!r} exists on this backend")
        worker_cls = (
            cls_with_init.cls if isinstance(cls_with_init, ClassWithInitArgs) else cls_with_init
        )
        if worker_cls is None:
            raise TypeError("from_detached needs the worker class to know its registered methods")
        group = cls.__new__(cls)
        group._setup(backend, name_prefix, worker_cls, refs, None, owner=False)
        return group

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One WorkerGroup per role of a fused (colocated) worker class, sharing its ranks."""
        roles = getattr(self._cls, "__hybridflow_roles__", None)
        if roles is None:
            raise ValueError(
                f"{self._cls.__name__} is not a fused worker class; build one with "
                "create_colocated_worker_cls"
            )
        views = {}
        for role in prefix_set:
            if role not in roles:
                raise ValueError(f"no role {role!r} in this fused group; roles: {sorted(roles)}")
            view = type(self).__new__(type(self))
            view._setup(
                self._backend,
                f"{self.name_prefix}.{role}",
                roles[role],
                self._refs,
                None,
                owner=False,
                method_prefix=f"{role}_",
                parent=self,
            )
            views[role] = view
        return views

    # -- the verl surface ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._refs)

    @property
    def worker_names(self) -> list[str]:
        return [ref.name for ref in self._refs]

    @property
    def backend(self) -> Backend:
        return self._backend

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name`` on every rank; a list of ``world_size`` is split one per rank."""
        self._check_method(method_name)
        futures = self._call_ranks(range(self.world_size), method_name, args, kwargs, True)
        return FutureList(futures, self._backend)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        self._check_method(method_name)
        futures = self._call_ranks(
            range(self.world_size), method_name, args, kwargs, True, blocking=True
        )
        return self._backend.gather(futures)

    execute_all = execute_all_async

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        self._check_method(method_name)
        return self._call_ranks([0], method_name, args, kwargs, True, split=False)[0]

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        self._check_method(method_name)
        futures = self._call_ranks([0], method_name, args, kwargs, True, split=False, blocking=True)
        return self._backend.gather(futures)[0]

    execute_rank_zero = execute_rank_zero_async

    def recover(self) -> list[int]:
        """Re-create the ranks whose worker died; return their numbers.

        Each dead rank is built again, with its constructor arguments and rank
        environment, on a live worker of the same host (the same one for every group on
        the pool, so colocation holds). Its state is lost: a recovered rank starts from
        ``__init__``, and collectives must be set up again by the caller.
        """
        if not self._owner or self._pool is None:
            raise ValueError(
                "only the group that created the instances can recover them (not a spawned "
                "or detached view)"
            )
        dead = [ref.rank for ref in self._refs if not self._backend.alive(ref.slot)]
        if not dead:
            return []
        new_refs = [
            InstanceRef(
                self.name_prefix,
                rank,
                self._pool.replace_slot(self._backend, self._refs[rank].slot),
                self._cls.__name__,
            )
            for rank in dead
        ]
        _create_instances(
            self._backend, self._cls_with_init, new_refs, [self._envs[r] for r in dead]
        )
        for ref in new_refs:
            self._refs[ref.rank] = ref  # in place: spawned role views share this list
        logger.warning("recovered ranks %s of worker group %s", dead, self.name_prefix)
        return dead

    def shutdown(self) -> None:
        """Drop the instances and give the pool's slots back (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            try:
                self._backend.destroy(self._refs)
            finally:
                if self._pool is not None:
                    self._pool.release()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<WorkerGroup {self.name_prefix!r}: {self.world_size} x {self._cls.__name__}>"

    # -- what dispatch functions use ----------------------------------------------------

    def _rank_slots(self) -> list[Slot]:
        return [ref.slot for ref in self._refs]

    def _slot_of_first(self, dp_ranks: list[int], dp_rank: int) -> Slot:
        return self._refs[dp_ranks.index(dp_rank)].slot

    def _dispatch_info(self, mesh_name: str) -> tuple[list[int], list[bool]]:
        """Each rank's DP index and collect flag for ``mesh_name``, asked once then cached."""
        if mesh_name not in self._dispatch_cache:
            infos = self.execute_all_sync("_query_dispatch_info", mesh_name)
            missing = [rank for rank, info in enumerate(infos) if info is None]
            if missing:
                raise ValueError(
                    f"ranks {missing} of {self.name_prefix} did not call "
                    f"_register_dispatch_collect_info({mesh_name!r}, ...) in __init__"
                )
            dp_ranks = [info[0] for info in infos]
            if sorted(set(dp_ranks)) != list(range(max(dp_ranks) + 1)):
                raise ValueError(f"dp ranks of mesh {mesh_name!r} are not 0..n-1: {dp_ranks}")
            self._dispatch_cache[mesh_name] = (dp_ranks, [info[1] for info in infos])
        return self._dispatch_cache[mesh_name]

    # -- internals ------------------------------------------------------------------------

    def _make_method(self, name: str, spec: MethodSpec, fns: DispatchFns) -> Callable[..., Any]:
        rank_zero = (
            spec.execute_mode is Execute.RANK_ZERO or spec.dispatch_mode is Dispatch.RANK_ZERO
        )

        def method(*args: Any, **kwargs: Any) -> Any:
            dispatched = fns.dispatch_fn(self, *args, **kwargs)
            pad = getattr(dispatched, "pad", 0)
            d_args, d_kwargs = dispatched
            ranks = [0] if rank_zero else range(self.world_size)
            futures = self._call_ranks(
                ranks,
                name,
                d_args,
                d_kwargs,
                spec.materialize_futures,
                split=not rank_zero,
                blocking=spec.blocking,
            )
            if spec.blocking:
                outputs = self._backend.gather(futures)
            else:
                outputs = FutureList(futures, self._backend)
            if rank_zero:
                outputs = outputs[0]
            return self._unpad(fns.collect_fn(self, outputs), pad)

        method.__name__ = name
        method.__qualname__ = f"{type(self).__name__}.{name}"
        method.__doc__ = getattr(getattr(self._cls, name, None), "__doc__", None)
        return method

    def _call_ranks(
        self,
        ranks: Iterable[int],
        method_name: str,
        args: tuple,
        kwargs: dict,
        materialize: bool,
        *,
        split: bool = True,
        blocking: bool = False,
    ) -> list[Any]:
        if self._closed or (self._parent is not None and self._parent._closed):
            raise RuntimeError(f"worker group {self.name_prefix} is shut down")
        n = self.world_size
        target = self._method_prefix + method_name
        label = f"{self.name_prefix}.{method_name}"

        def pick(value: Any, rank: int) -> Any:
            if split and isinstance(value, (list, tuple)) and len(value) == n:
                value = value[rank]
            if materialize and isinstance(value, DataProtoFuture):
                value = value.whole(self._refs[rank].slot)
            return value

        return [
            self._backend.call(
                self._refs[rank],
                target,
                tuple(pick(a, rank) for a in args),
                {k: pick(v, rank) for k, v in kwargs.items()},
                label=label,
                blocking=blocking,
            )
            for rank in ranks
        ]

    def _unpad(self, result: Any, pad: Any) -> Any:
        if isinstance(pad, int) and pad == 0:
            return result
        if isinstance(result, DataProtoFuture):
            return dataclasses.replace(result, pad=pad)
        if isinstance(result, DataProto):
            if self._backend.is_future(pad):
                pad = self._backend.gather([pad])[0]
            return unpad_dataproto(result, pad)
        return result

    def _check_method(self, method_name: str) -> None:
        if not isinstance(method_name, str) or not callable(getattr(self._cls, method_name, None)):
            raise ValueError(
                f"{self._cls.__name__} has no method {method_name!r}; "
                f"registered methods: {sorted(registered_methods(self._cls))}"
            )


def _rank_envs(
    pool: ResourcePool, refs: list[InstanceRef], addr: str, port: int, extra: dict[str, str]
) -> list[dict[str, str]]:
    """What each rank finds in ``os.environ`` before its class body runs."""
    local_ranks, local_sizes = pool.local_rank_list(), pool.local_world_size_list()
    envs = []
    for ref in refs:
        env = {
            **extra,
            "RANK": str(ref.rank),
            "WORLD_SIZE": str(len(refs)),
            "LOCAL_RANK": str(local_ranks[ref.rank]),
            "LOCAL_WORLD_SIZE": str(local_sizes[ref.rank]),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }
        if ref.slot.device.startswith("cuda:"):  # the one GPU this slot's process owns
            env["CUDA_VISIBLE_DEVICES"] = ref.slot.device.split(":", 1)[1]
        envs.append(env)
    return envs


def _create_instances(
    backend: Backend,
    cls_with_init: ClassWithInitArgs,
    refs: list[InstanceRef],
    envs: list[dict[str, str]],
) -> None:
    """Build every ref's instance and wait; on failure drop the ones that were made."""
    futures = [
        backend.create(ref, cls_with_init.cls, cls_with_init.args, cls_with_init.kwargs, env)
        for ref, env in zip(refs, envs)
    ]
    try:
        backend.gather(futures)
    except BaseException:
        backend.destroy(refs)
        raise


def _check_env(worker_env: dict[str, str] | None) -> dict[str, str]:
    if worker_env is None:
        return {}
    if not isinstance(worker_env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in worker_env.items()
    ):
        raise TypeError("worker_env must be a dict of str to str")
    clash = sorted(set(worker_env) & {*RANK_ENV_KEYS, "CUDA_VISIBLE_DEVICES"})
    if clash:
        raise ValueError(
            f"worker_env may not set {clash}: the group assigns them per rank (rendezvous and "
            "devices included)"
        )
    return dict(worker_env)
