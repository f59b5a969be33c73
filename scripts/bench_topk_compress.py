#!/usr/bin/env python
"""Benchmark top-k + expand and the index-key compress kernel (issue 3, items 1 and 5).

Points:
* top-k + expand: 256 rows x 32K candidates (batch 64 x 128K, 4 rows each), batch 1 x 8K and
  batch 8 x 32K; the table's config and (without --quick) a (num_warps, CHUNK) sweep. Side by
  side on the same shape: the decode scorer (`score_decode`, BF16 keys; without --quick also
  FP8 and MXFP4), and each top-k row carries the top-k / scorer time ratio plus what
  materialising the scores costs next to the scorer's key reads (the numbers behind the
  docstring's choice of materialised scores over selection fused into the scorers).
* compress: a 16K-token prefill (batch 1) and a 4-row verify at batch 64, each index format.

Every configuration is checked against the reference on the inputs it is timed on before it is
timed; a point whose check fails is recorded with its error and no timing. Times are graph
replays over input sets rotated through more than 3x the last-level cache (cold cache).

Output: <out>/bench_topk_compress.jsonl (one JSON object per point) and .csv (same rows, raw
samples left out). Usage: python scripts/bench_topk_compress.py --out DIR [--quick]
[--copy-gbps 4285]. Without a GPU, --smoke runs tiny shapes under the interpreter (functional).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qsa.measure.results import bench_parser, parse_bench_args, write_rows
from qsa.cases import CaseSpec, make_case, poison_
from qsa.configs import BlockConfig
from qsa.formats import INDEX_FORMATS, index_layout
from qsa.kernels import compress as kcompress
from qsa.kernels import topk as ktopk
from qsa.kernels.common import interpreting, lookup
from qsa.measure.device import detect_device
from qsa.measure.work import Work
from qsa.measure.timing import sets_for_cold_cache, time_fn
from qsa.tolerances import CODE_MISMATCH, INTERPRETER_FP8_MISMATCH
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset, get_preset
from qsa.reference.compress import completed_groups, compress_reference, rope_inv_freq
from qsa.reference.score import score_reference
from qsa.reference.topk import topk_expand_reference

SCALE_RTOL = 2.0 ** -19   # boundaries within FP32 noise (see tests/test_kernel_compress.py)
CALLS_PER_SAMPLE = 100


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    context: int
    rows: int


TOPK_SHAPES = (Shape("b64_ctx128k", 64, 131072, 4), Shape("b1_ctx8k", 1, 8192, 4),
               Shape("b8_ctx32k", 8, 32768, 4))
SMOKE_TOPK = (Shape("smoke_b2_ctx4k", 2, 4096, 4),)
SWEEP = tuple((w, c) for w in (2, 4, 8, 16, 32) for c in (1024, 2048, 4096))  # (warps, CHUNK)
# Sweep only warp counts that hold 8..64 candidates per lane of a 32-lane warp: fewer idles the
# lanes, more spills the row out of registers (and takes seconds to time).
KEYS_PER_LANE = (8, 64)


class Bench:
    def __init__(self, out: Path, copy_gbps: float, device: Any) -> None:
        self.out, self.copy_gbps, self.device = out, copy_gbps, device
        self.rows: list[dict[str, Any]] = []

    def record(self, point: dict[str, Any], fn_for_set: Callable[[int], None] | None,
               n_sets: int, bytes_per_set: int, work: Any, error: str = "") -> None:
        row = {"device": self.device.slug, "torch": self.device.torch_version,
               "triton": self.device.triton_version, **point,
               "bytes_moved": work.bytes_moved, "flops": work.flops, "verified": not error,
               "error": error, "copy_gbps_ref": self.copy_gbps}
        if fn_for_set is not None and not error:
            # Calls per sample are set, not estimated: the estimate times eager calls, whose
            # input checks sync with the host; graph replays skip those checks.
            t = time_fn(fn_for_set, n_sets, bytes_per_set=bytes_per_set,
                        calls_per_sample=max(n_sets, CALLS_PER_SAMPLE))
            gbps = work.bytes_moved / t.median_us / 1e3
            row.update(t.as_record())
            row.update(us=t.median_us, gbps=gbps, pct_copy=100 * gbps / self.copy_gbps)
        self.rows.append(row)
        us = row.get("us")
        print(f"{point['kernel']:>9} {point['shape']:>22} {point.get('format', ''):>6} "
              f"{point['config']:<60} " + (f"{us:9.2f} us {row['pct_copy']:6.1f}% copy"
                                           if us is not None else f"ERROR {error}"), flush=True)

    def write(self) -> None:
        write_rows(self.out, "bench_topk_compress", self.rows)


def _config_name(cfg: BlockConfig | None, kernel: str, fmt: str, size: int) -> str:
    used, _ = lookup(kernel, fmt, size, cfg)
    tag = "table" if cfg is None else "sweep"
    return f"{tag}:{json.dumps(used.as_dict(), sort_keys=True, separators=(',', ':'))}"


# ------------------------------------------------------------------------------------------------
# top-k + expand
# ------------------------------------------------------------------------------------------------

def bench_decode_scorer(b: Bench, preset: ModelPreset, shape: Shape, case: Any, fmt: str,
                        llc: int) -> float | None:
    """Time the decode scorer (another kernel family, `qsa.kernels.scoring.score_decode`) on the
    same shape, so top-k's cost is measured against scoring's in one run. Checked loosely
    against the reference (its own tests check it exactly); returns its median us or None."""
    from qsa.kernels import score_rowwise, score_stacked, scoring

    point = {"kernel": "score_decode", "shape": shape.name, "format": fmt, "batch": shape.batch,
             "context": shape.context, "rows_per_request": shape.rows,
             "config": "stacked" if scoring.stacked_decode_enabled() else "rowwise"}
    mod = score_stacked if scoring.stacked_decode_enabled() else score_rowwise
    q = case.q_index.to(torch.bfloat16)
    planes = {k: v for k, v in case.cache.items()
              if k in ("index_compressed", "index_compressed_scale")}
    if interpreting():  # --smoke: the interpreter's bf16 dot is wrong; fp32 surrogates
        q = q.float()
        planes = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in planes.items()}
    per_set = sum(v.numel() * v.element_size() for v in planes.values())
    n_sets = sets_for_cold_cache(per_set, llc)
    sets = [planes] + [{k: v.clone() for k, v in planes.items()} for _ in range(n_sets - 1)]
    ref = score_reference(case.cache, case.batch, q.float(), preset, fmt)
    out = torch.empty_like(ref)
    error, work = "", None
    try:
        work = mod.work(case.batch, preset, fmt)
        got = scoring.score_decode(sets[0], case.batch, q, preset, fmt, out=out,
                                   max_rows_per_request=shape.rows)
        fin = torch.isfinite(ref)
        tol = 1e-2 * float(ref[fin].abs().max()) if fin.any() else 0.0
        if not torch.equal(fin, torch.isfinite(got)) or (got[fin] - ref[fin]).abs().max() > tol:
            error = "scores differ from the reference beyond 1% of the largest score"
    except Exception as exc:  # the scorer is timed beside top-k: record a failure, keep going
        error = f"{type(exc).__name__}: {exc}"

    def run(i: int) -> None:
        scoring.score_decode(sets[i], case.batch, q, preset, fmt, out=out,
                             max_rows_per_request=shape.rows)

    b.record(point, run, n_sets, per_set, work or Work(0, 0), error)
    return b.rows[-1].get("us")


def bench_topk(b: Bench, preset: ModelPreset, shapes: tuple[Shape, ...], full: bool,
               llc: int, dev: str) -> None:
    """full: a config sweep and the decode scorer in every index format (else BF16 only)."""
    for shape in shapes:
        case = make_case(CaseSpec.decode(preset, shape.batch, shape.context, shape.rows,
                                         build_kv=False, seed=1), device=dev)
        scores = score_reference(case.cache, case.batch, case.q_index, preset, "bf16")
        ref = topk_expand_reference(scores, case.batch, preset)
        score_us = {"bf16": bench_decode_scorer(b, preset, shape, case, "bf16", llc)}
        case.cache.clear()
        for fmt in INDEX_FORMATS[1:] if full else ():
            other = make_case(CaseSpec.decode(preset, shape.batch, shape.context, shape.rows,
                                              index_format=fmt, build_kv=False, seed=1),
                              device=dev)
            score_us[fmt] = bench_decode_scorer(b, preset, shape, other, fmt, llc)
            del other
        rows, cand = scores.shape
        work = ktopk.work(preset, rows, cand)
        per_set = scores.numel() * 4 + ref.numel() * 4
        n_sets = sets_for_cold_cache(per_set, llc)
        sets = [(scores.clone(), torch.empty_like(ref)) for _ in range(n_sets)]
        # What materialising the scores costs (written by the scorer, read here) next to the
        # scorer's own key reads, per index format: the traffic a fused design would save.
        score_rw = 2 * scores.numel() * 4
        mat = {"scores_write_read_bytes": score_rw,
               "scores_write_read_us_at_copy_bw": score_rw / b.copy_gbps / 1e3}
        for fmt in INDEX_FORMATS:
            key_bytes = shape.batch * cand * index_layout(fmt, preset.index_dim,
                                                          torch.float8_e4m3fn).bytes_per_row
            mat[f"scores_vs_{fmt}_key_bytes"] = score_rw / key_bytes
            mat[f"score_decode_{fmt}_us"] = score_us.get(fmt)
        configs: list[BlockConfig | None] = [None]
        if full:
            hip = torch.version.hip is not None
            block_n = 1 << (cand - 1).bit_length()
            configs += [BlockConfig({"CHUNK": c, "RADIX_BITS": r}, num_warps=w, num_stages=1)
                        for r in (0, 8) for w, c in SWEEP
                        if KEYS_PER_LANE[0] <= block_n // (32 * w) <= KEYS_PER_LANE[1]
                        and c <= block_n and not (hip and w > 16)]
        for cfg in configs:
            point = {"kernel": "topk", "shape": shape.name, "batch": shape.batch,
                     "context": shape.context, "rows": rows, "candidates": cand,
                     "config": _config_name(cfg, ktopk.KERNEL, ktopk.FORMAT, cand), **mat}
            error = ""
            try:
                got = ktopk.topk_expand(sets[0][0], case.batch, preset, cfg, out=sets[0][1])
                if not torch.equal(got, ref):
                    error = f"mismatch in {int((got != ref).any(1).sum())} rows"
            except Exception as exc:  # a config that fails to compile is recorded, not fatal
                error = f"{type(exc).__name__}: {exc}"

            def run(i: int, cfg: BlockConfig | None = cfg) -> None:
                ktopk.topk_expand(sets[i][0], case.batch, preset, cfg, out=sets[i][1])

            b.record(point, run, n_sets, per_set, work, error)
            row = b.rows[-1]
            for fmt, sus in score_us.items():
                if sus and row.get("us"):
                    row[f"topk_over_score_decode_{fmt}"] = row["us"] / sus
        sets = scores = ref = None  # free them before the next shape


# ------------------------------------------------------------------------------------------------
# compress
# ------------------------------------------------------------------------------------------------

def _check_compress(cache: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                    batch: PagedBatch, start: torch.Tensor) -> str:
    """Codes of the completed groups equal the reference's except for rare rounding-boundary
    cases, scales within FP32 noise; the full rule is enforced by the tests."""
    req, grp = completed_groups(batch, start)
    slot = batch.slots(req, grp * 4)
    blk, off = slot // batch.block_size, (slot % batch.block_size) // 4
    kc = cache["index_compressed"][blk, off].contiguous().view(torch.uint8)
    rc = ref["index_compressed"][blk, off].contiguous().view(torch.uint8)
    frac = (kc != rc).float().mean().item()
    fp8 = cache["index_compressed"].element_size() == 1 and "index_compressed_scale" in cache \
        and cache["index_compressed_scale"].dtype == torch.float32
    if frac > (INTERPRETER_FP8_MISMATCH if fp8 and interpreting() else CODE_MISMATCH):
        return f"{100 * frac:.2f}% of code bytes differ from the reference"
    if "index_compressed_scale" in cache:
        ks, rs = cache["index_compressed_scale"][blk, off], ref["index_compressed_scale"][blk, off]
        if ks.dtype == torch.float32:
            if not ((ks - rs).abs() <= SCALE_RTOL * rs.abs()).all():
                return "FP8 scales differ beyond FP32 noise"
        elif (ks != rs).float().mean().item() > CODE_MISMATCH:
            return "MXFP4 exponents differ from the reference"
    return ""


def _compress_sets(kind: str, preset: ModelPreset, fmt: str, llc: int, dev: str, smoke: bool
                   ) -> tuple[str, Any, list[PagedBatch], list[torch.Tensor], int]:
    """Input sets touching disjoint memory of one cache: prefill sets are separate requests,
    verify sets are different groups of the same requests."""
    bytes_per_group = kcompress.work(preset, fmt, 1).bytes_moved
    if kind == "prefill":
        tokens = 256 if smoke else 16384
        per_set = bytes_per_group * (tokens // 4)
        n_sets = 1 if smoke else sets_for_cold_cache(per_set, llc)
        case = make_case(CaseSpec(preset, (tokens,) * n_sets, (1,) * n_sets, index_format=fmt,
                                  build_kv=False, seed=2), device=dev)
        bt, ctx = case.batch.block_table, case.batch.context_lens
        # One request whose pass is the whole prompt: rows = tokens picks the prefill config.
        qs = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
        pos = torch.arange(tokens, dtype=torch.int32, device=dev)
        batches = [PagedBatch(bt[i:i + 1], ctx[i:i + 1], qs, pos, case.batch.block_size)
                   for i in range(n_sets)]
        starts = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(n_sets)]
        return f"prefill_{tokens}", case, batches, starts, per_set
    nreq, context = (2, 512) if smoke else (64, 32768)
    per_set = bytes_per_group * nreq
    n_sets = min(sets_for_cold_cache(per_set, llc) if not smoke else 1, context // 4 - 1)
    case = make_case(CaseSpec.decode(preset, nreq, context, 4, index_format=fmt,
                                     build_kv=False, seed=3), device=dev)
    batches, starts = [], []
    for i in range(n_sets):
        ctx = case.batch.context_lens - 4 * i
        batches.append(PagedBatch(case.batch.block_table, ctx, case.batch.query_start,
                                  case.batch.positions - 4 * i, case.batch.block_size))
        starts.append(ctx - 4)
    return f"verify_b{nreq}_ctx{context}", case, batches, starts, per_set


def bench_compress(b: Bench, preset: ModelPreset, llc: int, dev: str, smoke: bool) -> None:
    inv = rope_inv_freq(preset).to(dev)
    for kind in ("prefill", "verify"):
        for fmt in INDEX_FORMATS:
            name, case, batches, starts, per_set = _compress_sets(kind, preset, fmt, llc, dev,
                                                                  smoke)
            groups = len(completed_groups(batches[0], starts[0])[0])
            ref = {k: v.clone() for k, v in case.cache.items()}
            compress_reference(ref, batches[0], starts[0], case.rms_weight, preset, fmt)
            cache = case.cache
            for plane in ("index_compressed", "index_compressed_scale"):
                if plane in cache:
                    poison_(cache[plane])
            point = {"kernel": "compress", "shape": name, "format": fmt,
                     "batch": batches[0].batch, "groups": groups, "n_sets": len(batches),
                     "config": _config_name(None, kcompress.KERNEL, fmt, batches[0].num_rows)}
            error = ""
            try:
                kcompress.compress_index_keys(cache, batches[0], starts[0], case.rms_weight, inv,
                                              preset, fmt)
                error = _check_compress(cache, ref, batches[0], starts[0])
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"

            def run(i: int) -> None:
                kcompress.compress_index_keys(cache, batches[i], starts[i], case.rms_weight, inv,
                                              preset, fmt)

            b.record(point, run, len(batches), per_set, kcompress.work(preset, fmt, groups),
                     error)
            case = cache = ref = None


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__.splitlines()[0], "table configs only, no warps sweep")
    args = parse_bench_args(ap, argv)
    device = detect_device()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llc = device.llc_bytes
    preset = get_preset(args.preset)
    b = Bench(args.out, args.copy_gbps, device)
    try:
        bench_topk(b, preset, SMOKE_TOPK if args.smoke else TOPK_SHAPES,
                   not (args.quick or args.smoke), llc, dev)
        bench_compress(b, preset, llc, dev, args.smoke)
    except Exception:
        traceback.print_exc()
        b.write()
        return 1
    b.write()
    failed = [r for r in b.rows if r["error"]]
    print(f"wrote {len(b.rows)} points to {args.out} ({len(failed)} failed verification)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
