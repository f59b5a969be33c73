"""Top-k + expand: per query row, the top `min(k, visible)` groups by score, expanded to token ids
with the row's incomplete tail group (spec section 2, steps 4-5).

Choice: scores are materialised ([rows, max_ctx//4] FP32, written by the scorers) and selected
here, not fused into the scorers. Why:
* Selection is a global operation over a row, while a bandwidth-bound scorer splits one
  request's keys over many programs (a 128K-context request is 8 MiB of BF16 keys). Fusing means
  either one program per request (batch 64 would stream from 64 of 132 SMs, about half the
  bandwidth) or a cross-program merge, which is a second pass anyway.
* The materialised scores are small next to the keys: 4 B per group per row against 256 B
  (BF16), 132 B (FP8) or 68 B (MXFP4) of key per group per request. At 4 rows per request the
  write plus re-read adds 12% / 24% / 47% to the scorer's traffic (FP32 logits are ctx bytes per row against 8 / 4.1 / 2.1 MiB of keys per request at 128K), and in the model
  the re-read hits L2 (256 rows x 32K groups = 32 MiB). `qsa bench --suite decode` times
  this kernel cold (its bytes count the score reads) next to the scorer at the same shapes,
  which is the measurement that decides whether fusing would pay.

Selection (one program per row, the row held in registers):
* Scores map to order-preserving uint32 keys (-0 folded onto +0, so equal scores are equal keys).
* The k-th largest key (the threshold) is found by bisection on the key's bits, most
  significant first: a candidate bit is kept while at least k keys are >= prefix | bit. Each
  pass is one compare + count per key (~3 instructions) and one block reduction; it stops once
  exactly k keys are >= the prefix, else after 32 (ties). With the meta key BOUND=1 it starts
  below the bits every candidate for the k-th key shares: that key lies between the largest key
  and the smallest of k (rounded up to a power of two) group maxima, two reductions that skip
  the bits above the highest one where those bounds differ. A radix select (a histogram of
  several bits per pass) needs fewer passes but costs more per key, and was not faster
  (profiles/nvidia-h200/bench/topk/warps/NOTES.md).
* A last pass streams the row in chunks (or, when the config's CHUNK covers the row, takes the
  keys already in registers) and keeps every key > threshold plus, among keys equal to
  it, the lowest group indices (the spec's tie rule, so a 1-row decode and a 4-row verify of the
  same token select the same groups). One packed prefix count gives each selected group its
  output slot, so the output is in ascending group order without a sort.
* Rows with visible <= k are dense causal. A row's scores are loaded first thing, up to the groups
  its position shows ((p+1)//4, clamped to the columns), before the visible count (which also
  needs the request's context, one more dependent load) is known; rows dense by position read
  none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.kernels.common import kernel_repr, lookup, require, require_dtype
from qsa.kernels.common import data_checks_enabled
from qsa.measure.work import Work
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset

KERNEL = "topk"
FORMAT = "fp32"  # the config table's format key: the scores' dtype
# Calls of at least MANY_ROWS rows (prefill chunks) read the table under FORMAT_MANY_ROWS: with
# many programs per SM, throughput decides and fewer warps per row win, while a decode call's
# few rows are latency-bound and want more (profiles/nvidia-h200/bench/topk/rows-axis/NOTES.md).
MANY_ROWS = 2048
FORMAT_MANY_ROWS = "fp32-many-rows"
MAX_BATCH = 8192  # the row -> request lookup holds one lane per request
# The final pass packs (#equal before, #greater before) into one int32: equal counts need
# 17 bits, so at most 2^17 candidates per row and fewer than 2^14 selected groups.
EQ_BITS = tl.constexpr(17)
EQ_MASK = tl.constexpr((1 << EQ_BITS.value) - 1)
MAX_CANDIDATES = 1 << EQ_BITS.value
MAX_K = (1 << (31 - EQ_BITS.value)) - 1


@triton.jit
def _order_keys(x, valid):
    """FP32 -> uint32 keys with the same order; -0 == +0; invalid lanes get 0 (below -inf)."""
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # negative: flip all bits; positive: set the sign bit
    key = (bits ^ flip).to(tl.uint32, bitcast=True)
    key = tl.where(x == 0.0, tl.full(x.shape, 0x80000000, tl.uint32), key)
    return tl.where(valid, key, tl.zeros(x.shape, tl.uint32))


@triton.jit
def _tail_ids(o, base, tail0, tail_len):
    """Token ids at output columns o >= base: the tail group's tokens, then -1."""
    return tl.where(o - base < tail_len, tail0 + o - base, -1)


