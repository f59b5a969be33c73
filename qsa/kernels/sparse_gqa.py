"""Sparse GQA over the selected token ids of each query row (spec section 2 step 7), reading BF16
or FP8 (E4M3 + FP32 per-(token, KV head) scale) K/V tiles from the paged cache.

Design, and why (the notes named hold the measurements):
* One program per (query row, KV head): the G query heads of the KV head are the M side of one
  MMA tile (padded to 16, the smallest MMA M), so every K/V byte loaded serves all G heads.
* Ids go through the page table per token (a selected group is 4 tokens of one page). SLOTS=1
  first turns every id into its cache slot in a small kernel, so the K/V gathers sit one
  dependent load deep instead of two; it costs a launch, so small batches leave it off
  (profiles/nvidia-h200/bench/attention/sweep-slots/NOTES.md).
* A BF16 split of one token block requests V right after K: a one-iteration loop loses the
  pipeliner's copies that would fetch V ahead. FP8 keeps V after the scores, where its entry
  is faster (profiles/nvidia-h200/bench/attention/early-v/NOTES.md).
* Online softmax in FP32 in the exp2 domain (log2(e) folded into the scale).
* FP8: the key scale multiplies the score column, the value scale is folded into the
  probability before the PV product (spec 2.7). The codes feed FP16 MMAs: on sm90 E4M3 converts
  to FP16 in one instruction but to BF16 only through two more, which would make FP8
  dequantization-bound. q is scaled by a power of two and each row's probabilities by their
  tile maximum to keep FP16 in range (both undone in FP32).
* Decode grids (rows x KV heads) are often smaller than the device, so the token list is split
  across programs (a count from the config or the SM/CU count), whose partial outputs and
  log-sum-exps a merge kernel combines.
* PV_HALVES=1 runs the PV product over each half of the head dim in turn: the FP8 V tile's
  fp16 staging copy then covers half the columns, so two programs fit on an sm90 SM instead of
  one (profiles/nvidia-h200/bench/attention/pv-halves/NOTES.md).
* PDL=1 (NVIDIA sm90+) launches the pre-pass, attention and merge grids with programmatic
  dependent launch, so a grid's launch overlaps the previous grid's run (same note).
* Prefill is the same kernel, unsplit, with its own throughput-sized block config.
* ROWS=R > 1, the shared (tile-union) path: a program owns R consecutive rows (M = R x G) and
  walks the union of their selections (`qsa.kernels.row_union`), masking each score its row
  did not select, so a K/V tile several rows selected is loaded once. It trades K/V bytes for
  matrix work, so `plan_sharing` measures a call's union and chooses per call between the
  per-row entries ("bf16"/"fp8") and the shared ones ("bf16-shared"/"fp8-shared", chosen up
  to a union of SHARE_MAX_UNION hundredths of one row's ids); split calls deal the union's
  tiles to the splits in turn (profiles/selection-overlap/NOTES.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qsa import overlap
from qsa.configs import BlockConfig, get_config
from qsa.configs.schema import schema_of
from qsa.formats import check_kv_format
from qsa.kernels import common, sparse_gqa_gluon
from qsa.kernels.row_union import row_block_union
from qsa.kernels.common import (KernelInputError, gdc_launch_dependents, gdc_wait, kernel_repr,
                                kv_code_planes, kv_scale_planes, lookup, require, require_dtype,
                                require_inner_contiguous, storage_dtypes, unit_count)
from qsa.measure.work import Work
from qsa.paging import BatchError, PagedBatch
from qsa.presets import ModelPreset

KERNEL_DECODE = "sparse_gqa_decode"
KERNEL_PREFILL = "sparse_gqa_prefill"
__all__ = ["KERNEL_DECODE", "KERNEL_PREFILL", "SharePlan", "choose_splits", "plan_sharing",
           "sparse_gqa_decode", "sparse_gqa_prefill", "split_count", "table_format", "work"]

LOG2E = 1.4426950408889634
MIN_M = 16  # smallest MMA M on every target (mma m16n8k16, MFMA 16x16)
MAX_M = 128
MAX_SPLITS = 64
ROWS_PER_PROGRAM = (1, 2, 4, 8)  # config key ROWS: consecutive rows sharing one program
SHARED = "-shared"  # table format suffix of the shared (tile-union) path's entries
# Meta keys of a table entry that steer the host side, not the attention kernel's constexprs.
_HOST_KEYS = ("NUM_SPLITS", "SPLIT_RESIDENT_PER_SM", "SPLIT_MIN_BLOCKS", "MERGE_BLOCK_D",
              "MERGE_WARPS", "SLOTS", "PDL", "SHARE_MAX_UNION")
_REPR_KEYS = ("FP8", "G", "BLOCK_M", "D", "BLOCK_N", "PAGE", "SPLIT", "PV_HALVES", "PDL", "ROWS")


def _attention_repr(spec) -> str:
    """One kernel serves both phases; the name says which, so profiler rows tell them apart."""
    name = KERNEL_PREFILL if spec.constants.get("PREFILL") else KERNEL_DECODE
    return kernel_repr(name, _REPR_KEYS)(spec)


@triton.jit
def _follow_previous_grid():
    """Programmatic dependent launch (sm90+, config key PDL): this grid may be launched while
    the previous one in the stream still runs. Let the next grid launch early too, then wait
    until the previous grid has finished and its writes are visible, before any global read
    or write: inputs and reused allocations are then as safe as in plain stream order, and
    what overlaps is only the launch and scheduling of the grid."""
    gdc_launch_dependents()
    gdc_wait()


@triton.jit
def _row_request(qs_ptr, row, batch, BATCH_P2: tl.constexpr):
    """Request of a query row: how many requests end at or before it (query_start is CSR)."""
    b = tl.arange(0, BATCH_P2)
    ends = tl.load(qs_ptr + 1 + b, mask=b < batch, other=2147483647)
    return tl.minimum(tl.sum((ends <= row).to(tl.int32), axis=0), batch - 1)


@triton.jit
def _id_blocks(ids, ctx, bt_row, max_pages, num_blocks, PAGE: tl.constexpr):
    """Cache block of each token id through the request's page table, and which ids are
    readable: not padding, inside the context, their page and block inside the pool."""
    page = ids // PAGE
    valid = (ids >= 0) & (ids < ctx) & (page < max_pages)
    blk = tl.load(bt_row + page, mask=valid, other=-1)
    return valid & (blk >= 0) & (blk < num_blocks), blk


@triton.jit
def _fp16_operand(v, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """E4M3 V codes [N, D] as the fp16 B operand of the PV product, converted in the layout
    they were loaded in (one packed instruction per two codes), so fp16 reaches the MMA through
    a conflict-free ldmatrix.trans. PV reduces over tokens, the strided dim of a token-major
    tile, and two compiler choices must be stopped (measured with ncu on sm90,
    profiles/nvidia-h200/bench/attention/sweep-slots/NOTES.md):
    * left alone, Triton moves the conversion after the shared-memory read of the operand,
      which then reads the 8-bit codes byte by byte (no 8-bit transposing ldmatrix on sm90);
    * Triton sizes the operand's k-width from the narrowest load it can trace the value back
      to (8 bits here), and the wider k-width makes ldmatrix.trans read 4-way bank-conflicted
      rows.
    A max over a size-1 axis is an identity that neither the conversion hoisting nor that trace
    goes through."""
    return tl.max(tl.reshape(v.to(tl.float16), (BLOCK_N, D, 1)), axis=2).to(tl.float16)


@triton.jit
def _load_v(v_rows, vs_ptr, blk64, stride_vsb, tok, head, valid, dv, FP8: tl.constexpr):
    """One tile's V columns `dv` and, for FP8 tiles, its per-token value scales (BF16: ones,
    never read)."""
    v = tl.load(v_rows + dv[None, :], mask=valid[:, None], other=0.0)
    if FP8:
        vsc = tl.load(vs_ptr + blk64 * stride_vsb + tok + head, mask=valid, other=0.0)
    else:
        vsc = tl.full(valid.shape, 1.0, tl.float32)
    return v, vsc


@triton.jit
def _pv_accumulate(acc, pw, v, alpha, r, FP8: tl.constexpr, BLOCK_N: tl.constexpr,
                   DV: tl.constexpr):
    """acc * alpha + P V over one tile's V columns: FP8 codes through fp16 with the row
    normaliser r undone on the product, BF16 accumulated in the MMA."""
    if FP8:
        acc = acc * alpha[:, None] + tl.dot(pw, _fp16_operand(v, BLOCK_N, DV)) * r[:, None]
    else:
        acc = tl.dot(pw, v, acc * alpha[:, None])
    return acc


@triton.jit(repr=_attention_repr)
def _sparse_gqa_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, ids_ptr, bt_ptr, ctx_ptr, qs_ptr,
                       out_ptr, po_ptr, lse_ptr, row_bits_ptr, union_len_ptr,
                       batch, num_blocks, max_pages, width, num_splits,
                       stride_qr, stride_qh, stride_ir, stride_bt, stride_kb, stride_vb,
                       stride_ksb, stride_vsb, stride_or, stride_oh, qk_scale,
                       HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                       SPLIT_BLOCKS: tl.constexpr, BATCH_P2: tl.constexpr,
                       FP8: tl.constexpr, SPLIT: tl.constexpr, PREFILL: tl.constexpr,
                       SLOTS: tl.constexpr, PV_HALVES: tl.constexpr, PDL: tl.constexpr,
                       ROWS: tl.constexpr, RUNTIME_TRIPS: tl.constexpr):
    if PDL:
        _follow_previous_grid()
    pid = tl.program_id(0)
    split = pid % num_splits
    unit = pid // num_splits
    block = unit // HKV  # the program's row (a block of ROWS rows)
    row = block * ROWS  # its first row
    head = unit % HKV
    req = _row_request(qs_ptr, row, batch, BATCH_P2)
    ctx = tl.load(ctx_ptr + req)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    # ROWS > 1: the ids are the union of the rows' cache slots, one list per row block
    ids_row = ids_ptr + block.to(tl.int64) * stride_ir
    n_lo = split * (SPLIT_BLOCKS * BLOCK_N)

    # M = ROWS x G: row r of the program's rows, query head hh of the KV head's group
    m_offs = tl.arange(0, BLOCK_M)
    if ROWS > 1:
        r_m = m_offs // G
        qrow64 = (row + r_m).to(tl.int64)[:, None]
        heads = head * G + m_offs % G
        hmask = (m_offs < ROWS * G) & (row + r_m < tl.load(qs_ptr + batch))  # the last block's
    else:  # one row: its offset stays a scalar
        qrow64 = row.to(tl.int64)
        heads = head * G + m_offs
        hmask = m_offs < G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow64 * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None], other=0.0)
    if FP8:
        # Power-of-two scale so the largest |q| lands in [2^14, 2^15): exact in FP16 range.
        qf = q.to(tl.float32)
        qa = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
        qmul = tl.exp2(14.0 - tl.floor(tl.log2(tl.maximum(qa, 1e-30))))
        q = (qf * qmul).to(tl.float16)
        score_scale = qk_scale / qmul
    else:
        score_scale = qk_scale

    # -1e30, not -inf: a tile with no valid token then gives alpha = 1 and p = 0, never NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    DV: tl.constexpr = D // 2 if PV_HALVES else D
    dv = tl.arange(0, DV)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    if PV_HALVES:
        acc_hi = tl.zeros([BLOCK_M, DV], tl.float32)
    head_off = head * D
    if ROWS > 1:
        # The row block's union: which of its rows selected each entry (bit r for row r) and
        # the union's length, both at the ids' row stride. Its tiles are dealt to the splits
        # in turn (tile i to split i % num_splits), so the splits stay even whatever its
        # length. A constexpr trip count under the interpreter (Triton 3.6's can not take a
        # runtime range bound under numpy >= 2.4): the tiles past the union are all masked
        # there.
        row_bits = row_bits_ptr + block.to(tl.int64) * stride_ir
        length = tl.load(union_len_ptr + block.to(tl.int64) * stride_ir)
    # One row per program: whole blocks per split make the constexpr count exact.
    for i in range(tl.cdiv(tl.maximum(tl.cdiv(length, BLOCK_N) - split, 0), num_splits)
                   if RUNTIME_TRIPS else SPLIT_BLOCKS):
        if ROWS > 1:
            n = (i * num_splits + split) * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = n < length
        else:
            n = n_lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
            inside = n < width
        ids = tl.load(ids_row + n, mask=inside, other=-1)
        if ROWS > 1:  # which of the program's rows selected each id: bit r of its mask
            bits = tl.load(row_bits + n, mask=inside, other=0)
        if SLOTS:
            # ids are cache slots (block * PAGE + offset, -1 for none): one dependent level
            valid = ids >= 0
            blk = ids // PAGE
        else:
            valid, blk = _id_blocks(ids, ctx, bt_row, max_pages, num_blocks, PAGE)
        blk64 = blk.to(tl.int64)
        tok = (ids % PAGE) * HKV
        kv_off = tok * D + head_off
        k = tl.load(k_ptr + (blk64 * stride_kb + kv_off)[:, None] + d[None, :],
                    mask=valid[:, None], other=0.0)
        v_rows = v_ptr + (blk64 * stride_vb + kv_off)[:, None]
        V_FIRST: tl.constexpr = SPLIT_BLOCKS == 1 and not FP8
        if V_FIRST:
            # One tile per program: the loop folds away with the pipeliner's asynchronous
            # copies, so V is requested next to K rather than after the scores (one DRAM
            # round trip less on the program's chain; the batch-1 entries split this way).
            v, vsc = _load_v(v_rows, vs_ptr, blk64, stride_vsb, tok, head, valid, dv, FP8)
        if FP8:
            ksc = tl.load(ks_ptr + blk64 * stride_ksb + tok + head, mask=valid, other=0.0)
            s = tl.dot(q, tl.trans(k.to(tl.float16)))
            s = s * (ksc * score_scale)[None, :]
        else:
            s = tl.dot(q, tl.trans(k)) * score_scale
        if ROWS > 1:
            s = tl.where(valid[None, :] & (((bits[None, :] >> r_m[:, None]) & 1) != 0), s,
                         float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not V_FIRST:
            v, vsc = _load_v(v_rows, vs_ptr, blk64, stride_vsb, tok, head, valid, dv, FP8)
        if FP8:
            pv = p * vsc[None, :]
            r = tl.max(pv, axis=1)
            r = tl.where(r > 0.0, r, 1.0)
            pw = (pv * (1.0 / r)[:, None]).to(tl.float16)
        else:
            r = alpha  # unused by the BF16 product
            pw = p.to(v.dtype)
        acc = _pv_accumulate(acc, pw, v, alpha, r, FP8, BLOCK_N, DV)
        if PV_HALVES:
            v = tl.load(v_rows + DV + dv[None, :], mask=valid[:, None], other=0.0)
            acc_hi = _pv_accumulate(acc_hi, pw, v, alpha, r, FP8, BLOCK_N, DV)
        m_i = m_new

    if PV_HALVES:
        acc = tl.reshape(tl.permute(tl.join(acc, acc_hi), (0, 2, 1)), (BLOCK_M, D))
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:  # partials in [rows, Hq, splits] order
        if ROWS > 1:
            part0 = ((row + r_m).to(tl.int64) * (HKV * G) + heads) * num_splits
        else:  # qrow64 is the row's scalar offset
            part0 = (qrow64 * (HKV * G) + heads) * num_splits
        tl.store(po_ptr + (part0 + split)[:, None] * D + d[None, :], o, mask=hmask[:, None])
        tl.store(lse_ptr + part0 + split, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)),
                                                   float("-inf")), mask=hmask)
    else:
        tl.store(out_ptr + qrow64 * stride_or + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit(repr=kernel_repr("sparse_gqa_merge", ["D", "BLOCK_S", "BLOCK_D", "PDL"]))
def _merge_kernel(po_ptr, lse_ptr, out_ptr, num_splits, stride_or, stride_oh,
                  HQ: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Log-sum-exp merge of the split partials of one (row, query head) and a D slice."""
    if PDL:
        _follow_previous_grid()
    rh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = s < num_splits
    lse = tl.load(lse_ptr + rh * num_splits + s, mask=live, other=float("-inf"))
    # Weights relative to the largest. A split with no token has lse -inf and weight 0; when no
    # split has one, every weight is 0 (not NaN) and so is their sum.
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0))
    den = tl.sum(w, axis=0)
    o = tl.load(po_ptr + (rh * num_splits + s)[:, None] * D + d[None, :], mask=live[:, None],
                other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    row = rh // HQ
    h = rh % HQ
    tl.store(out_ptr + row * stride_or + h * stride_oh + d, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _slots_kernel(ids_ptr, bt_ptr, ctx_ptr, qs_ptr, slots_ptr, batch, num_blocks, max_pages,
                  width, stride_ir, stride_bt, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                  BATCH_P2: tl.constexpr, PDL: tl.constexpr):
    """Token ids of one row -> cache slots (block * PAGE + offset), -1 where the id is padding,
    outside the request's context or its page is outside the pool."""
    if PDL:
        _follow_previous_grid()
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    req = _row_request(qs_ptr, row, batch, BATCH_P2)
    ctx = tl.load(ctx_ptr + req)
    ids = tl.load(ids_ptr + row.to(tl.int64) * stride_ir + n, mask=n < width, other=-1)
    valid, blk = _id_blocks(ids, ctx, bt_ptr + req.to(tl.int64) * stride_bt, max_pages,
                            num_blocks, PAGE)
    tl.store(slots_ptr + row.to(tl.int64) * width + n, tl.where(valid, blk * PAGE + ids % PAGE, -1),
             mask=n < width)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

def _check(q: torch.Tensor, cache: dict[str, torch.Tensor], batch: PagedBatch,
           token_ids: torch.Tensor, preset: ModelPreset, kv_format: str,
           out: torch.Tensor | None) -> None:
    """Shape, dtype and layout checks: host metadata only, no device reads."""
    kc, vc = kv_code_planes(cache, kv_format)
    hq, hkv, d = preset.num_q_heads, preset.num_kv_heads, preset.head_dim
    require(q.dim() == 3 and tuple(q.shape[1:]) == (hq, d),
            f"q: expected [rows, {hq}, {d}] for preset {preset.name}, got {tuple(q.shape)}")
    require_dtype(q, "q", storage_dtypes())
    require_inner_contiguous(q, "q", 2)
    rows = q.shape[0]
    shape = (batch.block_size, hkv, d)
    require(kc.dim() == 4 and tuple(kc.shape[1:]) == shape,
            f"cache['k']: expected [blocks, {', '.join(map(str, shape))}] (block_size, Hkv, D "
            f"of the batch and preset), got {tuple(kc.shape)}")
    require(vc.shape == kc.shape, f"cache['v']: shape {tuple(vc.shape)} differs from "
                                  f"cache['k'] {tuple(kc.shape)}")
    require(vc.dtype == kc.dtype, f"cache['v']: dtype {vc.dtype} differs from cache['k'] "
                                  f"{kc.dtype}")
    planes = kv_scale_planes(cache, kv_format)
    if kv_format != "fp8":
        require(kc.dtype == q.dtype, f"cache['k']: dtype {kc.dtype} does not match q "
                                     f"{q.dtype} for a BF16 cache")
    for name, t in planes:
        require_inner_contiguous(t, f"cache['{name}']", t.dim() - 1)
    require(token_ids.dim() == 2 and token_ids.shape[0] == rows and token_ids.shape[1] >= 1,
            f"token_ids: expected [{rows}, width >= 1], got {tuple(token_ids.shape)}")
    require_dtype(token_ids, "token_ids", (torch.int32,))
    require_inner_contiguous(token_ids, "token_ids", 1)
    bt = batch.block_table
    for name, t, nd in (("block_table", bt, 2), ("context_lens", batch.context_lens, 1),
                        ("query_start", batch.query_start, 1), ("positions", batch.positions, 1)):
        require(t.dtype == torch.int32 and t.dim() == nd,
                f"batch.{name}: expected int32 with {nd} dims, got {t.dtype} {tuple(t.shape)}")
    require(bt.stride(1) == 1, "batch.block_table: rows must be contiguous")
    require(batch.context_lens.is_contiguous() and batch.query_start.is_contiguous(),
            "batch.context_lens / query_start must be contiguous")
    require(batch.batch >= 1 and batch.query_start.shape[0] == batch.batch + 1
            and bt.shape[0] == batch.batch,
            f"batch: {batch.batch} requests, {batch.query_start.shape[0]} query_start entries, "
            f"{bt.shape[0]} block_table rows")
    require(batch.num_rows == rows, f"q: {rows} rows, the batch has {batch.num_rows}")
    require(d & (d - 1) == 0 and 16 <= d <= 256,
            f"head_dim {d}: unsupported (a power of two in 16..256)")
    require(preset.gqa_group <= MAX_M, f"GQA group {preset.gqa_group}: unsupported (> {MAX_M})")
    if out is not None:
        require(tuple(out.shape) == tuple(q.shape),
                f"out: expected {tuple(q.shape)}, got {tuple(out.shape)}")
        require_dtype(out, "out", (torch.bfloat16, torch.float16, torch.float32))
        require_inner_contiguous(out, "out", 2)
    for name, t in [("out", out), ("token_ids", token_ids), ("block_table", bt),
                    ("context_lens", batch.context_lens), ("query_start", batch.query_start),
                    *[(f"cache['{n}']", x) for n, x in planes]]:
        if t is not None:
            require(t.device == q.device, f"{name}: on {t.device}, q is on {q.device}")


def _check_values(cache: dict[str, torch.Tensor], batch: PagedBatch,
                  token_ids: torch.Tensor) -> None:
    """Data-dependent checks (a device sync on a GPU): batch invariants, page table inside the
    pool, and every selected id inside its request's context."""
    try:
        batch.validate(cache["k"].shape[0])
    except BatchError as e:
        raise KernelInputError(f"batch: {e}") from None
    ctx = batch.context_lens[batch.row_request.long()].long()
    ids = token_ids.long()
    bad = (ids >= ctx[:, None]) | (ids < -1)
    if bool(bad.any()):
        r, c = (int(x) for x in bad.nonzero()[0])
        raise KernelInputError(f"token_ids[{r}, {c}] = {int(ids[r, c])} is outside row {r}'s "
                               f"request context of {int(ctx[r])} tokens")


def choose_splits(units: int, width: int, block_n: int, unit_count: int,
                  programs_per_sm: int, min_blocks: int) -> int:
    """Splits of each (row, KV head) token list so that the grid fills, in one wave, the
    `programs_per_sm` resident programs of every SM/CU (the config's occupancy estimate):
    rounding down keeps equal-sized programs in a single wave instead of adding a short
    second one. At least `min_blocks` token blocks per split (fewer would be all prologue),
    at most MAX_SPLITS."""
    slots = programs_per_sm * unit_count
    if units <= 0 or units >= slots:
        return 1
    most = max(1, triton.cdiv(width, block_n) // max(1, min_blocks))
    return max(1, min(slots // units, most, MAX_SPLITS))


def _auto_splits(host: dict[str, int], units: int, width: int, block_n: int,
                 device: torch.device) -> int:
    """The config's NUM_SPLITS when > 0; else the SM/CU rule when the config carries its
    occupancy estimate SPLIT_RESIDENT_PER_SM; else unsplit (the prefill tables carry neither:
    their grids are large)."""
    if host.get("NUM_SPLITS", 0) > 0:
        return host["NUM_SPLITS"]
    if "SPLIT_RESIDENT_PER_SM" not in host:
        return 1
    return choose_splits(units, width, block_n, unit_count(device),
                         host["SPLIT_RESIDENT_PER_SM"], host.get("SPLIT_MIN_BLOCKS", 1))


def table_format(kv_format: str, shared: bool) -> str:
    """The table format key of a call: the per-row entries, or the shared path's."""
    return kv_format + SHARED if shared else kv_format


def _plan(kernel: str, fmt: str, rows: int, hkv: int, width: int, device: torch.device,
          config: BlockConfig | None, num_splits: int | None
          ) -> tuple[dict, dict[str, int], int, int]:
    """Launch keywords, host-side config keys, splits and token blocks per split of a call
    whose table format key is `fmt` (`table_format`)."""
    cfg, kw = lookup(kernel, fmt, rows, config)
    host = {key: kw.pop(key) for key in _HOST_KEYS if key in kw}
    impl = _check_impl(cfg, kernel, fmt)
    if impl != "triton":
        host["impl"] = impl
    kw.setdefault("PV_HALVES", 0)  # a config written before the switch existed
    kw.setdefault("ROWS", 1)
    block_n = kw.get("BLOCK_N", 0)
    require(block_n >= 16 and block_n & (block_n - 1) == 0,
            f"config: BLOCK_N {block_n} must be a power of two >= 16")
    per = kw["ROWS"]
    require(per in ROWS_PER_PROGRAM, f"config: ROWS {per} must be one of {ROWS_PER_PROGRAM}")
    units = triton.cdiv(rows, per) * hkv
    if num_splits is None:
        # A union is at least one row's width and at most `per` of them: splits are sized for
        # the overlapping rows the shared path is chosen for.
        num_splits = _auto_splits(host, units, width, block_n, device)
    require(isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS,
            f"num_splits {num_splits}: must be an integer in 1..{MAX_SPLITS}")
    require(units * num_splits < 2**31, f"{rows} rows x {hkv} KV heads x {num_splits} splits "
                                        "exceed one launch grid")
    if per > 1:  # tiles dealt in turn: every split exists, each loops over its share
        return kw, host, num_splits, triton.cdiv(triton.cdiv(width * per, block_n), num_splits)
    # Whole token blocks per split, so no block straddles two programs.
    split_blocks = triton.cdiv(triton.cdiv(width, block_n), num_splits)
    return kw, host, triton.cdiv(width, split_blocks * block_n), split_blocks


def split_count(rows: int, preset: ModelPreset, width: int, kv_format: str,
                device: torch.device | str, *, prefill: bool = False,
                config: BlockConfig | None = None, num_splits: int | None = None,
                shared: bool = False) -> int:
    """Programs per (row, KV head) a launch of this shape uses: what benchmarks record next to
    a time, since the split rule depends on the device. A requested `num_splits` is clamped so
    that every split gets whole token blocks and none is empty: with B = cdiv(width, BLOCK_N)
    blocks, the launch uses cdiv(B, cdiv(B, num_splits)) splits (never more than B)."""
    kernel = KERNEL_PREFILL if prefill else KERNEL_DECODE
    return _plan(kernel, table_format(kv_format, shared), rows, preset.num_kv_heads, width,
                 torch.device(device), config, num_splits)[2]


def _check_impl(cfg: BlockConfig, kernel: str, fmt: str) -> str:
    """The entry's implementation, refused where it can not run. Which formats and arch an
    implementation serves is declared once, in the table's schema (`qsa.configs.schema`): the
    Gluon kernel is NVIDIA sm90's (warp specialization, cp.async, mbarriers), for decode calls
    over per-row lists."""
    if cfg.impl == "triton":
        return "triton"
    serves = schema_of(kernel).impls.get(cfg.impl)
    require(serves is not None, f"config: impl {cfg.impl} does not implement {kernel}")
    formats, only_arch = serves
    backend, arch = common.backend_and_arch()
    require(backend == "cuda" and arch == only_arch,
            f"config: impl {cfg.impl} runs on NVIDIA {only_arch} only; this device is {backend} "
            f"{arch} (use impl triton)")
    require(fmt in formats, f"config: impl {cfg.impl} serves {kernel} formats "
                            f"{', '.join(formats)}, not {fmt}")
    return cfg.impl


def _use_pdl(host: dict[str, int]) -> bool:
    """Whether the launches use programmatic dependent launch (config key PDL=1): NVIDIA sm90
    and newer (griddepcontrol); refused on ROCm, older NVIDIA GPUs and Triton builds without
    the NVIDIA device calls. The interpreter runs grids one after another whatever the key
    says, so there it is off."""
    if not host.get("PDL", 0):
        return False
    backend, arch = common.backend_and_arch()
    if backend == "interpreter":
        return False
    if not common.dependent_launch_here():
        raise KernelInputError(f"config: PDL=1 needs programmatic dependent launch (NVIDIA "
                               f"sm90 or newer); this device is {backend} {arch}: use PDL=0")
    return True


def _launch(q: torch.Tensor, cache: dict[str, torch.Tensor], batch: PagedBatch,
            token_ids: torch.Tensor, preset: ModelPreset, kv_format: str,
            out: torch.Tensor | None, config: BlockConfig | None, num_splits: int | None,
            check: bool | None, kernel: str, shared: bool) -> torch.Tensor:
    _check(q, cache, batch, token_ids, preset, kv_format, out)
    if check is None:
        check = q.device.type == "cpu"
    if check:
        _check_values(cache, batch, token_ids)
    rows, hq, d = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    if rows == 0:
        return out
    kc, vc = cache["k"], cache["v"]
    fp8 = kv_format == "fp8"
    ks, vs = (cache["k_scale"], cache["v_scale"]) if fp8 else (kc, vc)  # unread placeholders
    hkv, g = preset.num_kv_heads, preset.gqa_group
    width = token_ids.shape[1]
    kw, host, num_splits, split_blocks = _plan(kernel, table_format(kv_format, shared), rows,
                                               hkv, width, q.device, config, num_splits)
    per = kw["ROWS"]
    require(per * g <= MAX_M, f"config: ROWS {per} x GQA group {g} exceeds an MMA tile of "
                              f"{MAX_M} rows")
    units = triton.cdiv(rows, per) * hkv
    split = num_splits > 1
    bp2 = max(64, triton.next_power_of_2(batch.batch))  # one variant for batch <= 64
    gluon = host.get("impl") == sparse_gqa_gluon.IMPL
    # a row block's union is one of slots; the Gluon kernel's load warps take slots unless
    # its entry resolves the ids itself
    slots = (bool(host.get("SLOTS", 0)) or per > 1
             or (gluon and not sparse_gqa_gluon.resolves_ids(kw)))
    pdl = _use_pdl(host)
    pdl_kw = {"launch_pdl": True} if pdl else {}
    ids = row_bits = union_len = token_ids  # the union's bits and length: unread unless ROWS > 1
    if per > 1:
        # one table [blocks, n + 1]: the row bits, then the length in column n
        ids, union = row_block_union(token_ids, batch, per, kc.shape[0])
        row_bits, union_len = union[:, :-1], union[:, -1]
    elif slots:
        ids = torch.empty((rows, width), dtype=torch.int32, device=q.device)
        _slots_kernel[(rows, triton.cdiv(width, 1024))](
            token_ids, batch.block_table, batch.context_lens, batch.query_start, ids,
            batch.batch, kc.shape[0], batch.block_table.shape[1], width, token_ids.stride(0),
            batch.block_table.stride(0), PAGE=batch.block_size, BLOCK=1024, BATCH_P2=bp2,
            PDL=pdl, num_warps=4, **pdl_kw)
    if split:
        po = torch.empty((rows, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((rows, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        po = lse = out  # unread placeholders
    if gluon:
        sparse_gqa_gluon.launch(q, kc, vc, ks, vs, ids, batch, out, po, lse,
                                num_splits=num_splits, split_blocks=split_blocks, hkv=hkv, g=g,
                                fp8=fp8, qk_scale=preset.softmax_scale * LOG2E, batch_p2=bp2,
                                meta=kw, num_warps=kw["num_warps"])
    else:
        _sparse_gqa_kernel[(units * num_splits,)](
            q, kc, vc, ks, vs, ids, batch.block_table, batch.context_lens, batch.query_start,
            out, po, lse, row_bits, union_len,
            batch.batch, kc.shape[0], batch.block_table.shape[1], ids.shape[1], num_splits,
            q.stride(0), q.stride(1), ids.stride(0), batch.block_table.stride(0),
            kc.stride(0), vc.stride(0), ks.stride(0), vs.stride(0), out.stride(0), out.stride(1),
            preset.softmax_scale * LOG2E,
            HKV=hkv, G=g, D=d, BLOCK_M=max(MIN_M, triton.next_power_of_2(per * g)),
            PAGE=batch.block_size, SPLIT_BLOCKS=split_blocks,
            BATCH_P2=bp2, FP8=fp8, SPLIT=split, PREFILL=kernel == KERNEL_PREFILL, SLOTS=slots,
            PDL=pdl, RUNTIME_TRIPS=per > 1 and not common.interpreting(), **kw, **pdl_kw)
    if split:
        block_d = min(d, host.get("MERGE_BLOCK_D", d))
        _merge_kernel[(rows * hq, d // block_d)](
            po, lse, out, num_splits, out.stride(0), out.stride(1), HQ=hq, D=d,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, PDL=pdl,
            num_warps=host.get("MERGE_WARPS", kw["num_warps"]), **pdl_kw)
    return out


def sparse_gqa_decode(q: torch.Tensor, cache: dict[str, torch.Tensor], batch: PagedBatch,
                      token_ids: torch.Tensor, preset: ModelPreset, kv_format: str,
                      out: torch.Tensor | None = None, config: BlockConfig | None = None,
                      num_splits: int | None = None, check: bool | None = None,
                      shared: bool = False) -> torch.Tensor:
    """Attention of each query row over its selected token ids; returns out [rows, Hq, D].

    q [rows, Hq, D] bf16; cache 'k', 'v' [blocks, block_size, Hkv, D] bf16 or fp8 (the block dim
    may have any stride), FP8 also 'k_scale', 'v_scale' [blocks, block_size, Hkv] fp32;
    token_ids [rows, width] int32, -1 padded (any order). Rows with no valid id output zeros.
    num_splits: split the token list across this many programs (None: the config's NUM_SPLITS,
    else a rule from the SM/CU count), clamped to whole, non-empty token blocks per split (see
    `split_count`, which reports the count a launch uses). check: validate the batch, page table and every id
    against its request's context (reads device data: a sync on a GPU, illegal in graph
    capture). None checks on the CPU only. Unchecked, an id outside its context or a page
    outside the pool is skipped by the kernel, never read. shared: look the config up under
    the shared (tile-union) path's entries (`plan_sharing` decides; an explicit config's ROWS
    decides by itself).
    """
    return _launch(q, cache, batch, token_ids, preset, kv_format, out, config, num_splits,
                   check, KERNEL_DECODE, shared)


def sparse_gqa_prefill(q: torch.Tensor, cache: dict[str, torch.Tensor], batch: PagedBatch,
                       token_ids: torch.Tensor, preset: ModelPreset, kv_format: str,
                       out: torch.Tensor | None = None, config: BlockConfig | None = None,
                       num_splits: int | None = None, check: bool | None = None,
                       shared: bool = False) -> torch.Tensor:
    """Same contract as `sparse_gqa_decode`, for many rows: the prefill block config, and
    unsplit unless `num_splits` (or the config's NUM_SPLITS) asks for splits."""
    return _launch(q, cache, batch, token_ids, preset, kv_format, out, config, num_splits,
                   check, KERNEL_PREFILL, shared)


@dataclass(frozen=True)
class SharePlan:
    """The per-call choice between the per-row and the shared path, with what decided it.
    union_ratio: the call's row blocks' unions over one row's ids (1: the rows of a block
    select the same tokens, `rows`: they share none); the shared path is chosen when it is at
    most max_union_ratio, the shared entry's SHARE_MAX_UNION."""

    shared: bool
    rows: int
    union_ratio: float
    max_union_ratio: float


def plan_sharing(token_ids: torch.Tensor, batch: PagedBatch, preset: ModelPreset,
                 kv_format: str, *, prefill: bool = False) -> SharePlan:
    """Measure the union of this call's ids at the shared entry's ROWS (`qsa.overlap`, the
    same measure every results row records) and choose the path (`SharePlan`). Made before a
    call, not inside it: the measurement reads device data, which a captured graph can not."""
    kernel = KERNEL_PREFILL if prefill else KERNEL_DECODE
    rows = token_ids.shape[0]
    _, arch = common.backend_and_arch()
    entry = get_config(kernel, arch, table_format(kv_format, True), rows).config
    per = entry.meta.get("ROWS", 1)
    limit = entry.meta.get("SHARE_MAX_UNION", 0) / 100
    if per < 2 or rows < 2:
        return SharePlan(False, per, float(min(per, rows)), limit)
    ratio = overlap.union_ratio(token_ids, batch, per)
    return SharePlan(ratio <= limit, per, ratio, limit)


def work(token_ids: torch.Tensor, batch: PagedBatch, preset: ModelPreset, kv_format: str
         ) -> Work:
    """Bytes: the unique K/V rows each request reads (codes of K and V, plus both FP32 scales
    for FP8) for every KV head, q read, out written, the id lists read. FLOPs: QK and PV,
    4 * D per (row, query head, valid id)."""
    check_kv_format(kv_format)
    hkv, hq, d = preset.num_kv_heads, preset.num_q_heads, preset.head_dim
    per_token = hkv * (2 * d * (1 if kv_format == "fp8" else 2) + (8 if kv_format == "fp8" else 0))
    ids = token_ids.long()
    valid = ids >= 0
    req = batch.row_request.long().to(ids.device)
    # Unique (request, token) pairs: encode as request * stride + token over the valid ids.
    stride = int(ids.max().item()) + 1 if bool(valid.any()) else 1
    keys = (req[:, None] * stride + ids)[valid]
    unique = int(torch.unique(keys).numel())
    rows = token_ids.shape[0]
    bytes_moved = (unique * per_token + 2 * rows * hq * d * 2
                   + token_ids.numel() * token_ids.element_size())
    flops = int(valid.sum().item()) * hq * d * 4
    return Work(bytes_moved, flops)
