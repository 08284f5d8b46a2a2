"""``WorkerGroup``: the driver's handle on one role's ranks.

Every ``@register``-ed method of the worker class becomes a method here. Calling it runs
``check -> dispatch -> call every rank through the backend -> wait (if blocking) ->
collect -> unpad``. The checks refuse, in the driver and before anything is sent, what
would only fail on the ranks: arguments the method's signature cannot take, and futures
this group's backend cannot resolve (of a closed backend, or of another kind of
backend); the dispatch functions refuse data they cannot split. Nothing in this module
knows which backend runs the ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .backends.base import Backend, FutureList, InstanceRef, Slot, call_ranks
from .call_checks import check_fits, check_inputs
from .decorators import Dispatch, Execute, MethodSpec, get_method_spec, resolve_dispatch_mode
from .decorators.dispatch import DispatchFns, drop_padding
from .protocol import DataProtoFuture
from .rank_env import backend_name, rank_envs
from .resource_pool import ResourcePool
from .worker import GROUP_ENV_KEYS, RANK_ENV_KEYS, ClassWithInitArgs

__all__ = [
    "FUSED_EXECUTE",
    "FUSED_METHOD_SEP",
    "DirectRolloutCallError",
    "WorkerGroup",
    "bindable_methods",
    "registered_methods",
]

logger = logging.getLogger(__name__)

#: The fused worker's generic entry point and how its first argument names the role's
#: method: ``"<role>_fwmn_<method>"`` (verl's names).
FUSED_EXECUTE = "_fuw_execute"
FUSED_METHOD_SEP = "_fwmn_"

#: Worker methods the group itself provides under the same name (returning one value per
#: rank, as the bound method would), so they are not bound over.
_GROUP_PROVIDED = frozenset({"_query_dispatch_info", "_query_collect_info"})


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
        if name in _GROUP_PROVIDED:
            continue
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


class DirectRolloutCallError(NotImplementedError, TypeError):
    """A DIRECT_ROLLOUT_METHOD method was called from the driver.

    ``NotImplementedError`` as in verl; also a ``TypeError`` for code written against
    earlier releases of this package.
    """


#: verl keywords that only steer Ray (register-center waits, nsight profiling): accepted
#: so verl trainer code runs unchanged, and ignored.
RAY_ONLY_KEYWORDS = frozenset(
    {"ray_wait_register_center_timeout", "profile_steps", "worker_nsight_options"}
)


class _MeshInfo(dict):
    """``{mesh_name: per-rank value}``, as verl keeps ``_dispatch_info``/``_collect_info``.

    Calling it (``wg._dispatch_info(mesh)``) returns ``(dp_ranks, collect_mask)`` for
    dispatch functions written against earlier releases of this package.
    """

    def __init__(self, layout: Callable[[str], tuple[list[int], list[bool]]]) -> None:
        super().__init__()
        self._layout = layout

    def __call__(self, mesh_name: str) -> tuple[list[int], list[bool]]:
        return self._layout(mesh_name)


class WorkerGroup:
    """``world_size`` instances of one worker class, rank ``i`` on the pool's slot ``i``.

    The parameters follow verl's ``RayWorkerGroup``: ``resource_pool``, then
    ``cls_with_init`` (also accepted as ``ray_cls_with_init=``), ``bin_pack``,
    ``name_prefix``, ``detached``, ``worker_names``, ``worker_handles``. With
    ``resource_pool=None`` the group attaches to instances made earlier, found by
    ``worker_handles`` (the ``workers`` of another group), ``worker_names`` or
    ``name_prefix``. ``master_addr``/``master_port`` (both or neither) replace the pool's
    rendezvous; ``use_gpu=True`` on a CPU pool is an error; ``device_name``,
    ``bin_pack`` and ``detached`` are recorded (placement always packs each node's ranks
    on one host, and a group lives until ``shutdown()`` whoever made it). Ray-only
    keywords (``ray_wait_register_center_timeout``, ``profile_steps``,
    ``worker_nsight_options``) are accepted and ignored; any other keyword is a
    ``TypeError``.
    """

    #: verl's name of the fused worker's generic entry point.
    fused_worker_execute_fn_name = FUSED_EXECUTE

    # Set for a group that made its instances; ``None`` for views and attached groups.
    _cls_with_init: ClassWithInitArgs | None
    _master_addr: str | None
    _master_port: str | None

    if TYPE_CHECKING:
        # Registered methods are bound per instance at construction (``_bind_methods``).
        def __getattr__(self, name: str) -> Any: ...

    def __init__(
        self,
        resource_pool: ResourcePool | None = None,
        cls_with_init: ClassWithInitArgs | type | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list[InstanceRef] | None = None,
        *,
        backend: Backend | None = None,
        worker_env: dict[str, str] | None = None,
        ray_cls_with_init: ClassWithInitArgs | type | None = None,
        device_name: str = "cuda",
        use_gpu: bool | None = None,
        master_addr: str | None = None,
        master_port: int | str | None = None,
        **ray_only: Any,
    ) -> None:
        cls_with_init = _pick_cls_with_init(cls_with_init, ray_cls_with_init)
        _check_ray_only(ray_only)
        if not isinstance(device_name, str) or not device_name:
            raise TypeError(f"device_name must be a non-empty str, got {device_name!r}")
        rendezvous = _check_master(master_addr, master_port)
        if backend is None:
            from .runtime import default_backend

            backend = default_backend()
        self.bin_pack = bool(bin_pack)
        self.detached = bool(detached)
        self.device_name = device_name
        if resource_pool is None:
            self._attach(backend, cls_with_init, name_prefix, worker_names, worker_handles)
            self.use_gpu = use_gpu
            return
        if not isinstance(resource_pool, ResourcePool):
            raise TypeError(f"resource_pool must be a ResourcePool or None, got {resource_pool!r}")
        if worker_names is not None or worker_handles is not None:
            raise ValueError(
                "worker_names/worker_handles attach to existing instances; pass them with "
                "resource_pool=None (or use WorkerGroup.from_detached)"
            )
        if use_gpu and resource_pool.use_gpu is False:
            raise ValueError(
                "use_gpu=True but the resource pool was built with use_gpu=False; build it "
                "with use_gpu=True (or None for auto)"
            )
        self.use_gpu = resource_pool.use_gpu if use_gpu is None else use_gpu
        self._create(backend, resource_pool, cls_with_init, name_prefix, worker_env, rendezvous)

    def _create(
        self,
        backend: Backend,
        resource_pool: ResourcePool,
        cls_with_init: ClassWithInitArgs | None,
        name_prefix: str | None,
        worker_env: dict[str, str] | None,
        rendezvous: tuple[str, int] | None,
    ) -> None:
        if cls_with_init is None:
            raise TypeError(
                "WorkerGroup needs the worker class: WorkerGroup(pool, ClassWithInitArgs(Cls, "
                "...)) (or ray_cls_with_init=...)"
            )
        env_extra = _check_env(worker_env)
        cls = cls_with_init.cls
        methods = bindable_methods(cls)  # a class that cannot be bound fails before placing
        prefix = name_prefix or f"{cls.__name__}_{uuid.uuid4().hex[:6]}"
        if backend.lookup(prefix):
            raise ValueError(
                f"a worker group named {prefix!r} already exists on this backend; pick another "
                "name_prefix or attach to it with WorkerGroup.from_detached"
            )
        wg_backend = backend_name(backend)  # a backend without a name fails before placing
        slots = resource_pool.acquire(backend)
        try:
            addr, port = rendezvous or resource_pool.rendezvous(backend, slots)
            refs = [
                InstanceRef(prefix, rank, slot, cls.__name__) for rank, slot in enumerate(slots)
            ]
            envs = rank_envs(
                refs,
                resource_pool.local_rank_list(),
                resource_pool.local_world_size_list(),
                resource_pool.node_peers(),
                (addr, port),
                env_extra,
                wg_backend,
            )
            _create_instances(backend, cls_with_init, refs, envs)
        except BaseException:
            resource_pool.release()
            raise
        self._setup(backend, prefix, cls, refs, resource_pool, owner=True, methods=methods)
        self._cls_with_init = cls_with_init
        self._envs = envs
        self._master_addr, self._master_port = addr, str(port)
        logger.info("created worker group %s: %d x %s", prefix, len(refs), cls.__name__)

    def _attach(
        self,
        backend: Backend,
        cls_with_init: ClassWithInitArgs | None,
        name_prefix: str | None,
        worker_names: list[str] | None,
        worker_handles: list[InstanceRef] | None,
    ) -> None:
        if cls_with_init is None:
            raise TypeError(
                "attaching to existing workers needs their class to know the registered "
                "methods: pass ClassWithInitArgs(Cls) (or the class) as the second argument"
            )
        refs = _find_refs(backend, name_prefix, worker_names, worker_handles)
        group = refs[0].group
        self._setup(backend, group, cls_with_init.cls, refs, None, owner=False)
        self._cls_with_init = cls_with_init
        self._is_init_with_detached_workers = True

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
        sub_cls_name: str = "",
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
        self._is_init_with_detached_workers = False
        self._cls_with_init = None
        self._master_addr = None
        self._master_port = None
        self.sub_cls_name = sub_cls_name
        self.fused_worker_used = bool(getattr(cls, "is_fused_worker", False) or sub_cls_name)
        self.wg_dict: dict[str, WorkerGroup] | None = None
        self._dispatch_info = _MeshInfo(self._mesh_layout)
        self._collect_info = _MeshInfo(self._mesh_layout)
        bound = bindable_methods(cls) if methods is None else methods
        for name, (spec, fns) in bound.items():
            setattr(self, name, self._make_method(name, spec, fns))
        self.method_names = sorted(bound)

    # -- construction helpers ---------------------------------------------------------

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: list[str] | ClassWithInitArgs | type | None = None,
        worker_handles: list[InstanceRef] | None = None,
        ray_cls_with_init: ClassWithInitArgs | type | None = None,
        *,
        cls_with_init: ClassWithInitArgs | type | None = None,
        backend: Backend | None = None,
        **kwargs: Any,
    ) -> WorkerGroup:
        """Attach to a group created earlier (by this or another driver).

        Found by ``name_prefix``, ``worker_names`` or ``worker_handles``; the worker class
        (``ray_cls_with_init=``, ``cls_with_init=``, or the second positional argument as
        in earlier releases) says which methods to bind.
        """
        if isinstance(worker_names, (type, ClassWithInitArgs)):
            cls_with_init, worker_names = worker_names, None  # from_detached(name, Cls)
        cwia = _pick_cls_with_init(cls_with_init, ray_cls_with_init)
        return cls(
            None,
            cwia,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
            backend=backend,
            **kwargs,
        )

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One WorkerGroup per role of a fused (colocated) worker class, sharing its ranks.

        Each view binds its role's registered methods under their plain names; any other
        method of the role is reachable with ``execute_all_sync(name)`` and friends.
        """
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
                sub_cls_name=role,
            )
            view._cls_with_init = self._cls_with_init
            view._master_addr, view._master_port = self._master_addr, self._master_port
            view.use_gpu, view.device_name = self.use_gpu, self.device_name
            view.bin_pack, view.detached = self.bin_pack, self.detached
            views[role] = view
        return views

    spawn_fused = spawn

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """Spawn the role views once and hang them on the group: ``wg.actor.compute(...)``."""
        if self.wg_dict is None:
            self.wg_dict = self.spawn(prefix_set)
        for role, view in self.wg_dict.items():
            if hasattr(type(self), role):
                raise ValueError(
                    f"role {role!r} would hide WorkerGroup.{role}; use spawn() for this role"
                )
            setattr(self, role, view)

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

    @property
    def workers(self) -> list[InstanceRef]:
        """One handle per rank (verl: the Ray actors); ``worker_handles=`` takes them back."""
        return list(self._refs)

    @property
    def _workers(self) -> list[InstanceRef]:
        return self.workers

    @property
    def _worker_names(self) -> list[str]:
        return self.worker_names

    @property
    def _world_size(self) -> int:
        return self.world_size

    @property
    def master_address(self) -> str | None:
        """The group's ``MASTER_ADDR`` (``None`` for a group attached by name)."""
        return self._master_addr

    @property
    def master_port(self) -> str | None:
        """The group's ``MASTER_PORT`` as a string, as in verl (``None`` when attached)."""
        return self._master_port

    @property
    def resource_pool(self) -> ResourcePool | None:
        return self._pool

    @property
    def ray_cls_with_init(self) -> ClassWithInitArgs | None:
        """verl's name for the ``ClassWithInitArgs`` the group was built from."""
        return self._cls_with_init

    cls_with_init = ray_cls_with_init

    def start_worker_aliveness_check(self, every_n_seconds: float = 1) -> None:
        """Kept for verl code: death detection is always on here.

        The backend fails pending and later calls with ``WorkerLostError`` as soon as a
        rank's process dies, so no polling thread (and no SIGABRT, as in verl) is needed.
        """
        if not isinstance(every_n_seconds, (int, float)) or every_n_seconds <= 0:
            raise ValueError(f"every_n_seconds must be a positive number, got {every_n_seconds!r}")

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method_name`` on every rank.

        verl's rule: when every positional and keyword argument is a list of exactly
        ``world_size`` items, rank ``i`` gets item ``i`` of each; otherwise every rank gets
        all arguments whole (tuples are never split).
        """
        self._check_method(method_name)
        self._check_inputs(method_name, args, kwargs)
        futures = self._call_ranks(range(self.world_size), method_name, args, kwargs, True)
        return FutureList(futures, self._backend)

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``execute_all_async`` and wait: one result per rank."""
        self._check_method(method_name)
        self._check_inputs(method_name, args, kwargs)
        futures = self._call_ranks(
            range(self.world_size), method_name, args, kwargs, True, blocking=True
        )
        return self._backend.gather(futures)

    execute_all = execute_all_async

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        self._check_method(method_name)
        self._check_inputs(method_name, args, kwargs)
        return self._call_ranks([0], method_name, args, kwargs, True, split=False)[0]

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        self._check_method(method_name)
        self._check_inputs(method_name, args, kwargs)
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
        if not self._owner or self._pool is None or self._cls_with_init is None:
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

    def _query_dispatch_info(self, mesh_name: str) -> list[int]:
        """Each rank's DP index on ``mesh_name`` (asks every rank; see ``_dispatch_info``)."""
        return self.execute_all_sync("_query_dispatch_info", mesh_name)

    def _query_collect_info(self, mesh_name: str) -> list[bool]:
        """Whether each rank's output on ``mesh_name`` is collected."""
        return self.execute_all_sync("_query_collect_info", mesh_name)

    def _mesh_layout(self, mesh_name: str) -> tuple[list[int], list[bool]]:
        """``(dp_ranks, collect_mask)`` of ``mesh_name``, asked once, then kept in
        ``_dispatch_info``/``_collect_info`` (verl's caches, which callers may fill too)."""
        if mesh_name not in self._dispatch_info:
            self._dispatch_info[mesh_name] = self._query_dispatch_info(mesh_name)
        if mesh_name not in self._collect_info:
            self._collect_info[mesh_name] = self._query_collect_info(mesh_name)
        dp_ranks = list(self._dispatch_info[mesh_name])
        collect = [bool(c) for c in self._collect_info[mesh_name]]
        for name, values in (("dispatch", dp_ranks), ("collect", collect)):
            if len(values) != self.world_size:
                raise ValueError(
                    f"{name} info of mesh {mesh_name!r} has {len(values)} entries for "
                    f"{self.world_size} ranks"
                )
        if sorted(set(dp_ranks)) != list(range(max(dp_ranks) + 1)):
            raise ValueError(f"dp ranks of mesh {mesh_name!r} are not 0..n-1: {dp_ranks}")
        return dp_ranks, collect

    # -- internals ------------------------------------------------------------------------

    def _make_method(self, name: str, spec: MethodSpec, fns: DispatchFns) -> Callable[..., Any]:
        rank_zero = (
            spec.execute_mode is Execute.RANK_ZERO or spec.dispatch_mode is Dispatch.RANK_ZERO
        )

        def method(*args: Any, **kwargs: Any) -> Any:
            self._check_open()
            self._check_inputs(name, args, kwargs)
            if fns.passes_arguments:  # else checked on what the dispatch function made
                self._check_fits(name, args, kwargs)
            dispatched = self._dispatch(name, spec, fns, args, kwargs)
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
                checked=fns.passes_arguments,
            )
            if spec.blocking:
                outputs = self._backend.gather(futures)
            else:
                outputs = FutureList(futures, self._backend)
            if rank_zero:
                outputs = outputs[0]
            source = f"{self.name_prefix}.{name}"
            result = drop_padding(
                fns.collect_fn(self, outputs),
                pad,
                self._backend,
                source=source,
                parts=outputs if spec.blocking and not rank_zero else None,
            )
            if isinstance(result, DataProtoFuture):  # names its tasks and its producer
                result = dataclasses.replace(result, label=source)
            return result

        method.__name__ = name
        method.__qualname__ = f"{type(self).__name__}.{name}"
        method.__doc__ = getattr(getattr(self._cls, name, None), "__doc__", None)
        return method

    def _dispatch(
        self, name: str, spec: MethodSpec, fns: DispatchFns, args: tuple, kwargs: dict
    ) -> Any:
        if spec.dispatch_mode is not Dispatch.DIRECT_ROLLOUT_METHOD:
            try:
                return fns.dispatch_fn(self, *args, **kwargs)
            except (TypeError, ValueError) as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(
                        f"raised by the dispatch of {self.name_prefix}.{name} in the driver, "
                        "before anything was sent to its ranks"
                    )
                raise
        try:  # the built-in function refuses; a mode replaced by update_dispatch_mode may not
            return fns.dispatch_fn(self, *args, **kwargs)
        except (TypeError, NotImplementedError) as exc:
            raise DirectRolloutCallError(
                f"{name} is registered with Dispatch.DIRECT_ROLLOUT_METHOD: the rollout engine "
                "calls it inside the worker process; the driver cannot"
            ) from exc

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
        checked: bool = False,
    ) -> list[Any]:
        """``checked``: the caller already checked that the method takes these arguments
        (on the driver's own arguments, before dispatch): not again on every call."""
        self._check_open()
        split = split and _splits_per_rank(args, kwargs, self.world_size)
        if not checked:
            first = next(iter(ranks), 0) if split else None
            self._check_fits(
                method_name,
                tuple(a[first] for a in args) if split else args,
                {k: v[first] for k, v in kwargs.items()} if split else kwargs,
            )
        target, route = self._route(method_name)
        label = f"{self.name_prefix}.{method_name}"

        def pick(value: Any, rank: int) -> Any:
            if split:
                value = value[rank]
            if materialize and isinstance(value, DataProtoFuture):
                value = value.whole(self._refs[rank].slot)
            return value

        ranks = list(ranks)
        if split and all(_one_object(v) for v in (*args, *kwargs.values())):
            # each rank's item is the very same object (``ONE_TO_ALL``'s lists): as if unsplit
            args, kwargs = tuple(v[0] for v in args), {k: v[0] for k, v in kwargs.items()}
            split = False
        rank_args: list[tuple] = []
        rank_kwargs: list[dict] = []
        if not split and not (materialize and _any_proto_future(args, kwargs)):
            # Every rank is given the very same objects: one tuple and one dict for all
            # (which a backend may pack once for all of them).
            rank_args = [(*route, *args)] * len(ranks)
            rank_kwargs = [dict(kwargs)] * len(ranks)
        else:
            for rank in ranks:
                a = (*route, *(pick(v, rank) for v in args))
                kw = {k: pick(v, rank) for k, v in kwargs.items()}
                if rank_args:  # ranks given the very same objects share them here too
                    a, kw = _same_or(a, rank_args[-1]), _same_or(kw, rank_kwargs[-1])
                rank_args.append(a)
                rank_kwargs.append(kw)
        return call_ranks(
            self._backend,
            list(map(self._refs.__getitem__, ranks)),
            target,
            rank_args,
            rank_kwargs,
            label=label,
            blocking=blocking,
        )

    def _route(self, method_name: str) -> tuple[str, tuple[str, ...]]:
        """The instance method to call and the leading arguments that select the role.

        A spawned view calls ``<role>_<method>`` on the fused worker when the fused class
        has it, and otherwise goes through the fused worker's ``_fuw_execute``, so any
        method of the role can be reached (as verl routes it).
        """
        if not self._method_prefix:
            return method_name, ()
        prefixed = self._method_prefix + method_name
        fused_cls = self._parent._cls if self._parent is not None else None
        if fused_cls is None or callable(getattr(fused_cls, prefixed, None)):
            return prefixed, ()
        return FUSED_EXECUTE, (f"{self.sub_cls_name}{FUSED_METHOD_SEP}{method_name}",)

    def _check_method(self, method_name: str) -> None:
        if not isinstance(method_name, str) or not callable(getattr(self._cls, method_name, None)):
            raise ValueError(
                f"{self._cls.__name__} has no method {method_name!r}; "
                f"registered methods: {sorted(registered_methods(self._cls))}"
            )

    def _check_open(self) -> None:
        if self._closed or (self._parent is not None and self._parent._closed):
            raise RuntimeError(f"worker group {self.name_prefix} is shut down")

    def _check_fits(self, method_name: str, args: tuple, kwargs: dict) -> None:
        check_fits(self._cls, method_name, args, kwargs)

    def _check_inputs(self, method_name: str, args: tuple, kwargs: dict) -> None:
        check_inputs(
            self._backend, f"{self.name_prefix}.{method_name}", self.world_size, args, kwargs
        )


