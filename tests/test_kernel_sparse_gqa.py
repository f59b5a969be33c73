"""Sparse GQA decode and prefill kernels against the float32 reference
(qsa.reference.attention.sparse_gqa_reference), on selections the reference index path makes.

CPU (Triton interpreter): bf16 q and BF16 caches run as fp32 surrogates (tests/support.py), so a
pass there means indexing, paging, masking, splitting and the online softmax are right; FP8
caches run with their real E4M3 codes. The GPU tests repeat the checks with production dtypes at
the model's shapes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa.cases import Case, CaseSpec, make_case, poison_
from qsa.configs import BlockConfig, get_config
from qsa.kernels import common, row_union, sparse_gqa
from qsa.kernels.common import KernelInputError, backend_and_arch
from qsa.kernels.sparse_gqa import (MAX_SPLITS, choose_splits, sparse_gqa_decode,
                                    sparse_gqa_prefill, split_count, work)
from qsa.paging import PagedBatch
from qsa.presets import get_preset
from qsa.reference.attention import gather_kv, sparse_gqa_reference
from qsa.reference.score import score_reference
from qsa.reference.topk import topk_expand_reference
from support import (DEVICE, INTERPRETING, poisoned, replay_captured, surrogate,
                     surrogate_cache)

# Decode-like batch: ragged contexts, a request of 3 tokens (rows with 2 and 3 ids), 1-4 rows.
DECODE = ((70, 3, 130, 40), (4, 2, 1, 3))
# Prefill-like batch: whole chunks of rows, dense (visible <= top-k) and sparse rows.
PREFILL = ((56, 24), (40, 16))
GROUPS = {12: (24, 2), 1: (2, 2)}  # GQA group -> (q heads, KV heads)


def _preset(group: int, block_size: int, head_dim: int = 64, topk: int = 8):
    hq, hkv = GROUPS[group]
    return get_preset().replace(head_dim=head_dim, num_q_heads=hq, num_kv_heads=hkv,
                                block_size=block_size, topk_groups=topk)


@lru_cache(maxsize=None)
def _case(kv_format: str, group: int, block_size: int, shape: tuple, seed: int = 1,
          head_dim: int = 64, topk: int = 8) -> tuple[Case, torch.Tensor]:
    """A case and the selections the reference index path makes on it (scores -> top-k)."""
    p = _preset(group, block_size, head_dim, topk)
    case = make_case(CaseSpec(p, shape[0], shape[1], kv_format=kv_format, seed=seed), DEVICE)
    scores = score_reference(case.cache, case.batch, case.q_index, p, "bf16")
    return case, topk_expand_reference(scores, case.batch, p)


def _entry_with(kv_format: str, rows: int, **meta: int) -> BlockConfig:
    """This device's table entry with config keys switched: SLOTS (the id -> slot pre-pass),
    PV_HALVES (the PV product by head-dim halves), ROWS (rows per program)."""
    entry = get_config("sparse_gqa_decode", backend_and_arch()[1], kv_format, rows)
    return entry.config.with_meta(**meta)


def _tol(ref: torch.Tensor) -> dict:
    """CPU: fp32 surrogates in and out, so only the order of summation (and FP16 probabilities
    for FP8 tiles, 2^-11) differ. GPU: P rounded to bf16 (fp16 for FP8 tiles) before PV and a
    bf16 output, each about 2^-9 of the largest value per element."""
    scale = float(ref.abs().max())
    return dict(atol=2e-4 * scale, rtol=1e-4) if INTERPRETING else dict(atol=1e-2 * scale,
                                                                        rtol=1e-2)


# The interpreter's fp32 -> bf16 store truncates instead of rounding to nearest even, so on CPU
# outputs are fp32 surrogates too (test_default_out_is_bf16 covers the bf16 store).
OUT_DTYPE = torch.float32 if INTERPRETING else torch.bfloat16


def _run(fn, case: Case, ids: torch.Tensor, kv_format: str, **kw) -> torch.Tensor:
    out = poisoned(tuple(case.q.shape), OUT_DTYPE)
    got = fn(surrogate(case.q), surrogate_cache(case.cache), case.batch, ids, case.preset,
             kv_format, out=out, **kw)
    assert got is out
    assert not torch.isnan(out).any(), "an output element was not written"
    return out.float()


def _reference(case: Case, ids: torch.Tensor, kv_format: str) -> torch.Tensor:
    return sparse_gqa_reference(case.q, case.cache, case.batch, ids, kv_format,
                                case.preset.softmax_scale)


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group", [12, 1])
@pytest.mark.parametrize("block_size", [16, pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_decode_matches_reference(kv_format: str, block_size: int, group: int,
                                  splits: int) -> None:
    case, ids = _case(kv_format, group, block_size, DECODE)
    ids = ids.clone()
    ids[5] = -1  # a row with no valid id outputs zeros
    ref = _reference(case, ids, kv_format)
    out = _run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits)
    torch.testing.assert_close(out, ref, **_tol(ref))
    assert torch.equal(out[5], torch.zeros_like(out[5]))


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("splits", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_decode_pv_halves(kv_format: str, splits: int) -> None:
    """PV_HALVES: the PV product over each half of the head dim in turn (two accumulators
    joined at the end) gives the reference's output, with the halves in their places."""
    case, ids = _case(kv_format, 12, 16, DECODE)
    ids = ids.clone()
    ids[5] = -1
    ref = _reference(case, ids, kv_format)
    out = _run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits,
               config=_entry_with(kv_format, ids.shape[0], PV_HALVES=1))
    torch.testing.assert_close(out, ref, **_tol(ref))
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    # a config written before the switch existed runs without it
    old = BlockConfig({"BLOCK_N": 16}, num_warps=4, num_stages=1)
    torch.testing.assert_close(_run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits,
                                    config=old), ref, **_tol(ref))


