"""One ``os.environ`` per process: each colocated instance sees its own variables only."""

from __future__ import annotations

import os

from hybridflow_dask.backends.hosting import EnvSwitch

RANK0 = {"HF_T_RANK": "0", "HF_T_WORLD": "8", "HF_T_PORT": "29500"}
RANK1 = {"HF_T_RANK": "1", "HF_T_WORLD": "8", "HF_T_PORT": "29500"}


def test_switching_between_instances_restores_what_the_process_had(monkeypatch):
    monkeypatch.setenv("HF_T_PORT", "from-the-process")
    monkeypatch.delenv("HF_T_RANK", raising=False)
    monkeypatch.delenv("HF_T_EXTRA", raising=False)
    switch = EnvSwitch()
    switch.switch({**RANK0, "HF_T_EXTRA": "only rank 0"})
    assert os.environ["HF_T_EXTRA"] == "only rank 0" and os.environ["HF_T_RANK"] == "0"
    switch.switch(RANK1)
    assert "HF_T_EXTRA" not in os.environ  # another instance's extra variable is gone
    assert (os.environ["HF_T_RANK"], os.environ["HF_T_PORT"]) == ("1", "29500")
    switch.switch({})
    assert "HF_T_RANK" not in os.environ and os.environ["HF_T_PORT"] == "from-the-process"


def test_a_switch_sets_only_the_variables_whose_values_differ(monkeypatch):
    for key in RANK0:
        monkeypatch.delenv(key, raising=False)
    switch = EnvSwitch()
    switch.switch(RANK0)
    set_now: list[str] = []
    real_putenv = os.putenv
    monkeypatch.setattr(os, "putenv", lambda k, v: (set_now.append(k), real_putenv(k, v)))
    switch.switch(RANK1)
    assert set_now == [os.fsencode("HF_T_RANK")]  # the rank's own; the shared ones stay as they are
    assert {k: os.environ[k] for k in RANK1} == RANK1
    switch.switch({})
    assert not any(k in os.environ for k in RANK0)
