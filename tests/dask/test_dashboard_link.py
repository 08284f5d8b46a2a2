"""``hf.dashboard_link()``: where a program's own groups can be watched."""

from __future__ import annotations

import urllib.request

import pytest

import hybridflow_dask as hf


def test_dashboard_link_of_a_dask_backend_is_served(hf_dask_backend):
    link = hf.dashboard_link(hf_dask_backend)
    assert link == hf_dask_backend.dashboard_link and link.endswith("/status")
    assert hf_dask_backend.groups_page == link[: -len("/status")] + "/hybridflow"
    with urllib.request.urlopen(hf_dask_backend.groups_page, timeout=10) as response:
        assert response.status == 200


def test_dashboard_link_is_that_of_the_default_backend(hf_local_backend, hf_dask_cluster):
    backend = hf.init(address=hf_dask_cluster.scheduler_address)  # attached: shutdown keeps it
    try:
        assert hf.dashboard_link() == backend.dashboard_link
        assert hf.dashboard_link().endswith("/status")
    finally:
        hf.shutdown()
    assert hf.dashboard_link(hf_local_backend) is None  # no dashboard in-process


class Echo(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def echo(self, x):
        return x


def test_default_backend_is_the_one_behind_groups_made_without_a_backend(hf_dask_cluster):
    attached = hf.init(address=hf_dask_cluster.scheduler_address)  # shutdown keeps the cluster
    try:
        group = hf.WorkerGroup(hf.ResourcePool([1]), hf.ClassWithInitArgs(Echo))
        assert group.echo(3) == [3]
        assert hf.default_backend() is attached is group.backend
        # the Monitoring advice: the link comes from default_backend(), as init() refuses now
        assert hf.default_backend().dashboard_link == hf.dashboard_link()
        with pytest.raises(RuntimeError, match="already set"):
            hf.init()
        group.shutdown()
    finally:
        hf.shutdown()
