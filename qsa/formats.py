"""Numeric formats of the caches (spec section 4), as torch encode/decode functions.

These are the reference the kernels are checked against, so they favour exactness over speed:
every rounding decision is explicit, nothing saturates silently where the spec says it cannot,
and non-finite input is refused instead of being turned into NaN codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

IndexFormat = Literal["bf16", "fp8", "mxfp4"]
KVFormat = Literal["bf16", "fp8"]
INDEX_FORMATS: tuple[str, ...] = get_args(IndexFormat)
KV_FORMATS: tuple[str, ...] = get_args(KVFormat)

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
MX_GROUP = 32  # elements per E8M0 exponent
E8M0_BIAS = 127
# E2M1 magnitudes by 3-bit code (exponent bits then mantissa bit); bit 3 is the sign.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


class FormatError(ValueError):
    """Input a format can not encode (non-finite values, wrong shapes or dtypes)."""


def check_index_format(fmt: str) -> str:
    if fmt not in INDEX_FORMATS:
        raise FormatError(f"index format {fmt!r} is not one of {', '.join(INDEX_FORMATS)}")
    return fmt


def check_kv_format(fmt: str) -> str:
    if fmt not in KV_FORMATS:
        raise FormatError(f"KV format {fmt!r} is not one of {', '.join(KV_FORMATS)}")
    return fmt


def format_pairs(spec: str | list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """`bf16/bf16,fp8/fp8` (or a list of such items): (index format, KV format) pairs, each
    checked by name."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    pairs = []
    for item in (i.strip() for i in items if i and str(i).strip()):
        parts = item.split("/")
        if len(parts) != 2:
            raise FormatError(f"{item!r}: expected INDEX/KV, e.g. fp8/fp8")
        pairs.append((check_index_format(parts[0]), check_kv_format(parts[1])))
    if not pairs:
        raise FormatError(f"{spec!r}: no INDEX/KV pair")
    return pairs


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value: 448 for OCP e4m3fn, 240 for e4m3fnuz."""
    if dtype not in FP8_DTYPES:
        raise FormatError(f"{dtype} is not an FP8 E4M3 dtype ({', '.join(map(str, FP8_DTYPES))})")
    return float(torch.finfo(dtype).max)


def _require_finite(x: torch.Tensor, what: str) -> None:
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise FormatError(f"{what}: non-finite value {x[tuple(bad)].item()} at index {bad}")


# --------------------------------------------------------------------------------------------
# Per-row FP8 E4M3
# --------------------------------------------------------------------------------------------

def fp8_quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row (last dim) to E4M3 codes with one FP32 scale = amax / fp8_max.

    A zero row, or one whose scale underflows to 0, stores scale 1 and zero codes. Codes are
    round-to-nearest-even of x / scale, saturated to +-fp8_max (the division can land a hair
    above the max; torch's cast would turn that into NaN).
    """
    fmax = fp8_max(dtype)
    xf = x.float()
    _require_finite(xf, "fp8_quantize_rows")
    amax = xf.abs().amax(dim=-1)
    # Divide by a tensor: torch on CUDA turns division by a Python scalar into a multiply by its
    # rounded reciprocal, which differs from the IEEE quotient in about half of the scales.
    scale = amax / torch.full_like(amax, fmax)
    zero = scale == 0
    scale = torch.where(zero, torch.ones_like(scale), scale)
    q = (xf / scale.unsqueeze(-1)).clamp(-fmax, fmax)
    q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q)
    return q.to(dtype), scale


def fp8_dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if codes.dtype not in FP8_DTYPES:
        raise FormatError(f"fp8_dequantize_rows: codes have dtype {codes.dtype}, not FP8 E4M3")
    if scale.shape != codes.shape[:-1]:
        raise FormatError(f"fp8_dequantize_rows: scale shape {tuple(scale.shape)} does not match "
                          f"codes rows {tuple(codes.shape[:-1])}")
    return codes.float() * scale.float().unsqueeze(-1)


# --------------------------------------------------------------------------------------------
# MXFP4: E2M1 codes, two per byte (element 2i in the low nibble), one E8M0 exponent per 32
# --------------------------------------------------------------------------------------------

