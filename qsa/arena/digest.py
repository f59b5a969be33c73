"""Page digests that can not cancel, bound to the page's place in its set.

Why not a keyed sum of words (what the offload used before): flipping the top bit of two words
changes the sum by 2 * 2^63 = 0 mod 2^64, so two FP8 sign bits could flip unnoticed; and a sum
over the page alone says nothing about which page it is, so a dropped, swapped or foreign page
passed. Here each 64-bit word j of a page goes through a full avalanche mix of (word XOR a key
of j) (MurmurHash3's 64-bit finalizer: every input bit flips each output bit with probability
about 1/2) and the mixed words are summed mod 2^64. Any change inside one word, and any
reordering of words, changes the sum unless pseudo-random 64-bit values cancel, a 2^-64 event.

The content sum is then folded with the page's identity: the layout digest, the set's random id,
the number of pages in the set and the page's position in it. A page moved to another position,
a page of another set or a set with a page dropped or added gives another digest. The manifest
digest folds the count and every page digest in order, so the set itself can not be edited
consistently by accident.

This guards against corruption and misplacement, not against an adversary: the functions are
public and unkeyed. The content sums run on the pages' device as a dozen elementwise passes
over int64 words; the folds run on the host over one value per page.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

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


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer on a Python int (host side, exact)."""
    x &= MASK64
    x ^= x >> 33
    x = (x * C1) & MASK64
    x ^= x >> 33
    x = (x * C2) & MASK64
    return x ^ (x >> 33)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def fmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`fmix64` elementwise on int64 tensors (products wrap mod 2^64, as on the host)."""
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


def content_sums(pages: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_j fmix64(w_j XOR k_j) mod 2^64 of pages [n, page_bytes] uint8 (rows contiguous):
    int64 [n] on the pages' device. Integer sums wrap, so the reduction order does not matter.
    On a GPU, one pass of the Triton kernel in `qsa.kernels.page_digest`; elsewhere (and as
    that kernel's reference) `content_sums_reference`."""
    if pages.is_cuda and pages.shape[0] > 0:
        from qsa.kernels.page_digest import page_content_sums

        return page_content_sums(pages)
    return content_sums_reference(pages, keys)


def content_sums_reference(pages: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`content_sums` in torch elementwise passes (any device), chunked to bound temporaries."""
    words = pages.view(torch.int64)
    out = torch.empty(words.shape[0], dtype=torch.int64, device=pages.device)
    step = max(1, CHUNK_BYTES // max(1, pages.shape[1]))
    for s in range(0, words.shape[0], step):
        out[s:s + step] = fmix64_tensor(words[s:s + step] ^ keys).sum(dim=1)
    return out


def fold(values: Sequence[int]) -> int:
    """An order-sensitive 64-bit hash of a sequence of 64-bit values."""
    h = SEED
    for v in values:
        h = fmix64((h ^ (v & MASK64)) * GOLDEN)
    return h


def layout_word(layout_digest: str) -> int:
    """64 bits standing for a layout digest (any string) in the folds."""
    return int.from_bytes(hashlib.blake2b(layout_digest.encode(), digest_size=8).digest(), "big")


def new_set_id() -> int:
    """A random 64-bit id per stored set: a page of another set never matches this one."""
    return secrets.randbits(64)


def bind(content: int, layout_digest: str, set_id: int, count: int, position: int) -> int:
    """The digest of the page at `position` of a set of `count` pages whose content sum is
    `content`."""
    return fold((layout_word(layout_digest), set_id, count, position, content))


def page_digests(sums: torch.Tensor, layout_digest: str, set_id: int) -> list[int]:
    """Digests of every page of a set from its content sums (in set order)."""
    n = int(sums.numel())
    return [bind(int(c), layout_digest, set_id, n, i) for i, c in enumerate(sums.tolist())]


def manifest_digest(layout_digest: str, set_id: int, page_bytes: int,
                    digests: Sequence[int], source_blocks: Sequence[int]) -> int:
    """The set as a whole: layout, id, page size, count, every page digest and source block,
    in order."""
    return fold((layout_word(layout_digest), set_id, page_bytes, len(digests), *digests,
                 len(source_blocks), *source_blocks))


def as_int64(values: Sequence[int]) -> torch.Tensor:
    """64-bit patterns as an int64 tensor (how digests travel next to the data)."""
    return torch.tensor([_signed(v) for v in values], dtype=torch.int64)


def as_patterns(t: torch.Tensor) -> list[int]:
    """An int64 tensor back to unsigned 64-bit patterns."""
    return [v & MASK64 for v in t.tolist()]
