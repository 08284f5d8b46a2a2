"""``DataProtoFuture``: a DataProto that is still being computed, spread over ranks.

It holds one backend future per producing rank (the parts, in row order) and how many
rows to drop from the end of their concatenation (the padding the producer was given).
Re-splitting it for a consumer runs small routing tasks next to each part, so every
consumer rank receives only the rows it needs and nothing passes through the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .data_proto import DataProto
from .rows import (
    Batch,
    PadRows,
    concat_batches,
    gather_rows,
    padding_rows,
    row_count,
    slice_rows,
)
from .tensordict_ops import chunk_bounds

__all__ = ["DataProtoFuture", "FutureRunner", "check_same_rows", "row_ranges"]


class FutureRunner(Protocol):
    """The part of a backend a DataProtoFuture needs (``Backend`` satisfies it)."""

    def submit(
        self, fn: Callable[..., Any], *args: Any, slot: Any = None, label: str = "hf"
    ) -> Any: ...

    def gather(self, futures: Sequence[Any]) -> list[Any]: ...

    def is_future(self, obj: Any) -> bool: ...


@dataclass
class DataProtoFuture:
    """Rows ``concat(parts)`` without the padding's rows, not yet materialized.

    ``pad`` is the padding the producer's input was given: an int, or a backend future of
    one when the producer's input was itself a future (its length was not known when the
    call was issued). How many trailing rows that makes is decided where the rows are
    counted, by ``rows.padding_rows``: ``k * pad`` for a result of ``k`` rows per row the
    producer was sent (a ``PadRows``), ``pad`` for a plain int. ``slots`` says where each
    part lives so routing tasks can run there; ``label`` (``"group.method"`` for a
    group's result) names the tasks and the producer in errors.
    """

    parts: list[Any]
    runner: FutureRunner
    pad: Any = 0
    slots: list[Any] | None = None
    label: str = field(default="hf", compare=False)

    def get(self) -> DataProto:
        """Bring the whole DataProto (or TensorDict, if the parts are ones) to the caller."""
        lazy_pad = self.runner.is_future(self.pad)
        values = self.runner.gather([*self.parts, self.pad] if lazy_pad else list(self.parts))
        pad = values.pop() if lazy_pad else self.pad
        return drop_tail(concat_batches(values), pad, self.label)

    def num_rows(self) -> Any:
        """A backend future of the row count, computed next to the parts (nothing moves)."""
        part_slots = self.slots or [None] * len(self.parts)
        lens = [
            self.runner.submit(row_count, part, slot=slot, label=f"{self.label}.rows")
            for part, slot in zip(self.parts, part_slots)
        ]
        return self.runner.submit(
            rows_after_pad,
            self.pad,
            self.label,
            *lens,
            slot=part_slots[0],
            label=f"{self.label}.rows",
        )

    def with_runner(self, runner: FutureRunner) -> DataProtoFuture:
        """The same rows, resolved through another runner (e.g. one inside a worker)."""
        return DataProtoFuture(list(self.parts), runner, self.pad, self.slots, self.label)

    def __deepcopy__(self, memo: dict) -> DataProtoFuture:
        # Futures are handles to immutable results: copying one must not copy its runner.
        return self.with_runner(self.runner)

    def __len__(self) -> int:
        raise TypeError("the length of a DataProtoFuture is not known until it is computed")

    def chunk(self, chunks: int, slots: Sequence[Any] | None = None) -> list[DataProtoFuture]:
        """Split into ``chunks`` futures of consecutive rows, sized like ``DataProto.chunk``.

        When ``chunks`` equals the number of parts and there is no padding to drop, the
        parts themselves are the chunks (no data moves; they are as even as the producer's
        outputs were). ``slots`` names where each chunk is assembled (default: next to part 0).
        """
        routed, _ = self.route(chunks, slots, padded=False)
        return [
            DataProtoFuture([part], self.runner, 0, [slot], self.label)
            for part, slot in zip(routed, _targets(self, chunks, slots))
        ]

    def route(
        self,
        n: int,
        slots: Sequence[Any] | None = None,
        *,
        padded: bool = True,
        consumer: str | None = None,
    ) -> tuple[list[Any], Any]:
        """One future per consumer rank, plus the pad the consumers' output must drop.

        ``consumer`` (the group whose call needs the rows) names the routing tasks, so
        they show under that group wherever work is shown (its producer's otherwise).

        With ``padded`` every consumer gets ``ceil(rows / n)`` rows (the tail padded with
        copies of the last row, as dispatch pads a DataProto). When ``n`` equals
        the number of parts and nothing needs trimming, part ``i`` goes to rank ``i``
        untouched.
        """
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"cannot split a DataProtoFuture into {n!r} chunks")
        if n == len(self.parts) and (padded or _is_zero(self.pad)):
            return list(self.parts), self.pad
        targets = _targets(self, n, slots)
        task = consumer or self.label
        part_slots = self.slots or [None] * len(self.parts)
        submit = self.runner.submit
        lens = [
            submit(row_count, part, slot=slot, label=f"{task}.rows")
            for part, slot in zip(self.parts, part_slots)
        ]
        routed = []
        for dest, target in enumerate(targets):
            pieces = [
                submit(
                    take_rows,
                    part,
                    i,
                    dest,
                    n,
                    padded,
                    self.pad,
                    self.label,
                    *lens,
                    slot=slot,
                    label=f"{task}.route",
                )
                for i, (part, slot) in enumerate(zip(self.parts, part_slots))
            ]
            routed.append(submit(assemble, *pieces, slot=target, label=f"{task}.assemble"))
        new_pad = (
            submit(
                pad_after_split,
                n,
                padded,
                self.pad,
                self.label,
                *lens,
                slot=targets[0],
                label=f"{task}.rows",
            )
            if padded
            else 0
        )
        return routed, new_pad

    def whole(self, slot: Any = None) -> Any:
        """A single backend future of the whole DataProto, assembled at ``slot``."""
        if len(self.parts) == 1 and _is_zero(self.pad):
            return self.parts[0]
        return self.runner.submit(
            concat_and_drop,
            self.pad,
            self.label,
            *self.parts,
            slot=slot,
            label=f"{self.label}.assemble",
        )

    @staticmethod
    def concat(futures: Sequence[DataProtoFuture]) -> DataProtoFuture:
        """Rows of every future in order; pads are trimmed next to the parts that hold them.

        The last future's pad is kept for whoever resolves the result (no routing) only
        when the result is that future alone: how many rows a pad stands for depends on
        the length of the parts it belongs to (``rows.padding_rows``).
        """
        if not futures:
            raise ValueError("DataProtoFuture.concat needs at least one future")
        runner = futures[0].runner
        parts: list[Any] = []
        slots: list[Any] = []
        alone = len(futures) == 1
        for fut in futures:
            if not alone and not _is_zero(fut.pad):
                n = len(fut.parts)
                fut_parts, _ = fut.route(n, fut.slots, padded=False)
            else:
                fut_parts = list(fut.parts)
            parts.extend(fut_parts)
            slots.extend(fut.slots or [None] * len(fut_parts))
        pad = futures[0].pad if alone else 0
        return DataProtoFuture(parts, runner, pad, slots, futures[0].label)


def _is_zero(pad: Any) -> bool:
    return isinstance(pad, int) and pad == 0


def _targets(fut: DataProtoFuture, n: int, slots: Sequence[Any] | None) -> list[Any]:
    if slots is not None:
        if len(slots) != n:
            raise ValueError(f"got {len(slots)} slots for {n} chunks")
        return list(slots)
    first = fut.slots[0] if fut.slots else None
    return [first] * n


# ---- routing functions: they run next to the data, on the workers -------------------


def row_ranges(rows: int, n: int, padded: bool) -> list[tuple[int, int]]:
    """Half-open ranges of (padded) row positions that each of ``n`` consumers takes."""
    if padded:
        size = -(-rows // n) if rows else 0
        return [(d * size, (d + 1) * size) for d in range(n)]
    return chunk_bounds(rows, n)


def take_rows(
    part: Batch, index: int, dest: int, n: int, padded: bool, pad: int, source: str, *lens: int
) -> tuple[np.ndarray, Batch]:
    """The rows of ``part`` that consumer ``dest`` needs, with their positions.

    Padding positions (past the last real row) repeat the last row, as verl pads.
    """
    rows = _real_rows(pad, source, lens)
    start = sum(lens[:index])
    stop = min(start + lens[index], rows)
    lo, hi = row_ranges(rows, n, padded)[dest]
    positions = np.arange(lo, hi)
    taken = np.minimum(positions, rows - 1) if rows else positions
    mine = (taken >= start) & (taken < stop)
    return positions[mine], gather_rows(part, taken[mine] - start)


def assemble(*pieces: tuple[np.ndarray, Batch]) -> Batch:
    """Concatenate routed pieces in row-position order."""
    nonempty = [(pos, dp) for pos, dp in pieces if len(pos)]
    if not nonempty:
        return pieces[0][1]
    positions = np.concatenate([pos for pos, _ in nonempty])
    joined = concat_batches([dp for _, dp in nonempty])
    order = np.argsort(positions, kind="stable")
    if np.array_equal(order, np.arange(len(order))):
        return joined
    return gather_rows(joined, order)


def pad_after_split(n: int, padded: bool, pad: int, source: str, *lens: int) -> int:
    rows = _real_rows(pad, source, lens)
    return PadRows.for_chunks(rows, n) if padded else 0


def rows_after_pad(pad: int, source: str, *lens: int) -> int:
    return _real_rows(pad, source, lens)


def _real_rows(pad: int, source: str, lens: Sequence[int]) -> int:
    """The rows of parts ``lens`` long that are not the padding's."""
    total = sum(lens)
    return total - padding_rows(pad, total, source)


def check_same_rows(part: Any, names: tuple[str, ...], *lengths: int) -> Any:
    """``part`` unchanged if every data argument of a call has the same number of rows."""
    if len(set(lengths)) > 1:
        detail = ", ".join(f"{name}: {rows} rows" for name, rows in zip(names, lengths))
        raise ValueError(
            f"DataProto arguments of one call must have the same length ({detail}); "
            "the futures' lengths were only known once they were computed"
        )
    return part


def concat_and_drop(pad: int, source: str, *parts: Batch) -> Batch:
    return drop_tail(concat_batches(list(parts)), pad, source)


def drop_tail(data: Batch, pad: int, source: str = "") -> Batch:
    """``data`` without the padding's rows (``rows.padding_rows``: ``k * pad`` of them
    for ``k`` result rows per row sent)."""
    rows = row_count(data)
    if int(pad) < 0:
        raise ValueError(f"cannot drop {int(pad)} padding rows from {rows} rows")
    drop = padding_rows(pad, rows, source)
    return data if drop == 0 else slice_rows(data, 0, rows - drop)
