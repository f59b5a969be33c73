"""Reference of the gated arena write (`qsa.kernels.page_write` does the same on the device):
staged pages reach their target blocks only when every page's content sum, its digest parts
added mod 2^64, equals the sum its digest implies; otherwise nothing is written.
"""

from __future__ import annotations

import torch


def write_if_intact_reference(staged: torch.Tensor, pages: torch.Tensor, parts: torch.Tensor,
                              want: torch.Tensor,
                              blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write staged [n, page_bytes] into pages[blocks] when no page differs; returns each
    page's content sum (int64 bit patterns) and its bool mismatch (parts int64 [n, chunks],
    want int64 [n] bit patterns)."""
    sums = parts.sum(dim=1)  # int64 sums wrap: the same as uint64 sums mod 2^64
    bad = sums != want
    if not bool(bad.any()):
        pages[blocks] = staged
    return sums, bad
