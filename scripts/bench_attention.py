#!/usr/bin/env python
"""Benchmark sparse GQA (decode, prefill) and K/V quantize-and-store, BF16 and FP8 (issue 4).

Points (preset qwen3.8-flash-next unless --preset):
* decode, 4 rows per request, batch 1, 8, 32, 64 x context 8K, 32K, 128K, BF16 and FP8, with
  (a) `index` selections: the index path on realistic keys (qsa.cases keys, reference scores,
  the top-k kernel when it imports, else the reference) and (b) `random`: the worst case, 512
  independent random groups per row. The K/V pool holds only the blocks the selections touch
  (filled with qsa.cases activations through the reference store), behind a shuffled page
  table; untouched pages are -1 and never read.
* prefill: one request whose 4K or 16K-token prompt is one chunk (rows = context).
* quantize-and-store: a 16K-token prefill chunk.

Every point is checked against the float32 reference on the inputs it is timed on before it
is timed (prefill: 257 rows spread over the chunk, each row being an independent program); a
point that fails is recorded with its error and no time. Times are graph replays over input
sets rotated through more than 3x the last-level cache (cold cache); decode sets are disjoint
requests of one pool. Bytes moved count the unique K/V rows each request reads (spec: rows of
a request share what their selections share), plus q, out and the id lists.

Output in --out: bench_attention.jsonl (one JSON object per point), bench_attention.csv (the
same without raw samples), bench_attention_targets.json (the issue's targets, met or by how
much missed). FP8 rows carry `fp8_speedup` = BF16 time / FP8 time of the same point.
Usage: python scripts/bench_attention.py --out DIR [--quick] [--sweep] [--copy-gbps 4285].
--sweep also times alternative block configs for the config tables (decode batch 64 and 8 at
128K, prefill 4K; a few more minutes); --smoke runs tiny shapes under the interpreter without a
GPU (functional only).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qsa.measure.results import bench_parser, parse_bench_args, write_rows
from qsa.arena.fields import CacheFormats, allocate_layer, declare_fields
from qsa.cases import CaseSpec, activations, make_batch, make_case, poison_
from qsa.configs import BlockConfig
from qsa.kernels import kv_quant, sparse_gqa
from qsa.kernels.common import interpreting, lookup
from qsa.measure.device import detect_device
from qsa.measure.work import Work
from qsa.measure.timing import sets_for_cold_cache, time_fn
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset, get_preset
from qsa.reference.attention import sparse_gqa_reference
from qsa.reference.kv import store_kv_reference
from qsa.reference.pipeline import row_slots
from qsa.reference.score import score_reference, visible_groups
from qsa.reference.topk import expand_reference, topk_expand_reference
from qsa.tolerances import INTERPRETER_FP8_MISMATCH

try:  # the top-k kernel (issue 3); the reference is the fallback
    from qsa.kernels.topk import topk_expand as _topk
    TOPK_SOURCE = "kernel"
except ImportError:  # pragma: no cover - depends on the other issue's progress
    _topk = topk_expand_reference
    TOPK_SOURCE = "reference"

FORMATS = ("bf16", "fp8")
ROWS_PER_REQUEST = 4
SAMPLES = 30
FILL_CHUNK_TOKENS = 1 << 19  # pool fill: tokens per reference-store call (bounds temporaries)
PREFILL_CHECK_ROWS = 256
OUTLIER_SCALE = 12.0  # qsa.cases' default K outlier scale; V gets a third of it

TARGETS = {"bf16_decode_b64_128k_pct_copy": 85.0, "b1_us_max": 6.0, "b8_us_max": 35.0,
           "fp8_decode_b64_128k_speedup": 1.7, "fp8_prefill_speedup": 1.15,
           "kv_store_16k_pct_copy": 70.0}


@dataclass(frozen=True)
class Plan:
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    store_tokens: int
    selections: tuple[str, ...] = ("index", "random")
    sweep_batches: tuple[int, ...] = (64, 8)  # --sweep: decode at the longest context


FULL = Plan((8192, 32768, 131072), (1, 8, 32, 64), (4096, 16384), 16384)
QUICK = Plan((131072,), (1, 8, 64), (4096,), 16384, ("random",), sweep_batches=(64, 8, 1))
SMOKE = Plan((160,), (1, 2), (48,), 64, sweep_batches=(2,))

# --sweep candidates: (BLOCK_N, num_warps, num_stages); decode also tries occupancy estimates.
# The pipeliner spreads num_stages - 1 over the ids -> page -> K/V chain of loads (3 levels), so
# K/V tiles get (num_stages - 1) // 3 buffers in flight: 4 stages give 1, 7 give 2.
SWEEP_TILES = ((64, 4, 4), (64, 4, 3), (64, 4, 5), (128, 4, 2), (128, 4, 3), (128, 8, 3),
               (32, 4, 4), (256, 8, 2))
SWEEP_RESIDENT = (1, 2, 3, 4)


# ------------------------------------------------------------------------------------------------
# recording
# ------------------------------------------------------------------------------------------------

class Bench:
    def __init__(self, out: Path, copy_gbps: float, device: Any) -> None:
        self.out, self.copy_gbps, self.device = out, copy_gbps, device
        self.rows: list[dict[str, Any]] = []

    def record(self, point: dict[str, Any], fn_for_set: Callable[[int], None], n_sets: int,
               bytes_per_set: int, work: Any, error: str = "") -> dict[str, Any]:
        row = {"device": self.device.slug, "arch": self.device.arch,
               "torch": self.device.torch_version, "triton": self.device.triton_version,
               **point, "n_sets": n_sets, "bytes_moved": work.bytes_moved, "flops": work.flops,
               "verified": not error, "error": error, "copy_gbps_ref": self.copy_gbps,
               "us": None}
        if not error:
            t = time_fn(fn_for_set, n_sets, bytes_per_set=bytes_per_set, samples=SAMPLES)
            gbps = work.bytes_moved / t.median_us / 1e3
            row.update(t.as_record())
            row.update(us=t.median_us, gbps=gbps, pct_copy=100 * gbps / self.copy_gbps,
                       tflops=work.flops / t.median_us / 1e6)
        self.rows.append(row)
        desc = " ".join(f"{k}={point[k]}" for k in ("op", "shape", "selection", "format")
                        if k in point)
        print(f"{desc:<58} {point.get('config_tag', ''):<6} " +
              (f"{row['us']:10.2f} us {row['gbps']:8.1f} GB/s {row['pct_copy']:6.1f}% copy"
               if row["us"] is not None else f"ERROR {error}"), flush=True)
        return row

    def add_ratios(self) -> None:
        """fp8_speedup on every FP8 row whose BF16 twin (same point otherwise) was timed."""
        def key(r: dict[str, Any]) -> tuple:
            return tuple((k, str(r.get(k))) for k in ("op", "shape", "selection", "config_tag"))
        bf16 = {key(r): r for r in self.rows if r.get("format") == "bf16" and r["us"]}
        for r in self.rows:
            twin = bf16.get(key(r))
            if r.get("format") == "fp8" and r["us"] and twin:
                r["fp8_speedup"] = twin["us"] / r["us"]
                r["bf16_us"] = twin["us"]

    def write(self, targets: dict[str, Any]) -> None:
        write_rows(self.out, "bench_attention", self.rows)
        with open(self.out / "bench_attention_targets.json", "w") as f:
            json.dump(targets, f, indent=1, default=str)


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """--smoke: the interpreter mishandles bf16 arithmetic, so kernels (and the reference they
    are checked against) get fp32 copies of bf16 tensors, as in the CPU tests."""
    return t.float() if interpreting() and t.dtype == torch.bfloat16 else t


def _config_name(kernel: str, fmt: str, size: int, cfg: BlockConfig | None) -> str:
    used, _ = lookup(kernel, fmt, size, cfg)
    return json.dumps(used.as_dict(), sort_keys=True, separators=(",", ":"))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    """The GPU tests' tolerance: bf16 probabilities and output, ~2^-9 of the largest value."""
    scale = float(want.abs().max())
    bad = (got.float() - want).abs() > 1e-2 * scale + 1e-2 * want.abs()
    if not torch.isfinite(got.float()).all():
        return f"{what}: non-finite output"
    if bool(bad.any()):
        return f"{what}: {int(bad.sum())} of {bad.numel()} elements differ from the reference"
    return ""


