"""Stacked decode scorer: a request's rows x index heads form one MMA operand.

Why: a decode/verify call scores few rows per request (1 draft row, 4 verify rows) against all
of the request's compressed keys, about 16 FLOP per key byte in BF16, far below every ridge
point. The kernel's time is the key stream, so every key must be read once per request, not once
per row: the R rows x H heads of a request are stacked into M (4 x 4 = 16, exactly one
matrix-unit tile; other shapes pad to 16 with masked rows), each key tile meets all of them in
one `tl.dot`, the ReLU is applied per head and the heads are summed back out of M
(head-major M, so the sum is one in-register add and one lane shuffle on a 16-row tile).

Operands: bf16 for BF16 keys, fp16 for FP8 and MXFP4 keys (`index_tiles` docstring). MXFP4 runs
two K=16 dots (even and odd elements) per 32-element scale block and scales their fp32 result
per key before the blocks are summed.

The grid is requests x key chunks: a small batch splits each request's keys over enough
programs to fill the device (`PROGRAMS_PER_UNIT` per SM/CU), a large batch gives each program
several tiles. Small calls are latency-bound, so the first key load waits for nothing but its
page id: the chunk is computed unconditionally (masked loads past the request's keys move
nothing), and q and the keys both arrive through the pipeliner's asynchronous copies; where a
program scores many tiles, or the call is bound by instruction issue (MXFP4 keys), q is loaded
and converted once per program instead (config key `HOIST_Q_MIN_TILES`, see the loop). Calls of
at most 256 rows and 8 rows per request; prefill-sized calls use `score_prefill`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.kernels.common import kernel_repr, lookup, require
from qsa.kernels.index_tiles import (MIN_MMA_M, key_col_scale, key_rows, load_dense,
                                     load_mx_halves, load_mx_scales, plan_tiles, prepare_inputs,
                                     row_visibility, rows_per_request_bound, score_work,
                                     split_config, store_scores)
from qsa.measure.work import Work
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset

KERNEL = "score_stacked"
MAX_ROWS = 256
MAX_ROWS_PER_REQUEST = 8


@triton.jit
def _stacked_q(q_ptr, kc_ptr, w_ptr, row0, nrows, stride_qr, FMT: tl.constexpr,
               H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
               HAS_W: tl.constexpr):
    """The stacked operand, head-major (m = h * BLOCK_R + r), in the dot dtype, and the head
    weight of every m (1.0 without weights). BF16/FP8 keys: one [M, D] tile. MXFP4: a tuple of
    2 * D/32 [M, 16] tiles, the even then the odd elements of each scale block, as the keys are
    decoded (`load_mx_halves`; a register tensor can not be sliced along K)."""
    m = tl.arange(0, H_PAD * BLOCK_R)
    h = m // BLOCK_R
    r = m % BLOCK_R
    q_row = q_ptr + (row0 + r).to(tl.int64) * stride_qr + h * D
    q_mask = ((r < nrows) & (h < H))[:, None]
    if FMT == "mxfp4":
        d = tl.arange(0, 32)
        q = ()
        for c in tl.static_range(D // 32):
            qc = tl.load(q_row[:, None] + c * 32 + d[None, :], mask=q_mask, other=0.0)
            q = q + tl.split(tl.reshape(qc.to(tl.float16), (H_PAD * BLOCK_R, 16, 2)))
    else:
        d = tl.arange(0, D)
        q = tl.load(q_row[:, None] + d[None, :], mask=q_mask, other=0.0)
        if FMT == "bf16":
            q = q.to(kc_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float16)
    if HAS_W:
        w_m = tl.load(w_ptr + h, mask=h < H, other=0.0)
    else:
        w_m = 1.0
    return q, w_m


@triton.jit
def _stacked_keys(kc_ptr, ks_ptr, key_off, scale_off, ok, FMT: tl.constexpr, D: tl.constexpr):
    """One key tile's loads: the dense tile in its storage dtype, or for MXFP4 a tuple of the
    decoded even and odd [N, 16] halves of the D/32 blocks followed by their per-key factors
    2^(E-127)."""
    if FMT == "mxfp4":
        k = ()
        for c in tl.static_range(D // 32):
            k = k + load_mx_halves(kc_ptr, key_off, ok, c)
        k = k + load_mx_scales(ks_ptr, scale_off, ok, D // 32)
    else:
        k = load_dense(kc_ptr, key_off, ok, 0, D)
    return k


@triton.jit
def _stacked_tile(q, w_m, k, ks_ptr, scale_off, ok, g, out_row, vis, row_ok, width, out_scale,
                  FMT: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, HAS_W: tl.constexpr):
    """Score one key tile against the stacked rows x heads and store it: one MMA (MXFP4: two
    K=16 MMAs per scale block, even and odd elements, scaled per key before the blocks are
    summed), per-head ReLU, head weights, heads summed back out of M, the per-key factor, -inf
    past each row's horizon."""
    if FMT == "mxfp4":
        NB: tl.constexpr = D // 32
        for c in tl.static_range(NB):
            part = tl.dot(q[2 * c + 1], tl.trans(k[2 * c + 1]),
                          tl.dot(q[2 * c], tl.trans(k[2 * c]))) * k[2 * NB + c][None, :]
            if c == 0:
                acc = part
            else:
                acc += part
    else:
        acc = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.maximum(acc, 0.0)
    if HAS_W:
        s = s * w_m[:, None]
    s = tl.sum(tl.reshape(s, (H_PAD, BLOCK_R, BLOCK_N)), axis=0)
    col = key_col_scale(ks_ptr, scale_off, ok, FMT, FMT == "mxfp4", BLOCK_N) * out_scale
    store_scores(out_row, g, s * col[None, :], vis, row_ok, width)


