"""Shared fixtures and the two tiers of the suite.

The plugin (hybridflow_dask.testing) provides the clusters and backends; ``backend``
parametrizes backend-neutral tests over both implementations.

Tiers: a test that starts a process (a Dask or Ray cluster, a subprocess driver, a
virtual environment) carries the ``cluster`` marker, so ``scripts/test.sh -m "not cluster"``
is the fast tier. The marker is applied here, at collection, to every test that uses a
fixture in ``PROCESS_FIXTURES`` (directly or through another fixture); a test or module
that starts processes some other way says so itself (``pytestmark = pytest.mark.cluster``,
or ``pytest.param(..., marks=pytest.mark.cluster)`` on a fixture's parameter). A run that
selects no cluster test checks the claim: a test that starts a process anyway fails,
naming the process and the marker.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import dask
import pytest

from hybridflow_dask.protocol import AUTO_PADDING_ENV, DataProtoConfig

#: Fixtures that start processes. A test that uses one, even through another fixture, is
#: in the cluster tier.
PROCESS_FIXTURES = frozenset(
    {
        "hf_dask_cluster",  # the plugin's session cluster (and hf_dask_backend on it)
        "hf_dask_backend",
        "ray_backend",  # tests/ray: the session's Ray instance
        "cli",  # tests/cli: the command, or a small program, in a fresh process
        "program",
        "hf_hosts",  # hosts made of network namespaces, their launchers in them
        "hf_module_hosts",
    }
)

CLUSTER = pytest.mark.cluster


@pytest.fixture(params=["local", pytest.param("dask", marks=CLUSTER)])
def backend(request: pytest.FixtureRequest):
    if request.param == "local":
        return request.getfixturevalue("hf_local_backend")
    return request.getfixturevalue("hf_dask_backend")


@pytest.fixture(scope="session", autouse=True)
def _reuse_worker_processes():
    """Backends made by tests reuse worker processes between groups, so the suite does not
    wait for restarts; the tests about fresh processes turn it back on for themselves."""
    with dask.config.set({"hybridflow.fresh-processes": False}):
        yield


@pytest.fixture(scope="session", autouse=True)
def _forked_worker_processes():
    """Every cluster this suite starts, the backend's and those tests make with Dask's
    own nanny, forks its workers from one server that imported torch, tensordict, Dask
    and the worker side once (the backend's own clusters fork theirs too, but without
    tensordict: this way a worker's first batch does not wait for that import either).
    With Dask's start method chosen here, the backend leaves it and this list alone.

    The server keeps the environment it started with (a worker is given the driver's as
    it starts, but preloaded libraries read theirs at import), so a test that needs a
    variable in its workers passes it to the cluster; the tests about what a fresh worker
    imports start theirs from a fresh interpreter (spawn, ``worker-preload: []``), and the
    tests about the backend's own fork server start from Dask's default."""
    from distributed.utils import get_mp_context

    from hybridflow_dask.backends.dask.config import worker_preload

    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        server = get_mp_context()  # sets Dask's own list of modules to preload, once
        server.set_forkserver_preload([*worker_preload(), "tensordict"])
        yield


@pytest.fixture(autouse=True)
def _padding_off(monkeypatch: pytest.MonkeyPatch):
    """Every test starts with auto padding off, whatever the environment says."""
    monkeypatch.delenv(AUTO_PADDING_ENV, raising=False)
    previous = DataProtoConfig._auto_padding
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = previous


# ---- the cluster tier -----------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(CLUSTER)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Only where no cluster test runs can a new process be blamed on the test running:
    # a cluster's nanny restarts workers in the background.
    if not any(item.get_closest_marker("cluster") for item in session.items):
        _ProcessWatch.install()


class _ProcessWatch:
    """Notes every process this pytest process starts while a test runs."""

    started: list[str] = []
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True
        cls._wrap(subprocess.Popen, "_execute_child", lambda a, k: f"subprocess {_argv(a, k)}")
        cls._wrap(multiprocessing.process.BaseProcess, "start", lambda a, k: f"process {a[0]}")
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                cls._wrap(os, name, lambda a, k, name=name: f"os.{name}")

    @classmethod
    def _wrap(cls, owner: Any, name: str, describe: Callable[[tuple, dict], str]) -> None:
        original = getattr(owner, name)

        def started(*args: Any, **kwargs: Any) -> Any:
            cls.started.append(describe(args, kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, started)


def _argv(args: tuple, kwargs: dict) -> str:
    argv = kwargs.get("args", args[1] if len(args) > 1 else "?")
    return repr(argv if isinstance(argv, str) else list(argv)[:4])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _ProcessWatch.started = []  # what the test's setup, call and teardown start
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    if _ProcessWatch.installed and _ProcessWatch.started and not item.get_closest_marker("cluster"):
        started = "; ".join(dict.fromkeys(_ProcessWatch.started))
        _ProcessWatch.started = []
        pytest.fail(
            f"{item.nodeid} started a process ({started}) but is not in the cluster tier: "
            "use a fixture from PROCESS_FIXTURES in tests/conftest.py, or mark the test "
            "(or its module) with pytest.mark.cluster",
            pytrace=False,
        )
    return result
