"""Several ranks' rows of a split batch, sent to their process as one piece.

A ``DP_COMPUTE_PROTO`` call cuts its batch into one chunk per rank, and a process that
hosts several ranks of the group would get each chunk packed on its own: a serialization
per rank in the driver, and as many on the way back in. When the ranks of one process
were given consecutive chunks of the same batches (``cut_from``), the driver sends their
rows as one piece instead, and each rank's bounds within it; the worker reads the piece
once and gives each rank a copy of its rows, its own memory as a chunk of its own would
have been. The driver then packs a batch once per process, not once per rank.

The way back is the same: when every rank of a piece returns a ``DataProto``, the worker
joins their rows and packs them once, with each rank's bounds and ``meta_info``, and the
driver reads one piece per process and gives each rank's result as its rows of it.

This module is the format both ends agree on: ``piece_of`` and ``results_of`` (the
driver), ``rows_for`` and ``join_results`` (the worker).
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

from dask.sizeof import sizeof

from ....protocol import DataProto
from ....protocol.rows import cut_from
from .messages import is_plain

__all__ = ["PIECE_MAX_BYTES", "Piece", "join_results", "piece_of", "results_of", "rows_for"]


#: The most bytes of rows that travel as one piece, either way. A piece saves the driver
#: ~20-25 µs per rank (one packing, or one reply read, instead of one per rank) and costs
#: the worker a copy of the rows (each rank's own, out of the piece; the results joined):
#: for 32 ranks that is the time of copying a few MiB, so larger rows travel rank by
#: rank, each from its own memory.
PIECE_MAX_BYTES = 4 << 20


class Piece(NamedTuple):
    """What a process's ranks are sent together: the arguments with each batch replaced
    by the rows of all of them, and each rank's ``(start, stop)`` within those rows."""

    args: tuple
    kwargs: dict
    bounds: list[tuple[int, int]]


def piece_of(args: Sequence[tuple], kwargs: Sequence[dict]) -> Piece | None:
    """One piece for ranks given ``args[i]``/``kwargs[i]``, or ``None`` unless every
    argument is either a chunk cut from one batch, the ranks' chunks consecutive rows of
    it (in rank order, the same rows of each batch), or one plain value they all share,
    and the rows hold at most ``PIECE_MAX_BYTES``."""
    first_args, first_kwargs = args[0], kwargs[0]
    names = first_kwargs.keys()
    if any(len(a) != len(first_args) for a in args) or any(k.keys() != names for k in kwargs):
        return None
    bounds: list[tuple[int, int]] | None = None
    columns = [
        *([a[i] for a in args] for i in range(len(first_args))),
        *([k[name] for k in kwargs] for name in names),
    ]
    joined = []
    for values in columns:
        cuts = [cut for cut in map(cut_from, values) if cut is not None]
        if not cuts:  # must then be one plain value for all
            head = values[0]
            if not is_plain(head) or not all(map(operator.is_, values, [head] * len(values))):
                return None
            joined.append(head)
            continue
        source, start = cuts[0][0], cuts[0][1]
        rows = [(lo - start, hi - start) for _, lo, hi in cuts]
        if (
            len(cuts) != len(values)
            or any(cut[0] is not source for cut in cuts)
            or any(a[1] != b[0] for a, b in itertools.pairwise(rows))
            or bounds not in (None, rows)
        ):
            return None
        bounds = rows
        joined.append(source.slice(start, cuts[-1][2]))
    if bounds is None:  # no batch among them: nothing to join
        return None
    if sum(sizeof(value) for value in joined if type(value) is DataProto) > PIECE_MAX_BYTES:
        return None
    count = len(first_args)
    return Piece(tuple(joined[:count]), dict(zip(names, joined[count:])), bounds)


def rows_for(args: tuple, kwargs: dict, start: int, stop: int) -> tuple[tuple, dict]:
    """One rank's arguments from its process's piece: each batch's rows ``start:stop``,
    copied (no two ranks share memory, and a rank keeping its rows keeps no others')."""

    def own(value: Any) -> Any:
        if type(value) is DataProto:
            return copy.deepcopy(value.slice(start, stop))
        return value  # a plain value the ranks share

    return tuple(map(own, args)), {name: own(value) for name, value in kwargs.items()}


def join_results(
    values: Sequence[Any],
) -> tuple[DataProto, list[dict], list[tuple[int, int]]] | None:
    """The rows of every rank's ``DataProto`` result joined, each rank's ``meta_info``,
    and its bounds in the joined rows; ``None`` unless every value is a ``DataProto``,
    their rows can be joined (the same keys, dtypes and trailing shapes) and together
    they hold at most ``PIECE_MAX_BYTES``."""
    if not values or any(type(value) is not DataProto for value in values):
        return None
    if sum(map(sizeof, values)) > PIECE_MAX_BYTES:
        return None
    try:
        rows = DataProto.concat(
            [DataProto(batch=v.batch, non_tensor_batch=v.non_tensor_batch) for v in values]
        )
    except (TypeError, ValueError, RuntimeError):  # rows that do not join: rank by rank
        return None
    bounds, start = [], 0
    for value in values:
        bounds.append((start, start + len(value)))
        start += len(value)
    return rows, [value.meta_info for value in values], bounds


def results_of(
    rows: DataProto, metas: Sequence[dict], bounds: Sequence[Sequence[int]]
) -> list[DataProto]:
    """Each rank's result from its process's joined rows: its rows (a view) and its own
    ``meta_info``."""
    results = []
    for meta, (start, stop) in zip(metas, bounds):
        result = rows.slice(start, stop)
        result.meta_info = meta
        results.append(result)
    return results