def test_pdl_is_refused_without_programmatic_dependent_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PDL=1 runs on NVIDIA sm90+ only; elsewhere on a GPU it is refused by name, and the
    interpreter (grids run one after another anyway) runs the kernels without it."""
    monkeypatch.setattr(common, "backend_and_arch", lambda: ("interpreter", "default"))
    assert not sparse_gqa._use_pdl({"PDL": 0}) and not sparse_gqa._use_pdl({"PDL": 1})
    monkeypatch.setattr(common, "backend_and_arch", lambda: ("cuda", "sm90"))
    assert sparse_gqa._use_pdl({"PDL": 1}) and not sparse_gqa._use_pdl({"PDL": 0})
    for target in (("cuda", "sm80"), ("hip", "gfx950")):
        monkeypatch.setattr(common, "backend_and_arch", lambda t=target: t)
        with pytest.raises(KernelInputError, match="PDL=1 needs programmatic dependent launch"):
            sparse_gqa._use_pdl({"PDL": 1})


@pytest.mark.interp_surrogate
@pytest.mark.parametrize(("block_size", "group"), [pytest.param(16, 12, marks=pytest.mark.slow),
                                                   (64, 12),
                                                   pytest.param(16, 1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_prefill_matches_reference(kv_format: str, block_size: int, group: int) -> None:
    case, ids = _case(kv_format, group, block_size, PREFILL)
    ref = _reference(case, ids, kv_format)
    torch.testing.assert_close(_run(sparse_gqa_prefill, case, ids, kv_format), ref,
                               **_tol(ref))


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("per", [pytest.param(2, marks=pytest.mark.slow), 4,
                                 pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("block_size", "group", "shape"),
                         [pytest.param(16, 12, PREFILL, marks=pytest.mark.slow), (64, 12, DECODE),
                          (16, 1, DECODE)])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_prefill_row_blocks(kv_format: str, block_size: int, group: int, shape: tuple,
                            per: int) -> None:
    """ROWS > 1: a program owns `per` consecutive rows and walks their selections' union,
    each score a row did not select masked. Blocks that straddle requests (the decode-shaped
    batch's ragged rows), a short last block, a row without ids and ids in any order give the
    reference's output."""
    case, ids = _case(kv_format, group, block_size, shape)
    ids = ids.clone()
    ids[1] = -1  # a row with no valid id outputs zeros
    g = torch.Generator().manual_seed(3)
    ids[2] = ids[2][torch.randperm(ids.shape[1], generator=g).to(ids.device)]
    ref = _reference(case, ids, kv_format)
    config = BlockConfig({"BLOCK_N": 16, "ROWS": per}, num_warps=4, num_stages=1)
    out = _run(sparse_gqa_prefill, case, ids, kv_format, config=config)
    torch.testing.assert_close(out, ref, **_tol(ref))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def _union_by_sets(ids: torch.Tensor, batch: PagedBatch, per: int, pool: int
                   ) -> list[list[tuple[int, int]]]:
    """Each row block's union by sets: (slot, row bits) of every readable id, request segment
    after request segment, ascending token ids within one."""
    req = batch.row_request.tolist()
    ctx, bt, page = batch.context_lens.tolist(), batch.block_table, batch.block_size
    blocks = []
    for b0 in range(0, ids.shape[0], per):
        found: dict[tuple[int, int], list[int]] = {}
        for r, row in enumerate(range(b0, min(b0 + per, ids.shape[0]))):
            q = req[row]
            for x in ids[row].tolist():
                if 0 <= x < ctx[q] and x // page < bt.shape[1] and 0 <= int(bt[q, x // page]) < pool:
                    slot = int(bt[q, x // page]) * page + x % page
                    found.setdefault((q, x), [slot, 0])[1] |= 1 << r
        blocks.append([tuple(v) for _, v in sorted(found.items())])
    return blocks


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(0, 5)), min_size=1, max_size=4),
       st.integers(1, 7), st.sampled_from([1, 2, 4, 8]), st.sampled_from([16, 32]),
       st.integers(0, 2**31 - 1))