@triton.jit
def _high_bit(x):
    """Position of the highest set bit of a uint32 scalar (0 for x <= 1)."""
    h = tl.zeros((), tl.int32)
    for j in tl.static_range(5):  # halves of 16, 8, 4, 2, 1 bits
        up = (x >> (16 >> j)) != 0
        h += tl.where(up, 16 >> j, 0)
        x = tl.where(up, x >> (16 >> j), x)
    return h


@triton.jit
def _kth_key_bisect(key, n, K: tl.constexpr, BLOCK_N: tl.constexpr, BOUND_GROUPS: tl.constexpr):
    """Bisection on the bits of the k-th largest key, most significant bit first. Returns a
    threshold t with #keys > t < K <= #keys >= t (t is the k-th key, or exactly K keys >= t).

    BOUND_GROUPS = G > 0 (G >= K, G <= BLOCK_N) starts below the bits every candidate shares:
    the k-th key lies between the smallest of G group maxima (G distinct keys are >= it) and
    the largest key, so the bits above the highest one where those two differ are the k-th
    key's too (config key BOUND). Two reductions instead of one per shared bit, which pays
    where many top bits are shared (profiles/nvidia-h200/bench/topk/bound/NOTES.md)."""
    prefix = tl.zeros((), tl.uint32)
    n_ge = n  # keys >= prefix, or n before the first pass (n > K: not an early exit)
    i = tl.zeros((), tl.int32)
    if BOUND_GROUPS:
        top = tl.max(key)
        # any grouping does: each group's maximum is a different key (padding keys are 0)
        low = tl.min(tl.max(tl.reshape(key, (BOUND_GROUPS, BLOCK_N // BOUND_GROUPS),
                                       can_reorder=True), axis=1))
        diff = top ^ low
        h = _high_bit(diff)  # bits above h agree; none differ when diff is 0
        i = tl.where(diff == 0, 32, 31 - h)
        bit = tl.full((), 1, tl.uint32) << h.to(tl.uint32)
        prefix = tl.where(diff == 0, top, top ^ (top & (bit | (bit - 1))))  # bits h..0 cleared
    while (i < 32) & (n_ge != K):
        cand = prefix | (tl.full((), 1, tl.uint32) << (31 - i).to(tl.uint32))
        c = tl.sum((key >= cand).to(tl.int32))
        prefix = tl.where(c >= K, cand, prefix)
        n_ge = tl.where(c >= K, c, n_ge)
        i += 1
    return prefix


@triton.jit
def _select_chunk(kc, gc, n, prefix, need, seen, out_row):
    """Write the token ids of the selected groups among keys `kc` of groups `gc`, given the
    packed counts of the groups before them (`seen`); returns this chunk's packed counts."""
    gt = kc > prefix
    eq = (kc == prefix) & (gc < n)
    packed = eq.to(tl.int32) + (gt.to(tl.int32) << EQ_BITS)
    before = seen + tl.cumsum(packed, 0) - packed
    n_eq_before = before & EQ_MASK
    sel = gt | (eq & (n_eq_before < need))
    slot = (before >> EQ_BITS) + tl.minimum(n_eq_before, need)
    for t in tl.static_range(4):
        tl.store(out_row + slot * 4 + t, gc * 4 + t, mask=sel)
    return tl.sum(packed)


@triton.jit(repr=kernel_repr(KERNEL, ("K", "BLOCK_N", "CHUNK", "BOUND_GROUPS")))
def _topk_expand_kernel(scores_ptr, s_stride, out_ptr, o_stride, pos_ptr, ctx_ptr, qs_ptr,
                        batch, n_cols, K: tl.constexpr, OUT_W: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_O: tl.constexpr,
                        CHUNK: tl.constexpr, BOUND_GROUPS: tl.constexpr):
    row = tl.program_id(0)
    bb = tl.arange(0, BLOCK_B)
    ends = tl.load(qs_ptr + 1 + bb, mask=bb < batch, other=2147483647)
    # Requests whose rows all come before this row (clamped: a bad batch reads in bounds).
    req = tl.minimum(tl.sum((ends <= row).to(tl.int32)), batch - 1)
    p = tl.load(pos_ptr + row)
    tail0 = 4 * ((p + 1) // 4)
    tail_len = p + 1 - tail0
    # The scores are requested as soon as the position is known: the groups the position
    # shows, clamped to the score columns, none where that makes the row dense. Waiting for
    # the visible count would put two more dependent loads in front of them (query_start ->
    # the request's context -> scores); a valid batch's rows see exactly these groups.
    s_row = scores_ptr + row.to(tl.int64) * s_stride
    g = tl.arange(0, BLOCK_N)
    by_pos = tl.minimum((p + 1) // 4, n_cols)
    x = tl.load(s_row + g, mask=(g < by_pos) & (by_pos > K), other=0.0)
    # Visible groups; clamped to the score columns so a bad batch can not read out of bounds.
    n = tl.maximum(tl.minimum(by_pos, tl.load(ctx_ptr + req) // 4), 0)
    out_row = out_ptr + row.to(tl.int64) * o_stride

    if n <= K:  # dense causal: groups 0..n-1, then the tail
        o = tl.arange(0, BLOCK_O)
        tl.store(out_row + o, tl.where(o < 4 * n, o, _tail_ids(o, 4 * n, tail0, tail_len)),
                 mask=o < OUT_W)
    else:
        key = _order_keys(x, g < n)
        prefix = _kth_key_bisect(key, n, K, BLOCK_N, BOUND_GROUPS)
        # Keys > prefix all go in; keys == prefix go in by ascending group while slots remain.
        # Each selected group's slot = #greater before it + min(#equal before it, slots left).
        need = K - tl.sum((key > prefix).to(tl.int32))  # slots left for keys == prefix
        if CHUNK >= BLOCK_N:  # one chunk: the row's keys are in registers already
            _select_chunk(key, g, n, prefix, need, tl.zeros((), tl.int32), out_row)
        else:
            seen = tl.zeros((), tl.int32)  # packed counts of the chunks before: #eq | #greater
            start = tl.zeros((), tl.int32)
            while start < n:
                gc = start + tl.arange(0, CHUNK)
                kc = _order_keys(tl.load(s_row + gc, mask=gc < n, other=0.0), gc < n)
                seen += _select_chunk(kc, gc, n, prefix, need, seen, out_row)
                start += CHUNK
        tail_cols = 4 * K + tl.arange(0, 4)
        tl.store(out_row + tail_cols, _tail_ids(tail_cols, 4 * K, tail0, tail_len),
                 mask=tail_cols < OUT_W)


def _check_batch(scores: torch.Tensor, batch: PagedBatch) -> None:
    dev = scores.device
    for name, t in (("context_lens", batch.context_lens), ("query_start", batch.query_start),
                    ("positions", batch.positions)):
        require_dtype(t, name, (torch.int32,))
        require(t.dim() == 1 and t.is_contiguous(), f"{name}: must be a contiguous 1-D tensor")
        require(t.device == dev, f"{name}: on {t.device}, the scores are on {dev}")
    require(batch.query_start.shape[0] == batch.batch + 1,
            f"query_start: needs batch + 1 = {batch.batch + 1} entries, got "
            f"{batch.query_start.shape[0]}")
    require(batch.batch <= MAX_BATCH, f"batch: {batch.batch} requests, at most {MAX_BATCH}")
    require(batch.batch > 0 or batch.num_rows == 0, "batch: rows without requests")
    if not data_checks_enabled() or batch.num_rows == 0:
        return
    qs, pos, ctx = batch.query_start, batch.positions, batch.context_lens
    rows_ok = (qs[0] == 0) & (qs[-1] == batch.num_rows) & (qs[1:] >= qs[:-1]).all()
    req = torch.searchsorted(qs[1:].contiguous(), torch.arange(batch.num_rows, device=dev,
                                                               dtype=torch.int32), right=True)
    vis = torch.minimum((pos + 1) // 4, ctx[req.clamp(max=max(batch.batch - 1, 0))] // 4)
    stats = torch.stack((rows_ok.long(), (pos < 0).any().long(), vis.max().long())).tolist()
    require(bool(stats[0]), "query_start: must start at 0, be non-decreasing and end at the "
            f"row count {batch.num_rows}")
    require(not stats[1], "positions: negative position")
    require(stats[2] <= scores.shape[1],
            f"scores: {scores.shape[1]} columns, a row sees {stats[2]} groups")


def topk_expand(scores: torch.Tensor, batch: PagedBatch, preset: ModelPreset,
                config: BlockConfig | None = None, *, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Token ids [rows, preset.expand_width] int32 of each row's top `min(k, visible)` groups
    (ascending group order, ties to the lower group), then its tail tokens, -1 padded; equals
    `qsa.reference.topk.topk_expand_reference`. `scores` is [rows, >= max visible] FP32 (a row
    reads at most min((p+1)//4, columns) of them, none when that is <= k, and ignores those
    past its visible groups); `out` may be given (e.g. under CUDA graphs)."""
    require_dtype(scores, "scores", (torch.float32,))
    require(scores.dim() == 2 and scores.stride(1) == 1,
            f"scores: must be 2-D with contiguous rows, got shape {tuple(scores.shape)} strides "
            f"{scores.stride()}")
    rows, n_cols = scores.shape
    require(rows == batch.num_rows, f"scores: {rows} rows, the batch has {batch.num_rows}")
    k, width = preset.topk_groups, preset.expand_width
    require(k <= MAX_K, f"preset.topk_groups: {k} groups, the kernel selects at most {MAX_K}")
    require(n_cols <= MAX_CANDIDATES,
            f"scores: {n_cols} candidates per row, the kernel takes at most {MAX_CANDIDATES}")
    _check_batch(scores, batch)
    if out is None:
        out = torch.empty((rows, width), dtype=torch.int32, device=scores.device)
    require_dtype(out, "out", (torch.int32,))
    require(out.dim() == 2 and tuple(out.shape) == (rows, width) and out.stride(1) == 1,
            f"out: must be [{rows}, {width}] with contiguous rows, got shape {tuple(out.shape)}")
    require(out.device == scores.device, f"out: on {out.device}, the scores on {scores.device}")
    if rows == 0:
        return out
    cfg, kw = lookup(KERNEL, table_format(rows), n_cols, config)
    require(cfg.meta.get("CHUNK", 0) >= 1 and triton.next_power_of_2(cfg.meta["CHUNK"])
            == cfg.meta["CHUNK"], f"config: meta CHUNK must be a power of two, got {cfg.meta}")
    block_n = triton.next_power_of_2(max(n_cols, 1))
    kw["CHUNK"] = min(cfg.meta["CHUNK"], block_n)  # the final pass's chunk, at most the row
    bound = kw.pop("BOUND", 0)  # an entry written before the switch existed: off
    require(bound in (0, 1), f"config: meta BOUND must be 0 or 1, got {bound}")
    # K groups or more (a power of two) within the row's block; rows of at most K groups never
    # search (dense causal), so a block that small needs no bound
    groups = triton.next_power_of_2(k)
    kw["BOUND_GROUPS"] = groups if bound and block_n >= groups else 0
    _topk_expand_kernel[(rows,)](
        scores, scores.stride(0), out, out.stride(0), batch.positions, batch.context_lens,
        batch.query_start, batch.batch, n_cols, K=k, OUT_W=width, BLOCK_N=block_n,
        BLOCK_B=triton.next_power_of_2(max(batch.batch, 2)),
        BLOCK_O=triton.next_power_of_2(width), **kw)
    return out


def table_format(rows: int) -> str:
    """The config table's format key for a call of `rows` rows (see MANY_ROWS)."""
    return FORMAT_MANY_ROWS if rows >= MANY_ROWS else FORMAT


def work(preset: ModelPreset, rows: int, candidates: int) -> Work:
    """Bytes of one call where every row has `candidates` visible groups: the scores read once
    (the final pass re-reads them from cache) and the token ids written. No FLOPs: selection is
    comparisons and counts."""
    if candidates <= preset.topk_groups:
        read = 0  # dense rows never read their scores
    else:
        read = rows * candidates * 4
    return Work(bytes_moved=read + rows * preset.expand_width * 4, flops=0)
