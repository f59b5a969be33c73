"""Neighbouring-row overlap (qsa.overlap) and the selections built on it: the measures agree
with set computations, the AR(1) row process has the statistics it claims and respects request
and chunk boundaries, the calibrated generators hit their targets at the overlap suite's shapes,
overlap 0 keeps the independent selections bit for bit, and impossible targets are refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa import overlap as ov
from qsa.cases import CaseSpec, make_batch, make_case, random_selection
from qsa.overlap import OverlapError
from qsa.paging import PagedBatch
from qsa.presets import ShapeError, get_preset
from qsa.reference import score_reference, topk_expand_reference
from qsa.reference.score import visible_groups
from qsa.reference.topk import expand_reference
from support import tiny_preset

PRESET = get_preset()
TINY = tiny_preset()
TOL = 0.03  # how close a calibrated selection's measured Jaccard must be to its target
TARGETS = [0.5, 0.8, 0.9, 0.95]


def batch_of(contexts: list[int], rows: list[int], block_size: int = 16) -> PagedBatch:
    """Requests of these contexts whose rows are their last tokens, pages in order."""
    pages = [(c + block_size - 1) // block_size for c in contexts]
    table = torch.full((len(pages), max(pages)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    qs = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qs[1:] = torch.cumsum(torch.tensor(rows), 0)
    pos = torch.cat([torch.arange(c - r, c, dtype=torch.int32) for c, r in zip(contexts, rows)])
    return PagedBatch(table, torch.tensor(contexts, dtype=torch.int32), qs, pos, block_size)


def uniform_batch(batch: int, context: int, rows: int, preset=PRESET) -> PagedBatch:
    spec = CaseSpec.decode(preset, batch, context, rows)
    return make_batch(spec, torch.Generator().manual_seed(0), "cpu")


def old_random_selection(batch: PagedBatch, preset, gen: torch.Generator) -> torch.Tensor:
    """random_selection as it was before the overlap knob: independent uniform keys, top-k."""
    vis = visible_groups(batch)
    g = int(vis.max())
    keys = torch.rand((batch.num_rows, g), generator=gen, device=vis.device)
    keys[torch.arange(g, device=vis.device)[None, :] >= vis[:, None]] = -1.0
    k = min(preset.topk_groups, g)
    groups = keys.topk(k, dim=1).indices.sort(dim=1).values.to(torch.int32)
    counts = vis.clamp(max=k).to(torch.int32)
    return expand_reference(groups, counts, batch.positions, preset.expand_width)


def measured(ids: torch.Tensor, batch: PagedBatch) -> float:
    return ov.neighbour_jaccard(ov.selected_groups(ids, batch), batch)


# ---------------------------------------------------------------------------------------------
# The measures against set computations


def jaccard_by_sets(groups: list[list[int]], request: list[int]) -> float:
    values = []
    for i in range(len(groups) - 1):
        if request[i] != request[i + 1]:
            continue
        a = {g for g in groups[i] if g >= 0}
        b = {g for g in groups[i + 1] if g >= 0}
        if a | b:
            values.append(len(a & b) / len(a | b))
    return sum(values) / len(values) if values else math.nan


def union_ratio_by_sets(ids: list[list[int]], request: list[int], per: int) -> float:
    own = sum(len({i for i in row if i >= 0}) for row in ids)
    if own == 0:
        return math.nan
    blocks: dict[tuple[int, int], set[int]] = {}
    for r, row in enumerate(ids):
        blocks.setdefault((r // per, request[r]), set()).update(i for i in row if i >= 0)
    return per * sum(len(s) for s in blocks.values()) / own


@st.composite
def ragged_batches(draw, max_requests: int = 4, max_rows: int = 6):
    n = draw(st.integers(1, max_requests))
    rows = draw(st.lists(st.integers(0, max_rows), min_size=n, max_size=n))
    contexts = [draw(st.integers(max(r, 1), 40)) for r in rows]
    return batch_of(contexts, rows, block_size=8)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_neighbour_jaccard_matches_sets(data):
    batch = data.draw(ragged_batches())
    width = data.draw(st.integers(1, 6))
    flat = data.draw(st.lists(st.integers(-1, 7), min_size=batch.num_rows * width,
                              max_size=batch.num_rows * width))  # repeats and padding anywhere
    groups = torch.tensor(flat, dtype=torch.long).reshape(batch.num_rows, width)
    want = jaccard_by_sets(groups.tolist(), batch.row_request.tolist())
    got = ov.neighbour_jaccard(groups, batch)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-12)


def test_neighbour_jaccard_by_hand_and_in_row_chunks(monkeypatch):
    batch = batch_of([40, 40], [3, 2])
    groups = torch.tensor([[0, 1, 2, -1],    # request 0
                           [1, 2, 3, 3],     # {1,2,3}: 2/4 with the row above
                           [-1, -1, -1, -1],  # empty: 0 with the row above
                           [5, 6, -1, -1],   # request 1 (no pair with the row above)
                           [6, 5, 5, -1]])   # same set: 1
    assert ov.neighbour_jaccard(groups, batch) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    # pairs with an empty union do not count; a batch without a pair measures NaN
    assert math.isnan(ov.neighbour_jaccard(torch.full((5, 4), -1), batch))
    assert math.isnan(ov.neighbour_jaccard(groups[:2], batch_of([40, 40], [1, 1])))
    gen = torch.Generator().manual_seed(0)
    big = batch_of([400] * 3, [300, 1, 250])
    g = torch.randint(-1, 60, (big.num_rows, 12), generator=gen)
    whole = ov.neighbour_jaccard(g, big)
    monkeypatch.setattr(ov, "ROW_CHUNK", 7)
    assert ov.neighbour_jaccard(g, big) == pytest.approx(whole, abs=1e-12)
    assert whole == pytest.approx(jaccard_by_sets(g.tolist(), big.row_request.tolist()))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_union_ratio_matches_sets(data):
    """Blocks of `per` consecutive rows cut across requests: each request's part of a block is
    its own union (rows of different requests never share a read)."""
    batch = data.draw(ragged_batches())
    if batch.num_rows == 0:
        return
    width = data.draw(st.integers(1, 8))
    per = data.draw(st.integers(1, 5))
    flat = data.draw(st.lists(st.integers(-1, 30), min_size=batch.num_rows * width,
                              max_size=batch.num_rows * width))
    ids = torch.tensor(flat, dtype=torch.int32).reshape(batch.num_rows, width)
    want = union_ratio_by_sets(ids.tolist(), batch.row_request.tolist(), per)
    got = ov.union_ratio(ids, batch, per)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12)


def test_union_ratio_by_hand():
    # rows 0-1 request 0, rows 2-4 request 1: the block of rows 0-3 straddles the requests
    batch = batch_of([40, 40], [2, 3])
    ids = torch.tensor([[0, 1, 2, -1],
                        [0, 1, 2, 3],
                        [0, 1, -1, -1],   # same ids as request 0's, another request: not shared
                        [0, 1, -1, -1],
                        [9, -1, -1, -1]], dtype=torch.int32)
    # block 0: request 0 reads {0,1,2,3} (4), request 1 reads {0,1} (2); block 1: {9} (1)
    assert ov.union_ratio(ids, batch, 4) == pytest.approx(4 * (4 + 2 + 1) / (3 + 4 + 2 + 2 + 1))
    assert ov.union_ratio(ids, batch, 1) == pytest.approx(1.0)
    same = torch.tensor([[4, 5, 6, 7]] * 4, dtype=torch.int32)
    assert ov.union_ratio(same, batch_of([40], [4]), 4) == pytest.approx(1.0)
    disjoint = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    assert ov.union_ratio(disjoint, batch_of([40], [4]), 4) == pytest.approx(4.0)
    assert math.isnan(ov.union_ratio(torch.full((5, 3), -1, dtype=torch.int32), batch, 4))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_selected_groups_excludes_tail_tokens(data):
    batch = data.draw(ragged_batches())
    width = data.draw(st.integers(1, 8))
    flat = data.draw(st.lists(st.integers(-1, 44), min_size=batch.num_rows * width,
                              max_size=batch.num_rows * width))
    ids = torch.tensor(flat, dtype=torch.int32).reshape(batch.num_rows, width)
    got = ov.selected_groups(ids, batch)
    ctx = batch.context_lens.tolist()
    for r, (req, pos) in enumerate(zip(batch.row_request.tolist(), batch.positions.tolist())):
        visible = min((pos + 1) // 4, ctx[req] // 4)
        want = [i // 4 if 0 <= i < 4 * visible else -1 for i in ids[r].tolist()]
        assert got[r].tolist() == want


def test_selected_groups_of_an_expanded_selection_are_its_groups():
    """The expand step's output: 4 ids per group, then the row's incomplete tail group, which
    is not a selection and so not counted."""
    batch = batch_of([23], [3])  # positions 20, 21, 22: tails of 1, 2 and 3 tokens
    groups = torch.tensor([[0, 2, 4], [1, 3, 4], [0, 1, 3]], dtype=torch.int32)
    ids = expand_reference(groups, torch.tensor([3, 3, 3], dtype=torch.int32), batch.positions,
                           16)
    sel = ov.selected_groups(ids, batch)
    for r in range(3):
        assert sorted(x for x in sel[r].tolist() if x >= 0) == sorted(
            g for g in groups[r].tolist() for _ in range(4))
        assert (ids[r] >= 20).sum() == r + 1  # the tail is there in the ids...
    assert not bool((sel >= 5).any())  # ...and nowhere in the groups (group 5 is the tail)


# ---------------------------------------------------------------------------------------------
# The AR(1) row process


def ar1_loop(noise: torch.Tensor, batch: PagedBatch, rho: float) -> torch.Tensor:
    """x_0 = e_0 at a request's first row, then x_i = rho x_{i-1} + sqrt(1 - rho^2) e_i."""
    out = torch.empty_like(noise)
    starts = set(batch.query_start.tolist())
    b = math.sqrt(1 - rho * rho)
    for i in range(noise.shape[0]):
        out[i] = noise[i] if i in starts else rho * out[i - 1] + b * noise[i]
    return out


