"""Content sums of page digests (`qsa.arena.digest`) in one pass over the pages; the
reference is `qsa.reference.page_digest`.

The torch reference takes a dozen elementwise passes over int64 temporaries; this kernel reads
each byte once, mixes it in registers and writes one partial sum per (page, chunk), so digesting
a page set costs about one read of it at HBM speed, small next to the host copy it guards.
Words and keys are unsigned 64-bit here: `>>` is a logical shift and products wrap mod 2^64,
exactly as `qsa.arena.digest.fmix64_array` on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from qsa.kernels.common import interpreting
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
    if out is None:
        out = torch.empty((_check_pages(pages), partial_count(pages.shape[1])),
                          dtype=torch.int64, device=pages.device)
    elif not (out.device == pages.device or (pages.is_cuda and out.is_pinned())):
        where = "pinned host memory" if out.is_pinned() else str(out.device)
        raise ValueError(f"out: expected contiguous int64 on {pages.device} or, for GPU pages, "
                         f"in pinned host memory; got {out.dtype} {tuple(out.shape)} in {where}")
    return partial_sums_into(pages, out)  # checks the pages and out's shape and dtype


def partial_sums_into(pages: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`page_partial_sums` into `out`, whose memory the caller vouches for: on the pages'
    device or pinned, which is not checked here (a pinned-memory query is a driver call, a
    few us of the host time that decides a one-page offload; `qsa.arena.digest.PendingSums`
    makes its buffer pinned). Its shape and dtype are checked."""
    n = _check_pages(pages)
    chunks = partial_count(pages.shape[1])
    if tuple(out.shape) != (n, chunks) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out: expected contiguous int64 {[n, chunks]}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if not n:
        return out
    words = pages.contiguous().view(torch.int64)
    per_page = words.shape[1]
    bound = None if interpreting() else _bound_kernel(words, out, per_page, chunks)
    if bound is None:
        _content_sum_kernel[(n, chunks)](words, out, per_page, chunks, BLOCK=BLOCK_WORDS,
                                         num_warps=NUM_WARPS)
    else:
        bound[(n, chunks, 1)](words, out, per_page, chunks, BLOCK_WORDS)
    return out


def _check_pages(pages: torch.Tensor) -> int:
    """The page count of `pages`, uint8 [n, page_bytes] with contiguous rows and whole words;
    raises ValueError otherwise."""
    if pages.dim() != 2 or pages.dtype != torch.uint8 or pages.stride(1) != 1 \
            or pages.shape[1] % 8:
        raise ValueError(f"pages: expected uint8 [n, page_bytes] with contiguous rows and "
                         f"page_bytes a multiple of 8, got {pages.dtype} "
                         f"{tuple(pages.shape)} strides {pages.stride()}")
    return pages.shape[0]


_BOUND: dict[tuple[Any, ...], Any] = {}


def _bound_kernel(words: torch.Tensor, out: torch.Tensor, per_page: int, chunks: int) -> Any:
    """The compiled kernel for these arguments, launched without Triton's per-call argument
    binding and cache lookup, which cost as much as this module's argument checks on the
    H200's host (profiles/nvidia-h200/offload-speed/bound-launch/); None where the normal
    launch must run. The key holds what Triton 3.6 specializes on for this kernel on NVIDIA:
    the device it loads the kernel on (the current one, as Triton's own launch), the two
    integers (their values), the pointers' 16-byte alignment, and the debug and
    instrumentation settings it compiles with. ROCm also specializes pointers on their
    buffer's size (32-bit buffer offsets), which this key does not hold: there the normal
    launch runs. A first call of a key compiles (or loads) through the normal path."""
    if torch.version.hip is not None:
        return None
    key = (torch.cuda.current_device(), per_page, chunks, words.data_ptr() % 16 == 0,
           out.data_ptr() % 16 == 0, knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    kernel = _BOUND.get(key)
    if kernel is None:
        kernel = _content_sum_kernel.warmup(words, out, per_page, chunks, BLOCK=BLOCK_WORDS,
                                            num_warps=NUM_WARPS, grid=(1, chunks))
        if kernel is None:  # a cache hook took the compile over: launch the normal way
            return None
        kernel = _BOUND[key] = kernel.result() if hasattr(kernel, "result") else kernel
    return kernel
