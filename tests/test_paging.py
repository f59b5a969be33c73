"""PagedBatch metadata (spec section 5): validation errors name the field, slot arithmetic
follows a shuffled page table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qsa.paging import BatchError, PagedBatch

BS = 16
CONTEXTS = (37, 5, 64)
ROWS = (2, 1, 4)
POOL = 12


def make(seed: int = 0) -> PagedBatch:
    """A valid ragged batch on a shuffled table, with -1 in unused columns."""
    gen = torch.Generator().manual_seed(seed)
    pages = [(c + BS - 1) // BS for c in CONTEXTS]  # 3, 1, 4
    ids = torch.randperm(POOL, generator=gen)
    table = torch.full((3, max(pages)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[at:at + n]
        at += n
    qs = torch.tensor([0, 2, 3, 7], dtype=torch.int32)
    pos = torch.tensor([35, 36, 4, 60, 61, 62, 63], dtype=torch.int32)
    return PagedBatch(table, torch.tensor(CONTEXTS, dtype=torch.int32), qs, pos, BS)


def expect_error(batch: PagedBatch, field: str, num_blocks: int = POOL) -> None:
    with pytest.raises(BatchError) as info:
        batch.validate(num_blocks)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_valid_batch_passes_and_derived_fields() -> None:
    b = make()
    assert b.validate(POOL) is b
    assert b.batch == 3 and b.num_rows == 7 and b.max_context == 64
    assert b.row_request.tolist() == [0, 0, 1, 2, 2, 2, 2]
    assert b.rows_per_request.tolist() == list(ROWS)


@pytest.mark.parametrize("field", ["block_table", "context_lens", "query_start", "positions"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.int16])
def test_wrong_dtype(field: str, dtype: torch.dtype) -> None:
    b = make()
    expect_error(dataclasses.replace(b, **{field: getattr(b, field).to(dtype)}), field)


@pytest.mark.parametrize("field", ["block_table", "context_lens", "query_start", "positions"])
def test_wrong_rank(field: str) -> None:
    b = make()
    expect_error(dataclasses.replace(b, **{field: getattr(b, field).unsqueeze(0)}), field)


def test_block_id_past_the_pool() -> None:
    b = make()
    t = b.block_table.clone()
    t[2, 3] = POOL  # last used page of request 2
    expect_error(dataclasses.replace(b, block_table=t), "block_table")
    t[2, 3] = -1  # a hole in a used column is as bad
    expect_error(dataclasses.replace(b, block_table=t), "block_table")
    # The same table is fine with a larger pool.
    t[2, 3] = POOL
    dataclasses.replace(b, block_table=t).validate(POOL + 1)


def test_unused_columns_are_not_checked() -> None:
    b = make()
    t = b.block_table.clone()
    assert int(t[1, 1]) == -1  # request 1 has 5 tokens: one page
    t[1, 1] = 999
    dataclasses.replace(b, block_table=t).validate(POOL)


def test_duplicated_block() -> None:
    b = make()
    t = b.block_table.clone()
    t[1, 0] = t[0, 2]
    expect_error(dataclasses.replace(b, block_table=t), "block_table")
    t = b.block_table.clone()
    t[2, 1] = t[2, 0]  # within one request
    expect_error(dataclasses.replace(b, block_table=t), "block_table")


def test_too_few_columns() -> None:
    b = make()
    expect_error(dataclasses.replace(b, block_table=b.block_table[:, :3].contiguous()),
                 "block_table")
    # Exactly enough columns is fine.
    longer = dataclasses.replace(b, context_lens=torch.tensor([37, 5, 48], dtype=torch.int32),
                                 positions=torch.tensor([35, 36, 4, 44, 45, 46, 47],
                                                        dtype=torch.int32),
                                 block_table=b.block_table[:, :3].contiguous())
    longer.validate(POOL)


def test_block_table_rows_must_match_requests() -> None:
    b = make()
    expect_error(dataclasses.replace(b, block_table=b.block_table[:2].contiguous()),
                 "block_table")


@pytest.mark.parametrize("positions", [
    [35, 37, 4, 60, 61, 62, 63],   # 37 == context of request 0
    [35, 36, 5, 60, 61, 62, 63],   # 5 == context of request 1
    [35, 36, 4, 60, 61, 62, 64],
    [-1, 36, 4, 60, 61, 62, 63],
])
def test_positions_outside_context(positions: list[int]) -> None:
    b = make()
    expect_error(dataclasses.replace(b, positions=torch.tensor(positions, dtype=torch.int32)),
                 "positions")


@pytest.mark.parametrize("qs", [
    [1, 2, 3, 7],      # does not start at 0
    [0, 3, 2, 7],      # decreasing
    [0, 2, 3, 6],      # does not end at the row count
    [0, 2, 3, 8],
    [0, 2, 7],         # wrong length
    [0, 2, 3, 7, 7],
])
def test_bad_query_start(qs: list[int]) -> None:
    b = make()
    expect_error(dataclasses.replace(b, query_start=torch.tensor(qs, dtype=torch.int32)),
                 "query_start")


def test_negative_context() -> None:
    b = make()
    expect_error(dataclasses.replace(b, context_lens=torch.tensor([37, -1, 64],
                                                                  dtype=torch.int32)),
                 "context_lens")


@pytest.mark.parametrize("bs", [0, 6, 18, -16])
def test_bad_block_size(bs: int) -> None:
    expect_error(dataclasses.replace(make(), block_size=bs), "block_size")


def test_zero_row_request_is_valid() -> None:
    b = make()
    ok = dataclasses.replace(b, query_start=torch.tensor([0, 2, 2, 6], dtype=torch.int32),
                             positions=torch.tensor([35, 36, 60, 61, 62, 63], dtype=torch.int32))
    ok.validate(POOL)
    assert ok.row_request.tolist() == [0, 0, 2, 2, 2, 2]
    assert ok.rows_per_request.tolist() == [2, 0, 4]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_slots_on_shuffled_table(seed: int) -> None:
    b = make(seed).validate(POOL)
    table = b.block_table.tolist()
    used = table[0][:3] + table[1][:1] + table[2][:4]
    assert used != list(range(len(used)))  # really shuffled, so slot != position
    reqs, poss, want = [], [], []
    for r, ctx in enumerate(CONTEXTS):
        for p in range(ctx):
            reqs.append(r)
            poss.append(p)
            want.append(table[r][p // BS] * BS + p % BS)
    got = b.slots(torch.tensor(reqs, dtype=torch.int32), torch.tensor(poss, dtype=torch.int32))
    assert got.tolist() == want
    # Every token has its own slot, inside the pool.
    assert len(set(want)) == len(want) and 0 <= min(want) and max(want) < POOL * BS


def test_slots_int64_positions_and_to() -> None:
    b = make(5)
    req = torch.tensor([2, 0], dtype=torch.int64)
    pos = torch.tensor([63, 17], dtype=torch.int64)
    t = b.block_table
    assert b.slots(req, pos).tolist() == [int(t[2, 3]) * BS + 15, int(t[0, 1]) * BS + 1]
    c = b.to("cpu")
    assert torch.equal(c.block_table, b.block_table) and c.block_size == BS