def _row_subset(batch: PagedBatch, rows: torch.Tensor) -> PagedBatch:
    """The batch restricted to some query rows (request-major order kept)."""
    rr = batch.row_request.long()[rows]
    qs = torch.zeros(batch.batch + 1, dtype=torch.int32, device=rows.device)
    qs[1:] = torch.cumsum(torch.bincount(rr, minlength=batch.batch), 0).to(torch.int32)
    return PagedBatch(batch.block_table, batch.context_lens, qs, batch.positions[rows],
                      batch.block_size)


def _requests(batch: PagedBatch, first: int, count: int) -> PagedBatch:
    """Requests [first, first + count) of a uniform decode batch, as a batch of their own."""
    r = ROWS_PER_REQUEST
    qs = torch.arange(0, (count + 1) * r, r, dtype=torch.int32, device=batch.positions.device)
    return PagedBatch(batch.block_table[first:first + count],
                      batch.context_lens[first:first + count], qs,
                      batch.positions[first * r:(first + count) * r], batch.block_size)


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------

def _random_selection(batch: PagedBatch, preset: ModelPreset, gen: torch.Generator
                      ) -> torch.Tensor:
    """Worst case: every row picks min(k, visible) independent random groups."""
    vis = visible_groups(batch)
    g = int(vis.max())
    keys = torch.rand((batch.num_rows, g), generator=gen, device=vis.device)
    keys[torch.arange(g, device=vis.device)[None, :] >= vis[:, None]] = -1.0
    k = min(preset.topk_groups, g)
    groups = keys.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)
    counts = vis.clamp(max=k).to(torch.int32)  # invalid picks sort last (larger group ids)
    return expand_reference(groups, counts, batch.positions, preset.expand_width)


