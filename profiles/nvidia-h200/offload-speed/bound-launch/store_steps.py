"""Host time of a one-page store on a GPU, end to end and by step: the store's wall time, a
one-page pinned copy with its wait, the digest kernel launched through Triton's JIT path and
through the bound launcher (`qsa.kernels.page_digest`), and the set's host folds.

Why: a one-page store is host-bound (`../host-time/NOTES.md`); this measures what the bound
launcher and the folds ahead of the copy's wait save. Runs with whatever `qsa` is first on the
path, so the code before a change is timed from a copy of it in the same device call; the
steps that only the new code has are skipped for the old one.

    PYTHONPATH=. python3 store_steps.py OUT_DIR [--label new]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import qsa
from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.arena import digest as dg
from qsa.arena import offload as om
from qsa.kernels import page_digest as pdk
from qsa.presets import get_preset

CALLS = 400


def median_us(fn: Callable[[], object], after: Callable[[], object] | None) -> float:
    """Median host time of `fn` over CALLS calls after 20 warm-ups; `after` runs untimed."""
    times = []
    for i in range(CALLS + 20):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if after is not None:
            after()
        if i >= 20:
            times.append(t1 - t0)
    return statistics.median(times) * 1e6


def layout_rows(fmt: str) -> list[tuple[str, float]]:
    dev = torch.device("cuda")
    layout = PageLayout.for_preset(get_preset("qwen3.8-flash-next"),
                                   CacheFormats(fmt, fmt, torch.float8_e4m3fn))
    arena = Arena(layout, 64, dev)
    arena.buffer.random_(0, 256)
    arena.claim(range(32))
    off = PageOffload(arena)
    p, pages, sync = layout.page_bytes, arena.pages, torch.cuda.synchronize
    src = [3]
    stored = off.store(src)
    if not torch.equal(stored.data.view(1, -1), pages[3:4].cpu()):
        raise AssertionError("the stored bytes are not the page")
    host = torch.empty((1, p), dtype=torch.uint8, pin_memory=True)
    view = pages[3:4]
    words = view.view(torch.int64)
    chunks = pdk.partial_count(p)
    out = torch.empty((1, chunks), dtype=torch.int64, pin_memory=True)
    rows = [(f"{fmt}: store 1 page (wall, returns with the bytes on the host)",
             median_us(lambda: off.store(src), sync)),
            (f"{fmt}: pinned copy of 1 page + stream sync (wall)",
             median_us(lambda: (host.copy_(view, non_blocking=True),
                                torch.cuda.current_stream().synchronize()), None)),
            (f"{fmt}: digest launch, Triton JIT path",
             median_us(lambda: pdk._content_sum_kernel[(1, chunks)](
                 words, out, words.shape[1], chunks, BLOCK=pdk.BLOCK_WORDS,
                 num_warps=pdk.NUM_WARPS), sync)),
            (f"{fmt}: page_partial_sums (the offload's launch)",
             median_us(lambda: pdk.page_partial_sums(view, out), sync))]
    sums = dg.host_sums(view)
    if hasattr(dg, "SetKeys"):
        keys = dg.SetKeys(layout.digest, p, src)
        rows += [(f"{fmt}: SetKeys (while the copy runs)",
                  median_us(lambda: dg.SetKeys(layout.digest, p, src), None)),
                 (f"{fmt}: layout.summary() (while the copy runs)",
                  median_us(layout.summary, None)),
                 (f"{fmt}: seal after the wait (page digests, manifest, StoredPages)",
                  median_us(lambda: om.seal(keys, "s", host.view(-1), sums),
                            None))]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--label", default="new")
    args = ap.parse_args()
    rows = layout_rows("fp8") + layout_rows("bf16")
    lines = [f"label {args.label}; qsa from {Path(qsa.__file__).parent}; torch "
             f"{torch.__version__}; {torch.cuda.get_device_name()}; median of {CALLS} calls, "
             "host clock", ""] + [f"{us:9.1f} us  {name}" for name, us in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"store_steps_{args.label}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
