"""K/V quantize-and-store (spec section 2 step 6, section 4): the new tokens' K and V, in one
launch, written to the paged cache at their token slots.

BF16 caches take the rows as they are. FP8 caches take E4M3 codes plus one FP32 scale per
(token, KV head) = row amax / fp8 max, the format `qsa.formats.fp8_quantize_rows` defines. Fusing
the scale, the cast and the scatter into one kernel is what keeps FP8 K/V from costing more than
a BF16 store (sglang PR #31652).

A program owns BLOCK_R (token, KV head) rows of both K and V: every row is one contiguous
`head_dim` vector in and one out, so loads and stores are full-width and the amax is a
row reduction in registers. K, V and the slots are independent loads, and the FP8 codes take
one division per row plus a residual FMA per element instead of a division per element: together
they lifted the FP8 store to its bandwidth target (profiles/nvidia-h200/bench/kv-store/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.formats import check_kv_format, fp8_max
from qsa.kernels.common import (KernelInputError, kernel_repr, kv_code_planes, kv_scale_planes,
                                lookup, require, require_dtype, require_inner_contiguous)
from qsa.measure.work import Work
from qsa.presets import ModelPreset

KERNEL = "kv_quant"
__all__ = ["KERNEL", "store_kv", "work"]


@triton.jit
def _quotient_rn(x, scale):
    """x / scale[:, None] correctly rounded in FP32, from one division per row.

    Markstein's correction: with y = RN(1/b) and q0 = RN(a * y) (within one ulp of a/b), the
    residual r = a - b * q0 is exact as an FMA and RN(q0 + r * y) = RN(a / b), provided nothing
    underflows. Rows with scale < 2^-32 are first multiplied by 2^96 on both sides (exact: a
    power of two, no overflow since |x| <= 448 * scale), which keeps y and, for every quotient
    an E4M3 code can distinguish from zero (>= 2^-11), the residual normal; smaller quotients
    round to a zero code whatever their last bits. An input of -0 gives code +0 (the residual
    FMA adds +0): the spec compares codes by value, where -0 equals +0.
    """
    lift = tl.where(scale < 2.3283064365386963e-10, 7.922816251426434e+28, 1.0)  # 2^-32, 2^96
    b = scale * lift
    y = tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), b)
    a = x * lift[:, None]
    q0 = a * y[:, None]
    r = tl.fma(-q0, b[:, None], a)
    return tl.fma(r, y[:, None], q0)


@triton.jit
def _store_rows(x, dst_ptr, dst_rows, scale_ptr, scale_offs, ok,
                D: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Encode rows x [R, D] (FP8: per-row scale, RNE codes, saturated) and store them."""
    d = tl.arange(0, D)
    x = x.to(tl.float32)
    if FP8:
        # Codes and scales equal the spec's FP32 `amax / fp8_max` and `x / scale` bit for bit
        # (torch on CUDA computes `tensor / python_scalar` as a multiply by the rounded
        # reciprocal, so the reference is run on the CPU when checking this kernel). The scale
        # is one correctly rounded division per row (div.rn); the codes are not: a div.rn per
        # element is about 8 instructions, enough to make this store instruction-bound.
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX)
        # A zero row, or one whose scale underflows (amax < fp8_max * 2^-149): scale 1. Its
        # codes x / 1 are then below the smallest E4M3 subnormal and round to (signed) zero.
        scale = tl.where(scale == 0.0, 1.0, scale)
        codes = _quotient_rn(x, scale)
        codes = tl.minimum(tl.maximum(codes, -FP8_MAX), FP8_MAX)
        tl.store(dst_ptr + dst_rows[:, None] + d[None, :],
                 codes.to(dst_ptr.dtype.element_ty), mask=ok[:, None])
        tl.store(scale_ptr + scale_offs, scale, mask=ok)
    else:
        tl.store(dst_ptr + dst_rows[:, None] + d[None, :],
                 x.to(dst_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit(repr=kernel_repr("kv_store", ["FP8", "HKV", "D", "PAGE", "BLOCK_R"]))
def _store_kv_kernel(k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                     n_rows, num_slots, stride_kt, stride_vt,
                     stride_kcb, stride_vcb, stride_ksb, stride_vsb,
                     HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_R: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, KV head) rows
    live = r < n_rows
    t = (r // HKV).to(tl.int64)
    h = r % HKV
    # K, V and the slots are three independent loads, all in flight at once: the K/V loads
    # are masked by the row count only, not by the slot, so they do not wait for it.
    d = tl.arange(0, D)
    k = tl.load(k_ptr + (t * stride_kt + h * D)[:, None] + d[None, :], mask=live[:, None],
                other=0.0)
    v = tl.load(v_ptr + (t * stride_vt + h * D)[:, None] + d[None, :], mask=live[:, None],
                other=0.0)
    slot = tl.load(slots_ptr + t, mask=live, other=-1).to(tl.int64)
    # Slots of -1 are skipped; a slot past the pool is skipped too so that a bad slot can not
    # write outside the cache (store_kv(check=True) reports it instead).
    ok = live & (slot >= 0) & (slot < num_slots)
    blk = slot // PAGE
    off = slot % PAGE
    dst = off * (HKV * D) + h * D
    sc = off * HKV + h
    _store_rows(k, kc_ptr, blk * stride_kcb + dst, ks_ptr, blk * stride_ksb + sc, ok, D, FP8,
                FP8_MAX)
    _store_rows(v, vc_ptr, blk * stride_vcb + dst, vs_ptr, blk * stride_vsb + sc, ok, D, FP8,
                FP8_MAX)


def _check(cache: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, kv_format: str) -> None:
    kc, vc = kv_code_planes(cache, kv_format)
    require(kc.dim() == 4, f"cache['k']: expected [blocks, block_size, Hkv, D], got shape "
                           f"{tuple(kc.shape)}")
    require(vc.shape == kc.shape, f"cache['v']: shape {tuple(vc.shape)} differs from "
                                  f"cache['k'] {tuple(kc.shape)}")
    require(vc.dtype == kc.dtype, f"cache['v']: dtype {vc.dtype} differs from cache['k'] "
                                  f"{kc.dtype}")
    _, _, hkv, d = kc.shape
    require(d >= 16 and d & (d - 1) == 0, f"head_dim {d}: must be a power of two >= 16")
    for name, t in (("k", k), ("v", v)):
        require(t.dim() == 3 and tuple(t.shape[1:]) == (hkv, d),
                f"{name}: expected [T, {hkv}, {d}] to match the cache, got {tuple(t.shape)}")
        require_dtype(t, name, (torch.bfloat16, torch.float16, torch.float32))
        require_inner_contiguous(t, name, 2)
        require(t.device == kc.device, f"{name}: on {t.device}, the cache is on {kc.device}")
    require(k.shape == v.shape, f"v: shape {tuple(v.shape)} differs from k {tuple(k.shape)}")
    require(slots.dim() == 1 and slots.shape[0] == k.shape[0],
            f"slots: expected [{k.shape[0]}], got {tuple(slots.shape)}")
    require_dtype(slots, "slots", (torch.int32, torch.int64))
    require(slots.device == kc.device, f"slots: on {slots.device}, the cache is on {kc.device}")
    planes = kv_scale_planes(cache, kv_format)
    for name, t in planes:
        require_inner_contiguous(t, f"cache['{name}']", t.dim() - 1)


def _check_values(cache: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> None:
    """Data-dependent checks: they read device values, so on a GPU they cost a sync."""
    num_slots = cache["k"].shape[0] * cache["k"].shape[1]
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise KernelInputError(f"slots[{i}] = {int(slots[i])} is outside the pool of "
                               f"{num_slots} slots (and not -1)")
    for name, t in (("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            raise KernelInputError(f"{name}: non-finite values can not be stored")


def store_kv(cache: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, kv_format: str, config: BlockConfig | None = None,
             check: bool | None = None) -> None:
    """Write K and V [T, Hkv, D] at token slots (block * block_size + offset) of `cache`.

    cache: 'k', 'v' [blocks, block_size, Hkv, D] (the block dim may have any stride; inner dims
    packed), plus FP32 'k_scale', 'v_scale' [blocks, block_size, Hkv] for FP8. The FP8 flavour
    (e4m3fn, or e4m3fnuz on gfx942) is the cache tensor's dtype. Slots of -1 are skipped.
    check: also verify slot range and finite input (reads device data: a sync on a GPU, and
    illegal inside graph capture). None checks on the CPU, where it is cheap, and not on a GPU;
    unchecked, a slot past the pool is skipped by the kernel rather than written.
    """
    _check(cache, slots, k, v, kv_format)
    kc, vc = cache["k"], cache["v"]
    if check is None:
        check = kc.device.type == "cpu"
    if check:
        _check_values(cache, slots, k, v)
    t = k.shape[0]
    if t == 0:
        return
    _, page, hkv, d = kc.shape
    fp8 = kv_format == "fp8"
    ks, vs = (cache["k_scale"], cache["v_scale"]) if fp8 else (kc, vc)  # unread placeholders
    _, kw = lookup(KERNEL, kv_format, t, config)
    block_r = kw.get("BLOCK_R", 0)
    require(block_r >= 1 and block_r & (block_r - 1) == 0,
            f"config: BLOCK_R {block_r} must be a power of two >= 1")
    rows = t * hkv
    grid = (triton.cdiv(rows, block_r),)
    _store_kv_kernel[grid](
        k, v, slots, kc, vc, ks, vs, rows, kc.shape[0] * page, k.stride(0), v.stride(0),
        kc.stride(0), vc.stride(0), ks.stride(0), vs.stride(0),
        HKV=hkv, D=d, PAGE=page, FP8=fp8, FP8_MAX=fp8_max(kc.dtype) if fp8 else 0.0, **kw)


def work(preset: ModelPreset, num_tokens: int, kv_format: str, in_itemsize: int = 2) -> Work:
    """Bytes the store must move: K and V rows read, codes (and FP8 scales) written, the slot
    list read. No matrix work: FLOPs 0."""
    check_kv_format(kv_format)
    elems = 2 * num_tokens * preset.num_kv_heads * preset.head_dim
    out_itemsize = 1 if kv_format == "fp8" else 2
    scales = 2 * num_tokens * preset.num_kv_heads * 4 if kv_format == "fp8" else 0
    return Work(elems * in_itemsize + elems * out_itemsize + scales + 8 * num_tokens, 0)
