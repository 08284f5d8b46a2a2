"""pytest plugin (entry point ``pytest11``): fixtures for testing your workers.

- ``hf_local_backend``: a fresh ``LocalBackend`` per test.
- ``hf_dask_cluster``: one loopback ``LocalCluster`` per session (ini ``hf_dask_workers``,
  default 2 single-threaded worker processes, with the Dask settings of a cluster a
  ``DaskBackend`` starts), closed at the end. It does not grow: a pool needing more free
  workers than it has is a ``ValueError`` that names the ini option.
- ``hf_dask_backend``: a ``DaskBackend`` attached to that cluster, for the session.
- ``hf_worker_group``: a factory ``make(cls_or_cwia, pool=[2], backend=..., **kw)`` whose
  groups are shut down after the test.
- ``hf_hosts`` / ``hf_module_hosts``: a factory ``make(n, **kw)`` of ``testing.hosts.Hosts``
  (``n`` hosts made of network namespaces, each running ``dask worker``), closed after the
  test / the module; skips where it cannot run (not root, no ``ip``).
- the ``gpu`` marker skips a test when no CUDA device is visible.
- ``--hf-backend=MODULE:FACTORY``: the backend the conformance kit tests
  (``pytest --hf-backend=pkg.mod:factory --pyargs hybridflow_dask.testing.conformance``;
  see ``hybridflow_dask.testing.conformance`` and ``docs/backends.md``), and
  ``--hf-kit-world-size=N``: the ranks of its pools in the tests about several ranks.

Installing the package loads this module into every pytest run, so it imports nothing
heavy at module level: each fixture imports what it needs (torch, Dask, the backends)
inside its body, when a test first uses it. A new fixture follows the same rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # the fixtures import these when used: loading the plugin stays cheap
    from ..backends.local import LocalBackend
    from ..resource_pool import ResourcePool
    from ..worker import ClassWithInitArgs
    from ..worker_group import WorkerGroup

__all__ = [
    "hf_dask_backend",
    "hf_dask_cluster",
    "hf_hosts",
    "hf_local_backend",
    "hf_module_hosts",
    "hf_worker_group",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("hf_dask_workers", "worker processes in the hf_dask_cluster fixture", default="2")
    parser.addoption(
        "--hf-backend",
        default=None,
        metavar="MODULE:FACTORY",
        help="the backend factory the conformance kit (hybridflow_dask.testing.conformance) "
        "tests: called with no arguments for a backend, and with attach_to=<backend> for a "
        "second driver on the same cluster if it takes that keyword",
    )
    parser.addoption(
        "--hf-kit-world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks of the conformance kit's pools in its tests about several ranks "
        "(default 2; a whole number from 2)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when none is visible")
    config.addinivalue_line(
        "markers",
        "hf_processes: a conformance test that needs instances in processes other than the "
        "driver's; skipped for backends with in_process = True",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not _cuda_visible():
        pytest.skip("needs a CUDA GPU; torch sees none on this machine")


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.fixture
def hf_local_backend() -> Iterator[LocalBackend]:
    from ..backends.local import LocalBackend

    backend = LocalBackend()
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def hf_dask_cluster(pytestconfig: pytest.Config) -> Iterator[Any]:
    import dask
    from distributed import LocalCluster

    from ..backends.dask.config import worker_preload
    from ..backends.dask.driver.cluster import loop_settings, owned_settings, worker_settings
    from ..backends.dask.internals import ForkserverNanny

    n = int(pytestconfig.getini("hf_dask_workers"))
    # the Dask settings of a cluster a DaskBackend starts (its histories, its event
    # loops' checks, its workers without Dask's profiler)
    with dask.config.set(owned_settings()):
        cluster = LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            worker_class=ForkserverNanny,
            preload_once=worker_preload(),
            settings=loop_settings(),
            config=worker_settings(),
        )
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def hf_dask_backend(hf_dask_cluster: Any, pytestconfig: pytest.Config) -> Iterator[Any]:
    import dask

    from ..backends.dask import DaskBackend

    workers = pytestconfig.getini("hf_dask_workers")

    class FixtureBackend(DaskBackend):
        """Says which ini option to raise when a pool does not fit the fixed cluster."""

        def place(self, process_on_nodes: Any, use_gpu: Any, name: str) -> Any:
            try:
                return super().place(process_on_nodes, use_gpu, name)
            except ValueError as exc:
                raise ValueError(
                    f"{exc} (the hf_dask_cluster fixture has {workers} worker processes, "
                    "shared by every group alive in the session; raise the ini option "
                    f'hf_dask_workers, e.g. hf_dask_workers = "{int(workers) * 2}" under '
                    "[tool.pytest.ini_options])"
                ) from None

    # Tests share the session's workers: reusing their processes between groups keeps a
    # suite fast (a backend you make yourself gives every new pool fresh processes).
    with dask.config.set({"hybridflow.fresh-processes": False}):
        backend = FixtureBackend(cluster=hf_dask_cluster)
    yield backend
    backend.shutdown()


def _hosts_factory() -> Iterator[Any]:
    from . import hosts  # lazily: plugin load stays cheap

    why = hosts.missing()
    if why is not None:
        pytest.skip(f"hosts made of network namespaces: {why}")
    made: list[Any] = []

    def make(n: int, **kwargs: Any) -> Any:
        group = hosts.Hosts(n, **kwargs)
        made.append(group)
        group.start()
        return group

    try:
        yield make
    finally:
        for group in reversed(made):
            group.close()


@pytest.fixture
def hf_hosts() -> Iterator[Any]:
    yield from _hosts_factory()


@pytest.fixture(scope="module")
def hf_module_hosts() -> Iterator[Any]:
    yield from _hosts_factory()


@pytest.fixture
def hf_worker_group() -> Iterator[Any]:
    from ..resource_pool import ResourcePool
    from ..worker_group import WorkerGroup

    made: list[WorkerGroup] = []

    def make(
        cls_with_init: ClassWithInitArgs | type,
        pool: ResourcePool | list[int] | None = None,
        *,
        backend: Any,
        **kwargs: Any,
    ) -> WorkerGroup:
        if pool is None:
            pool = [2]
        if not isinstance(pool, ResourcePool):
            pool = ResourcePool(pool)
        group = WorkerGroup(pool, cls_with_init, backend=backend, **kwargs)
        made.append(group)
        return group

    yield make
    for group in reversed(made):
        group.shutdown()