def test_correlate_rows_rho_zero_returns_the_draws_themselves():
    noise = torch.randn(10, 3)
    assert ov.correlate_rows(noise, batch_of([40, 40], [6, 4]), 0.0) is noise


@pytest.mark.parametrize("chunk", [ov.AR_CHUNK, 7])
@pytest.mark.parametrize("rho", [0.3, 0.97])
def test_correlate_rows_matches_the_recurrence_across_chunks(monkeypatch, chunk, rho):
    """Requests that start at a chunk's first row, inside a chunk, and span several chunks;
    one-row requests; a request without rows."""
    monkeypatch.setattr(ov, "AR_CHUNK", chunk)
    rows = [1, 127, 130, 0, 300, 5, 128, 1, 2 * chunk + 3]
    batch = batch_of([max(r, 1) + 10 for r in rows], rows)
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn((batch.num_rows, 2, 3), generator=gen, dtype=torch.float64)
    got = ov.correlate_rows(noise, batch, rho)
    torch.testing.assert_close(got, ar1_loop(noise, batch, rho), rtol=0, atol=1e-10)
    noise32 = noise.float()
    torch.testing.assert_close(ov.correlate_rows(noise32, batch, rho),
                               ar1_loop(noise32, batch, rho), rtol=1e-4, atol=1e-4)


