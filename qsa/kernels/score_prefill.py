"""Prefill scorer: matrix-core tiles of BLOCK_M rows of one request x BLOCK_N keys, causal.

Why: a prefill chunk has thousands of rows per request, so a key tile is shared by many rows and
the kernel is bound by the matrix unit and its epilogue, not by the keys (which stay in L2 across
row tiles). Hence:
* one dot per index head with M = BLOCK_M rows (not heads stacked into M as in the decode
  scorer): every head's accumulator has the same register layout, so the per-head ReLU and the
  head sum are plain register adds; summing heads out of a stacked M costs a shared-memory round
  trip per tile, more than the MMA itself at this size;
* the key tile is decoded once into the q dtype and shared by all rows and heads (exact for every
  format, `index_tiles.load_key_tile`), and the q tiles of all heads are loaded once per program;
* rows see different prefixes: a row tile reads keys only up to its largest horizon, key chunks
  past it only store -inf, and a row's groups past its own horizon are -inf.
* FP8 and MXFP4 keys of a call whose widest request has at least DECODE_MIN_GROUPS groups (a
  config key; without it, never; `QSA_PREFILL_DECODE_ONCE=0/1` in the environment forces
  either way for A/B runs) are decoded once per call: a first launch writes every request's
  keys, decoded exactly into the q dtype, to a dense scratch (the FP8 row scales beside them),
  and the scorer runs on it as on BF16 keys (TILE_FMT "dense"). Decoding inside the scorer
  repeats it for every row tile that meets a key tile, and puts register-to-shared-memory
  stores of the decoded tile in front of every MMA (profiles/nvidia-h200/bench/scorers/
  prefill-decode-once/). The decoded launch:
  - takes the BF16 table entry's tiles, also when the call passes its own config (whose tiles
    serve the in-tile decode), so a tuner's DECODE_MIN_GROUPS candidate is timed on the launch
    the tables would make;
  - addresses keys and scales by request and group: no page table, so neither a table walk in
    the scorer nor an identity table to build (one more kernel per call). With direct
    addresses Triton's pipeliner keeps one more key buffer than through a table: at 3 stages
    one program fits on an sm90 SM, at 2 stages two
    (profiles/nvidia-h200/bench/scorers/prefill-dense-keys/NOTES.md);
  - applies the FP8 scales to the score columns, requested before the MMAs and read unmasked
    (profiles/nvidia-h200/bench/scorers/prefill-dense-cols/);
  - on NVIDIA sm90+, is a programmatic dependent launch of the decode pass: it launches while
    the pass runs and loads its q tiles, then waits for the pass before its first key.

The grid is (requests x row tiles) x key chunks, so a short prefill (few row tiles) still fills
the device and long horizons are balanced over programs.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.kernels.common import (dependent_launch_here, gdc_launch_dependents, gdc_wait,
                                kernel_repr, lookup, require)
from qsa.kernels.index_tiles import (MIN_MMA_M, ScoreInputs, env_flag, key_col_scale,
                                     key_rows, load_key_tile, plan_tiles, prepare_inputs,
                                     row_visibility, rows_per_request_bound, score_work,
                                     split_config, store_ninf, store_scores)
from qsa.measure.work import Work
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset

KERNEL = "score_prefill"
DECODE_ENV = "QSA_PREFILL_DECODE_ONCE"  # forces the decode pass on (1) or off (0): A/B runs
DECODE_BLOCK_N = 64  # groups per program of the decode pass (a copy-like pass: not tuned)
DECODE_WARPS = 4
DECODE_PDL = True  # the scorer launched as a dependent of the decode pass where the device can


@triton.jit
def _head_queries(q_ptr, row0, row_ok, stride_qr, DT: tl.constexpr, H: tl.constexpr,
                  D: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tuple of H q tiles [BLOCK_M, D] in the dot dtype, one per index head."""
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q_row = q_ptr + (row0 + r).to(tl.int64)[:, None] * stride_qr + d[None, :]
    q = ()
    for h in tl.static_range(H):
        q = q + (tl.load(q_row + h * D, mask=row_ok[:, None], other=0.0).to(DT),)
    return q


