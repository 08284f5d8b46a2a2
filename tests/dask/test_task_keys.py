"""Task keys: unique across the driver's calls and across processes forked from it."""

from __future__ import annotations

import os

import pytest

from hybridflow_dask.backends.dask.wire.keys import task_key, task_keys


def test_keys_are_unique_and_keep_the_label_dask_shows():
    keys = [task_key("actor-rollout.generate") for _ in range(1000)]
    keys += list(task_keys("actor-rollout.generate", 1000))
    assert len(set(keys)) == len(keys)
    assert all(k.startswith("actor_rollout.generate-") for k in keys)


@pytest.mark.cluster  # (it forks a process)
def test_a_forked_child_draws_keys_of_its_own():
    parent = task_key("g.m")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first key, then out without running pytest's teardown
        try:
            os.write(write, task_key("g.m").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    os.waitpid(pid, 0)
    assert child and child != parent
    # not the parent's next key either: a different prefix, not just the next number
    assert child.split("-")[1][:20] != parent.split("-")[1][:20]
