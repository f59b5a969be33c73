"""Reference index-key compression (spec section 2, steps 1-2)."""

from __future__ import annotations

import torch

from qsa.formats import quantize_index
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset


def rope_inv_freq(preset: ModelPreset) -> torch.Tensor:
    """FP32 inverse frequencies of the NeoX half-split RoPE. Computed once in float64 and handed
    to kernels as a tensor, so reference and kernels rotate by exactly the same frequencies."""
    half = preset.rope_dims // 2
    exps = torch.arange(half, dtype=torch.float64) * 2 / preset.rope_dims
    return (preset.rope_theta ** -exps).to(torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*len(inv_freq) dims of x [..., D] (NeoX pairs (i, i + half)) in FP32."""
    half = inv_freq.shape[0]
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device)
    cos, sin = torch.cos(ang), torch.sin(ang)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)` in FP32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.float())


def completed_groups(batch: PagedBatch, start_positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, group) pairs whose last token this pass writes: `start//4 <= g < ctx//4`."""
    reqs, groups = [], []
    for b in range(batch.batch):
        first, end = int(start_positions[b]) // 4, int(batch.context_lens[b]) // 4
        g = torch.arange(first, end, dtype=torch.int32)
        reqs.append(torch.full_like(g, b))
        groups.append(g)
    dev = batch.block_table.device
    if not reqs:
        return torch.empty(0, dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.int32, device=dev)
    return torch.cat(reqs).to(dev), torch.cat(groups).to(dev)


def compress_reference(cache: dict[str, torch.Tensor], batch: PagedBatch,
                       start_positions: torch.Tensor, rms_weight: torch.Tensor,
                       preset: ModelPreset, index_format: str,
                       fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Compress every group this pass completes and store it; returns the FP32 keys [n, D]
    (after norm and rotation, before quantization) of the groups in `completed_groups` order."""
    req, grp = completed_groups(batch, start_positions)
    raw = cache["index_raw"]
    bs = batch.block_size
    parts = []
    for t in range(4):
        slot = batch.slots(req, grp * 4 + t)
        parts.append(raw[slot // bs, slot % bs, 0].float())
    mean = (sum(parts) / 4).to(torch.bfloat16).float()
    normed = rms_norm(mean, rms_weight, preset.rms_eps)
    keys = apply_rope(normed, grp * 4, rope_inv_freq(preset))
    codes, scale = quantize_index(keys, index_format, fp8_dtype)
    slot = batch.slots(req, grp * 4)
    blk, off = slot // bs, (slot % bs) // 4
    cache["index_compressed"][blk, off, 0] = codes
    if scale is not None:
        cache["index_compressed_scale"][blk, off, 0] = scale
    return keys


def write_raw_keys_reference(cache: dict[str, torch.Tensor], slots: torch.Tensor,
                             raw_keys: torch.Tensor) -> None:
    """Store raw BF16 index keys [T, D] at token slots (always BF16: pooling needs them)."""
    bs = cache["index_raw"].shape[1]
    cache["index_raw"][slots // bs, slots % bs, 0] = raw_keys.to(torch.bfloat16)
