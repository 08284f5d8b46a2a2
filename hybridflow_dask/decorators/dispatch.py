"""Dispatch and collect functions, and the registry that maps modes to them.

A dispatch function takes ``(worker_group, *args, **kwargs)`` and returns per-rank
``(args, kwargs)``: every argument becomes a list with one entry per rank. A collect
function takes ``(worker_group, outputs)`` (one output, or one backend future, per rank
that ran) and returns what the driver sees. These signatures are verl's, so custom modes
written for verl carry over.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..protocol import DataProto, DataProtoConfig, DataProtoFuture, pad_dataproto_to_divisor
from .modes import Dispatch

__all__ = [
    "DispatchFns",
    "Dispatched",
    "collect_all_to_all",
    "collect_dp_compute",
    "collect_dp_compute_data_proto",
    "collect_nd_compute_dataproto",
    "dispatch_all_to_all",
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
    "dispatch_nd_compute_dataproto",
    "dispatch_one_to_all",
    "get_predefined_dispatch_fn",
    "make_nd_compute_dataproto_dispatch_fn",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]


class Dispatched(tuple):
    """``(args, kwargs)`` plus the padding rows the collected result must drop.

    A 2-tuple, so custom dispatch functions that unpack a built-in one's result keep
    working; ``pad`` is an int, or a backend future when the input was a future.
    """

    pad: Any

    def __new__(cls, args: tuple, kwargs: dict, pad: Any = 0) -> Dispatched:
        obj = super().__new__(cls, (args, kwargs))
        obj.pad = pad
        return obj


@dataclass(frozen=True)
class DispatchFns:
    dispatch_fn: Callable[..., Any]
    collect_fn: Callable[..., Any]


# ---- simple modes -------------------------------------------------------------------


def dispatch_one_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    n = worker_group.world_size
    return (
        tuple([arg] * n for arg in args),
        {key: [value] * n for key, value in kwargs.items()},
    )


def dispatch_all_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    return args, kwargs


def collect_all_to_all(worker_group: Any, output: Any) -> Any:
    return output


def dispatch_dp_compute(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    n = worker_group.world_size
    for name, value in _named(args, kwargs):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = (
                f"a {type(value).__name__} of length {len(value)}"
                if isinstance(value, (list, tuple))
                else type(value).__name__
            )
            raise ValueError(
                f"DP_COMPUTE needs one value per rank: argument {name} must be a list of "
                f"{n} items (the group's world size), got {got}"
            )
    return args, kwargs


def collect_dp_compute(worker_group: Any, output: Any) -> Any:
    return output if isinstance(output, list) else list(output)


# ---- DataProto modes ----------------------------------------------------------------


def dispatch_dp_compute_data_proto(worker_group: Any, *args: Any, **kwargs: Any) -> Dispatched:
    """Split every DataProto (or DataProtoFuture) argument into one chunk per rank."""
    return _split_data(worker_group, worker_group.world_size, args, kwargs)


def dispatch_dp_compute_data_proto_with_func(
    worker_group: Any, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> Dispatched:
    """Send ``func`` to every rank with the split data."""
    if not callable(func):
        raise TypeError(
            f"DP_COMPUTE_PROTO_WITH_FUNC takes a function as its first argument, got {func!r}"
        )
    split = _split_data(worker_group, worker_group.world_size, args, kwargs)
    split_args, split_kwargs = split
    return Dispatched(([func] * worker_group.world_size, *split_args), split_kwargs, split.pad)


def collect_dp_compute_data_proto(worker_group: Any, output: Any) -> Any:
    """Concatenate the ranks' DataProtos in rank order (lazily, if they are futures)."""
    return _concat_outputs(worker_group, list(output), list(range(len(output))))


