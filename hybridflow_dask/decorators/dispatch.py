"""Dispatch and collect functions, and the registry that maps modes to them.

A dispatch function takes ``(worker_group, *args, **kwargs)`` and returns per-rank
``(args, kwargs)``: every argument becomes a list with one entry per rank. A collect
function takes ``(worker_group, outputs)`` (one output, or one backend future, per rank
that ran) and returns what the driver sees. These signatures are verl's, so custom modes
written for verl carry over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..protocol import PADDING_SIZE_KEY, DataProto, DataProtoFuture, unpad_dataproto
from ..protocol.future import check_same_rows, drop_tail
from ..protocol.rows import (
    concat_batches,
    cut_rows,
    is_batch,
    pad_for_dispatch,
    padding_enabled,
    padding_rows,
    row_count,
)
from ..protocol.tensordict_ops import chunk_bounds
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
    "looks_like_future",
    "make_nd_compute_dataproto_dispatch_fn",
    "register_dispatch_mode",
    "resolve_dispatch_mode",
    "update_dispatch_mode",
]


class Dispatched(tuple):
    """``(args, kwargs)`` plus the padding rows the collected result must drop.

    A 2-tuple, so custom dispatch functions that unpack a built-in one's result keep
    working: the built-in DP modes also put the pad in ``kwargs[PADDING_SIZE_KEY]`` (verl's
    key), which survives a wrapper that re-packs ``(args, kwargs)``; it is taken out again
    before the ranks are called. ``pad`` is an int (a ``PadRows``), or a backend future of
    one when the input was a future.
    """

    pad: Any

    def __new__(cls, args: tuple, kwargs: dict, pad: Any = 0) -> Dispatched:
        obj = super().__new__(cls, (args, kwargs))
        obj.pad = pad
        return obj


@dataclass(frozen=True)
class DispatchFns:
    """A mode's functions. ``passes_arguments``: the dispatch function hands every rank
    the caller's arguments in the caller's order (each one whole, or its rank's share),
    as every built-in DP/broadcast function does, so a call can be checked against the
    method's signature before it is dispatched."""

    dispatch_fn: Callable[..., Any]
    collect_fn: Callable[..., Any]
    passes_arguments: bool = False


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
    """Every argument is a list (or tuple) of one value per rank; rank ``i`` gets item ``i``.

    Tuples are handed on as lists, so the group splits them like lists (verl passes a
    tuple whole to every rank although its dispatch accepted it as per-rank values).
    """
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
                f"{n} items (the group's world size), got {got}; pass [value] * {n} to "
                "give every rank the same value, or register the method with "
                "Dispatch.ONE_TO_ALL"
            )
    return (
        tuple(_as_list(value) for value in args),
        {key: _as_list(value) for key, value in kwargs.items()},
    )


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def collect_dp_compute(worker_group: Any, output: Any) -> Any:
    return output if isinstance(output, list) else list(output)


# ---- DataProto modes ----------------------------------------------------------------


def dispatch_dp_compute_data_proto(worker_group: Any, *args: Any, **kwargs: Any) -> Dispatched:
    """Split every DataProto, TensorDict or DataProtoFuture argument into one chunk per rank.

    Every argument must be one of those, all of the same length. A batch with 0 rows is
    a ``ValueError`` (verl's ``chunk`` of an empty DataProto fails too: there is nothing
    to give each rank); a DataProtoFuture's length is known only where it was computed,
    so an empty one reaches the ranks as empty chunks, and a future whose length differs
    from another argument's fails the call there, before the method runs.
    """
    return _with_pad_key(_split_data(worker_group, worker_group.world_size, args, kwargs))


