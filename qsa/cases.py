"""Seeded generator of realistic QSA inputs for any preset.

Kernels, tests, benchmarks and notebooks all draw their inputs from here, so a shape that
passes a test is the same shape a benchmark times. Realistic means: ragged context lengths and
rows per request, shuffled page tables, a poisoned pool (an unwritten slot read by mistake shows
up as NaN), and activations with outlier channels, which is what makes FP8 and MXFP4 scales
matter. `overlap` gives neighbouring rows of a request correlated index queries, calibrated to
a target mean Jaccard of their selections (`qsa.overlap`); 0 keeps them independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qsa import overlap as ov
from qsa.arena.fields import CacheFormats, allocate_layer, declare_fields, kv_field_names
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset, ShapeError
from qsa.reference.compress import compress_reference, write_raw_keys_reference
from qsa.reference.kv import store_kv_reference
from qsa.reference.pipeline import row_slots
from qsa.reference.score import score_reference, visible_groups
from qsa.reference.topk import expand_reference


@dataclass(frozen=True)
class CaseSpec:
    preset: ModelPreset
    context_lens: tuple[int, ...]
    rows_per_request: tuple[int, ...]
    index_format: str = "bf16"
    kv_format: str = "bf16"
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    seed: int = 0
    shuffle_pages: bool = True
    spare_blocks: int = 3
    outlier_channels: int = 4
    outlier_scale: float = 12.0
    build_kv: bool = True
    overlap: float = 0.0  # target mean Jaccard of neighbouring rows' selections (0: independent)

    def __post_init__(self) -> None:
        if len(self.context_lens) == 0:
            raise ShapeError("context_lens: at least one request is needed")
        if len(self.rows_per_request) != len(self.context_lens):
            raise ShapeError(f"rows_per_request: {len(self.rows_per_request)} entries for "
                             f"{len(self.context_lens)} requests")
        for i, (c, r) in enumerate(zip(self.context_lens, self.rows_per_request)):
            if c < 1 or c > self.preset.max_context:
                raise ShapeError(f"context_lens[{i}]: {c} is outside 1..{self.preset.max_context}")
            if r < 0 or r > c:
                raise ShapeError(f"rows_per_request[{i}]: {r} rows for a context of {c}")
        most = min(self.preset.index_dim, self.preset.head_dim)
        if not 0 <= self.outlier_channels <= most:
            raise ShapeError(f"outlier_channels: must be in 0..{most}, got {self.outlier_channels}")
        if self.spare_blocks < 0:
            raise ShapeError(f"spare_blocks: must be >= 0, got {self.spare_blocks}")
        CacheFormats(self.kv_format, self.index_format, self.fp8_dtype)
        try:
            ov.check_target(self.overlap)
        except ov.OverlapError as e:
            raise ShapeError(str(e)) from None

    @property
    def formats(self) -> CacheFormats:
        return CacheFormats(self.kv_format, self.index_format, self.fp8_dtype)

    @classmethod
    def decode(cls, preset: ModelPreset, batch: int, context: int, rows: int | None = None,
               **kw) -> "CaseSpec":
        """A uniform decode/verify batch: `rows` rows (default: the preset's verify rows)."""
        r = preset.rows_per_verify if rows is None else rows
        return cls(preset, (context,) * batch, (r,) * batch, **kw)


@dataclass
class Case:
    spec: CaseSpec
    batch: PagedBatch
    cache: dict[str, torch.Tensor]
    q: torch.Tensor  # [rows, Hq, D] bf16
    q_index: torch.Tensor  # [rows, H, Dindex] fp32, already normalized and rotated
    rms_weight: torch.Tensor  # [Dindex] fp32
    overlap_measured: float  # mean Jaccard of neighbouring rows' selections, as calibrated
    raw_keys: torch.Tensor  # [rows, Dindex] bf16, the new tokens' raw index keys
    k_new: torch.Tensor  # [rows, Hkv, D] bf16
    v_new: torch.Tensor  # [rows, Hkv, D] bf16
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def preset(self) -> ModelPreset:
        return self.spec.preset

    @property
    def num_blocks(self) -> int:
        return next(iter(self.cache.values())).shape[0]


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with a value no kernel may produce or read unnoticed: NaN for floats (FP8 included),
    0xFF bytes for integer planes."""
    if t.dtype.is_floating_point:
        if t.element_size() == 1:
            t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn; in fnuz 0x80 is NaN, set below
            if t.dtype == torch.float8_e4m3fnuz:
                t.view(torch.uint8).fill_(0x80)
        else:
            t.fill_(float("nan"))
    else:
        t.fill_(-1 if t.dtype.is_signed else 0xFF)
    return t


def activations(gen: torch.Generator, shape: tuple[int, ...], outliers: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Gaussian rows with a few outlier channels and log-normal per-row magnitudes, drawn on
    the generator's device (benchmark-sized cases are generated where they are used)."""
    return _shaped(*_draws(gen, shape), outliers, scale)


def _draws(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian draws of `activations`: the rows, then their log magnitudes."""
    dev = gen.device
    x = torch.randn(shape, generator=gen, device=dev)
    return x, torch.randn((*shape[:-1], 1), generator=gen, device=dev)


def _shaped(x: torch.Tensor, log_mag: torch.Tensor, outliers: torch.Tensor, scale: float
            ) -> torch.Tensor:
    ch = torch.ones(x.shape[-1], device=x.device)
    ch[outliers.to(x.device)] = scale
    return x * ch * torch.exp(0.5 * log_mag)


def select_groups(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top min(k, visible) groups of each row ([rows, k], -1 padded; invisible groups score
    -inf), ties to the lower group index: the reference's rule, vectorized (the overlap
    calibration selects many times)."""
    k = min(k, scores.shape[1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    picked = torch.gather(scores, 1, order)
    return torch.where(picked > float("-inf"), order, -1)


def make_batch(spec: CaseSpec, gen: torch.Generator, device: torch.device | str) -> PagedBatch:
    bs = spec.preset.block_size
    pages = [(c + bs - 1) // bs for c in spec.context_lens]
    total = sum(pages) + spec.spare_blocks
    ids = torch.randperm(total, generator=gen) if spec.shuffle_pages else torch.arange(total)
    table = torch.full((len(pages), max(pages)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[at:at + n].to(torch.int32)
        at += n
    rows = torch.tensor(spec.rows_per_request, dtype=torch.int32)
    qs = torch.zeros(len(pages) + 1, dtype=torch.int32)
    qs[1:] = torch.cumsum(rows, 0)
    pos = torch.cat([torch.arange(c - r, c, dtype=torch.int32)
                     for c, r in zip(spec.context_lens, spec.rows_per_request)])
    batch = PagedBatch(table, torch.tensor(spec.context_lens, dtype=torch.int32), qs, pos, bs)
    return batch.validate(total).to(device)


def make_case(spec: CaseSpec, device: torch.device | str = "cpu") -> Case:
    """Build a case: the cache holds every token of every request (written and compressed by
    the reference), and the query rows are each request's last `rows` tokens."""
    p = spec.preset
    gen = torch.Generator().manual_seed(spec.seed)
    batch = make_batch(spec, gen, device)
    num_blocks = int(batch.block_table.max()) + 1 + spec.spare_blocks
    fields = declare_fields(p, spec.formats)
    if not spec.build_kv:
        kv = kv_field_names(fields)
        fields = tuple(f for f in fields if f.name not in kv)
    cache = {n: poison_(t) for n, t in allocate_layer(fields, num_blocks, device).items()}

    # Tensor data is drawn on `device` (seeded per device type); page tables on the CPU.
    dgen = torch.Generator(device=device).manual_seed(spec.seed + 1)
    idx_out = torch.randperm(p.index_dim, generator=gen)[:spec.outlier_channels]
    kv_out = torch.randperm(p.head_dim, generator=gen)[:spec.outlier_channels]
    total = sum(spec.context_lens)
    req = torch.repeat_interleave(torch.arange(batch.batch),
                                  torch.tensor(spec.context_lens)).to(device)
    pos = torch.cat([torch.arange(c) for c in spec.context_lens]).to(device)
    slots = batch.slots(req, pos)
    raw_all = activations(dgen, (total, p.index_dim), idx_out, spec.outlier_scale)
    write_raw_keys_reference(cache, slots, raw_all)
    rms_weight = 0.1 * torch.randn(p.index_dim, generator=dgen, device=device)
    compress_reference(cache, batch, torch.zeros_like(batch.context_lens), rms_weight, p,
                       spec.index_format, spec.fp8_dtype)

    rows = batch.num_rows
    shape_kv = (rows, p.num_kv_heads, p.head_dim)
    k_new = activations(dgen, shape_kv, kv_out, spec.outlier_scale).to(torch.bfloat16)
    v_new = activations(dgen, shape_kv, kv_out, spec.outlier_scale / 3).to(torch.bfloat16)
    if spec.build_kv:
        store_kv_reference(cache, slots,
                           activations(dgen, (total, *shape_kv[1:]), kv_out, spec.outlier_scale),
                           activations(dgen, (total, *shape_kv[1:]), kv_out,
                                       spec.outlier_scale / 3),
                           spec.kv_format, spec.fp8_dtype)
        store_kv_reference(cache, row_slots(batch), k_new, v_new, spec.kv_format, spec.fp8_dtype)
    # Row raw keys are the cache's own raw keys of those positions, so re-writing them is a no-op.
    rs = row_slots(batch)
    raw_rows = cache["index_raw"][rs // p.block_size, rs % p.block_size, 0].clone()
    q = torch.randn((rows, p.num_q_heads, p.head_dim), generator=dgen, device=device)
    draws = _draws(dgen, (rows, p.index_heads, p.index_dim))

    def index_queries(rho: float) -> torch.Tensor:
        x = _shaped(ov.correlate_rows(draws[0], batch, rho), draws[1], idx_out, 2.0)
        return x / x.norm(dim=-1, keepdim=True) * p.index_dim ** 0.5

    def jaccard_at(rho: float) -> float:
        scores = score_reference(cache, batch, index_queries(rho), p, spec.index_format)
        return ov.neighbour_jaccard(select_groups(scores, p.topk_groups), batch)

    rho, measured = ov.calibrate(spec.overlap, jaccard_at, "these index keys")
    return Case(spec, batch, cache, q.to(torch.bfloat16), index_queries(rho), rms_weight,
                measured, raw_rows, k_new, v_new)


def selection_generator(seed: int) -> torch.Generator:
    """The generator random selections draw from: on the CPU, whatever device the case is on,
    so a trace synthesized on a CPU (`qsa trace synth --seed S`) holds the selections a GPU
    run with seed S times."""
    return torch.Generator().manual_seed(seed + 9)


def random_selection(batch: PagedBatch, preset: ModelPreset, gen: torch.Generator,
                     overlap: float = 0.0) -> tuple[torch.Tensor, float]:
    """Selections for sparse attention without the index path: every row picks
    min(top-k, visible) random groups, expanded to token ids like the index path's output.
    `overlap` 0: independent rows (the worst case for sharing); else each request's rows pick
    by AR(1)-correlated keys calibrated to that mean Jaccard of neighbouring rows (`qsa.overlap`).
    Returns the ids and the measured Jaccard."""
    vis = visible_groups(batch)
    g = int(vis.max())
    keys = torch.rand((batch.num_rows, g), generator=gen, device=gen.device).to(vis.device)
    normal = torch.special.ndtri(keys.clamp(1e-7, 1 - 1e-7).double()).float()  # same order
    unseen = torch.arange(g, device=vis.device)[None, :] >= vis[:, None]
    k = min(preset.topk_groups, g)

    def groups_at(rho: float) -> torch.Tensor:
        z = keys if rho == 0.0 else ov.correlate_rows(normal, batch, rho)
        return z.masked_fill(unseen, float("-inf")).topk(k, dim=1).indices

    def jaccard_at(rho: float) -> float:
        return ov.neighbour_jaccard(groups_at(rho).masked_fill(
            torch.arange(k, device=vis.device)[None, :] >= vis[:, None], -1), batch)

    rho, measured = ov.calibrate(overlap, jaccard_at, "random selections")
    groups = groups_at(rho).sort(dim=1).values.to(torch.int32)
    counts = vis.clamp(max=k).to(torch.int32)  # invalid picks sort last (larger group ids)
    return expand_reference(groups, counts, batch.positions, preset.expand_width), measured


FILL_CHUNK_TOKENS = 1 << 19  # pool fill: tokens per reference-store call (bounds temporaries)


def touched_kv_pool(batch: PagedBatch, ids: torch.Tensor, preset: ModelPreset,
                    kv_formats: tuple[str, ...], seed: int,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn
                    ) -> tuple[PagedBatch, dict[str, dict[str, torch.Tensor]]]:
    """K/V pools holding only the pages some row selects, behind a shuffled page table (other
    pages -1, never read): long-context sparse attention without the memory of whole contexts.
    Every format's pool holds the same values (stored by the reference), so formats compare on
    one input. Returns the batch with its new page table and {format: K/V planes}."""
    dev = ids.device
    page = preset.block_size
    pages = batch.block_table.shape[1]
    rr = batch.row_request.long()[:, None].expand_as(ids)
    used = torch.unique((rr * pages + ids.long() // page)[ids >= 0])
    perm = torch.randperm(used.numel(), generator=torch.Generator().manual_seed(seed))
    table = torch.full_like(batch.block_table, -1)
    table[used // pages, used % pages] = perm.to(device=dev, dtype=torch.int32)
    batch = PagedBatch(table, batch.context_lens, batch.query_start, batch.positions, page)
    pools = {}
    for fmt in kv_formats:
        declared = declare_fields(preset, CacheFormats(kv=fmt, fp8_dtype=fp8_dtype))
        kv = kv_field_names(declared)
        fields = tuple(f for f in declared if f.name in kv)
        pools[fmt] = {n: poison_(t) for n, t in allocate_layer(fields, used.numel(), dev).items()}
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    outliers = torch.randperm(preset.head_dim, generator=gen,
                              device=dev)[:CaseSpec.outlier_channels]
    slots = (perm.to(dev).long()[:, None] * page + torch.arange(page, device=dev)).flatten()
    shape = (preset.num_kv_heads, preset.head_dim)
    for at in range(0, slots.numel(), FILL_CHUNK_TOKENS):
        s = slots[at:at + FILL_CHUNK_TOKENS]
        k = activations(gen, (s.numel(), *shape), outliers, CaseSpec.outlier_scale)
        v = activations(gen, (s.numel(), *shape), outliers, CaseSpec.outlier_scale / 3)
        for fmt, pool in pools.items():
            store_kv_reference(pool, s, k, v, fmt, fp8_dtype)
    return batch, pools
