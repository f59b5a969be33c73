"""Host time of a one-page store and restore, without the device work: on the CPU, with the
page-digest content sums replaced by zeros and a small page (a 64-dim, 8-layer preset, so the
copy is a few us), what is left is the Python between the operations, the part that decides a
one-page offload on the H200 (NOTES.md). Prints us per call (median, p10-p90).

    PYTHONPATH=TREE python3 profiles/nvidia-h200/offload-speed/host_cost.py

Run it once per tree (e.g. a `git worktree` of an earlier commit) and alternate the runs.
"""
import torch

from qsa.arena import Arena, CacheFormats, PageLayout, PageOffload
from qsa.arena import digest as dg
from qsa.measure.timing import time_fn
from qsa.presets import get_preset

layout = PageLayout.for_preset(get_preset().replace(head_dim=64, block_size=16, num_layers=8),
                               CacheFormats("fp8", "fp8", torch.float8_e4m3fn))
arena = Arena(layout, 8, torch.device("cpu"))
arena.claim(range(4))
# No device work: the sums the digests fold are zeros (both the older single-call API and the
# parts API are replaced, whichever the tree has).
dg.content_sums = lambda pages: torch.zeros(pages.shape[0], dtype=torch.int64)
dg.content_parts = lambda pages: torch.zeros((pages.shape[0], 1), dtype=torch.int64)
off = PageOffload(arena)
src, dst = [0], [4]
for _ in range(50):
    arena.free(off.restore(off.store(src), dst))


def host_us(fn) -> str:
    """The workbench's timing (`time_fn`; without a GPU, the host clock): median and p10-p90
    of the per-call time over samples of 200 calls."""
    t = time_fn(lambda i: fn(), calls_per_sample=200, samples=30)
    return f"{t.median_us:.1f} us (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f})"


stored = off.store(src)
page, host = arena.pages[:1], torch.empty_like(arena.pages[:1])
print(f"page_bytes {layout.page_bytes}: copy {host_us(lambda: host.copy_(page))}, "
      f"store {host_us(lambda: off.store(src))}, "
      f"restore + free {host_us(lambda: arena.free(off.restore(stored, dst)))}")
