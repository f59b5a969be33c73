"""Can the SMs move a page set to pinned host memory as fast as the copy engine? A store that
gathers, copies and digests in one kernel (stores to mapped pinned memory) would need no
gather pass, no separate digest and one launch. Times, with CUDA events (median of 20, after
3 warm-ups), for 1 and 64 FP8 and BF16 pages: the pinned copy of contiguous pages
(`copy_`), and the kernel on consecutive and on random blocks for a few block sizes and warp
counts. Every kernel result is checked against the pages and the digest kernel's parts.

    PYTHONPATH=. python3 profiles/nvidia-h200/offload-speed/mapped-sums/sm_copy.py OUT.txt
"""
import sys

import torch
import triton
import triton.language as tl

from qsa.arena import Arena, CacheFormats, PageLayout
from qsa.kernels.page_digest import _fmix, _GOLDEN, _SEED, page_partial_sums
from qsa.presets import get_preset


@triton.jit
def _store_kernel(src_ptr, ids_ptr, dst_ptr, parts_ptr, words_per_page, n_chunks,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    page = tl.load(ids_ptr + i).to(tl.int64)
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    live = j < words_per_page
    w = tl.load(src_ptr + page * words_per_page + j, mask=live, other=0)
    tl.store(dst_ptr + i.to(tl.int64) * words_per_page + j, w, mask=live)
    key = _fmix(j.to(tl.uint64) * _GOLDEN + _SEED)
    h = tl.where(live, _fmix(w.to(tl.uint64, bitcast=True) ^ key), 0)
    tl.store(parts_ptr + i.to(tl.int64) * n_chunks + chunk,
             tl.sum(h, axis=0).to(tl.int64, bitcast=True))


def time_us(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


lines = []
for kv in ("fp8", "bf16"):
    layout = PageLayout.for_preset(get_preset(), CacheFormats(kv, kv))
    arena = Arena(layout, 512, "cuda")
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8, device="cuda"))
    words = arena.pages.view(torch.int64)
    wpp = words.shape[1]
    for n in (1, 64):
        host = torch.empty((n, wpp), dtype=torch.int64, pin_memory=True)
        base = time_us(lambda: host.copy_(words[100:100 + n], non_blocking=True))
        lines.append(f"{kv} {n} pages ({n * layout.page_bytes / 1e6:.1f} MB): pinned copy "
                     f"{base:.1f} us")
        for pattern in ("consecutive", "random"):
            ids = (torch.arange(100, 100 + n) if pattern == "consecutive"
                   else torch.randperm(512)[:n]).to(torch.int32).cuda()
            want = page_partial_sums(arena.pages[ids.long()])
            for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)):
                chunks = triton.cdiv(wpp, block)
                parts = torch.empty((n, chunks), dtype=torch.int64, pin_memory=True)

                def run():
                    _store_kernel[(n, chunks)](words, ids, host, parts, wpp, chunks,
                                               BLOCK=block, num_warps=warps)
                host.fill_(-1)
                run()
                torch.cuda.synchronize()
                ok = torch.equal(host.cuda(), words[ids.long()]) and torch.equal(
                    parts.sum(1), want.sum(1).cpu())
                t = time_us(run)
                lines.append(f"  {pattern:11s} BLOCK {block:5d} warps {warps:2d}: {t:8.1f} us "
                             f"= {base / t * 100:5.1f}% of the copy, verified {ok}")
        print("\n".join(lines[-12:]), flush=True)
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
