"""Round-trip cost of moving a DataProto: our zero-copy paths against pickle and torch.save.

Each method turns a DataProto into what would go on the wire, then a receiver gets fresh
copies of those bytes (one memcpy per buffer, as a socket read into new memory would) and
rebuilds the DataProto. Methods:

* ``frames``         ours: ``serialize_dataproto`` -> header + one frame per tensor/array
* ``pickle5-oob``    ours: ``pickle.dumps(dp, protocol=5, buffer_callback=...)``
* ``frames-inproc``  ours, no transfer copy (same-process hand-off: zero copy end to end)
* ``pickle-plain``   plain pickle of the same data without our hooks (a dict holding the
                     TensorDict, the numpy dict and meta_info; TensorDict's own pickling)
* ``torch.save``     verl's way: ``batch.contiguous().consolidate()``, ``torch.save`` into an
                     ``io.BytesIO``, pickle ``(bytes, non_tensor_batch, meta_info)``; load
                     with ``pickle.loads`` + ``torch.load``

Usage: ``python benchmarks/bench_serialization.py --sizes 1 64 256 --repeats 5``.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensordict
import torch
from outdir import results_dir  # benchmarks/outdir.py, next to this script

from hybridflow_dask.protocol import DataProto, deserialize_dataproto, serialize_dataproto

MiB = 1024 * 1024
DEFAULT_OUT = Path(__file__).parent / "results" / "serialization.json"

# One row: float32[256] + bfloat16[256] + int64[32] = 1792 bytes, plus a short uid string.
ROW_BYTES = 256 * 4 + 256 * 2 + 32 * 8


def make_dataproto(size_mib: int) -> DataProto:
    """About ``size_mib`` MiB of tensors plus a per-row object array of short strings."""
    rows = max(1, size_mib * MiB // ROW_BYTES)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "hidden": torch.randn(rows, 256, generator=g),
        "logprobs": torch.randn(rows, 256, generator=g).to(torch.bfloat16),
        "input_ids": torch.randint(0, 50_000, (rows, 32), generator=g),
    }
    uids = np.array([f"uid-{i}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(tensors, {"uid": uids}, {"step": 1, "temperature": 0.7})


def receive(frames: list[Any]) -> list[bytearray]:
    """Simulated transfer: the receiver holds fresh, writable copies of every buffer."""
    return [bytearray(memoryview(frame).cast("B")) for frame in frames]


# ---------------------------------------------------------------------- methods
# Each is (serialize: dp -> wire, deserialize: wire -> dp); wire is a list of buffers.


def frames_ser(dp: DataProto) -> tuple[dict, list]:
    return serialize_dataproto(dp)


def frames_deser(wire: tuple[dict, list]) -> DataProto:
    header, frames = wire
    return deserialize_dataproto(header, receive(frames))


def frames_deser_inproc(wire: tuple[dict, list]) -> DataProto:
    header, frames = wire
    return deserialize_dataproto(header, frames)


def pickle5_ser(dp: DataProto) -> tuple[bytes, list]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def pickle5_deser(wire: tuple[bytes, list]) -> DataProto:
    data, buffers = wire
    received = receive([data, *buffers])
    return pickle.loads(received[0], buffers=received[1:])


def plain_ser(dp: DataProto) -> bytes:
    state = {"batch": dp.batch, "non_tensor_batch": dp.non_tensor_batch, "meta_info": dp.meta_info}
    return pickle.dumps(state, protocol=5)


def plain_deser(wire: bytes) -> DataProto:
    state = pickle.loads(receive([wire])[0])
    return DataProto(state["batch"], state["non_tensor_batch"], state["meta_info"])


def torch_save_ser(dp: DataProto) -> bytes:
    batch = dp.batch.contiguous().consolidate()
    buffer = io.BytesIO()
    torch.save(batch, buffer)
    return pickle.dumps((buffer.getvalue(), dp.non_tensor_batch, dp.meta_info), protocol=5)


def torch_save_deser(wire: bytes) -> DataProto:
    blob, non_tensor, meta = pickle.loads(receive([wire])[0])
    batch = torch.load(io.BytesIO(blob), weights_only=False, map_location="cpu")
    return DataProto(batch, non_tensor, meta)


METHODS: dict[str, tuple[Callable, Callable]] = {
    "frames": (frames_ser, frames_deser),
    "pickle5-oob": (pickle5_ser, pickle5_deser),
    "frames-inproc": (frames_ser, frames_deser_inproc),
    "pickle-plain": (plain_ser, plain_deser),
    "torch.save": (torch_save_ser, torch_save_deser),
}


def wire_bytes(wire: Any) -> tuple[int, int]:
    """(total bytes, in-band bytes) of a method's output; in-band = all but raw buffers."""
    if isinstance(wire, bytes):
        return len(wire), len(wire)
    head, frames = wire
    total = sum(memoryview(f).nbytes for f in frames)
    if isinstance(head, bytes):  # pickle stream + out-of-band buffers
        return len(head) + total, len(head)
    objects = head.get("objects")
    pickled = memoryview(frames[objects["frame"]]).nbytes if objects else 0
    header_bytes = len(json.dumps(head))
    return header_bytes + total, header_bytes + pickled


