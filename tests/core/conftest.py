"""Every core test starts with auto padding off, whatever the environment says."""

from __future__ import annotations

import pytest

from hybridflow_dask.protocol import AUTO_PADDING_ENV, DataProtoConfig


@pytest.fixture(autouse=True)
def _padding_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(AUTO_PADDING_ENV, raising=False)
    previous = DataProtoConfig._auto_padding
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = previous
