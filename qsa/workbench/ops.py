"""Per-op measurement: the one path from a shape to a verified, timed, roofline-annotated record.

`measure()` is what the CLI, the notebooks, the tuner and the step roll-up call. For a point it
builds inputs from `qsa.cases`, runs the kernel on poisoned outputs and checks it against the
float32 reference (a timing is only recorded for a verified configuration), then times it over
rotated copies of the inputs it reads, so every call sees a cold last-level cache.
"""

from __future__ import annotations

import contextlib
import json
import os
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from qsa import overlap as ov
from qsa.arena.fields import kv_field_names
from qsa.cases import (Case, CaseSpec, make_batch, make_case, poison_, random_selection,
                       selection_generator, touched_kv_pool)
from qsa.configs import BlockConfig
from qsa.formats import dequantize_index
from qsa.kernels.common import Lookup, observe_lookups
from qsa.measure.device import DeviceInfo, detect_device, load_or_measure_ceilings
from qsa.measure.roofline import Work, roofline_record
from qsa.measure.timing import sets_for_cold_cache, time_fn, time_twice
from qsa.presets import DEFAULT_PRESET, ModelPreset, as_preset
from qsa.reference import (rope_inv_freq, score_reference, sparse_gqa_reference,
                           topk_expand_reference)
from qsa.reference.compress import completed_groups
from qsa.reference.pipeline import pass_start_positions, row_slots
from qsa.trace import read_trace
from qsa.tolerances import (ATTENTION_ATOL, ATTENTION_RTOL, CODE_MISMATCH,
                            INTERPRETER_FP8_MISMATCH, SCORE_ATOL, SCORE_RTOL)

OPS: tuple[str, ...] = ("score_stacked", "score_rowwise", "score_prefill", "topk_expand",
                        "compress", "kv_store", "sparse_gqa_decode", "sparse_gqa_prefill")
# Config-table name of each op's kernel.
KERNEL_OF: dict[str, str] = {
    "score_stacked": "score_stacked", "score_rowwise": "score_rowwise",
    "score_prefill": "score_prefill", "topk_expand": "topk", "compress": "compress",
    "kv_store": "kv_quant", "sparse_gqa_decode": "sparse_gqa_decode",
    "sparse_gqa_prefill": "sparse_gqa_prefill",
}
KV_OPS = ("kv_store", "sparse_gqa_decode", "sparse_gqa_prefill")
# How a sparse-attention point picks its token ids: the index path on realistic keys (scores,
# top-k), or `random` (random groups per row, K/V pool holding only the selected pages, so 128K
# contexts at batch 64 fit), or `trace` (a selection trace's, `qsa.trace`: its requests and rows,
# K/V random). The first two take the point's `overlap`, how much neighbouring rows'
# selections overlap (0: independent rows, the worst case for sharing K/V tiles).
SELECTIONS = ("index", "random", "trace")
ATTENTION_OPS = ("sparse_gqa_decode", "sparse_gqa_prefill")
# Which sparse GQA path a point runs: chosen per call from the measured union (`auto`, what
# production does), or forced, so both paths can be timed side by side on the same inputs.
SHARING = ("auto", "per-row", "shared")
MAX_ROTATION_BYTES = 24 << 30  # memory allowed for rotated input copies


class VerificationError(AssertionError):
    """A kernel's output disagrees with the reference: the point is not timed."""