def check_equal(a: DataProto, b: DataProto) -> None:
    if len(a) != len(b) or set(a.batch.keys()) != set(b.batch.keys()):
        raise RuntimeError("round trip changed the DataProto's shape")
    for key, x in a.batch.items():
        y = b.batch[key]
        if x.dtype != y.dtype or not torch.equal(x, y):
            raise RuntimeError(f"round trip changed tensor {key!r}")
    if a.non_tensor_batch["uid"].tolist() != b.non_tensor_batch["uid"].tolist():
        raise RuntimeError("round trip changed the object array")


def time_method(dp: DataProto, ser: Callable, deser: Callable, repeats: int) -> dict[str, Any]:
    ser_times, deser_times, totals = [], [], []
    sizes = (0, 0)
    for i in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        wire = ser(dp)
        t1 = time.perf_counter()
        back = deser(wire)
        t2 = time.perf_counter()
        if i == 0:
            check_equal(dp, back)
            sizes = wire_bytes(wire)
        ser_times.append(t1 - t0)
        deser_times.append(t2 - t1)
        totals.append(t2 - t0)
        del wire, back
    return {
        "serialize_ms": 1000 * statistics.median(ser_times),
        "deserialize_ms": 1000 * statistics.median(deser_times),
        "total_ms": 1000 * statistics.median(totals),
        "wire_bytes": sizes[0],
        "inband_bytes": sizes[1],
    }


def run(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    results = []
    for size in sizes:
        dp = make_dataproto(size)
        payload = sum(t.numel() * t.element_size() for t in dp.batch.values())
        by_method = {}
        for name, (ser, deser) in METHODS.items():
            row = {"size_mib": size, "method": name, "payload_bytes": payload}
            row.update(time_method(dp, ser, deser, repeats))
            row["gb_per_s"] = payload / (row["total_ms"] / 1000) / 1e9
            by_method[name] = row
        baseline = by_method["torch.save"]["total_ms"]
        for row in by_method.values():
            row["speedup_vs_torch_save"] = baseline / row["total_ms"]
            results.append(row)
        del dp
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    columns = [
        ("size MiB", "size_mib", "{:d}"),
        ("method", "method", "{}"),
        ("ser ms", "serialize_ms", "{:.1f}"),
        ("deser ms", "deserialize_ms", "{:.1f}"),
        ("total ms", "total_ms", "{:.1f}"),
        ("GB/s", "gb_per_s", "{:.2f}"),
        ("in-band KiB", "inband_bytes", "{}"),
        ("x vs torch.save", "speedup_vs_torch_save", "{:.1f}"),
    ]
    cells = [[title for title, _, _ in columns]]
    for row in results:
        line = []
        for _, key, fmt in columns:
            value = row[key]
            if key == "inband_bytes":
                value = f"{value / 1024:.1f}"
            line.append(fmt.format(value) if key != "inband_bytes" else value)
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "numpy": np.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256], help="MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out",
        type=Path,
        help="JSON file (default: results/serialization.json; results/scratch/ if partial)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = run(args.sizes, args.repeats)
    print(format_table(results))
    print(f"\nmedians of {args.repeats} runs; receiver copies every buffer except in frames-inproc")
    if args.out is None:
        partial = (args.sizes, args.repeats) != ([1, 64, 256], 5)
        args.out = results_dir(None, trial=partial) / DEFAULT_OUT.name
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(), "repeats": args.repeats, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
