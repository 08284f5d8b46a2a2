"""``hf.dashboard_link()``: where a program's own groups can be watched."""

from __future__ import annotations

import urllib.request

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
