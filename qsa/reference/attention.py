"""Reference sparse GQA (spec section 2, step 7) and the dense causal attention it must equal
when every group is selected."""

from __future__ import annotations

import torch

from qsa.formats import dequantize_kv
from qsa.paging import PagedBatch


def gather_kv(cache: dict[str, torch.Tensor], batch: PagedBatch, request: int,
              tokens: torch.Tensor, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K and V [n, Hkv, D] of one request's token positions."""
    slot = batch.slots(torch.full_like(tokens, request), tokens)
    bs = batch.block_size
    blk, off = slot // bs, slot % bs
    out = []
    for name in ("k", "v"):
        sc = cache.get(f"{name}_scale")
        out.append(dequantize_kv(cache[name][blk, off], None if sc is None else sc[blk, off],
                                 kv_format))
    return out[0], out[1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q.k * scale) @ v for q [Hq, D], k/v [n, Hkv, D]; query head h uses KV head
    h // (Hq / Hkv). FP32 throughout."""
    hq, hkv = q.shape[0], k.shape[1]
    kh = k.float().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
    vh = v.float().repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("hd,nhd->hn", q.float(), kh) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), vh)


def sparse_gqa_reference(q: torch.Tensor, cache: dict[str, torch.Tensor], batch: PagedBatch,
                         token_ids: torch.Tensor, kv_format: str, scale: float) -> torch.Tensor:
    """Output [rows, Hq, D] FP32; a row with no valid id (all -1) outputs zeros."""
    rows = q.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rr = batch.row_request.tolist()
    for r in range(rows):
        ids = token_ids[r]
        ids = ids[ids >= 0].long()
        if ids.numel() == 0:
            continue
        ctx = int(batch.context_lens[rr[r]])
        if int(ids.max()) >= ctx:
            raise ValueError(f"sparse_gqa: row {r} selects token {int(ids.max())} past its "
                             f"request's context {ctx}")
        k, v = gather_kv(cache, batch, rr[r], ids, kv_format)
        out[r] = attend(q[r], k, v, scale)
    return out


def dense_causal_reference(q: torch.Tensor, cache: dict[str, torch.Tensor], batch: PagedBatch,
                           kv_format: str, scale: float) -> torch.Tensor:
    """Every row attends to all positions <= its own: what QSA equals while visible <= top-k."""
    rows = q.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    rr = batch.row_request.tolist()
    for r in range(rows):
        toks = torch.arange(int(batch.positions[r]) + 1, device=q.device)
        k, v = gather_kv(cache, batch, rr[r], toks, kv_format)
        out[r] = attend(q[r], k, v, scale)
    return out