def dispatch_direct_rollout_method(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(
        "methods registered with Dispatch.DIRECT_ROLLOUT_METHOD are called inside a fused "
        "worker, not from the driver"
    )


# ---- N-d meshes (TP/PP/DP) ----------------------------------------------------------


def dispatch_nd_compute_dataproto(
    mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any
) -> Dispatched:
    """Split by DP rank, and give every rank of a DP group the same chunk."""
    dp_ranks, _ = worker_group._dispatch_info(mesh_name)
    dp_size = max(dp_ranks) + 1
    slots = [worker_group._slot_of_first(dp_ranks, d) for d in range(dp_size)]
    split = _split_data(worker_group, dp_size, args, kwargs, slots=slots)
    split_args, split_kwargs = split
    return Dispatched(
        tuple([chunks[d] for d in dp_ranks] for chunks in split_args),
        {key: [chunks[d] for d in dp_ranks] for key, chunks in split_kwargs.items()},
        split.pad,
    )


def collect_nd_compute_dataproto(mesh_name: str, worker_group: Any, output: Any) -> Any:
    """Concatenate the outputs of the ranks marked ``is_collect``, in rank order."""
    _, collect_mask = worker_group._dispatch_info(mesh_name)
    ranks = [r for r, keep in enumerate(collect_mask) if keep]
    return _concat_outputs(worker_group, [output[r] for r in ranks], ranks)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Callable[..., Any]]:
    """A dict dispatch mode for workers that called ``_register_dispatch_collect_info``."""
    return {
        "dispatch_fn": partial(dispatch_nd_compute_dataproto, mesh_name),
        "collect_fn": partial(collect_nd_compute_dataproto, mesh_name),
    }


# ---- registry -----------------------------------------------------------------------

_REGISTRY: dict[Dispatch, DispatchFns] = {
    Dispatch.RANK_ZERO: DispatchFns(dispatch_all_to_all, collect_all_to_all),
    Dispatch.ONE_TO_ALL: DispatchFns(dispatch_one_to_all, collect_all_to_all),
    Dispatch.ALL_TO_ALL: DispatchFns(dispatch_all_to_all, collect_all_to_all),
    Dispatch.DP_COMPUTE: DispatchFns(dispatch_dp_compute, collect_dp_compute),
    Dispatch.DP_COMPUTE_PROTO: DispatchFns(
        dispatch_dp_compute_data_proto, collect_dp_compute_data_proto
    ),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: DispatchFns(
        dispatch_dp_compute_data_proto_with_func, collect_dp_compute_data_proto
    ),
    Dispatch.DP_COMPUTE_METRIC: DispatchFns(dispatch_dp_compute_data_proto, collect_dp_compute),
    Dispatch.DIRECT_ROLLOUT_METHOD: DispatchFns(dispatch_direct_rollout_method, collect_all_to_all),
}


def get_predefined_dispatch_fn(dispatch_mode: Dispatch) -> dict[str, Callable[..., Any]]:
    fns = resolve_dispatch_mode(dispatch_mode)
    return {"dispatch_fn": fns.dispatch_fn, "collect_fn": fns.collect_fn}


