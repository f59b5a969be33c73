"""The union of the selections of each block of consecutive query rows, for sparse GQA's shared
(tile-union) path: each cache slot some row of the block selected, once, with a bit per row
that selected it.

Why bitmaps and two small launches: a segmented sort of the rows' slots (what the first
version did with torch) costs milliseconds at a prefill chunk's 4,096 rows, more than the K/V
bytes a union saves. Token ids of one request live in [0, context), so each row marks its ids
in a bitmap of the request's tokens (`_mark_kernel`: one atomic OR per id), and one program
per (row block, chunk of tokens) reads its rows' bitmaps back and writes the tokens any row
marked, in ascending token order, with their row bits (`_gather_kernel`). A chunk's place in
the union is the number of marked tokens before it, which the program counts itself from the
bitmaps, so the output is the same on every run (no atomic reservation) and the union needs
no sort at all.

Rows of a block may belong to different requests (a block that straddles two requests): their
token ids mean different tokens, so each request's rows form a segment of the block, and the
union lists segment after segment. Only readable ids are marked (not padding, inside the
context, their page inside the page table and the pool: the rule the per-row kernel applies),
so every union entry is a slot the attention kernel may read.

Output layout (what `qsa.kernels.sparse_gqa` reads): slots [blocks, n + 1] and bits
[blocks, n + 1] int32 with n = rows per block x the id list's width (the union's bound), the
union's length in bits[:, n]. Entries past the length are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.kernels import common
from qsa.kernels.common import require
from qsa.paging import PagedBatch

MARK_BLOCK = 1024  # ids per program of the marking launch
TILE_WORDS = 32  # bitmap words (32 tokens each) a gather step expands at a time
COUNT_WORDS = 512  # bitmap words a counting step reads at a time
# Gather programs per row block: enough (blocks x chunks) programs for PROGRAMS_PER_UNIT on
# every SM/CU when the blocks are few (a decode call's requests; each program's chain of
# dependent steps is then short), one chunk per block when they are many (prefill).
CHUNK_MIN_WORDS = 64
PROGRAMS_PER_UNIT = 4


@triton.jit
def rows_request(qs_ptr, rows, batch, BATCH_P2: tl.constexpr):
    """Request of each query row in `rows` (query_start is CSR)."""
    b = tl.arange(0, BATCH_P2)
    ends = tl.load(qs_ptr + 1 + b, mask=b < batch, other=2147483647)
    return tl.minimum(tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1), batch - 1)


@triton.jit
def _popcount(x):
    """Set bits of each 32-bit word (SWAR: portable, and the interpreter runs it)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _mark_kernel(ids_ptr, bt_ptr, ctx_ptr, qs_ptr, bm_ptr, batch, num_blocks, max_pages, width,
                 words, stride_ir, stride_bt, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                 BATCH_P2: tl.constexpr):
    """Bit `id` of the row's bitmap for each readable id of the row."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    req = tl.sum(rows_request(qs_ptr, tl.full([1], row, tl.int32), batch, BATCH_P2), axis=0)
    ctx = tl.load(ctx_ptr + req)
    ids = tl.load(ids_ptr + row.to(tl.int64) * stride_ir + n, mask=n < width, other=-1)
    page = ids // PAGE
    ok = (ids >= 0) & (ids < ctx) & (page < max_pages)
    blk = tl.load(bt_ptr + req.to(tl.int64) * stride_bt + page, mask=ok, other=-1)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    tl.atomic_or(bm_ptr + row.to(tl.int64) * words + ids // 32, 1 << (ids % 32), mask=ok)


@triton.jit
def _gather_kernel(bm_ptr, bt_ptr, ctx_ptr, qs_ptr, slots_ptr, bits_ptr, rows, batch, words,
                   chunk_words, stride_o, stride_bt, bound,
                   R: tl.constexpr, PAGE: tl.constexpr, BATCH_P2: tl.constexpr,
                   TILE_W: tl.constexpr, COUNT_W: tl.constexpr, COUNT_TRIPS: tl.constexpr,
                   CHUNK_TRIPS: tl.constexpr, RUNTIME_TRIPS: tl.constexpr):
    """Program (row block, chunk): for each request segment of the block, the marked tokens
    of the chunk's words, written after the segments before it and the chunk's earlier tokens,
    with their row bits; chunk 0 writes the union's length."""
    block = tl.program_id(0)
    chunk = tl.program_id(1)
    r = tl.arange(0, R)
    row_r = block * R + r
    live = row_r < rows
    req_r = rows_request(qs_ptr, row_r, batch, BATCH_P2)
    prev_r = rows_request(qs_ptr, tl.maximum(row_r - 1, 0), batch, BATCH_P2)
    seg_r = tl.cumsum(((r == 0) | (req_r != prev_r)).to(tl.int32), axis=0) - 1
    out_slots = slots_ptr + block.to(tl.int64) * stride_o
    out_bits = bits_ptr + block.to(tl.int64) * stride_o
    jj = tl.arange(0, 32)
    wc = tl.arange(0, COUNT_W)
    wt = tl.arange(0, TILE_W)
    base = 0  # union entries of the segments before this one
    for s in range(R):
        in_s = live & (seg_r == s)
        req = tl.max(tl.where(in_s, req_r, -1), axis=0)
        ctx = tl.load(ctx_ptr + tl.maximum(req, 0), mask=req >= 0, other=0)
        seg_words = tl.minimum(tl.cdiv(ctx, 32), words)
        lo = chunk * chunk_words
        hi = tl.minimum(lo + chunk_words, seg_words)
        bm_r = bm_ptr + row_r.to(tl.int64)[:, None] * words
        # The segment's marked tokens in all (its length) and before this chunk (its place).
        total = 0
        before = 0
        # A constexpr bound under the interpreter (masked past the words): Triton 3.6's can not
        # take a runtime range bound under numpy >= 2.4.
        for i in range(tl.cdiv(seg_words, COUNT_W) if RUNTIME_TRIPS else COUNT_TRIPS):
            w = i * COUNT_W + wc
            x = tl.load(bm_r + w[None, :], mask=in_s[:, None] & (w < seg_words)[None, :],
                        other=0)
            pc = _popcount(tl.reduce(x, 0, _or))
            total += tl.sum(pc, axis=0)
            before += tl.sum(tl.where(w < lo, pc, 0), axis=0)
        at = base + before
        bt_row = bt_ptr + tl.maximum(req, 0).to(tl.int64) * stride_bt
        for i in range(tl.cdiv(tl.maximum(hi - lo, 0), TILE_W) if RUNTIME_TRIPS
                       else CHUNK_TRIPS):
            w = lo + i * TILE_W + wt
            x = tl.load(bm_r + w[None, :], mask=in_s[:, None] & (w < hi)[None, :], other=0)
            b3 = (x[:, :, None] >> jj[None, None, :]) & 1
            member = tl.reshape(tl.sum(b3 << r[:, None, None], axis=0), (TILE_W * 32,))
            tok = tl.reshape(w[:, None] * 32 + jj[None, :], (TILE_W * 32,))
            hit = member != 0
            pos = at + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            blk = tl.load(bt_row + tok // PAGE, mask=hit, other=0)
            tl.store(out_slots + pos, blk * PAGE + tok % PAGE, mask=hit)
            tl.store(out_bits + pos, member, mask=hit)
            at += tl.sum(hit.to(tl.int32), axis=0)
        base += total
    if chunk == 0:
        tl.store(out_bits + bound, base)


def chunk_count(blocks: int, words: int, device: torch.device) -> int:
    """Gather programs per row block: PROGRAMS_PER_UNIT per SM/CU over all blocks, at least
    CHUNK_MIN_WORDS words each."""
    programs = PROGRAMS_PER_UNIT * common.unit_count(device)
    if blocks >= programs:
        return 1
    return max(1, min(triton.cdiv(programs, blocks), words // CHUNK_MIN_WORDS))


def row_block_union(token_ids: torch.Tensor, batch: PagedBatch, per: int, pool_blocks: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of each block of `per` consecutive rows' readable ids, as cache slots with
    row bits (module docstring): (slots [blocks, n] view, bits [blocks, n + 1]), n = per x
    width, the length in bits[:, n]. Three launches (a zeroing fill, the marking, the
    gathering) of fixed size, so a CUDA graph can capture them."""
    rows, width = token_ids.shape
    require(per & (per - 1) == 0 and per >= 1, f"rows per block {per}: must be a power of two")
    dev = token_ids.device
    blocks = triton.cdiv(rows, per)
    n = per * width
    bt = batch.block_table
    page = batch.block_size
    words = triton.cdiv(bt.shape[1] * page, 32)
    bm = torch.zeros((rows, words), dtype=torch.int32, device=dev)
    slots = torch.empty((blocks, n + 1), dtype=torch.int32, device=dev)
    bits = torch.empty((blocks, n + 1), dtype=torch.int32, device=dev)
    bp2 = max(64, triton.next_power_of_2(batch.batch))
    _mark_kernel[(rows, triton.cdiv(width, MARK_BLOCK))](
        token_ids, bt, batch.context_lens, batch.query_start, bm, batch.batch, pool_blocks,
        bt.shape[1], width, words, token_ids.stride(0), bt.stride(0), PAGE=page,
        BLOCK=MARK_BLOCK, BATCH_P2=bp2, num_warps=4)
    chunks = chunk_count(blocks, words, dev)
    chunk_words = triton.cdiv(triton.cdiv(words, chunks), TILE_WORDS) * TILE_WORDS
    runtime = not common.interpreting()
    _gather_kernel[(blocks, triton.cdiv(words, chunk_words))](
        bm, bt, batch.context_lens, batch.query_start, slots, bits, rows, batch.batch, words,
        chunk_words, slots.stride(0), bt.stride(0), n, R=per, PAGE=page, BATCH_P2=bp2,
        TILE_W=TILE_WORDS, COUNT_W=COUNT_WORDS,
        COUNT_TRIPS=0 if runtime else triton.cdiv(words, COUNT_WORDS),
        CHUNK_TRIPS=0 if runtime else chunk_words // TILE_WORDS, RUNTIME_TRIPS=runtime,
        num_warps=4)
    return slots[:, :n], bits
