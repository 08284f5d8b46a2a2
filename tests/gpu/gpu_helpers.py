"""What the GPU tests run on workers, and how they read the GPU from outside (NVML).

Worker classes live here, at module level in an importable module, so Dask workers
unpickle them by reference. Nothing here starts CUDA at import: this module is imported
on machines without a GPU too, where the tests that use it are skipped.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import hybridflow_dask as hf
from hybridflow_dask.protocol import serialization as proto_serialization

GiB = 1 << 30


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nvml_uuid(index: str) -> str:
    """The UUID NVML gives the GPU that ``CUDA_VISIBLE_DEVICES`` calls ``index``, without
    its ``GPU-`` prefix (how torch writes it)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        if index.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(index)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
        uuid = pynvml.nvmlDeviceGetUUID(handle)
    finally:
        pynvml.nvmlShutdown()
    return plain_uuid(uuid.decode() if isinstance(uuid, bytes) else uuid)


def plain_uuid(uuid: Any) -> str:
    """A GPU UUID as lowercase hex groups, whoever wrote it (torch, NVML's ``GPU-...``)."""
    return str(uuid).strip().lower().removeprefix("gpu-")


def nvml_used_bytes(index: int = 0) -> int:
    """Device memory in use on GPU ``index``, all processes together, as NVML sees it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def wait_until(predicate: Any, timeout: float, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


def current_context() -> int:
    """The CUDA context current on this thread (driver API), as an address."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    status = libcuda.cuCtxGetCurrent(ctypes.byref(handle))
    if status != 0:
        raise RuntimeError(f"cuCtxGetCurrent returned CUresult {status}")
    return int(handle.value or 0)


class DeviceIdentity(hf.Worker):
    """Reports what a rank sees of its GPU before and after it first uses CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda_was_started = torch.cuda.is_initialized()
        self.env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK")}
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def identity(self) -> dict:
        local = int(self.env["LOCAL_RANK"] or 0)
        return {
            "env": self.env,
            "cuda_started_before_init": self.cuda_was_started,
            "device_count": torch.cuda.device_count(),
            "current_device": torch.cuda.current_device(),
            "uuid": plain_uuid(torch.cuda.get_device_properties(local).uuid),
            "uuid_of_cuda0": plain_uuid(torch.cuda.get_device_properties(0).uuid),
            "pid": os.getpid(),
        }


class Doubler(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: hf.DataProto) -> hf.DataProto:
        x = data.batch["x"]
        devices = torch.tensor([x.is_cuda] * len(data))
        return hf.DataProto.from_dict(
            {"x": x * 2, "half": data.batch["half"] + 1, "arrived_on_cuda": devices}
        )


class Producer(hf.Worker):
    """Returns a CUDA batch it keeps (as a trainer returns its buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: torch.Tensor | None = None

    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: hf.DataProto) -> hf.DataProto:
        rows = len(data)
        self.kept = torch.arange(rows * 1024, dtype=torch.float32, device="cuda").reshape(rows, -1)
        return hf.DataProto.from_dict({"x": self.kept})

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def kept_pointer(self) -> int:
        return int(self.kept.data_ptr()) if self.kept is not None else 0

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def count_host_copies(self) -> None:
        """From now on, count CUDA tensors this process's serializer copies to the host."""
        original = proto_serialization.__dict__.get("_hf_original_buffer")
        if original is None:
            original = proto_serialization._tensor_buffer
            proto_serialization.__dict__["_hf_original_buffer"] = original
        counter = {"n": 0}

        def counting(tensor: torch.Tensor) -> Any:
            if tensor.device.type == "cuda":
                counter["n"] += 1
            return original(tensor)

        proto_serialization._tensor_buffer = counting
        proto_serialization.__dict__["_hf_host_copies"] = counter

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def host_copies(self) -> int:
        return int(proto_serialization.__dict__["_hf_host_copies"]["n"])


class Consumer(hf.Worker):
    @hf.register(hf.Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def consume(self, data: hf.DataProto) -> hf.DataProto:
        x = data.batch["x"]
        rows = len(data)
        return hf.DataProto.from_dict(
            {
                "on_cuda": torch.tensor([x.is_cuda] * rows),
                "row_sum": x.sum(dim=1).cpu(),
                "pointer": torch.tensor([x.data_ptr()] * rows, dtype=torch.int64),
            }
        )


class Nccl(hf.Worker):
    """Joins an NCCL process group in ``__init__`` (env://, from the rank env)."""

    def __init__(self) -> None:
        super().__init__()
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> tuple[float, int, int, str]:
        tensor = torch.tensor([value * (self.rank + 1)], device="cuda")
        dist.all_reduce(tensor)
        return tensor.item(), dist.get_rank(), dist.get_world_size(), str(tensor.device)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def leave(self) -> None:
        dist.destroy_process_group()


class ContextReport(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def context(self) -> tuple[int, int, str]:
        torch.zeros(1, device="cuda")  # CUDA in use on this instance's thread
        return os.getpid(), current_context(), plain_uuid(torch.cuda.get_device_properties(0).uuid)


class MemoryHog(hf.Worker):
    """Holds ``nbytes`` of device memory for its life."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.block = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def held(self) -> int:
        return int(self.block.numel())


class Where(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[str, int, bool]:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return visible, int(os.environ["LOCAL_RANK"]), torch.cuda.is_available()
