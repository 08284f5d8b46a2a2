"""The narrow boundary between the programming model and whatever runs the workers.

A backend speaks plain terms only: slots (places where instances live), classes and
arguments, method names, futures. WorkerGroups, dispatch modes and padding live above
this line and are the same code for every backend.

The protocol is three small groups, one per caller, and ``Backend`` is their union:

- ``Placement`` (used by ``ResourcePool``): ``place``, ``release``, ``free_port``,
  ``alive``, ``replace``;
- ``Instances`` (used by ``WorkerGroup``): ``create``, ``call``, ``destroy``, ``lookup``;
- ``Futures`` (used by ``DataProtoFuture``, ``hybridflow_dask.get`` and every gather):
  ``submit``, ``gather``, ``is_future``;

plus ``name``, ``closed`` and ``shutdown``. Optional members, read where present:
``dashboard_link`` (a URL where people watch the backend's work, or ``None``),
``call_ranks`` (one call to several ranks, which the backend may send together: see
``call_ranks`` below, which the core calls),
``future_problem(obj)`` (why one of its futures can no longer be an argument, e.g. made
by a client since closed, or ``None``; the core refuses such a call before sending it),
``in_process`` and ``results_outlive_workers`` (below). The docstrings below are the
contract: what each method must guarantee, not only what it takes.
``hybridflow_dask.testing.conformance`` checks it (``docs/backends.md`` says how to run
it against your backend).

Guarantees that span several methods:

- **Copies.** Arguments are captured when ``create``/``call``/``submit`` is made, and a
  result when the method returns: neither the caller changing an argument in place
  afterwards, nor the instance changing a returned object in a later call, nor a consumer
  changing its input changes what the other side sees. (A remote backend gets this from
  serialization; an in-process one must copy.)
- **One environment per instance.** While an instance's ``__init__`` or any of its
  methods runs, ``os.environ`` holds that instance's ``env`` (given to ``create``) and no
  other instance's extra variables, even when colocated instances share a process.
- **``async def`` methods** run to completion on an event loop that belongs to the
  instance and lives as long as it does (tasks it starts keep their loop between calls).
- **Order.** Calls to one instance start in the order ``call`` was invoked (whichever
  thread invoked it, and whether or not their inputs are ready yet). A ``def`` method
  runs alone: the next call starts when it has returned. An ``async def`` method's body
  starts before the next call does, and the next call starts once it reaches its first
  ``await`` (so coroutine calls overlap only while they wait, as on a Ray async actor); an
  in-process backend may instead run each coroutine to its end before the next call, which
  keeps the same order. The kit checks both orders.
- **Time limits.** A call made while ``hybridflow.call-timeout`` is set (``dask.config``)
  never starts after that many seconds from when it was made, and ``gather`` never waits
  longer for it: ``CallTimeoutError`` (a ``TimeoutError``), saying which ranks' calls were
  withdrawn (they will not run) and which were running (they may still finish). A backend
  without remote processes has nothing to time out (its calls run inline).
- **Errors** from ``__init__`` or a method reach ``gather`` with their own type, a note
  ``"raised by {group}.{method} on rank {rank} ..."`` (``hosting.annotate_error`` writes
  it, and sets ``exc.hybridflow_origin = (group, method, rank)`` and
  ``exc.remote_traceback``; notes need Python 3.11). An exception that cannot travel
  becomes a ``RuntimeError`` carrying the same (``hosting.sendable``).
- **Death.** When the process behind a slot dies, every pending and later call and create
  on its instances raises ``WorkerLostError`` naming the group and rank, promptly (the kit
  allows ``DEATH_LIMIT_S``, 10 s; the project's backends take well under a second), never
  a hang; ``alive`` turns ``False`` for the slot. A gather of a result the slot had
  already finished either returns it intact (where the backend keeps it outside that
  process: Ray's object store, the Dask backend's driver for small results) or raises
  ``WorkerLostError``; never anything else. A backend that keeps every result outside
  declares ``results_outlive_workers = True``, and must then return it.
- **Losing the cluster.** A backend whose instances live in a cluster it reaches over the
  network raises ``SchedulerLostError`` once the cluster's coordinator is gone for longer
  than its limit, from every call and gather; an address where none answers at start-up
  is ``SchedulerUnreachableError``. Every failure of the library itself is a
  ``hybridflow_dask.HybridFlowError`` (``errors``).
- **Shutdown racing a wait.** ``shutdown`` from another thread makes a ``gather`` or
  ``call`` in progress raise ``RuntimeError`` (the backend was shut down), never hang.

Optional attribute, read by the conformance kit only: ``in_process = True`` says the
backend runs instances inside the driver's process (like ``LocalBackend``), so the tests
that need separate processes (a killed worker, ``recover()``, a second driver) are
skipped for it, with that reason. Absent means ``False``.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..errors import WorkerLostError, WorkerUnreachableError

__all__ = [
    "Backend",
    "BackendFuture",
    "FutureList",
    "Futures",
    "InstanceRef",
    "Instances",
    "Placement",
    "Slot",
    "WorkerLostError",
    "WorkerUnreachableError",
    "call_ranks",
]


@dataclass(frozen=True)
class Slot:
    """One place a rank can live: a worker process (and the device it owns, if any).

    ``index`` is the slot's position in what ``place`` returned; ``address`` is backend
    specific (a Dask worker address, or ``"local"``); ``host`` is what ``MASTER_ADDR`` is
    taken from, and slots on one host must have equal ``host``; ``node`` is the index into
    the pool's ``process_on_nodes`` this slot was placed for.

    ``device`` is ``"cpu"`` or ``"cuda:<id>"``, where ``<id>`` is how
    ``CUDA_VISIBLE_DEVICES`` names that GPU on the slot's host (an index or a UUID). The
    core builds each rank's ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK`` from it
    (``hybridflow_dask.rank_env``); anything else is a ``ValueError`` there.
    """

    index: int
    address: str
    host: str
    node: int = 0
    device: str = "cpu"
    name: str = ""
    #: The process behind the slot, where the backend can tell incarnations apart (a
    #: worker restarted at the same address is a different process).
    worker_id: str = ""


@dataclass(frozen=True)
class InstanceRef:
    """A handle on one rank's instance: which group it belongs to and where it lives.

    Made by the core, kept by the backend (``lookup`` returns them): it must survive
    pickling, since another driver may receive it.
    """

    group: str
    rank: int
    slot: Slot
    cls_name: str = ""
    #: Tells apart instances that reuse a group name and rank (a group made again, a
    #: recovered rank), so a late teardown of the old one never touches the new one.
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    # Cached (in the instance's ``__dict__``, which a frozen dataclass still has): a
    # group call reads them several times per rank.
    @functools.cached_property
    def name(self) -> str:
        """``"{group}/{rank}"``: how people see the rank."""
        return f"{self.group}/{self.rank}"

    @functools.cached_property
    def key(self) -> str:
        """Unique per instance: what backends index instances and call order by."""
        return f"{self.name}#{self.uid}"


class FutureList(list):
    """The per-rank futures of a non-blocking call, remembering the backend that made them.

    A plain list to the caller; ``hybridflow_dask.get`` gathers it through the backend,
    which can fail fast when a worker dies instead of waiting on each future in turn.
    """

    def __init__(self, futures: Any, backend: Backend) -> None:
        super().__init__(futures)
        self.backend = backend

    def __reduce__(self) -> tuple:
        return (list, (list(self),))


@runtime_checkable
class BackendFuture(Protocol):
    """A backend's future. The core waits through ``Futures.gather``, never on the future
    itself, and asks ``done`` only to tell futures from plain values (and to see which
    finished); ``result`` is there for people who hold one."""

    def result(self, timeout: float | None = None) -> Any: ...

    def done(self) -> bool: ...


@runtime_checkable
class Placement(Protocol):
    """Where ranks live. Used by ``ResourcePool``: it places a pool once, on its first
    group, shares the slots between the groups on the pool, and releases them with the
    last group; ``WorkerGroup.recover`` asks ``alive`` and, through the pool, ``replace``.
    """

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        """Reserve one slot per rank of a pool, in rank order.

        ``process_on_nodes[i]`` ranks share a host (``Slot.node == i`` for them, equal
        ``host``). ``use_gpu``: ``True`` needs a GPU per slot, ``False`` none, ``None``
        GPUs if every slot can have one. A slot stays the pool's until ``release``; two
        pools never get the same slot while both hold it, unless the backend documents
        that its slots take several pools. A pool that cannot fit is a ``ValueError``
        that says what is missing; raises ``RuntimeError`` after ``shutdown``.
        """
        ...

    def release(self, slots: Sequence[Slot]) -> None:
        """Give slots back once no group uses them (their instances are destroyed)."""
        ...

    def free_port(self, slot: Slot) -> int:
        """A TCP port free on ``slot.host`` now, for ``MASTER_PORT`` (1..65535)."""
        ...

    def alive(self, slot: Slot) -> bool:
        """Whether the process behind ``slot`` is still the one instances were made in.

        ``False`` once it died (even if a new process took its address) and after
        ``shutdown``; must not block for long.
        """
        ...

    def replace(self, slot: Slot) -> Slot:
        """A live slot on the same host as a dead one, to re-create its instances on.

        May wait for the host to restart a process; raises when none comes. Called once
        per dead slot of a pool: colocated groups recover onto the same new slot.
        """
        ...


@runtime_checkable
class Instances(Protocol):
    """Stateful instances and calls on them. Used by ``WorkerGroup``.

    Arguments handed to ``create``/``call``/``submit`` may contain this backend's futures
    at the top level of ``args`` or as values of ``kwargs``: the backend waits for them and
    passes their values, where the call runs, so data never needs to pass through the
    driver. A ``DataProtoFuture`` there (a method registered with
    ``materialize_futures=False``) is passed as a future: the backend hands the instance
    one whose runner resolves inside the hosting process
    (``fut.with_runner(runner_there)``), as the driver's runner may not exist there.
    """

    def create(
        self,
        ref: InstanceRef,
        cls: type,
        args: tuple,
        kwargs: dict,
        env: dict[str, str],
    ) -> BackendFuture:
        """Construct ``cls(*args, **kwargs)`` on ``ref.slot`` with ``env`` in ``os.environ``.

        ``env`` is the rank's environment (``rank_env.rank_envs``: ``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ... and the group's ``worker_env``); it is in place
        before the class body runs and again for every call on the instance, and no other
        instance sees it. Returns a future; gathering it yields ``None`` or raises the
        annotated ``__init__`` error (method ``"__init__"``). ``ref`` is kept for
        ``lookup``. ``cls`` is picklable by reference (a module-level class).
        """
        ...

    def call(
        self,
        ref: InstanceRef,
        method: str,
        args: tuple,
        kwargs: dict,
        *,
        label: str,
        blocking: bool = False,
    ) -> BackendFuture:
        """Call ``method`` on the instance; returns a future of its result at once.

        Calls to one instance run in issue order, one at a time (see the module's
        guarantees, as for copies, environment, ``async def`` methods and errors).
        ``label`` (``"group.method"``) names the call wherever the backend shows work.
        ``blocking`` says the caller gathers the result at once, so a backend may hand the
        value back with its reply instead of keeping it where it was computed. A call to a
        destroyed instance fails (at the call or at gather); to a dead one, with
        ``WorkerLostError``; after ``shutdown``, ``RuntimeError``.
        """
        ...

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        """Drop instances (a group's shutdown): no longer callable nor found by ``lookup``.

        Never raises for instances already gone or on dead slots; calls issued before it
        on an instance may still run first.
        """
        ...

    def lookup(self, group: str) -> list[InstanceRef]:
        """Instances of a named group made earlier and not destroyed, by this driver or,
        for a backend whose instances outlive drivers, by another one attached to the same
        cluster (``WorkerGroup.from_detached``). ``[]`` when none."""
        ...


@runtime_checkable
class Futures(Protocol):
    """Resolving futures. Used by ``DataProtoFuture`` (row routing), ``hybridflow_dask.get``
    and every gather the core makes; ``protocol.future.FutureRunner`` is the same shape."""

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Slot | None = None, label: str = "hf"
    ) -> BackendFuture:
        """Run a plain function (row routing, small bookkeeping) near its inputs.

        ``args`` may hold this backend's futures (top level): ``fn`` gets their values.
        ``slot`` says where to run it (``None``: anywhere, ideally next to the inputs). A
        future of a dead slot's data fails with ``WorkerLostError``. ``fn`` is a
        module-level function of this package (picklable by reference).
        """
        ...

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        """Materialize futures in the driver, in order, raising the first failure.

        Entries that are not this backend's futures (``is_future`` is ``False``) come
        back as they are. When several fail, the first in list order (rank order) is
        raised, once the ones before it are done; a lost worker raises
        ``WorkerLostError`` at once. The values are the driver's own: changing them never
        reaches an instance or another gather.
        """
        ...

    def is_future(self, obj: Any) -> bool:
        """Whether ``obj`` is one of this backend's futures (what ``gather``/``call``
        resolve). ``False`` for plain values and other backends' futures."""
        ...


