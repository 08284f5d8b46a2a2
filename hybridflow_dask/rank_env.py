"""What each rank finds in ``os.environ``: built by the core, the same for every backend.

A backend receives the finished dict in ``Backend.create`` and only has to put it in
place; how ``CUDA_VISIBLE_DEVICES`` and ``LOCAL_RANK`` follow from the slots' devices, and
what ``WG_BACKEND`` says, is decided here, once.
"""

from __future__ import annotations

from typing import Any

from .backends.base import InstanceRef, Slot

__all__ = ["backend_name", "gpu_id", "rank_envs", "visible_devices"]


def rank_envs(
    refs: list[InstanceRef],
    local_ranks: list[int],
    local_sizes: list[int],
    node_peers: list[list[Slot]],
    rendezvous: tuple[str, int],
    extra: dict[str, str],
    backend_name: str,
) -> list[dict[str, str]]:
    """What each rank finds in ``os.environ`` before its class body runs.

    GPU ranks follow torchrun's model: ``CUDA_VISIBLE_DEVICES`` lists the GPUs of every
    slot the pool has on the rank's node, in local-rank order, and ``LOCAL_RANK`` is the
    index of the rank's own GPU in that list, so ``torch.cuda.set_device(LOCAL_RANK)``
    (or ``cuda:LOCAL_RANK``) is the rank's GPU, and NCCL sees its node peers' devices.
    When the node's slots do not each own a distinct GPU, a rank sees only its own GPU
    (device 0) and ``LOCAL_RANK`` is still its place on the node.
    """
    addr, port = rendezvous
    envs = []
    for ref in refs:
        local_rank = local_ranks[ref.rank]
        env = {
            **extra,
            "RANK": str(ref.rank),
            "WORLD_SIZE": str(len(refs)),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_sizes[ref.rank]),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "WG_PREFIX": ref.group,
            "WG_BACKEND": backend_name,
            "RAY_LOCAL_RANK": str(local_rank),
            "RAY_LOCAL_WORLD_SIZE": str(local_sizes[ref.rank]),
        }
        visible = visible_devices(ref.slot, node_peers[ref.rank], local_rank)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        envs.append(env)
    return envs


def gpu_id(slot: Slot) -> str | None:
    """The GPU ``slot`` owns, as ``CUDA_VISIBLE_DEVICES`` names it; ``None`` for a CPU slot.

    ``Slot.device`` must be ``"cpu"`` or ``"cuda:<id>"`` (the backend contract): any other
    value is a ``ValueError`` naming the slot, so a backend's mistake shows at group
    creation instead of as a rank on the wrong GPU.
    """
    device = slot.device
    if device == "cpu":
        return None
    if isinstance(device, str) and device.startswith("cuda:") and device[5:].strip():
        return device[5:].strip()
    raise ValueError(
        f"slot {slot.index} ({slot.address}) has device {device!r}; a backend's Slot.device "
        "must be 'cpu' or 'cuda:<id>', <id> as CUDA_VISIBLE_DEVICES names the GPU"
    )


def visible_devices(slot: Slot, peers: list[Slot], local_rank: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the rank on ``slot`` (``None`` on a CPU slot)."""
    own = gpu_id(slot)
    if own is None:
        return None
    ids = [gpu_id(peer) for peer in peers]
    known = [i for i in ids if i is not None]
    consistent = (
        len(known) == len(ids)
        and len(set(known)) == len(known)
        and 0 <= local_rank < len(known)
        and known[local_rank] == own
    )
    return ",".join(known) if consistent else own


def backend_name(backend: Any) -> str:
    """``WG_BACKEND``: the backend's own ``name`` attribute (``"dask"``, ``"local"``).

    Required by the ``Backend`` protocol; a backend without one is a ``TypeError`` that
    says so, rather than a name guessed from its class.
    """
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"{type(backend).__name__} has no backend name: the Backend protocol needs a "
            "non-empty str attribute `name` (e.g. name = 'dask'), which ranks see as "
            "WG_BACKEND"
        )
    return name
