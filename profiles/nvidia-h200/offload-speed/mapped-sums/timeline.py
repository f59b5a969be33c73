"""Where a store or restore (64 pages unless PAGES is given) spends the time over its copy:
torch.profiler around a few calls of each default case (BF16 and FP8 layouts; consecutive
blocks: one range; scattered: gather / scatter), and per call the device timeline relative to
the call's start on the host: each copy and kernel with its start, end and stream. Also the
wall time of a plain pinned copy of the same bytes. Writes timeline.txt and one chrome trace
per case into OUT_DIR.

    PYTHONPATH=. python3 profiles/nvidia-h200/offload-speed/mapped-sums/timeline.py OUT_DIR [PAGES]
"""
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.presets import get_preset

N, CALLS, HALF = (int(sys.argv[2]) if len(sys.argv) > 2 else 64), 4, 256
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda")
lines = []


def wall(fn, reps=10):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


for kv in ("bf16", "fp8"):
    layout = PageLayout.for_preset(get_preset(), CacheFormats(kv, kv))
    arena = Arena(layout, 2 * HALF, dev)
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8, device=dev))
    arena.claim(range(HALF))
    gen = torch.Generator().manual_seed(0)
    host = torch.empty(N * layout.page_bytes, dtype=torch.uint8, pin_memory=True)
    view = arena.pages[:N].reshape(-1)
    copy_d2h = wall(lambda: host.copy_(view, non_blocking=True))
    copy_h2d = wall(lambda: view.copy_(host, non_blocking=True))
    lines.append(f"{kv}: page_bytes {layout.page_bytes}, {N} pages = {N * layout.page_bytes / 1e6:.1f} MB;"
                 f" pinned copy d2h {copy_d2h:.1f} us, h2d {copy_h2d:.1f} us")
    for pattern in ("consecutive", "scattered"):
        src = (list(range(N)) if pattern == "consecutive"
               else torch.randperm(HALF, generator=gen)[:N].tolist())
        dst = (list(range(HALF, HALF + N)) if pattern == "consecutive"
               else (HALF + torch.randperm(HALF, generator=gen)[:N]).tolist())
        off = PageOffload(arena)
        for _ in range(3):  # warm-up: allocators, Triton compile
            arena.free(off.restore(off.store(src), dst))
        torch.cuda.synchronize()
        st = off.store(src)
        lines.append(f"  {pattern}: store {wall(lambda: off.store(src)):.1f} us, restore "
                     f"{wall(lambda: arena.free(off.restore(st, dst))):.1f} us (wall per call)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                torch.cuda.synchronize()
                with record_function("STORE"):
                    s = off.store(src)
                    torch.cuda.synchronize()
                with record_function("RESTORE"):
                    arena.free(off.restore(s, dst))
                    torch.cuda.synchronize()
        case = f"{kv}_{N}p_{pattern}"
        trace = out / f"trace_{case}.json"
        prof.export_chrome_trace(str(trace))
        ev = json.loads(trace.read_text())["traceEvents"]
        calls = [e for e in ev if e.get("name") in ("STORE", "RESTORE")
                 and e.get("cat") == "user_annotation"]
        gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        for c in sorted(calls, key=lambda e: e["ts"])[-2:]:  # the last store and restore
            t0, t1 = c["ts"], c["ts"] + c["dur"]
            lines.append(f"    {c['name']} call: {c['dur']:.1f} us on the host")
            for g in sorted((g for g in gpu if t0 <= g["ts"] <= t1), key=lambda g: g["ts"]):
                lines.append(f"      +{g['ts'] - t0:8.1f} .. +{g['ts'] + g['dur'] - t0:8.1f} us  "
                             f"stream {g['args'].get('stream')}  {g['name'][:70]}")
print("\n".join(lines))
(out / "timeline.txt").write_text("\n".join(lines) + "\n")