def test_correlate_rows_requests_are_independent():
    """A request's first row is its own draw, whatever the rows before it (previous request,
    previous chunk) hold."""
    rows = [200, 60, 128, 3]
    batch = batch_of([r + 5 for r in rows], rows)
    noise = torch.randn((batch.num_rows, 4), generator=torch.Generator().manual_seed(2))
    x = ov.correlate_rows(noise, batch, 0.9)
    starts = batch.query_start.tolist()
    for b in range(len(rows)):
        other = noise.clone()
        other[:starts[b]] = torch.randn((starts[b], 4)) * 100  # every earlier request changed
        y = ov.correlate_rows(other, batch, 0.9)
        assert torch.equal(y[starts[b]], noise[starts[b]])
        torch.testing.assert_close(y[starts[b]:], x[starts[b]:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_correlate_rows_has_unit_variance_and_neighbour_correlation_rho(rho):
    rows = [1500, 1500, 1000]
    batch = batch_of([r + 1 for r in rows], rows)
    noise = torch.randn((batch.num_rows, 256), generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)
    x = ov.correlate_rows(noise, batch, rho)
    assert float(x.var()) == pytest.approx(1.0, abs=0.02)
    req = batch.row_request
    same = torch.nonzero(req[1:] == req[:-1]).flatten()
    lag1 = float((x[same] * x[same + 1]).mean())
    assert lag1 == pytest.approx(rho, abs=0.02)
    same2 = torch.nonzero(req[2:] == req[:-2]).flatten()
    assert float((x[same2] * x[same2 + 2]).mean()) == pytest.approx(rho ** 2, abs=0.02)
    # across a request boundary: uncorrelated (2 pairs x 256 columns)
    first = batch.query_start[1:-1].long()
    assert abs(float((x[first - 1] * x[first]).mean())) < 0.2


# ---------------------------------------------------------------------------------------------
# Random selections: calibrated to the target at the overlap suite's shapes


def _hits(batch: PagedBatch, target: float) -> None:
    ids, j = random_selection(batch, PRESET, torch.Generator().manual_seed(7), target)
    assert abs(j - target) <= TOL, (target, j)
    assert measured(ids, batch) == pytest.approx(j, abs=1e-12)  # what the caller records


@pytest.mark.parametrize("target", TARGETS)
def test_random_selection_hits_target_decode_suite_shape(target):
    """The overlap suite's decode call: 32 requests x 32K, an MTP-3 verify (4 rows each)."""
    _hits(uniform_batch(32, 32768, 4), target)


@pytest.mark.parametrize("target", TARGETS)
def test_random_selection_hits_target_prefill_like(target):
    """A prefill chunk's shape with a sixteenth of the suite's rows (the default lane)."""
    _hits(uniform_batch(1, 16384, 256), target)


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
def test_random_selection_hits_target_prefill_suite_shape(target):
    """The overlap suite's prefill chunk: 4,096 rows at 16K (5-25 s each on a CPU)."""
    _hits(uniform_batch(1, 16384, 4096), target)


@pytest.mark.parametrize("shape", [
    ((32768,) * 32, (4,) * 32),
    ((20, 9, 100, 45, 300), (4, 1, 7, 2, 30)),  # rows with fewer visible groups than top-k
])
def test_overlap_zero_is_the_old_independent_selection_bit_for_bit(shape):
    p = PRESET if shape[0][0] == 32768 else TINY
    batch = make_batch(CaseSpec(p, *shape), torch.Generator().manual_seed(0), "cpu")
    old_gen = torch.Generator().manual_seed(11)
    want = old_random_selection(batch, p, old_gen)
    for kw in ({}, {"overlap": 0}):
        gen = torch.Generator().manual_seed(11)
        ids, j = random_selection(batch, p, gen, **kw)
        assert ids.dtype == want.dtype and torch.equal(ids, want)
        assert j == pytest.approx(measured(ids, batch), abs=1e-12)
        # the generator moved exactly as before: later draws from it are unchanged too
        assert torch.equal(gen.get_state(), old_gen.get_state())


def test_random_selection_is_seeded_and_rows_keep_their_counts():
    batch = make_batch(CaseSpec(TINY, (20, 9, 100, 300), (4, 1, 7, 40)),
                       torch.Generator().manual_seed(0), "cpu")
    a, ja = random_selection(batch, TINY, torch.Generator().manual_seed(5), 0.8)
    b, jb = random_selection(batch, TINY, torch.Generator().manual_seed(5), 0.8)
    assert torch.equal(a, b) and ja == jb
    groups = ov.selected_groups(a, batch)
    vis = visible_groups(batch).clamp(max=TINY.topk_groups)
    for r in range(batch.num_rows):
        distinct = {g for g in groups[r].tolist() if g >= 0}
        assert len(distinct) == int(vis[r])  # min(top-k, visible) groups, whatever the overlap


# ---------------------------------------------------------------------------------------------
# The index path: correlated index queries, calibrated on the reference's own selection


def test_index_path_overlap_is_calibrated_and_recorded():
    spec = CaseSpec(TINY, (256, 300, 200, 256), (24, 32, 16, 24), overlap=0.8, seed=1,
                    build_kv=False)
    case = make_case(spec)
    assert abs(case.overlap_measured - 0.8) <= TOL
    scores = score_reference(case.cache, case.batch, case.q_index, TINY, spec.index_format)
    ids = topk_expand_reference(scores, case.batch, TINY)
    assert case.overlap_measured == pytest.approx(measured(ids, case.batch), abs=1e-12)
    independent = make_case(CaseSpec(TINY, spec.context_lens, spec.rows_per_request, seed=1,
                                     build_kv=False))
    assert independent.overlap_measured < 0.2
    scores0 = score_reference(independent.cache, independent.batch, independent.q_index, TINY,
                              spec.index_format)
    assert independent.overlap_measured == pytest.approx(
        measured(topk_expand_reference(scores0, independent.batch, TINY), independent.batch),
        abs=1e-12)
    # the queries stay normalized as before: norm sqrt(index_dim) per head
    norms = case.q_index.norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, TINY.index_dim ** 0.5))


