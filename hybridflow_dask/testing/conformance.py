"""The conformance kit: the tests every ``Backend`` must pass (``backends/base.py``).

Run it against your backend with one option, a factory that returns a fresh backend::

    pytest --hf-backend=mypkg.mybackend:make_backend --pyargs hybridflow_dask.testing.conformance

The factory is called with no arguments for the backend under test (once per run, and
once more for the shutdown test). If it also takes a keyword ``attach_to``,
``factory(attach_to=backend)`` must return a second driver's backend on the same cluster:
the kit then checks that ``WorkerGroup.from_detached`` works across drivers.

Or, from a test module of your own, import the kit and override the factory fixture::

    from hybridflow_dask.testing.conformance import *  # noqa: F403

    @pytest.fixture(scope="module")
    def hf_backend_factory():
        return make_backend

(override ``hf_backend`` as well to test a backend you already hold; the kit then does
not shut it down if your fixture does not).

The tests about several ranks (environments, colocation, routing, errors in rank order,
a failed construction, a death and ``recover()``) run on pools of the kit's world size,
2 unless ``--hf-kit-world-size=N`` or an overridden ``hf_kit_world_size`` fixture says
otherwise; the tests about one instance keep their pools of one. At world size ``n`` the
kit holds at most ``max(n + 1, 3)`` slots at once: a pool of ``n`` ranks and one of 1.

Tests marked ``hf_processes`` kill a worker process, call ``recover()`` or attach a
second driver: a backend that hosts instances in the driver's own process declares
``in_process = True`` and those tests are skipped for it, with that reason. They run
last, since a killed process leaves the cluster a slot short until it is restarted. A
process may host several ranks (``DaskBackend(ranks_per_worker=k)``): killing the last
rank's process then takes all of its ranks, and ``recover()`` must rebuild exactly those.
The classes the kit runs live in
``hybridflow_dask.testing.conformance_workers``, which the hosting processes must be able
to import. ``docs/backends.md`` is the guide.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ..backends.base import Backend, InstanceRef, WorkerLostError
from ..errors import HybridFlowError
from ..protocol import DataProto, DataProtoFuture
from ..resource_pool import ResourcePool
from ..runtime import get
from ..worker import ClassWithInitArgs
from ..worker_group import WorkerGroup
from .conformance_workers import Probe, add, double

#: How long a call may take to fail once its worker is dead, before the kit calls it a hang.
DEATH_LIMIT_S = 10.0
#: How long any other single wait of the kit may take.
WAIT_LIMIT_S = 60.0

_NO_BACKEND = (
    "no backend to test: pass --hf-backend=MODULE:FACTORY (a callable returning a fresh "
    "Backend), or override the hf_backend_factory fixture in a module that imports this kit"
)


# ---- fixtures -------------------------------------------------------------------------


def load_factory(spec: str) -> Callable[..., Any]:
    """``"pkg.module:attr"`` (``attr`` may be dotted) to the callable it names."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise pytest.UsageError(f"--hf-backend takes MODULE:FACTORY, got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise pytest.UsageError(f"--hf-backend={spec} names {target!r}, which is not callable")
    return target


@pytest.fixture(scope="module")
def hf_backend_factory(pytestconfig: pytest.Config) -> Callable[..., Any]:
    """The factory under test, from ``--hf-backend`` (override this fixture instead)."""
    spec = pytestconfig.getoption("hf_backend", default=None)
    if not spec:
        pytest.fail(_NO_BACKEND, pytrace=False)
    return load_factory(spec)


@pytest.fixture(scope="module")
def hf_kit_world_size(pytestconfig: pytest.Config) -> int:
    """Ranks of the pools of the tests about several ranks: ``--hf-kit-world-size``, else
    2 (override this fixture in your module to fix it there)."""
    value = pytestconfig.getoption("hf_kit_world_size", default=None)
    return 2 if value is None else check_world_size(value)


def check_world_size(value: Any) -> int:
    """The kit's world size, refused unless a whole number from 2 (its tests need a rank 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise pytest.UsageError(
            f"the kit's world size must be a whole number from 2, got {value!r}"
        )
    return value


@pytest.fixture(scope="module")
def hf_backend(hf_backend_factory: Callable[..., Any]) -> Iterator[Any]:
    """One backend for the kit's tests, shut down after them."""
    backend = hf_backend_factory()
    yield backend
    backend.shutdown()


