"""Reading what the scheduler shows of calls: task prefixes and the task stream."""

from __future__ import annotations

import time
from typing import Any


def wait_for_streamed(client: Any, wanted: set[str], timeout: float = 10) -> set[str]:
    """Task-name prefixes the scheduler knows (tasks and task-stream records), once
    ``wanted`` are all there or ``timeout`` passed: direct calls are not tasks, they reach
    the dashboard's task stream as records a moment after they finish."""
    deadline = time.monotonic() + timeout
    while True:
        prefixes = set(client.run_on_scheduler(_prefixes_of_tasks_and_stream))
        if wanted <= prefixes or time.monotonic() > deadline:
            return prefixes
        time.sleep(0.1)


def _prefixes_of_tasks_and_stream(dask_scheduler: Any) -> list[str]:
    from dask.utils import key_split

    found = set(dask_scheduler.task_prefixes)
    for plugin in dask_scheduler.plugins.values():
        for record in getattr(plugin, "buffer", ()):
            if isinstance(record, dict) and "key" in record:
                found.add(key_split(record["key"]))
    return sorted(found)
