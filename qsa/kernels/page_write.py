"""A restore's arena write, gated on the device by its page check; the reference is
`qsa.reference.page_write`.

Why on the device: a restore may write its staged pages only once every page's content sum
matches the sum its digest implies. Checked on the host, the arena write waits for the host to
wake after the last digest, read the sums, compare and issue the write: a host round trip
between two device operations at the end of every large restore
(profiles/nvidia-h200/offload-speed/mapped-sums/NOTES.md). Here the check and the write are
queued behind the digests while the copy still runs: one program per page adds its digest parts
and compares them with the expected sum, and the write copies only when no page differed. The
host still compares the same sums itself and requires the device's per-page verdict to agree,
so a refusal names the page as before and a disagreement can not pass unnoticed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsa.kernels.common import KernelInputError

WRITE_WORDS = 2048  # 8-byte words per write program: 16 KiB of a page
WRITE_WARPS = 4


@triton.jit
def _gate_kernel(parts_ptr, n_parts, plan_ptr, n_pages, ctl_ptr, BLOCK: tl.constexpr):
    """Program p: page p's content sum (its parts added mod 2^64) into plan[3, p], checked
    against plan[0, p]; writes plan[2, p] (1 where they differ), ctl[1 + p] = plan[1, p] (the
    page's target block) and adds the mismatch to the count ctl[0]."""
    page = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    parts = tl.load(parts_ptr + page.to(tl.int64) * n_parts + j, mask=j < n_parts, other=0)
    total = tl.sum(parts.to(tl.uint64, bitcast=True), axis=0)
    bad = (total != tl.load(plan_ptr + page).to(tl.uint64, bitcast=True)).to(tl.int32)
    tl.store(plan_ptr + 3 * n_pages + page, total.to(tl.int64, bitcast=True))
    tl.store(plan_ptr + 2 * n_pages + page, bad.to(tl.int64))
    tl.store(ctl_ptr + 1 + page, tl.load(plan_ptr + n_pages + page).to(tl.int32))
    tl.atomic_add(ctl_ptr, bad)


@triton.jit
def _write_kernel(staged_ptr, pages_ptr, ctl_ptr, words_per_page, BLOCK: tl.constexpr):
    """Program (p, c): words c*BLOCK.. of staged page p into its target block, when the
    count of mismatched pages ctl[0] is zero."""
    page = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = (j < words_per_page) & (tl.load(ctl_ptr) == 0)
    block = tl.load(ctl_ptr + 1 + page).to(tl.int64)
    w = tl.load(staged_ptr + page.to(tl.int64) * words_per_page + j, mask=live)
    tl.store(pages_ptr + block * words_per_page + j, w, mask=live)


def write_if_intact(staged: torch.Tensor, pages: torch.Tensor, parts: torch.Tensor,
                    plan: torch.Tensor) -> torch.cuda.Event | None:
    """Issue, on the current stream: the check of every staged page against its expected
    content sum, then the write of all of them into their target blocks, if none differed.
    Returns an event marking the end of the check on a GPU, so the host can read the verdict
    while the write still runs (None elsewhere: the interpreter runs each launch to its end).

    staged: uint8 [n, page_bytes] on the device; pages: the arena's uint8 [num_blocks,
    page_bytes] on the same device (both with contiguous rows of whole 8-byte words);
    parts: int64 [n, chunks], the digest parts of the staged pages (`qsa.kernels.page_digest`;
    on the device or in pinned host memory); plan: int64 [4, n] in pinned host memory (or on
    the device): row 0 the expected content sums (uint64 bit patterns), row 1 the target
    blocks; rows 2 and 3 written by the check: 1 where a page's sum differed, and each
    page's content sum (so the host reads n sums, not n * chunks parts). Wait for the
    returned event before reading them or dropping `plan` and `parts`. Target blocks must be
    distinct and in range (the caller checked them): the kernel does not.
    """
    n, p = _check(staged, pages, parts, plan)
    if n == 0:
        return None
    words, arena = staged.view(torch.int64), pages.view(torch.int64)
    ctl = torch.zeros(n + 1, dtype=torch.int32, device=staged.device)
    # a page's parts in one load: 144 for a 1.1 MiB page (`qsa.kernels.page_digest`)
    _gate_kernel[(n,)](parts, parts.shape[1], plan, n, ctl,
                       BLOCK=triton.next_power_of_2(parts.shape[1]), num_warps=4)
    gate = torch.cuda.current_stream(staged.device).record_event() if staged.is_cuda else None
    per_page = p // 8
    _write_kernel[(n, triton.cdiv(per_page, WRITE_WORDS))](words, arena, ctl, per_page,
                                                           BLOCK=WRITE_WORDS,
                                                           num_warps=WRITE_WARPS)
    return gate


def _check(staged: torch.Tensor, pages: torch.Tensor, parts: torch.Tensor,
           plan: torch.Tensor) -> tuple[int, int]:
    """(page count, page bytes); raises KernelInputError naming what does not fit."""
    for name, t in (("staged", staged), ("pages", pages)):
        if t.dim() != 2 or t.dtype != torch.uint8 or not t.is_contiguous() or t.shape[1] % 8:
            raise KernelInputError(f"{name}: expected contiguous uint8 [*, page_bytes] with "
                                   f"page_bytes a multiple of 8, got {t.dtype} "
                                   f"{tuple(t.shape)} strides {t.stride()}")
    n, p = staged.shape
    if pages.shape[1] != p or pages.device != staged.device:
        raise KernelInputError(f"pages: {tuple(pages.shape)} on {pages.device} does not take "
                               f"staged pages {tuple(staged.shape)} on {staged.device}")
    if parts.dim() != 2 or parts.shape[0] != n or parts.dtype != torch.int64 \
            or not parts.is_contiguous():
        raise KernelInputError(f"parts: expected contiguous int64 [{n}, chunks], got "
                               f"{parts.dtype} {tuple(parts.shape)}")
    if tuple(plan.shape) != (4, n) or plan.dtype != torch.int64 or not plan.is_contiguous():
        raise KernelInputError(f"plan: expected contiguous int64 [4, {n}], got {plan.dtype} "
                               f"{tuple(plan.shape)}")
    return n, p
