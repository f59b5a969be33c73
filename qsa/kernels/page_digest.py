"""Content sums of page digests (`qsa.arena.digest`) in one pass over the pages; the
reference is `qsa.reference.page_digest`.

The torch reference takes a dozen elementwise passes over int64 temporaries; this kernel reads
each byte once, mixes it in registers and writes one partial sum per (page, chunk), so digesting
a page set costs about one read of it at HBM speed, small next to the host copy it guards.
Words and keys are unsigned 64-bit here: `>>` is a logical shift and products wrap mod 2^64,
exactly as `qsa.arena.digest.fmix64_array` on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.reference import page_digest as ref

BLOCK_WORDS = 1024  # words per program: 8 KiB of a page
NUM_WARPS = 4
_C1 = tl.constexpr(ref.C1)
_C2 = tl.constexpr(ref.C2)
_GOLDEN = tl.constexpr(ref.GOLDEN)
_SEED = tl.constexpr(ref.SEED)


@triton.jit
def _fmix(x):
    x = x ^ (x >> 33)
    x = x * _C1
    x = x ^ (x >> 33)
    x = x * _C2
    return x ^ (x >> 33)


@triton.jit
def _content_sum_kernel(words_ptr, out_ptr, words_per_page, n_chunks,
                        BLOCK: tl.constexpr):
    page = tl.program_id(0)
    chunk = tl.program_id(1)
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    live = j < words_per_page
    w = tl.load(words_ptr + page.to(tl.int64) * words_per_page + j, mask=live, other=0)
    key = _fmix(j.to(tl.uint64) * _GOLDEN + _SEED)
    h = tl.where(live, _fmix(w.to(tl.uint64, bitcast=True) ^ key), 0)
    tl.store(out_ptr + page.to(tl.int64) * n_chunks + chunk,
             tl.sum(h, axis=0).to(tl.int64, bitcast=True))


def page_content_sums(pages: torch.Tensor) -> torch.Tensor:
    """int64 [n] content sums of pages [n, page_bytes] uint8 with contiguous rows."""
    return page_partial_sums(pages).sum(dim=1)  # int64 sums wrap: the same as one sum mod 2^64


def partial_count(page_bytes: int) -> int:
    """How many partial sums `page_partial_sums` gives a page of `page_bytes`."""
    return triton.cdiv(page_bytes // 8, BLOCK_WORDS)


def page_partial_sums(pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [n, chunks]: each page's content sum in parts (one per program), whose sum mod
    2^64 is the page's. A caller that reads the sums on the host adds the parts there, which
    saves a reduction launch (host time decides a small offload). `out` may be pinned host
    memory, which the kernel then writes directly (mapped memory: no copy call, and nothing
    waits behind a bulk copy on the copy engine)."""
    if pages.dim() != 2 or pages.dtype != torch.uint8 or pages.stride(1) != 1 \
            or pages.shape[1] % 8:
        raise ValueError(f"pages: expected uint8 [n, page_bytes] with contiguous rows and "
                         f"page_bytes a multiple of 8, got {pages.dtype} "
                         f"{tuple(pages.shape)} strides {pages.stride()}")
    words = pages.contiguous().view(torch.int64)
    n, per_page = words.shape
    chunks = partial_count(pages.shape[1])
    shape = (n, chunks)
    if out is None:
        out = torch.empty(shape, dtype=torch.int64, device=pages.device)
    elif (tuple(out.shape) != shape or out.dtype != torch.int64 or not out.is_contiguous()
          or not (out.device == pages.device or (pages.is_cuda and out.is_pinned()))):
        where = "pinned host memory" if out.is_pinned() else str(out.device)
        raise ValueError(f"out: expected contiguous int64 {list(shape)} on {pages.device} or, "
                         f"for GPU pages, in pinned host memory; got {out.dtype} "
                         f"{tuple(out.shape)} in {where}")
    if n:
        _content_sum_kernel[(n, chunks)](words, out, per_page, chunks, BLOCK=BLOCK_WORDS,
                                         num_warps=NUM_WARPS)
    return out
