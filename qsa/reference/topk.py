"""Reference top-k selection and expansion (spec section 2, steps 4-5)."""

from __future__ import annotations

import torch

from qsa.paging import PagedBatch
from qsa.presets import ModelPreset
from qsa.reference.score import visible_groups


def select_reference(scores: torch.Tensor, visible: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top min(k, visible) groups per row; ties go to the lower group index.

    Returns (groups [rows, k] int32 in ascending group order, -1 padded; counts [rows] int32).
    The stable descending sort keeps equal scores in index order, which is the tie rule.
    """
    rows = scores.shape[0]
    counts = torch.clamp(visible, max=k).to(torch.int32)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    for r in range(rows):
        n = int(counts[r])
        if n == 0:
            continue
        v = int(visible[r])
        order = torch.sort(scores[r, :v], descending=True, stable=True).indices[:n]
        out[r, :n] = torch.sort(order).values.to(torch.int32)
    return out, counts


def expand_reference(groups: torch.Tensor, counts: torch.Tensor, positions: torch.Tensor,
                     width: int) -> torch.Tensor:
    """Token ids [rows, width]: 4 per selected group, then the incomplete tail group, -1 padded."""
    rows, k = groups.shape
    out = torch.full((rows, width), -1, dtype=torch.int32, device=groups.device)
    for r in range(rows):
        n = int(counts[r])
        toks = (groups[r, :n, None].long() * 4 + torch.arange(4, device=groups.device)).flatten()
        p = int(positions[r])
        tail = torch.arange(4 * ((p + 1) // 4), p + 1, device=groups.device)
        ids = torch.cat((toks, tail))
        if ids.numel() > width:
            raise ValueError(f"expand: {ids.numel()} ids do not fit width {width}")
        out[r, :ids.numel()] = ids.to(torch.int32)
    return out


def topk_expand_reference(scores: torch.Tensor, batch: PagedBatch, preset: ModelPreset
                          ) -> torch.Tensor:
    groups, counts = select_reference(scores, visible_groups(batch), preset.topk_groups)
    return expand_reference(groups, counts, batch.positions, preset.expand_width)