def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax <= 6 * 2^e, so a group never clips (round up, not the usual floor).

    Computed in float64 and corrected by exact comparisons: log2 of an FP32 division can land on
    the wrong side of an integer, and `6 * 2^e` is exact in float64. Zero groups (and groups too
    small for E8M0) take the smallest exponent, -127, which still satisfies the bound.
    """
    a = amax.double()
    safe = torch.where(a > 0, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(safe / E2M1_MAX))
    e = torch.where(a > E2M1_MAX * torch.exp2(e), e + 1, e)
    e = torch.where(a <= E2M1_MAX * torch.exp2(e - 1), e - 1, e)
    e = torch.where(a > 0, e, torch.full_like(e, -E8M0_BIAS))
    e = e.clamp(min=-E8M0_BIAS)
    if (e > 254 - E8M0_BIAS).any():
        raise FormatError("mx_exponent: group amax exceeds what an E8M0 exponent can scale")
    return e.to(torch.int32)


_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
_E2M1_MIDPOINTS = (_E2M1[1:] + _E2M1[:-1]) / 2


def e2m1_round(m: torch.Tensor) -> torch.Tensor:
    """3-bit E2M1 magnitude code of |m| <= 6, round-to-nearest, ties to the even code.

    `bucketize` counts the midpoints below m; an exact midpoint between codes i and i+1 goes up
    only when i is odd, i.e. toward the code whose mantissa bit is 0.
    """
    mm = m.double()
    mids = _E2M1_MIDPOINTS.to(mm.device)
    idx = torch.bucketize(mm, mids)
    at_mid = (idx < mids.numel()) & (mm == mids[idx.clamp(max=mids.numel() - 1)])
    return (idx + (at_mid & (idx % 2 == 1)).long()).clamp(max=7).to(torch.uint8)


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim (a multiple of 32) to packed E2M1 codes and E8M0 exponent bytes.

    Returns (codes uint8 [..., D/2], exponents uint8 [..., D/32]). A value that rounds to zero
    magnitude is stored as +0 (code 0), so codes are a function of the value alone.
    """
    d = x.shape[-1]
    if d % MX_GROUP:
        raise FormatError(f"mxfp4_quantize: last dim {d} is not a multiple of {MX_GROUP}")
    xf = x.float()
    _require_finite(xf, "mxfp4_quantize")
    g = xf.reshape(*x.shape[:-1], d // MX_GROUP, MX_GROUP)
    e = mx_exponent(g.abs().amax(-1))
    scaled = g.double() / torch.exp2(e.double()).unsqueeze(-1)
    mag = e2m1_round(scaled.abs())
    sign = ((scaled < 0) & (mag > 0)).to(torch.uint8) << 3
    nib = (mag | sign).reshape(*x.shape[:-1], d)
    packed = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return packed.contiguous(), (e + E8M0_BIAS).to(torch.uint8)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """Values of 4-bit E2M1 codes (any integer tensor holding 0..15)."""
    n = nibbles.long()
    mag = _E2M1.to(device=n.device, dtype=torch.float32)[n & 7]
    return torch.where((n & 8) != 0, -mag, mag)


def mxfp4_dequantize(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    if codes.dtype != torch.uint8 or exponents.dtype != torch.uint8:
        raise FormatError(f"mxfp4_dequantize: codes and exponents must be uint8, got "
                          f"{codes.dtype} and {exponents.dtype}")
    d = codes.shape[-1] * 2
    if exponents.shape != (*codes.shape[:-1], d // MX_GROUP):
        raise FormatError(f"mxfp4_dequantize: exponents shape {tuple(exponents.shape)} does not "
                          f"fit codes shape {tuple(codes.shape)}")
    lo, hi = codes & 15, codes >> 4
    vals = torch.stack((e2m1_decode(lo), e2m1_decode(hi)), dim=-1).reshape(*codes.shape[:-1], d)
    scale = torch.exp2(exponents.float() - E8M0_BIAS).repeat_interleave(MX_GROUP, dim=-1)
    return vals * scale


# --------------------------------------------------------------------------------------------
# Cache-level helpers: what a compressed index key or a K/V row looks like in each format
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredLayout:
    """Per-row storage of a quantized vector: code tail shape/dtype and optional scale plane."""

    code_shape: tuple[int, ...]
    code_dtype: torch.dtype
    scale_shape: tuple[int, ...] | None
    scale_dtype: torch.dtype | None

    @property
    def bytes_per_row(self) -> int:
        n = _numel(self.code_shape) * _itemsize(self.code_dtype)
        if self.scale_shape is not None:
            n += _numel(self.scale_shape) * _itemsize(self.scale_dtype)
        return n


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype | None) -> int:
    assert dtype is not None
    return torch.empty((), dtype=dtype).element_size()


def index_layout(fmt: str, dim: int, fp8_dtype: torch.dtype) -> StoredLayout:
    """Storage of one compressed index key (spec section 5: `index_compressed` and its scale)."""
    check_index_format(fmt)
    if fmt == "bf16":
        return StoredLayout((dim,), torch.bfloat16, None, None)
    if fmt == "fp8":
        fp8_max(fp8_dtype)
        return StoredLayout((dim,), fp8_dtype, (), torch.float32)
    if dim % MX_GROUP:
        raise FormatError(f"index dim {dim} is not a multiple of {MX_GROUP} (MXFP4 group)")
    return StoredLayout((dim // 2,), torch.uint8, (dim // MX_GROUP,), torch.uint8)


def kv_layout(fmt: str, head_dim: int, fp8_dtype: torch.dtype) -> StoredLayout:
    """Storage of one K or V row of one KV head."""
    check_kv_format(fmt)
    if fmt == "bf16":
        return StoredLayout((head_dim,), torch.bfloat16, None, None)
    fp8_max(fp8_dtype)
    return StoredLayout((head_dim,), fp8_dtype, (), torch.float32)


def quantize_index(x: torch.Tensor, fmt: str, fp8_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode float index keys [..., D] in `fmt`: (codes, scale plane or None)."""
    check_index_format(fmt)
    if fmt == "bf16":
        _require_finite(x, "quantize_index")
        return x.to(torch.bfloat16), None
    if fmt == "fp8":
        return fp8_quantize_rows(x, fp8_dtype)
    return mxfp4_quantize(x)


def dequantize_index(codes: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    check_index_format(fmt)
    if fmt == "bf16":
        return codes.float()
    if scale is None:
        raise FormatError(f"dequantize_index: format {fmt} needs its scale plane")
    if fmt == "fp8":
        return fp8_dequantize_rows(codes, scale)
    return mxfp4_dequantize(codes, scale)


def quantize_kv(x: torch.Tensor, fmt: str, fp8_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode K or V rows [..., head_dim]: BF16 passes through, FP8 gets a per-row FP32 scale."""
    check_kv_format(fmt)
    if fmt == "bf16":
        _require_finite(x, "quantize_kv")
        return x.to(torch.bfloat16), None
    return fp8_quantize_rows(x, fp8_dtype)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    check_kv_format(fmt)
    if fmt == "bf16":
        return codes.float()
    if scale is None:
        raise FormatError("dequantize_kv: an FP8 cache needs its scale plane")
    return fp8_dequantize_rows(codes, scale)