_MISSING = object()


def _one_object(items: list) -> bool:
    """Whether every item of ``items`` (a rank's each) is the very same object."""
    first = items[0]
    return all(item is first for item in items)


def _any_proto_future(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, DataProtoFuture) for v in (*args, *kwargs.values()))


def _same_or(made: Any, previous: Any) -> Any:
    """``previous`` if it holds the very same objects as ``made`` (a tuple or a dict)."""
    if len(made) != len(previous):
        return made
    if type(made) is dict:
        for key, value in made.items():
            if previous.get(key, _MISSING) is not value:
                return made
        return previous
    for x, y in zip(made, previous):
        if x is not y:
            return made
    return previous


def _splits_per_rank(args: tuple, kwargs: dict, n: int) -> bool:
    """verl's rule: split only when every argument is a list of exactly ``n`` items."""
    values = [*args, *kwargs.values()]
    return all(isinstance(v, list) and len(v) == n for v in values)


def _pick_cls_with_init(
    cls_with_init: ClassWithInitArgs | type | None,
    ray_cls_with_init: ClassWithInitArgs | type | None,
) -> ClassWithInitArgs | None:
    if cls_with_init is not None and ray_cls_with_init is not None:
        raise TypeError("pass the worker class once: cls_with_init or ray_cls_with_init, not both")
    chosen = cls_with_init if cls_with_init is not None else ray_cls_with_init
    if chosen is None or isinstance(chosen, ClassWithInitArgs):
        return chosen
    if isinstance(chosen, type):
        return ClassWithInitArgs(chosen)
    raise TypeError(f"cls_with_init must be a ClassWithInitArgs (or a class), got {chosen!r}")


