"""Where a page store and restore spend their time: torch.profiler over a few rounds of each,
at 1 and 64 pages, FP8 layout, consecutive and scattered blocks, next to the plain pinned copy
of the same bytes. Writes one key_averages table per case (host and device time per op) and
the wall time per call.

    PYTHONPATH=. python3 profiles/nvidia-h200/offload-speed/profile_offload.py OUT_DIR
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.presets import get_preset

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
layout = PageLayout.for_preset(get_preset(), CacheFormats("fp8", "fp8", torch.float8_e4m3fn))
arena = Arena(layout, 512, dev)
arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8, device=dev))
arena.claim(range(256))
gen = torch.Generator().manual_seed(0)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


lines = [f"page_bytes {layout.page_bytes}"]
for n in (1, 64):
    for pattern in ("consecutive", "scattered"):
        src = (list(range(n)) if pattern == "consecutive"
               else torch.randperm(256, generator=gen)[:n].tolist())
        dst = (list(range(256, 256 + n)) if pattern == "consecutive"
               else (256 + torch.randperm(256, generator=gen)[:n]).tolist())
        off = PageOffload(arena)
        host = torch.empty(n * layout.page_bytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        view = arena.pages[:n].reshape(-1)
        for _ in range(3):  # warm-up: allocators, Triton compile
            arena.free(off.restore(off.store(src), dst))
            host.copy_(view, non_blocking=True)
        sync()

        def wall(fn, reps=10):
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            return (time.perf_counter() - t0) / reps * 1e6

        copy_us = wall(lambda: host.copy_(view, non_blocking=True))
        store_us = wall(lambda: off.store(src))
        stored = off.store(src)
        restore_us = wall(lambda: arena.free(off.restore(stored, dst)))
        case = f"{n}p_{pattern}"
        lines.append(f"{case}: copy {copy_us:.1f} us, store {store_us:.1f} us, "
                     f"restore {restore_us:.1f} us (wall per call, 10 calls)")
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
            for _ in range(5):
                s = off.store(src)
                arena.free(off.restore(s, dst))
            sync()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (out / f"profile_{case}.txt").write_text(table)
        prof.export_chrome_trace(str(out / f"trace_{case}.json"))
print("\n".join(lines))
(out / "summary.txt").write_text("\n".join(lines) + "\n")
