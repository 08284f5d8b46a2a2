"""verl parity: ``execute_all`` and ALL_TO_ALL split arguments by verl's rule.

Split only when every positional and keyword argument is a list of exactly world-size
items; otherwise every rank gets the arguments whole. Tuples are never split.
"""

from __future__ import annotations

from hybridflow_dask import Dispatch, Worker, register


class Echo(Worker):
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def echo(self, *args, **kwargs):
        return self.rank, args, kwargs


def test_tuples_are_passed_whole(hf_local_backend, hf_worker_group):
    g = hf_worker_group(Echo, [2], backend=hf_local_backend)
    assert g.execute_all_sync("echo", (7, 8)) == [(0, ((7, 8),), {}), (1, ((7, 8),), {})]
    assert g.echo((7, 8)) == [(0, ((7, 8),), {}), (1, ((7, 8),), {})]


def test_a_list_next_to_a_non_list_is_passed_whole(hf_local_backend, hf_worker_group):
    g = hf_worker_group(Echo, [2], backend=hf_local_backend)
    assert g.echo([1, 2], "s") == [(0, ([1, 2], "s"), {}), (1, ([1, 2], "s"), {})]
    assert g.execute_all_sync("echo", [1, 2], tag="s") == [
        (0, ([1, 2],), {"tag": "s"}),
        (1, ([1, 2],), {"tag": "s"}),
    ]
    # A list of the wrong length stops the split for every argument.
    assert g.execute_all_sync("echo", [1, 2], [3, 4, 5]) == [
        (0, ([1, 2], [3, 4, 5]), {}),
        (1, ([1, 2], [3, 4, 5]), {}),
    ]


def test_all_world_size_lists_are_split(hf_local_backend, hf_worker_group):
    g = hf_worker_group(Echo, [2], backend=hf_local_backend)
    assert g.execute_all_sync("echo", [1, 2], ["a", "b"], k=[10, 20]) == [
        (0, (1, "a"), {"k": 10}),
        (1, (2, "b"), {"k": 20}),
    ]
    assert g.echo(x=[[1], [2]]) == [(0, (), {"x": [1]}), (1, (), {"x": [2]})]
