"""What the three index scorers share: finding a tile of compressed keys through the page table,
loading and decoding it in any index format, the per-row visibility and the -inf epilogue, and
the host-side checks and launch planning.

Score semantics (spec section 2.3): for a row at position p of a request with context ctx,
visible = min((p+1)//4, ctx//4) and, for g < visible,
    score[g] = sum_h w_h * relu(q_h . k_g) * index_scale,
else -inf. The ReLU is per head, before the head sum.

Operand dtypes fed to the matrix unit, and why. q_index is bf16 (the interpreter surrogate hands
fp32 copies of bf16 tensors, and every kernel takes the dtype it is given).
* BF16 keys: the dot runs in the key storage dtype. Products of bf16 values are exact in the
  fp32 accumulator, so only the summation order differs from the fp32 reference.
* Decode (stacked scorer), FP8 and MXFP4 keys: fp16 operands. The scorer does about 16 FLOP per
  key byte, so decoding must keep up with HBM, and fp16 holds both formats exactly:
  - E4M3 codes (fn and fnuz) convert with one packed instruction per two codes on sm90/gfx950
    (`cvt.rn.f16x2.e4m3x2`; bf16 needs three). q converts to fp16 exactly (|q| is O(10): index
    queries are RMS-normalized). An FP8 MMA is not used: it would quantize q. The FP32 key scale
    is positive, so it commutes with the ReLU and the head sum and is applied once per (row,
    key), after them.
  - E2M1 nibbles become fp16 bit patterns by integer operations alone (`mx_nibbles`, four per
    code byte, no float conversion): the value times 2^-14, exact. The low and high nibbles of a
    byte are the even and odd elements of a block and stay apart (`load_mx_halves`): each half
    is already the packed fp16 pair the MMA takes, and q is split the same way, so a block is
    two K=16 dots instead of re-interleaving the halves in registers. The E8M0 exponents vary
    along D, so they act before the dot is complete: each 32-element block's fp32 result is
    multiplied by 2^(E-127) per key before the blocks are summed (still before the ReLU); the
    2^14 is restored after the head sum. A key's four exponents arrive in one 32-bit load
    (`load_mx_scales`). That is what
    `tl.dot_scaled` computes; it is not used because the interpreter lacks it and sm90 has no
    FP4 MMA. On gfx950, whose MFMA takes MX scales natively, it is the next step.
* Prefill (a key tile meets hundreds of rows x heads, so decode cost is amortized): FP8 and
  MXFP4 keys are decoded into bf16 with the MXFP4 exponents applied (`load_key_tile`; E2M1
  values times powers of two are exact in bf16), once per call into a scratch for long
  contexts or once per tile for short ones (`qsa.kernels.score_prefill`), and every head's dot
  runs in bf16.

Keys are read through the page table with 64-bit offsets; the block dim of the cache may have any
stride (arena views), the dims inside a block must be packed. Groups at or past a request's
readable limit and pages outside the pool are masked, never read.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qsa.configs import BlockConfig
from qsa.configs.schema import host_keys
from qsa.formats import MX_GROUP, FormatError, check_index_format
from qsa.kernels.common import (KernelInputError, check_index_planes, data_checks_enabled,
                                require, require_dtype, require_inner_contiguous,
                                storage_dtypes, unit_count)
from qsa.paging import BatchError, PagedBatch
from qsa.presets import ModelPreset

# Smallest M a matrix-unit tile has (mma m16n8k16 on sm90, 16x16 MFMA on gfx9): stacked
# operands with fewer rows x heads are padded to it with masked rows.
MIN_MMA_M = 16
# Meta keys that steer the host-side launch plan and are not kernel arguments: those the
# scorers' schemas mark as host keys.
HOST_META_KEYS = host_keys("score_stacked", "score_rowwise", "score_prefill")


# ------------------------------------------------------------------------------------------------
# Jitted helpers: finding, loading and decoding key tiles, and the per-row epilogue
# ------------------------------------------------------------------------------------------------

@triton.jit
def key_rows(bt_row_ptr, g, g_mask, bt_cols, num_blocks, stride_kb, stride_sb,
             GPB: tl.constexpr, KROW: tl.constexpr, SROW: tl.constexpr):
    """Element offsets of the key row and scale row of groups `g` of one request, read through
    its page-table row, and which of them may be read: `g_mask` and a page inside the pool.

    The page id is loaded whenever the column is inside the table, not under `g_mask`: the first
    key load then waits for one round trip (the page id), not two (the context, then the page).
    """
    page = g // GPB
    blk = tl.load(bt_row_ptr + page, mask=page < bt_cols, other=-1)
    ok = g_mask & (blk >= 0) & (blk < num_blocks)
    blk = blk.to(tl.int64)
    slot = (g % GPB).to(tl.int64)
    return blk * stride_kb + slot * KROW, blk * stride_sb + slot * SROW, ok


@triton.jit
def load_dense(kc_ptr, key_off, ok, d0, CK: tl.constexpr):
    """Dims d0 .. d0+CK-1 of BF16/FP8 keys, [N, CK] in the storage dtype (0 where masked)."""
    d = d0 + tl.arange(0, CK)
    return tl.load(kc_ptr + key_off[:, None] + d[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def mx_nibbles(x):
    """fp16 values E2M1 * 2^-14 of the low and high nibbles of MXFP4 code bytes `x` (uint32).

    Nibble s|e1 e0|m becomes fp16 bits s<<15 | e1 e0 m<<9: the exponent field holds e and the
    e=0 code (0.5) lands on a subnormal, so every E2M1 value comes out exact, scaled by 2^-14.
    Both nibbles are built in one 32-bit word (low nibble in the low half) with two multiplies
    as shifts and two masks: x * (2^9 + 2^21) places the magnitudes, x * (2^12 + 2^24) the
    signs, and the shifted copies of an 8-bit x can not overlap. Four integer instructions per
    byte on sm90, plus one to take the byte out of the loaded word.
    """
    pair = ((x * 0x00200200) & 0x0E000E00) | ((x * 0x01001000) & 0x80008000)
    return (pair.to(tl.uint16).to(tl.float16, bitcast=True),
            (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True))


@triton.jit
def load_mx_halves(kc_ptr, key_off, ok, c):
    """Scale block c (elements 32c .. 32c+31) of MXFP4 keys as two fp16 [N, 16] tiles: even
    elements (low nibbles) and odd elements (high nibbles), E2M1 * 2^-14."""
    i = c * 16 + tl.arange(0, 16)
    x = tl.load(kc_ptr + key_off[:, None] + i[None, :], mask=ok[:, None], other=0)
    return mx_nibbles(x.to(tl.uint32))


@triton.jit
def e8m0_value(e):
    """2^(e-127) of E8M0 bytes (int32), fp32, from the bits (byte 0 is the subnormal 2^-127)."""
    return tl.where(e > 0, e << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def load_mx_scale(ks_ptr, scale_off, ok, c):
    """2^(E-127) of scale block c per key, [N] fp32."""
    return e8m0_value(tl.load(ks_ptr + scale_off + c, mask=ok, other=0).to(tl.int32))


@triton.jit
def load_mx_scales(ks_ptr, scale_off, ok, NB: tl.constexpr):
    """2^(E-127) of the NB scale blocks of each key, a tuple of NB [N] fp32. A key's E8M0 bytes
    are contiguous; when NB is a multiple of 4 they are 4-byte aligned (`prepare_inputs` checks
    it) and arrive four per 32-bit load: one load and one layout change of the [N] vector per
    four blocks instead of one per block."""
    out = ()
    if NB % 4 == 0:
        for w in tl.static_range(NB // 4):
            word = tl.load((ks_ptr + scale_off + 4 * w).to(tl.pointer_type(tl.int32)),
                           mask=ok, other=0)
            for j in tl.static_range(4):
                out = out + (e8m0_value((word >> (8 * j)) & 0xFF),)
    else:
        for c in tl.static_range(NB):
            out = out + (load_mx_scale(ks_ptr, scale_off, ok, c),)
    return out


@triton.jit
def load_key_tile(kc_ptr, ks_ptr, key_off, scale_off, ok, DT: tl.constexpr, FMT: tl.constexpr,
                  D: tl.constexpr, BLOCK_N: tl.constexpr):
    """A whole key tile [N, D] decoded exactly into DT (bf16, or the interpreter's fp32):
    BF16/FP8 codes converted, MXFP4 values with their block exponents applied (E2M1 values
    times powers of two are exact in bf16). For kernels whose tile meets many rows, which
    amortize the decode; FP8 keys still need `key_col_scale` after the head sum."""
    if FMT == "mxfp4":
        i = tl.arange(0, D // 2)
        x = tl.load(kc_ptr + key_off[:, None] + i[None, :], mask=ok[:, None], other=0)
        lo, hi = mx_nibbles(x.to(tl.uint32))
        v = tl.reshape(tl.join(lo, hi), (BLOCK_N, D)).to(tl.float32) * 16384.0
        j = tl.arange(0, D // 32)
        e = tl.load(ks_ptr + scale_off[:, None] + j[None, :], mask=ok[:, None], other=0)
        s = e8m0_value(e.to(tl.int32))
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, D // 32, 32)), (BLOCK_N, D))
        k = (v * s).to(DT)
    else:
        k = load_dense(kc_ptr, key_off, ok, 0, D).to(DT)
    return k


@triton.jit
def key_col_scale(ks_ptr, scale_off, ok, FMT: tl.constexpr, MX_SHIFT: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Per-key factor applied after the ReLU head sum: the FP8 row scale (positive, so it
    commutes with both), 2^14 for MXFP4 tiles decoded as E2M1 * 2^-14 (MX_SHIFT), else 1."""
    if FMT == "fp8":
        col = tl.load(ks_ptr + scale_off, mask=ok, other=1.0)
    elif MX_SHIFT:
        col = tl.full([BLOCK_N], 16384.0, tl.float32)
    else:
        col = tl.full([BLOCK_N], 1.0, tl.float32)
    return col


@triton.jit
def row_visibility(pos_ptr, row0, nrows, n_groups, BLOCK_R: tl.constexpr):
    """Which of BLOCK_R rows from row0 exist, and the groups each sees: min((p+1)//4, ctx//4)."""
    r = tl.arange(0, BLOCK_R)
    row_ok = r < nrows
    pos = tl.load(pos_ptr + row0 + r, mask=row_ok, other=0)
    return row_ok, tl.minimum((pos + 1) // 4, n_groups)


@triton.jit
def store_scores(out_row, g, s, vis, row_ok, width):
    """Store [R, N] scores; groups a row can not see become -inf."""
    s = tl.where(g[None, :] < vis[:, None], s, float("-inf"))
    tl.store(out_row[:, None] + g[None, :], s, mask=row_ok[:, None] & (g < width)[None, :])


@triton.jit
def store_ninf(out_row, row_ok, tile0, width, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
               TILES: tl.constexpr):
    """-inf over key tiles tile0 .. tile0+TILES-1 of BLOCK_R rows (a chunk nobody can see)."""
    n = tl.arange(0, BLOCK_N)
    ninf = tl.full([BLOCK_R, BLOCK_N], float("-inf"), tl.float32)
    for i in range(TILES):
        g = (tile0 + i) * BLOCK_N + n
        tl.store(out_row[:, None] + g[None, :], ninf, mask=row_ok[:, None] & (g < width)[None, :])


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScoreInputs:
    """Checked arguments of one scorer call, in the form every scorer launches with."""

    fmt: str
    keys: torch.Tensor  # index_compressed [blocks, B/4, 1, D or D/2]
    scales: torch.Tensor  # its scale plane; the keys again for BF16 (never read)
    q: torch.Tensor  # [rows, H, D]
    weights: torch.Tensor | None  # [H] fp32
    out: torch.Tensor  # [rows, width] fp32
    batch: PagedBatch
    heads: int
    dim: int
    index_scale: float
    facts: BatchFacts | None  # None while a graph is captured (no data checks)
    # Blocks per request of keys held densely (request b's group g at block row
    # b * dense_blocks * gpb + g), read without the page table; 0: paged through the table.
    dense_blocks: int = 0

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def width(self) -> int:
        return self.out.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[0]

    @property
    def gpb(self) -> int:
        return self.keys.shape[1]

    def common_args(self) -> tuple:
        """Pointers and strides in the order the scorer kernels take them; for dense keys the
        table's width is the blocks per request (the table itself is not read)."""
        b = self.batch
        return (self.q, self.keys, self.scales, self.weights if self.weights is not None else
                self.out, self.out, b.block_table, b.context_lens, b.query_start, b.positions,
                self.q.stride(0), self.keys.stride(0), self.scales.stride(0),
                b.block_table.stride(0), self.out.stride(0),
                self.dense_blocks or b.block_table.shape[1], self.num_blocks, self.width,
                self.index_scale)

    def common_meta(self) -> dict:
        """Constexprs every scorer kernel takes (KROW / SROW: code and scale elements per stored
        key, the packed inner dims of a block)."""
        mx = self.fmt == "mxfp4"
        return {"FMT": self.fmt, "H": self.heads, "D": self.dim, "GPB": self.gpb,
                "KROW": self.dim // 2 if mx else self.dim,
                "SROW": self.dim // MX_GROUP if mx else 1, "HAS_W": self.weights is not None}


@dataclass(frozen=True)
class BatchFacts:
    """What the host needs to know about a validated batch's device data."""

    max_context: int
    max_rows_per_request: int


# Validated batches by the id of their page table, dropped when it is freed. An entry holds a weak
# reference to the page table, the batch's other tensors (so none can be freed and its id
# reused) and every tensor's version counter (so an in-place change re-validates). The layers of
# one step score the same batch: it is validated once.
_FACTS: dict[int, tuple] = {}


def batch_facts(batch: PagedBatch, num_blocks: int) -> BatchFacts:
    """Validate `batch` against a pool of `num_blocks` blocks (KernelInputError naming the
    problem) and return its facts; host syncs, so only outside graph capture."""
    tensors = (batch.block_table, batch.context_lens, batch.query_start, batch.positions)
    sig = (tensors[1:], tuple(t._version for t in tensors), num_blocks, batch.block_size)
    key = id(tensors[0])
    hit = _FACTS.get(key)
    if (hit is not None and hit[0]() is tensors[0]
            and all(a is b for a, b in zip(hit[1][0], sig[0])) and hit[1][1:] == sig[1:]):
        return hit[2]
    try:
        batch.validate(num_blocks)
    except BatchError as e:
        raise KernelInputError(str(e)) from None
    rows = int(batch.rows_per_request.max()) if batch.batch else 0
    facts = BatchFacts(batch.max_context, rows)
    if key not in _FACTS:
        weakref.finalize(tensors[0], _FACTS.pop, key, None)
    _FACTS[key] = (weakref.ref(tensors[0]), sig, facts)
    return facts


def _check_keys(cache: dict[str, torch.Tensor], fmt: str, dim: int, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and scales; BF16 keys stand in for the (unread) scale pointer."""
    keys, scales = check_index_planes(cache, fmt, dim, block_size)
    return keys, keys if scales is None else scales


def _check_batch(batch: PagedBatch, rows: int, device: torch.device) -> None:
    for name, t, nd in (("block_table", batch.block_table, 2),
                        ("context_lens", batch.context_lens, 1),
                        ("query_start", batch.query_start, 1), ("positions", batch.positions, 1)):
        require_dtype(t, name, (torch.int32,))
        require(t.dim() == nd, f"{name}: must have {nd} dims, got shape {tuple(t.shape)}")
        require(t.device == device, f"{name}: on {t.device}, the keys are on {device}")
        require(t.stride(-1) == 1 or t.shape[-1] <= 1, f"{name}: inner dim must be contiguous")
    require(batch.positions.shape[0] == rows,
            f"positions: {batch.positions.shape[0]} rows, q_index has {rows}")
    require(batch.query_start.shape[0] == batch.batch + 1,
            f"query_start: needs batch + 1 = {batch.batch + 1} entries, "
            f"got {batch.query_start.shape[0]}")
    require(batch.block_table.shape[0] == batch.batch,
            f"block_table: {batch.block_table.shape[0]} rows for {batch.batch} requests")


def prepare_inputs(cache: dict[str, torch.Tensor], batch: PagedBatch, q_index: torch.Tensor,
                   preset: ModelPreset, index_format: str, head_weights: torch.Tensor | None,
                   out: torch.Tensor | None) -> ScoreInputs:
    """Check everything a scorer reads and writes; allocate `out` if not given.

    Metadata checks (dtypes, shapes, strides, devices) always run. Checks of device data (page
    ids inside the pool, positions inside their contexts, the output width) run when
    `data_checks_enabled()`; `out=None` needs the widest context, a host sync, so a captured
    call must pass `out`.
    """
    try:
        check_index_format(index_format)
    except FormatError as e:
        raise KernelInputError(str(e)) from None
    h, d = preset.index_heads, preset.index_dim
    require(batch.block_size == preset.block_size,
            f"batch.block_size {batch.block_size} != preset block_size {preset.block_size}")
    keys, scales = _check_keys(cache, index_format, d, batch.block_size)
    if index_format == "mxfp4" and (d // MX_GROUP) % 4 == 0:
        require(scales.data_ptr() % 4 == 0 and scales.stride(0) % 4 == 0,
                f"index_compressed_scale: the E8M0 rows are read four bytes at a time and must "
                f"be 4-byte aligned (data offset {scales.data_ptr() % 4} mod 4, block stride "
                f"{scales.stride(0)})")
    dev = keys.device
    require(scales.device == dev, f"index_compressed_scale: on {scales.device}, keys on {dev}")
    require(q_index.dim() == 3 and tuple(q_index.shape[1:]) == (h, d),
            f"q_index: shape {tuple(q_index.shape)} is not [rows, {h}, {d}]")
    require_dtype(q_index, "q_index", storage_dtypes())
    require_inner_contiguous(q_index, "q_index", 2)
    require(q_index.device == dev, f"q_index: on {q_index.device}, keys on {dev}")
    rows = q_index.shape[0]
    _check_batch(batch, rows, dev)
    if head_weights is not None:
        require(tuple(head_weights.shape) == (h,) and head_weights.is_contiguous(),
                f"head_weights: must be a contiguous [{h}] tensor, got {tuple(head_weights.shape)}")
        require_dtype(head_weights, "head_weights", (torch.float32,))
        require(head_weights.device == dev,
                f"head_weights: on {head_weights.device}, keys on {dev}")
    facts = batch_facts(batch, keys.shape[0]) if data_checks_enabled() else None
    if out is None:
        require(facts is not None, "out: a captured call must pass the output (its width needs "
                                   "the widest context, a host sync)")
        out = torch.empty((rows, facts.max_context // 4), dtype=torch.float32, device=dev)
    require(out.dim() == 2 and out.shape[0] == rows,
            f"out: shape {tuple(out.shape)} is not [{rows}, width]")
    require_dtype(out, "out", (torch.float32,))
    require(out.stride(1) == 1 or out.shape[1] <= 1, "out: inner dim must be contiguous")
    require(out.device == dev, f"out: on {out.device}, keys on {dev}")
    if facts is not None:
        width = facts.max_context // 4
        require(out.shape[1] == width, f"out: width {out.shape[1]} != max context // 4 = {width}")
    return ScoreInputs(index_format, keys, scales, q_index, head_weights, out, batch, h, d,
                       preset.index_scale, facts)


def rows_per_request_bound(inp: ScoreInputs, hint: int | None, limit: int) -> int:
    """Most query rows of one request: `hint` if given (checked against the batch when data
    checks run), else the validated batch's count (not available while capturing)."""
    if hint is None:
        require(inp.facts is not None,
                "max_rows_per_request: a captured call must pass it (a host sync)")
        rmax = inp.facts.max_rows_per_request
    else:
        require(isinstance(hint, int) and hint >= 1,
                f"max_rows_per_request: must be a positive int, got {hint!r}")
        rmax = hint
        if inp.facts is not None:
            actual = inp.facts.max_rows_per_request
            require(actual <= hint, f"max_rows_per_request: a request has {actual} rows, "
                                    f"more than the hint {hint}")
    require(rmax <= limit, f"rows per request: {rmax}, this kernel takes at most {limit}")
    return max(rmax, 1)


def plan_tiles(items: int, width: int, block_n: int, programs_per_unit: int, max_tiles: int,
               device: torch.device) -> tuple[int, int]:
    """(key chunks per item, tiles per chunk) so that items x chunks programs fill the device.

    Tiles per chunk is a compile-time constant of the kernels, a power of two (few variants
    compile) and at least 2: a one-iteration loop is folded away and loses the pipeliner's
    asynchronous copies, whose loads do not stall the program (a synchronous load's trip through
    shared memory blocks every later load behind it). A tile past an item's keys moves nothing.
    """
    n_tiles = triton.cdiv(width, block_n)
    want_chunks = triton.cdiv(programs_per_unit * unit_count(device), max(items, 1))
    tiles = triton.next_power_of_2(triton.cdiv(n_tiles, want_chunks))
    tiles = max(2, min(tiles, max_tiles))
    return triton.cdiv(n_tiles, tiles), tiles


def split_config(cfg: BlockConfig, launch: dict) -> tuple[dict, dict]:
    """(kernel launch keywords, host-only knobs) of a looked-up config; the kernel names carry
    warps and stages through the WARPS / STAGES constexprs. Tile sizes must be powers of two
    and BLOCK_N at least 16 (the smallest matrix-unit N)."""
    for k, v in cfg.meta.items():
        require(isinstance(v, int) and v >= 1 and v & (v - 1) == 0,
                f"config: {k} = {v!r} must be a power of two")
    require(cfg.meta.get("BLOCK_N", 16) >= 16,
            f"config: BLOCK_N {cfg.meta.get('BLOCK_N')} must be >= 16")
    kw = {k: v for k, v in launch.items() if k not in HOST_META_KEYS}
    kw.update(WARPS=cfg.num_warps, STAGES=cfg.num_stages)
    host = {k: cfg.meta[k] for k in HOST_META_KEYS if k in cfg.meta}
    return kw, host


def key_bytes(fmt: str, dim: int) -> int:
    """Bytes of one stored compressed key with its scale-plane share."""
    return {"bf16": 2 * dim, "fp8": dim + 4, "mxfp4": dim // 2 + dim // MX_GROUP}[fmt]


def score_work(batch: PagedBatch, preset: ModelPreset, index_format: str, *,
               keys_per_row: bool, q_itemsize: int = 2) -> tuple[int, int]:
    """(bytes moved, useful FLOPs) of one scorer call on `batch` (host sync: reads the batch).

    Keys: every group below the request's last complete group once per request with rows, or
    (`keys_per_row`, the row-wise design) the row's visible groups once per row. Plus q, the
    FP32 output [rows, max_ctx // 4], the page-table entries and the per-row/request metadata.
    FLOPs: 2 * heads * dim per visible (row, group); padding, ReLU and the head sum are not
    useful work.
    """
    check_index_format(index_format)
    h, d = preset.index_heads, preset.index_dim
    kb = key_bytes(index_format, d)
    ctx = batch.context_lens.long().cpu()
    nrows = batch.rows_per_request.long().cpu()
    rr = batch.row_request.long().cpu()
    pos = batch.positions.long().cpu()
    vis = torch.minimum((pos + 1) // 4, ctx[rr] // 4)
    gpb = batch.block_size // 4
    if keys_per_row:
        groups = int(vis.sum())
        pages = int(((vis + gpb - 1) // gpb).sum())
    else:
        has = nrows > 0
        groups = int((ctx[has] // 4).sum())
        pages = int(((ctx[has] // 4 + gpb - 1) // gpb).sum())
    rows = int(pos.numel())
    width = int(ctx.max()) // 4 if ctx.numel() else 0
    moved = (groups * kb + rows * h * d * q_itemsize + rows * width * 4 + pages * 4
             + rows * 4 + batch.batch * 12)
    return moved, int(vis.sum()) * 2 * h * d


def env_flag(name: str, default: bool) -> bool:
    """A 0/1 switch read from the environment at call time."""
    v = os.environ.get(name)
    return default if v is None else v.strip() not in ("0", "false", "False", "")
