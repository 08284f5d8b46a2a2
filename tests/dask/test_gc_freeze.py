"""The driver and every worker freeze the objects alive at start-up, once per process.

A full collection otherwise rescans torch's and Dask's ~400k objects (a 0.2 s pause that a
burst of calls hits). Freezing again later would pin a program's own cyclic garbage for
good, so a second backend must not freeze.
"""

from __future__ import annotations

import gc
import weakref

from hybridflow_dask.backends import DaskBackend


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_driver_and_each_worker_froze_their_start_up_objects(hf_dask_backend):
    assert gc.get_freeze_count() > 0
    counts = hf_dask_backend.client.run(gc.get_freeze_count)
    assert counts and all(n > 0 for n in counts.values()), counts


def test_a_later_backend_does_not_freeze_the_program_s_garbage(hf_dask_cluster, hf_dask_backend):
    frozen = gc.get_freeze_count()
    gc.disable()  # no automatic collection may free the garbage before the backend starts
    try:
        garbage = Node()
        gone = weakref.ref(garbage)
        del garbage  # unreachable, but alive until a collection
        backend = DaskBackend(cluster=hf_dask_cluster)
    finally:
        gc.enable()
    try:
        assert gc.get_freeze_count() <= frozen  # frozen objects still die; none were added
        gc.collect()
        assert gone() is None
    finally:
        backend.shutdown()