@dataclass(frozen=True)
class Point:
    """One measurable shape: `rows` query rows (new tokens) per request."""

    op: str
    preset: ModelPreset
    batch: int
    context: int
    rows: int
    index_format: str = "bf16"
    kv_format: str = "bf16"
    seed: int = 0
    selection: str = "index"
    overlap: float = 0.0  # target mean Jaccard of neighbouring rows' selections
    sharing: str = "auto"
    trace: str | None = None  # selection "trace": the trace file
    trace_layer: int | None = None  # its layer replayed (None: the first)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"op: {self.op!r} is not one of {', '.join(OPS)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection: {self.selection!r} is not one of "
                             f"{', '.join(SELECTIONS)}")
        if self.selection in ("random", "trace") and self.op not in ATTENTION_OPS:
            raise ValueError(f"selection: {self.selection} selections are for "
                             f"{' and '.join(ATTENTION_OPS)}, not {self.op}")
        if (self.selection == "trace") != (self.trace is not None):
            raise ValueError("selection: a trace file goes with selection trace, and back")
        if self.trace is not None and self.overlap:
            raise ValueError("overlap: a trace's selections overlap as they were recorded")
        ov.check_target(self.overlap)
        if self.sharing not in SHARING:
            raise ValueError(f"sharing: {self.sharing!r} is not one of {', '.join(SHARING)}")
        if self.sharing != "auto" and self.op not in ATTENTION_OPS:
            raise ValueError(f"sharing: only sparse GQA ops have a shared path, not {self.op}")
        for name in ("batch", "context", "rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.rows > self.context:
            raise ValueError(f"rows: {self.rows} rows do not fit a context of {self.context}")

    @property
    def fmt(self) -> str:
        """Config-table format key: the storage format the op reads."""
        if self.op == "topk_expand":  # FP32 scores whatever the key format; keyed by rows
            from qsa.kernels.topk import table_format

            return table_format(self.batch * self.rows)
        return self.kv_format if self.op in KV_OPS else self.index_format

    @property
    def table_formats(self) -> tuple[str, ...]:
        """Every format key of the op's table whose entries this point can run: top-k's
        entries for many rows run at any row count, and sparse GQA's shared entries on any
        selection, so a compile check covers them too."""
        if self.op == "topk_expand":
            from qsa.kernels.topk import FORMAT, FORMAT_MANY_ROWS

            return FORMAT, FORMAT_MANY_ROWS
        if self.op in ATTENTION_OPS:  # the per-row entries and the shared path's
            from qsa.kernels.sparse_gqa import table_format

            return self.fmt, table_format(self.fmt, True)
        return (self.fmt,)

    def as_record(self) -> dict[str, Any]:
        return {"op": self.op, "preset": self.preset.name, "batch": self.batch,
                "context": self.context, "rows": self.rows, "index_format": self.index_format,
                "kv_format": self.kv_format, "seed": self.seed, "selection": self.selection,
                "overlap_target": None if self.trace else self.overlap,
                "sharing": self.sharing, "trace": self.trace, "trace_layer": self.trace_layer}


@dataclass
class Prepared:
    """Inputs of one point, ready to verify and time. `call(i, cfg)` runs the kernel on rotation
    set i; `check(cfg)` runs set 0 on poisoned outputs and raises VerificationError."""

    point: Point
    call: Callable[[int, BlockConfig | None], Any]
    check: Callable[[BlockConfig | None], None]
    work: Work
    n_sets: int
    bytes_per_set: int
    inputs: dict[str, Any]  # what the inputs measure (overlap) and what the call chose


@contextlib.contextmanager
def env_overrides(env: dict[str, str] | None) -> Iterator[None]:
    """Temporarily set environment toggles such as QSA_STACKED_DECODE_SCORER."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _interpreting(device: str) -> bool:
    return device == "cpu"


def kernel_view(t: torch.Tensor, device: str) -> torch.Tensor:
    """bf16 tensors reach interpreted kernels as fp32: the interpreter mishandles bf16."""
    return t.float() if _interpreting(device) and t.dtype == torch.bfloat16 else t


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# False while a point is prepared only to be verified: one input set, no rotated copies (a
# memory-checker run of a tiny shape would otherwise clone its inputs thousands of times).
_ROTATE: ContextVar[bool] = ContextVar("qsa_rotate_inputs", default=True)


def rotation_sets(base: dict[str, torch.Tensor], work: Work, dev: DeviceInfo
                  ) -> list[dict[str, torch.Tensor]]:
    """Copies of the tensors an op reads, enough that cycling through them exceeds three times
    the last-level cache (one set on the CPU, where times mean nothing, and when verifying)."""
    n = 1
    if dev.is_gpu and _ROTATE.get():
        n = sets_for_cold_cache(max(work.bytes_moved, 1), dev.llc_bytes)
        n = max(1, min(n, MAX_ROTATION_BYTES // max(_nbytes(base), 1)))
    return [base] + [{k: v.clone() for k, v in base.items()} for _ in range(n - 1)]


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float
                 ) -> None:
    """Same infinities, NaN (poison) exactly where the reference has it (slots the call must
    not write), and |got - want| <= atol + rtol * |want| elsewhere."""
    got, want = got.float().cpu(), want.float().cpu()
    if got.shape != want.shape:
        raise VerificationError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        raise VerificationError(f"{name}: {int((nan_g & ~nan_w).sum())} unwritten (poisoned) "
                                f"elements, {int((nan_w & ~nan_g).sum())} written where nothing "
                                "should be")
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
        raise VerificationError(f"{name}: infinite entries differ from the reference")
    fin = ~inf_w & ~nan_w
    g, w = got[fin], want[fin]
    excess = (g - w).abs() - (atol + rtol * w.abs())
    if (excess > 0).any():
        i = int(torch.argmax(excess))
        raise VerificationError(f"{name}: error {float((g[i] - w[i]).abs()):.3g} exceeds the "
                                f"tolerance at element {i} (got {float(g[i]):.6g}, want "
                                f"{float(w[i]):.6g})")


SAME_VALUES_CHUNK = 1 << 26  # elements compared at a time: 256 MiB of fp32 per side


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit by value: -0 equals +0, and poison (NaN) left where the reference has it
    too, i.e. in slots the call must not write, counts as equal. Compared where the tensors
    are, a chunk at a time: a whole cache plane copied to the host as fp32 (the K/V store's
    check compares every plane of the arena) took seconds per verified candidate."""
    if got.dtype != want.dtype:  # an fp32 surrogate of a bf16 field: compare as stored
        got = got.to(want.dtype)
    if got.shape != want.shape:
        return False
    if not want.dtype.is_floating_point:
        return torch.equal(got, want.to(got.device))
    g, w = got.reshape(-1), want.to(got.device).reshape(-1)
    return all(torch.allclose(g[i:i + SAME_VALUES_CHUNK].float(),
                              w[i:i + SAME_VALUES_CHUNK].float(), rtol=0, atol=0, equal_nan=True)
               for i in range(0, g.numel(), SAME_VALUES_CHUNK))


# Under the interpreter, in-kernel fp32 -> fp8 casts drop rounding carries (a code comes out at
# half its value, triton-lang/triton #8322) for a few percent of elements.


def assert_codes_match(name: str, got: torch.Tensor, want: torch.Tensor,
                       max_fraction: float) -> None:
    """Decoded values of the written slots: NaN (poison) where the reference has it, and at
    most `max_fraction` of the elements more than one quantization step (1/8 relative) off."""
    assert_close(name, got, want, atol=float("inf"), rtol=0.0)
    fin = torch.isfinite(want)
    wrong = ((got - want).abs() > 0.13 * want.abs() + 1e-6) & fin
    if float(wrong.sum()) > max_fraction * float(fin.sum()):
        raise VerificationError(f"{name}: {int(wrong.sum())} of {int(fin.sum())} elements differ "
                                "from the reference by more than one step")


# Ops whose inputs hold selections or the index queries that make them: the only ones whose
# cases are built (and calibrated) with the point's overlap.
SELECTING_OPS = ("score_stacked", "score_rowwise", "score_prefill", "topk_expand",
                 *ATTENTION_OPS)


def _case(point: Point, device: str, dev: DeviceInfo, build_kv: bool) -> Case:
    spec = CaseSpec(point.preset, (point.context,) * point.batch, (point.rows,) * point.batch,
                    index_format=point.index_format, kv_format=point.kv_format,
                    fp8_dtype=dev.fp8_dtype or torch.float8_e4m3fn, seed=point.seed,
                    build_kv=build_kv,
                    overlap=point.overlap if point.op in SELECTING_OPS else 0.0)
    return make_case(spec, device)


def _case_overlap(case: Case, point: Point) -> dict[str, Any]:
    """The overlap record of an index-path op: its rows' selections as calibrated (none for an
    op whose inputs hold no selection)."""
    return {"overlap_measured": case.overlap_measured if point.op in SELECTING_OPS else None}


def _index_planes(case: Case, device: str) -> dict[str, torch.Tensor]:
    return {k: kernel_view(v, device) for k, v in case.cache.items()
            if k.startswith("index_compressed")}


def _prepare_score(point: Point, device: str, dev: DeviceInfo) -> Prepared:
    from qsa.kernels import score_prefill, score_rowwise, score_stacked

    mod = {"score_stacked": score_stacked, "score_rowwise": score_rowwise,
           "score_prefill": score_prefill}[point.op]
    fn = getattr(mod, point.op)
    # The row bound the wrapper would otherwise read from the device: without it a call can
    # not be captured in a graph, and its timing falls back to device events.
    extra = ({"max_rows_per_request": point.rows}
             if point.op in ("score_stacked", "score_prefill") else {})
    case = _case(point, device, dev, build_kv=False)
    p, fmt = point.preset, point.index_format
    want = score_reference(case.cache, case.batch, case.q_index, p, fmt)
    work = mod.work(case.batch, p, fmt)
    q = kernel_view(case.q_index.to(torch.bfloat16), device)  # kernels take bf16 queries
    sets = rotation_sets({**_index_planes(case, device), "q_index": q}, work, dev)
    outs = [torch.empty_like(want) for _ in sets]

    def call(i: int, cfg: BlockConfig | None) -> torch.Tensor:
        s = sets[i]
        cache = {k: v for k, v in s.items() if k != "q_index"}
        return fn(cache, case.batch, s["q_index"], p, fmt, out=outs[i], config=cfg, **extra)

    def check(cfg: BlockConfig | None) -> None:
        poison_(outs[0])
        # bf16 queries and MMA operands against an FP32 reference
        assert_close(point.op, call(0, cfg), want, atol=SCORE_ATOL, rtol=SCORE_RTOL)

    return Prepared(point, call, check, work, len(sets), _nbytes(sets[0]),
                    _case_overlap(case, point))


def _prepare_topk(point: Point, device: str, dev: DeviceInfo) -> Prepared:
    from qsa.kernels import topk

    case = _case(point, device, dev, build_kv=False)
    p = point.preset
    scores = score_reference(case.cache, case.batch, case.q_index, p, point.index_format)
    want = topk_expand_reference(scores, case.batch, p)
    work = topk.work(p, case.batch.num_rows, scores.shape[1])
    sets = rotation_sets({"scores": scores}, work, dev)
    outs = [torch.empty_like(want) for _ in sets]

    def call(i: int, cfg: BlockConfig | None) -> torch.Tensor:
        return topk.topk_expand(sets[i]["scores"], case.batch, p, config=cfg, out=outs[i])

    def check(cfg: BlockConfig | None) -> None:
        outs[0].fill_(-2)
        got = call(0, cfg).cpu()
        diff = (got != want.cpu()).any(1)
        if diff.any():
            raise VerificationError(f"topk_expand: row {int(diff.nonzero()[0])} selects other "
                                    "tokens than the reference")

    return Prepared(point, call, check, work, len(sets), _nbytes(sets[0]),
                    _case_overlap(case, point))


def _prepare_compress(point: Point, device: str, dev: DeviceInfo) -> Prepared:
    from qsa.kernels import compress

    case = _case(point, device, dev, build_kv=False)
    p, fmt = point.preset, point.index_format
    start = pass_start_positions(case.batch)
    want = {k: v.clone() for k, v in case.cache.items() if k.startswith("index_compressed")}
    groups = int((case.batch.context_lens // 4 - start // 4).clamp(min=0).sum())
    work = compress.work(p, fmt, groups)
    inv_freq = rope_inv_freq(p).to(device)
    sets = rotation_sets({k: kernel_view(v, device) for k, v in case.cache.items()}, work, dev)

    def call(i: int, cfg: BlockConfig | None) -> None:
        compress.compress_index_keys(sets[i], case.batch, start, case.rms_weight, inv_freq, p,
                                     fmt, config=cfg)

    req, grp = completed_groups(case.batch, start)
    slot = case.batch.slots(req, grp * 4)
    blk, off = slot // p.block_size, (slot % p.block_size) // 4

    def check(cfg: BlockConfig | None) -> None:
        for k in want:  # poison exactly the slots this pass must write
            sets[0][k][blk, off] = poison_(sets[0][k][blk, off])
        call(0, cfg)
        scale = "index_compressed_scale"
        got = dequantize_index(sets[0]["index_compressed"].to(want["index_compressed"].dtype),
                               sets[0].get(scale), fmt)
        ref = dequantize_index(want["index_compressed"], want.get(scale), fmt)
        # Keys pass through sin/cos, whose last bits differ between devices and libraries; a
        # 1-ulp input change may move a code by one quantization step: allow 1% of elements.
        assert_close("compress", got, ref, atol=float("inf"), rtol=0.0)  # every slot written
        others = torch.ones(got.shape[:2], dtype=torch.bool, device=got.device)
        others[blk, off] = False
        for k, plane in want.items():  # and no other slot touched, bit for bit
            if not same_values(sets[0][k][others], plane[others]):
                raise VerificationError(f"compress: {k} changed outside the groups of this pass")
        frac = (INTERPRETER_FP8_MISMATCH if fmt == "fp8" and _interpreting(device)
                else CODE_MISMATCH)
        assert_codes_match("compress", got[blk, off], ref[blk, off], frac)

    return Prepared(point, call, check, work, len(sets), _nbytes(sets[0]),
                    _case_overlap(case, point))


def _prepare_kv_store(point: Point, device: str, dev: DeviceInfo) -> Prepared:
    from qsa.kernels import kv_quant

    case = _case(point, device, dev, build_kv=True)
    p, fmt = point.preset, point.kv_format
    slots = row_slots(case.batch).to(torch.int64)
    want = {k: case.cache[k].clone() for k in kv_field_names(case.cache)}
    work = kv_quant.work(p, case.batch.num_rows, fmt)
    base = {"k_new": kernel_view(case.k_new, device), "v_new": kernel_view(case.v_new, device),
            **{k: kernel_view(v, device) for k, v in want.items()}}
    sets = rotation_sets(base, work, dev)

    def call(i: int, cfg: BlockConfig | None) -> None:
        s = sets[i]
        kv_quant.store_kv({k: s[k] for k in want}, slots, s["k_new"], s["v_new"], fmt,
                          config=cfg)

    def check(cfg: BlockConfig | None) -> None:
        s = sets[0]
        rs = slots
        for k in want:  # poison exactly the slots the call must write
            s[k][rs // p.block_size, rs % p.block_size] = poison_(s[k][:1, :1].clone())[0, 0]
        call(0, cfg)
        for k, ref in want.items():
            got = s[k]
            if got.dtype.is_floating_point and got.element_size() == 1 and _interpreting(device):
                assert_codes_match(k, got.float(), ref.float(), INTERPRETER_FP8_MISMATCH)
            elif not same_values(got, ref):  # on a GPU: bit-exact by value
                raise VerificationError(f"kv_store: {k} differs from the reference")

    return Prepared(point, call, check, work, len(sets), _nbytes(sets[0]),
                    _case_overlap(case, point))


def _prepare_attention(point: Point, device: str, dev: DeviceInfo) -> Prepared:
    from qsa.kernels import sparse_gqa

    prefill = point.op == "sparse_gqa_prefill"
    fn = sparse_gqa.sparse_gqa_prefill if prefill else sparse_gqa.sparse_gqa_decode
    p, fmt = point.preset, point.kv_format
    if point.selection in ("random", "trace"):
        # Only the page table, q and the selected pages: no index path, no whole contexts.
        if point.trace is not None:
            trace = read_trace(point.trace, p)
            spec = CaseSpec(p, tuple(trace.context_lens.tolist()), trace.rows_per_request,
                            seed=point.seed)
        else:
            spec = CaseSpec.decode(p, point.batch, point.context, point.rows, seed=point.seed)
        full = make_batch(spec, torch.Generator().manual_seed(point.seed), device)
        gen = torch.Generator(device=device).manual_seed(point.seed + 7)
        q = torch.randn((full.num_rows, p.num_q_heads, p.head_dim), generator=gen,
                        device=device).to(torch.bfloat16)
        if point.trace is not None:
            ids = trace.token_ids(point.trace_layer, device)
        else:
            ids, _ = random_selection(full, p, selection_generator(point.seed), point.overlap)
        batch, pools = touched_kv_pool(full, ids, p, (fmt,), point.seed + 8,
                                       dev.fp8_dtype or torch.float8_e4m3fn)
        cache = pools[fmt]
    else:
        case = _case(point, device, dev, build_kv=True)
        scores = score_reference(case.cache, case.batch, case.q_index, p, point.index_format)
        ids = topk_expand_reference(scores, case.batch, p)
        batch, cache, q = case.batch, case.cache, case.q
    want = sparse_gqa_reference(q, cache, batch, ids, fmt, p.softmax_scale)
    work = sparse_gqa.work(ids, batch, p, fmt)
    kv = {k: kernel_view(cache[k], device) for k in kv_field_names(cache)}
    sets = rotation_sets({**kv, "q": kernel_view(q, device)}, work, dev)
    outs = [torch.empty(q.shape, dtype=sets[0]["q"].dtype, device=device) for _ in sets]
    # Per call, from the union these ids make: the per-row or the shared path.
    plan = sparse_gqa.plan_sharing(ids, batch, p, fmt, prefill=prefill)
    shared = plan.shared if point.sharing == "auto" else point.sharing == "shared"
    inputs = {**ov.measure(ids, batch, plan.rows).as_record(
                  None if point.trace else point.overlap),
              "path": "shared" if shared else "per-row",
              "share_max_union": plan.max_union_ratio}

    # A random-selection pool holds only the selected pages: the page table has holes (-1)
    # that the batch check would refuse, so only the reference comparison checks the call.
    checked = {"check": False} if point.selection != "index" else {}

    def call(i: int, cfg: BlockConfig | None) -> torch.Tensor:
        s = sets[i]
        return fn(s["q"], {k: s[k] for k in kv}, batch, ids, p, fmt, out=outs[i],
                  config=cfg, shared=shared, **checked)

    def check(cfg: BlockConfig | None) -> None:
        poison_(outs[0])
        assert_close(point.op, call(0, cfg), want, atol=ATTENTION_ATOL,
                     rtol=ATTENTION_RTOL)

    return Prepared(point, call, check, work, len(sets), _nbytes(sets[0]), inputs)


_PREPARERS: dict[str, Callable[[Point, str, DeviceInfo], Prepared]] = {
    "score_stacked": _prepare_score, "score_rowwise": _prepare_score,
    "score_prefill": _prepare_score, "topk_expand": _prepare_topk,
    "compress": _prepare_compress, "kv_store": _prepare_kv_store,
    "sparse_gqa_decode": _prepare_attention, "sparse_gqa_prefill": _prepare_attention,
}


def config_coordinate(prep: Prepared) -> Lookup:
    """The config-table coordinate (kernel, format, bucket size) the op's kernel looks its
    table entry up at for this point, observed from one verified run of the kernel with its
    table config. Refuses an op whose call resolves more than one coordinate."""
    kernel = KERNEL_OF[prep.point.op]
    with observe_lookups() as seen:
        prep.check(None)
    found = {(s.kernel, s.fmt, s.size): s for s in seen if s.kernel == kernel}
    if len(found) != 1:
        why = ("" if len(found) < 2 else
               ": the call reads more than one table entry, so no single entry decides its "
               "speed (score_prefill scores FP8/MXFP4 keys from their entry's "
               "DECODE_MIN_GROUPS groups on with the BF16 entry's tiles); tune the entry it "
               "borrows, or a shape below that threshold for the format's own entry")
        raise RuntimeError(f"{prep.point.op}: expected one config lookup of {kernel!r}, "
                           f"saw {sorted(found) or 'none'}{why}")
    return next(iter(found.values()))


def prepare(point: Point, device: str | None = None) -> Prepared:
    dev = detect_device()
    device = device or ("cuda" if dev.is_gpu else "cpu")
    return _PREPARERS[point.op](point, device, dev)


def _verified_record(point: Point, config: BlockConfig | None) -> dict[str, Any]:
    """The columns of a verified point before its timing: shape, kernel, config."""
    return {**point.as_record(), "kernel": KERNEL_OF[point.op],
            "config": json.dumps(config.as_dict() if config else None, sort_keys=True),
            "verified": True}


def measure_prepared(prep: Prepared, config: BlockConfig | None = None,
                     samples: int | None = None, twice: bool = False) -> dict[str, Any]:
    """Verify, then time, one prepared point under one config; one flat record. With `twice`,
    the point is timed a second time in the same run and the record carries the repeat and
    the noise verdict (`repeat_same_within_noise`), so a caller can tell noise from change."""
    dev = detect_device()
    prep.check(config)
    kw: dict[str, Any] = {"bytes_per_set": prep.bytes_per_set}
    if samples is not None:
        kw["samples"] = samples
    fn = lambda i: prep.call(i, config)  # noqa: E731
    repeat: dict[str, Any] = {}
    if twice:
        tt = time_twice(fn, prep.n_sets, **kw)
        timing, repeat = tt.first, tt.as_record()
    else:
        timing = time_fn(fn, prep.n_sets, **kw)
    ceilings = load_or_measure_ceilings(dev) if dev.is_gpu else None
    matrix = "fp8" if prep.point.fmt == "fp8" and prep.point.op == "score_prefill" else "bf16"
    rec: dict[str, Any] = {
        **_verified_record(prep.point, config),
        **prep.inputs,
        **timing.as_record(),
        **{k: v for k, v in repeat.items() if k.startswith(("repeat_", "noise_"))},
        **roofline_record(timing, prep.work, ceilings, matrix=matrix),
    }
    rec["us"] = rec["median_us"]
    return rec


def measure(op: str, *, preset: str | ModelPreset = DEFAULT_PRESET, batch: int,
            context: int,
            rows: int, index_format: str = "bf16", kv_format: str = "bf16",
            config: BlockConfig | None = None, device: str | None = None,
            env: dict[str, str] | None = None, seed: int = 0,
            samples: int | None = None, selection: str = "index", timed: bool = True,
            overlap: float = 0.0, sharing: str = "auto", trace: str | None = None,
            trace_layer: int | None = None) -> dict[str, Any]:
    """Build, verify and time one point; see the module docstring. `timed=False` verifies
    only (one input set, no timing): quick checks and memory-checker runs."""
    with env_overrides(env):
        point = Point(op, as_preset(preset), batch, context, rows, index_format, kv_format,
                      seed, selection, overlap, sharing, trace, trace_layer)
        if timed:
            rec = measure_prepared(prepare(point, device), config, samples)
        else:
            token = _ROTATE.set(False)
            try:
                prep = prepare(point, device)
                prep.check(config)
            finally:
                _ROTATE.reset(token)
            rec = {**_verified_record(point, config), **prep.inputs, "us": None}
    rec["env"] = json.dumps(env or {}, sort_keys=True)
    return rec