def test_row_block_union(requests: list, width: int, per: int, page: int, seed: int) -> None:
    """The union each block of rows reads, built by the bitmap kernels, against a set
    computation: ragged requests (blocks that straddle them, a short last block, requests
    without rows), repeated ids, padding, ids past the context or on a page outside the pool
    (a hole in the shuffled page table), a row without ids: each readable id once, with the
    bits of exactly the rows that listed it, request after request, then the length."""
    g = torch.Generator().manual_seed(seed)
    ctx = [c for c, _ in requests]
    rows = [min(r, c) for c, r in requests]
    pages = [-(-c // page) for c in ctx]
    pool = sum(pages)
    perm = torch.randperm(pool + 1, generator=g).to(torch.int32)
    perm[perm == pool] = pool + 5  # one page points past the pool: never read
    bt = torch.full((len(ctx), max(pages)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        bt[i, :n] = perm[at:at + n]
        at += n
    qs = torch.tensor([0, *torch.cumsum(torch.tensor(rows), 0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(c - r, c) for c, r in zip(ctx, rows)]).to(torch.int32)
    batch = PagedBatch(bt, torch.tensor(ctx, dtype=torch.int32), qs, pos, page)
    if batch.num_rows == 0:
        return
    ids = torch.randint(-1, max(ctx) + 3, (batch.num_rows, width), generator=g,
                        dtype=torch.int32)
    ids[0] = -1
    slots, bits = row_union.row_block_union(ids.to(DEVICE), batch.to(DEVICE), per, pool)
    slots, bits = slots.cpu(), bits.cpu()
    n_all = per * width
    assert slots.shape == (-(-batch.num_rows // per), n_all)
    assert bits.shape == (slots.shape[0], n_all + 1) and slots.stride(0) == bits.stride(0)
    for b, want in enumerate(_union_by_sets(ids, batch, per, pool)):
        n = int(bits[b, n_all])
        assert list(zip(slots[b, :n].tolist(), bits[b, :n].tolist())) == want


@pytest.mark.parametrize("per", [2, 4])
def test_row_block_union_over_several_chunks(per: int) -> None:
    """Long contexts split a block's bitmap over several gather programs, each counting the
    marked tokens before its chunk to place its own: the union is still each readable id
    once, in order, whichever program wrote it (blocks straddling two requests)."""
    g = torch.Generator().manual_seed(per)
    ctx, page = [9000, 5000], 64
    pages = [-(-c // page) for c in ctx]
    perm = torch.randperm(sum(pages), generator=g).to(torch.int32)
    bt = torch.full((2, max(pages)), -1, dtype=torch.int32)
    bt[0, :pages[0]], bt[1, :pages[1]] = perm[:pages[0]], perm[pages[0]:]
    pos = torch.tensor([8997, 8998, 8999, 4998, 4999], dtype=torch.int32)
    batch = PagedBatch(bt, torch.tensor(ctx, dtype=torch.int32),
                       torch.tensor([0, 3, 5], dtype=torch.int32), pos, page)
    ids = torch.randint(0, 9000, (5, 96), generator=g, dtype=torch.int32)
    blocks = -(-5 // per)
    words = -(-max(pages) * page // 32)
    assert row_union.chunk_count(blocks, words, torch.device(DEVICE)) > 1 or not INTERPRETING
    slots, bits = row_union.row_block_union(ids.to(DEVICE), batch.to(DEVICE), per,
                                            sum(pages))
    slots, bits = slots.cpu(), bits.cpu()
    for b, want in enumerate(_union_by_sets(ids, batch, per, sum(pages))):
        n = int(bits[b, per * 96])
        assert list(zip(slots[b, :n].tolist(), bits[b, :n].tolist())) == want


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_decode_shared_path_with_splits(kv_format: str, splits: int) -> None:
    """The shared path in a split decode call: a union's tiles dealt to the splits in turn,
    partials merged by the merge kernel, on the ragged decode batch (blocks of 4 rows straddle
    its requests), a row without ids and a shuffled id list."""
    case, ids = _case(kv_format, 12, 16, DECODE)
    ids = ids.clone()
    ids[5] = -1
    g = torch.Generator().manual_seed(5)
    ids[2] = ids[2][torch.randperm(ids.shape[1], generator=g).to(ids.device)]
    ref = _reference(case, ids, kv_format)
    config = _entry_with(kv_format, ids.shape[0], ROWS=4)
    out = _run(sparse_gqa_decode, case, ids, kv_format, config=config, num_splits=splits)
    torch.testing.assert_close(out, ref, **_tol(ref))
    assert torch.equal(out[5], torch.zeros_like(out[5]))


def test_plan_sharing_follows_the_measured_union() -> None:
    """Rows that select the same tokens measure a union of one row and take the shared path;
    rows with disjoint selections measure `rows` rows' worth and keep the per-row path; the
    plan reports the entry's threshold it compared against."""
    case, ids = _case("bf16", 12, 16, PREFILL)
    same = ids[:1].expand_as(ids).contiguous()
    batch = PagedBatch(case.batch.block_table, case.batch.context_lens,
                       case.batch.query_start,
                       torch.full_like(case.batch.positions, int(case.batch.positions.min())),
                       case.batch.block_size)
    plan = sparse_gqa.plan_sharing(same, batch, case.preset, "bf16", prefill=True)
    assert plan.union_ratio == pytest.approx(1.0) and plan.shared and plan.rows >= 2
    disjoint = torch.full_like(ids, -1)
    for r in range(ids.shape[0]):  # row r: the tokens of one 4-token group of its own
        disjoint[r, :4] = torch.arange(4 * r, 4 * r + 4, dtype=torch.int32) % 24
    plan = sparse_gqa.plan_sharing(disjoint, case.batch, case.preset, "bf16", prefill=True)
    assert plan.union_ratio == pytest.approx(plan.rows, rel=0.3) and not plan.shared
    assert 1.0 < plan.max_union_ratio < plan.rows


def test_row_blocks_refused_where_they_can_not_run() -> None:
    """ROWS must be a listed power of two and fit R x G rows into one MMA tile."""
    case, ids = _case("bf16", 12, 16, PREFILL)

    def call(**meta: int) -> None:
        sparse_gqa_prefill(surrogate(case.q), surrogate_cache(case.cache), case.batch, ids,
                           case.preset, "bf16", config=BlockConfig({"BLOCK_N": 16, **meta}))

    with pytest.raises(KernelInputError, match="ROWS 3 must be one of"):
        call(ROWS=3)
    with pytest.raises(KernelInputError, match="ROWS 8 x GQA group 24 exceeds"):
        p = case.preset.replace(num_q_heads=48)
        sparse_gqa_prefill(torch.empty((ids.shape[0], 48, p.head_dim), device=DEVICE,
                                       dtype=surrogate(case.q).dtype),
                           surrogate_cache(case.cache), case.batch, ids, p, "bf16",
                           config=BlockConfig({"BLOCK_N": 16, "ROWS": 8}))


@pytest.mark.interp_surrogate
@pytest.mark.parametrize("slots", [0, 1])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_order_strides_and_unchecked_ids(kv_format: str, slots: int) -> None:
    """Ids in any order, q, id and cache views with padded outer strides, and (unchecked) an id
    past its request's context, which the kernel must skip rather than read; with and without
    the id -> slot pre-pass (SLOTS), which must skip it too."""
    case, ids = _case(kv_format, 12, 16, DECODE)
    g = torch.Generator().manual_seed(5)
    shuffled = ids.clone()
    for r in range(ids.shape[0]):
        n = int((ids[r] >= 0).sum())
        shuffled[r, :n] = ids[r, :n][torch.randperm(n, generator=g).to(ids.device)]
    ref = _reference(case, ids, kv_format)
    q_big = poison_(torch.empty((case.q.shape[0], case.q.shape[1] + 3, case.q.shape[2]),
                                dtype=surrogate(case.q).dtype, device=DEVICE))
    q = q_big[:, :case.q.shape[1]]
    q.copy_(case.q)
    cache = {}
    for name, t in surrogate_cache(case.cache).items():
        big = poison_(torch.empty((t.shape[0], t[0].numel() + 64), dtype=t.dtype, device=DEVICE))
        cache[name] = big.narrow(1, 0, t[0].numel()).unflatten(1, t.shape[1:])
        cache[name].copy_(t)
    past = torch.full((ids.shape[0], ids.shape[1] + 5), -7, dtype=ids.dtype,
                      device=DEVICE)[:, :ids.shape[1]]
    past.copy_(shuffled)
    r = int(((past < 0).any(1) & (past >= 0).any(1)).nonzero()[0])
    free = int((past[r] < 0).nonzero()[0])
    ctx = int(case.batch.context_lens[case.batch.row_request[r]])
    past[r, free] = ctx + 1  # past the context, inside the pool
    out = poisoned(tuple(case.q.shape), OUT_DTYPE)
    assert q.stride(0) != q[0].numel() and past.stride(0) != past.shape[1]
    sparse_gqa_decode(q, cache, case.batch, past, case.preset, kv_format, out=out,
                      num_splits=2, check=False,
                      config=_entry_with(kv_format, q.shape[0], SLOTS=slots))
    torch.testing.assert_close(out.float(), ref, **_tol(ref))


@pytest.mark.interp_surrogate
def test_fp8_error_against_bf16_is_bounded(capsys: pytest.CaptureFixture) -> None:
    """FP8 attention vs BF16 attention on the same outlier-bearing K/V (qsa.cases).

    Bound, per (row, head, dim), exact for the data at hand: with eps = the largest score change
    the FP8 keys cause on the row's ids, every softmax weight moves by a factor within
    e^(+-2 eps), so |o8 - o16| <= max_n |v8_n - v16_n| + (e^(2 eps) - 1) max_n |v16_n| (plus
    the kernels' own rounding, a 2^-8 slack). The global relative error is reported, and held
    under 2^-3 (one E4M3 step at any magnitude): above that the error would be systematic.
    """
    case16, ids = _case("bf16", 12, 16, DECODE, head_dim=256, topk=16)
    case8, _ = _case("fp8", 12, 16, DECODE, head_dim=256, topk=16)
    o16 = _run(sparse_gqa_decode, case16, ids, "bf16")
    o8 = _run(sparse_gqa_decode, case8, ids, "fp8")
    p = case16.preset
    rr = case16.batch.row_request.tolist()
    bound = torch.zeros_like(o16)
    for r in range(ids.shape[0]):
        tok = ids[r][ids[r] >= 0].long()
        k16, v16 = gather_kv(case16.cache, case16.batch, rr[r], tok, "bf16")
        k8, v8 = gather_kv(case8.cache, case8.batch, rr[r], tok, "fp8")
        q = case16.q[r].float().view(p.num_kv_heads, p.gqa_group, p.head_dim)
        s16 = torch.einsum("hgd,nhd->hgn", q, k16) * p.softmax_scale
        s8 = torch.einsum("hgd,nhd->hgn", q, k8) * p.softmax_scale
        eps = (s8 - s16).abs().amax(-1).flatten()  # [Hq]
        dv = (v8 - v16).abs().amax(0).repeat_interleave(p.gqa_group, 0)  # [Hq, D]
        vmax = v16.abs().amax(0).repeat_interleave(p.gqa_group, 0)
        bound[r] = dv + torch.expm1(2 * eps)[:, None] * vmax + 2.0 ** -8 * vmax
    err = (o8 - o16).abs()
    rel = float((o8 - o16).norm() / o16.norm())
    used = float((err / bound).max())
    with capsys.disabled():
        print(f"\nFP8 vs BF16 sparse GQA: relative error {rel:.4f} (Frobenius), "
              f"max {used:.2f} of the first-order bound")
    assert (err <= bound).all(), f"FP8 error exceeds the bound by {used:.2f}x"
    assert rel <= 2.0 ** -3


def test_choose_splits() -> None:
    # Grids that fill the resident slots are not split; smaller ones split to fill one wave.
    assert choose_splits(512, 2051, 32, 132, 2, 2) == 1
    assert choose_splits(256, 2051, 32, 132, 2, 2) == 1
    assert choose_splits(64, 2051, 32, 132, 2, 2) == 4
    assert choose_splits(8, 2051, 32, 132, 8, 2) == 32
    assert choose_splits(8, 2051, 64, 132, 8, 2) == 16  # 33 blocks, at least 2 per split
    assert choose_splits(1, 10**6, 16, 1000, 8, 1) == MAX_SPLITS
    assert choose_splits(4, 20, 16, 132, 2, 2) == 1  # too few blocks to split
    # What a launch uses: whole blocks per split, none empty, so a requested count is clamped
    # to cdiv(blocks, cdiv(blocks, requested)). Blocks of 16 over a width of 35 are 3 blocks:
    # 3 requested stay 3, 4 become 3, 2 stay 2. The block size is pinned by the config, since
    # the tables' BLOCK_N differs per device (32 on sm90 would give 2 blocks, so 2 splits).
    p = _preset(12, 16)
    n16 = BlockConfig({"BLOCK_N": 16})
    assert split_count(10, p, 35, "bf16", DEVICE, config=n16, num_splits=3) == 3
    assert split_count(10, p, 35, "bf16", DEVICE, config=n16, num_splits=4) == 3
    assert split_count(10, p, 35, "bf16", DEVICE, config=n16, num_splits=2) == 2
    assert split_count(10, p, 35, "bf16", DEVICE, config=BlockConfig({"BLOCK_N": 32}),
                       num_splits=3) == 2
    assert split_count(10, p, 35, "fp8", DEVICE, prefill=True) == 1


def test_work_counts_unique_rows() -> None:
    case, ids = _case("fp8", 12, 16, DECODE)
    p = case.preset
    w = work(ids, case.batch, p, "fp8")
    rr = case.batch.row_request
    unique = sum(len(set(ids[rr == b][ids[rr == b] >= 0].tolist())) for b in range(4))
    rows = ids.shape[0]
    per_token = p.num_kv_heads * (2 * p.head_dim + 8)
    assert w.bytes_moved == (unique * per_token + 4 * rows * p.num_q_heads * p.head_dim
                             + ids.numel() * 4)
    assert w.flops == int((ids >= 0).sum()) * p.num_q_heads * p.head_dim * 4
    assert work(ids, case.batch, p, "bf16").bytes_moved > w.bytes_moved


def test_errors() -> None:
    case, ids = _case("fp8", 12, 16, DECODE)
    q, cache, b, p = surrogate(case.q), surrogate_cache(case.cache), case.batch, case.preset

    def call(**kw):
        args = dict(q=q, cache=cache, batch=b, token_ids=ids, preset=p, kv_format="fp8")
        args.update(kw)
        return sparse_gqa_decode(**args)

    with pytest.raises(KernelInputError, match="k_scale"):
        call(cache={n: t for n, t in cache.items() if n != "k_scale"})
    with pytest.raises(KernelInputError, match="dtype"):
        call(kv_format="bf16")  # FP8 codes declared as a BF16 cache
    with pytest.raises(KernelInputError, match="q: dtype"):
        call(q=q.half())
    with pytest.raises(KernelInputError, match="q: expected"):
        call(q=q[:, :12])
    with pytest.raises(KernelInputError, match="cache\\['k'\\]: expected"):
        call(batch=PagedBatch(b.block_table, b.context_lens, b.query_start, b.positions, 32))
    with pytest.raises(KernelInputError, match="token_ids: dtype"):
        call(token_ids=ids.long())
    with pytest.raises(KernelInputError, match="token_ids: expected"):
        call(token_ids=ids[:-1])
    with pytest.raises(KernelInputError, match="out: expected"):
        call(out=torch.empty((1, 2, 3), device=DEVICE))
    with pytest.raises(KernelInputError, match="num_splits"):
        call(num_splits=MAX_SPLITS + 1)
    with pytest.raises(KernelInputError, match="KV format"):
        call(kv_format="int8")
    with pytest.raises(KernelInputError, match="BLOCK_N"):
        call(config=BlockConfig({"BLOCK_N": 24}))
    past = ids.clone()
    past[0, 0] = int(b.context_lens[0])
    with pytest.raises(KernelInputError, match="outside row 0's request context"):
        call(token_ids=past, check=True)
    bt = b.block_table.clone()
    bt[0, 0] = cache["k"].shape[0]
    with pytest.raises(KernelInputError, match="outside the pool"):
        call(batch=PagedBatch(bt, b.context_lens, b.query_start, b.positions, b.block_size),
             check=True)
    with pytest.raises(KernelInputError, match="GQA group"):
        big = p.replace(num_q_heads=2 * 256, num_kv_heads=2)
        # q of the production dtype (bf16 on a GPU), so only the group size is wrong.
        call(preset=big, q=torch.empty((q.shape[0], 512, p.head_dim), dtype=q.dtype,
                                       device=DEVICE))


def test_default_out_is_bf16() -> None:
    case, ids = _case("bf16", 12, 16, DECODE)
    ref = _reference(case, ids, "bf16")
    out = sparse_gqa_prefill(surrogate(case.q), surrogate_cache(case.cache), case.batch, ids,
                             case.preset, "bf16")
    assert out.dtype == torch.bfloat16
    # One bf16 step: the interpreter's store truncates (rounds to nearest on a GPU).
    torch.testing.assert_close(out.float(), ref, atol=1e-3 * float(ref.abs().max()),
                               rtol=2.0 ** -7)


def test_empty_rows() -> None:
    case, ids = _case("bf16", 12, 16, DECODE)
    b = case.batch
    empty = PagedBatch(b.block_table, b.context_lens, torch.zeros_like(b.query_start),
                       b.positions[:0], b.block_size)
    out = sparse_gqa_decode(surrogate(case.q)[:0], surrogate_cache(case.cache), empty, ids[:0],
                            case.preset, "bf16")
    assert out.shape == (0, *case.q.shape[1:])


# --- GPU: production dtypes at the model's shapes ----------------------------------------------

GPU_DECODE = ((5000, 1200, 3, 9000, 700), (4, 4, 2, 4, 1))
GPU_PREFILL = ((4096,), (1024,))


@lru_cache(maxsize=None)
def _gpu_case(kv_format: str, preset_name: str, block_size: int, shape: tuple, seed: int = 11):
    p = get_preset(preset_name).replace(block_size=block_size)
    case = make_case(CaseSpec(p, shape[0], shape[1], kv_format=kv_format, seed=seed), DEVICE)
    scores = score_reference(case.cache, case.batch, case.q_index, p, "bf16")
    return case, topk_expand_reference(scores, case.batch, p)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [0, 1])
@pytest.mark.parametrize("splits", [None, 1, 8])
@pytest.mark.parametrize("preset_name", ["qwen3.8-flash-next", "qwen3.8-flash-next-tp2"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_decode(kv_format: str, block_size: int, preset_name: str,
                    splits: int | None, slots: int) -> None:
    case, ids = _gpu_case(kv_format, preset_name, block_size, GPU_DECODE)
    ids = ids.clone()
    ids[-1] = -1
    ref = _reference(case, ids, kv_format)
    out = _run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits,
               config=_entry_with(kv_format, ids.shape[0], SLOTS=slots))
    torch.testing.assert_close(out, ref, **_tol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 8])
@pytest.mark.parametrize("preset_name", ["qwen3.8-flash-next", "qwen3.8-flash-next-tp2"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_decode_pv_halves(kv_format: str, block_size: int, preset_name: str,
                              splits: int | None) -> None:
    case, ids = _gpu_case(kv_format, preset_name, block_size, GPU_DECODE)
    ids = ids.clone()
    ids[-1] = -1
    ref = _reference(case, ids, kv_format)
    out = _run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits,
               config=_entry_with(kv_format, ids.shape[0], SLOTS=1, PV_HALVES=1))
    torch.testing.assert_close(out, ref, **_tol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [0, 1])
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_decode_pdl(kv_format: str, splits: int, slots: int) -> None:
    """Programmatic dependent launch (PDL=1) of the pre-pass, attention and merge grids, each
    waiting for the previous grid before touching memory: the output is the reference's, also
    when the call is captured in a CUDA graph and replayed."""
    if torch.version.hip is not None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs NVIDIA sm90 or newer")
    case, ids = _gpu_case(kv_format, "qwen3.8-flash-next", 64, GPU_DECODE)
    ref = _reference(case, ids, kv_format)
    config = _entry_with(kv_format, ids.shape[0], SLOTS=slots, PDL=1)
    torch.testing.assert_close(_run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits,
                                    config=config), ref, **_tol(ref))
    q, cache = surrogate(case.q), surrogate_cache(case.cache)
    out = torch.empty(tuple(case.q.shape), dtype=OUT_DTYPE, device=DEVICE)

    def call() -> None:
        sparse_gqa_decode(q, cache, case.batch, ids, case.preset, kv_format, out=out,
                          config=config, num_splits=splits, check=False)

    replay_captured(call, out)
    torch.testing.assert_close(out.float(), ref, **_tol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_decode_group_one(kv_format: str) -> None:
    p = get_preset().replace(num_q_heads=4, num_kv_heads=4)
    case = make_case(CaseSpec(p, GPU_DECODE[0], GPU_DECODE[1], kv_format=kv_format, seed=3),
                     DEVICE)
    ids = topk_expand_reference(score_reference(case.cache, case.batch, case.q_index, p, "bf16"),
                                case.batch, p)
    ref = _reference(case, ids, kv_format)
    for splits in (1, 4):
        out = _run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits)
        torch.testing.assert_close(out, ref, **_tol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_prefill(kv_format: str) -> None:
    case, ids = _gpu_case(kv_format, "qwen3.8-flash-next", 64, GPU_PREFILL)
    ref = _reference(case, ids, kv_format)
    torch.testing.assert_close(_run(sparse_gqa_prefill, case, ids, kv_format), ref,
                               **_tol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("per", [4, 8])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_prefill_row_blocks(kv_format: str, per: int) -> None:
    """ROWS > 1 on the GPU, where the loop stops at each block's union length."""
    case, ids = _gpu_case(kv_format, "qwen3.8-flash-next", 64, GPU_PREFILL)
    ref = _reference(case, ids, kv_format)
    config = BlockConfig({"BLOCK_N": 32, "ROWS": per, "PV_HALVES": int(per == 8)},
                         num_warps=8 if per == 8 else 4, num_stages=2)
    torch.testing.assert_close(_run(sparse_gqa_prefill, case, ids, kv_format, config=config),
                               ref, **_tol(ref))


@pytest.mark.gpu
def test_gpu_fp8_error_against_bf16() -> None:
    case16, ids = _gpu_case("bf16", "qwen3.8-flash-next", 64, GPU_DECODE)
    case8, _ = _gpu_case("fp8", "qwen3.8-flash-next", 64, GPU_DECODE)
    o16 = _run(sparse_gqa_decode, case16, ids, "bf16")
    o8 = _run(sparse_gqa_decode, case8, ids, "fp8")
    rel = float((o8 - o16).norm() / o16.norm())
    print(f"\nFP8 vs BF16 sparse GQA on the GPU: relative error {rel:.4f}")
    assert math.isfinite(rel) and rel <= 2.0 ** -3


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [0.0, 0.9])
@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_shared_path_table_entries(kv_format: str, prefill: bool, overlap: float) -> None:
    """The shared path with this device's own table entries (bf16-shared / fp8-shared), on
    ragged batches whose rows overlap or not, shuffled pages, a row without ids and blocks
    that straddle requests: the reference's output, poisoned output fully written, also when
    captured in a CUDA graph (union kernels included) and replayed."""
    p = get_preset()
    shape = GPU_PREFILL if prefill else GPU_DECODE
    case = make_case(CaseSpec(p, shape[0], shape[1], kv_format=kv_format, seed=5,
                              overlap=overlap), DEVICE)
    scores = score_reference(case.cache, case.batch, case.q_index, p, "bf16")
    ids = topk_expand_reference(scores, case.batch, p)
    ids[1] = -1
    ref = _reference(case, ids, kv_format)
    fn = sparse_gqa_prefill if prefill else sparse_gqa_decode
    torch.testing.assert_close(_run(fn, case, ids, kv_format, shared=True), ref, **_tol(ref))
    q, cache = surrogate(case.q), surrogate_cache(case.cache)
    out = torch.empty(tuple(case.q.shape), dtype=OUT_DTYPE, device=DEVICE)

    def call() -> None:
        fn(q, cache, case.batch, ids, p, kv_format, out=out, shared=True, check=False)

    replay_captured(call, out)
    torch.testing.assert_close(out.float(), ref, **_tol(ref))


# The Gluon implementation (impl "gluon", NVIDIA sm90): its own keys beside the host keys of
# this device's Triton entry (splits, merge).
GLUON_META = {"BLOCK_N": 64, "STAGES": 3, "LOAD_WARPS": 4, "LOAD_REGS": 96}
NOT_SM90 = "the Gluon kernel is NVIDIA sm90's (warp specialization, cp.async, mbarriers)"


def _gluon_entry(kv_format: str, rows: int, num_warps: int = 4, **meta: int) -> BlockConfig:
    base = _entry_with(kv_format, rows)
    return BlockConfig({**base.meta, **GLUON_META, **meta}, num_warps, 1, impl="gluon")


def _on_sm90() -> bool:
    return (torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability() == (9, 0))


def test_gluon_impl_is_refused_where_it_can_not_run() -> None:
    """The interpreter (and ROCm, older NVIDIA) run the Triton kernel; an entry naming the
    Gluon one there is an error that says so, never a silent fallback."""
    if _on_sm90():
        pytest.skip("runs the Gluon kernel here; the refusal is for other devices")
    case, ids = _case("fp8", 12, 16, DECODE)
    with pytest.raises(KernelInputError, match="impl gluon runs on NVIDIA sm90 only"):
        _run(sparse_gqa_decode, case, ids, "fp8", config=_gluon_entry("fp8", ids.shape[0]))
    with pytest.raises(ValueError, match="impl: 'cutlass' is not one of triton, gluon"):
        BlockConfig({"BLOCK_N": 16}, impl="cutlass")
    entry = _gluon_entry("fp8", 4)
    assert BlockConfig.from_dict(entry.as_dict()) == entry
    assert "impl" not in _entry_with("fp8", 4).as_dict()  # Triton entries keep their JSON


# No pre-pass: the load warps resolve the ids and hand the slots over in shared memory.
RESOLVING = {"SLOTS_AHEAD": 1, "RESOLVE_IDS": 1}


@pytest.mark.gpu
@pytest.mark.parametrize(("num_warps", "meta"), [
    (4, {}), (4, {"BLOCK_N": 32, "STAGES": 4}), (8, {"STAGES": 2, "LOAD_WARPS": 1}),
    (4, {"SLOTS_AHEAD": 1}), (4, RESOLVING),
    (8, {**RESOLVING, "BLOCK_N": 64, "STAGES": 1, "LOAD_WARPS": 2})],
    ids=["base", "n32-s4", "w8-lw1", "ahead", "resolving", "resolving-w8"])
@pytest.mark.parametrize("splits", [None, 1, 8])
@pytest.mark.parametrize("preset_name", ["qwen3.8-flash-next", "qwen3.8-flash-next-tp2"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_decode_gluon(kv_format: str, block_size: int, preset_name: str,
                          splits: int | None, num_warps: int, meta: dict) -> None:
    """The Gluon kernel on poisoned outputs, a ragged batch over shuffled pages, a row without
    ids, split (merged by the merge kernel) and unsplit; slots from the pre-pass or resolved
    by the load warps."""
    if not _on_sm90():
        pytest.skip(NOT_SM90)
    case, ids = _gpu_case(kv_format, preset_name, block_size, GPU_DECODE)
    ids = ids.clone()
    ids[-1] = -1
    ref = _reference(case, ids, kv_format)
    out = _run(sparse_gqa_decode, case, ids, kv_format, num_splits=splits,
               config=_gluon_entry(kv_format, ids.shape[0], num_warps, **meta))
    torch.testing.assert_close(out, ref, **_tol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("meta", [{}, RESOLVING], ids=["pre-pass", "resolving"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8"])
def test_gpu_decode_gluon_graph_replay(kv_format: str, meta: dict) -> None:
    """Captured in a CUDA graph (the slots pre-pass or none, the Gluon grid, the merge) and
    replayed."""
    if not _on_sm90():
        pytest.skip(NOT_SM90)
    case, ids = _gpu_case(kv_format, "qwen3.8-flash-next", 64, GPU_DECODE)
    ref = _reference(case, ids, kv_format)
    config = _gluon_entry(kv_format, ids.shape[0], **meta)
    q, cache = surrogate(case.q), surrogate_cache(case.cache)
    out = torch.empty(tuple(case.q.shape), dtype=OUT_DTYPE, device=DEVICE)

    def call() -> None:
        sparse_gqa_decode(q, cache, case.batch, ids, case.preset, kv_format, out=out,
                          config=config, num_splits=4, check=False)

    replay_captured(call, out)
    torch.testing.assert_close(out.float(), ref, **_tol(ref))
