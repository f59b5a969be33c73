"""Reference index scoring (spec section 2, step 3)."""

from __future__ import annotations

import torch

from qsa.formats import dequantize_index
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset


def compressed_keys(cache: dict[str, torch.Tensor], batch: PagedBatch, request: int,
                    index_format: str) -> torch.Tensor:
    """Dequantized compressed keys [ctx//4, D] of one request, in group order."""
    n = int(batch.context_lens[request]) // 4
    g = torch.arange(n, device=batch.block_table.device)
    slot = batch.slots(torch.full_like(g, request), g * 4)
    bs = batch.block_size
    blk, off = slot // bs, (slot % bs) // 4
    codes = cache["index_compressed"][blk, off, 0]
    scale = cache.get("index_compressed_scale")
    return dequantize_index(codes, None if scale is None else scale[blk, off, 0], index_format)


def visible_groups(batch: PagedBatch) -> torch.Tensor:
    """Groups each row may see: min((p+1)//4, ctx//4), [rows] int32."""
    ctx = batch.context_lens[batch.row_request.long()]
    return torch.minimum((batch.positions + 1) // 4, ctx // 4).to(torch.int32)


def score_reference(cache: dict[str, torch.Tensor], batch: PagedBatch, q_index: torch.Tensor,
                    preset: ModelPreset, index_format: str,
                    head_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [rows, max_ctx//4] FP32; groups a row can not see are -inf.

    The ReLU is per head, before the (weighted) head sum: it can not be folded into q.
    """
    rows, heads, _ = q_index.shape
    w = torch.ones(heads, device=q_index.device) if head_weights is None else head_weights.float()
    width = batch.max_context // 4
    out = torch.full((rows, width), float("-inf"), device=q_index.device)
    vis = visible_groups(batch)
    qs = batch.query_start.tolist()
    for b in range(batch.batch):
        if qs[b] == qs[b + 1]:
            continue
        kc = compressed_keys(cache, batch, b, index_format)
        q = q_index[qs[b]:qs[b + 1]].float()
        s = (torch.relu(torch.einsum("rhd,gd->rhg", q, kc)) * w[None, :, None]).sum(1)
        s = s * preset.index_scale
        g = torch.arange(kc.shape[0], device=s.device)
        s = torch.where(g[None, :] < vis[qs[b]:qs[b + 1], None], s, float("-inf"))
        out[qs[b]:qs[b + 1], :kc.shape[0]] = s
    return out
