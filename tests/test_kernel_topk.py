"""Top-k + expand kernel against `topk_expand_reference`, exactly (spec section 2, steps 4-5).

Selection is comparisons and counts on order-preserving integer keys, so there is no rounding
anywhere: every output must equal the reference bit for bit, on CPU and GPU.
"""

from __future__ import annotations

import pytest
import torch

from qsa.cases import CaseSpec, make_batch, make_case
from qsa.configs import BlockConfig
from qsa.configs import load_table
from qsa.kernels import topk as topk_module
from qsa.kernels.common import KernelInputError, lookup, observe_lookups
from qsa.kernels.topk import FORMAT, FORMAT_MANY_ROWS, KERNEL, MAX_K, topk_expand, work
from qsa.paging import PagedBatch
from qsa.presets import get_preset
from qsa.reference.score import score_reference, visible_groups
from qsa.reference.topk import topk_expand_reference
from support import DEVICE
from support import compile_for_gpu_targets

POISON = -7  # not a token id and not the -1 pad
# The k-th key search: bisection from the top bit, or below the bits the bound shows every
# candidate shares (config key BOUND).
ALGOS = pytest.mark.parametrize("algo", ["bisect", "bisect-bound"])


def _realistic(preset, ctx, rows, fmt="bf16", seed=0, device=DEVICE):
    """Scores of real compressed keys (reference scorer), NaN past each row's visible groups
    (the kernel must never read them)."""
    case = make_case(CaseSpec(preset, ctx, rows, index_format=fmt, build_kv=False, seed=seed),
                     device=device)
    s = score_reference(case.cache, case.batch, case.q_index, preset, fmt)
    vis = visible_groups(case.batch).long()
    cols = torch.arange(s.shape[1], device=s.device)
    s[cols[None, :] >= vis[:, None]] = float("nan")
    return case.batch, s


def _batch(preset, ctx, rows, seed=0, device=DEVICE) -> PagedBatch:
    spec = CaseSpec(preset, ctx, rows, build_kv=False, seed=seed)
    return make_batch(spec, torch.Generator().manual_seed(seed), device)


def _search(algo: str) -> dict[str, int]:
    """The meta keys of a search named as in ALGOS."""
    return {"BOUND": int(algo == "bisect-bound")}


def _algo(algo: str, n_cols: int, base: BlockConfig | None = None) -> BlockConfig:
    """The table's config for this row length (or `base`) with the given search."""
    return (base or lookup(KERNEL, FORMAT, n_cols)[0]).with_meta(**_search(algo))


def _check(scores: torch.Tensor, batch: PagedBatch, preset, config=None) -> torch.Tensor:
    ref = topk_expand_reference(scores, batch, preset)
    out = torch.full_like(ref, POISON)
    got = topk_expand(scores, batch, preset, config, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, ref)
    return got


# ------------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ------------------------------------------------------------------------------------------------

def test_many_rows_read_their_own_table_entries(monkeypatch) -> None:
    """A prefill chunk's thousands of rows and a decode call's few rows want different warps
    at the same candidate count: from MANY_ROWS rows on, the call looks its entry up under its
    own format key, which every arch of the table holds (a missing key would fail the call)."""
    p = get_preset(block_size=16, topk_groups=8)
    batch, s = _realistic(p, (130, 201), (2, 3), seed=4)
    for many_rows, want in ((batch.num_rows + 1, FORMAT), (batch.num_rows, FORMAT_MANY_ROWS)):
        monkeypatch.setattr(topk_module, "MANY_ROWS", many_rows)
        with observe_lookups() as seen:
            _check(s, batch, p)
        assert [(x.kernel, x.fmt, x.size) for x in seen] == [(KERNEL, want, s.shape[1])]
    for arch, by_fmt in load_table(KERNEL).items():
        assert {FORMAT, FORMAT_MANY_ROWS} <= set(by_fmt), arch


