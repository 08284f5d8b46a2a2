"""Fuzzed inputs at the group boundary: every predefined dispatch mode, through a real group.

Malformed calls (wrong per-rank list lengths, mixed futures and values, non-DataProto
where a DataProto is needed, DataProtos of different lengths, empty batches, futures of a
closed or another backend, keyword-only and unknown keyword arguments) must raise a
``ValueError``/``TypeError`` that names the problem in the driver, before any rank's
instance is reached, and the group must answer the next valid call correctly. The
instances count every attribute lookup of a fuzzed method (``Target.__getattribute__``),
so a call that reached a rank counts even when Python's own argument binding failed there.

The groups (world size 2) are module-scoped, one on a ``LocalBackend`` and one on the
session ``DaskBackend``; the worker class is at module level so Dask workers import it.
"""

from __future__ import annotations

import concurrent.futures
import keyword
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from hybridflow_dask import (
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    Dispatch,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from hybridflow_dask.backends import LocalBackend

WORLD = 2

FUZZ = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

#: The methods fuzzed here: a lookup of any of them on an instance counts as a call that
#: reached the rank.
FUZZED = frozenset({"one", "all", "zero", "dp", "proto", "with_func", "metric", "kwonly"})


def bump(worker: Worker, data: DataProto) -> DataProto:
    """The function DP_COMPUTE_PROTO_WITH_FUNC calls are given (module level: picklable)."""
    return DataProto.from_dict({"idx": data.batch["idx"] + 100})


class Target(Worker):
    """One method per predefined mode; each returns something that shows what it got."""

    _reached = 0

    def __getattribute__(self, name: str):
        if name in FUZZED:
            object.__setattr__(self, "_reached", object.__getattribute__(self, "_reached") + 1)
        return super().__getattribute__(name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def one(self, x, y=0, *, z=0):
        return (self.rank, x, y, z)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def all(self, x, y=0, *, z=0):
        return (self.rank, x, y, z)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def zero(self, x, y=0, *, z=0):
        return (self.rank, x, y, z)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp(self, x, y=0, *, z=0):
        return (self.rank, x, y, z)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def proto(self, data, other=None, *, extra=None):
        out = {"idx": data.batch["idx"] * 2, "rank": torch.full((len(data),), self.rank)}
        if other is not None:
            out["other"] = other.batch["idx"]
        return DataProto.from_dict(out)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def with_func(self, func, data, *, extra=None):
        return func(self, data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data, *, extra=None):
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def kwonly(self, x, *, scale):
        return x * scale

    # -- not fuzzed: helpers the tests call ---------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def calls(self):
        return self._reached

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def one_later(self, x):
        return x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def proto_later(self, data):
        return DataProto.from_dict({"idx": data.batch["idx"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def times(self, data):
        """``k`` result rows for every row (``k``: the batch's ``k`` column), each row's
        together and in input order, as ``DataProto.repeat(k, interleave=True)`` gives."""
        return repeat_rows(data, int(data.batch["k"][0]))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def times_later(self, data):
        return self.times(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def uneven(self, data):
        """Rank 0 returns two rows per row, the others one: no k fits every rank."""
        return repeat_rows(data, 2 if self.rank == 0 else 1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def uneven_later(self, data):
        return self.uneven(data)


def repeat_rows(data: DataProto, k: int) -> DataProto:
    return data.select_idxs(np.repeat(np.arange(len(data)), k))


def batch(n: int, *, auto_padding: bool = False, start: int = 0, k: int = 1) -> DataProto:
    return DataProto.from_dict(
        {"idx": torch.arange(start, start + n), "k": torch.full((n,), k)},
        auto_padding=auto_padding,
    )


# ---- groups and stale futures (module scope) ----------------------------------------------


class Stage:
    """A module's group, with futures of its own backend and futures it must refuse."""

    def __init__(self, group: WorkerGroup, own: dict, stale: list[tuple[str, object]]) -> None:
        self.group = group
        self.own = own  # futures of the group's own backend, made before any fuzzing
        self.stale = stale  # (what, value): futures of closed or other backends


def closed_local_futures() -> tuple[list[tuple[str, object]], LocalBackend]:
    backend = LocalBackend()
    producer = WorkerGroup(ResourcePool([WORLD]), Target, backend=backend)
    futures = producer.one_later(7)
    rows = producer.proto_later(batch(4))
    backend.shutdown()
    stale = [
        ("FutureList of a closed LocalBackend", futures),
        ("DataProtoFuture of a closed LocalBackend", rows),
    ]
    return stale, futures[0]


def closed_dask_futures(cluster) -> list[tuple[str, object]]:
    from hybridflow_dask.backends import DaskBackend

    backend = DaskBackend(cluster=cluster)
    try:
        producer = WorkerGroup(ResourcePool([WORLD]), Target, backend=backend)
        futures = producer.one_later(7)
        rows = producer.proto_later(batch(4))
        assert rows.get().batch["idx"].tolist() == [0, 1, 2, 3]
    finally:
        backend.shutdown()
    return [
        ("FutureList of a closed DaskBackend", futures),
        ("future of a closed DaskBackend", futures[0]),
        ("DataProtoFuture of a closed DaskBackend", rows),
    ]


@pytest.fixture(scope="module", params=["local", pytest.param("dask", marks=pytest.mark.cluster)])
def stage(request):
    stale, bare_local = closed_local_futures()
    if request.param == "local":
        backend = LocalBackend()
        other = concurrent.futures.Future()
        other.set_result(7)
        # A bare LocalFuture carries its value and no backend: one from a closed
        # LocalBackend still resolves here (harmless), so it is not among the refused.
        stale.append(("concurrent.futures.Future", other))
    else:
        backend = request.getfixturevalue("hf_dask_backend")
        stale.append(("LocalFuture given to a DaskBackend group", bare_local))
        stale.extend(closed_dask_futures(request.getfixturevalue("hf_dask_cluster")))
    group = WorkerGroup(ResourcePool([WORLD]), ClassWithInitArgs(Target), backend=backend)
    own = {"futures": group.one_later(5), "rows": group.proto_later(batch(4, start=10))}
    yield Stage(group, own, stale)
    group.shutdown()
    if request.param == "local":
        backend.shutdown()


# ---- the checks every rejected call gets ---------------------------------------------------


def refused(stage: Stage, call, error: type | tuple, match: str, *, in_driver: bool = True):
    """``call()`` raises ``error`` matching ``match``; no rank's instance was reached."""
    before = stage.group.calls()
    with pytest.raises(error, match=match) as info:
        call()
    assert stage.group.calls() == before, f"a rank was reached: {info.value}"
    if in_driver:
        assert not hasattr(info.value, "remote_traceback"), "raised on a worker"
    return info.value


def check_still_works(stage: Stage, method: str) -> None:
    """A valid call of ``method``'s mode right after a refused one gives the right result."""
    g = stage.group
    if method in ("one", "all"):
        assert getattr(g, method)(3, z=1) == [(0, 3, 0, 1), (1, 3, 0, 1)]
    elif method == "zero":
        assert g.zero(3, y=2) == (0, 3, 2, 0)
    elif method == "dp":
        assert g.dp([1, 2], y=(10, 20)) == [(0, 1, 10, 0), (1, 2, 20, 0)]
    elif method == "kwonly":
        assert g.kwonly(3, scale=2) == [6, 6]
    elif method == "with_func":
        assert g.with_func(bump, batch(4)).batch["idx"].tolist() == [100, 101, 102, 103]
    elif method == "metric":
        assert g.metric(batch(6)) == [{"rank": 0, "rows": 3}, {"rank": 1, "rows": 3}]
    else:
        out = g.proto(batch(5, auto_padding=True), other=batch(5, auto_padding=True, start=7))
        assert out.batch["idx"].tolist() == [0, 2, 4, 6, 8]
        assert out.batch["other"].tolist() == [7, 8, 9, 10, 11]
        assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]


# ---- strategies -----------------------------------------------------------------------------

#: name -> (positional parameters in order, optional keyword-only ones, required ones)
SIGNATURES = {
    "one": (["x", "y"], ["z"], []),
    "all": (["x", "y"], ["z"], []),
    "zero": (["x", "y"], ["z"], []),
    "dp": (["x", "y"], ["z"], []),
    "proto": (["data", "other"], ["extra"], []),
    "with_func": (["func", "data"], ["extra"], []),
    "metric": (["data"], ["extra"], []),
    "kwonly": (["x"], [], ["scale"]),
}
DATA_METHODS = ["proto", "with_func", "metric"]


def fitting_value(method: str, param: str):
    """A value ``method`` accepts for ``param``, so only the malformation is wrong."""
    if method == "dp":
        return [1, 2]
    if param == "func":
        return bump
    if method in DATA_METHODS:
        return batch(4)
    return 1


def valid_call(method: str) -> tuple[list, dict]:
    positional, _, required = SIGNATURES[method]
    first = 2 if method == "with_func" else 1
    args = [fitting_value(method, p) for p in positional[:first]]
    return args, {name: fitting_value(method, name) for name in required}


names = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)


@st.composite
def signature_mismatches(draw):
    """A call whose arguments the method's signature refuses, and what the error says."""
    method = draw(st.sampled_from(sorted(SIGNATURES)))
    positional, optional, required = SIGNATURES[method]
    args, kwargs = valid_call(method)
    kind = draw(
        st.sampled_from(["unknown keyword", "too many", "missing", "twice", "keyword-only"])
    )
    if kind == "unknown keyword":
        name = draw(names.filter(lambda s: s not in {*positional, *optional, *required}))
        kwargs[name] = fitting_value(method, "x")
        return method, args, kwargs, f"unexpected keyword argument '{name}'"
    if kind == "too many":
        extra = draw(st.integers(1, 3))
        args = [fitting_value(method, p) for p in positional] + [
            fitting_value(method, "x") for _ in range(extra)
        ]
        return method, args, kwargs, "too many positional arguments"
    if kind == "missing":
        return method, [], kwargs, f"missing a required argument: '{positional[0]}'"
    if kind == "twice":
        kwargs[positional[0]] = args[0]
        return method, args, kwargs, f"multiple values for argument '{positional[0]}'"
    # keyword-only: a required one left out, or an optional one passed by position
    if required:
        kwargs.pop(required[0])
        if draw(st.booleans()):
            args.append(fitting_value(method, required[0]))
            return method, args, kwargs, "only be passed by name"
        return method, args, kwargs, f"missing a required argument: '{required[0]}'"
    args = [fitting_value(method, p) for p in positional] + [fitting_value(method, optional[0])]
    return method, args, kwargs, f"{optional[0]} can only be passed by name"


not_batches = st.one_of(
    st.none(),
    st.integers(-3, 3),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(0, 3), max_size=4),
    st.tuples(st.integers(), st.integers()),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    st.builds(lambda n: torch.arange(n), st.integers(0, 4)),
    st.builds(lambda n: np.arange(n), st.integers(0, 4)),
    st.just([batch(2), batch(2)]),
    st.just({"idx": torch.arange(4)}),
)


def call(stage: Stage, method: str, args, kwargs):
    return lambda: getattr(stage.group, method)(*args, **kwargs)


# ---- the properties -----------------------------------------------------------------------


@FUZZ
@given(case=signature_mismatches())
def test_arguments_the_method_cannot_take_are_refused_in_the_driver(stage, case):
    method, args, kwargs, says = case
    error = refused(stage, call(stage, method, args, kwargs), TypeError, re.escape(says))
    assert f"Target.{method}(" in str(error) and "call it as" in str(error)
    check_still_works(stage, method)


per_rank_lists = st.one_of(
    st.lists(st.integers(), max_size=5).filter(lambda v: len(v) != WORLD),
    st.lists(st.integers(), max_size=5).filter(lambda v: len(v) != WORLD).map(tuple),
    st.integers(),
    st.text(max_size=3),
    st.none(),
    st.dictionaries(st.integers(), st.integers(), min_size=WORLD, max_size=WORLD),
)


@FUZZ
@given(
    x=st.one_of(per_rank_lists, st.just([1, 2])),
    y=st.one_of(per_rank_lists, st.just((10, 20))),
    by_name=st.booleans(),
)
def test_dp_compute_needs_a_list_of_world_size_per_argument(stage, x, y, by_name):
    bad = [(name, v) for name, v in (("#0" if not by_name else "'x'", x), ("'y'", y))]
    bad = [(name, v) for name, v in bad if not (isinstance(v, (list, tuple)) and len(v) == WORLD)]
    args, kwargs = ([], {"x": x, "y": y}) if by_name else ([x], {"y": y})
    if not bad:  # both fit: a tuple is split per rank like a list
        assert stage.group.dp(*args, **kwargs) == [(0, x[0], y[0], 0), (1, x[1], y[1], 0)]
        return
    error = refused(stage, call(stage, "dp", args, kwargs), ValueError, "DP_COMPUTE needs")
    assert f"argument {bad[0][0]}" in str(error) and f"list of {WORLD} items" in str(error)
    check_still_works(stage, "dp")


@FUZZ
@given(method=st.sampled_from(DATA_METHODS), value=not_batches, by_name=st.booleans())
def test_data_modes_refuse_what_is_not_a_batch(stage, method, value, by_name):
    args = [bump] if method == "with_func" else []
    kwargs = {"data": value} if by_name else {}
    args += [] if by_name else [value]
    refused(stage, call(stage, method, args, kwargs), TypeError, "must be a DataProto")
    check_still_works(stage, method)


@FUZZ
@given(method=st.sampled_from(DATA_METHODS), own=st.sampled_from(["futures", "future"]))
def test_data_modes_refuse_backend_futures_naming_the_fix(stage, method, own):
    futures = stage.own["futures"]
    value = futures if own == "futures" else futures[0]
    args = [bump, value] if method == "with_func" else [value]
    error = refused(stage, call(stage, method, args, {}), TypeError, "must be a DataProto")
    assert "future" in str(error) and "DataProto.concat(hf.get(" in str(error)
    check_still_works(stage, method)


@FUZZ
@given(
    first=st.integers(1, 9),
    second=st.integers(1, 9),
    pad_first=st.booleans(),
    pad_second=st.booleans(),
    by_name=st.booleans(),
)
def test_dataprotos_of_different_lengths_are_refused(
    stage, first, second, pad_first, pad_second, by_name
):
    a = batch(first, auto_padding=pad_first)
    b = batch(second, auto_padding=pad_second)
    args, kwargs = ([a], {"other": b}) if by_name else ([a, b], {})
    uneven = [(n, p) for n, p in ((first, pad_first), (second, pad_second)) if n % WORLD and not p]
    if first == second and not uneven:
        out = stage.group.proto(*args, **kwargs)
        assert out.batch["other"].tolist() == list(range(first))
        return
    says = "not divisible" if uneven else "must have the same length"
    error = refused(stage, call(stage, "proto", args, kwargs), ValueError, says)
    if not uneven:
        assert f"{first} rows" in str(error) and f"{second} rows" in str(error)
    check_still_works(stage, "proto")


@FUZZ
@given(
    method=st.sampled_from(DATA_METHODS),
    kind=st.sampled_from(["dataproto", "padded dataproto", "tensordict", "with a full one"]),
)
def test_empty_batches_are_refused(stage, method, kind):
    """verl's ``chunk`` of an empty DataProto fails; here it is a ValueError that says so."""
    empty = {
        "dataproto": batch(0),
        "padded dataproto": batch(0, auto_padding=True),
        "tensordict": TensorDict({"idx": torch.arange(0)}, batch_size=[0]),
        "with a full one": batch(0),
    }[kind]
    args = [bump, empty] if method == "with_func" else [empty]
    kwargs = {}
    if kind == "with a full one":
        if method != "proto":
            return
        args, kwargs = [batch(4)], {"other": empty}
    refused(stage, call(stage, method, args, kwargs), ValueError, "0 rows")
    check_still_works(stage, method)


def stale_call(method: str, value, where: int):
    """A call of ``method`` with ``value`` where its mode takes futures."""
    if method == "dp":  # value is a list here: per-rank futures, or one next to a value
        return ([value], {}) if where == 0 else ([[1, 2]], {"y": value})
    if method in DATA_METHODS:
        if method == "proto" and where == 1:
            return [batch(4)], {"other": value}
        return ([bump, value] if method == "with_func" else [value]), {}
    if method == "kwonly":
        return [value], {"scale": 2}
    return ([value] if where == 0 else [1]), ({} if where == 0 else {"y": value})


@FUZZ
@given(data=st.data())
def test_futures_of_a_closed_or_another_backend_are_refused(stage, data):
    what, value = data.draw(st.sampled_from(stage.stale), label="stale")
    method = data.draw(st.sampled_from(sorted(SIGNATURES)), label="method")
    if method in DATA_METHODS and not isinstance(value, DataProtoFuture):
        method = "one"  # a data mode refuses any other future as not a batch (tested above)
    if method == "dp" and not isinstance(value, list):
        value = [value, 5]  # mixed: a stale future next to a value
    args, kwargs = stale_call(method, value, data.draw(st.integers(0, 1), label="where"))
    error = refused(
        stage, call(stage, method, args, kwargs), ValueError, r"shut down|cannot (resolve|fetch)"
    )
    assert f".{method}: argument" in str(error), what
    check_still_works(stage, method)


@FUZZ
@given(n=st.integers(1, 9), other=st.integers(1, 9), swap=st.booleans())
def test_mixed_futures_and_values(stage, n, other, swap):
    """Own futures next to values work; a future and a DataProto of another length do not."""
    g = stage.group
    futures = stage.own["futures"]
    assert g.dp([futures[0], n]) == [(0, 5, 0, 0), (1, n, 0, 0)]
    assert g.one(futures[0], y=n) == [(0, 5, n, 0), (1, 5, n, 0)]
    rows = stage.own["rows"]  # 4 rows: 10..13
    given_rows = batch(other, auto_padding=True)
    args = [given_rows, rows] if swap else [rows, given_rows]
    if other == 4:
        out = g.proto(*args)
        first, second = (range(4), range(10, 14)) if swap else (range(10, 14), range(4))
        assert out.batch["idx"].tolist() == [2 * i for i in first]
        assert out.batch["other"].tolist() == list(second)
        return
    # A future's length is known only where it was computed: the check runs there, and
    # the call fails before the method runs on any rank.
    refused(stage, call(stage, "proto", args, {}), ValueError, "same length", in_driver=False)
    check_still_works(stage, "proto")


# ---- a result's row count under auto padding ------------------------------------------------


@FUZZ
@given(n=st.integers(1, 9), k=st.integers(0, 3), later=st.booleans())
def test_padding_is_taken_off_k_rows_per_row(stage, n, k, later):
    """A method returning k rows per row it was sent (in input order) loses exactly the
    k * padding rows at the end: the caller gets k * n rows, whatever the padding."""
    g = stage.group
    data = batch(n, auto_padding=True, k=k)
    expected = np.repeat(np.arange(n), k).tolist()
    out = g.times_later(data).get() if later else g.times(data)
    assert out.batch["idx"].tolist() == expected
    if later and k:  # the future feeds the next call, which keeps its k rows per row
        chained = g.proto(g.times_later(data))
        assert chained.batch["idx"].tolist() == [2 * i for i in expected]


@FUZZ
@given(n=st.integers(1, 9).filter(lambda n: n % WORLD), later=st.booleans())
def test_padding_with_no_common_rows_per_row_names_method_and_rows(stage, n, later):
    g = stage.group
    data = batch(n, auto_padding=True)
    size = -(-n // WORLD)  # rows each rank was sent
    if later:
        future = g.uneven_later(data)
        with pytest.raises(ValueError, match=r"\.uneven_later returned") as info:
            future.get()
        assert f"returned {3 * size} rows for the {2 * size} rows it was sent" in str(info.value)
    else:
        with pytest.raises(ValueError, match=r"\.uneven returned") as info:
            g.uneven(data)
        text = str(info.value)
        assert f"{size} rows on rank 1 for the {size} rows it was sent" in text
        assert f"rank 0 returned {2 * size}" in text
    assert "turn auto padding off" in str(info.value)
    check_still_works(stage, "proto")
