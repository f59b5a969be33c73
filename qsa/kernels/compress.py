"""Index-key compress: mean-pool 4 raw keys, RMSNorm, RoPE, quantize, store (spec section 2.2).

Why the kernel looks the way it does:
* The (request, group) work list is built inside every program from `context_lens` and
  `start_positions` (a cumulative sum over the batch), so a call needs no host sync and no extra
  launch, and the grid is a fixed persistent grid that strides over tiles of `GROUPS` groups.
  A 16K-token prefill and a 64-request verify use the same kernel and are both load-balanced.
* Page sizes are multiples of 4, so the 4 tokens of a group share one page: one page-table load
  per group. A group whose first tokens were written by an earlier prefill chunk reads them from
  the raw-key cache like any other, so chunking never changes a compressed key.
* Every rounding the spec names is done with integer bit operations, identical on NVIDIA, AMD and
  the interpreter: the BF16 rounding of the mean (RNE on the FP32 bits; the interpreter's cast
  truncates), the MXFP4 exponent (ceil, from the amax bits) and the E2M1 codes (RNE on the grid).
  FP8 codes use the hardware RNE cast after an IEEE division by the row scale (`div_rn`, as torch
  divides), clamped to the format's max.
* What can differ from the float32 reference is FP32 noise a few ulp wide: the sum order of the
  RMS reduction, the `cos`/`sin` implementations and FMA contraction in the rotation. A stored
  code can therefore differ from the reference's only where the reference key lies within that
  noise of a rounding boundary (the tests check exactly that rule).

Config (`compress.json`, bucketed by the pass's query rows): meta GROUPS (groups per tile) and
PROGRAMS (the persistent grid; programs without work exit after the prefix sum).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.formats import FP8_DTYPES, FormatError, check_index_format, fp8_max, index_layout
from qsa.kernels.common import (KernelInputError, check_index_planes, data_checks_enabled,
                                interpreting, kernel_repr, lookup, require, require_dtype,
                                require_inner_contiguous)
from qsa.measure.work import Work
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset

KERNEL = "compress"
# The in-kernel prefix sum over the batch holds one lane per request.
MAX_BATCH = 4096
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------------
# Jitted helpers (the quantizers are also exercised on their own by the tests)
# ------------------------------------------------------------------------------------------------

@triton.jit
def _round_bf16(x):
    """FP32 -> nearest-even BF16 value, as FP32, by integer math (finite inputs)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_encode(y, FP8_MAX: tl.constexpr):
    """Rows of y [G, D] -> (codes as clamped FP32 values [G, D], FP32 scales [G]).

    scale = amax / fp8_max and codes = x / scale, both IEEE divisions as torch divides (Triton's
    `/` may be approximate); a zero row, or one whose scale underflows, gets scale 1 and zero
    codes. The caller casts the codes to the FP8 dtype (hardware RNE).
    """
    scale = tl.div_rn(tl.max(tl.abs(y), axis=1), FP8_MAX)
    zero = scale == 0.0
    scale = tl.where(zero, 1.0, scale)
    q = tl.div_rn(y, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    q = tl.where(zero[:, None], 0.0, q)
    return q, scale


@triton.jit
def _mxfp4_encode(y, G: tl.constexpr, D: tl.constexpr):
    """Rows of y [G, D] -> (packed E2M1 bytes [G, D/2] int32, E8M0 bytes [G, D/32] int32).

    All integer math on the FP32 bits, so it is exact everywhere:
    * e = ceil(log2(amax / 6)): with amax = 1.m * 2^E, amax <= 6 * 2^e iff e >= E - 2 when
      1.m <= 1.5, else e >= E - 1; stored as e + 127, clamped at 0 (zero or tiny groups).
    * y / 2^e is held exactly as an integer Y in units of 2^-25 (|y / 2^e| <= 6 needs < 2^28);
      values below 2^-2 are code 0. The E2M1 code counts the grid midpoints below Y, taking a
      midpoint itself only toward the even code (RNE). Zero magnitude stores +0.
    """
    NG: tl.constexpr = D // 32
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    amax = tl.max(tl.reshape(mag, [G, NG, 32]), axis=2)  # [G, NG]: FP32 order == int order
    ebyte = tl.maximum((amax >> 23) - 2 + ((amax & 0x7FFFFF) > 0x400000).to(tl.int32), 0)
    eb = tl.reshape(tl.broadcast_to(ebyte[:, :, None], [G, NG, 32]), [G, D])
    ex = mag >> 23
    sig = (mag & 0x7FFFFF) | tl.where(ex > 0, 0x800000, 0)
    k = tl.maximum(ex, 1) - eb  # y / 2^e = sig * 2^(k - 23)
    big = tl.where(k >= -2, sig << tl.minimum(tl.maximum(k + 2, 0), 4), 0)
    Q: tl.constexpr = 8388608  # 0.25 in units of 2^-25
    code = ((big > Q).to(tl.int32) + (big >= 3 * Q).to(tl.int32) + (big > 5 * Q).to(tl.int32)
            + (big >= 7 * Q).to(tl.int32) + (big > 10 * Q).to(tl.int32)
            + (big >= 14 * Q).to(tl.int32) + (big > 20 * Q).to(tl.int32))
    nib = code | tl.where((bits < 0) & (code > 0), 8, 0)
    lo, hi = tl.split(tl.reshape(nib, [G, D // 2, 2]))
    return lo | (hi << 4), ebyte


@triton.jit(repr=kernel_repr(KERNEL, ("FMT", "GROUPS", "PROGRAMS", "D")))
def _compress_kernel(raw_ptr, raw_s0, out_ptr, out_s0, scale_ptr, scale_s0, bt_ptr, bt_s0,
                     max_pages, ctx_ptr, start_ptr, weight_ptr, inv_freq_ptr, batch, num_blocks,
                     eps,
                     D: tl.constexpr, ROPE_HALF: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_B: tl.constexpr, FMT: tl.constexpr, FP8_MAX: tl.constexpr,
                     GROUPS: tl.constexpr, PROGRAMS: tl.constexpr):
    # Work list: request r owns groups [start_r // 4, ctx_r // 4), laid end to end.
    b = tl.arange(0, BLOCK_B)
    in_batch = b < batch
    ctx = tl.load(ctx_ptr + b, mask=in_batch, other=0)
    first = tl.maximum(tl.load(start_ptr + b, mask=in_batch, other=0), 0) // 4
    count = tl.maximum(ctx // 4 - first, 0)
    end = tl.cumsum(count, 0)
    total = tl.sum(count)
    shift = first - (end - count)  # group = work item + shift of its request

    d = tl.arange(0, D)
    partner = tl.where(d < ROPE_HALF, d + ROPE_HALF, tl.where(d < 2 * ROPE_HALF, d - ROPE_HALF, d))
    one_w = 1.0 + tl.load(weight_ptr + d).to(tl.float32)
    one_wp = 1.0 + tl.load(weight_ptr + partner).to(tl.float32)
    rot = d < 2 * ROPE_HALF
    inv_freq = tl.load(inv_freq_ptr + d % ROPE_HALF, mask=rot, other=0.0)
    sign = tl.where(d < ROPE_HALF, -1.0, 1.0)

    tile = tl.program_id(0) * GROUPS
    while tile < total:  # a while loop: the interpreter can not range() over a device value
        item = tile + tl.arange(0, GROUPS)
        tile += PROGRAMS * GROUPS
        req = tl.sum((end[None, :] <= item[:, None]).to(tl.int32), axis=1)
        grp = item + tl.sum(tl.where(b[None, :] == req[:, None], shift[None, :], 0), axis=1)
        tok = grp * 4
        page = tok // PAGE
        blk = tl.load(bt_ptr + req * bt_s0 + page, mask=(item < total) & (page < max_pages),
                      other=-1)
        ok = (item < total) & (blk >= 0) & (blk < num_blocks)
        blk64 = blk.to(tl.int64)
        row = blk64 * raw_s0 + (tok % PAGE) * D  # first raw key of the group
        m2 = ok[:, None]

        # Mean of the 4 raw keys in FP32 (the reference's summation order), rounded to BF16;
        # the rotation partner of every dim is pooled the same way.
        x = tl.load(raw_ptr + row[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        xp = tl.load(raw_ptr + row[:, None] + partner[None, :], mask=m2, other=0.0).to(tl.float32)
        for t in tl.static_range(1, 4):
            x += tl.load(raw_ptr + row[:, None] + t * D + d[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            xp += tl.load(raw_ptr + row[:, None] + t * D + partner[None, :], mask=m2,
                          other=0.0).to(tl.float32)
        x = _round_bf16(x * 0.25)
        xp = _round_bf16(xp * 0.25)

        ms = tl.sum(x * x, axis=1) * (1.0 / D) + eps
        r = tl.div_rn(1.0, tl.sqrt_rn(ms))  # IEEE, as torch divides (`/` may be approximate)
        y = x * r[:, None] * one_w[None, :]
        yp = xp * r[:, None] * one_wp[None, :]
        ang = tok.to(tl.float32)[:, None] * inv_freq[None, :]
        y = tl.where(rot[None, :], y * tl.cos(ang) + sign[None, :] * yp * tl.sin(ang), y)

        slot = (tok % PAGE) // 4
        if FMT == "bf16":
            dst = out_ptr + blk64[:, None] * out_s0 + slot[:, None] * D + d[None, :]
            tl.store(dst, _round_bf16(y).to(out_ptr.dtype.element_ty), mask=m2)
        elif FMT == "fp8":
            q, s = _fp8_encode(y, FP8_MAX)
            dst = out_ptr + blk64[:, None] * out_s0 + slot[:, None] * D + d[None, :]
            tl.store(dst, q.to(out_ptr.dtype.element_ty), mask=m2)
            tl.store(scale_ptr + blk64 * scale_s0 + slot, s, mask=ok)
        else:
            packed, ebyte = _mxfp4_encode(y, GROUPS, D)
            h = tl.arange(0, D // 2)
            dst = out_ptr + blk64[:, None] * out_s0 + slot[:, None] * (D // 2) + h[None, :]
            tl.store(dst, packed.to(tl.uint8), mask=m2)
            j = tl.arange(0, D // 32)
            sdst = scale_ptr + blk64[:, None] * scale_s0 + slot[:, None] * (D // 32) + j[None, :]
            tl.store(sdst, ebyte.to(tl.uint8), mask=m2)


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------

def _bf16_storage() -> tuple[torch.dtype, ...]:
    """BF16 fields (raw keys, BF16 compressed keys); fp32 only as the interpreter's surrogate
    (tests/support.py): the kernel loads and converts, so it is dtype-generic."""
    return (torch.bfloat16, torch.float32) if interpreting() else (torch.bfloat16,)


def _check_format_tensors(cache: dict[str, torch.Tensor], preset: ModelPreset,
                          index_format: str) -> tuple[torch.Tensor, torch.Tensor,
                                                      torch.Tensor | None, float]:
    """(raw keys, codes, scale plane or None, FP8 max or 0) after checking the cache fields."""
    for name in ("index_raw", "index_compressed"):
        require(name in cache, f"cache: missing field {name!r} (has {', '.join(cache)})")
    raw, out = cache["index_raw"], cache["index_compressed"]
    d, bs = preset.index_dim, preset.block_size
    require(raw.dim() == 4 and tuple(raw.shape[1:]) == (bs, 1, d),
            f"index_raw: shape {tuple(raw.shape)} is not [blocks, {bs}, 1, {d}]")
    require_dtype(raw, "index_raw", _bf16_storage())
    require_inner_contiguous(raw, "index_raw", 3)
    out, scale = check_index_planes(cache, index_format, d, bs)
    require(out.shape[0] == raw.shape[0], f"index_compressed: {out.shape[0]} blocks, index_raw "
            f"has {raw.shape[0]}")
    fmax = fp8_max(out.dtype) if index_format == "fp8" else 0.0
    return raw, out, scale, fmax


def _check_batch(batch: PagedBatch, start_positions: torch.Tensor, num_blocks: int,
                 preset: ModelPreset, device: torch.device) -> None:
    require(batch.block_size == preset.block_size,
            f"batch.block_size {batch.block_size} != preset block_size {preset.block_size}")
    for name, t in (("block_table", batch.block_table), ("context_lens", batch.context_lens),
                    ("start_positions", start_positions)):
        require_dtype(t, name, (torch.int32,))
        require(t.device == device, f"{name}: on {t.device}, the cache is on {device}")
    require(batch.block_table.dim() == 2 and batch.block_table.stride(1) == 1,
            "block_table: must be 2-D with contiguous rows")
    require(batch.context_lens.dim() == 1 and batch.context_lens.is_contiguous(),
            "context_lens: must be a contiguous 1-D tensor")
    require(tuple(start_positions.shape) == (batch.batch,) and start_positions.is_contiguous(),
            f"start_positions: shape {tuple(start_positions.shape)} is not [{batch.batch}] "
            "contiguous")
    require(batch.block_table.shape[0] == batch.batch,
            f"block_table: {batch.block_table.shape[0]} rows for {batch.batch} requests")
    require(batch.batch <= MAX_BATCH, f"batch: {batch.batch} requests, at most {MAX_BATCH}")
    if not data_checks_enabled() or batch.batch == 0:
        return
    bt, bs = batch.block_table, batch.block_size
    start, ctx = start_positions.long(), batch.context_lens.long()
    first_page = (start.clamp(min=0) // 4 * 4) // bs
    end_page = (ctx // 4 * 4 + bs - 1) // bs  # pages holding a completed group
    cols = torch.arange(bt.shape[1], device=bt.device)
    touched = (cols[None, :] >= first_page[:, None]) & (cols[None, :] < end_page[:, None])
    bad_page = touched & ((bt < 0) | (bt >= num_blocks))
    stats = torch.stack((bad_page.any(), (start < 0).any(), (end_page > bt.shape[1]).any()))
    bad_page_any, neg_start, short_table = stats.tolist()
    require(not neg_start, "start_positions: negative start position")
    require(not short_table, f"block_table: {bt.shape[1]} columns, a context needs more pages")
    if bad_page_any:
        r, c = (int(v) for v in bad_page.nonzero()[0])
        raise KernelInputError(f"block_table[{r}, {c}] = {int(bt[r, c])} points outside the pool "
                               f"of {num_blocks} blocks")


def compress_index_keys(cache: dict[str, torch.Tensor], batch: PagedBatch,
                        start_positions: torch.Tensor, rms_weight: torch.Tensor,
                        inv_freq: torch.Tensor, preset: ModelPreset, index_format: str,
                        config: BlockConfig | None = None) -> None:
    """Compress every group this pass completes (`start // 4 <= g < ctx // 4` per request) into
    `cache["index_compressed"]` (and its scale plane), in place; matches
    `qsa.reference.compress.compress_reference`. `inv_freq` comes from `rope_inv_freq(preset)`.
    The FP8 dtype is the compressed field's dtype (e4m3fn or e4m3fnuz)."""
    try:
        check_index_format(index_format)
    except FormatError as e:
        raise KernelInputError(str(e)) from None
    raw, out, scale, fmax = _check_format_tensors(cache, preset, index_format)
    dev = raw.device
    for name, t in (("index_compressed", out), ("index_compressed_scale", scale)):
        if t is not None:
            require(t.device == dev, f"{name}: on {t.device}, index_raw is on {dev}")
    d, half = preset.index_dim, preset.rope_dims // 2
    require(tuple(rms_weight.shape) == (d,) and rms_weight.is_contiguous()
            and rms_weight.device == dev, f"rms_weight: must be a contiguous [{d}] tensor on {dev}")
    require_dtype(rms_weight, "rms_weight", _WEIGHT_DTYPES)
    require(tuple(inv_freq.shape) == (half,) and inv_freq.is_contiguous()
            and inv_freq.device == dev, f"inv_freq: must be a contiguous [{half}] tensor on {dev}")
    require_dtype(inv_freq, "inv_freq", (torch.float32,))
    _check_batch(batch, start_positions, raw.shape[0], preset, dev)
    if batch.batch == 0:
        return
    cfg, kw = lookup(KERNEL, index_format, batch.num_rows, config)
    programs = cfg.meta["PROGRAMS"]
    _compress_kernel[(programs,)](
        raw, raw.stride(0), out, out.stride(0), scale, 0 if scale is None else scale.stride(0),
        batch.block_table, batch.block_table.stride(0), batch.block_table.shape[1],
        batch.context_lens, start_positions,
        rms_weight, inv_freq, batch.batch, raw.shape[0], preset.rms_eps,
        D=d, ROPE_HALF=half, PAGE=batch.block_size,
        BLOCK_B=triton.next_power_of_2(max(batch.batch, 2)), FMT=index_format, FP8_MAX=fmax, **kw)


def work(preset: ModelPreset, index_format: str, groups: int) -> Work:
    """Bytes and FLOPs of compressing `groups` groups: 4 raw BF16 keys read and one stored key
    (codes + scale plane) written per group, plus its page-table entry; FLOPs of the mean (4/dim),
    RMSNorm (3/dim), rotation (3 per rotated dim) and quantization (2/dim)."""
    d = preset.index_dim
    stored = index_layout(index_format, d, FP8_DTYPES[0]).bytes_per_row
    per_group_bytes = 4 * 2 * d + stored + 4
    per_group_flops = 4 * d + 3 * d + 3 * preset.rope_dims + 2 * d
    return Work(bytes_moved=groups * per_group_bytes, flops=groups * per_group_flops)
