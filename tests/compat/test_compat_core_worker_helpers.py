"""verl parity: the Worker helpers and rank variables verl code relies on."""

from __future__ import annotations

import os

import pytest

from hybridflow_dask import ClassWithInitArgs, Dispatch, Worker, register

GROUP_KEYS = ("WG_PREFIX", "WG_BACKEND", "RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE")


class Helper(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.env_in_init = {key: os.environ.get(key) for key in GROUP_KEYS}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def group_env(self) -> dict:
        return self.env_in_init

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def own_rendezvous(self) -> tuple[str, str]:
        return self.get_available_master_addr_port()


def test_env_keys_is_verls_list():
    assert Worker.env_keys() == [
        "WORLD_SIZE",
        "RANK",
        "LOCAL_WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
    ]


def test_address_helpers_read_my_host_ip_and_find_a_free_port(monkeypatch):
    port = Worker._get_free_port()
    assert isinstance(port, int) and 0 < port < 65536
    monkeypatch.setenv("MY_HOST_IP", "10.9.8.7")
    assert Worker._get_node_ip() == "10.9.8.7"
    worker = Worker()
    addr, port_text = worker.get_available_master_addr_port()
    assert addr == "10.9.8.7" and port_text.isdigit()
    with pytest.warns(DeprecationWarning):
        assert worker.get_availale_master_addr_port()[0] == "10.9.8.7"
    monkeypatch.delenv("MY_HOST_IP")
    assert Worker._get_node_ip()  # some address of this host, never an exception


def test_rank_env_has_verls_group_variables(hf_local_backend, hf_worker_group):
    wg = hf_worker_group(Helper, [2, 1], backend=hf_local_backend, name_prefix="compat_helper")
    assert wg.group_env() == [
        {
            "WG_PREFIX": "compat_helper",
            "WG_BACKEND": "local",
            "RAY_LOCAL_RANK": r,
            "RAY_LOCAL_WORLD_SIZE": s,
        }
        for r, s in (("0", "2"), ("1", "2"), ("0", "1"))
    ]
    addr, port = wg.own_rendezvous()[0]
    assert addr and port.isdigit()


def test_worker_env_may_not_override_group_variables(hf_local_backend, hf_worker_group):
    with pytest.raises(ValueError, match="WG_PREFIX"):
        hf_worker_group(Helper, [1], backend=hf_local_backend, worker_env={"WG_PREFIX": "x"})


def test_class_with_init_args_update_options_merges_and_checks_the_type():
    cwia = ClassWithInitArgs(Helper)
    assert cwia.fused_worker_used is False
    cwia.update_options({"num_cpus": 1})
    cwia.update_options({"name": "w"})
    assert cwia.options == {"num_cpus": 1, "name": "w"}
    cwia.set_additional_resource({"special": 1})
    with pytest.raises(TypeError, match="dict"):
        cwia.update_options(["num_cpus"])
