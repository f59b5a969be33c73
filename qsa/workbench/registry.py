"""The op registry: one `OpSpec` per op, the one place that says what an op is.

An op is one kernel call the workbench measures. Its spec names the kernel wrapper, the config
table (whose schema is `qsa.configs.schema`'s), the float32 reference, the input builder with
its check and tolerance (`qsa.tolerances`), the work model (bytes, FLOPs), the storage format
it reads, whether it takes selections, where it runs in a layer pass, the smoke points the
smoke suite and the compile check run, and the test module that exercises it. `workbench.ops`,
the tuner, the step roll-up, reports, the compile check, suites, the CLI and the notebooks read
this registry instead of lists of their own; `tests/test_registry.py` holds it to the kernels,
tables and tests.

Layout, and why:
* Config schemas are data in `qsa.configs.schema`, beside the tables: kernels import
  `qsa.configs`, and a table is checked where it is loaded.
* Everything else is declared here, one spec per op, each kernel family's specs next to its
  input builder. `Point` (a shape of an op) and `Prepared` (its built inputs) live here too: a
  point is checked against its op's spec, and the builders take points.
* The CLI reads the registry (`--op` choices and help) before it decides whether kernels run
  under Triton's interpreter, which must happen before a kernel module is imported. So this
  module imports neither the kernels nor torch: kernel wrappers, references and work models
  are named by `Ref` (module and attribute, imported on first use; every one lies below this
  module, which the registry tests check), and each builder imports what it runs when it runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Literal

from qsa.configs.schema import ConfigSchema, schema_of
from qsa.measure.work import Work
from qsa.presets import ModelPreset
from qsa.tolerances import (ATTENTION_ATOL, ATTENTION_RTOL, CODE_MISMATCH,
                            INTERPRETER_FP8_MISMATCH, SCORE_ATOL, SCORE_RTOL)

if TYPE_CHECKING:
    from qsa.cases import Case
    from qsa.configs import BlockConfig
    from qsa.measure.device import DeviceInfo

# How a sparse-attention point picks its token ids: the index path on realistic keys (scores,
# top-k), or `random` (random groups per row, K/V pool holding only the selected pages, so 128K
# contexts at batch 64 fit), or `trace` (a selection trace's, `qsa.trace`: its requests and rows,
# K/V random). The first two take the point's `overlap`, how much neighbouring rows'
# selections overlap (0: independent rows, the worst case for sharing K/V tiles).
SELECTIONS = ("index", "random", "trace")
# Which sparse GQA path a point runs: chosen per call from the measured union (`auto`, what
# production does), or forced, so both paths can be timed side by side on the same inputs.
SHARING = ("auto", "per-row", "shared")
PHASES = ("decode", "prefill")  # of a step: a decode step, or one prefill chunk
Storage = Literal["index", "kv", "scores"]


@dataclass(frozen=True)
class Ref:
    """An object of a module (a function, a constant), named by module and attribute and
    imported on first use (see the module docstring). Looked up at every use, so a test may
    replace it in its module."""

    module: str
    name: str

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Tolerance:
    """How close a kernel's output must be to its reference, values from `qsa.tolerances`:
    |got - want| <= atol + rtol * |want| for computed values, at most `mismatch` of the stored
    codes one quantization step off; all zero: the same values, bit for bit. Under the
    interpreter FP8 codes may be off by `INTERPRETER_FP8_MISMATCH` whatever the op's value."""

    atol: float = 0.0
    rtol: float = 0.0
    mismatch: float = 0.0


@dataclass(frozen=True)
class StepRole:
    """Where an op runs in one layer pass of a step (`qsa.workbench.step`): its position and
    the phases that call it. Ops that share a position are alternatives: the first whose
    `chosen` holds (or that has none) runs, as the runtime's own dispatch chooses."""

    order: int
    phases: tuple[str, ...]
    chosen: Ref | None = None


