"""The float32 reference of one QSA layer (spec section 2).

Checked against independent computations: dense causal attention while every group fits the
budget, a hand-written selection oracle for the tie rule, hand-computed scores, compression and
attention, and the invariants a kernel must share (decode and verify pick the same groups; a
group split across prefill chunks compresses as in one chunk).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from qsa.cases import Case, CaseSpec, make_case, poison_
from qsa.paging import PagedBatch
from qsa.presets import get_preset
from qsa.reference import (compress_reference, dense_causal_reference, expand_reference,
                           qsa_layer_reference, score_reference, select_reference,
                           sparse_gqa_reference, topk_expand_reference, visible_groups,
                           write_raw_keys_reference)
from qsa.reference.score import compressed_keys

PRESET = get_preset().replace(block_size=16)
FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


# --------------------------------------------------------------------------------------------
# Independent helpers
# --------------------------------------------------------------------------------------------

def oracle_select(scores: list[float], visible: int, k: int) -> list[int]:
    """Top min(k, visible) groups: highest score first, ties to the lower index; ascending."""
    order = sorted(range(visible), key=lambda g: (-scores[g], g))
    return sorted(order[:min(k, visible)])


def expected_count(p: int, k: int) -> int:
    return min(4 * ((p + 1) // 4), 4 * k) + (p + 1) % 4


def run_layer(case: Case, preset=None) -> object:
    c = case
    return qsa_layer_reference(c.cache, c.batch, preset or c.preset, raw_keys=c.raw_keys,
                               k=c.k_new, v=c.v_new, q=c.q, q_index=c.q_index,
                               rms_weight=c.rms_weight, index_format=c.spec.index_format,
                               kv_format=c.spec.kv_format, fp8_dtype=c.spec.fp8_dtype)


def check_ids(ids: list[int], p: int, k: int, width: int) -> list[int]:
    """Invariants of one expanded row; returns the selected groups."""
    valid = [i for i in ids if i >= 0]
    n = expected_count(p, k)
    assert len(ids) == width
    assert ids[:n] == valid and all(i == -1 for i in ids[n:]), "ids must be -1 padded at the end"
    assert len(valid) == n, (p, len(valid), n)
    assert len(set(valid)) == n and max(valid, default=0) <= p and min(valid, default=0) >= 0
    tail_len = (p + 1) % 4
    tail = valid[n - tail_len:] if tail_len else []
    assert tail == list(range(4 * ((p + 1) // 4), p + 1))
    body = valid[:n - tail_len]
    groups = [t // 4 for t in body[0::4]]
    assert body == [4 * g + j for g in groups for j in range(4)]
    assert groups == sorted(groups)
    return groups


def kv_by_hand(case: Case, request: int, tokens: list[int], name: str) -> torch.Tensor:
    """Float64 K or V [n, Hkv, D] read through the page table (FP8: code * scale)."""
    bs, t = case.batch.block_size, case.batch.block_table.tolist()
    out = []
    for p in tokens:
        blk, off = t[request][p // bs], p % bs
        x = case.cache[name][blk, off].double()
        if f"{name}_scale" in case.cache:
            x = x * case.cache[f"{name}_scale"][blk, off].double()[:, None]
        out.append(x)
    return torch.stack(out)


def attention_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """Float64, head by head: query head h reads KV head h // (Hq / Hkv)."""
    hq, hkv = q.shape[0], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        logits = (k[:, kh] @ q[h].double()) * scale
        out[h] = torch.softmax(logits, 0) @ v[:, kh]
    return out