@ALGOS
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_small_k_realistic_scores(fmt: str, algo: str) -> None:
    """k = 8 so short contexts need a search; rows 1, 4 and 8 per request, ragged."""
    p = get_preset(block_size=16, topk_groups=8)
    batch, s = _realistic(p, (3, 37, 70, 130, 201, 64), (1, 4, 1, 4, 2, 8), fmt, seed=1)
    _check(s, batch, p, _algo(algo, s.shape[1]))


@ALGOS
def test_default_k_realistic_scores_multi_chunk(algo: str) -> None:
    """k = 512 with visible up to 2250 groups: the search, and a final pass over several chunks."""
    p = get_preset(block_size=64)
    batch, s = _realistic(p, (2100, 9000, 2052), (1, 2, 4), seed=2)
    assert int(visible_groups(batch).max()) > 2048
    _check(s, batch, p, _algo(algo, s.shape[1]))


@ALGOS
def test_heavy_ties(algo: str) -> None:
    """Mostly exact zeros (ReLU), a few repeated levels, +0 and -0 mixed, whole rows of zeros
    and a row of one constant: ties go to the lower group index."""
    p = get_preset(block_size=16, topk_groups=8)
    batch = _batch(p, (300, 150, 97, 64), (4, 3, 2, 1), seed=3)
    gen = torch.Generator().manual_seed(3)
    rows, w = batch.num_rows, 300 // 4
    levels = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (rows, w), generator=gen)]
    s = torch.where(torch.rand(rows, w, generator=gen) < 0.9, 0.0, levels)
    s[torch.rand(rows, w, generator=gen) < 0.3] = -0.0
    s[1] = 0.0
    s[2] = -0.0
    s[5] = 3.25
    _check(s.to(DEVICE), batch, p, _algo(algo, w))


@ALGOS
def test_default_k_ties_whole_row_of_zeros(algo: str) -> None:
    p = get_preset(block_size=64)
    batch = _batch(p, (4000, 2100), (2, 1), seed=4)
    s = torch.zeros(batch.num_rows, 1000, device=DEVICE)
    s[1, 700:] = 1.0  # 300 groups above the zeros: the other 212 are the lowest zero groups
    _check(s, batch, p, _algo(algo, s.shape[1]))


@ALGOS
def test_negative_scores_and_neg_inf(algo: str) -> None:
    """General FP32 order (signed head weights can make scores negative; -inf inside visible)."""
    p = get_preset(block_size=16, topk_groups=8)
    batch = _batch(p, (200, 120), (3, 2), seed=5)
    gen = torch.Generator().manual_seed(5)
    s = torch.randn(batch.num_rows, 50, generator=gen) * 100
    s[torch.rand(s.shape, generator=gen) < 0.2] = float("-inf")
    s[torch.rand(s.shape, generator=gen) < 0.1] = 0.0
    s[torch.rand(s.shape, generator=gen) < 0.1] = -0.0
    s[0, :40] = float("-inf")  # fewer than k finite scores
    _check(s.to(DEVICE), batch, p, _algo(algo, s.shape[1]))


@pytest.mark.parametrize("k", [6, 7, 13])
def test_bound_with_k_not_a_power_of_two(k: int) -> None:
    """The bound takes next_power_of_2(k) groups: still at least k distinct keys above it.
    Rows of few levels put the k-th key on a tie, or make the bound equal the largest key."""
    p = get_preset(block_size=16, topk_groups=k)
    batch, s = _realistic(p, (300, 211, 97), (3, 2, 2), seed=15)
    s[1] = torch.round(s[1] * 2) / 2
    s[2, :] = 0.75
    s[3, ::3] = 5.0
    _check(s, batch, p, _algo("bisect-bound", s.shape[1]))


@ALGOS
def test_visible_around_k(algo: str) -> None:
    """visible = k - 1, k (dense, no search) and k + 1 (search) in one request's rows."""
    p = get_preset(block_size=16, topk_groups=8)
    batch = _batch(p, (40,), (12,), seed=6)  # positions 28..39: visible 7, 8, 9, 10
    gen = torch.Generator().manual_seed(6)
    s = torch.rand(batch.num_rows, 10, generator=gen).to(DEVICE)
    _check(s, batch, p, _algo(algo, s.shape[1]))