def _kv_caches(preset: ModelPreset, num_blocks: int, dev: str) -> dict[str, dict]:
    caches = {}
    for fmt in FORMATS:
        fields = tuple(f for f in declare_fields(preset, CacheFormats(kv=fmt))
                       if f.name in ("k", "v", "k_scale", "v_scale"))
        caches[fmt] = {n: poison_(t) for n, t in allocate_layer(fields, num_blocks, dev).items()}
    return caches


def _fill(caches: dict[str, dict], preset: ModelPreset, blocks: torch.Tensor, seed: int) -> None:
    """Every slot of `blocks` gets realistic K/V (qsa.cases activations), stored in both
    formats by the reference store, so BF16 and FP8 points read the same values."""
    dev = blocks.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    outliers = torch.randperm(preset.head_dim, generator=gen, device=dev)[:4]
    page = preset.block_size
    slots = (blocks.long()[:, None] * page + torch.arange(page, device=dev)).flatten()
    shape = (preset.num_kv_heads, preset.head_dim)
    for at in range(0, slots.numel(), FILL_CHUNK_TOKENS):
        s = slots[at:at + FILL_CHUNK_TOKENS]
        k = activations(gen, (s.numel(), *shape), outliers, OUTLIER_SCALE)
        v = activations(gen, (s.numel(), *shape), outliers, OUTLIER_SCALE / 3)
        for fmt, cache in caches.items():
            store_kv_reference(cache, s, k, v, fmt)


@dataclass
class DecodeInputs:
    batch: PagedBatch  # all requests, page table over the touched blocks only
    q: torch.Tensor
    ids: torch.Tensor
    caches: dict[str, dict]
    touched_blocks: int


