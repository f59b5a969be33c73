"""Where a one-page store's wall time goes: every call the store makes, wrapped with a host
clock (`perf_counter_ns`) inside real stores, and the device side of the same stores from
torch.profiler (the copy, the digest kernel, the gaps).

Why: the steps of `store_steps.py` timed alone add up to about half of a store's wall time
(2026-12-03, first call), so the missing half happens between or inside them in a real store.

    PYTHONPATH=. python3 store_trace.py OUT_DIR [--layout fp8]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.arena import digest as dg
from qsa.arena import offload as om
from qsa.kernels import page_digest as pdk
from qsa.presets import get_preset

STORES = 300
marks: list[tuple[str, str, int]] = []


def traced(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        marks.append((name, "in", time.perf_counter_ns()))
        try:
            return fn(*a, **k)
        finally:
            marks.append((name, "out", time.perf_counter_ns()))
    return wrapper


def call_table(top: str, skip: int) -> list[str]:
    """One line per call made inside the `top` calls recorded in `marks` (after the first
    `skip` of them): its median start and duration in us relative to the `top` call's start,
    indented by nesting, in order of start."""
    done, cur, stack = [], None, []
    for name, kind, t in marks:
        if name == top and kind == "in":
            cur, stack = {"_t0": t, "calls": []}, []
        elif name == top:
            done.append(cur)
        elif cur is None:
            continue
        elif kind == "in":
            stack.append((name, t))
        else:
            n, t_in = stack.pop()
            cur["calls"].append((len(stack), n, t_in - cur["_t0"], t - t_in))
    starts, durs, depth = defaultdict(list), defaultdict(list), {}
    for s in done[skip:]:
        seen = defaultdict(int)
        for d, n, st, du in s["calls"]:
            key = f"{n}#{seen[n]}"
            seen[n] += 1
            starts[key].append(st / 1e3)
            durs[key].append(du / 1e3)
            depth[key] = d
    return [f"{statistics.median(starts[k]):9.1f} {statistics.median(durs[k]):9.1f}"
            f"  {'  ' * depth[k]}{k}"
            for k in sorted(starts, key=lambda k: statistics.median(starts[k]))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layout", default="fp8")
    ap.add_argument("--pages", type=int, default=1, help="consecutive blocks per store")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a dry run
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    layout = PageLayout.for_preset(get_preset("qwen3.8-flash-next"),
                                   CacheFormats(args.layout, args.layout, torch.float8_e4m3fn))
    arena = Arena(layout, max(64, 2 * args.pages), dev)
    arena.buffer.random_(0, 256)
    arena.claim(range(max(32, args.pages)))
    off = PageOffload(arena)
    src = [3] if args.pages == 1 else list(range(args.pages))
    stores = STORES if args.pages == 1 else 60
    for _ in range(20):
        off.store(src)
    sync()
    # wrap what the store calls (instance, module and class attributes)
    arena.check_blocks = traced("check_blocks", arena.check_blocks)
    off._sources = traced("_sources", off._sources)
    off._copy_out = traced("_copy_out", off._copy_out)
    for mod, name in [(om, "_copy"), (om, "_digest"), (om, "seal"), (dg, "content_parts"),
                      (pdk, "_bound_kernel"), (pdk, "page_partial_sums")]:
        if hasattr(mod, name):
            setattr(mod, name, traced(name, getattr(mod, name)))
    if hasattr(dg, "SetKeys"):
        om.dg.SetKeys = traced("SetKeys", dg.SetKeys)
    for cls, name in [(dg.PendingSums, "__init__"), (dg.PendingSums, "result"),
                      (dg.PendingSums, "close"), (torch.cuda.Stream, "synchronize")]:
        setattr(cls, name, traced(f"{cls.__name__}.{name}", getattr(cls, name)))
    torch.cuda.current_stream = traced("current_stream", torch.cuda.current_stream)
    walls = []
    for _ in range(stores):
        marks.append(("store", "in", time.perf_counter_ns()))
        t0 = time.perf_counter()
        off.store(src)
        walls.append(time.perf_counter() - t0)
        marks.append(("store", "out", time.perf_counter_ns()))
        sync()
    lines = [f"{args.layout}: {stores} stores of {args.pages} pages, the last {stores - 20}: "
             "wall median "
             f"{statistics.median(walls[20:]) * 1e6:.1f} us (host clock, wrappers included)",
             "", "  start us    dur us  call (median over stores; indent = nesting)",
             *call_table("store", 20)]
    # the device side, unwrapped calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            off.store(src)
            sync()
    lines += ["", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"store_trace_{args.layout}" + ("" if args.pages == 1 else f"_{args.pages}p")
    prof.export_chrome_trace(str(args.out / f"{name}.json"))
    (args.out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