@triton.jit(repr=kernel_repr(KERNEL, ("FMT", "H", "D", "GPB", "BLOCK_R", "BLOCK_N", "TILES",
                                      "WARPS", "STAGES", "HOIST_Q")))
def _score_stacked_kernel(q_ptr, kc_ptr, ks_ptr, w_ptr, out_ptr, bt_ptr, ctx_ptr, qs_ptr,
                          pos_ptr, stride_qr, stride_kb, stride_sb, stride_bt, stride_or,
                          bt_cols, num_blocks, width, out_scale,
                          FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                          GPB: tl.constexpr, KROW: tl.constexpr, SROW: tl.constexpr,
                          HAS_W: tl.constexpr, H_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr, TILES: tl.constexpr, WARPS: tl.constexpr,
                          STAGES: tl.constexpr, HOIST_Q: tl.constexpr):
    b = tl.program_id(0)
    tile0 = tl.program_id(1) * TILES
    row0 = tl.load(qs_ptr + b)
    nrows = tl.load(qs_ptr + b + 1) - row0
    n_groups = tl.load(ctx_ptr + b) // 4
    key_limit = tl.where(nrows > 0, n_groups, 0)  # a request without rows reads nothing
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    out_row = out_ptr + (row0 + tl.arange(0, BLOCK_R)).to(tl.int64) * stride_or
    row_ok, vis = row_visibility(pos_ptr, row0, nrows, n_groups, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    # Where q is loaded is a config choice (HOIST_Q_MIN_TILES: from how many tiles per program
    # it is loaded once). In the loop, the pipeliner fetches q like the keys, with asynchronous
    # copies, and the first tile waits for two round trips (page ids, then keys and q) instead
    # of stalling on q's trip through shared memory before the first key load: BF16 and FP8
    # calls of 2 tiles per program measure faster so. Once per program saves the per-tile
    # conversion, which wins for many tiles per program and for MXFP4 keys, whose calls are
    # bound by instruction issue (profiles/nvidia-h200/bench/scorers/mxfp4-issue/NOTES.md).
    if HOIST_Q:
        q, w_m = _stacked_q(q_ptr, kc_ptr, w_ptr, row0, nrows, stride_qr, FMT, H, H_PAD, D,
                            BLOCK_R, HAS_W)
    for i in range(TILES):
        g = (tile0 + i) * BLOCK_N + n
        key_off, scale_off, ok = key_rows(bt_row, g, g < key_limit, bt_cols, num_blocks,
                                          stride_kb, stride_sb, GPB, KROW, SROW)
        k = _stacked_keys(kc_ptr, ks_ptr, key_off, scale_off, ok, FMT, D)
        if not HOIST_Q:
            q, w_m = _stacked_q(q_ptr, kc_ptr, w_ptr, row0, nrows, stride_qr, FMT, H, H_PAD, D,
                                BLOCK_R, HAS_W)
        _stacked_tile(q, w_m, k, ks_ptr, scale_off, ok, g, out_row, vis, row_ok, width,
                      out_scale, FMT, D, H_PAD, BLOCK_R, BLOCK_N, HAS_W)


def score_stacked(cache: dict[str, torch.Tensor], batch: PagedBatch, q_index: torch.Tensor,
                  preset: ModelPreset, index_format: str, *,
                  head_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  max_rows_per_request: int | None = None,
                  config: BlockConfig | None = None) -> torch.Tensor:
    """Scores [rows, max_ctx // 4] FP32 of a decode-sized call; matches
    `qsa.reference.score.score_reference`.

    q_index [rows, H, D] (bf16; the interpreter surrogate passes fp32) is rounded in the kernel
    to the dot dtype. `out` and `max_rows_per_request` avoid host syncs and are required while a
    graph is captured.
    """
    inp = prepare_inputs(cache, batch, q_index, preset, index_format, head_weights, out)
    require(inp.rows <= MAX_ROWS, f"rows: {inp.rows} query rows, the stacked decode scorer takes "
                                  f"at most {MAX_ROWS} (use score_prefill)")
    rmax = rows_per_request_bound(inp, max_rows_per_request, MAX_ROWS_PER_REQUEST)
    if inp.rows == 0 or inp.width == 0:
        return inp.out
    h_pad = triton.next_power_of_2(inp.heads)
    block_r = max(triton.next_power_of_2(rmax), MIN_MMA_M // h_pad)
    # The table's coordinate is the key groups the grid covers (requests x the widest
    # request's groups): width alone put a batch-32 step call on the entry tuned for batch 8
    # at the same context, a grid four times smaller.
    cfg, launch = lookup(KERNEL, index_format, batch.batch * inp.width, config)
    kw, host = split_config(cfg, launch)
    require("HOIST_Q_MIN_TILES" in host, "config: the stacked scorer needs meta key "
            "HOIST_Q_MIN_TILES (tiles per program from which q is loaded once, not per tile)")
    chunks, tiles = plan_tiles(batch.batch, inp.width, kw["BLOCK_N"], host["PROGRAMS_PER_UNIT"],
                               host["MAX_TILES"], inp.keys.device)
    _score_stacked_kernel[(batch.batch, chunks)](*inp.common_args(), **inp.common_meta(),
                                                 H_PAD=h_pad, BLOCK_R=block_r, TILES=tiles,
                                                 HOIST_Q=tiles >= host["HOIST_Q_MIN_TILES"], **kw)
    return inp.out


def work(batch: PagedBatch, preset: ModelPreset, index_format: str, q_itemsize: int = 2) -> Work:
    """Each request's keys once, q, the FP32 scores and the page table; 2*H*D FLOP per visible
    (row, group)."""
    moved, flops = score_work(batch, preset, index_format, keys_per_row=False,
                              q_itemsize=q_itemsize)
    return Work(bytes_moved=moved, flops=flops)