@pytest.fixture(autouse=True)
def hf_processes_only(request: pytest.FixtureRequest, hf_backend: Any) -> None:
    """Skips ``hf_processes`` tests for a backend that declares ``in_process = True``."""
    if request.node.get_closest_marker("hf_processes") and _in_process(hf_backend):
        pytest.skip(_in_process_reason(hf_backend))


@pytest.fixture
def hf_kit_group(hf_backend: Any) -> Iterator[Callable[..., WorkerGroup]]:
    """``make(pool, **kw)``: a ``Probe`` group on the backend, shut down after the test."""
    made: list[WorkerGroup] = []

    def make(pool: ResourcePool | list[int], *, fail_on_rank: int = -1, **kw: Any) -> WorkerGroup:
        if not isinstance(pool, ResourcePool):
            pool = ResourcePool(pool)
        cwia = ClassWithInitArgs(Probe, os.getpid(), fail_on_rank)
        kw.setdefault("name_prefix", _unique("kit"))
        group = WorkerGroup(pool, cwia, backend=hf_backend, **kw)
        made.append(group)
        return group

    yield make
    for group in reversed(made):
        group.shutdown()


@pytest.fixture
def hf_second_driver(hf_backend: Any, hf_backend_factory: Callable[..., Any]) -> Iterator[Any]:
    """``factory(attach_to=hf_backend)``: another driver's backend on the same cluster."""
    try:
        takes_it = "attach_to" in inspect.signature(hf_backend_factory).parameters
    except (TypeError, ValueError):
        takes_it = False
    if not takes_it:
        pytest.skip(
            "the backend factory takes no attach_to keyword, so the kit cannot make a second "
            "driver on the same cluster (see hybridflow_dask.testing.conformance)"
        )
    other = hf_backend_factory(attach_to=hf_backend)
    yield other
    other.shutdown()


@dataclass
class KilledRank:
    """What the kit saw after SIGKILLing the process of ``group``'s last rank."""

    group: WorkerGroup
    rank: int
    old_pid: int
    #: The ranks that lived in that process (``rank`` and any light ranks beside it).
    lost_ranks: list[int]
    outcome: str  # "raised", "returned" or "hung"
    error: BaseException | None
    value: Any
    seconds: float
    alive_after: bool
    #: What gathering a result ``rank`` finished before the kill did: ("returned", value),
    #: ("raised", error) or ("hung", None).
    kept_after: tuple[str, Any] = ("hung", None)


@pytest.fixture(scope="module")
def hf_killed_rank(hf_backend: Any, hf_kit_world_size: int) -> Iterator[KilledRank]:
    """A group whose last rank's process was killed, and what the next call did: one kill
    per kit run, shared by the death and recovery tests."""
    if _in_process(hf_backend):
        pytest.skip(_in_process_reason(hf_backend))
    group = WorkerGroup(
        ResourcePool([hf_kit_world_size]),
        ClassWithInitArgs(Probe, os.getpid()),
        backend=hf_backend,
        name_prefix=_unique("kit_killed"),
    )
    try:
        rank = hf_kit_world_size - 1
        ref = group.workers[rank]
        pids = [w["pid"] for w in group.where()]
        old_pid = pids[rank]
        group.execute_all_sync("record", "before the kill")
        kept = hf_backend.call(ref, "rank_and", ("kept",), {}, label=f"{ref.group}.rank_and")
        hf_backend.gather([kept])  # finished, and kept where the backend keeps results
        start = time.monotonic()
        hf_backend.call(ref, "exit_process", (), {}, label=f"{ref.group}.exit_process")
        # Calls run in issue order, so this one runs after the kill: it can only fail.
        outcome, value = _within(
            DEATH_LIMIT_S,
            lambda: _call(hf_backend, ref, "where"),
        )
        seconds = time.monotonic() - start
        error = value if outcome == "raised" else None
        kept_after = _within(DEATH_LIMIT_S, lambda: hf_backend.gather([kept])[0])
        yield KilledRank(
            group,
            rank,
            old_pid,
            [r for r, pid in enumerate(pids) if pid == old_pid],
            outcome,
            error,
            value,
            seconds,
            hf_backend.alive(ref.slot),
            kept_after,
        )
    finally:
        group.shutdown()


# ---- the contract's vocabulary ----------------------------------------------------------


