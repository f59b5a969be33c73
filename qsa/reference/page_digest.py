"""Reference of the page-digest content sum (`qsa.kernels.page_digest` computes the same in
one pass): sum_j fmix64(w_j XOR k_j) mod 2^64 over the 64-bit words w_j of a page, with
k_j = fmix64(j * golden + seed), fmix64 being MurmurHash3's 64-bit finalizer. Why this
construction, and how digests bind pages to their place: `qsa.arena.digest`.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
C1 = 0xFF51AFD7ED558CCD  # MurmurHash3 fmix64 multipliers
C2 = 0xC4CEB9FE1A85EC53
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive word indices
SEED = 0x51_5341_9A6E_D16E
CHUNK_BYTES = 64 << 20  # bounds the int64 temporaries of one content-sum pass


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch needs for constants."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def fmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer elementwise on int64 bit patterns (products wrap mod
    2^64; `qsa.arena.digest.fmix64_array` is the same on the host)."""
    x = x ^ _shr(x, 33)
    x = x * _signed(C1)
    x = x ^ _shr(x, 33)
    x = x * _signed(C2)
    return x ^ _shr(x, 33)


def word_keys(page_bytes: int, device: torch.device | str) -> torch.Tensor:
    """One pseudo-random int64 key per 64-bit word of a page: fmix64(j * golden + seed)."""
    if page_bytes <= 0 or page_bytes % 8:
        raise ValueError(f"page size {page_bytes} is not a positive whole number of 64-bit "
                         "words")
    j = torch.arange(page_bytes // 8, dtype=torch.int64, device=device)
    return fmix64_tensor(j * _signed(GOLDEN) + _signed(SEED))


def content_sums_reference(pages: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`content_sums` in torch elementwise passes (any device), chunked to bound temporaries."""
    words = pages.view(torch.int64)
    out = torch.empty(words.shape[0], dtype=torch.int64, device=pages.device)
    step = max(1, CHUNK_BYTES // max(1, pages.shape[1]))
    for s in range(0, words.shape[0], step):
        out[s:s + step] = fmix64_tensor(words[s:s + step] ^ keys).sum(dim=1)
    return out
