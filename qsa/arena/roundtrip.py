"""The `qsa offload-check` round trip: above both the offload and the page file, so each of
those imports only downward (`qsa.arena.page_file` builds on `qsa.arena.offload`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from qsa.arena.arena import Arena, PageLayout
from qsa.arena.fields import CacheFormats
from qsa.arena.offload import PageOffload
from qsa.arena.page_file import write_page_file
from qsa.presets import DEFAULT_PRESET, get_preset


def offload_roundtrip_check(device: torch.device | str, *,
                            preset: str = DEFAULT_PRESET, kv: str = "fp8",
                            index: str = "fp8", pages: int = 64, seed: int = 0,
                            save: str | Path | None = None) -> dict[str, Any]:
    """CLI piece: store `pages` pages of random bytes, scramble their blocks, restore them into
    other blocks, compare every byte; report the store and restore rates of the timed round
    (one round after a warm-up, so a functional check, not a benchmark). `save`: also write
    the stored set to that page file."""
    from qsa.measure.device import detect_device

    dev = torch.device(device)
    fp8 = detect_device(dev.index or 0).fp8_dtype if dev.type == "cuda" else None
    layout = PageLayout.for_preset(get_preset(preset),
                                   CacheFormats(kv, index, fp8 or torch.float8_e4m3fn))
    arena = Arena(layout, 2 * pages, dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, generator=gen,
                                     dtype=torch.uint8, device=dev))
    off = PageOffload(arena)
    src = arena.allocate(pages)
    arena.free(off.restore(off.store(src)))  # warm-up: allocators, pinned-memory cache
    original = arena.pages[src].clone()
    t0 = _now(dev)
    stored = off.store(src)
    t1 = _now(dev)
    arena.pages[src] = torch.randint(0, 256, original.shape, generator=gen, dtype=torch.uint8,
                                     device=dev)
    t2 = _now(dev)
    dst = off.restore(stored)
    t3 = _now(dev)
    same = arena.pages[dst].eq(original).all(dim=1)
    nbytes = stored.nbytes
    if save is not None:
        write_page_file(save, stored)
    return {
        "ok": bool(same.all()) and set(dst).isdisjoint(src),
        "device": str(dev), "preset": preset, "kv": kv, "index": index,
        "layout_digest": layout.digest, "page_bytes": layout.page_bytes, "pages": pages,
        "bytes": nbytes, "source_blocks": src, "restored_blocks": dst,
        "mismatched_pages": int((~same).sum()), "pinned": bool(stored.data.is_pinned()),
        "store_s": t1 - t0, "restore_s": t3 - t2,
        "store_gbps": nbytes / (t1 - t0) / 1e9, "restore_gbps": nbytes / (t3 - t2) / 1e9,
        "saved": None if save is None else str(save),
    }


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()