def dispatch_dp_compute_data_proto_with_func(
    worker_group: Any, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> Dispatched:
    """Send ``func`` to every rank with the split data."""
    if not callable(func):
        raise TypeError(
            f"DP_COMPUTE_PROTO_WITH_FUNC takes a function as its first argument, got {func!r}; "
            "pass the function first (it is called as func(worker, *shards)), then the data"
        )
    split = _split_data(worker_group, worker_group.world_size, args, kwargs)
    split_args, split_kwargs = split
    return _with_pad_key(
        Dispatched(([func] * worker_group.world_size, *split_args), split_kwargs, split.pad)
    )


def collect_dp_compute_data_proto(worker_group: Any, output: Any) -> Any:
    """Concatenate the ranks' DataProtos (or TensorDicts) in rank order, lazily for futures."""
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
    return _with_pad_key(
        Dispatched(
            tuple([chunks[d] for d in dp_ranks] for chunks in split_args),
            {key: [chunks[d] for d in dp_ranks] for key, chunks in split_kwargs.items()},
            split.pad,
        )
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
    """The functions registered for ``dispatch_mode``, as given (verl's registry entry)."""
    fns = _registered(dispatch_mode)
    return {"dispatch_fn": fns.dispatch_fn, "collect_fn": fns.collect_fn}


def resolve_dispatch_mode(dispatch_mode: Any) -> DispatchFns:
    """The functions a WorkerGroup calls for a ``Dispatch`` member or a dict mode.

    They wrap the registered ones so that padding is handled whatever the dispatch
    function returns: the pad is read from a ``Dispatched`` or from
    ``kwargs[PADDING_SIZE_KEY]`` (so a custom function that wraps a built-in one keeps
    it) and removed from the kwargs the ranks see; the WorkerGroup takes it off what the
    collect function returns with ``drop_padding``.
    """
    if isinstance(dispatch_mode, dict):
        fns = DispatchFns(dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"])
    else:
        fns = _registered(dispatch_mode)
    return _padding_aware(fns)


#: Built-in dispatch functions that hand every rank the caller's arguments, in order.
_PASSING_ARGUMENTS = frozenset(
    {
        dispatch_one_to_all,
        dispatch_all_to_all,
        dispatch_dp_compute,
        dispatch_dp_compute_data_proto,
        dispatch_dp_compute_data_proto_with_func,
        dispatch_nd_compute_dataproto,
    }
)


def _passes_arguments(dispatch_fn: Callable[..., Any]) -> bool:
    if isinstance(dispatch_fn, partial):  # make_nd_compute_dataproto_dispatch_fn's
        dispatch_fn = dispatch_fn.func
    try:
        return dispatch_fn in _PASSING_ARGUMENTS
    except TypeError:  # an unhashable callable is none of them
        return False


def _registered(dispatch_mode: Any) -> DispatchFns:
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


def _split_data(
    worker_group: Any, n: int, args: tuple, kwargs: dict, slots: list | None = None
) -> Dispatched:
    """Chunk each data argument ``n`` ways, padding where needed; all must agree on rows.

    Every argument in hand is checked (kind, rows, divisibility, equal lengths) before
    any future is routed, so a bad call sends nothing to any worker.
    """
    slots = slots if slots is not None else worker_group._rank_slots()
    named = _named(args, kwargs)
    rows = {
        name: _checked_rows(name, value, n)
        for name, value in named
        if not isinstance(value, DataProtoFuture)
    }
    if len(set(rows.values())) > 1:
        detail = ", ".join(f"{name}: {count} rows" for name, count in rows.items())
        raise ValueError(
            f"DataProto arguments of one call must have the same length ({detail}); "
            "pass batches whose row i belongs together, one row per sample in each"
        )
    consumer = getattr(worker_group, "name_prefix", None)  # routing shows under the consumer
    split = [_split_one(name, value, n, slots, consumer) for name, value in named]
    if len(split) > 1 and any(s.rows is None for s in split):
        _check_rows_on_workers(split, slots)
    chunks = [s.chunks for s in split]
    pad = split[0].pad if split else 0
    return Dispatched(tuple(chunks[: len(args)]), dict(zip(kwargs, chunks[len(args) :])), pad)


@dataclass
class _Split:
    """One data argument cut into per-rank chunks; ``rows`` is None for a future's."""

    name: str
    chunks: list[Any]
    pad: Any
    rows: int | None
    source: Any


def _checked_rows(name: str, value: Any, n: int) -> int:
    """The rows of a data argument in hand, or the error that says why it cannot be split."""
    if not is_batch(value):
        raise TypeError(
            f"argument {name} must be a DataProto, TensorDict or DataProtoFuture for this "
            f"dispatch mode, got {_describe(value)}; {_fix_for(value)}"
        )
    rows = row_count(value)
    if rows == 0:
        raise ValueError(
            f"argument {name} has 0 rows: there is nothing to split over {n} ranks (verl's "
            "DataProto.chunk fails on an empty batch too); skip the call when the batch is "
            "empty, or register the method with Dispatch.ONE_TO_ALL to hand every rank the "
            "whole batch"
        )
    if rows % n and not padding_enabled(value):
        raise ValueError(
            f"argument {name} has {rows} rows, not divisible by {n} ranks; turn on "
            "auto padding (DataProtoConfig.auto_padding = True, VERL_AUTO_PADDING=1, or "
            "DataProto.from_dict(..., auto_padding=True)) or send a multiple of "
            f"{n} rows"
        )
    return rows


def _split_one(name: str, value: Any, n: int, slots: list, consumer: str | None) -> _Split:
    if isinstance(value, DataProtoFuture):
        chunks, pad = value.route(n, slots, consumer=consumer)
        # One single-part future per rank: materialized where the call runs, or handed
        # to the rank as is for methods registered with materialize_futures=False.
        futures = [
            DataProtoFuture([chunk], value.runner, 0, [slot], value.label)
            for chunk, slot in zip(chunks, slots)
        ]
        return _Split(name, futures, pad, None, value)
    rows = _checked_rows(name, value, n)
    padded, pad = pad_for_dispatch(value, n)
    bounds = chunk_bounds(row_count(padded), n)
    return _Split(name, cut_rows(padded, bounds), pad, rows, value)


def looks_like_future(value: Any) -> bool:
    """A backend's future (any backend's): something with ``result()`` and ``done()``."""
    try:
        return callable(getattr(value, "result", None)) and callable(getattr(value, "done", None))
    except Exception:  # an object whose attribute lookup itself fails is no future
        return False


def _describe(value: Any) -> str:
    if isinstance(value, list) and value and all(looks_like_future(v) for v in value):
        return f"a {type(value).__name__} of {len(value)} futures (a non-blocking call's result)"
    if looks_like_future(value):
        return f"a {type(value).__name__} (a backend future)"
    return type(value).__name__


def _fix_for(value: Any) -> str:
    if looks_like_future(value) or (
        isinstance(value, list) and value and all(looks_like_future(v) for v in value)
    ):
        return (
            "register the producing method with Dispatch.DP_COMPUTE_PROTO (a non-blocking "
            "one returns a DataProtoFuture, which this mode splits), or pass "
            "DataProto.concat(hf.get(futures))"
        )
    return "wrap it with DataProto.from_dict(...) or register the method with Dispatch.ONE_TO_ALL"


def _check_rows_on_workers(split: list[_Split], slots: list) -> None:
    """Make every rank's future chunks fail unless all data arguments have equal rows.

    A future's length is known only where it was computed, so the check runs there, next
    to the chunks: each rank's call then fails with a ValueError naming the lengths
    instead of silently dropping the longer argument's extra rows.
    """
    runner = next(s.source.runner for s in split if s.rows is None)
    lengths = [s.rows if s.rows is not None else s.source.num_rows() for s in split]
    names = tuple(s.name for s in split)
    for s in split:
        if s.rows is not None:
            continue
        s.chunks = [
            DataProtoFuture(
                [runner.submit(check_same_rows, fut.parts[0], names, *lengths, slot=slot)],
                fut.runner,
                0,
                [slot],
                fut.label,
            )
            for fut, slot in zip(s.chunks, slots)
        ]


def _with_pad_key(dispatched: Dispatched) -> Dispatched:
    """Also carry the pad in the kwargs, under verl's key (see ``Dispatched``)."""
    pad = dispatched.pad
    if _is_zero(pad):
        return dispatched
    args, kwargs = dispatched
    return Dispatched(args, {**kwargs, PADDING_SIZE_KEY: pad}, pad)


def _is_zero(pad: Any) -> bool:
    return isinstance(pad, int) and pad == 0


def _concat_outputs(worker_group: Any, outputs: list[Any], ranks: list[int]) -> Any:
    backend = worker_group._backend
    if outputs and all(backend.is_future(o) for o in outputs):
        slots = worker_group._rank_slots()
        return DataProtoFuture(
            outputs, backend, 0, [slots[r] for r in ranks], label=worker_group.name_prefix
        )
    for rank, out in zip(ranks, outputs):
        if not is_batch(out):
            raise TypeError(
                f"rank {rank} returned {type(out).__name__}; a DataProto collect mode needs "
                "every rank to return a DataProto or a TensorDict (use DP_COMPUTE_METRIC for "
                "other values)"
            )
    return concat_batches(outputs)


# ---- padding through custom dispatch functions ------------------------------------------


def _padding_aware(fns: DispatchFns) -> DispatchFns:
    def dispatch_fn(worker_group: Any, *args: Any, **kwargs: Any) -> Dispatched:
        return _as_dispatched(fns.dispatch_fn(worker_group, *args, **kwargs))

    return DispatchFns(dispatch_fn, fns.collect_fn, _passes_arguments(fns.dispatch_fn))


def _as_dispatched(result: Any) -> Dispatched:
    """A dispatch function's ``(args, kwargs)`` with the pad taken out of the kwargs."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(
            "a dispatch function must return (args, kwargs): per-rank lists for each "
            f"positional and keyword argument; got {type(result).__name__}"
        )
    args, kwargs = result
    if not isinstance(kwargs, dict):
        raise TypeError(
            f"a dispatch function must return (args, kwargs) with kwargs a dict, got "
            f"{type(kwargs).__name__}"
        )
    pad = getattr(result, "pad", 0)
    if PADDING_SIZE_KEY in kwargs:
        kwargs = dict(kwargs)
        pad = kwargs.pop(PADDING_SIZE_KEY)
    return Dispatched(tuple(args), kwargs, pad)


def drop_padding(
    result: Any, pad: Any, backend: Any, *, source: str = "", parts: list[Any] | None = None
) -> Any:
    """The collected ``result`` without what padding added: a DataProto's or TensorDict's
    padding rows, padded ranks' list entries, or, for a ``DataProtoFuture``, the pad
    recorded for whoever resolves it. The one place padding is taken off a result.

    ``pad`` is what the call's ``Dispatched`` carried: an int, a ``PadRows``, or a
    backend future of one (``backend`` gathers it). How many rows a batch result loses
    is ``protocol.rows.padding_rows``'s rule: a method that returns ``k`` rows for every
    row it was sent (``k = 1``: one row per row; ``DataProto.repeat(k, interleave=True)``
    for ``k`` samples per prompt), each row's results together and in input order, loses
    exactly its last ``k * pad`` rows; any other row count under padding is a
    ``ValueError`` naming ``source`` (``"group.method"``), the rows sent and the rows
    returned, since the padding's rows cannot be told apart then. ``parts`` (a blocking
    call's per-rank results) lets that check run rank by rank: every rank must return
    ``k`` times the rows it was sent, with one ``k`` for all.
    """
    if _is_zero(pad):
        return result
    if isinstance(result, DataProtoFuture):
        return dataclasses.replace(result, pad=pad)
    if not (isinstance(result, list) or is_batch(result)):
        return result
    if backend.is_future(pad):
        pad = backend.gather([pad])[0]
    if is_batch(result) and parts is not None:
        _check_rows_per_rank(parts, pad, source)
    if isinstance(result, DataProto):
        return unpad_dataproto(result, padding_rows(pad, len(result), source))
    if not isinstance(result, list):
        return drop_tail(result, pad, source)
    # verl drops one entry per padding row; a PadRows knows how many ranks really got
    # padding, so ranks that computed on real rows only keep their entries.
    padded_ranks = getattr(pad, "padded_chunks", int(pad))
    keep = max(len(result) - padded_ranks, 0)
    if type(result) is list or not hasattr(result, "__dict__"):
        return list(result[:keep])
    trimmed = type(result).__new__(type(result))  # e.g. a FutureList: keep its backend
    trimmed.__dict__.update(result.__dict__)
    list.extend(trimmed, result[:keep])
    return trimmed


def _check_rows_per_rank(parts: list[Any], pad: Any, source: str) -> None:
    """Every rank returned ``k`` times the rows it was sent, one ``k`` for all ranks.

    Only when ``parts`` are one batch per chunk the input was split into (not an N-d
    mesh's replicas) and ``pad`` knows the chunk size.
    """
    padded, chunks = getattr(pad, "padded_rows", None), getattr(pad, "chunks", None)
    if not padded or not chunks or len(parts) != chunks or not all(map(is_batch, parts)):
        return
    size = padded // chunks
    got = [row_count(part) for part in parts]
    k = got[0] // size
    for rank, rows in enumerate(got):
        if rows != k * size:
            than_zero = f", rank 0 returned {got[0]}" if rank else ""
            raise ValueError(
                f"{source or 'the method'} returned {rows} rows on rank {rank} for the "
                f"{size} rows it was sent{than_zero} ({int(pad)} of the {padded} rows sent "
                "to the ranks were auto padding): with auto padding every rank must return "
                "the same number k of rows for every row it was sent, in input order "
                f"(k * {size} rows), so that the last k * {int(pad)} rows of the result are "
                "the padding's and can be dropped. Return k rows per input row, or turn "
                f"auto padding off and send a multiple of {chunks} rows"
            )