def resolve_dispatch_mode(dispatch_mode: Any) -> DispatchFns:
    """The functions behind a ``Dispatch`` member or a ``{dispatch_fn, collect_fn}`` dict."""
    if isinstance(dispatch_mode, dict):
        return DispatchFns(dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"])
    try:
        return _REGISTRY[dispatch_mode]
    except (KeyError, TypeError):
        raise ValueError(
            f"dispatch mode {dispatch_mode!r} has no dispatch/collect functions; "
            "add them with register_dispatch_mode or update_dispatch_mode"
        ) from None


def register_dispatch_mode(
    dispatch_mode_name: str, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> Dispatch:
    """Add ``Dispatch.<name>`` with its functions; returns the new member."""
    _check_callables(dispatch_fn, collect_fn)
    mode = Dispatch.register(dispatch_mode_name)
    _REGISTRY[mode] = DispatchFns(dispatch_fn, collect_fn)
    return mode


def update_dispatch_mode(
    dispatch_mode: Dispatch, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]
) -> None:
    """Replace the functions of an existing mode."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"update_dispatch_mode needs a Dispatch member, got {dispatch_mode!r}")
    _check_callables(dispatch_fn, collect_fn)
    _REGISTRY[dispatch_mode] = DispatchFns(dispatch_fn, collect_fn)


def _check_callables(dispatch_fn: Any, collect_fn: Any) -> None:
    for name, fn in (("dispatch_fn", dispatch_fn), ("collect_fn", collect_fn)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {fn!r}")


# ---- helpers ------------------------------------------------------------------------


def _named(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [(f"#{i}", a) for i, a in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]


def padding_enabled(data: DataProto) -> bool:
    """Auto padding is on globally (config or ``VERL_AUTO_PADDING``) or for this batch."""
    env = os.environ.get("VERL_AUTO_PADDING", "").strip().lower() in ("1", "true")
    return bool(DataProtoConfig.auto_padding) or env or data.is_padding_enabled()


def _split_data(
    worker_group: Any, n: int, args: tuple, kwargs: dict, slots: list | None = None
) -> Dispatched:
    """Chunk each data argument ``n`` ways, padding where needed; all must agree on rows."""
    slots = slots if slots is not None else worker_group._rank_slots()
    pads: list[tuple[str, Any, int | None]] = []

    def split(name: str, value: Any) -> list[Any]:
        if isinstance(value, DataProtoFuture):
            chunks, pad = value.route(n, slots)
            pads.append((name, pad, None))
            # One single-part future per rank: materialized where the call runs, or handed
            # to the rank as is for methods registered with materialize_futures=False.
            return [
                DataProtoFuture([chunk], value.runner, 0, [slot], value.label)
                for chunk, slot in zip(chunks, slots)
            ]
        if not isinstance(value, DataProto):
            raise TypeError(
                f"argument {name} must be a DataProto or DataProtoFuture for this dispatch "
                f"mode, got {type(value).__name__}; wrap it with DataProto.from_dict(...) or "
                "register the method with Dispatch.ONE_TO_ALL"
            )
        pad = 0
        if len(value) % n and padding_enabled(value):
            value, pad = pad_dataproto_to_divisor(value, n)
        elif len(value) % n:
            raise ValueError(
                f"argument {name} has {len(value)} rows, not divisible by {n} ranks; turn on "
                "auto padding (DataProtoConfig.auto_padding = True, VERL_AUTO_PADDING=1, or "
                "DataProto.from_dict(..., auto_padding=True)) or send a multiple of "
                f"{n} rows"
            )
        pads.append((name, pad, len(value) - pad))
        return value.chunk(n)

    split_args = tuple(split(name, a) for name, a in _named(args, {}))
    split_kwargs = {key: split(repr(key), v) for key, v in kwargs.items()}
    known = {(rows, pad) for _, pad, rows in pads if rows is not None}
    if len(known) > 1:
        detail = ", ".join(f"{name}: {rows} rows" for name, _, rows in pads if rows is not None)
        raise ValueError(f"DataProto arguments of one call must have the same length ({detail})")
    pad = pads[0][1] if pads else 0
    return Dispatched(split_args, split_kwargs, pad)


def _concat_outputs(worker_group: Any, outputs: list[Any], ranks: list[int]) -> Any:
    backend = worker_group._backend
    if outputs and all(backend.is_future(o) for o in outputs):
        slots = worker_group._rank_slots()
        return DataProtoFuture(
            outputs, backend, 0, [slots[r] for r in ranks], label=worker_group.name_prefix
        )
    for rank, out in zip(ranks, outputs):
        if not isinstance(out, DataProto):
            raise TypeError(
                f"rank {rank} returned {type(out).__name__}; a DataProto collect mode needs "
                "every rank to return a DataProto (use DP_COMPUTE_METRIC for other values)"
            )
    return DataProto.concat(outputs)
