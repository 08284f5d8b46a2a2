"""Which ranks' arguments may travel as one piece of rows (``wire.row_pieces``): only
consecutive chunks the dispatch cut from the same batches, in rank order, beside plain
values they all share; anything else travels rank by rank."""

from __future__ import annotations

import copy

import torch

import hybridflow_dask as hf
from hybridflow_dask.backends.dask.wire.messages import pack, unpack
from hybridflow_dask.backends.dask.wire.row_pieces import (
    PIECE_MAX_BYTES,
    join_results,
    piece_of,
    results_of,
    rows_for,
)
from hybridflow_dask.protocol.rows import cut_from, cut_rows


def _batch(rows: int) -> hf.DataProto:
    return hf.DataProto.from_dict({"x": torch.arange(float(rows))})


def test_consecutive_chunks_of_one_batch_make_one_piece_with_each_ranks_bounds():
    chunks = cut_rows(_batch(12), [(0, 3), (3, 6), (6, 9), (9, 12)])
    piece = piece_of([("role", c) for c in chunks[1:3]], [{"step": 1}] * 2)
    assert piece is not None
    assert piece.bounds == [(0, 3), (3, 6)]
    assert piece.args[0] == "role" and piece.kwargs == {"step": 1}
    assert piece.args[1].batch["x"].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    args, kwargs = rows_for(piece.args, piece.kwargs, 3, 6)
    assert args[1].batch["x"].tolist() == [6.0, 7.0, 8.0] and kwargs == {"step": 1}
    assert args[1].batch["x"].untyped_storage().nbytes() == 3 * 4  # its own rows only


def test_chunks_that_are_not_consecutive_rows_of_one_batch_travel_rank_by_rank():
    chunks = cut_rows(_batch(4), [(0, 2), (2, 4)])
    other = cut_rows(_batch(4), [(0, 2), (2, 4)])
    assert piece_of([(chunks[0],), (chunks[0],)], [{}, {}]) is None  # one chunk twice
    assert piece_of([(chunks[1],), (chunks[0],)], [{}, {}]) is None  # out of order
    assert piece_of([(chunks[0],), (other[1],)], [{}, {}]) is None  # two batches
    sliced = _batch(4)
    assert piece_of([(sliced[0:2],), (sliced[2:4],)], [{}, {}]) is None  # not the dispatch's


def test_values_beside_the_rows_must_be_plain_and_shared_for_a_piece():
    chunks = cut_rows(_batch(4), [(0, 2), (2, 4)])
    tensor = torch.ones(1)
    assert piece_of([(chunks[0], tensor), (chunks[1], tensor)], [{}, {}]) is None
    assert piece_of([(chunks[0], 1), (chunks[1], 2)], [{}, {}]) is None
    assert piece_of([(chunks[0],), (chunks[1],)], [{"a": 1}, {"b": 1}]) is None
    assert piece_of([(1,), (1,)], [{}, {}]) is None  # no rows at all


def test_results_that_join_come_back_as_each_ranks_rows_and_meta_info():
    results = [
        hf.DataProto.from_dict({"x": torch.full((n,), float(n))}, meta_info={"n": n})
        for n in (1, 3, 2)
    ]
    joined = join_results(results)
    assert joined is not None
    rows, metas, bounds = joined
    assert bounds == [(0, 1), (1, 4), (4, 6)] and rows.meta_info == {}
    back = results_of(rows, metas, bounds)
    assert [r.batch["x"].tolist() for r in back] == [[1.0], [3.0] * 3, [2.0] * 2]
    assert [r.meta_info for r in back] == [{"n": 1}, {"n": 3}, {"n": 2}]


def test_results_that_do_not_join_are_left_rank_by_rank():
    one = hf.DataProto.from_dict({"x": torch.ones(2)})
    assert join_results([one, hf.DataProto.from_dict({"y": torch.ones(2)})]) is None
    assert join_results([one, hf.DataProto.from_dict({"x": torch.ones(2, 3)})]) is None
    assert join_results([one, torch.ones(2)]) is None


def test_a_chunk_whose_fields_were_replaced_no_longer_counts_as_cut_from_its_batch():
    chunks = cut_rows(_batch(4), [(0, 2), (2, 4)])
    changed = copy.copy(chunks[1])
    changed.batch = _batch(2).batch  # other rows now
    assert piece_of([(chunks[0],), (changed,)], [{}, {}]) is None
    assert piece_of([(chunks[0],), (copy.copy(chunks[1]),)], [{}, {}]) is not None


def test_a_chunk_travels_without_the_batch_it_was_cut_from():
    """Where a chunk was cut from is the driver's note: packing the chunk sends its own
    rows only, as packing a plain slice does (not the whole batch beside them)."""
    batch = _batch(1 << 16)
    chunk = cut_rows(batch, [(0, 1 << 15), (1 << 15, 1 << 16)])[0]
    assert cut_from(chunk) is not None
    packed, plain = pack(chunk, "a chunk"), pack(batch.slice(0, 1 << 15), "a slice")
    assert sum(map(len, map(memoryview, packed.frames))) == sum(
        map(len, map(memoryview, plain.frames))
    )
    assert cut_from(unpack(packed)) is None


def test_results_larger_than_the_join_bound_are_left_rank_by_rank():
    """Joining copies the results on the worker: above the bound they travel each from
    its own memory."""
    half = PIECE_MAX_BYTES // 8 + 1  # float32 elements: two results just over the bound
    big = [hf.DataProto.from_dict({"x": torch.ones(half)}) for _ in range(2)]
    assert join_results(big) is None
    assert join_results([big[0], hf.DataProto.from_dict({"x": torch.ones(2)})]) is not None


def test_rows_larger_than_the_piece_bound_travel_rank_by_rank():
    rows = PIECE_MAX_BYTES // 4 + 2  # float32 rows: just over the bound in all
    chunks = cut_rows(_batch(rows), [(0, rows // 2), (rows // 2, rows)])
    assert piece_of([(chunks[0],), (chunks[1],)], [{}, {}]) is None
    small = cut_rows(_batch(8), [(0, 4), (4, 8)])
    assert piece_of([(small[0],), (small[1],)], [{}, {}]) is not None