@dataclass(frozen=True)
class ForcedPath:
    """A path a call takes only at shapes past the smoke points, forced on by the kernel's
    environment toggle `env` so that the compile check covers it too, for the formats whose
    entries carry the config key `key` that gates it."""

    label: str
    env: Ref
    key: str


@dataclass(frozen=True)
class OpSpec:
    """What an op is (see the module docstring). `builds_overlap`: its inputs hold selections,
    or the index queries that make them, so they are built at the point's overlap.
    `takes_selection`: it can be given random or traced selections and a forced sharing path.
    `table_format`: the kernel's rule from rows to its table's format, where that is not the
    storage format. `fp8_matrix`: FP8 calls are held to the FP8 matrix-unit ceiling."""

    name: str  # as points, records and `qsa bench --op` name it
    summary: str  # one line, for help texts
    entry: Ref  # the kernel wrapper (qsa.kernels)
    table: str  # its config table: the records' "kernel" column
    reference: Ref  # the float32 oracle (qsa.reference)
    inputs: Callable[[OpSpec, Point, str, DeviceInfo], Prepared]  # a point's inputs and check
    work: Ref  # bytes and FLOPs of a call (the kernel module's model)
    tolerance: Tolerance  # how close to the reference its output must be
    storage: Storage  # what it reads: the index cache, the K/V cache, or FP32 scores
    test: str  # the test module that exercises the wrapper
    smoke: tuple[dict[str, Any], ...]  # grids of its smoke points (smoke suite, compile check)
    builds_overlap: bool = False
    takes_selection: bool = False
    step: StepRole | None = None
    table_format: Ref | None = None
    fp8_matrix: bool = False
    forced: tuple[ForcedPath, ...] = ()

    @property
    def schema(self) -> ConfigSchema:
        return schema_of(self.table)

    def build(self, point: Point, device: str, dev: DeviceInfo) -> Prepared:
        """The point's inputs, call and check (`inputs`)."""
        return self.inputs(self, point, device, dev)

    def storage_format(self, index_format: str, kv_format: str) -> str:
        """The format the op reads: the index or K/V format, or the one its scores have."""
        if self.storage == "index":
            return index_format
        if self.storage == "kv":
            return kv_format
        (fmt,) = set(self.schema.formats.values())
        return fmt


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
        from qsa.overlap import check_target  # torch: not for the CLI's import (docstring)

        spec = find(self.op)
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection: {self.selection!r} is not one of "
                             f"{', '.join(SELECTIONS)}")
        if self.selection in ("random", "trace") and not spec.takes_selection:
            raise ValueError(f"selection: {self.selection} selections are for "
                             f"{_selecting()}, not {self.op}")
        if (self.selection == "trace") != (self.trace is not None):
            raise ValueError("selection: a trace file goes with selection trace, and back")
        if self.trace is not None and self.overlap:
            raise ValueError("overlap: a trace's selections overlap as they were recorded")
        check_target(self.overlap)
        if self.sharing not in SHARING:
            raise ValueError(f"sharing: {self.sharing!r} is not one of {', '.join(SHARING)}")
        if self.sharing != "auto" and not spec.takes_selection:
            raise ValueError(f"sharing: only {_selecting()} have a shared path, not {self.op}")
        for name in ("batch", "context", "rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.rows > self.context:
            raise ValueError(f"rows: {self.rows} rows do not fit a context of {self.context}")

    @property
    def spec(self) -> OpSpec:
        return find(self.op)

    @property
    def fmt(self) -> str:
        """Config-table format key: the storage format the op reads, or where the kernel keys
        its table otherwise (top-k: by rows), that key."""
        if self.spec.table_format is not None:
            return self.spec.table_format(self.batch * self.rows)
        return self.spec.storage_format(self.index_format, self.kv_format)

    @property
    def table_formats(self) -> tuple[str, ...]:
        """Every format key of the op's table whose entries this point can run (those serving
        its storage format): top-k's entries for many rows run at any row count, and sparse
        GQA's shared entries on any selection, so a compile check covers them too."""
        reads = self.spec.storage_format(self.index_format, self.kv_format)
        return tuple(f for f, serves in self.spec.schema.formats.items() if serves == reads)

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
    sets: list[dict[str, Any]]  # the rotated input sets `call` cycles through (tensors by name)
    inputs: dict[str, Any]  # what the inputs measure (overlap) and what the call chose

    @property
    def n_sets(self) -> int:
        return len(self.sets)

    @property
    def bytes_per_set(self) -> int:
        from qsa.workbench.verify import nbytes

        return nbytes(self.sets[0])


# ------------------------------------------------------------------------------------------------
# Input builders: a point's inputs from `qsa.cases`, the kernel call on rotated copies, and the
# check of its output against the reference on poisoned outputs
# ------------------------------------------------------------------------------------------------

def _case(spec: OpSpec, point: Point, device: str, dev: DeviceInfo, build_kv: bool) -> Case:
    import torch

    from qsa.cases import CaseSpec, make_case

    return make_case(CaseSpec(point.preset, (point.context,) * point.batch,
                              (point.rows,) * point.batch, index_format=point.index_format,
                              kv_format=point.kv_format,
                              fp8_dtype=dev.fp8_dtype or torch.float8_e4m3fn, seed=point.seed,
                              build_kv=build_kv,
                              overlap=point.overlap if spec.builds_overlap else 0.0), device)


def _case_overlap(spec: OpSpec, case: Case) -> dict[str, Any]:
    """The overlap record of an index-path op: its rows' selections as calibrated (none for an
    op whose inputs hold no selection)."""
    return {"overlap_measured": case.overlap_measured if spec.builds_overlap else None}


def _score_inputs(spec: OpSpec, point: Point, device: str, dev: DeviceInfo, *,
                  row_bound: bool) -> Prepared:
    """An index scorer on the case's compressed keys; `row_bound`: the wrapper takes the
    bound on rows per request that it would otherwise read from the device (without it a call
    can not be captured in a graph, and its timing falls back to device events)."""
    import torch

    from qsa.cases import poison_
    from qsa.workbench.verify import assert_close, kernel_view, rotation_sets

    extra = {"max_rows_per_request": point.rows} if row_bound else {}
    case = _case(spec, point, device, dev, build_kv=False)
    p, fmt = point.preset, point.index_format
    want = spec.reference(case.cache, case.batch, case.q_index, p, fmt)
    work = spec.work(case.batch, p, fmt)
    q = kernel_view(case.q_index.to(torch.bfloat16), device)  # kernels take bf16 queries
    planes = {k: kernel_view(v, device) for k, v in case.cache.items()
              if k.startswith("index_compressed")}
    sets = rotation_sets({**planes, "q_index": q}, work, dev)
    outs = [torch.empty_like(want) for _ in sets]

    def call(i: int, cfg: BlockConfig | None) -> torch.Tensor:
        s = sets[i]
        cache = {k: v for k, v in s.items() if k != "q_index"}
        return spec.entry(cache, case.batch, s["q_index"], p, fmt, out=outs[i], config=cfg,
                          **extra)

    def check(cfg: BlockConfig | None) -> None:
        poison_(outs[0])
        tol = spec.tolerance
        assert_close(spec.name, call(0, cfg), want, atol=tol.atol, rtol=tol.rtol)

    return Prepared(point, call, check, work, sets, _case_overlap(spec, case))


SCORER_SMOKE = ({"batch": 2, "context": 96, "index_format": ["bf16", "fp8", "mxfp4"]},)
_SCORES = Ref("qsa.reference.score", "score_reference")
_SCORE_TOLERANCE = Tolerance(SCORE_ATOL, SCORE_RTOL)  # bf16 queries and MMA operands
_SCORER_TEST = "tests/test_kernel_scorers.py"
SCORE_STACKED = OpSpec(
    "score_stacked", "decode scorer: a request's rows x index heads in one MMA operand",
    entry=Ref("qsa.kernels.score_stacked", "score_stacked"), table="score_stacked",
    reference=_SCORES, inputs=partial(_score_inputs, row_bound=True),
    work=Ref("qsa.kernels.score_stacked", "work"), tolerance=_SCORE_TOLERANCE, storage="index",
    test=_SCORER_TEST, smoke=SCORER_SMOKE, builds_overlap=True,
    step=StepRole(2, ("decode",), chosen=Ref("qsa.kernels.scoring", "stacked_decode_enabled")))
SCORE_ROWWISE = OpSpec(
    "score_rowwise", "row-wise decode scorer, the baseline (QSA_STACKED_DECODE_SCORER=0)",
    entry=Ref("qsa.kernels.score_rowwise", "score_rowwise"), table="score_rowwise",
    reference=_SCORES, inputs=partial(_score_inputs, row_bound=False),
    work=Ref("qsa.kernels.score_rowwise", "work"), tolerance=_SCORE_TOLERANCE, storage="index",
    test=_SCORER_TEST, smoke=SCORER_SMOKE, builds_overlap=True, step=StepRole(2, ("decode",)))
SCORE_PREFILL = OpSpec(
    "score_prefill", "prefill scorer: matrix-core tiles over many rows, causal",
    entry=Ref("qsa.kernels.score_prefill", "score_prefill"), table="score_prefill",
    reference=_SCORES, inputs=partial(_score_inputs, row_bound=True),
    work=Ref("qsa.kernels.score_prefill", "work"), tolerance=_SCORE_TOLERANCE, storage="index",
    test=_SCORER_TEST,
    smoke=({"batch": 1, "context": 48, "rows": 48, "index_format": ["bf16", "fp8", "mxfp4"]},),
    builds_overlap=True, step=StepRole(2, ("prefill",)), fp8_matrix=True,
    forced=(ForcedPath("keys decoded once: the table's lookups",
                       Ref("qsa.kernels.score_prefill", "DECODE_ENV"), "DECODE_MIN_GROUPS"),))


def _topk_inputs(spec: OpSpec, point: Point, device: str, dev: DeviceInfo) -> Prepared:
    """Top-k + expand over the reference scores of the case's keys; the ids must equal the
    reference's exactly."""
    import torch

    from qsa.reference import score_reference
    from qsa.workbench.verify import VerificationError, rotation_sets

    case = _case(spec, point, device, dev, build_kv=False)
    p = point.preset
    scores = score_reference(case.cache, case.batch, case.q_index, p, point.index_format)
    want = spec.reference(scores, case.batch, p)
    work = spec.work(p, case.batch.num_rows, scores.shape[1])
    sets = rotation_sets({"scores": scores}, work, dev)
    outs = [torch.empty_like(want) for _ in sets]

    def call(i: int, cfg: BlockConfig | None) -> torch.Tensor:
        return spec.entry(sets[i]["scores"], case.batch, p, config=cfg, out=outs[i])

    def check(cfg: BlockConfig | None) -> None:
        outs[0].fill_(-2)
        got = call(0, cfg).cpu()
        diff = (got != want.cpu()).any(1)
        if diff.any():
            raise VerificationError(f"{spec.name}: row {int(diff.nonzero()[0])} selects other "
                                    "tokens than the reference")

    return Prepared(point, call, check, work, sets, _case_overlap(spec, case))


TOPK_EXPAND = OpSpec(
    "topk_expand", "top-k groups per row, expanded to token ids with the tail",
    entry=Ref("qsa.kernels.topk", "topk_expand"), table="topk",
    reference=Ref("qsa.reference.topk", "topk_expand_reference"), inputs=_topk_inputs,
    work=Ref("qsa.kernels.topk", "work"), tolerance=Tolerance(), storage="scores",
    test="tests/test_kernel_topk.py", smoke=SCORER_SMOKE, builds_overlap=True,
    step=StepRole(3, PHASES), table_format=Ref("qsa.kernels.topk", "table_format"))


def _compress_inputs(spec: OpSpec, point: Point, device: str, dev: DeviceInfo) -> Prepared:
    """Compress of the groups this pass completes; the case's compressed caches, written by
    the reference (`qsa.cases`), are what the kernel must write, and nothing else."""
    import torch

    from qsa.cases import poison_
    from qsa.formats import dequantize_index
    from qsa.reference import rope_inv_freq
    from qsa.reference.compress import completed_groups
    from qsa.reference.pipeline import pass_start_positions
    from qsa.workbench.verify import (VerificationError, assert_close, assert_codes_match,
                                      interpreting, kernel_view, rotation_sets,
                                      same_values)

    case = _case(spec, point, device, dev, build_kv=False)
    p, fmt = point.preset, point.index_format
    start = pass_start_positions(case.batch)
    want = {k: v.clone() for k, v in case.cache.items() if k.startswith("index_compressed")}
    groups = int((case.batch.context_lens // 4 - start // 4).clamp(min=0).sum())
    work = spec.work(p, fmt, groups)
    inv_freq = rope_inv_freq(p).to(device)
    sets = rotation_sets({k: kernel_view(v, device) for k, v in case.cache.items()}, work, dev)

    def call(i: int, cfg: BlockConfig | None) -> None:
        spec.entry(sets[i], case.batch, start, case.rms_weight, inv_freq, p, fmt, config=cfg)

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
        assert_close(spec.name, got, ref, atol=float("inf"), rtol=0.0)  # every slot written
        others = torch.ones(got.shape[:2], dtype=torch.bool, device=got.device)
        others[blk, off] = False
        for k, plane in want.items():  # and no other slot touched, bit for bit
            if not same_values(sets[0][k][others], plane[others]):
                raise VerificationError(f"{spec.name}: {k} changed outside the groups of this "
                                        "pass")
        frac = (INTERPRETER_FP8_MISMATCH if fmt == "fp8" and interpreting(device)
                else spec.tolerance.mismatch)
        assert_codes_match(spec.name, got[blk, off], ref[blk, off], frac)

    return Prepared(point, call, check, work, sets, _case_overlap(spec, case))


COMPRESS = OpSpec(
    "compress", "index-key compress: mean-pool, norm, rotate, quantize, scatter",
    entry=Ref("qsa.kernels.compress", "compress_index_keys"), table="compress",
    reference=Ref("qsa.reference.compress", "compress_reference"), inputs=_compress_inputs,
    work=Ref("qsa.kernels.compress", "work"), tolerance=Tolerance(mismatch=CODE_MISMATCH),
    storage="index", test="tests/test_kernel_compress.py", smoke=SCORER_SMOKE,
    step=StepRole(0, PHASES))


def _kv_store_inputs(spec: OpSpec, point: Point, device: str, dev: DeviceInfo) -> Prepared:
    """The K/V store of the case's new tokens; the case's K/V planes, written by the reference
    (`qsa.cases`), are what the kernel must write: bit for bit on a GPU."""
    from qsa.arena.fields import kv_field_names
    from qsa.cases import poison_
    from qsa.reference.pipeline import row_slots
    from qsa.workbench.verify import (VerificationError, assert_codes_match, interpreting,
                                      kernel_view, rotation_sets, same_values)

    case = _case(spec, point, device, dev, build_kv=True)
    p, fmt = point.preset, point.kv_format
    slots = row_slots(case.batch).long()
    want = {k: case.cache[k].clone() for k in kv_field_names(case.cache)}
    work = spec.work(p, case.batch.num_rows, fmt)
    base = {"k_new": kernel_view(case.k_new, device), "v_new": kernel_view(case.v_new, device),
            **{k: kernel_view(v, device) for k, v in want.items()}}
    sets = rotation_sets(base, work, dev)

    def call(i: int, cfg: BlockConfig | None) -> None:
        s = sets[i]
        spec.entry({k: s[k] for k in want}, slots, s["k_new"], s["v_new"], fmt, config=cfg)

    def check(cfg: BlockConfig | None) -> None:
        s = sets[0]
        for k in want:  # poison exactly the slots the call must write
            s[k][slots // p.block_size, slots % p.block_size] = poison_(s[k][:1, :1].clone())[0, 0]
        call(0, cfg)
        for k, ref in want.items():
            got = s[k]
            if got.dtype.is_floating_point and got.element_size() == 1 and interpreting(device):
                assert_codes_match(k, got.float(), ref.float(), INTERPRETER_FP8_MISMATCH)
            elif not same_values(got, ref):  # on a GPU: bit-exact by value
                raise VerificationError(f"{spec.name}: {k} differs from the reference")

    return Prepared(point, call, check, work, sets, _case_overlap(spec, case))


KV_STORE = OpSpec(
    "kv_store", "K/V quantize-and-store of the new tokens, one launch",
    entry=Ref("qsa.kernels.kv_quant", "store_kv"), table="kv_quant",
    reference=Ref("qsa.reference.kv", "store_kv_reference"), inputs=_kv_store_inputs,
    work=Ref("qsa.kernels.kv_quant", "work"), tolerance=Tolerance(), storage="kv",
    test="tests/test_kernel_kv_quant.py",
    smoke=({"batch": 1, "context": 48, "rows": 48, "kv_format": ["bf16", "fp8"]},),
    step=StepRole(1, PHASES))


def _attention_inputs(spec: OpSpec, point: Point, device: str, dev: DeviceInfo, *,
                      prefill: bool) -> Prepared:
    """Sparse GQA over the point's selections: the index path's on the case's keys, random
    ones, or a trace's (then only the page table, q and the selected pages are built, no index
    path and no whole contexts); the path, per-row or shared, as the point asks. `prefill`:
    the call sharing is planned for is the prefill kernel's."""
    import torch

    from qsa import overlap as ov
    from qsa.arena.fields import kv_field_names
    from qsa.cases import (CaseSpec, make_batch, poison_, random_selection,
                           selection_generator, touched_kv_pool)
    from qsa.kernels.sparse_gqa import plan_sharing
    from qsa.reference import score_reference, topk_expand_reference
    from qsa.trace import read_trace
    from qsa.workbench.verify import assert_close, kernel_view, rotation_sets

    p, fmt = point.preset, point.kv_format
    if point.selection in ("random", "trace"):
        if point.trace is not None:
            trace = read_trace(point.trace, p)
            cspec = CaseSpec(p, tuple(trace.context_lens.tolist()), trace.rows_per_request,
                             seed=point.seed)
        else:
            cspec = CaseSpec.decode(p, point.batch, point.context, point.rows, seed=point.seed)
        full = make_batch(cspec, torch.Generator().manual_seed(point.seed), device)
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
        case = _case(spec, point, device, dev, build_kv=True)
        scores = score_reference(case.cache, case.batch, case.q_index, p, point.index_format)
        ids = topk_expand_reference(scores, case.batch, p)
        batch, cache, q = case.batch, case.cache, case.q
    want = spec.reference(q, cache, batch, ids, fmt, p.softmax_scale)
    work = spec.work(ids, batch, p, fmt)
    kv = {k: kernel_view(cache[k], device) for k in kv_field_names(cache)}
    sets = rotation_sets({**kv, "q": kernel_view(q, device)}, work, dev)
    outs = [torch.empty(q.shape, dtype=sets[0]["q"].dtype, device=device) for _ in sets]
    # Per call, from the union these ids make: the per-row or the shared path.
    plan = plan_sharing(ids, batch, p, fmt, prefill=prefill)
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
        return spec.entry(s["q"], {k: s[k] for k in kv}, batch, ids, p, fmt, out=outs[i],
                          config=cfg, shared=shared, **checked)

    def check(cfg: BlockConfig | None) -> None:
        poison_(outs[0])
        tol = spec.tolerance
        assert_close(spec.name, call(0, cfg), want, atol=tol.atol, rtol=tol.rtol)

    return Prepared(point, call, check, work, sets, inputs)


_ATTENTION = Ref("qsa.reference.attention", "sparse_gqa_reference")
# P rounded to bf16 (fp16 for FP8 tiles) before PV and a bf16 output
_ATTENTION_TOLERANCE = Tolerance(ATTENTION_ATOL, ATTENTION_RTOL)
_SHARED_SMOKE = {"batch": 2, "context": 96, "rows": 8, "kv_format": ["bf16", "fp8"],
                 "selection": "random", "overlap": 0.9, "sharing": "shared"}
SPARSE_GQA_DECODE = OpSpec(
    "sparse_gqa_decode", "sparse GQA over each row's selected tokens, split-K for small grids",
    entry=Ref("qsa.kernels.sparse_gqa", "sparse_gqa_decode"), table="sparse_gqa_decode",
    reference=_ATTENTION, inputs=partial(_attention_inputs, prefill=False),
    work=Ref("qsa.kernels.sparse_gqa", "work"), tolerance=_ATTENTION_TOLERANCE, storage="kv",
    test="tests/test_kernel_sparse_gqa.py",
    smoke=({"batch": 2, "context": 96, "kv_format": ["bf16", "fp8"],
            "selection": ["index", "random"]}, _SHARED_SMOKE),
    builds_overlap=True, takes_selection=True, step=StepRole(4, ("decode",)))
SPARSE_GQA_PREFILL = OpSpec(
    "sparse_gqa_prefill", "sparse GQA for many rows, unsplit, its own block config",
    entry=Ref("qsa.kernels.sparse_gqa", "sparse_gqa_prefill"), table="sparse_gqa_prefill",
    reference=_ATTENTION, inputs=partial(_attention_inputs, prefill=True),
    work=Ref("qsa.kernels.sparse_gqa", "work"), tolerance=_ATTENTION_TOLERANCE, storage="kv",
    test="tests/test_kernel_sparse_gqa.py",
    smoke=({"batch": 1, "context": 48, "rows": 48, "kv_format": ["bf16", "fp8"]},
           _SHARED_SMOKE),
    builds_overlap=True, takes_selection=True, step=StepRole(4, ("prefill",)))


REGISTRY: tuple[OpSpec, ...] = (SCORE_STACKED, SCORE_ROWWISE, SCORE_PREFILL, TOPK_EXPAND,
                                COMPRESS, KV_STORE, SPARSE_GQA_DECODE, SPARSE_GQA_PREFILL)
OPS: tuple[str, ...] = tuple(s.name for s in REGISTRY)
_BY_NAME = {s.name: s for s in REGISTRY}


def find(op: str) -> OpSpec:
    """The spec of `op`; a ValueError naming the ops otherwise."""
    try:
        return _BY_NAME[op]
    except KeyError:
        raise ValueError(f"op: {op!r} is not one of {', '.join(OPS)}") from None


def _selecting() -> str:
    return " and ".join(s.name for s in REGISTRY if s.takes_selection)


def layer_pass(phase: str) -> tuple[OpSpec, ...]:
    """The ops of one layer pass in `phase`, in the order they run; of the ops that share a
    position (the decode scorers), the one the runtime's dispatch chooses now."""
    if phase not in PHASES:
        raise ValueError(f"phase: {phase!r} is not one of {', '.join(PHASES)}")
    at: dict[int, list[OpSpec]] = {}
    for s in REGISTRY:
        if s.step is not None and phase in s.step.phases:
            at.setdefault(s.step.order, []).append(s)
    return tuple(next(s for s in group if s.step.chosen is None or s.step.chosen())
                 for _, group in sorted(at.items()))
