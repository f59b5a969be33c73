"""Host time of a one-page offload on a GPU: store and restore wall times, the host cost of
each step they take (timed alone), and a cProfile of the calls.

Why: a one-page store is host-bound (`../mapped-sums/NOTES.md`: its copy and digest take
about 30 us of a 190-310 us call), so what decides it is which host steps cost what. Runs
with whatever `qsa` is first on the path, so the code before a change can be timed from a
copy of it in the same device call.

    PYTHONPATH=. python3 host_time.py OUT_DIR [--label new] [--layout fp8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import qsa
from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.arena import digest as dg
from qsa.arena import offload as om
from qsa.presets import get_preset

CALLS = 400


def median_us(fn: Callable[[], object], calls: int = CALLS,
              after: Callable[[], object] | None = None) -> float:
    """Median host time of `fn` (after a warm-up); `after` runs untimed after each call."""
    times = []
    for i in range(calls + 20):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if after is not None:
            after()
        if i >= 20:
            times.append(t1 - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--label", default="new")
    ap.add_argument("--layout", default="fp8", choices=("fp8", "bf16"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    fmt = args.layout
    layout = PageLayout.for_preset(get_preset("qwen3.8-flash-next"),
                                   CacheFormats(fmt, fmt, torch.float8_e4m3fn))
    arena = Arena(layout, 64, dev)
    arena.buffer.random_(0, 256)
    arena.claim(range(32))
    off = PageOffload(arena)
    p = layout.page_bytes
    pages = arena.pages
    sync = torch.cuda.synchronize
    rows: list[tuple[str, float]] = []

    def step(name: str, fn: Callable[[], object], after: Callable[[], object] = sync) -> None:
        rows.append((name, median_us(fn, after=after)))

    src = [3]
    stored = off.store(src)
    step("store 1 page (wall, returns with the bytes on the host)", lambda: off.store(src))
    step("restore 1 page + free (wall)", lambda: arena.free(off.restore(stored, [40])))
    ids = arena.check_blocks(src, state="allocated")
    step("arena.check_blocks([b], 'allocated')",
         lambda: arena.check_blocks(src, state="allocated"), None)
    step("_ranges(ids, 'auto')", lambda: off._ranges(ids, "auto"), None)
    step("torch.empty((1, page), pin_memory=True)",
         lambda: torch.empty((1, p), dtype=torch.uint8, pin_memory=True), None)
    host = torch.empty((1, p), dtype=torch.uint8, pin_memory=True)
    view = pages[3:4]
    step("pages[a:b] view", lambda: pages[3:4], None)
    step("host.copy_(page, non_blocking=True) issue", lambda: host.copy_(view, non_blocking=True))
    main_s = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    step("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(dev), None)
    step("stream.record_event()", lambda: main_s.record_event(), None)
    ev = main_s.record_event()
    step("side.wait_event(ev)", lambda: side.wait_event(ev))
    step("side.wait_stream(main)", lambda: main_s.wait_stream(side))

    def ctx() -> None:
        with torch.cuda.stream(side):
            pass

    step("with torch.cuda.stream(side): pass", ctx, None)
    step("dg.PendingSums(1, page, cuda)", lambda: dg.PendingSums(1, p, dev), None)
    pend = dg.PendingSums(1, p, dev)
    step("PendingSums.add: digest kernel launch into pinned memory", lambda: pend.add(view, 0))
    step("PendingSums.close() (records an event)", lambda: pend.close(), None)
    pend.close()
    sync()
    step("PendingSums.result() on finished work", lambda: pend.result(), None)
    done = main_s.record_event()
    sync()
    step("event.synchronize() on a finished event", lambda: done.synchronize(), None)
    sums = pend.result()
    step("seal (set id, page digests, manifest)",
         lambda: om.seal(layout.digest, layout.summary(), p, host.view(-1), sums, [3]), None)
    step("manifest_holds(stored)", lambda: om.manifest_holds(stored), None)
    step("expected_sums(digests)",
         lambda: dg.expected_sums(dg.as_uint64(stored.digests), stored.layout_digest,
                                  stored.set_id), None)
    step("arena.claim([b]) + arena.free([b])", lambda: arena.free(arena.claim([40])), None)
    step("torch.empty((1, page), cuda)",
         lambda: torch.empty((1, p), dtype=torch.uint8, device=dev), None)

    lines = [f"label {args.label}; qsa from {Path(qsa.__file__).parent}; layout {fmt}, page "
             f"{p} B; torch {torch.__version__}; median of {CALLS} calls, host clock", ""]
    lines += [f"{us:9.1f} us  {name}" for name, us in rows]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        off.store(src)
        arena.free(off.restore(stored, [40]))
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    text = "\n".join(lines) + "\n\ncProfile, 200 one-page stores and restores + frees, by own " \
        "time:\n" + buf.getvalue()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"host_time_{args.label}_{fmt}.txt").write_text(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
