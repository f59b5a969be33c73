"""Row-wise decode scorer: one program per query row and key chunk, FP32 vector units.

The baseline the stacked scorer is measured against (and the escape hatch behind
QSA_STACKED_DECODE_SCORER=0): the kernel design that shipped before. Each row reads its
request's keys up to its own horizon, so a verify of R rows streams the keys R times (from L2
when the rows of a request run together, from HBM when they do not). It is written well for
what it is: the page lookups, key decode and masking are the same shared helpers the stacked
scorer uses, the row's request is found in-kernel (no host sync, no extra launch), and a row's
keys are split over enough programs to fill the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.kernels.common import kernel_repr, lookup
from qsa.kernels.index_tiles import (key_col_scale, key_rows, load_dense, load_mx_halves,
                                     load_mx_scales, plan_tiles, prepare_inputs, score_work,
                                     split_config)
from qsa.measure.work import Work
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset

KERNEL = "score_rowwise"


@triton.jit
def _fma_tile(q_ptr, q_row_off, kc_ptr, ks_ptr, key_off, scale_off, ok,
              FMT: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, CK: tl.constexpr):
    """Per-head dot products of one key tile with one query row on the FP32 vector units,
    [N, H_PAD], before the ReLU, over D in chunks of CK (MXFP4: its 32-element scale blocks, as
    even/odd halves scaled per key before the blocks are summed)."""
    h = tl.arange(0, H_PAD)
    hq = q_ptr + q_row_off + h[:, None] * D
    hm = (h < H)[:, None]
    acc = tl.zeros([BLOCK_N, H_PAD], tl.float32)
    if FMT == "mxfp4":
        i2 = 2 * tl.arange(0, 16)
        scales = load_mx_scales(ks_ptr, scale_off, ok, D // 32)
        for c in tl.static_range(D // 32):
            lo, hi = load_mx_halves(kc_ptr, key_off, ok, c)
            qe = tl.load(hq + c * 32 + i2[None, :], mask=hm, other=0.0).to(tl.float32)
            qo = tl.load(hq + c * 32 + i2[None, :] + 1, mask=hm, other=0.0).to(tl.float32)
            part = tl.sum(lo.to(tl.float32)[:, None, :] * qe[None, :, :], axis=2)
            part += tl.sum(hi.to(tl.float32)[:, None, :] * qo[None, :, :], axis=2)
            acc += part * scales[c][:, None]
    else:
        dk = tl.arange(0, CK)
        for c in tl.static_range(D // CK):
            k = load_dense(kc_ptr, key_off, ok, c * CK, CK).to(tl.float32)
            qc = tl.load(hq + c * CK + dk[None, :], mask=hm, other=0.0).to(tl.float32)
            acc += tl.sum(k[:, None, :] * qc[None, :, :], axis=2)
    return acc


@triton.jit(repr=kernel_repr(KERNEL, ("FMT", "H", "D", "GPB", "BLOCK_N", "CK", "TILES",
                                      "WARPS", "STAGES")))
def _score_rowwise_kernel(q_ptr, kc_ptr, ks_ptr, w_ptr, out_ptr, bt_ptr, ctx_ptr, qs_ptr,
                          pos_ptr, stride_qr, stride_kb, stride_sb, stride_bt, stride_or,
                          bt_cols, num_blocks, width, out_scale, batch,
                          FMT: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                          GPB: tl.constexpr, KROW: tl.constexpr, SROW: tl.constexpr,
                          HAS_W: tl.constexpr, H_PAD: tl.constexpr, BLOCK_B: tl.constexpr,
                          BLOCK_N: tl.constexpr, CK: tl.constexpr, TILES: tl.constexpr,
                          WARPS: tl.constexpr, STAGES: tl.constexpr):
    row = tl.program_id(0)
    tile0 = tl.program_id(1) * TILES
    # The row's request: how many requests end at or before it (one vector load).
    j = tl.arange(0, BLOCK_B)
    ends = tl.load(qs_ptr + 1 + j, mask=j < batch, other=2147483647)
    b = tl.sum((ends <= row).to(tl.int32), axis=0)
    n_groups = tl.load(ctx_ptr + b) // 4
    vis = tl.minimum((tl.load(pos_ptr + row) + 1) // 4, n_groups)
    out_row = out_ptr + row.to(tl.int64) * stride_or
    n = tl.arange(0, BLOCK_N)
    if tile0 * BLOCK_N < vis:
        h = tl.arange(0, H_PAD)
        if HAS_W:
            w = tl.load(w_ptr + h, mask=h < H, other=0.0)
        q_row_off = row.to(tl.int64) * stride_qr
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        for i in range(TILES):
            g = (tile0 + i) * BLOCK_N + n
            key_off, scale_off, ok = key_rows(bt_row, g, g < vis, bt_cols, num_blocks,
                                              stride_kb, stride_sb, GPB, KROW, SROW)
            s = tl.maximum(_fma_tile(q_ptr, q_row_off, kc_ptr, ks_ptr, key_off, scale_off, ok,
                                     FMT, H, H_PAD, D, BLOCK_N, CK), 0.0)
            if HAS_W:
                s = s * w[None, :]
            col = key_col_scale(ks_ptr, scale_off, ok, FMT, FMT == "mxfp4", BLOCK_N) * out_scale
            s = tl.sum(s, axis=1) * col
            tl.store(out_row + g, tl.where(g < vis, s, float("-inf")), mask=g < width)
    else:
        for i in range(TILES):
            g = (tile0 + i) * BLOCK_N + n
            tl.store(out_row + g, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=g < width)


def score_rowwise(cache: dict[str, torch.Tensor], batch: PagedBatch, q_index: torch.Tensor,
                  preset: ModelPreset, index_format: str, *,
                  head_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  config: BlockConfig | None = None) -> torch.Tensor:
    """Scores [rows, max_ctx // 4] FP32; matches `qsa.reference.score.score_reference`.

    Any number of rows. `out` avoids a host sync and is required while a graph is captured.
    """
    inp = prepare_inputs(cache, batch, q_index, preset, index_format, head_weights, out)
    if inp.rows == 0 or inp.width == 0:
        return inp.out
    cfg, launch = lookup(KERNEL, index_format, inp.width, config)
    kw, host = split_config(cfg, launch)
    chunks, tiles = plan_tiles(inp.rows, inp.width, kw["BLOCK_N"], host["PROGRAMS_PER_UNIT"],
                               host["MAX_TILES"], inp.keys.device)
    _score_rowwise_kernel[(inp.rows, chunks)](
        *inp.common_args(), batch.batch, **inp.common_meta(),
        H_PAD=triton.next_power_of_2(inp.heads),
        BLOCK_B=triton.next_power_of_2(max(batch.batch, 1)), TILES=tiles, **kw)
    return inp.out


def work(batch: PagedBatch, preset: ModelPreset, index_format: str, q_itemsize: int = 2) -> Work:
    """The row-wise design's traffic: each row's visible keys once per row, plus q, the FP32
    scores and the page table; 2*H*D FLOP per visible (row, group)."""
    moved, flops = score_work(batch, preset, index_format, keys_per_row=True,
                              q_itemsize=q_itemsize)
    return Work(bytes_moved=moved, flops=flops)