def test_backend_has_a_name_and_every_protocol_method(hf_backend: Any) -> None:
    name = getattr(hf_backend, "name", None)
    assert isinstance(name, str) and name, (
        f"{type(hf_backend).__name__} has no `name` (a non-empty str such as 'dask'): the "
        "Backend protocol needs it, ranks see it as WG_BACKEND"
    )
    wanted = [m for m in dir(Backend) if not m.startswith("_") and callable(getattr(Backend, m))]
    missing = [m for m in wanted if not callable(getattr(hf_backend, m, None))]
    assert not missing, f"{type(hf_backend).__name__} lacks Backend methods {missing}"
    assert isinstance(hf_backend, Backend)


def test_place_returns_one_slot_per_rank_grouped_by_node(hf_backend: Any) -> None:
    slots = hf_backend.place([2, 1], False, _unique("kit_place"))
    try:
        assert len(slots) == 3, f"place([2, 1]) returned {len(slots)} slots, not one per rank"
        assert [s.index for s in slots] == [0, 1, 2], "Slot.index must be 0..n-1 in rank order"
        assert [s.node for s in slots] == [0, 0, 1], (
            f"Slot.node must be each rank's index into process_on_nodes: got "
            f"{[s.node for s in slots]} for [2, 1]"
        )
        assert slots[0].host == slots[1].host, "ranks of one node must share a host"
        bad = [s.device for s in slots if s.device != "cpu"]
        assert not bad, f"use_gpu=False must give 'cpu' slots, got devices {bad}"
    finally:
        hf_backend.release(slots)


def test_free_port_is_a_port_number(hf_backend: Any) -> None:
    slots = hf_backend.place([1], False, _unique("kit_port"))
    try:
        port = hf_backend.free_port(slots[0])
        assert isinstance(port, int) and 0 < port < 65536, f"free_port returned {port!r}"
    finally:
        hf_backend.release(slots)


# ---- the rank environment ---------------------------------------------------------------


def test_rank_env_is_in_os_environ_in_init_and_in_every_call(
    hf_backend: Any, hf_kit_group, hf_kit_world_size: int
) -> None:
    n = hf_kit_world_size
    group = hf_kit_group([n])
    for when, envs in (("__init__", group.env_at_init()), ("a call", group.env_now())):
        for rank, env in enumerate(envs):
            expected = {
                "RANK": str(rank),
                "WORLD_SIZE": str(n),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": group.master_address,
                "MASTER_PORT": group.master_port,
                "WG_PREFIX": group.name_prefix,
                "WG_BACKEND": hf_backend.name,
            }
            got = {k: env[k] for k in expected}
            assert got == expected, (
                f"rank {rank} saw another environment in {when} than create() was given: "
                f"{got} != {expected}"
            )


def test_colocated_instances_never_see_each_others_environment(
    hf_kit_group, hf_kit_world_size: int
) -> None:
    pool = ResourcePool([hf_kit_world_size])
    a = hf_kit_group(pool, worker_env={"KIT_ROLE": "a"})
    b = hf_kit_group(pool, worker_env={"KIT_ROLE": "b", "KIT_ONLY_B": "1"})
    pending = []
    for _ in range(3):  # interleaved, not waited for one by one
        pending += [("a", a.execute_all_async("env_now")), ("b", b.execute_all_async("env_now"))]
    for role, futures in pending:
        for rank, env in enumerate(get(futures)):
            wanted = {"KIT_ROLE": role, "KIT_ONLY_B": "1" if role == "b" else None}
            got = {k: env[k] for k in wanted}
            assert got == wanted, (
                f"rank {rank} of group {role} saw {got} (wanted {wanted}): colocated "
                "instances must each see only their own environment"
            )


# ---- instances and calls ----------------------------------------------------------------


def test_create_call_lookup_and_destroy_one_instance(hf_backend: Any) -> None:
    slots = hf_backend.place([1], False, _unique("kit_raw"))
    ref = InstanceRef(_unique("kit_raw"), 0, slots[0], "Probe")
    try:
        created = hf_backend.create(ref, Probe, (os.getpid(),), {}, {"KIT_ROLE": "raw"})
        assert hf_backend.gather([created]) == [None], "gathering create() must give None"
        found = [r.name for r in hf_backend.lookup(ref.group)]
        assert found == [ref.name], f"lookup({ref.group!r}) found {found}, not the instance"
        assert _call(hf_backend, ref, "env_now")["KIT_ROLE"] == "raw"
        assert _call(hf_backend, ref, "rank_and", 7) == (0, 7)
        hf_backend.destroy([ref])
        assert hf_backend.lookup(ref.group) == [], "lookup must not find destroyed instances"
        outcome, value = _within(WAIT_LIMIT_S, lambda: _call(hf_backend, ref, "rank_and", 8))
        assert outcome == "raised", (
            f"a call on a destroyed instance {outcome} ({value!r}); it must fail"
        )
    finally:
        hf_backend.destroy([ref])
        hf_backend.release(slots)