@triton.jit(repr=kernel_repr(KERNEL + "_decode", ("FMT", "D", "BLOCK_N")))
def _decode_keys_kernel(kc_ptr, ks_ptr, bt_ptr, ctx_ptr, dk_ptr, ds_ptr, stride_kb, stride_sb,
                        stride_bt, bt_cols, num_blocks, width_p, scale_rows, FMT: tl.constexpr,
                        D: tl.constexpr, GPB: tl.constexpr, KROW: tl.constexpr,
                        SROW: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Groups of one request, decoded exactly into the scratch's dtype, at rows b * width_p + g
    of the scratch; FP8 row scales to the scale scratch, whose last request's row runs on to
    `scale_rows` (the scorer reads its scales unmasked). Groups past the request's keys (or
    on a page outside the pool) are written as zeros with scale 1, like the scorer's masked
    loads."""
    if PDL:  # the scorer may launch now; it waits for this grid before reading the scratch
        gdc_launch_dependents()
    b = tl.program_id(0)
    g = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_groups = tl.load(ctx_ptr + b) // 4
    key_off, scale_off, ok = key_rows(bt_ptr + b.to(tl.int64) * stride_bt, g, g < n_groups,
                                      bt_cols, num_blocks, stride_kb, stride_sb, GPB, KROW, SROW)
    k = load_key_tile(kc_ptr, ks_ptr, key_off, scale_off, ok, dk_ptr.dtype.element_ty, FMT, D,
                      BLOCK_N)
    row = b.to(tl.int64) * width_p + g
    live = g < width_p
    tl.store(dk_ptr + row[:, None] * D + tl.arange(0, D)[None, :], k, mask=live[:, None])
    if FMT == "fp8":
        last = b == tl.num_programs(0) - 1
        tl.store(ds_ptr + row, key_col_scale(ks_ptr, scale_off, ok, FMT, False, BLOCK_N),
                 mask=live | (last & (row < scale_rows)))


@triton.jit(repr=kernel_repr(KERNEL, ("FMT", "TILE_FMT", "H", "D", "GPB", "BLOCK_M", "BLOCK_N",
                                      "TILES", "WARPS", "STAGES")))
def _score_prefill_kernel(q_ptr, kc_ptr, ks_ptr, w_ptr, out_ptr, bt_ptr, ctx_ptr, qs_ptr,
                          pos_ptr, stride_qr, stride_kb, stride_sb, stride_bt, stride_or,
                          bt_cols, num_blocks, width, out_scale, row_tiles,
                          FMT: tl.constexpr, TILE_FMT: tl.constexpr, H: tl.constexpr,
                          D: tl.constexpr, GPB: tl.constexpr, KROW: tl.constexpr,
                          SROW: tl.constexpr,
                          HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          TILES: tl.constexpr, WARPS: tl.constexpr, STAGES: tl.constexpr,
                          PDL: tl.constexpr):
    b = tl.program_id(0) // row_tiles
    tile0 = tl.program_id(1) * TILES
    row0 = tl.load(qs_ptr + b) + (tl.program_id(0) % row_tiles) * BLOCK_M
    nrows = tl.minimum(tl.load(qs_ptr + b + 1) - row0, BLOCK_M)
    n_groups = tl.load(ctx_ptr + b) // 4
    row_ok, vis = row_visibility(pos_ptr, row0, nrows, n_groups, BLOCK_M)
    out_row = out_ptr + (row0 + tl.arange(0, BLOCK_M)).to(tl.int64) * stride_or
    horizon = tl.max(tl.where(row_ok, vis, 0), axis=0)
    if tile0 * BLOCK_N < horizon:
        # BF16 keys, or keys decoded by `_decode_keys_kernel` (TILE_FMT "dense": bf16 rows
        # b * bt_cols * GPB + g, no page table): their storage dtype; FP8/MXFP4 tiles decode
        # into the q dtype.
        if TILE_FMT == "bf16" or TILE_FMT == "dense":
            DT: tl.constexpr = kc_ptr.dtype.element_ty
            LOAD_FMT: tl.constexpr = "bf16"
        else:
            DT: tl.constexpr = q_ptr.dtype.element_ty
            LOAD_FMT: tl.constexpr = TILE_FMT
        q = _head_queries(q_ptr, row0, row_ok, stride_qr, DT, H, D, BLOCK_M)
        if PDL:  # q is ours; the decoded keys are not written until the decode pass ends
            gdc_wait()
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        n = tl.arange(0, BLOCK_N)
        for i in range(TILES):
            g = (tile0 + i) * BLOCK_N + n
            if TILE_FMT == "dense":
                ok = g < horizon
                key_row = b.to(tl.int64) * bt_cols * GPB + g
                key_off, scale_off = key_row * KROW, key_row
            else:
                key_off, scale_off, ok = key_rows(bt_row, g, g < horizon, bt_cols, num_blocks,
                                                  stride_kb, stride_sb, GPB, KROW, SROW)
            if FMT == "fp8" and TILE_FMT == "dense":
                # Requested before the MMAs so their latency hides behind them, computed in the
                # accumulator's column layout from g alone (through a page table, Triton walks
                # it again in that layout: 20 loads per warp and tile, and 255 registers).
                # Unmasked, so the load vectorizes: the scratch runs on past the last request's
                # row over every column a tile reads.
                col = tl.load(ks_ptr + b.to(tl.int64) * bt_cols * GPB + g)  # padded: in bounds
            else:
                col = key_col_scale(ks_ptr, scale_off, ok, FMT, False, BLOCK_N)
            k = tl.trans(load_key_tile(kc_ptr, ks_ptr, key_off, scale_off, ok, DT, LOAD_FMT, D,
                                       BLOCK_N))
            for h in tl.static_range(H):
                a = tl.maximum(tl.dot(q[h], k), 0.0)
                if HAS_W:
                    a = a * tl.load(w_ptr + h)
                if h == 0:
                    s = a
                else:
                    s += a
            col = col * out_scale
            store_scores(out_row, g, s * col[None, :], vis, row_ok, width)
    else:
        store_ninf(out_row, row_ok, tile0, width, BLOCK_M, BLOCK_N, TILES)


def rows_per_tile(block_mh: int, heads: int, dim: int) -> int:
    """Rows of a tile (BLOCK_M) from the config's budget BLOCK_MH, rows x heads at index dim 128:
    the q tiles of all heads stay resident per program, so more heads or a wider index dim mean
    fewer rows (16 .. 128)."""
    require(block_mh >= MIN_MMA_M and block_mh == triton.next_power_of_2(block_mh),
            f"config: BLOCK_MH {block_mh} must be a power of two >= {MIN_MMA_M}")
    rows = block_mh * 128 // (triton.next_power_of_2(heads) * dim)
    return min(128, max(MIN_MMA_M, rows))


def score_prefill(cache: dict[str, torch.Tensor], batch: PagedBatch, q_index: torch.Tensor,
                  preset: ModelPreset, index_format: str, *,
                  head_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  max_rows_per_request: int | None = None,
                  config: BlockConfig | None = None) -> torch.Tensor:
    """Scores [rows, max_ctx // 4] FP32 of any number of rows; matches
    `qsa.reference.score.score_reference`.

    q_index [rows, H, D] (bf16; the interpreter surrogate passes fp32). `out` and
    `max_rows_per_request` avoid host syncs and are required while a graph is captured.
    """
    inp = prepare_inputs(cache, batch, q_index, preset, index_format, head_weights, out)
    rmax = rows_per_request_bound(inp, max_rows_per_request, max(inp.rows, 1))
    if inp.rows == 0 or inp.width == 0:
        return inp.out
    cfg, launch = lookup(KERNEL, index_format, inp.rows, config)
    kw, host = split_config(cfg, launch)
    meta = inp.common_meta()
    tile_fmt = index_format
    decode = index_format != "bf16" and decode_once(host, config, inp.width)
    if decode:  # a decoded tile is a BF16 tile: the BF16 entry's tiles, the call's config or not
        kw, host = split_config(*lookup(KERNEL, "bf16", inp.rows, None))
    block_m = rows_per_tile(host["BLOCK_MH"], inp.heads, inp.dim)
    row_tiles = triton.cdiv(rmax, block_m)
    chunks, tiles = plan_tiles(batch.batch * row_tiles, inp.width, kw["BLOCK_N"],
                               host["PROGRAMS_PER_UNIT"], host["MAX_TILES"], inp.keys.device)
    pdl = decode and DECODE_PDL and dependent_launch_here()
    if decode:
        inp = decoded_keys(inp, chunks * tiles * kw["BLOCK_N"], pdl)
        meta.update(KROW=inp.dim, SROW=1)
        tile_fmt = "dense"
    _score_prefill_kernel[(batch.batch * row_tiles, chunks)](
        *inp.common_args(), row_tiles, **meta, TILE_FMT=tile_fmt, BLOCK_M=block_m,
        TILES=tiles, PDL=pdl, **kw, **({"launch_pdl": True} if pdl else {}))
    return inp.out


def decode_once(host: dict[str, int], config: BlockConfig | None, width: int) -> bool:
    """Whether FP8/MXFP4 keys are decoded to a scratch first: from the config's
    DECODE_MIN_GROUPS groups of the widest request on (absent: never); `DECODE_ENV` forces it
    on or off unless a config was passed explicitly."""
    if config is None and os.environ.get(DECODE_ENV) is not None:
        return env_flag(DECODE_ENV, False)
    return "DECODE_MIN_GROUPS" in host and width >= host["DECODE_MIN_GROUPS"]


def decoded_keys(inp: ScoreInputs, span: int, pdl: bool = False) -> ScoreInputs:
    """The call's inputs with its keys decoded once (`_decode_keys_kernel`) into a dense
    scratch of the q dtype, blocks of the same groups, request after request (`dense_blocks`
    per request): the scorer reads it with the BF16 tile path and no page table. `span`: the
    columns the scorer's tiles cover; FP8 scales are written that far past the last request's
    start, so the scorer reads them without a mask. `pdl`: the next launch depends on this
    one programmatically."""
    b, gpb, d, dev = inp.batch, inp.gpb, inp.dim, inp.keys.device
    pages = triton.cdiv(inp.width, gpb)
    width_p, blocks = pages * gpb, b.batch * pages
    scale_rows = (b.batch - 1) * width_p + max(width_p, span)
    keys = torch.empty((blocks, gpb, 1, d), dtype=inp.q.dtype, device=dev)
    scales = (torch.empty(scale_rows, dtype=torch.float32, device=dev)[:blocks * gpb]
              .view(blocks, gpb, 1) if inp.fmt == "fp8" else keys)
    meta = inp.common_meta()
    _decode_keys_kernel[(b.batch, triton.cdiv(max(width_p, span), DECODE_BLOCK_N))](
        inp.keys, inp.scales, b.block_table, b.context_lens, keys, scales, inp.keys.stride(0),
        inp.scales.stride(0), b.block_table.stride(0), b.block_table.shape[1], inp.num_blocks,
        width_p, scale_rows, FMT=inp.fmt, D=d, GPB=gpb, KROW=meta["KROW"],
        SROW=meta["SROW"], BLOCK_N=DECODE_BLOCK_N, PDL=pdl, num_warps=DECODE_WARPS)
    return dataclasses.replace(inp, keys=keys, scales=scales, dense_blocks=pages)


def work(batch: PagedBatch, preset: ModelPreset, index_format: str, q_itemsize: int = 2) -> Work:
    """Each request's keys once (row tiles re-read them from L2), q, the FP32 scores and the page
    table; 2*H*D FLOP per visible (row, group), the causal half excluded."""
    moved, flops = score_work(batch, preset, index_format, keys_per_row=False,
                              q_itemsize=q_itemsize)
    return Work(bytes_moved=moved, flops=flops)