def _check_ray_only(kwargs: dict[str, Any]) -> None:
    unknown = sorted(set(kwargs) - RAY_ONLY_KEYWORDS)
    if unknown:
        raise TypeError(
            f"WorkerGroup got unexpected keyword argument(s) {unknown}; it takes "
            "resource_pool, cls_with_init/ray_cls_with_init, bin_pack, name_prefix, detached, "
            "worker_names, worker_handles, backend, worker_env, device_name, use_gpu, "
            f"master_addr, master_port (and ignores {sorted(RAY_ONLY_KEYWORDS)})"
        )
    if kwargs:
        logger.debug("ignoring Ray-only WorkerGroup keywords %s", sorted(kwargs))


def _check_master(addr: str | None, port: int | str | None) -> tuple[str, int] | None:
    if addr is None and port is None:
        return None
    if addr is None or port is None:
        raise ValueError(
            "pass both master_addr and master_port to choose the rendezvous yourself, or "
            "neither to let the pool pick one"
        )
    try:
        number = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"master_port must be a port number, got {port!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {port!r}")
    return str(addr), number


def _find_refs(
    backend: Backend,
    name_prefix: str | None,
    worker_names: list[str] | None,
    worker_handles: list[InstanceRef] | None,
) -> list[InstanceRef]:
    """The instances an attaching group talks to, in rank order."""
    if worker_handles:
        if not all(isinstance(ref, InstanceRef) for ref in worker_handles):
            raise TypeError("worker_handles must be the .workers of another WorkerGroup")
        return sorted(worker_handles, key=lambda r: r.rank)
    if worker_names:
        groups = {str(name).rsplit("/", 1)[0] for name in worker_names}
        if len(groups) != 1:
            raise ValueError(
                f"worker_names must name ranks of one group ('<group>/<rank>'), got {worker_names}"
            )
        found = {ref.name: ref for ref in backend.lookup(groups.pop())}
        missing = [name for name in worker_names if name not in found]
        if missing:
            raise ValueError(f"no worker named {missing} exists on this backend")
        return sorted((found[name] for name in worker_names), key=lambda r: r.rank)
    if name_prefix:
        refs = sorted(backend.lookup(name_prefix), key=lambda r: r.rank)
        if not refs:
            raise ValueError(f"no worker group named {name_prefix!r} exists on this backend")
        return refs
    raise ValueError(
        "resource_pool=None attaches to existing workers: pass name_prefix=, worker_names= "
        "or worker_handles= of a group made earlier, or pass a ResourcePool to create new ones"
    )


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
    clash = sorted(set(worker_env) & {*RANK_ENV_KEYS, *GROUP_ENV_KEYS, "CUDA_VISIBLE_DEVICES"})
    if clash:
        raise ValueError(
            f"worker_env may not set {clash}: the group assigns them per rank (rendezvous and "
            "devices included)"
        )
    return dict(worker_env)
