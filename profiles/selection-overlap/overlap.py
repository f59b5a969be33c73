"""How much the token selections of neighbouring query rows overlap on the workbench's own
inputs (`qsa.cases`: the index path's reference scores and top-k), which decides what a sparse
GQA kernel gains by loading each K/V tile once for a block of rows (the union of their
selections, masked per row) instead of once per row.

For blocks of R consecutive rows of one request: union / mean row width (1 = identical
selections, R = disjoint), the K/V bytes such a kernel reads relative to one program per row
(union / (R * width)), and the MMA work relative to it (R * G rows padded to the MMA M, over
the union, against 16-row tiles over each row's own ids; G = 12 query heads per KV head).
Runs on the CPU (reference path only).

    PYTHONPATH=. python3 profiles/selection-overlap/overlap.py > profiles/selection-overlap/overlap.txt
"""
import torch
import triton

from qsa.cases import CaseSpec, make_case
from qsa.presets import get_preset
from qsa.reference.score import score_reference
from qsa.reference.topk import topk_expand_reference

p = get_preset("qwen3.8-flash-next")
G = p.gqa_group


def report(label: str, ids: torch.Tensor, rows_per_request: int, blocks: tuple[int, ...]) -> None:
    print(f"\n{label}: {ids.shape[0]} rows, id width {ids.shape[1]}")
    print(f"{'R':>4} {'union/width':>12} {'K/V bytes vs per-row':>21} {'MMA work vs per-row':>20}")
    for r in blocks:
        unions, widths = [], []
        for s in range(0, ids.shape[0] - r + 1, r):
            if s // rows_per_request != (s + r - 1) // rows_per_request:
                continue  # blocks never cross requests
            blk = ids[s:s + r]
            unions.append(torch.unique(blk[blk >= 0]).numel())
            widths.append((blk >= 0).sum(1).float().mean().item())
        u = sum(unions) / len(unions)
        w = sum(widths) / len(widths)
        m = max(16, triton.next_power_of_2(r * G))
        print(f"{r:>4} {u / w:>12.2f} {u / (r * w):>21.2f} {m * u / (r * 16 * w):>20.2f}")


torch.manual_seed(0)
for batch, ctx, rows, blocks, what in ((32, 32768, 4, (2, 4), "decode step b32 x 32K, MTP 3"),
                                       (1, 16384, 4096, (2, 4, 8, 16), "prefill chunk 4096 rows at 16K")):
    spec = CaseSpec.decode(p, batch, ctx, rows, seed=0)
    case = make_case(spec, "cpu")
    scores = score_reference(case.cache, case.batch, case.q_index, p, "bf16")
    ids = topk_expand_reference(scores, case.batch, p)
    report(what, ids, rows, blocks)