def test_from_detached_attaches_by_name_on_the_same_backend(
    hf_backend: Any, hf_kit_group, hf_kit_world_size: int
) -> None:
    group = hf_kit_group([hf_kit_world_size])
    group.execute_all_sync("record", "made")
    attached = WorkerGroup.from_detached(
        name_prefix=group.name_prefix, cls_with_init=ClassWithInitArgs(Probe), backend=hf_backend
    )
    assert attached.execute_all_sync("history") == [["made"]] * hf_kit_world_size


def test_calls_on_one_instance_run_in_issue_order(hf_backend: Any, hf_kit_group) -> None:
    ref = hf_kit_group([1]).workers[0]
    futures = []
    for i in range(40):
        if i % 9 == 4:  # now and then a blocking call, gathered at once
            assert _call(hf_backend, ref, "record", i) == i
        else:
            futures.append(hf_backend.call(ref, "record", (i,), {}, label=f"{ref.group}.record"))
    hf_backend.gather(futures)
    seen = _call(hf_backend, ref, "history")
    assert seen == list(range(40)), (
        f"calls on one instance ran out of issue order: issued 0..39, the instance ran {seen}"
    )


def test_calls_from_several_threads_run_one_at_a_time_each_threads_in_order(
    hf_backend: Any, hf_kit_group
) -> None:
    ref = hf_kit_group([1]).workers[0]
    errors: list[BaseException] = []

    def issue(thread: int) -> None:
        try:
            futures = [
                hf_backend.call(ref, "record", ((thread, i),), {}, label=f"{ref.group}.record")
                for i in range(10)
            ]
            hf_backend.gather(futures)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=issue, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_LIMIT_S)
    assert not errors, f"calls from several threads failed: {errors!r}"
    seen = _call(hf_backend, ref, "history")
    assert sorted(seen) == sorted((t, i) for t in range(4) for i in range(10)), (
        f"calls from 4 threads were lost or repeated: the instance ran {len(seen)} of 40"
    )
    for t in range(4):
        mine = [i for who, i in seen if who == t]
        assert mine == list(range(10)), f"thread {t}'s calls ran out of its issue order: {mine}"
    overlaps = _call(hf_backend, ref, "overlaps")
    assert overlaps == 0, f"{overlaps} calls ran while another call was inside the instance"


def test_async_methods_run_on_one_event_loop_per_instance_that_outlives_the_call(
    hf_backend: Any, hf_kit_group
) -> None:
    ref = hf_kit_group([1]).workers[0]
    loop = _call(hf_backend, ref, "start_ticker")
    later_loop, ticks, ticker_alive = _call(hf_backend, ref, "ticks_after", 0.05)
    assert later_loop == loop, "async def methods of one instance must share one event loop"
    assert ticker_alive, "a task an async method started was stopped when the call returned"
    assert ticks > 0, "a task an async method started made no progress in a later call"


def test_an_argument_that_cannot_travel_is_refused_at_the_call_naming_group_method_and_rank(
    hf_backend: Any, hf_kit_group
) -> None:
    group = hf_kit_group([1])
    ref = group.workers[0]
    with pytest.raises(TypeError) as caught:  # at the call, or at latest at its gather
        hf_backend.gather(
            [hf_backend.call(ref, "record", (threading.Lock(),), {}, label=f"{ref.group}.record")]
        )
    text = str(caught.value)
    assert f"{ref.group}.record" in text and "rank 0" in text, (
        f"an argument that cannot be pickled must be refused naming group, method and rank: {text}"
    )
    assert _call(hf_backend, ref, "record", "after") == "after"
    assert _call(hf_backend, ref, "history") == ["after"], "the refused call must not run"


def test_async_methods_start_in_issue_order_with_the_instances_other_calls(
    hf_backend: Any, hf_kit_group
) -> None:
    ref = hf_kit_group([1]).workers[0]
    futures = []
    for i in range(20):
        method = "record_async" if i % 2 == 0 else "record"
        futures.append(hf_backend.call(ref, method, (i,), {}, label=f"{ref.group}.{method}"))
    hf_backend.gather(futures)
    seen = _call(hf_backend, ref, "history")
    assert seen == list(range(20)), (
        "an async def method's body must start before any call made after it on the same "
        f"instance (calls overlap only after its first await); issued 0..19, started {seen}"
    )