@ALGOS
def test_short_contexts_and_empty_rows(algo: str) -> None:
    """ctx < 4 (visible 0: tail only), a request with no rows, and a call with no rows."""
    p = get_preset(block_size=16, topk_groups=8)
    batch = _batch(p, (1, 3, 2, 9), (1, 3, 0, 2), seed=7)
    s = torch.rand(batch.num_rows, 2).to(DEVICE)
    out = _check(s, batch, p, _algo(algo, s.shape[1]))
    assert out[0, 0] == 0 and (out[0, 1:] == -1).all()
    empty = _batch(p, (5, 8), (0, 0), seed=8)
    got = topk_expand(torch.empty(0, 2, device=DEVICE), empty, p, _algo(algo, 2))
    assert got.shape == (0, p.expand_width)


@ALGOS
def test_one_row_decode_equals_verify_row(algo: str) -> None:
    """Each row of a 4-row verify selects what a 1-row decode of that token selects."""
    p = get_preset(block_size=16, topk_groups=8)
    batch, s = _realistic(p, (150, 91), (4, 4), seed=9)
    cfg = _algo(algo, s.shape[1])
    four = topk_expand(s, batch, p, cfg)
    for r in range(batch.num_rows):
        req = int(batch.row_request[r])
        one = PagedBatch(batch.block_table[req:req + 1], batch.context_lens[req:req + 1],
                         torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                         batch.positions[r:r + 1], batch.block_size)
        assert torch.equal(topk_expand(s[r:r + 1], one, p, cfg), four[r:r + 1])


@ALGOS
def test_explicit_config_and_strided_rows(algo: str) -> None:
    p = get_preset(block_size=16, topk_groups=8)
    batch, s = _realistic(p, (120, 77), (2, 3), seed=10)
    wide = torch.full((s.shape[0], s.shape[1] + 13), float("nan"), device=DEVICE)
    wide[:, :s.shape[1]] = s
    _check(wide[:, :s.shape[1]], batch, p,
           BlockConfig({"CHUNK": 8, **_search(algo)}, num_warps=2, num_stages=1))


