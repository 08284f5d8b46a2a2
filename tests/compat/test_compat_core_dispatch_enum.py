"""verl parity: ``Dispatch`` behaves like verl's ``DynamicEnum``."""

from __future__ import annotations

import pickle

import pytest

import hybridflow_dask as hf
from hybridflow_dask import Dispatch, Execute


def _identity_dispatch(worker_group, *args, **kwargs):
    return args, kwargs


def _identity_collect(worker_group, output):
    return output


def test_dispatch_remove_drops_a_registered_mode():
    mode = hf.register_dispatch_mode("COMPAT_REMOVE_ME", _identity_dispatch, _identity_collect)
    assert Dispatch.COMPAT_REMOVE_ME is mode
    assert Dispatch.remove("COMPAT_REMOVE_ME") is mode
    assert not hasattr(Dispatch, "COMPAT_REMOVE_ME")
    assert "COMPAT_REMOVE_ME" not in Dispatch
    # The name is free again, and the new member gets a fresh value.
    again = hf.register_dispatch_mode("COMPAT_REMOVE_ME", _identity_dispatch, _identity_collect)
    assert again is not mode and again.value != mode.value
    Dispatch.remove("compat_remove_me")  # any case, as verl upper-cases
    with pytest.raises(ValueError, match="no such member"):
        Dispatch.remove("COMPAT_REMOVE_ME")


def test_register_upper_cases_names():
    mode = hf.register_dispatch_mode("compat_lower_mode", _identity_dispatch, _identity_collect)
    try:
        assert mode.name == "COMPAT_LOWER_MODE"
        assert Dispatch.COMPAT_LOWER_MODE is mode
        assert not hasattr(Dispatch, "compat_lower_mode")
        with pytest.raises(ValueError, match="already exists"):
            Dispatch.register("Compat_Lower_Mode")
    finally:
        Dispatch.remove("COMPAT_LOWER_MODE")


def test_dispatch_class_is_a_mapping_of_names():
    assert Dispatch["ONE_TO_ALL"] is Dispatch.ONE_TO_ALL
    assert "ONE_TO_ALL" in Dispatch and "NO_SUCH_MODE" not in Dispatch
    assert Dispatch.DP_COMPUTE_PROTO in Dispatch
    assert Execute.RANK_ZERO in Execute and Execute.RANK_ZERO not in Dispatch
    members = list(Dispatch)
    assert Dispatch.ALL_TO_ALL in members and Dispatch.DIRECT_ROLLOUT_METHOD in members
    assert Dispatch.names()[:3] == ["RANK_ZERO", "ONE_TO_ALL", "ALL_TO_ALL"]
    assert Dispatch.values() == members
    assert Execute.names() == ["ALL", "RANK_ZERO"]
    with pytest.raises(KeyError, match="NO_SUCH_MODE"):
        Dispatch["NO_SUCH_MODE"]


def test_from_name_is_case_insensitive_and_returns_none_for_unknown():
    assert Dispatch.from_name("one_to_all") is Dispatch.ONE_TO_ALL
    assert Dispatch.from_name("DP_COMPUTE_PROTO") is Dispatch.DP_COMPUTE_PROTO
    assert Dispatch.from_name("NO_SUCH_MODE") is None
    assert Execute.from_name("all") is Execute.ALL


def test_members_stay_singletons_through_pickle():
    for member in (Dispatch.ONE_TO_ALL, Execute.RANK_ZERO):
        assert pickle.loads(pickle.dumps(member)) is member