# ---- futures ----------------------------------------------------------------------------


def test_futures_are_accepted_as_arguments_and_keyword_arguments(
    hf_backend: Any, hf_kit_group
) -> None:
    producer = hf_kit_group([2])
    consumer = hf_kit_group([1])
    made = producer.execute_all_async("rank_and", "x")  # one future per rank
    assert all(hf_backend.is_future(f) for f in made), "a non-blocking call must give futures"
    ref = consumer.workers[0]
    assert _call(hf_backend, ref, "rank_and", made[1]) == (0, (1, "x")), (
        "a future passed as an argument must arrive as its value"
    )
    kw = hf_backend.call(ref, "rank_and", (), {"value": made[0]}, label=f"{ref.group}.rank_and")
    assert hf_backend.gather([kw]) == [(0, (0, "x"))], (
        "a future passed as a keyword argument must arrive as its value"
    )
    split = consumer.execute_all_sync("rank_and", [made[1]])  # a list of world_size items
    assert split == [(0, (1, "x"))]


def test_gather_returns_plain_values_as_they_are(hf_backend: Any, hf_kit_group) -> None:
    ref = hf_kit_group([1]).workers[0]
    future = hf_backend.call(ref, "rank_and", (5,), {}, label=f"{ref.group}.rank_and")
    plain = [3, "text", None, {"k": [1]}]
    assert hf_backend.is_future(future)
    assert not any(hf_backend.is_future(v) for v in plain), "plain values are not futures"
    got = hf_backend.gather([future, *plain])
    assert got == [(0, 5), *plain], (
        f"gather must return non-future entries as they are, in order; got {got!r}"
    )


def test_submit_runs_a_function_on_future_inputs(hf_backend: Any, hf_kit_group) -> None:
    group = hf_kit_group([1])
    slot = group.workers[0].slot
    tensor = hf_backend.call(
        group.workers[0], "get_state", (), {}, label=f"{group.name_prefix}.get_state"
    )
    doubled = hf_backend.submit(double, tensor, slot=slot, label="kit.double")
    total = hf_backend.submit(add, 1, 2, label="kit.add")
    values = hf_backend.gather([doubled, total])
    assert values[0].tolist() == [0.0, 2.0, 4.0, 6.0], f"submit(double, future) gave {values[0]}"
    assert values[1] == 3