# ---------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize("target", [1.0, 1.5, -0.1, -1, float("nan"), float("inf"), "0.5",
                                    None])
def test_targets_outside_zero_one_are_refused(target):
    with pytest.raises(OverlapError, match=r"must be in \[0, 1\)"):
        ov.check_target(target)
    with pytest.raises(OverlapError, match=r"must be in \[0, 1\)"):
        ov.calibrate(target, lambda rho: 0.0)
    batch = batch_of([40], [4])
    with pytest.raises(OverlapError, match=r"must be in \[0, 1\)"):
        random_selection(batch, TINY, torch.Generator().manual_seed(0), target)
    with pytest.raises(ShapeError, match=r"overlap: .*must be in \[0, 1\)"):
        CaseSpec(TINY, (40,), (4,), overlap=target)


def test_a_target_below_independent_rows_is_refused_by_name():
    # 1,024 rows at 4K: early rows see fewer than 512 groups and select them all, so
    # independent rows already measure about 0.4
    batch = uniform_batch(1, 4096, 1024)
    _, j0 = random_selection(batch, PRESET, torch.Generator().manual_seed(0), 0.0)
    assert j0 > 0.35
    with pytest.raises(OverlapError) as e:
        random_selection(batch, PRESET, torch.Generator().manual_seed(0), 0.3)
    msg = str(e.value)
    assert "random selections" in msg and f"{j0:.3f}" in msg and "target 0.3" in msg
    assert "use 0 for independent rows" in msg and "\n" not in msg
    # the same through the calibration itself, with what it names
    with pytest.raises(OverlapError, match=r"these keys give a Jaccard of 0\.500 .*target 0\.2"):
        ov.calibrate(0.2, lambda rho: 0.5 + 0.5 * rho, "these keys")
    # within the tolerance of the independent value is not refused
    target = 0.5 - ov.CALIBRATE_TOL / 2
    rho, j = ov.calibrate(target, lambda rho: 0.5 + 0.5 * rho)
    assert abs(j - target) <= ov.CALIBRATE_TOL


def test_calibrate_bisects_on_the_measure_and_returns_the_closest_when_coarse():
    rho, j = ov.calibrate(0.64, lambda rho: rho * rho)
    assert abs(j - 0.64) <= ov.CALIBRATE_TOL and rho == pytest.approx(0.8, abs=0.01)
    assert ov.calibrate(0.0, lambda rho: 0.25) == (0.0, 0.25)  # 0: independent, as measured
    steps = lambda rho: 0.0 if rho < 0.5 else 1.0  # noqa: E731 - a measure with two values
    rho, j = ov.calibrate(0.4, steps)
    assert j == 0.0 and rho < 0.5  # the closest of what it measured
