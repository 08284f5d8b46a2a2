"""Tests across hosts made of network namespaces (``hybridflow_dask.testing.hosts``).

Every test here carries the ``hosts`` marker (deselect with ``-m "not hosts"``) and the
``cluster`` one (they start processes); they need root and ``ip`` and skip with that
reason elsewhere. CI runs them as root.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.hosts)
            item.add_marker(pytest.mark.cluster)