def test_data_proto_futures_route_each_consumer_rank_only_its_rows(
    hf_kit_group, hf_kit_world_size: int
) -> None:
    n = hf_kit_world_size
    wide = hf_kit_group([n])
    narrow = hf_kit_group([1])
    rows = 3 * n - 1  # 3 rows a rank once padded by one row: the last rank gets 2 and a pad
    batch = DataProto.from_dict({"idx": torch.arange(rows)}, auto_padding=True)
    first = wide.mark(batch)
    assert isinstance(first, DataProtoFuture)
    result = get(wide.mark(narrow.mark(first)))  # n ranks -> 1 -> n, worker to worker
    assert result.batch["idx"].tolist() == list(range(rows)), (
        f"the chain lost or added rows: {result.batch['idx'].tolist()}"
    )
    assert result.batch["by_rank"].tolist() == [i // 3 for i in range(rows)]
    (narrow_seen,) = narrow.execute_all_sync("history")
    assert narrow_seen == [list(range(rows))], (
        f"the 1-rank consumer got rows {narrow_seen}, not the {rows} rows without padding"
    )
    wide_seen = wide.execute_all_sync("history")
    for rank, seen in enumerate(wide_seen[:-1]):
        mine = [3 * rank, 3 * rank + 1, 3 * rank + 2]
        assert seen == [mine, mine], f"rank {rank} of {n} got rows {seen}, not {mine} twice"
    last = wide_seen[-1]
    assert [got[:2] for got in last] == [[rows - 2, rows - 1]] * 2, (
        f"rank {n - 1} of {n} got rows {last}: each consumer rank must get only its rows"
    )
    assert all(len(got) == 3 for got in last), "padding must even the ranks out"


def test_a_data_proto_future_passed_unmaterialized_resolves_inside_the_worker(
    hf_kit_group, hf_kit_world_size: int
) -> None:
    producer = hf_kit_group([hf_kit_world_size])
    consumer = hf_kit_group([1])
    rows = 2 * hf_kit_world_size  # two rows from each producer rank
    future = producer.mark(DataProto.from_dict({"idx": torch.arange(rows)}))
    (got,) = consumer.resolve_here(future)
    assert got["was_future"], "materialize_futures=False must hand the method the future"
    assert got["idx"] == list(range(rows)), (
        f"the DataProtoFuture resolved inside the worker gave rows {got['idx']}: its runner "
        "must be one that works there (DataProtoFuture.with_runner)"
    )


# ---- errors -----------------------------------------------------------------------------


def test_method_errors_keep_their_type_and_name_group_method_and_rank(
    hf_kit_group, hf_kit_world_size: int
) -> None:
    group = hf_kit_group([hf_kit_world_size])
    last = hf_kit_world_size - 1
    with pytest.raises(ValueError, match=f"failing on rank {last}") as info:
        group.execute_all_sync("fail", (last,))  # a tuple: every rank gets it whole
    _assert_names_origin(info.value, group.name_prefix, "fail", last)


def test_gather_raises_the_first_failure_in_rank_order(
    hf_kit_group, hf_kit_world_size: int
) -> None:
    n = hf_kit_world_size
    group = hf_kit_group([n])
    first = n // 2 - 1  # rank 0 at world size 2; past it, ranks before the first succeed
    with pytest.raises(ValueError, match=f"failing on rank {first} as asked"):  # then KeyErrors
        group.execute_all_sync("fail", tuple(range(first, n)))


def test_init_errors_name_the_group_and_rank_and_leave_no_instances(
    hf_backend: Any, hf_kit_group, hf_kit_world_size: int
) -> None:
    name = _unique("kit_init")
    last = hf_kit_world_size - 1
    with pytest.raises(ValueError, match=f"__init__ fails on rank {last} as asked") as info:
        hf_kit_group([hf_kit_world_size], fail_on_rank=last, name_prefix=name)
    _assert_names_origin(info.value, name, "__init__", last)
    assert hf_backend.lookup(name) == [], "a group that failed to build left instances"


# ---- colocation and shutdown ------------------------------------------------------------


def test_groups_on_one_pool_share_each_ranks_process(hf_kit_group, hf_kit_world_size: int) -> None:
    pool = ResourcePool([hf_kit_world_size])
    a, b = hf_kit_group(pool), hf_kit_group(pool)
    assert [r.slot for r in a.workers] == [r.slot for r in b.workers], (
        "groups on one pool must be given the pool's slots"
    )
    assert [w["pid"] for w in a.where()] == [w["pid"] for w in b.where()], (
        "rank i of groups on one pool must share a process"
    )


def test_shutdown_is_idempotent_and_refuses_later_use(hf_backend_factory) -> None:
    backend = hf_backend_factory()
    pool = ResourcePool([1])
    try:
        group = WorkerGroup(
            pool, ClassWithInitArgs(Probe, os.getpid()), backend=backend, name_prefix=_unique("k")
        )
        ref = group.workers[0]
        future = backend.call(ref, "rank_and", (1,), {}, label=f"{ref.group}.rank_and")
        backend.gather([future])
    finally:
        backend.shutdown()
    backend.shutdown()  # idempotent
    refused = {
        "place": lambda: backend.place([1], False, "kit_after"),
        "call": lambda: backend.call(ref, "rank_and", (2,), {}, label="kit.after"),
        "gather": lambda: backend.gather([future]),
        "lookup": lambda: backend.lookup(ref.group),
        "submit": lambda: backend.submit(add, 1, 2, label="kit.after"),
    }
    for what, use in refused.items():
        outcome, value = _within(WAIT_LIMIT_S, use)
        assert outcome == "raised" and isinstance(value, RuntimeError), (
            f"{what}() after shutdown() {outcome} {value!r}; it must raise RuntimeError"
        )
    assert backend.alive(ref.slot) is False, "alive() must be False after shutdown()"
    group.shutdown()  # a group shut down after its backend: destroy/release do nothing


# ---- copies -----------------------------------------------------------------------------


def test_arguments_are_captured_when_the_call_is_made(hf_backend: Any, hf_kit_group) -> None:
    ref = hf_kit_group([1]).workers[0]
    tensor = torch.zeros(3)
    nested = {"t": tensor, "items": [1, 2]}
    stored = hf_backend.call(ref, "store", (nested,), {}, label=f"{ref.group}.store")
    tensor.add_(5)
    nested["items"].append(3)
    hf_backend.gather([stored])
    loaded = _call(hf_backend, ref, "load")
    assert loaded["t"].tolist() == [0.0, 0.0, 0.0] and loaded["items"] == [1, 2], (
        f"the instance saw the caller's in-place changes made after the call ({loaded}): "
        "arguments must be captured when the call is made"
    )
    mine = torch.ones(2)
    _call(hf_backend, ref, "mutate_input", mine)
    assert mine.tolist() == [1.0, 1.0], "an instance changing its argument changed the caller's"


def test_results_are_captured_when_the_method_returns(hf_backend: Any, hf_kit_group) -> None:
    ref = hf_kit_group([1]).workers[0]
    early = hf_backend.call(ref, "get_state", (), {}, label=f"{ref.group}.get_state")
    _call(hf_backend, ref, "bump_state_in_place")
    (value,) = hf_backend.gather([early])
    assert value.tolist() == [0.0, 1.0, 2.0, 3.0], (
        f"a result gathered after a later call changed the instance's state reads {value}: "
        "results must be captured when the method returns"
    )
    mine = _call(hf_backend, ref, "get_state")
    mine.add_(1)
    again = _call(hf_backend, ref, "get_state")
    assert again.tolist() == [100.0, 101.0, 102.0, 103.0], (
        "the caller changing a result it gathered changed the instance's state"
    )


def test_a_consumer_changing_its_input_never_changes_the_producers_result(
    hf_backend: Any, hf_kit_group
) -> None:
    pool = ResourcePool([1])  # colocated: the result is handed over inside one process
    producer, consumer = hf_kit_group(pool), hf_kit_group(pool)
    made = hf_backend.call(
        producer.workers[0], "get_state", (), {}, label=f"{producer.name_prefix}.get_state"
    )
    _call(hf_backend, consumer.workers[0], "mutate_input", made)
    (value,) = hf_backend.gather([made])
    assert value.tolist() == [0.0, 1.0, 2.0, 3.0], (
        f"a consumer changing its input in place changed the producer's result: {value}"
    )
    state = _call(hf_backend, producer.workers[0], "get_state")
    assert state.tolist() == [0.0, 1.0, 2.0, 3.0], "...and the producer's own state"


# ---- death, recovery, second drivers ----------------------------------------------------


@pytest.mark.hf_processes
def test_pools_placed_apart_live_in_distinct_processes(hf_kit_group) -> None:
    (a,) = hf_kit_group([1]).where()
    (b,) = hf_kit_group([1]).where()
    assert a["pid"] != b["pid"], "two pools held at once were given one process"
    assert os.getpid() not in (a["pid"], b["pid"]), "instances run in the driver's process"


@pytest.mark.hf_processes
def test_from_detached_attaches_from_a_second_driver(
    hf_kit_group, hf_second_driver, hf_kit_world_size: int
) -> None:
    n = hf_kit_world_size
    group = hf_kit_group([n])
    group.execute_all_sync("record", "from the first driver")
    attached = WorkerGroup.from_detached(
        name_prefix=group.name_prefix,
        cls_with_init=ClassWithInitArgs(Probe),
        backend=hf_second_driver,
    )
    assert attached.world_size == n
    attached.execute_all_sync("record", "from the second driver")
    expected = [["from the first driver", "from the second driver"]] * n
    assert group.execute_all_sync("history") == expected, (
        "a second driver's calls did not reach the first driver's instances"
    )


@pytest.mark.hf_processes
def test_a_killed_worker_fails_the_next_call_with_worker_lost_error_naming_group_and_rank(
    hf_killed_rank: KilledRank,
) -> None:
    k = hf_killed_rank
    assert k.outcome != "hung", (
        f"a call to rank {k.rank}, whose process was killed, did not finish within "
        f"{DEATH_LIMIT_S:g}s: a backend must fail it with WorkerLostError, not wait"
    )
    assert k.outcome == "raised", (
        f"a call to rank {k.rank}, whose process was killed, returned {k.value!r}: the "
        "worker was lost silently; it must raise WorkerLostError"
    )
    assert isinstance(k.error, WorkerLostError), (
        f"a call to a killed rank raised {type(k.error).__name__}: {k.error}; it must raise "
        "WorkerLostError"
    )
    assert isinstance(k.error, HybridFlowError), "WorkerLostError must be a HybridFlowError"
    text = str(k.error)
    assert k.group.name_prefix in text and f"rank {k.rank}" in text, (
        f"WorkerLostError must name the group {k.group.name_prefix!r} and 'rank {k.rank}': {text!r}"
    )


@pytest.mark.hf_processes
def test_a_result_finished_before_a_death_is_returned_intact_or_lost_never_anything_else(
    hf_backend: Any, hf_killed_rank: KilledRank
) -> None:
    outcome, value = hf_killed_rank.kept_after
    made = (hf_killed_rank.rank, "kept")
    assert outcome != "hung", (
        f"gathering a result of a killed rank did not finish within {DEATH_LIMIT_S:g}s"
    )
    if getattr(hf_backend, "results_outlive_workers", False):
        assert (outcome, value) == ("returned", made), (
            "results_outlive_workers = True, but a result finished before the worker died "
            f"was not returned: {outcome} {value!r}"
        )
    elif outcome == "returned":  # kept outside the process that made it (held by the driver)
        assert value == made, (
            f"a result finished before its worker died came back changed: {value!r}"
        )
    else:
        assert isinstance(value, WorkerLostError), (
            "a result lost with its worker must fail its gather with WorkerLostError: "
            f"{outcome} {value!r}"
        )


@pytest.mark.hf_processes
def test_alive_is_false_for_a_killed_workers_slot(hf_killed_rank: KilledRank) -> None:
    assert not hf_killed_rank.alive_after, (
        "alive(slot) is still True for a slot whose process was killed"
    )


@pytest.mark.hf_processes
def test_recover_rebuilds_the_killed_rank_in_a_new_process(hf_killed_rank: KilledRank) -> None:
    group, lost = hf_killed_rank.group, hf_killed_rank.lost_ranks
    outcome, value = _within(WAIT_LIMIT_S * 2, group.recover)
    assert outcome == "returned", f"recover() {outcome}: {value!r}"
    assert value == lost, f"recover() rebuilt ranks {value}, not {lost} (the killed process's)"
    pids = [w["pid"] for w in group.where()]
    stale = [r for r in lost if pids[r] == hf_killed_rank.old_pid]
    assert not stale, f"ranks {stale} were not rebuilt in a new process"
    wanted = [[] if r in lost else ["before the kill"] for r in range(group.world_size)]
    assert group.execute_all_sync("history") == wanted, (
        f"after recover() the ranks of other processes must keep their state and ranks {lost} "
        "start from __init__"
    )


# ---- helpers ----------------------------------------------------------------------------


def _call(backend: Any, ref: InstanceRef, method: str, *args: Any) -> Any:
    """A blocking call gathered at once, as WorkerGroup makes them."""
    future = backend.call(ref, method, args, {}, label=f"{ref.group}.{method}", blocking=True)
    return backend.gather([future])[0]


def _within(seconds: float, fn: Callable[[], Any]) -> tuple[str, Any]:
    """``("returned", value)``, ``("raised", exc)`` or ``("hung", None)`` after ``seconds``:
    a backend that waits forever fails the test with a message instead of hanging it."""
    box: list[tuple[str, Any]] = []

    def run() -> None:
        try:
            box.append(("returned", fn()))
        except BaseException as exc:
            box.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True, name="hf-kit-wait")
    thread.start()
    thread.join(seconds)
    return box[0] if box else ("hung", None)


