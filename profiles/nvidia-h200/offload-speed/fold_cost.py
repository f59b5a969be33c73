"""Host cost of the digest folds of one store (seal) and one restore check, for 1 and 64 pages,
on whatever CPU runs it (no GPU): the page digests from content sums, and the manifest.
(`fold_cost.txt` was taken on the code of its time; the calls follow the current API.)

    PYTHONPATH=. python3 profiles/nvidia-h200/offload-speed/fold_cost.py
"""
import time

import numpy as np
import torch

from qsa.arena import digest as dg
from qsa.arena import offload as of

REPS = 2000
for n in (1, 64):
    sums = torch.randint(-2**62, 2**62, (n,), dtype=torch.int64).numpy().view(np.uint64)
    data = torch.zeros(n * 8, dtype=torch.uint8)
    t0 = time.perf_counter()
    for _ in range(REPS):
        s = of.seal("layout" * 8, "summary", 8, data, sums, list(range(n)))
    seal_us = (time.perf_counter() - t0) / REPS * 1e6
    want = dg.as_uint64(s.digests)
    t0 = time.perf_counter()
    for _ in range(REPS):
        dg.page_digests(sums, s.layout_digest, s.set_id)
        dg.manifest_digest(s.layout_digest, s.set_id, s.page_bytes, want, s.source_blocks)
    check_us = (time.perf_counter() - t0) / REPS * 1e6
    print(f"{n:3d} pages: seal {seal_us:6.1f} us, restore check folds {check_us:6.1f} us")
