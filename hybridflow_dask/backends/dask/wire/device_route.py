"""The device route: CUDA tensors between GPU workers without a trip through host memory.

``hybridflow.device-transfer`` (or ``DaskBackend(device_transfer=...)``) picks where the
bytes of CUDA tensors go when a value is copied or moved:

- ``host`` (the default): the sender copies them to host memory, the receiver back to its
  device, as ``protocol.serialization`` always does for Dask's ``dask`` family;
- ``device``: each process the backend reaches (the driver, and every worker through
  :class:`DeviceRoutePlugin`) turns this module's switch on. Then the copies a worker
  makes of a CUDA result (the snapshot at return, a colocated consumer's private input)
  are made on the device, and DataProtos, TensorDicts and tensors answer Dask's ``cuda``
  serialization family with their CUDA frames left on the device. Dask asks that family
  only on comms that carry device memory (UCX, through ``distributed-ucxx``); TCP and TLS
  comms ask ``dask`` first and still carry host bytes.

:func:`choose_transfer_route` decides, from plain facts, what a backend gets, and
refuses the device route where it cannot work (no GPU worker at all).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

__all__ = [
    "DEVICE_COMMS",
    "DEVICE_ROUTE_PLUGIN",
    "DeviceRoutePlugin",
    "TransferRoute",
    "choose_transfer_route",
    "enable",
    "enabled",
    "serializers",
    "ucx_available",
]

#: Comm protocols whose frames may be device memory (Dask's ``cuda`` family is asked first).
DEVICE_COMMS = frozenset({"ucx", "ucxx"})
#: The worker plugin's name on the cluster.
DEVICE_ROUTE_PLUGIN = "hybridflow-device-route"

_state = {"on": False}


def enabled() -> bool:
    """Whether this process keeps CUDA tensors on the device (the device route)."""
    return _state["on"]


def enable() -> None:
    """Turn the device route on in this process, for good (a process hosts one cluster's
    instances; a backend cannot know whether another one still relies on it)."""
    _state["on"] = True


def serializers() -> tuple[str, ...]:
    """Dask serializer families for copies made inside this process."""
    return ("cuda", "dask", "pickle") if enabled() else ("dask", "pickle")


class DeviceRoutePlugin(WorkerPlugin):
    """Turns the device route on in every worker process, present and future."""

    name = DEVICE_ROUTE_PLUGIN
    idempotent = True

    def setup(self, worker: Any) -> None:
        enable()


def ucx_available() -> bool:
    """Whether Dask can speak ``ucx://`` here (``distributed-ucxx`` is installed)."""
    return importlib.util.find_spec("distributed_ucxx") is not None


@dataclass(frozen=True)
class TransferRoute:
    """What a backend does with CUDA tensors' bytes.

    ``name`` is ``"host"`` or ``"device"``; ``between_workers`` says how they cross from
    one worker process to another (``"device"`` only on a comm that carries device
    memory); ``reason`` is the sentence ``hybridflow-dask info`` and the log print.
    """

    name: str
    between_workers: str
    reason: str


def choose_transfer_route(requested: str, *, protocol: str, gpus: int | None) -> TransferRoute:
    """Pure decision, so it can be tested with any cluster's facts.

    ``protocol`` is the cluster's comm (``"tcp"``, ``"tls"``, ``"ucx"``, ``"inproc"``);
    ``gpus`` how many GPU workers it has (``None``: not known yet, e.g. an attached
    cluster with no workers so far). ``ValueError`` for the device route on a cluster
    known to have no GPU worker.
    """
    if requested == "host":
        return TransferRoute("host", "host", "hybridflow.device-transfer is 'host' (default)")
    if requested != "device":
        raise ValueError(f"unknown transfer route {requested!r}: 'host' or 'device'")
    if gpus == 0:
        raise ValueError(
            "hybridflow.device-transfer='device' keeps CUDA tensors on GPU workers' devices, "
            "but no worker of this cluster has a GPU; use 'host' (the default), or start GPU "
            "workers (LocalCUDACluster, dask cuda worker)"
        )
    if protocol in DEVICE_COMMS:
        return TransferRoute(
            "device",
            "device",
            f"CUDA tensors stay on the device: the cluster's {protocol}:// comm carries "
            "device memory between workers",
        )
    return TransferRoute(
        "device",
        "host",
        f"CUDA tensors stay on the device within each worker process; the cluster's "
        f"{protocol}:// comm carries host bytes only, so between worker processes they still "
        "cross as host bytes (start the cluster with protocol='ucx' and distributed-ucxx for "
        "device-to-device transfers)",
    )
