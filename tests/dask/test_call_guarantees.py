"""Ray actor call semantics, on LocalBackend and on every Dask call path.

A call works on its arguments as they were when it was issued, a result keeps the values
the method returned (later in-place changes of the instance's state, of the driver's
arguments or of a consumer's input never reach it, fetched or passed on), calls on one
instance run one at a time in each caller's issue order, and mixed large and small
traffic from many threads on one lane finishes. Random programs are checked against a
pure-torch model of the workers, so every backend answers to the same reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import dask
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend, LocalBackend
from hybridflow_dask.backends.base import FutureList

DEFAULT_PATH = {
    "hybridflow.call-path": "direct",
    "hybridflow.socket-lane": True,
    "hybridflow.same-host-copy": True,
}
PATHS = {
    "lane": {},
    "lane-nocopy": {"hybridflow.same-host-copy": False},
    "direct": {"hybridflow.socket-lane": False},
    "task": {"hybridflow.call-path": "task"},
}
FACTORS = {"A": 1, "B": 3, "C": -2}  # C shares A's pool (colocated), B has its own
BIG = 262_144  # int64 elements: 2 MiB, above the lane's 1 MiB same-host-copy threshold
MiB = 1 << 20
PROGRAM_SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,  # the same programs on every path
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: examples cost real calls
    suppress_health_check=list(HealthCheck),  # function-scoped autouse fixtures, slow calls
)


def later(method: Callable, mode: Any) -> Callable:
    """The non-blocking twin of a registered worker method."""

    def twin(self, *args):
        return method(self, *args)

    twin.__name__ = method.__name__ + "_later"
    return hf.register(mode, blocking=False)(twin)


ONE, DP = hf.Dispatch.ONE_TO_ALL, hf.Dispatch.DP_COMPUTE_PROTO


class Cell(hf.Worker):
    """int64 state rows per rank; every result is exact, so a model predicts it."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor
        self.rows = torch.zeros(1, 1, dtype=torch.int64)
        self.keyed: dict[str, torch.Tensor] = {}
        self.count = 0

    @hf.register(ONE)
    def reset(self, rows: int, width: int, keys: tuple[str, ...] = ()) -> None:
        self.rows = initial_rows(self.rank, rows, width)
        self.keyed = {key: torch.zeros(width, dtype=torch.int64) for key in keys}
        self.count = 0

    @hf.register(ONE)
    def add(self, x):
        self.rows.add_(x)
        return int(self.rows.sum())

    @hf.register(ONE)
    def peek(self):
        return self.rows  # the instance's own tensor, not a copy

    @hf.register(ONE)
    def bump(self):
        self.rows.add_(1)

    @hf.register(DP)
    def accumulate(self, data):
        self.rows.add_(data.batch["x"])
        return hf.DataProto.from_dict({"x": self.rows})  # wraps the instance's own tensor

    @hf.register(DP)
    def scale(self, data):
        x = data.batch["x"]
        x.mul_(self.factor)  # in place: must never reach the producer's result
        return hf.DataProto.from_dict({"x": x})

    @hf.register(ONE)
    def keyed_add(self, key, x):
        count = self.count  # a read-modify-write that loses counts if two calls overlap
        time.sleep(0.001)
        self.count = count + 1
        self.keyed[key].add_(x)
        return self.keyed[key]  # own state

    @hf.register(ONE)
    def calls(self):
        return self.count

    add_later, peek_later, bump_later = later(add, ONE), later(peek, ONE), later(bump, ONE)
    accumulate_later, scale_later = later(accumulate, DP), later(scale, DP)
    keyed_add_later = later(keyed_add, ONE)


def initial_rows(rank: int, rows: int, width: int) -> torch.Tensor:
    return torch.arange(rows * width, dtype=torch.int64).reshape(rows, width) + 1000 * rank


def make_backend(path: str, request: pytest.FixtureRequest) -> Any:
    if path == "local":
        return LocalBackend()
    with dask.config.set({**DEFAULT_PATH, **PATHS[path]}):
        return DaskBackend(cluster=request.getfixturevalue("hf_dask_cluster"))


@pytest.fixture(
    scope="module",
    params=["local", *(pytest.param(path, marks=pytest.mark.cluster) for path in PATHS)],
)
def groups(request):
    """A (2 ranks), B on a pool of its own, C colocated with A; one backend per path."""
    backend = make_backend(request.param, request)
    made: list[hf.WorkerGroup] = []
    try:
        pool_a = hf.ResourcePool([2])
        for name, pool in (("A", pool_a), ("B", hf.ResourcePool([2])), ("C", pool_a)):
            cwia = hf.ClassWithInitArgs(Cell, FACTORS[name])
            made.append(hf.WorkerGroup(pool, cwia, backend=backend))
        with dask.config.set({"hybridflow.call-timeout": "30s"}):  # a hang is an error
            yield dict(zip("ABC", made))
    finally:
        for group in reversed(made):
            group.shutdown()
        backend.shutdown()


def value_of(x: Any) -> Any:
    if isinstance(x, hf.DataProtoFuture):
        x = hf.get(x)
    if isinstance(x, hf.DataProto):
        return x.batch["x"]
    return hf.get(x) if isinstance(x, FutureList) else x


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    return got == want


