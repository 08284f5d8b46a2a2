"""One job of the shared-cluster test: a driver process that attaches to the cluster at
``argv[1]``, builds a group of two ranks that call ``init_process_group("gloo")`` without
a guard (as a careless worker does), all-reduces once, prints what it saw as JSON, and
leaves the cluster running. Run twice against one cluster by ``test_hosts_fresh``."""

from __future__ import annotations

import json
import os
import sys

import dask
import torch
import torch.distributed as dist

import hybridflow_dask as hf
from hybridflow_dask.backends import DaskBackend


class Unguarded(hf.Worker):
    def __init__(self) -> None:
        dist.init_process_group("gloo")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def total(self, value: int) -> dict:
        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        return {"pid": os.getpid(), "sum": int(tensor.item())}


def main(address: str) -> None:
    with dask.config.set({"hybridflow.fresh-processes": True}):
        backend = DaskBackend(address=address)
    with backend, hf.WorkerGroup(hf.ResourcePool([2]), Unguarded, backend=backend) as group:
        print(json.dumps(group.total(1)))


if __name__ == "__main__":
    main(sys.argv[1])