@ALGOS
def test_positions_past_the_context(algo: str) -> None:
    """A row sees min((p+1)//4, ctx//4) groups: rows whose position lies past their request's
    context (the kernel requests scores by position before it knows the context) select from
    the context's groups only, searched (ctx//4 > k) or dense (ctx//4 <= k); the columns past
    them hold NaN, which must not reach a selection."""
    p = get_preset(block_size=16, topk_groups=8)
    batch = _batch(p, (80, 80), (3, 3), seed=12)  # positions 77..79: 19 or 20 groups
    ctx = torch.tensor([44, 28], dtype=torch.int32, device=DEVICE)  # 11 and 7 groups
    short = PagedBatch(batch.block_table, ctx, batch.query_start, batch.positions,
                       batch.block_size)
    s = torch.rand(batch.num_rows, 20, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    s[:3, 11:] = float("nan")
    s[3:, 7:] = float("nan")
    _check(s, short, p, _algo(algo, s.shape[1]))


def test_errors() -> None:
    p = get_preset(block_size=16, topk_groups=8)
    batch, s = _realistic(p, (60, 33), (2, 1), seed=11)
    s = s.nan_to_num(0.0)
    i64 = PagedBatch(batch.block_table, batch.context_lens.long(), batch.query_start,
                     batch.positions, batch.block_size)
    cases = {
        "dtype": lambda: topk_expand(s.half(), batch, p),
        "dims": lambda: topk_expand(s[0], batch, p),
        "rows": lambda: topk_expand(s[:2], batch, p),
        "row layout": lambda: topk_expand(s.t().contiguous().t(), batch, p),
        "columns": lambda: topk_expand(s[:, :10], batch, p),
        "k": lambda: topk_expand(s, batch, p.replace(topk_groups=MAX_K + 1)),
        "batch dtype": lambda: topk_expand(s, i64, p),
        "out dtype": lambda: topk_expand(s, batch, p, out=torch.empty(
            3, p.expand_width, dtype=torch.int64, device=DEVICE)),
        "out shape": lambda: topk_expand(s, batch, p, out=torch.empty(
            3, p.expand_width - 1, dtype=torch.int32, device=DEVICE)),
        "config": lambda: topk_expand(s, batch, p, BlockConfig({"CHUNK": 24})),
        "bound": lambda: topk_expand(s, batch, p, BlockConfig({"CHUNK": 8, "BOUND": 2})),
    }
    for what, fn in cases.items():
        with pytest.raises(KernelInputError):
            fn()
            pytest.fail(f"no error for {what}")


@pytest.mark.slow
def test_topk_compiles_for_gpu_targets() -> None:
    sig = {"scores_ptr": "*fp32", "s_stride": "i32", "out_ptr": "*i32", "o_stride": "i32",
           "pos_ptr": "*i32", "ctx_ptr": "*i32", "qs_ptr": "*i32", "batch": "i32",
           "n_cols": "i32"}
    variants = []
    for block_n, chunk, warps, groups in ((2048, 1024, 4, 0), (32768, 4096, 16, 0),
                                          (2048, 1024, 4, 512), (8192, 4096, 16, 512),
                                          (8192, 8192, 16, 512), (2048, 2048, 4, 0)):
        consts = {"K": 512, "OUT_W": 2051, "BLOCK_N": block_n, "BLOCK_B": 64, "BLOCK_O": 4096,
                  "CHUNK": chunk, "BOUND_GROUPS": groups}
        variants.append(({**sig, **{k: "constexpr" for k in consts}}, consts,
                         {"num_warps": warps}))
    compile_for_gpu_targets("qsa.kernels.topk", "_topk_expand_kernel", variants)


def test_work() -> None:
    p = get_preset()
    assert work(p, 256, 32768).bytes_moved == 256 * 32768 * 4 + 256 * 2051 * 4
    assert work(p, 4, 100).bytes_moved == 4 * 2051 * 4


# ------------------------------------------------------------------------------------------------
# GPU tests: the benchmark shapes
# ------------------------------------------------------------------------------------------------

def _relu_like_scores(rows: int, w: int, seed: int) -> torch.Tensor:
    """Sums of 4 per-head ReLUs (1/16 exact zeros), with some rows quantized to few levels."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = torch.relu(torch.randn(rows, 4, w, generator=gen, device="cuda")).sum(1) / 11.3
    s[::7] = torch.round(s[::7] * 4) / 4  # heavy ties
    s[3::16] = 0.0
    return s


@pytest.mark.gpu
@ALGOS
@pytest.mark.parametrize("batch_size,ctx", [(64, 131072), (2, 262144)])
def test_gpu_large_rows(batch_size: int, ctx: int, algo: str) -> None:
    p = get_preset()
    batch = _batch(p, (ctx,) * batch_size, (4,) * batch_size, seed=12, device="cuda")
    s = _relu_like_scores(batch.num_rows, ctx // 4, 12)
    _check(s, batch, p, _algo(algo, s.shape[1]))


@pytest.mark.gpu
@ALGOS
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("batch_size,ctx", [(1, 8192), (8, 32768)])
def test_gpu_realistic(fmt: str, batch_size: int, ctx: int, algo: str) -> None:
    p = get_preset()
    ctxs = tuple(ctx - 13 * i for i in range(batch_size))
    batch, s = _realistic(p, ctxs, (4,) * batch_size, fmt, seed=13, device="cuda")
    _check(s, batch, p, _algo(algo, s.shape[1]))


@pytest.mark.gpu
def test_gpu_one_row_equals_verify_row() -> None:
    p = get_preset()
    batch = _batch(p, (131072, 40000), (4, 4), seed=14, device="cuda")
    s = _relu_like_scores(batch.num_rows, 131072 // 4, 14)
    four = topk_expand(s, batch, p)
    for r in range(batch.num_rows):
        req = r // 4
        one = PagedBatch(batch.block_table[req:req + 1], batch.context_lens[req:req + 1],
                         torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                         batch.positions[r:r + 1], batch.block_size)
        assert torch.equal(topk_expand(s[r:r + 1], one, p), four[r:r + 1])