def run_threads(jobs: dict[str, Callable[[], Any]], timeout: float) -> dict[str, Any]:
    """Run each job in a daemon thread; fail naming the jobs stuck or failed."""
    results: dict[str, Any] = {}

    def run(name: str, job: Callable[[], Any]) -> None:
        try:
            results[name] = job()
        except BaseException as exc:
            results[name] = exc

    threads = {
        name: threading.Thread(target=run, args=(name, job), daemon=True)
        for name, job in jobs.items()
    }
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    problems = [f"{n}: stuck after {timeout:g} s" for n, t in threads.items() if t.is_alive()]
    problems += [
        f"{n}: {type(r).__name__}: {str(r).splitlines()[0] if str(r) else ''}"
        for n, r in results.items()
        if isinstance(r, BaseException)
    ]
    assert not problems, "threads did not finish cleanly: " + "; ".join(problems)
    return results


# -- random programs against the model -----------------------------------------------------

STEP_KINDS = ["add", "acc", "peek", "bump", "feed-B", "feed-C", "fetch"]
steps = st.tuples(st.sampled_from(STEP_KINDS), st.booleans(), st.integers(1, 9), st.booleans())
SNAPSHOTS = [  # each non-blocking result is followed by in-place changes, then read
    ("acc", False, 2, True), ("bump", True, 0, False), ("feed-C", False, 0, False),
    ("feed-B", True, 0, False), ("peek", False, 0, False), ("add", False, 5, True),
    ("bump", False, 0, False), ("feed-B", False, 0, False), ("fetch", False, 0, False),
    ("acc", True, 3, True), ("peek", True, 0, False),
]  # fmt: skip


def run_program(groups: dict, shape: tuple[int, int], program: list) -> None:
    """Issue the program's calls and check each result against a sequential model:
    per-rank state rows, arguments as they were at call time, results as returned."""
    a = groups["A"]
    k, width = shape
    a.reset(k, width)
    model = [initial_rows(rank, k, width) for rank in range(2)]
    checks: list[tuple[str, Any, Any]] = []  # (step, result or future, expected value)
    produced = None  # A's latest non-blocking DataProtoFuture and its expected rows
    for i, (kind, blocking, value, mutate) in enumerate(program):
        what = f"step {i} {kind} {'blocking' if blocking else 'non-blocking'}"
        if kind == "fetch":
            pending = [n for n, c in enumerate(checks) if not c[0].endswith("(fetched)")]
            if pending:
                step, out, want = checks[pending[0]]
                checks[pending[0]] = (step + " (fetched)", value_of(out), want)
            continue
        if kind.startswith("feed"):
            if produced is None:
                continue
            consumer = groups[kind[-1]]
            out = (consumer.scale if blocking else consumer.scale_later)(produced[0])
            checks.append((what, out, produced[1] * FACTORS[kind[-1]]))
            continue
        if kind == "add":
            x = torch.arange(width, dtype=torch.int64) % 5 * value
            for rows in model:
                rows.add_(x)
            out = (a.add if blocking else a.add_later)(x)
            want: Any = [int(rows.sum()) for rows in model]
        elif kind == "acc":
            x = (torch.arange(2 * k * width, dtype=torch.int64) % 7 * value).reshape(2 * k, width)
            for rank, rows in enumerate(model):
                rows.add_(x[rank * k : (rank + 1) * k])
            out = (a.accumulate if blocking else a.accumulate_later)(
                hf.DataProto.from_dict({"x": x})
            )
            want = torch.cat(model)
            if not blocking:
                produced = (out, want)
        elif kind == "peek":
            x = None
            out = (a.peek if blocking else a.peek_later)()
            want = [rows.clone() for rows in model]
        else:  # bump
            x = None
            out = (a.bump if blocking else a.bump_later)()
            for rows in model:
                rows.add_(1)
            want = [None, None]
        if mutate and x is not None:
            x.add_(100)  # the call returned: the worker must have what x was before this
        checks.append((what, out, want))
    for step, out, want in checks:
        got = value_of(out)
        assert same(got, want), f"{step} of {program} (rows, width = {shape}): {got} != {want}"


@PROGRAM_SETTINGS
@given(
    shape=st.sampled_from([(1, 3), (2, 5), (1, BIG)]),
    program=st.lists(steps, min_size=1, max_size=10),
)
@example(shape=(1, BIG), program=SNAPSHOTS)
@example(shape=(2, 3), program=SNAPSHOTS)
def test_random_call_programs_give_the_results_of_the_sequential_snapshot_model(
    groups, shape, program
):
    run_program(groups, shape, program)


def test_a_kept_result_keeps_the_returned_values_after_the_instance_changes_them(groups):
    run_program(groups, (1, 4), [("peek", False, 0, False), ("bump", True, 0, False)])
    run_program(groups, (1, BIG), [("acc", False, 1, False), ("bump", True, 0, False)])


