#!/usr/bin/env python
"""Index scorers: stacked vs row-wise decode scorers side by side, and the prefill scorer.

Decode: preset qwen3.8-flash-next, verify calls of 4 rows per request at batch 1, 8, 32, 64 x
context 8K, 32K, 128K, plus the draft layer's 1-row call at batch 32 x 32K, for each index format
(BF16, FP8 + row scale, MXFP4). Both decode scorers run on the same inputs in the same run and
the stacked/row-wise ratio is reported. Prefill: 4K and 16K rows x 16K and 64K context (the last
`rows` tokens of one request), TFLOP/s of useful work and % of the BF16 matrix rate.

Every point is built once with `qsa.cases.make_case` on the GPU (without K/V) and verified
against `qsa.reference.score_reference` before it is timed; only verified points get a time.
Times are CUDA-graph replays (`qsa.measure.timing.time_fn`) with a cold L2: copies of the
compressed-key tensors (codes and scale planes) are rotated over more than 3x the last-level
cache. Bytes moved are each kernel's `work()` (keys, q, FP32 scores, page table); GB/s is taken
against `--copy-gbps` and TFLOP/s against `--bf16-tflops`. Writes results.jsonl (with the raw
samples) and results.csv into --out.

Targets (issue 3, H200): stacked BF16 at batch 64 x 128K >= 95% of the copy bandwidth; stacked at
batch 1 x 8K <= 3 us and at batch 8 x 32K <= 6 us; prefill 16K rows x 64K >= 400 TFLOP/s.

    python scripts/bench_scorers.py --out profiles/scorers/h200 [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from qsa.cases import CaseSpec, make_case
from qsa.formats import INDEX_FORMATS
from qsa.kernels import score_prefill as prefill_mod
from qsa.kernels import score_rowwise as rowwise_mod
from qsa.kernels import score_stacked as stacked_mod
from qsa.kernels.common import lookup
from qsa.kernels.index_tiles import key_bytes
from qsa.measure.device import detect_device
from qsa.measure.timing import sets_for_cold_cache, time_fn
from qsa.presets import get_preset
from qsa.reference.score import score_reference

DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXTS = (8192, 32768, 131072)
VERIFY_ROWS = 4
DRAFT = (32, 32768)  # batch, context of the draft layer's 1-row call
PREFILL = ((4096, 16384), (4096, 65536), (16384, 16384), (16384, 65536))  # rows, context
QUICK_DECODE = ((1, 8192), (8, 32768), (64, 131072))
QUICK_PREFILL = ((4096, 16384),)
MAX_SETS = 2048  # rotation copies of the smallest key sets (1 x 8K MXFP4 needs ~1100)
KERNELS = {"stacked": stacked_mod, "rowwise": rowwise_mod, "prefill": prefill_mod}
ENTRY = {"stacked": stacked_mod.score_stacked, "rowwise": rowwise_mod.score_rowwise,
         "prefill": prefill_mod.score_prefill}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for results.jsonl/.csv")
    ap.add_argument("--quick", action="store_true",
                    help="3 decode points, the draft call and one prefill point; fewer samples")
    ap.add_argument("--copy-gbps", type=float, default=4285.0,
                    help="device copy bandwidth for pct_copy (H200 measured: 4285)")
    ap.add_argument("--bf16-tflops", type=float, default=797.0,
                    help="device BF16 matrix rate for pct_bf16 (H200 measured: 797)")
    ap.add_argument("--preset", default="qwen3.8-flash-next")
    ap.add_argument("--formats", nargs="*", default=list(INDEX_FORMATS), choices=INDEX_FORMATS)
    ap.add_argument("--samples", type=int, help="timing samples per point (default 50, quick 15)")
    ap.add_argument("--decode", nargs="*", metavar="BATCH:CONTEXT", help="override decode points")
    ap.add_argument("--prefill", nargs="*", metavar="ROWS:CONTEXT", help="override prefill points")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cpu: a functional run under the Triton interpreter (no timings)")
    return ap.parse_args(argv)


def pairs(values: list[str] | None, default: tuple[tuple[int, int], ...]
          ) -> tuple[tuple[int, int], ...]:
    if values is None:
        return default
    return tuple(tuple(int(x) for x in v.split(":")) for v in values)


def kernel_input(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the kernels take it: on CPU the interpreter's fp32 surrogate of bf16."""
    return t.float() if t.device.type == "cpu" and t.dtype == torch.bfloat16 else t


