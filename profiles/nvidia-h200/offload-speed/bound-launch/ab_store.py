"""A store (and with --pages N > 1, a restore too) of the committed code against the new,
interleaved call by call in one process, next to plain pinned copies of the same bytes (the
order rotated every round), so that the host's speed, which moves by up to 2x between runs on
the H200's host (`../host-time/NOTES.md`), moves them all alike. One page: a store against a
copy with its wait; N pages (consecutive blocks): store and restore against the copy of their
direction, as a percentage of it (a restore waited for until its pages are in the arena).

The committed `qsa/` of OLD_TREE is loaded as the package `qsa_old` (a copy whose imports are
renamed), beside this checkout's `qsa`.

    PYTHONPATH=. python3 ab_store.py OLD_TREE OUT_DIR [--pages N] [--scattered]

--scattered: N > 1 pages from shuffled blocks into other shuffled blocks (the default
strategy then gathers and scatters), against the same copies of N consecutive pages.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CALLS = 600
IMPORT = re.compile(r"^(\s*)(from|import) qsa(\.|\s)", re.M)


def load_old(tree: Path):
    """The committed package, importable as `qsa_old`."""
    root = Path(tempfile.mkdtemp())
    shutil.copytree(tree / "qsa", root / "qsa_old")
    for f in (root / "qsa_old").rglob("*.py"):
        f.write_text(IMPORT.sub(lambda m: f"{m[1]}{m[2]} qsa_old{m[3]}", f.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module("qsa_old.arena"), importlib.import_module("qsa_old.presets")


def offload(arena_mod, presets_mod, fmt: str, pages: int, scattered: bool = False):
    layout = arena_mod.PageLayout.for_preset(presets_mod.get_preset("qwen3.8-flash-next"),
                                             arena_mod.CacheFormats(fmt, fmt,
                                                                    torch.float8_e4m3fn))
    arena = arena_mod.Arena(layout, max(16, 2 * pages), torch.device("cuda"))
    arena.buffer.random_(0, 256)
    src = [3] if pages == 1 else list(range(pages))
    dst = [12] if pages == 1 else list(range(pages, 2 * pages))
    if scattered and pages > 1:
        order = torch.randperm(2 * pages, generator=torch.Generator().manual_seed(0)).tolist()
        src, dst = order[:pages], order[pages:]
    arena.claim(src)
    off = arena_mod.PageOffload(arena)
    stored = off.store(src)  # verified: the bytes, and a restore of them
    if not torch.equal(stored.data.view(pages, -1), arena.pages[src].cpu()):
        raise AssertionError("the stored bytes are not the pages")
    arena.free(off.restore(stored, dst))
    if not torch.equal(arena.pages[dst], arena.pages[src]):
        raise AssertionError("the restored pages are not the stored ones")
    return off, arena, src, dst, stored


def main() -> None:
    import qsa.arena as new_arena
    import qsa.presets as new_presets

    ap = argparse.ArgumentParser()
    ap.add_argument("old_tree", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--pages", type=int, default=1)
    ap.add_argument("--scattered", action="store_true")
    args = ap.parse_args()
    old_arena, old_presets = load_old(args.old_tree)
    n, out = args.pages, args.out
    calls_n = CALLS if n == 1 else 200
    out.mkdir(parents=True, exist_ok=True)
    lines, records = [], []
    for fmt in ("fp8", "bf16"):
        engines = {"old": offload(old_arena, old_presets, fmt, n, args.scattered),
                   "new": offload(new_arena, new_presets, fmt, n, args.scattered)}
        arena = engines["new"][1]
        dev_bytes = arena.pages[:n]
        host = torch.empty(dev_bytes.shape, dtype=torch.uint8, pin_memory=True)
        back = arena.pages[n:2 * n]

        def wait(fn):
            def call() -> None:
                fn()
                torch.cuda.current_stream().synchronize()
            return call

        calls = {"copy": wait(lambda: host.copy_(dev_bytes, non_blocking=True))}
        for name, (off, arena_e, src_e, dst_e, stored) in engines.items():
            calls[f"{name}_store"] = lambda off=off, src_e=src_e: off.store(src_e)
            if n > 1:
                calls[f"{name}_restore"] = wait(lambda off=off, a=arena_e, s=stored, d=dst_e:
                                                a.free(off.restore(s, d)))
        if n > 1:
            calls["copy_h2d"] = wait(lambda: back.copy_(host, non_blocking=True))
        times: dict[str, list[float]] = {k: [] for k in calls}
        names = list(calls)
        for i in range(calls_n + 10):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                calls[name]()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if i >= 10:
                    times[name].append((t1 - t0) * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        rec = {"layout": fmt, "pages": n, "scattered": args.scattered, "calls": calls_n,
               **{f"{k}_median_us": v for k, v in med.items()},
               **{f"{k}_p10_us": statistics.quantiles(v, n=10)[0] for k, v in times.items()},
               **{f"{k}_p90_us": statistics.quantiles(v, n=10)[-1] for k, v in times.items()}}
        for op in ("store", "restore") if n > 1 else ("store",):
            rec[f"{op}_new_over_old_paired_median"] = statistics.median(
                a / b for a, b in zip(times[f"new_{op}"], times[f"old_{op}"]))
        if n == 1:
            rec.update(new_over_copy=med["new_store"] / med["copy"],
                       old_over_copy=med["old_store"] / med["copy"])
            lines.append(f"{fmt}: copy {med['copy']:.1f} us, old store {med['old_store']:.1f} us "
                         f"({rec['old_over_copy']:.2f}x the copy), new store "
                         f"{med['new_store']:.1f} us ({rec['new_over_copy']:.2f}x); new/old "
                         f"paired median {rec['store_new_over_old_paired_median']:.3f}")
        else:
            for op, ref in (("store", "copy"), ("restore", "copy_h2d")):
                for e in ("old", "new"):
                    rec[f"{e}_{op}_pct_of_copy"] = 100 * med[ref] / med[f"{e}_{op}"]
                kind = "scattered pages" if args.scattered else "pages"
                lines.append(f"{fmt} {n} {kind} {op}: copy {med[ref]:.1f} us; old "
                             f"{med[f'old_{op}']:.1f} us ({rec[f'old_{op}_pct_of_copy']:.1f}% of "
                             f"the copy), new {med[f'new_{op}']:.1f} us "
                             f"({rec[f'new_{op}_pct_of_copy']:.1f}%); new/old paired median "
                             f"{rec[f'{op}_new_over_old_paired_median']:.3f}")
        records.append(rec)
    text = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host clock, each call "
            f"waited for, {calls_n} calls of each interleaved\n" + "\n".join(lines) + "\n")
    tag = ("" if n == 1 else f"_{n}p") + ("_scattered" if args.scattered and n > 1 else "")
    (out / f"ab_store{tag}.txt").write_text(text)
    (out / f"ab_store{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(text)


if __name__ == "__main__":
    main()