@runtime_checkable
class Backend(Placement, Instances, Futures, Protocol):
    """Runs stateful instances on slots and methods on instances, returning futures.

    ``name`` (``"local"``, ``"dask"``, ...) is what ranks find in ``WG_BACKEND``; nothing
    in the core depends on the backend's class.
    """

    name: str

    @property
    def closed(self) -> bool:
        """Whether ``shutdown`` was called. The core refuses, before sending anything, a
        call whose arguments hold futures of a closed backend (their results are gone)."""
        ...

    def shutdown(self) -> None:
        """Stop what this backend started; idempotent.

        Afterwards ``place``, ``free_port``, ``replace``, ``create``, ``call``, ``lookup``,
        ``submit`` and ``gather`` raise ``RuntimeError``; ``release`` and ``destroy`` do
        nothing (groups may shut down after their backend), ``alive`` is ``False``. The
        instances it made are gone.
        """
        ...


def call_ranks(
    backend: Instances,
    refs: Sequence[InstanceRef],
    method: str,
    args: Sequence[tuple],
    kwargs: Sequence[dict],
    *,
    label: str,
    blocking: bool = False,
) -> list[BackendFuture]:
    """``backend.call(refs[i], method, args[i], kwargs[i], ...)`` for each rank, in order.

    A backend may offer ``call_ranks`` with this signature: it promises exactly what
    that sequence of calls promises (order per instance, copies, deadlines, errors
    and deaths per rank), and may send the parts together (one message per worker
    process, arguments shared by several ranks packed once). Checks that would refuse
    one rank's part (a dead rank, an argument that cannot travel) refuse the whole call
    before any part is sent.
    """
    together = getattr(backend, "call_ranks", None)
    if together is not None:
        return together(refs, method, args, kwargs, label=label, blocking=blocking)
    return [
        backend.call(ref, method, a, kw, label=label, blocking=blocking)
        for ref, a, kw in zip(refs, args, kwargs)
    ]
