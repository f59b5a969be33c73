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
# The defaults of the keys an entry may leave out (KW, MAXNREG), as its schema declares them.
_DEFAULTS = {k.name: k.default for k in schema_of("sparse_gqa_decode").keys_of("fp8", IMPL)
             if k.default is not None}
MMA_M = gl.constexpr(16)  # mma.sync m16n8k16: the G query heads of a KV head, padded


@gluon.jit
def _load_partition(k_ptr, v_ptr, ks_ptr, vs_ptr, slots_row, width, n_lo, n_tiles, head,
                    stride_kb, stride_vb, stride_ksb, stride_vsb,
                    k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty,
                    HKV: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                    PAGE: gl.constexpr, STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
                    VEC: gl.constexpr, FP8: gl.constexpr):
    """Gather tile i's K/V rows (and FP8 scales) into stage i % STAGES once it is empty."""
    COLS: gl.constexpr = D // VEC  # threads across one D row, VEC elements (16 B) each
    tile_l: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // COLS, COLS], [LOAD_WARPS, 1], [1, 0])
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [LOAD_WARPS], [0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, tile_l))
    for i in range(n_tiles):
        s = i % STAGES
        n = n_lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile_l))
        slot = gl.load(slots_row + n, mask=n < width, other=-1)
        valid = slot >= 0
        row = (slot // PAGE).to(gl.int64)
        tok = (slot % PAGE) * HKV + head
        # the stage's previous tile released (the first pass finds it free: phase 1 is done)
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        off = (tok * D)[:, None] + d[None, :]
        cp.async_copy_global_to_shared(k_bufs.index(s), k_ptr + (row * stride_kb)[:, None] + off,
                                       mask=valid[:, None])
        cp.async_copy_global_to_shared(v_bufs.index(s), v_ptr + (row * stride_vb)[:, None] + off,
                                       mask=valid[:, None])
        if FP8:
            n1 = n_lo + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=vec_l)
            slot1 = gl.load(slots_row + n1, mask=n1 < width, other=-1)
            row1 = (slot1 // PAGE).to(gl.int64)
            tok1 = (slot1 % PAGE) * HKV + head
            cp.async_copy_global_to_shared(ks_bufs.index(s), ks_ptr + row1 * stride_ksb + tok1,
                                           mask=slot1 >= 0)
            cp.async_copy_global_to_shared(vs_bufs.index(s), vs_ptr + row1 * stride_vsb + tok1,
                                           mask=slot1 >= 0)
        cp.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _compute_partition(q_ptr, out_ptr, po_ptr, lse_ptr, slots_row, width, n_lo, n_tiles,
                       row, head, split, num_splits, stride_qr, stride_qh, stride_or,
                       stride_oh, qk_scale, k_bufs, v_bufs, ks_bufs, vs_bufs, ready, empty,
                       vh_buf, HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                       SPLIT: gl.constexpr, KW: gl.constexpr, num_warps: gl.constexpr):
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
                            ["FP8", "G", "D", "BLOCK_N", "STAGES", "LOAD_WARPS", "SPLIT"]))
def _sparse_gqa_gluon_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, out_ptr, po_ptr,
                             lse_ptr, width, num_splits, stride_qr, stride_qh, stride_sr,
                             stride_kb, stride_vb, stride_ksb, stride_vsb, stride_or,
                             stride_oh, qk_scale,
                             HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                             BLOCK_N: gl.constexpr, PAGE: gl.constexpr,
                             SPLIT_BLOCKS: gl.constexpr, FP8: gl.constexpr,
                             SPLIT: gl.constexpr, STAGES: gl.constexpr,
                             LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
                             KW: gl.constexpr, num_warps: gl.constexpr):
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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_s)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_s)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=32 * LOAD_WARPS)  # one cp.async arrival per thread
        mbarrier.init(empty.index(s), count=1)

    gl.warp_specialize([
        (_compute_partition, (q_ptr, out_ptr, po_ptr, lse_ptr, slots_row, width, n_lo, n_tiles,
                              row, head, split, num_splits, stride_qr, stride_qh, stride_or,
                              stride_oh, qk_scale, k_bufs, v_bufs, ks_bufs, vs_bufs, ready,
                              empty, vh_buf, HKV, G, D, BLOCK_N, STAGES, FP8, SPLIT, KW, num_warps)),
        (_load_partition, (k_ptr, v_ptr, ks_ptr, vs_ptr, slots_row, width, n_lo, n_tiles, head,
                           stride_kb, stride_vb, stride_ksb, stride_vsb, k_bufs, v_bufs,
                           ks_bufs, vs_bufs, ready, empty, HKV, D, BLOCK_N, PAGE, STAGES,
                           LOAD_WARPS, VEC, FP8)),
    ], [LOAD_WARPS], [LOAD_REGS])


def launch(q, kc, vc, ks, vs, slots, out, po, lse, *, num_splits: int, split_blocks: int,
           hkv: int, g: int, page: int, fp8: bool, qk_scale: float, meta: dict[str, int],
           num_warps: int) -> None:
    """One launch over every (row, KV head, split): `meta` holds the entry's BLOCK_N, STAGES,
    LOAD_WARPS, LOAD_REGS (the load warps' register budget) and MAXNREG (registers per thread
    of the whole program, 0: the compiler's; 128 lets two programs share an SM)."""
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
    grid = (rows * hkv * num_splits,)
    _sparse_gqa_gluon_kernel[grid](
        q, kc, vc, ks, vs, slots, out, po, lse, slots.shape[1], num_splits,
        q.stride(0), q.stride(1), slots.stride(0), kc.stride(0), vc.stride(0), ks.stride(0),
        vs.stride(0), out.stride(0), out.stride(1), qk_scale,
        HKV=hkv, G=g, D=d, BLOCK_N=block_n, PAGE=page, SPLIT_BLOCKS=split_blocks,
        FP8=fp8, SPLIT=num_splits > 1, STAGES=meta["STAGES"], LOAD_WARPS=meta["LOAD_WARPS"],
        LOAD_REGS=meta["LOAD_REGS"], KW=meta["KW"], num_warps=num_warps,
        **({"maxnreg": meta["MAXNREG"]} if meta["MAXNREG"] else {}))


__all__ = ["IMPL", "launch"]
