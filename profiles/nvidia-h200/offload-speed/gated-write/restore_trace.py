"""Where a restore's wall time goes, without a profiler: every call the restore makes (and
each copy it issues), wrapped with a host clock inside real restores of N consecutive or
scattered pages, and per restore the device time of each chunk copy from CUDA events, so the
host's issue times can be set against the copy engine's schedule.

Why: under torch.profiler the host's share is inflated several times over; the interleaved
A/B (`../bound-launch/ab_store.py`) reads a 64-page FP8 restore about 300 us over a pinned
copy of its bytes, while the profiled device timeline accounts for only about 65 us after the
copy.

    PYTHONPATH=. python3 restore_trace.py OUT_DIR [--layout fp8] [--pages 64] [--scattered]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.arena import digest as dg
from qsa.arena import offload as om
from qsa.kernels import page_write as pw
from qsa.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bound-launch"))
from store_trace import call_table, marks, traced  # noqa: E402  (the store's tracing)

RESTORES = 80


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layout", default="fp8")
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--scattered", action="store_true")
    args = ap.parse_args()
    n = args.pages
    dev = torch.device("cuda")
    layout = PageLayout.for_preset(get_preset("qwen3.8-flash-next"),
                                   CacheFormats(args.layout, args.layout, torch.float8_e4m3fn))
    arena = Arena(layout, 2 * n, dev)
    arena.buffer.random_(0, 256)
    order = (torch.randperm(2 * n, generator=torch.Generator().manual_seed(0)).tolist()
             if args.scattered else list(range(2 * n)))
    src, dst = order[:n], order[n:]
    arena.claim(src)
    off = PageOffload(arena)
    stored = off.store(src)
    host = stored.data
    back = arena.pages[:n].view(-1)
    for _ in range(10):
        arena.free(off.restore(stored, dst))
    torch.cuda.synchronize()
    copies = []
    for _ in range(30):
        t0 = time.perf_counter()
        back.copy_(host, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        copies.append((time.perf_counter() - t0) * 1e6)
    # wrap what a restore calls
    arena.check_blocks = traced("check_blocks", arena.check_blocks)
    arena.claim = traced("claim", arena.claim)
    arena.pick_free = traced("pick_free", arena.pick_free)
    for mod, name in [(om, "check_sums"), (om, "manifest_holds"), (dg, "expected_sums"),
                      (pw, "write_if_intact"), (pw, "_check")]:
        if hasattr(mod, name):
            setattr(mod, name, traced(name, getattr(mod, name)))
    for obj, name in [(off, "check_stored"), (off, "_stage"), (off, "_streams")]:
        setattr(obj, name, traced(name, getattr(obj, name)))
    for cls, name in [(dg.PendingSums, "__init__"), (dg.PendingSums, "add"),
                      (dg.PendingSums, "close"), (dg.PendingSums, "result"),
                      (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "wait_event"),
                      (torch.cuda.Stream, "record_event"), (torch.cuda.Stream, "wait_stream")]:
        setattr(cls, name, traced(f"{cls.__name__}.{name}", getattr(cls, name)))
    walls, chunk_us = [], defaultdict(list)
    real_copy = torch.Tensor.copy_
    for _ in range(RESTORES):
        events = []

        def copy_with_events(self, src_t, non_blocking=False, _events=events):
            if src_t.device.type == "cpu" and self.is_cuda:
                a = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
                out = real_copy(self, src_t, non_blocking=non_blocking)
                b = torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
                _events.append((a, b))
                return out
            return real_copy(self, src_t, non_blocking=non_blocking)

        torch.Tensor.copy_ = traced("copy_", copy_with_events)
        marks.append(("restore", "in", time.perf_counter_ns()))
        t0 = time.perf_counter()
        got = off.restore(stored, dst)
        torch.cuda.current_stream().synchronize()
        walls.append(time.perf_counter() - t0)
        marks.append(("restore", "out", time.perf_counter_ns()))
        torch.Tensor.copy_ = real_copy
        for i, (a, b) in enumerate(events):
            chunk_us[f"chunk {i} copy (device)"].append(a.elapsed_time(b) * 1e3)
            if i:
                chunk_us[f"gap before chunk {i} (device)"].append(
                    events[i - 1][1].elapsed_time(a) * 1e3)
        arena.free(got)
    kind = "scattered" if args.scattered else "consecutive"
    lines = [f"{args.layout}: {RESTORES} restores of {n} {kind} pages, the last "
             f"{RESTORES - 10}: wall median {statistics.median(walls[10:]) * 1e6:.1f} us "
             f"(host clock, wrappers and chunk events included; waited for); a pinned copy of "
             f"the same bytes with its wait: {statistics.median(copies):.1f} us",
             "", "  start us    dur us  call (median over restores; indent = nesting)",
             *call_table("restore", 10)]
    lines += ["", "device, from events around each host-to-device copy (median us):"]
    lines += [f"  {k}: {statistics.median(v):.1f}" for k, v in chunk_us.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"restore_trace_{args.layout}_{n}p_{kind}"
    (args.out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