def build(preset, fmt: str, contexts: tuple[int, ...], rows: tuple[int, ...], fp8: torch.dtype,
          seed: int, device: str):
    """A case without K/V; only the compressed-key fields are kept in its cache."""
    return make_case(CaseSpec(preset, contexts, rows, index_format=fmt, fp8_dtype=fp8,
                              build_kv=False, seed=seed), device)


def verify(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when the scores match the reference (same -inf pattern, fp32 accumulation-order
    tolerance), else what differs."""
    if torch.isnan(got).any():
        return "NaN in the output (an element was not written)"
    if not torch.equal(got == float("-inf"), ref == float("-inf")):
        return "-inf pattern differs from the reference"
    fin = ref != float("-inf")
    if not fin.any():
        return ""
    err = (got[fin] - ref[fin]).abs()
    tol = 1e-4 * ref[fin].abs() + 1e-5 * ref[fin].abs().max()
    bad = int((err > tol).sum())
    return "" if bad == 0 else f"{bad} scores off by up to {float(err.max()):.3g}"


class Point:
    """One case, its rotated key sets, q, an output buffer and the reference scores."""

    def __init__(self, case, llc_bytes: int, max_sets: int) -> None:
        self.case = case
        self.preset = case.preset
        self.fmt = case.spec.index_format
        q = case.q_index.to(torch.bfloat16)
        self.q = kernel_input(q)
        b = case.batch
        self.rmax = max(case.spec.rows_per_request)
        self.width = b.max_context // 4
        self.out = torch.empty(b.num_rows, self.width, device=q.device)
        self.key_read = sum(c // 4 for c in case.spec.context_lens) * key_bytes(
            self.fmt, self.preset.index_dim)
        self.n_sets = min(max_sets, sets_for_cold_cache(self.key_read, llc_bytes))
        self.ref = score_reference(case.cache, b, q.float(), self.preset, self.fmt)
        keys = {k: kernel_input(v) for k, v in case.cache.items()
                if k.startswith("index_compressed")}
        case.cache = keys  # the raw keys are not needed any more
        self.sets = [keys] + [{k: v.clone() for k, v in keys.items()}
                              for _ in range(self.n_sets - 1)]

    def call(self, kernel: str) -> Callable[[int], None]:
        fn = ENTRY[kernel]
        extra = {} if kernel == "rowwise" else {"max_rows_per_request": self.rmax}

        def run(i: int) -> None:
            fn(self.sets[i], self.case.batch, self.q, self.preset, self.fmt, out=self.out,
               **extra)

        return run

    def release(self) -> None:
        del self.sets, self.case, self.out, self.ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure(point: Point, kernel: str, samples: int, args: argparse.Namespace,
            meta: dict[str, Any]) -> dict[str, Any]:
    """Verify, then time one kernel on one point; a row for the results table."""
    mod = KERNELS[kernel]
    size = point.case.batch.num_rows if kernel == "prefill" else point.width
    cfg, _ = lookup(mod.KERNEL, point.fmt, size)
    row: dict[str, Any] = {**meta, "kernel": kernel, "kernel_name": mod.KERNEL,
                           "format": point.fmt, "config": json.dumps(cfg.as_dict()),
                           "n_sets": point.n_sets}
    work = mod.work(point.case.batch, point.preset, point.fmt)
    row.update(bytes_moved=work.bytes_moved, flops=work.flops)
    fn = point.call(kernel)
    # Eager with every data check, then the timed call itself (sync-free path, poisoned output).
    problem = verify(ENTRY[kernel](point.case.cache, point.case.batch, point.q, point.preset,
                                   point.fmt), point.ref)
    if not problem:
        point.out.fill_(float("nan"))
        fn(0)
        problem = verify(point.out, point.ref)
    row.update(verified=not problem, verify_error=problem)
    if problem:
        print(f"  {kernel} {point.fmt}: NOT VERIFIED ({problem}); not timed", flush=True)
        return row
    t = time_fn(fn, point.n_sets, bytes_per_set=point.key_read, samples=samples)
    us = t.median_us
    row.update(t.as_record())
    row.update(gbps=work.bytes_moved / us / 1e3, pct_copy=100 * work.bytes_moved / us / 1e3
               / args.copy_gbps, tflops=work.flops / us / 1e6,
               pct_bf16=100 * work.flops / us / 1e6 / args.bf16_tflops)
    print(f"  {kernel:8s} {point.fmt:6s} {us:9.2f} us  {row['gbps']:7.0f} GB/s "
          f"({row['pct_copy']:5.1f}% copy)  {row['tflops']:6.1f} TFLOP/s", flush=True)
    return row


def target(row: pd.Series) -> tuple[str, bool] | None:
    """The issue's target for a row, if it has one: (description, met)."""
    if not row.get("verified") or pd.isna(row.get("median_us")):
        return None
    k, b, c = row["kernel"], row["batch"], row["context"]
    if row["call"] == "verify" and k == "stacked":
        if row["format"] == "bf16" and b == 64 and c == 131072:
            return ">= 95% of copy bandwidth", row["pct_copy"] >= 95.0
        if b == 1 and c == 8192:
            return "<= 3 us", row["median_us"] <= 3.0
        if b == 8 and c == 32768:
            return "<= 6 us", row["median_us"] <= 6.0
    if k == "prefill" and row["rows"] == 16384 and c == 65536:
        return ">= 400 TFLOP/s", row["tflops"] >= 400.0
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = detect_device()
    if args.device == "cpu":
        print("bench_scorers: CPU run under the interpreter, functional only (no speed)")
    preset = get_preset(args.preset)
    fp8 = info.fp8_dtype or torch.float8_e4m3fn
    samples = args.samples or (15 if args.quick else 50)
    decode = pairs(args.decode, QUICK_DECODE if args.quick else tuple(
        (b, c) for c in DECODE_CONTEXTS for b in DECODE_BATCHES))
    prefill = pairs(args.prefill, QUICK_PREFILL if args.quick else PREFILL)
    t0 = time.time()
    rows: list[dict[str, Any]] = []
    calls = [("verify", b, c, VERIFY_ROWS) for b, c in decode]
    if args.decode is None:
        calls.append(("draft", *DRAFT, 1))
    for fmt in args.formats:
        for call, b, c, r in calls:
            print(f"{call} {fmt} batch {b} x {c}, {r} rows/request", flush=True)
            point = Point(build(preset, fmt, (c,) * b, (r,) * b, fp8, b + c, args.device),
                          info.llc_bytes, MAX_SETS)
            meta = {"call": call, "batch": b, "context": c, "rows_per_request": r,
                    "rows": b * r}
            pair = {k: measure(point, k, samples, args, meta) for k in ("stacked", "rowwise")}
            ratio = None
            if all(p.get("median_us") for p in pair.values()):
                ratio = pair["rowwise"]["median_us"] / pair["stacked"]["median_us"]
            for p in pair.values():
                p["rowwise_over_stacked"] = ratio
            rows += pair.values()
            point.release()
        for n, c in prefill:
            print(f"prefill {fmt} {n} rows x {c}", flush=True)
            point = Point(build(preset, fmt, (c,), (n,), fp8, n + c, args.device),
                          info.llc_bytes, MAX_SETS)
            meta = {"call": "prefill", "batch": 1, "context": c, "rows_per_request": n,
                    "rows": n}
            rows.append(measure(point, "prefill", samples, args, meta))
            point.release()

    df = pd.DataFrame(rows)
    df["device"] = info.slug
    df["preset"] = args.preset
    df["copy_gbps_ceiling"] = args.copy_gbps
    df["bf16_tflops_ceiling"] = args.bf16_tflops
    verdicts = [target(r) for _, r in df.iterrows()]
    df["target"] = [v[0] if v else None for v in verdicts]
    df["meets_target"] = [v[1] if v else None for v in verdicts]
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_json(args.out / "results.jsonl", orient="records", lines=True)
    df.drop(columns=["samples_us"], errors="ignore").to_csv(args.out / "results.csv",
                                                            index=False)
    cols = ["call", "format", "batch", "context", "rows", "kernel", "median_us", "gbps",
            "pct_copy", "tflops", "pct_bf16", "rowwise_over_stacked", "target",
            "meets_target"]
    print(df[[c for c in cols if c in df]].to_string(
        index=False, float_format=lambda v: f"{v:.2f}"))
    judged = df[df.target.notna()]
    missed = judged[~judged.meets_target.astype(bool)]
    unverified = df[~df.verified.astype(bool)]
    print(f"targets: {len(judged) - len(missed)}/{len(judged)} met; "
          f"{len(unverified)} unverified points; {time.time() - t0:.0f} s")
    return 1 if len(unverified) else 0


if __name__ == "__main__":
    sys.exit(main())