def decode_inputs(preset: ModelPreset, nreq: int, context: int, selection: str, dev: str,
                  seed: int) -> DecodeInputs:
    spec = CaseSpec.decode(preset, nreq, context, ROWS_PER_REQUEST, build_kv=False, seed=seed)
    if selection == "index":
        case = make_case(spec, device=dev)
        scores = score_reference(case.cache, case.batch, case.q_index, preset, "bf16")
        ids = _topk(scores, case.batch, preset)
        batch, q = case.batch, case.q
        del case, scores
    else:
        batch = make_batch(spec, torch.Generator().manual_seed(seed), dev)
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        q = torch.randn((batch.num_rows, preset.num_q_heads, preset.head_dim), generator=gen,
                        device=dev).to(torch.bfloat16)
        ids = _random_selection(batch, preset, gen)
    # Physical blocks only for the (request, page) pairs some row selects, in shuffled order.
    page = preset.block_size
    pages = batch.block_table.shape[1]
    valid = ids >= 0
    rr = batch.row_request.long()[:, None].expand_as(ids)
    used = torch.unique((rr * pages + ids.long() // page)[valid])
    perm = torch.randperm(used.numel(), generator=torch.Generator().manual_seed(seed + 2))
    table = torch.full_like(batch.block_table, -1)
    table[used // pages, used % pages] = perm.to(device=dev, dtype=torch.int32)
    batch = PagedBatch(table, batch.context_lens, batch.query_start, batch.positions, page)
    caches = _kv_caches(preset, used.numel(), dev)
    _fill(caches, preset, perm.to(dev), seed + 3)
    caches = {f: {k: _kernel_view(v) for k, v in c.items()} for f, c in caches.items()}
    return DecodeInputs(batch, _kernel_view(q), ids, caches, used.numel())


# ------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------

def _attention_point(b: Bench, kernel: Callable, kernel_name: str, preset: ModelPreset,
                     fmt: str, cache: dict, sets: list[tuple[PagedBatch, torch.Tensor,
                                                             torch.Tensor, torch.Tensor]],
                     check_rows: torch.Tensor | None, point: dict[str, Any],
                     cfg: BlockConfig | None = None) -> dict[str, Any]:
    """Verify set 0 against the reference, then time all sets (cold cache)."""
    batch0, q0, ids0, out0 = sets[0]
    works = [sparse_gqa.work(ids, batch, preset, fmt) for batch, _, ids, _ in sets]
    bytes_per_set = max(w.bytes_moved for w in works)
    rows = q0.shape[0]
    try:
        splits = sparse_gqa.split_count(rows, preset, ids0.shape[1], fmt, q0.device,
                                        prefill=kernel_name == sparse_gqa.KERNEL_PREFILL,
                                        config=cfg)
    except Exception:  # a bad config: the launch below records why
        splits = None
    point = {**point, "format": fmt, "rows": rows, "splits": splits, "config": _config_name(
        kernel_name, fmt, rows, cfg), "config_tag": point.get("config_tag", "table")}
    error = ""
    try:
        poison_(out0)
        kernel(q0, cache, batch0, ids0, preset, fmt, out=out0, config=cfg, check=False)
        sub = torch.arange(rows, device=q0.device) if check_rows is None else check_rows
        sb = _row_subset(batch0, sub)
        want = sparse_gqa_reference(q0[sub], cache, sb, ids0[sub], fmt, preset.softmax_scale)
        error = _close(out0[sub], want, point["op"])
    except Exception as exc:  # a config that fails to compile or launch is recorded, not fatal
        error = f"{type(exc).__name__}: {exc}"

    def run(i: int) -> None:
        batch, q, ids, out = sets[i]
        kernel(q, cache, batch, ids, preset, fmt, out=out, config=cfg, check=False)

    n = len(works)  # the timed calls rotate over the sets: report their mean work
    mean = Work(sum(w.bytes_moved for w in works) // n, sum(w.flops for w in works) // n)
    return b.record(point, run, n, bytes_per_set, mean, error)


def _decode_sets(inp: DecodeInputs, nreq: int, llc: int, preset: ModelPreset, fmt: str
                 ) -> list[tuple[PagedBatch, torch.Tensor, torch.Tensor, torch.Tensor]]:
    total = inp.batch.batch // nreq
    one = _requests(inp.batch, 0, nreq)
    r = ROWS_PER_REQUEST * nreq
    per_set = sparse_gqa.work(inp.ids[:r], one, preset, fmt).bytes_moved
    n_sets = max(1, min(sets_for_cold_cache(per_set, llc), total))
    sets = []
    for i in range(n_sets):
        rows = slice(i * r, (i + 1) * r)
        sets.append((_requests(inp.batch, i * nreq, nreq), inp.q[rows], inp.ids[rows],
                     torch.empty_like(inp.q[rows])))
    return sets


def bench_decode(b: Bench, preset: ModelPreset, plan: Plan, llc: int, dev: str) -> None:
    nreq_max = max(plan.batches)
    for ctx in plan.contexts:
        for sel in plan.selections:
            inp = decode_inputs(preset, nreq_max, ctx, sel, dev, seed=ctx % 9973 + len(sel))
            src = f" ({TOPK_SOURCE} top-k)" if sel == "index" else ""
            print(f"# decode pool ctx={ctx} selection={sel}{src}: {inp.touched_blocks} blocks "
                  "touched", flush=True)
            for nreq in plan.batches:
                for fmt in FORMATS:
                    sets = _decode_sets(inp, nreq, llc, preset, fmt)
                    _attention_point(b, sparse_gqa.sparse_gqa_decode, sparse_gqa.KERNEL_DECODE,
                                     preset, fmt, inp.caches[fmt], sets, None,
                                     {"op": "decode", "shape": f"b{nreq}_ctx{ctx}",
                                      "batch": nreq, "context": ctx, "selection": sel,
                                      "touched_blocks": inp.touched_blocks})
            del inp
            if dev == "cuda":
                torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------------

def bench_prefill(b: Bench, preset: ModelPreset, plan: Plan, llc: int, dev: str) -> None:
    for n in plan.prefill_rows:
        cases = {fmt: make_case(CaseSpec(preset, (n,), (n,), kv_format=fmt, seed=5), device=dev)
                 for fmt in FORMATS}  # same seed: the same K/V values in both formats
        c16 = cases["bf16"]
        scores = score_reference(c16.cache, c16.batch, c16.q_index, preset, "bf16")
        ids = _topk(scores, c16.batch, preset)
        del scores
        step = max(1, n // PREFILL_CHECK_ROWS)
        check = torch.cat([torch.arange(0, n, step), torch.tensor([n - 1])]).unique().to(dev)
        for fmt in FORMATS:
            case = cases[fmt]
            cache = {k: _kernel_view(v) for k, v in case.cache.items() if k[0] in "kv"}
            q = _kernel_view(case.q)
            per_set = sparse_gqa.work(ids, case.batch, preset, fmt).bytes_moved
            n_sets = sets_for_cold_cache(per_set, llc)
            sets = [(case.batch, q.clone(), ids.clone(), torch.empty_like(q))
                    for _ in range(n_sets)]
            _attention_point(b, sparse_gqa.sparse_gqa_prefill, sparse_gqa.KERNEL_PREFILL,
                             preset, fmt, cache, sets, check,
                             {"op": "prefill", "shape": f"prefill_{n}", "batch": 1,
                              "context": n, "selection": "index"})
        del cases


# ------------------------------------------------------------------------------------------------
# quantize-and-store
# ------------------------------------------------------------------------------------------------

def bench_store(b: Bench, preset: ModelPreset, plan: Plan, llc: int, dev: str) -> None:
    t = plan.store_tokens
    for fmt in FORMATS:
        work = kv_quant.work(preset, t, fmt)
        n_sets = sets_for_cold_cache(work.bytes_moved, llc)
        # n_sets requests of one prompt each: disjoint inputs and destination slots.
        case = make_case(CaseSpec(preset, (t,) * n_sets, (t,) * n_sets, kv_format=fmt, seed=6),
                         device=dev)
        slots = row_slots(case.batch).to(torch.int64)
        ref = {k: poison_(v) for k, v in case.cache.items() if k[0] in "kv"}
        cache = {k: _kernel_view(v.clone()) for k, v in ref.items()}
        # The reference runs on the CPU: on CUDA, torch turns its `amax / fp8_max` into
        # `amax * (1 / fp8_max)`, off the spec's correctly rounded division for ~half the scales.
        ref = {k: v.cpu() for k, v in ref.items()}
        k_new, v_new = _kernel_view(case.k_new), _kernel_view(case.v_new)
        sets = [(slots[i * t:(i + 1) * t], k_new[i * t:(i + 1) * t], v_new[i * t:(i + 1) * t])
                for i in range(n_sets)]
        point = {"op": "kv_store", "shape": f"prefill_{t}", "format": fmt, "tokens": t,
                 "config": _config_name(kv_quant.KERNEL, fmt, t, None), "config_tag": "table"}
        error = ""
        try:
            s, k, v = sets[0]
            kv_quant.store_kv(cache, s, k, v, fmt, check=False)
            s_cpu = s.cpu()
            store_kv_reference(ref, s_cpu, case.k_new[:t].cpu(), case.v_new[:t].cpu(), fmt)
            page = preset.block_size
            for name in ref:  # written slots equal the reference by value (-0 == +0)
                got = cache[name][s // page, s % page].float().cpu()
                want = ref[name][s_cpu // page, s_cpu % page].float()
                wrong = float((got != want).float().mean())
                codes = name in ("k", "v") and fmt == "fp8" and interpreting()
                if wrong > (INTERPRETER_FP8_MISMATCH if codes else 0.0):
                    error = f"kv_store: {name}: {100 * wrong:.2f}% differ from the reference"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"

        def run(i: int) -> None:
            s, k, v = sets[i]
            kv_quant.store_kv(cache, s, k, v, fmt, check=False)

        b.record(point, run, n_sets, work.bytes_moved, work, error)


# ------------------------------------------------------------------------------------------------
# config sweep (for the tables)
# ------------------------------------------------------------------------------------------------

def _sweep_configs(kernel: str, fmt: str, size: int, decode: bool) -> Iterator[BlockConfig]:
    base, _ = lookup(kernel, fmt, size)
    host = {k: v for k, v in base.meta.items() if k != "BLOCK_N"}
    for n, w, s in SWEEP_TILES:
        yield BlockConfig({**host, "BLOCK_N": n}, num_warps=w, num_stages=s, amd=base.amd)
    if decode:
        for res in SWEEP_RESIDENT:
            yield base.with_meta(SPLIT_RESIDENT_PER_SM=res)


def bench_sweep(b: Bench, preset: ModelPreset, plan: Plan, llc: int, dev: str) -> None:
    ctx = max(plan.contexts)
    inp = decode_inputs(preset, max(plan.sweep_batches), ctx, "random", dev, seed=17)
    for nreq in plan.sweep_batches:
        for fmt in FORMATS:
            sets = _decode_sets(inp, nreq, llc, preset, fmt)
            for i, cfg in enumerate(_sweep_configs(sparse_gqa.KERNEL_DECODE, fmt,
                                                   ROWS_PER_REQUEST * nreq, True)):
                _attention_point(b, sparse_gqa.sparse_gqa_decode, sparse_gqa.KERNEL_DECODE,
                                 preset, fmt, inp.caches[fmt], sets, None,
                                 {"op": "decode", "shape": f"b{nreq}_ctx{ctx}", "batch": nreq,
                                  "context": ctx, "selection": "random",
                                  "config_tag": f"sweep{i}"}, cfg)
    del inp
    n = plan.prefill_rows[0]
    case = {fmt: make_case(CaseSpec(preset, (n,), (n,), kv_format=fmt, seed=5), device=dev)
            for fmt in FORMATS}
    scores = score_reference(case["bf16"].cache, case["bf16"].batch, case["bf16"].q_index,
                             preset, "bf16")
    ids = _topk(scores, case["bf16"].batch, preset)
    check = torch.arange(0, n, max(1, n // 64), device=dev)
    for fmt in FORMATS:
        c = case[fmt]
        cache = {k: _kernel_view(v) for k, v in c.cache.items() if k[0] in "kv"}
        q = _kernel_view(c.q)
        sets = [(c.batch, q, ids, torch.empty_like(q))]
        for i, cfg in enumerate(_sweep_configs(sparse_gqa.KERNEL_PREFILL, fmt, n, False)):
            _attention_point(b, sparse_gqa.sparse_gqa_prefill, sparse_gqa.KERNEL_PREFILL,
                             preset, fmt, cache, sets, check,
                             {"op": "prefill", "shape": f"prefill_{n}", "batch": 1,
                              "context": n, "selection": "index", "config_tag": f"sweep{i}"},
                             cfg)


# ------------------------------------------------------------------------------------------------
# targets
# ------------------------------------------------------------------------------------------------

def _pick(rows: list[dict], **match: Any) -> list[dict]:
    return [r for r in rows if r["us"] and r.get("config_tag") == "table"
            and all(r.get(k) == v for k, v in match.items())]


def targets(rows: list[dict]) -> dict[str, Any]:
    """Each target of the issue: the measured value (worst over the points it covers), the
    goal, and whether it is met."""
    out: dict[str, Any] = {}

    def put(name: str, value: float | None, goal: float, higher_is_better: bool,
            points: list[dict]) -> None:
        if value is None:
            out[name] = {"goal": goal, "value": None, "met": None, "note": "not measured"}
            return
        met = value >= goal if higher_is_better else value <= goal
        out[name] = {"goal": goal, "value": value, "met": met,
                     "miss_pct": None if met else 100 * abs(value - goal) / goal,
                     "points": [f"{p['shape']}/{p.get('selection')}/{p.get('format')}"
                                for p in points]}

    pts = _pick(rows, op="decode", batch=64, context=131072, format="bf16")
    put("bf16_decode_b64_128k_pct_copy", min((p["pct_copy"] for p in pts), default=None),
        TARGETS["bf16_decode_b64_128k_pct_copy"], True, pts)
    for nreq, name in ((1, "b1_us_max"), (8, "b8_us_max")):
        pts = _pick(rows, op="decode", batch=nreq, selection="random")
        put(name, max((p["us"] for p in pts), default=None), TARGETS[name], False, pts)
    pts = [p for p in _pick(rows, op="decode", batch=64, context=131072, format="fp8")
           if "fp8_speedup" in p]
    put("fp8_decode_b64_128k_speedup", min((p["fp8_speedup"] for p in pts), default=None),
        TARGETS["fp8_decode_b64_128k_speedup"], True, pts)
    pts = [p for p in _pick(rows, op="prefill", format="fp8") if "fp8_speedup" in p]
    put("fp8_prefill_speedup", min((p["fp8_speedup"] for p in pts), default=None),
        TARGETS["fp8_prefill_speedup"], True, pts)
    pts = _pick(rows, op="kv_store")
    put("kv_store_16k_pct_copy", min((p["pct_copy"] for p in pts), default=None),
        TARGETS["kv_store_16k_pct_copy"], True, pts)
    return out


def _summary(rows: list[dict]) -> None:
    print("\n# FP8 vs BF16, side by side (us; speedup = BF16 / FP8)")
    for r in rows:
        if r.get("format") == "fp8" and "fp8_speedup" in r:
            print(f"{r['op']:>8} {r['shape']:>16} {str(r.get('selection')):>7} "
                  f"{r.get('config_tag'):>8}  bf16 {r['bf16_us']:9.2f}  fp8 {r['us']:9.2f}  "
                  f"x{r['fp8_speedup']:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__.splitlines()[0],
                      "128K decode at batch 1, 8, 64 (random selections); 4K prefill; store")
    ap.add_argument("--sweep", action="store_true",
                    help="also time alternative block configs (decode 128K, prefill 4K)")
    args = parse_bench_args(ap, argv)
    device = detect_device()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    preset = get_preset(args.preset)
    plan = QUICK if args.quick else FULL
    if args.smoke:
        preset = preset.replace(head_dim=64, topk_groups=8, block_size=16)
        plan = SMOKE
    llc = device.llc_bytes
    b = Bench(args.out, args.copy_gbps, device)
    status = 0
    try:
        bench_decode(b, preset, plan, llc, dev)
        bench_prefill(b, preset, plan, llc, dev)
        bench_store(b, preset, plan, llc, dev)
        if args.sweep:
            bench_sweep(b, preset, plan, llc, dev)
    except Exception:
        traceback.print_exc()
        status = 1
    b.add_ratios()
    tg = targets(b.rows)
    b.write(tg)
    _summary(b.rows)
    print("\n# targets")
    for name, t in tg.items():
        v = t["value"]
        print(f"{name:<32} goal {t['goal']:>7} value " +
              ("n/a" if v is None else f"{v:9.2f}") + f"  met={t['met']}" +
              (f" (missed by {t['miss_pct']:.1f}%)" if t.get("miss_pct") else ""))
    failed = [r for r in b.rows if r["error"] and r.get("config_tag") == "table"]
    swept = [r for r in b.rows if r["error"] and r.get("config_tag") != "table"]
    print(f"wrote {len(b.rows)} points to {args.out} ({len(failed)} table configs failed "
          f"verification; {len(swept)} swept configs failed or did not compile)")
    return 1 if failed or status else 0


if __name__ == "__main__":
    sys.exit(main())
