"""Graph-replay samples sized by host launch time (before) against device time (after), side by
side in one process, on the decode-sized points whose numbers moved between processes.

For each point: verify once, then time it four times, before / after / after / before, with
`time_fn`'s defaults except `calls_per_sample`: "before" passes the count the old rule gave
(1000 us divided by one pass of plain launches, i.e. by the host's launch time), "after" lets
`time_fn` size the sample from a probe graph. An empty kernel (one program, no memory) is timed
at fixed counts of calls per graph: what a graph replay costs per call with no work at all.

Usage: PYTHONPATH=. python3 profiles/nvidia-h200/timing-sizing/ab_sizing.py OUT.jsonl
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from qsa.measure import timing
from qsa.presets import DEFAULT_PRESET, as_preset
from qsa.workbench.ops import Point, prepare

POINTS = [  # op, batch, context, rows, index format, kv format, selection
    ("score_stacked", 1, 8192, 4, "bf16", "bf16", "index"),
    ("score_stacked", 1, 8192, 4, "fp8", "bf16", "index"),
    ("score_stacked", 1, 8192, 4, "mxfp4", "bf16", "index"),
    ("score_stacked", 8, 32768, 4, "bf16", "bf16", "index"),
    ("score_stacked", 8, 32768, 4, "fp8", "bf16", "index"),
    ("score_stacked", 8, 32768, 4, "mxfp4", "bf16", "index"),
    ("topk_expand", 1, 8192, 4, "bf16", "bf16", "index"),
    ("topk_expand", 32, 32768, 4, "bf16", "bf16", "index"),
    ("sparse_gqa_decode", 1, 131072, 4, "bf16", "bf16", "random"),
    ("sparse_gqa_decode", 1, 131072, 4, "bf16", "fp8", "random"),
    ("sparse_gqa_decode", 8, 131072, 4, "bf16", "bf16", "random"),
    ("sparse_gqa_decode", 8, 131072, 4, "bf16", "fp8", "random"),
    ("compress", 32, 32768, 4, "fp8", "bf16", "index"),
    ("kv_store", 32, 32768, 4, "bf16", "fp8", "index"),
    ("sparse_gqa_decode", 64, 131072, 4, "bf16", "fp8", "random"),  # a large call: unchanged
]


@triton.jit
def _empty_kernel(x_ptr, FLAG: tl.constexpr):
    if FLAG:  # never true: the kernel launches and does nothing
        tl.store(x_ptr, 0)


def _old_count(fn, n_sets: int) -> int:
    return timing.calls_for_target(timing._events_pass_us(fn, n_sets), 1000.0)


def main(out_path: str) -> None:
    preset = as_preset(DEFAULT_PRESET)
    rows = []
    x = torch.empty(1, device="cuda")
    empty = lambda i: _empty_kernel[(1,)](x, FLAG=False)  # noqa: E731
    for calls in (1, 4, 16, 64, 256, 1000):
        t = timing.time_fn(empty, calls_per_sample=calls, samples=50)
        rows.append({"point": "empty kernel", "rule": f"{calls} calls", "median_us": t.median_us,
                     "calls_per_sample": calls})
    for op, b, ctx, r, ifmt, kvfmt, sel in POINTS:
        prep = prepare(Point(op, preset, b, ctx, r, ifmt, kvfmt, 0, sel))
        prep.check(None)
        fn = lambda i: prep.call(i, None)  # noqa: E731
        kw = {"bytes_per_set": prep.bytes_per_set}
        name = f"{op} b{b} x {ctx} {ifmt}/{kvfmt}"
        for rule in ("before", "after", "after", "before"):
            old = _old_count(fn, prep.n_sets) if rule == "before" else None
            t = timing.time_fn(fn, prep.n_sets, calls_per_sample=old, **kw)
            rows.append({"point": name, "rule": rule, "median_us": t.median_us,
                         "p10_us": t.p10_us, "p90_us": t.p90_us,
                         "calls_per_sample": t.calls_per_sample, "cache_policy": t.cache_policy})
            print(f"{name:48s} {rule:6s} {t.median_us:9.2f} us  calls/sample "
                  f"{t.calls_per_sample}", flush=True)
    with open(out_path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    for row in rows[:6]:
        print(f"empty kernel, {row['rule']:>10s}: {row['median_us']:.2f} us per call")


if __name__ == "__main__":
    main(sys.argv[1])