def test_a_passed_on_result_keeps_the_returned_values_after_the_instance_changes_them(groups):
    program = [("acc", False, 1, False), ("bump", True, 0, False), ("feed-B", True, 0, False)]
    run_program(groups, (1, 4), program)


def test_a_call_sees_its_argument_as_it_was_when_the_call_returned(groups):
    for width in (4, BIG):
        run_program(groups, (1, width), [("add", False, 3, True), ("acc", False, 2, True)])


# -- several driver threads on one group ------------------------------------------------------

thread_steps = st.tuples(st.sampled_from(["add", "add_later", "fetch"]), st.integers(1, 9))


@PROGRAM_SETTINGS
@given(
    width=st.sampled_from([3, 3, BIG]),
    programs=st.lists(st.lists(thread_steps, min_size=1, max_size=6), min_size=3, max_size=3),
)
def test_threads_sharing_a_group_get_their_sequential_results_and_calls_never_overlap(
    groups, width, programs
):
    a = groups["A"]
    keys = tuple(f"thread{t}" for t in range(len(programs)))
    a.reset(1, width, keys)

    def thread(key: str, program: list) -> list[tuple[Any, Any]]:
        model = torch.zeros(width, dtype=torch.int64)
        outs: list[tuple[Any, Any]] = []
        for op, value in program:
            if op == "fetch":
                if outs:
                    outs[-1] = (value_of(outs[-1][0]), outs[-1][1])
                continue
            x = torch.arange(width, dtype=torch.int64) % 3 + value
            model.add_(x)
            outs.append(
                ((a.keyed_add if op == "add" else a.keyed_add_later)(key, x), model.clone())
            )
            x.add_(100)  # after the call returned
        return [(value_of(out), [want, want]) for out, want in outs]

    results = run_threads(
        {key: (lambda k=key, p=program: thread(k, p)) for key, program in zip(keys, programs)},
        timeout=60,
    )
    for key, program in zip(keys, programs):
        for n, (got, want) in enumerate(results[key]):
            assert same(got, want), f"{key} call {n} of {program}: {got} != {want}"
    calls = sum(op != "fetch" for program in programs for op, _ in program)
    assert a.calls() == [calls, calls], "calls on one instance overlapped (lost counts)"


# -- mixed traffic on one lane ------------------------------------------------------------------


class Pipe(hf.Worker):
    @hf.register(ONE)
    def sink(self, x):
        return float(x[0]), x.numel()

    @hf.register(ONE)
    def source(self, i):
        return torch.full((2 * MiB,), float(i))  # 8 MiB

    @hf.register(ONE, blocking=False)
    def big_later(self, i):
        return torch.full((12 * MiB,), float(i))  # 48 MiB

    @hf.register(ONE, blocking=False)
    def pieces_later(self, i):
        return [torch.full((128 * 1024,), float(i)) for _ in range(96)]  # 48 MiB on the socket

    @hf.register(ONE)
    def ping(self, i):
        return i

    ping_later = later(ping, ONE)


def _shut_down(group: Any, backend: Any) -> None:
    """Shut down in a daemon thread, so that a stuck lane cannot hang the test session."""
    closers = [group.shutdown] if group is not None else []
    for close in [*closers, backend.shutdown]:
        closer = threading.Thread(target=close, daemon=True)
        closer.start()
        closer.join(30)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "path", ["local", *(pytest.param(path, marks=pytest.mark.cluster) for path in PATHS)]
)
def test_mixed_large_and_small_traffic_from_many_threads_on_one_lane_finishes(path, request):
    def sends(size: int = 128 * 1024, count: int = 60) -> None:
        for i in range(count):
            x = torch.full((size,), float(i))
            assert group.sink(x) == [(float(i), size)]

    def replies() -> None:
        for i in range(12):
            (out,) = group.source(i)
            assert torch.equal(out, torch.full((2 * MiB,), float(i)))

    def fetches() -> None:
        for i in range(4):
            (out,) = hf.get(group.big_later(i))
            assert out.numel() == 12 * MiB and out[0] == i and out[-1] == i

    def pieces() -> None:
        for i in range(4):
            (out,) = hf.get(group.pieces_later(i))
            assert len(out) == 96 and all(p.numel() == 128 * 1024 and p[-1] == i for p in out)

    def small() -> None:
        for i in range(200):
            assert group.ping(i) == [i]
            if i % 10 == 0:
                assert hf.get(group.ping_later(i)) == [i]

    with dask.config.set({"hybridflow.call-timeout": "60s"}):
        backend = make_backend(path, request)
        group = None
        try:
            group = hf.WorkerGroup(hf.ResourcePool([1]), Pipe, backend=backend)
            jobs = {
                "blocking 512 KiB sends": sends,
                "more blocking 512 KiB sends": sends,
                "blocking 2 MiB sends": lambda: sends(512 * 1024, 20),
                "blocking 8 MiB replies": replies,
                "48 MiB non-blocking results fetched with hf.get": fetches,
                "48 MiB non-blocking results in 512 KiB pieces fetched with hf.get": pieces,
                "small calls": small,
                "more small calls": small,
            }
            run_threads(jobs, timeout=90)
        finally:
            _shut_down(group, backend)
