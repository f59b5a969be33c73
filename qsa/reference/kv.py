"""Reference K/V quantize-and-store (spec section 2, step 6)."""

from __future__ import annotations

import torch

from qsa.formats import quantize_kv


def store_kv_reference(cache: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, kv_format: str,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
    """Write new tokens' K and V [T, Hkv, D] at token slots; slots of -1 are skipped."""
    keep = slots >= 0
    s = slots[keep].long()
    bs = cache["k"].shape[1]
    blk, off = s // bs, s % bs
    for name, x in (("k", k), ("v", v)):
        codes, scale = quantize_kv(x[keep], kv_format, fp8_dtype)
        cache[name][blk, off] = codes
        if scale is not None:
            cache[f"{name}_scale"][blk, off] = scale