def index_keys_by_hand(case: Case, request: int) -> torch.Tensor:
    """BF16 compressed keys [ctx//4, D] of one request, read through the page table."""
    assert case.spec.index_format == "bf16"
    bs, t = case.batch.block_size, case.batch.block_table.tolist()
    n = int(case.batch.context_lens[request]) // 4
    return torch.stack([case.cache["index_compressed"][t[request][4 * g // bs],
                                                       (4 * g % bs) // 4, 0].double()
                        for g in range(n)]) if n else torch.zeros(0, case.preset.index_dim,
                                                                   dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# Dense equivalence while visible <= top-k
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("index_format,kv_format,fp8", [
    ("bf16", "bf16", torch.float8_e4m3fn),
    ("mxfp4", "fp8", torch.float8_e4m3fn),
    ("fp8", "fp8", torch.float8_e4m3fnuz),
])
def test_sparse_equals_dense_causal_below_budget(index_format: str, kv_format: str,
                                                 fp8: torch.dtype) -> None:
    # 2048 tokens: the last row sees exactly 512 = top-k groups; 3 tokens: no group at all.
    ctx, rows = (2048, 301, 37, 3), (2, 3, 2, 3)
    case = make_case(CaseSpec(PRESET, ctx, rows, index_format=index_format, kv_format=kv_format,
                              fp8_dtype=fp8, seed=21))
    assert int(visible_groups(case.batch).max()) == PRESET.topk_groups
    res = run_layer(case)
    for r, p in enumerate(case.batch.positions.tolist()):
        ids = res.token_ids[r].tolist()
        assert ids[:p + 1] == list(range(p + 1)) and set(ids[p + 1:]) <= {-1}, r
    dense = dense_causal_reference(case.q, case.cache, case.batch, kv_format,
                                   PRESET.softmax_scale)
    assert bool(torch.isfinite(res.out).all())
    torch.testing.assert_close(res.out, dense, rtol=1e-5, atol=1e-6)


def test_dense_reference_is_causal_attention() -> None:
    """dense_causal_reference against a float64 head-by-head computation (GQA head map)."""
    case = make_case(CaseSpec(PRESET, (70, 9), (3, 2), kv_format="fp8", seed=2))
    dense = dense_causal_reference(case.q, case.cache, case.batch, "fp8", PRESET.softmax_scale)
    rr = case.batch.row_request.tolist()
    for r, p in enumerate(case.batch.positions.tolist()):
        toks = list(range(p + 1))
        want = attention_by_hand(case.q[r], kv_by_hand(case, rr[r], toks, "k"),
                                 kv_by_hand(case, rr[r], toks, "v"), 1 / 16)
        torch.testing.assert_close(dense[r].double(), want, rtol=1e-4, atol=1e-5)


def test_sparse_gqa_by_hand_and_empty_rows() -> None:
    case = make_case(CaseSpec(PRESET, (90, 40), (2, 2), kv_format="fp8", seed=9))
    gen = torch.Generator().manual_seed(0)
    rr = case.batch.row_request.tolist()
    ids = torch.full((4, 50), -1, dtype=torch.int32)
    chosen = []
    for r, p in enumerate(case.batch.positions.tolist()):
        n = 0 if r == 1 else 37
        sel = torch.randperm(p + 1, generator=gen)[:n].tolist()
        ids[r, :n] = torch.tensor(sel, dtype=torch.int32)
        chosen.append(sel)
    out = sparse_gqa_reference(case.q, case.cache, case.batch, ids, "fp8", 1 / 16)
    assert bool((out[1] == 0).all())
    for r in (0, 2, 3):
        want = attention_by_hand(case.q[r], kv_by_hand(case, rr[r], chosen[r], "k"),
                                 kv_by_hand(case, rr[r], chosen[r], "v"), 1 / 16)
        torch.testing.assert_close(out[r].double(), want, rtol=1e-4, atol=1e-5)
    bad = ids.clone()
    bad[2, 0] = 40  # request 1 has 40 tokens: id 40 is past its context
    with pytest.raises(ValueError):
        sparse_gqa_reference(case.q, case.cache, case.batch, bad, "fp8", 1 / 16)


# --------------------------------------------------------------------------------------------
# Selection and expansion
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 8, 512])
def test_select_tie_rule_matches_oracle(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    rows, width = 24, 700
    # Heavy ties: a few distinct levels, most scores exactly 0 (as after the ReLU).
    levels = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 1.25, 3.0])
    scores = levels[torch.randint(0, len(levels), (rows, width), generator=gen)]
    visible = torch.randint(0, width + 1, (rows,), generator=gen).to(torch.int32)
    visible[:3] = torch.tensor([0, 1, width], dtype=torch.int32)
    for r in range(rows):
        scores[r, int(visible[r]):] = float("-inf")
    groups, counts = select_reference(scores, visible, k)
    assert groups.shape == (rows, k) and groups.dtype == torch.int32
    for r in range(rows):
        v = int(visible[r])
        want = oracle_select(scores[r].tolist(), v, k)
        assert int(counts[r]) == len(want) == min(k, v)
        assert groups[r].tolist() == want + [-1] * (k - len(want)), r


