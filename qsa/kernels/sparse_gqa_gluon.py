"""Sparse GQA decode for NVIDIA sm90 in Gluon (`triton.experimental.gluon`), warp-specialized:
the same contract and the same per-(row, KV head, split) programs as `qsa.kernels.sparse_gqa`,
chosen by a table entry's `impl` key ("gluon"); the Triton kernel stays the portable path
(ROCm, the interpreter, CI).

Why a second implementation: the Triton kernel over FP8 tiles is latency-bound (each program's
warps wait on gathered, page-table-indexed loads, then on the conversions and MMAs, one after
another; profiles/nvidia-h200/bench/attention/occupancy/NOTES.md). Gluon can split a program's
warps by role, which plain Triton can not for a gathered tile:

* load warps (a worker partition) turn each tile's cache slots into addresses and gather the
  tile's K and V codes and scales into a ring of shared-memory stages with `cp.async`; each
  stage has a "ready" mbarrier (every load thread arrives when its copies have landed) and an
  "empty" one (the compute warps release the stage once they hold it in registers). Masked
  copies (slot -1, padding) fill zeros, so no stale code reaches an MMA.
* compute warps (the default partition) run QK (an M=16 MMA over the G query heads), the online
  softmax in the exp2 domain, and PV; FP8 V is converted to fp16 into a staging buffer that the
  PV operand reads transposed. The FP8 scaling is the Triton kernel's (power-of-two q scale,
  key scale on the score column, value scale folded into the probability, per-row tile
  maximum undone on the product), so both implementations agree within the same tolerance.

Ids arrive as cache slots (`block * PAGE + offset`, -1 for none: the Triton module's slots
pre-pass), so a load warp is one dependent load away from its copies; a row block's union is a
list of the same kind, so the shared path could feed the load warps as it is. Splits write the
Triton kernel's partials and share its merge kernel. Measurements:
profiles/nvidia-h200/bench/attention/gluon/NOTES.md.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mbarrier, mma_v2

from qsa.configs.schema import schema_of
from qsa.kernels.common import kernel_repr, require

IMPL = "gluon"
# The defaults of the keys an entry may leave out, as its schema declares them.
_DEFAULTS = {k.name: k.default for k in schema_of("sparse_gqa_decode").keys_of("fp8", IMPL)
             if k.default is not None}
MMA_M = gl.constexpr(16)  # mma.sync m16n8k16: the G query heads of a KV head, padded


@gluon.jit
def _tile_slots(ids_row, n, width, bt_row, ctx, max_pages, num_blocks, PAGE: gl.constexpr,
                RESOLVE_IDS: gl.constexpr):
    """Cache slots of list entries `n` (-1: none). RESOLVE_IDS: the list holds token ids,
    resolved here through the request's page table as the Triton module's slots pre-pass
    does (padding, ids past the context and pages outside the pool are -1)."""
    ids = gl.load(ids_row + n, mask=n < width, other=-1)
    if RESOLVE_IDS:
        page = ids // PAGE
        valid = (ids >= 0) & (ids < ctx) & (page < max_pages)
        blk = gl.load(bt_row + page, mask=valid, other=-1)
        valid = valid & (blk >= 0) & (blk < num_blocks)
        ids = gl.where(valid, blk * PAGE + ids % PAGE, -1)
    return ids


@gluon.jit
def _load_partition(k_ptr, v_ptr, ks_ptr, vs_ptr, slots_row, width, n_lo, n_tiles, row, head,
                    stride_kb, stride_vb, stride_ksb, stride_vsb, bt_ptr, ctx_ptr, qs_ptr,
                    batch, num_blocks, max_pages, stride_bt,
                    k_bufs, v_bufs, ks_bufs, vs_bufs, slot_bufs, ready, empty,
                    HKV: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                    PAGE: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
                    VEC: gl.constexpr, FP8: gl.constexpr, SLOTS_AHEAD: gl.constexpr,
                    RESOLVE_IDS: gl.constexpr, BATCH_P2: gl.constexpr):
    """Gather tile i's K/V rows (and FP8 scales) into stage i % STAGES once it is empty.
    SLOTS_AHEAD: a tile's slots are loaded while the previous tile's copies fly, and handed to
    the compute warps in the stage (one more arrival on its ready barrier), so neither
    partition waits on global memory for them at the top of a tile. RESOLVE_IDS: the list
    holds the row's token ids (`_tile_slots`), so no pre-pass launch is needed."""
    COLS: gl.constexpr = D // VEC  # threads across one D row, VEC elements (16 B) each
    tile_l: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // COLS, COLS], [LOAD_WARPS, 1], [1, 0])
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, tile_l))
    n_row = n_lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile_l))
    n_vec = n_lo + gl.arange(0, BLOCK_N, layout=vec_l)
    if RESOLVE_IDS:  # the row's request: how many requests end at or before the row
        b = gl.arange(0, BATCH_P2, layout=vec_l)
        ends = gl.load(qs_ptr + 1 + b, mask=b < batch, other=2147483647)
        req = gl.minimum(gl.sum((ends <= row).to(gl.int32), axis=0), batch - 1)
        ctx = gl.load(ctx_ptr + req)
        bt_row = bt_ptr + req.to(gl.int64) * stride_bt
    else:  # unread
        ctx = width
        bt_row = bt_ptr
    if SLOTS_AHEAD:
        slot = _tile_slots(slots_row, n_row, width, bt_row, ctx, max_pages, num_blocks, PAGE,
                           RESOLVE_IDS)
        slot1 = _tile_slots(slots_row, n_vec, width, bt_row, ctx, max_pages, num_blocks, PAGE,
                            RESOLVE_IDS)
    for i in range(n_tiles):
        s = i % STAGES
        at = i * BLOCK_N
        if SLOTS_AHEAD:
            nxt = at + BLOCK_N
            next_slot = _tile_slots(slots_row, n_row + nxt, width, bt_row, ctx, max_pages,
                                    num_blocks, PAGE, RESOLVE_IDS)
            next_slot1 = _tile_slots(slots_row, n_vec + nxt, width, bt_row, ctx, max_pages,
                                     num_blocks, PAGE, RESOLVE_IDS)
        else:
            slot = gl.load(slots_row + n_row + at, mask=n_row + at < width, other=-1)
        valid = slot >= 0
        blk = (slot // PAGE).to(gl.int64)
        off = (((slot % PAGE) * HKV + head) * D)[:, None] + d[None, :]
        # the stage's previous tile released (the first pass finds it free: phase 1 is done)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        cp.async_copy_global_to_shared(k_bufs.index(s), k_ptr + (blk * stride_kb)[:, None] + off,
                                       mask=valid[:, None])
        cp.async_copy_global_to_shared(v_bufs.index(s), v_ptr + (blk * stride_vb)[:, None] + off,
                                       mask=valid[:, None])
        if FP8:
            if not SLOTS_AHEAD:
                slot1 = gl.load(slots_row + n_vec + at, mask=n_vec + at < width, other=-1)
            blk1 = (slot1 // PAGE).to(gl.int64)
            tok1 = (slot1 % PAGE) * HKV + head
            cp.async_copy_global_to_shared(ks_bufs.index(s), ks_ptr + blk1 * stride_ksb + tok1,
                                           mask=slot1 >= 0)
            cp.async_copy_global_to_shared(vs_bufs.index(s), vs_ptr + blk1 * stride_vsb + tok1,
                                           mask=slot1 >= 0)
        cp.mbarrier_arrive(ready.index(s), increment_count=False)
        if SLOTS_AHEAD:
            slot_bufs.index(s).store(slot1)
            gl.thread_barrier()  # every load warp's slots stored before the one arrival below
            mbarrier.arrive(ready.index(s))
            slot = next_slot
            slot1 = next_slot1


@gluon.jit
def _compute_partition(q_ptr, out_ptr, po_ptr, lse_ptr, slots_row, width, n_lo,
                       n_tiles, row, head, split, num_splits, stride_qr, stride_qh, stride_or,
                       stride_oh, qk_scale, k_bufs, v_bufs, ks_bufs, vs_bufs, slot_bufs, ready,
                       empty, vh_buf, HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                       SPLIT: gl.constexpr, KW: gl.constexpr, SLOTS_AHEAD: gl.constexpr,
                       num_warps: gl.constexpr):
    """QK, online softmax and PV over the ring's tiles, then the row's output or partial."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps],
                                                    instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    # QK's operands: K-width 8 (8 consecutive head-dim codes per thread), so a thread reads a
    # K row's codes 8 bytes at a time; both operands take the same order along the head dim.
    qa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=KW)
    kb_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=KW)
    row_l: gl.constexpr = gl.SliceLayout(1, mma_l)  # one value per query head
    col_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # one value per token (or D column)
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, num_warps], [1, 0])
    v_l: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [num_warps, 1], [1, 0])
    op_t: gl.constexpr = gl.float16 if FP8 else gl.bfloat16

    m_q = gl.arange(0, MMA_M, layout=gl.SliceLayout(1, q_l))
    d_q = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))
    heads_q = head * G + m_q
    q = gl.load(q_ptr + row.to(gl.int64) * stride_qr + heads_q[:, None] * stride_qh
                + d_q[None, :], mask=(m_q < G)[:, None], other=0.0)
    if FP8:
        # Power-of-two scale so the largest |q| lands in [2^14, 2^15): exact in FP16 range.
        qf = q.to(gl.float32)
        qa = gl.max(gl.max(gl.abs(qf), axis=1), axis=0)
        qmul = gl.exp2(14.0 - gl.floor(gl.log2(gl.maximum(qa, 1e-30))))
        q_op = gl.convert_layout((qf * qmul).to(gl.float16), qa_l)
        score_scale = qk_scale / qmul
    else:
        q_op = gl.convert_layout(q, qa_l)
        score_scale = qk_scale

    # -1e30, not -inf: a tile with no valid token then gives alpha = 1 and p = 0, never NaN.
    m_i = gl.full([MMA_M], -1.0e30, gl.float32, layout=row_l)
    l_i = gl.zeros([MMA_M], gl.float32, layout=row_l)
    acc = gl.zeros([MMA_M, D], gl.float32, layout=mma_l)
    c = gl.full([MMA_M], 1.0, gl.float32, layout=row_l)  # FP8: the output is acc * c
    for i in range(n_tiles):
        s = i % STAGES
        if SLOTS_AHEAD:
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            valid = slot_bufs.index(s).load(col_l) >= 0
        else:
            n = n_lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
            valid = gl.load(slots_row + n, mask=n < width, other=-1) >= 0
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        k_op = k_bufs.index(s).permute((1, 0)).load(kb_l)
        if FP8:
            v = v_bufs.index(s).load(v_l)
            ksc = ks_bufs.index(s).load(col_l)
            vsc = vs_bufs.index(s).load(col_l)
        else:
            v_op = v_bufs.index(s).load(b_l)
        gl.thread_barrier()  # every compute warp holds the stage: it may be refilled
        mbarrier.arrive(empty.index(s))

        if FP8:
            sc = mma_v2(q_op, k_op.to(gl.float16), gl.zeros([MMA_M, BLOCK_N], gl.float32, mma_l))
            sc = sc * (ksc * score_scale)[None, :]
        else:
            sc = mma_v2(q_op, k_op, gl.zeros([MMA_M, BLOCK_N], gl.float32, mma_l)) * score_scale
        sc = gl.where(valid[None, :], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        if FP8:
            pv = p * vsc[None, :]
            r = gl.max(pv, axis=1)
            r = gl.where(r > 0.0, r, 1.0)
            p_op = gl.convert_layout((pv * (1.0 / r)[:, None]).to(gl.float16), a_l)
            vh_buf.store(v.to(gl.float16))
            v_op = vh_buf.load(b_l)
            # acc holds the output over c (per row): acc c alpha + r P'V = r (acc c alpha / r
            # + P'V), so the product accumulates into acc rescaled once, and c becomes r.
            acc = mma_v2(p_op, v_op, acc * (c * alpha / r)[:, None])
            c = r
        else:
            p_op = gl.convert_layout(p.to(op_t), a_l)
            acc = mma_v2(p_op, v_op, acc * alpha[:, None])
        m_i = m_new

    has = l_i > 0.0
    o = acc * (c / gl.where(has, l_i, 1.0))[:, None]
    m_o = gl.arange(0, MMA_M, layout=row_l)
    d_o = gl.arange(0, D, layout=col_l)
    hmask = m_o < G
    heads = head * G + m_o
    if SPLIT:  # partials in [rows, Hq, splits] order, merged by the Triton module's kernel
        part0 = (row.to(gl.int64) * (HKV * G) + heads) * num_splits + split
        gl.store(po_ptr + part0[:, None] * D + d_o[None, :], o, mask=hmask[:, None])
        gl.store(lse_ptr + part0, gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)),
                                           float("-inf")), mask=hmask)
    else:
        gl.store(out_ptr + row.to(gl.int64) * stride_or + heads[:, None] * stride_oh
                 + d_o[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@gluon.jit(repr=kernel_repr("sparse_gqa_decode_gluon",
                            ["FP8", "G", "D", "BLOCK_N", "STAGES", "LOAD_WARPS", "SPLIT",
                             "SLOTS_AHEAD"]))
def _sparse_gqa_gluon_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, out_ptr, po_ptr,
                             lse_ptr, bt_ptr, ctx_ptr, qs_ptr, batch, num_blocks,
                             max_pages, width, num_splits, stride_qr, stride_qh, stride_sr,
                             stride_bt, stride_kb, stride_vb, stride_ksb, stride_vsb, stride_or,
                             stride_oh, qk_scale,
                             HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                             BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
                             SPLIT_BLOCKS: gl.constexpr, FP8: gl.constexpr,
                             SPLIT: gl.constexpr, STAGES: gl.constexpr,
                             LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
                             KW: gl.constexpr, SLOTS_AHEAD: gl.constexpr,
                             RESOLVE_IDS: gl.constexpr, BATCH_P2: gl.constexpr,
                             num_warps: gl.constexpr):
    pid = gl.program_id(0)
    split = pid % num_splits
    unit = pid // num_splits
    row = unit // HKV
    head = unit % HKV
    n_lo = split * (SPLIT_BLOCKS * BLOCK_N)
    n_tiles = gl.minimum(gl.cdiv(width - n_lo, BLOCK_N), SPLIT_BLOCKS)
    slots_row = slots_ptr + row.to(gl.int64) * stride_sr

    code_t: gl.constexpr = k_ptr.dtype.element_ty
    VEC: gl.constexpr = 16 // code_t.primitive_bitwidth * 8
    tile_s: gl.constexpr = gl.SwizzledSharedLayout(vec=VEC, per_phase=1, max_phase=8,
                                                   order=[1, 0])
    flat_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    bar_s: gl.constexpr = mbarrier.MBarrierLayout()
    k_bufs = gl.allocate_shared_memory(code_t, [STAGES, BLOCK_N, D], tile_s)
    v_bufs = gl.allocate_shared_memory(code_t, [STAGES, BLOCK_N, D], tile_s)
    if FP8:
        ks_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], flat_s)
        vs_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], flat_s)
        vh_buf = gl.allocate_shared_memory(gl.float16, [BLOCK_N, D],
                                           gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    else:  # unread: one stage's codes stand in for them
        ks_bufs = k_bufs
        vs_bufs = v_bufs
        vh_buf = k_bufs.index(0)
    if SLOTS_AHEAD:
        slot_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], flat_s)
    else:  # unread
        slot_bufs = k_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_s)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_s)
    for s in gl.static_range(STAGES):
        # one cp.async arrival per load thread (SLOTS_AHEAD: and one with the tile's slots)
        mbarrier.init(ready.index(s), count=32 * LOAD_WARPS + SLOTS_AHEAD)
        mbarrier.init(empty.index(s), count=1)

    gl.warp_specialize([
        (_compute_partition, (q_ptr, out_ptr, po_ptr, lse_ptr, slots_row, width,
                              n_lo, n_tiles, row, head, split, num_splits, stride_qr,
                              stride_qh, stride_or, stride_oh, qk_scale, k_bufs, v_bufs,
                              ks_bufs, vs_bufs, slot_bufs, ready, empty, vh_buf, HKV, G, D,
                              BLOCK_N, STAGES, FP8, SPLIT, KW, SLOTS_AHEAD, num_warps)),
        (_load_partition, (k_ptr, v_ptr, ks_ptr, vs_ptr, slots_row, width, n_lo, n_tiles, row,
                           head, stride_kb, stride_vb, stride_ksb, stride_vsb, bt_ptr, ctx_ptr,
                           qs_ptr, batch, num_blocks, max_pages, stride_bt, k_bufs, v_bufs,
                           ks_bufs, vs_bufs, slot_bufs, ready, empty, HKV, D, BLOCK_N, PAGE,
                           STAGES, LOAD_WARPS, VEC, FP8, SLOTS_AHEAD, RESOLVE_IDS, BATCH_P2)),
    ], [LOAD_WARPS], [LOAD_REGS])


def launch(q, kc, vc, ks, vs, ids, batch, out, po, lse, *, num_splits: int,
           split_blocks: int, hkv: int, g: int, fp8: bool, qk_scale: float, batch_p2: int,
           meta: dict[str, int], num_warps: int) -> None:
    """One launch over every (row, KV head, split): `meta` holds the entry's BLOCK_N, STAGES,
    LOAD_WARPS, LOAD_REGS (the load warps' register budget), MAXNREG (registers per thread
    of the whole program, 0: the compiler's; 128 lets two programs share an SM), KW,
    SLOTS_AHEAD and RESOLVE_IDS. `ids`: the rows' token ids where the entry resolves them
    (`resolves_ids`), else their cache slots. `batch_p2`: the caller's power of two over the
    batch (the row-to-request count). Splits leave their partials to the caller's merge
    kernel."""
    rows, _, d = q.shape
    meta = {**_DEFAULTS, **meta}
    block_n = meta["BLOCK_N"]
    require(g <= MMA_M, f"GQA group {g}: the Gluon kernel holds at most {MMA_M} query heads "
                        "per KV head (use impl triton)")
    require(block_n >= 8 * num_warps and block_n & (block_n - 1) == 0,
            f"config: BLOCK_N {block_n} must be a power of two >= 8 x num_warps ({num_warps})")
    require(d * kc.element_size() <= 16 * 32,
            f"head_dim {d}: a K/V row must fit one warp's 16-byte copies (at most 512 bytes)")
    require(meta["STAGES"] >= 1 and meta["LOAD_WARPS"] >= 1,
            f"config: STAGES {meta['STAGES']} and LOAD_WARPS {meta['LOAD_WARPS']} must be >= 1")
    require(meta["SLOTS_AHEAD"] or not meta["RESOLVE_IDS"],
            "config: RESOLVE_IDS 1 needs SLOTS_AHEAD 1 (the load warps hand the resolved slots "
            "to the compute warps)")
    bt = batch.block_table
    _sparse_gqa_gluon_kernel[(rows * hkv * num_splits,)](
        q, kc, vc, ks, vs, ids, out, po, lse, bt, batch.context_lens, batch.query_start,
        batch.batch, kc.shape[0], bt.shape[1], ids.shape[1], num_splits, q.stride(0),
        q.stride(1), ids.stride(0), bt.stride(0), kc.stride(0), vc.stride(0), ks.stride(0),
        vs.stride(0), out.stride(0), out.stride(1), qk_scale,
        HKV=hkv, G=g, D=d, BLOCK_N=block_n, PAGE=batch.block_size, SPLIT_BLOCKS=split_blocks,
        FP8=fp8, SPLIT=num_splits > 1, STAGES=meta["STAGES"], LOAD_WARPS=meta["LOAD_WARPS"],
        LOAD_REGS=meta["LOAD_REGS"], KW=meta["KW"], SLOTS_AHEAD=meta["SLOTS_AHEAD"],
        RESOLVE_IDS=meta["RESOLVE_IDS"], BATCH_P2=batch_p2,
        num_warps=num_warps, **({"maxnreg": meta["MAXNREG"]} if meta["MAXNREG"] else {}))


def resolves_ids(meta: dict[str, int]) -> bool:
    """Whether an entry's kernel takes token ids (and resolves them itself) instead of the
    slots of the Triton module's pre-pass."""
    return bool({**_DEFAULTS, **meta}["RESOLVE_IDS"])


__all__ = ["IMPL", "launch", "resolves_ids"]