def _assert_names_origin(exc: BaseException, group: str, method: str, rank: int) -> None:
    notes = "\n".join(getattr(exc, "__notes__", []))
    for part in (group, method, f"rank {rank}") if sys.version_info >= (3, 11) else ():
        assert part in notes, (
            f"{type(exc).__name__} from {group}.{method} on rank {rank} carries no note naming "
            f"{part!r} (notes: {notes!r}); annotate it with hosting.annotate_error"
        )
    origin = getattr(exc, "hybridflow_origin", None)
    assert origin == (group, method, rank), f"exc.hybridflow_origin is {origin!r}"


def _in_process(backend: Any) -> bool:
    return getattr(backend, "in_process", False) is True


def _in_process_reason(backend: Any) -> str:
    name = getattr(backend, "name", type(backend).__name__)
    return (
        f"backend {name!r} hosts instances in the driver's process (in_process = True): "
        "this test needs worker processes it can kill or reach from a second driver"
    )


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:6]}"


#: What ``from hybridflow_dask.testing.conformance import *`` brings: the fixtures and the
#: tests, in the order they are written (so both ways of running the kit run them in the
#: same order, the process tests last).
__all__ = [
    name
    for name in list(globals())
    if name.startswith(("test_", "hf_"))
    or name in ("KilledRank", "check_world_size", "load_factory")
]