def test_select_all_ties_picks_lowest_groups() -> None:
    scores = torch.zeros(2, 40)
    groups, counts = select_reference(scores, torch.tensor([40, 10], dtype=torch.int32), 8)
    assert groups[0].tolist() == list(range(8))
    assert groups[1].tolist() == list(range(8))
    assert counts.tolist() == [8, 8]


def test_expand_count_formula_many_positions_full_budget() -> None:
    """Positions below, at and far above the 2048-token budget of the real preset."""
    p_all = list(range(0, 24)) + list(range(2040, 2056)) + [4095, 4096, 4097, 5001, 9998]
    k = get_preset().topk_groups
    width = get_preset().expand_width
    gen = torch.Generator().manual_seed(1)
    vis = torch.tensor([(p + 1) // 4 for p in p_all], dtype=torch.int32)
    scores = torch.randint(0, 4, (len(p_all), int(vis.max())), generator=gen).float()
    groups, counts = select_reference(scores, vis, k)
    ids = expand_reference(groups, counts, torch.tensor(p_all, dtype=torch.int32), width)
    assert ids.shape == (len(p_all), 2051)
    for r, p in enumerate(p_all):
        got = check_ids(ids[r].tolist(), p, k, width)
        assert got == oracle_select(scores[r].tolist(), int(vis[r]), k)
    assert max(expected_count(p, k) for p in p_all) == 2048 + 3


def test_expand_count_and_selection_through_pipeline_small_topk() -> None:
    """topk 8 makes selection bite at small contexts: 4*8 + tail ids, the top-scoring groups."""
    k = 8
    preset = PRESET.replace(topk_groups=k)
    ctx, rows = (203, 37, 3, 64, 33), (4, 3, 3, 4, 2)
    case = make_case(CaseSpec(preset, ctx, rows, index_format="fp8", seed=5))
    res = run_layer(case)
    dense = dense_causal_reference(case.q, case.cache, case.batch, "bf16", preset.softmax_scale)
    bites = 0
    for r, p in enumerate(case.batch.positions.tolist()):
        groups = check_ids(res.token_ids[r].tolist(), p, k, preset.expand_width)
        v = (p + 1) // 4
        assert groups == oracle_select(res.scores[r].tolist(), v, k)
        if v > k:
            bites += 1
            assert not torch.allclose(res.out[r], dense[r], rtol=1e-3, atol=1e-4), r
        else:
            torch.testing.assert_close(res.out[r], dense[r], rtol=1e-5, atol=1e-6)
    assert bites >= 8


def test_expand_beyond_budget_through_score_and_select() -> None:
    """The real top-k (512) past 2048 tokens: 2048 selected ids plus the tail, never more."""
    preset = PRESET  # top-k 512, block size 16
    ctx, rows = (3001, 2050, 700), (3, 2, 1)
    case = make_case(CaseSpec(preset, ctx, rows, index_format="fp8", seed=19, build_kv=False))
    scores = score_reference(case.cache, case.batch, case.q_index, preset, "fp8")
    ids = topk_expand_reference(scores, case.batch, preset)
    assert ids.shape == (sum(rows), 2051)
    for r, p in enumerate(case.batch.positions.tolist()):
        groups = check_ids(ids[r].tolist(), p, 512, preset.expand_width)
        assert groups == oracle_select(scores[r].tolist(), (p + 1) // 4, 512)
        assert len(groups) == min(512, (p + 1) // 4)


def test_expand_width_overflow_raises() -> None:
    groups = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError):
        expand_reference(groups, torch.tensor([2], dtype=torch.int32),
                         torch.tensor([10], dtype=torch.int32), 8)


# --------------------------------------------------------------------------------------------
# Decode (1 row) and verify (4 rows) select the same groups, ties included
# --------------------------------------------------------------------------------------------

def _tie_heavy_q_index(case: Case) -> torch.Tensor:
    """Index queries that make most scores exactly 0: only head 0 is non-zero, along the
    direction (a +-unit channel) with the fewest positive dot products with the request's keys;
    a few positive scores remain so the ranking is not all ties."""
    q = torch.zeros_like(case.q_index)
    rr = case.batch.row_request.tolist()
    d = case.preset.index_dim
    for r in range(q.shape[0]):
        keys = compressed_keys(case.cache, case.batch, rr[r], case.spec.index_format)
        cands = torch.cat((torch.eye(d), -torch.eye(d)))
        pos = (cands @ keys.T > 0).sum(1)
        pos = torch.where(pos > 0, pos, torch.full_like(pos, 10 ** 6))
        q[r, 0] = cands[int(pos.argmin())] * d ** 0.5
    return q


@pytest.mark.parametrize("index_format", ["bf16", "fp8", "mxfp4"])
def test_decode_and_verify_select_same_groups_with_ties(index_format: str) -> None:
    ctx = (123, 78)
    case = make_case(CaseSpec(PRESET, ctx, (4, 4), index_format=index_format, seed=13))
    q_index = _tie_heavy_q_index(case)
    # Scores do not depend on k: pick k so that every row has fewer positive scores than k and
    # more zero scores than the k - positives slots left, i.e. the tie rule decides every row.
    first = score_reference(case.cache, case.batch, q_index, PRESET, index_format)
    vis = visible_groups(case.batch).tolist()
    n_pos = [int((first[r, :v] > 0).sum()) for r, v in enumerate(vis)]
    k = max(n_pos) + 2
    assert k < min(vis) - 2, (n_pos, vis)
    preset = PRESET.replace(topk_groups=k)
    verify_scores = score_reference(case.cache, case.batch, q_index, preset, index_format)
    verify_ids = topk_expand_reference(verify_scores, case.batch, preset)
    rr = case.batch.row_request.tolist()
    for r, p in enumerate(case.batch.positions.tolist()):
        req = rr[r]
        # The decode step of token p: context p + 1, one row, same cache and page table.
        dec = PagedBatch(case.batch.block_table[req:req + 1],
                         torch.tensor([p + 1], dtype=torch.int32),
                         torch.tensor([0, 1], dtype=torch.int32),
                         torch.tensor([p], dtype=torch.int32), preset.block_size)
        dec.validate(case.num_blocks)
        dec_scores = score_reference(case.cache, dec, q_index[r:r + 1], preset, index_format)
        dec_ids = topk_expand_reference(dec_scores, dec, preset)
        v = (p + 1) // 4
        assert v == vis[r]
        assert torch.equal(dec_scores[0, :v], verify_scores[r, :v])
        assert dec_ids[0].tolist() == verify_ids[r].tolist(), r
        s = verify_scores[r, :v].tolist()
        top = [g for g in range(v) if s[g] > 0]
        zeros = [g for g in range(v) if s[g] == 0]
        assert len(top) + len(zeros) == v and len(top) < k < len(top) + len(zeros)
        # Ties decide: all positives, then the lowest-index zero-score groups.
        groups = check_ids(verify_ids[r].tolist(), p, k, preset.expand_width)
        assert groups == sorted(top + zeros[:k - len(top)])


# --------------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------------

def _fresh_index_cache(case: Case) -> dict[str, torch.Tensor]:
    """The case's cache with every index plane poisoned again."""
    cache = {k: v.clone() for k, v in case.cache.items()}
    for name in ("index_raw", "index_compressed", "index_compressed_scale"):
        if name in cache:
            poison_(cache[name])
    return cache


def _raw_all(case: Case) -> list[torch.Tensor]:
    bs, t = case.batch.block_size, case.batch.block_table.tolist()
    return [torch.stack([case.cache["index_raw"][t[r][p // bs], p % bs, 0] for p in range(c)])
            for r, c in enumerate(case.spec.context_lens)]


def _pass(case: Case, cache: dict[str, torch.Tensor], raw: list[torch.Tensor], start: list[int],
          end: list[int], index_format: str) -> None:
    """One prefill chunk per request: write raw keys start..end-1, then compress."""
    b = case.batch
    reqs = [r for r in range(b.batch) for _ in range(start[r], end[r])]
    poss = [p for r in range(b.batch) for p in range(start[r], end[r])]
    counts = [end[r] - start[r] for r in range(b.batch)]
    qs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
    chunk = PagedBatch(b.block_table, torch.tensor(end, dtype=torch.int32), qs,
                       torch.tensor(poss, dtype=torch.int32), b.block_size)
    chunk.validate(case.num_blocks)
    slots = chunk.slots(torch.tensor(reqs), torch.tensor(poss))
    write_raw_keys_reference(cache, slots, torch.stack([raw[r][p] for r, p in zip(reqs, poss)]))
    compress_reference(cache, chunk, torch.tensor(start, dtype=torch.int32), case.rms_weight,
                       case.preset, index_format, case.spec.fp8_dtype)


def _group_written(case: Case, cache: dict[str, torch.Tensor], r: int, g: int) -> bool:
    bs, t = case.batch.block_size, case.batch.block_table.tolist()
    blk, off = t[r][4 * g // bs], (4 * g % bs) // 4
    if "index_compressed_scale" in cache and cache["index_compressed_scale"].dtype == torch.uint8:
        return bool((cache["index_compressed_scale"][blk, off] != 0xFF).all())
    return not bool(cache["index_compressed"][blk, off].float().isnan().any())


@pytest.mark.parametrize("index_format,fp8", [("bf16", torch.float8_e4m3fn),
                                              ("fp8", torch.float8_e4m3fn),
                                              ("fp8", torch.float8_e4m3fnuz),
                                              ("mxfp4", torch.float8_e4m3fn)])
def test_group_straddling_two_chunks_compresses_as_one(index_format: str,
                                                       fp8: torch.dtype) -> None:
    ctx = (45, 30, 19)
    case = make_case(CaseSpec(PRESET, ctx, (1, 1, 1), index_format=index_format, fp8_dtype=fp8,
                              seed=17, build_kv=False))
    raw = _raw_all(case)
    one = _fresh_index_cache(case)
    _pass(case, one, raw, [0, 0, 0], list(ctx), index_format)
    names = [n for n in ("index_compressed", "index_compressed_scale") if n in one]
    for n in names:  # one pass from scratch reproduces the case's own cache
        assert torch.equal(one[n].view(torch.uint8), case.cache[n].view(torch.uint8)), n
    for split in ([21, 14, 17], [22, 15, 18], [23, 13, 16], [16, 16, 16]):
        two = _fresh_index_cache(case)
        _pass(case, two, raw, [0, 0, 0], split, index_format)
        for r, s in enumerate(split):
            # The straddling group is complete only after the second chunk.
            assert all(_group_written(case, two, r, g) for g in range(s // 4))
            assert not _group_written(case, two, r, s // 4) or s % 4 == 0
        _pass(case, two, raw, split, list(ctx), index_format)
        for n in names:
            assert torch.equal(two[n].view(torch.uint8), one[n].view(torch.uint8)), (n, split)


def test_compress_by_hand() -> None:
    """mean of 4 raw keys (FP32, rounded to BF16), RMSNorm with (1 + w), NeoX RoPE over the
    first 64 dims at the group's first position 4g with theta 1e7; stored as BF16."""
    ctx = (70, 21)
    case = make_case(CaseSpec(PRESET, ctx, (1, 1), seed=3, build_kv=False))
    raw = _raw_all(case)
    cache = _fresh_index_cache(case)
    _pass(case, cache, raw, [0, 0], list(ctx), "bf16")
    keys = compress_reference({k: v.clone() for k, v in cache.items()}, case.batch,
                              torch.zeros(2, dtype=torch.int32), case.rms_weight, PRESET, "bf16")
    w = case.rms_weight.double()
    half = 32
    inv = [1e7 ** (-2 * i / 64) for i in range(half)]
    want = []
    for r, c in enumerate(ctx):
        for g in range(c // 4):
            m = raw[r][4 * g:4 * g + 4].float().sum(0) / 4
            m = m.to(torch.bfloat16).double()
            x = m / torch.sqrt(m.pow(2).mean() + 1e-6) * (1 + w)
            y = x.clone()
            for i in range(half):
                a = 4 * g * inv[i]
                y[i] = x[i] * math.cos(a) - x[i + half] * math.sin(a)
                y[i + half] = x[i + half] * math.cos(a) + x[i] * math.sin(a)
            want.append(y)
    want_t = torch.stack(want)
    torch.testing.assert_close(keys.double(), want_t, rtol=1e-5, atol=1e-5)
    for r in range(2):
        got = index_keys_by_hand(dataclasses.replace(case, cache=cache), r)
        n0 = sum(c // 4 for c in ctx[:r])
        ref = want_t[n0:n0 + got.shape[0]]
        torch.testing.assert_close(got, ref, rtol=2 ** -8, atol=1e-3)


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------

def test_scores_by_hand_and_visibility() -> None:
    ctx, rows = (37, 100, 5, 8), (3, 4, 2, 1)
    case = make_case(CaseSpec(PRESET, ctx, rows, seed=8, build_kv=False))
    scores = score_reference(case.cache, case.batch, case.q_index, PRESET, "bf16")
    assert scores.shape == (sum(rows), max(ctx) // 4) and scores.dtype == torch.float32
    rr = case.batch.row_request.tolist()
    for r, p in enumerate(case.batch.positions.tolist()):
        c = ctx[rr[r]]
        v = min((p + 1) // 4, c // 4)
        assert int(visible_groups(case.batch)[r]) == v
        assert bool(torch.isfinite(scores[r, :v]).all()), r
        assert bool((scores[r, v:] == float("-inf")).all()), r
        keys = index_keys_by_hand(case, rr[r])[:v]
        q = case.q_index[r].double()
        want = torch.relu(q @ keys.T).sum(0) / math.sqrt(128)
        torch.testing.assert_close(scores[r, :v].double(), want, rtol=1e-5, atol=1e-5)


def test_relu_is_per_head_not_folded_into_q() -> None:
    """Heads u and -u: per-head ReLU gives |u.k| > 0; summing the heads (or q) first gives 0."""
    case = make_case(CaseSpec(PRESET, (64, 29), (2, 1), seed=4, build_kv=False))
    q = torch.zeros_like(case.q_index)
    u = case.q_index[:, 0]
    q[:, 0], q[:, 1] = u, -u
    scores = score_reference(case.cache, case.batch, q, PRESET, "bf16")
    rr = case.batch.row_request.tolist()
    for r, p in enumerate(case.batch.positions.tolist()):
        v = (p + 1) // 4
        keys = index_keys_by_hand(case, rr[r])[:v]
        want = (keys @ u[r].double()).abs() / math.sqrt(128)
        assert bool((want > 0).all())
        torch.testing.assert_close(scores[r, :v].double(), want, rtol=1e-5, atol=1e-6)


def test_head_weights_scale_heads() -> None:
    case = make_case(CaseSpec(PRESET, (64,), (2,), seed=6, build_kv=False))
    w = torch.tensor([1.0, 0.0, 2.0, 0.5])
    got = score_reference(case.cache, case.batch, case.q_index, PRESET, "bf16", head_weights=w)
    keys = index_keys_by_hand(case, 0)
    for r, p in enumerate(case.batch.positions.tolist()):
        v = (p + 1) // 4
        want = (torch.relu(case.q_index[r].double() @ keys[:v].T) * w.double()[:, None]).sum(0)
        torch.testing.assert_close(got[r, :v].double(), want / math.sqrt(128), rtol=1e-5,
                                   atol=1e-5)
