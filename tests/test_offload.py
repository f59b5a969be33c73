"""Page offload: what moves for each layer, bit-identical restores, refusals, bad requests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa.arena import (Arena, ArenaError, BindingMismatchError, CacheFormats, DigestError,
                       LayoutMismatchError, ManifestError, OffloadError, PageOffload,
                       TruncatedPagesError, declare_row_spaces, offload_roundtrip_check,
                       verify_layer_binding)
from qsa.arena import digest as dg
from qsa.arena.offload import MIN_CHUNK_PAGES, block_ranges
from qsa.cases import CaseSpec, make_case
from qsa.paging import PagedBatch
from qsa.presets import get_preset
from qsa.reference import score_reference, sparse_gqa_reference, topk_expand_reference
from support import DEVICE, surrogate, surrogate_cache
from test_arena import FORMAT_CASES, SMALL, expected_placement

QUANTIZED_CASES = [c for c in FORMAT_CASES if c != ("bf16", "bf16")]
FP8_KV_CASES = [c for c in FORMAT_CASES if c[0] == "fp8"]
SMALL_TOPK = SMALL.replace(topk_groups=4)  # fewer groups than visible: selection matters


def _random_bytes(arena: Arena, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, generator=gen,
                                     dtype=torch.uint8))


def _snapshot(arena: Arena) -> tuple[torch.Tensor, list[int]]:
    return arena.buffer.clone(), arena.free_blocks()


def _assert_unchanged(arena: Arena, snap: tuple[torch.Tensor, list[int]]) -> None:
    assert torch.equal(arena.buffer, snap[0]), "a refused request wrote into the arena"
    assert arena.free_blocks() == snap[1], "a refused request changed the free blocks"


# ---------------------------------------------------------------------------------------------
# What moves for each layer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv,index", FORMAT_CASES)
@pytest.mark.parametrize("draft", ["bf16", "same"])
@pytest.mark.parametrize("multimodal", [False, True])
def test_offload_moves_exactly_each_layers_own_rows(kv, index, draft, multimodal):
    """For every layer of both row spaces: per declared field, in stored order, the offload
    moves that layer's own bytes (by data pointer and size), and the layer binds the same set."""
    preset = get_preset()
    formats = CacheFormats(kv, index, multimodal=multimodal)
    draft_formats = formats if draft == "same" else None
    arena = Arena.for_preset(preset, 2, formats, draft=draft_formats)
    off = PageOffload(arena)
    spaces = declare_row_spaces(preset, formats, draft_formats)
    want, page = expected_placement(spaces)
    assert arena.layout.page_bytes == page
    base = arena.buffer.data_ptr()
    covered = []
    for space in spaces:
        for row in range(space.rows):
            expect = [(f.name, base + at, f.nbytes) for s, r, f, at in want
                      if (s, r) == (space.name, row)]
            moved = off.layer_tensors(space.name, row)
            assert [(n, t.data_ptr(), t.shape[1]) for n, t in moved] == expect
            assert all(t.shape[0] == 2 and t.stride(0) == page for _, t in moved)
            bound = arena.layer(space.name, row)
            as_bound = {(n, t.data_ptr(), t[0].numel() * t.element_size(),
                         t.stride(0) * t.element_size()) for n, t in bound.items()}
            assert as_bound == {(n, p, b, page) for n, p, b in expect}
            verify_layer_binding(off, space.name, row)
            covered += expect
    assert len(covered) == len(want) == len(set(covered))  # every field of every row, once


def _patched_layer(monkeypatch, rebind):
    real = Arena.layer

    def layer(self, space, row):
        cache = real(self, space, row)
        rebind(self, space, row, cache, real)
        return cache

    monkeypatch.setattr(Arena, "layer", layer)


@pytest.mark.parametrize("kv,index", FP8_KV_CASES)
def test_binding_k_scale_in_place_of_v_scale_fails(kv, index, monkeypatch):
    arena = Arena.for_preset(get_preset(), 2, CacheFormats(kv, index))
    off = PageOffload(arena)

    def swap(self, space, row, cache, real):
        if "v_scale" in cache:
            cache["v_scale"] = cache["k_scale"]

    _patched_layer(monkeypatch, swap)
    for row in (0, 11):
        with pytest.raises(BindingMismatchError,
                           match=rf"qsa\[{row}\]\.v_scale: the layer binds qsa\[{row}\]\.k_scale"):
            verify_layer_binding(off, "qsa", row)
    with pytest.raises(BindingMismatchError, match="v_scale"):
        PageOffload(arena)


@pytest.mark.parametrize("kv,index", FORMAT_CASES)
def test_binding_the_targets_index_rows_for_the_draft_fails(kv, index, monkeypatch):
    arena = Arena.for_preset(get_preset(), 2, CacheFormats(kv, index))
    off = PageOffload(arena)

    def target_index(self, space, row, cache, real):
        if space == "qsa_draft":
            target = real(self, "qsa", 0)
            for name in ("index_raw", "index_compressed"):
                cache[name] = target[name]

    _patched_layer(monkeypatch, target_index)
    verify_layer_binding(off, "qsa", 0)
    with pytest.raises(BindingMismatchError,
                       match=r"qsa_draft\[0\]\.index_raw: the layer binds qsa\[0\]\.index_raw"):
        verify_layer_binding(off, "qsa_draft", 0)


@pytest.mark.parametrize("kv,index", QUANTIZED_CASES)
def test_a_binding_or_offload_without_scale_planes_fails(kv, index, monkeypatch):
    """The change request's bug, both ways round: scales bound but not registered for offload,
    or registered as missing from the layer."""
    arena = Arena.for_preset(get_preset(), 2, CacheFormats(kv, index))
    off = PageOffload(arena)
    with monkeypatch.context() as m:
        real = PageOffload.layer_tensors
        m.setattr(PageOffload, "layer_tensors", lambda self, s, r: tuple(
            (n, t) for n, t in real(self, s, r) if not n.endswith("_scale")))
        with pytest.raises(BindingMismatchError, match="the offload moves fields"):
            verify_layer_binding(off, "qsa", 3)
    bound = arena.layer("qsa", 3)
    dropped = next(n for n in bound if n.endswith("_scale"))
    del bound[dropped]
    with pytest.raises(BindingMismatchError, match=f"not bound: \\['{dropped}'\\]"):
        verify_layer_binding(off, "qsa", 3, bound)


# ---------------------------------------------------------------------------------------------
# Round trip: a restored prefix attends bit-identically
# ---------------------------------------------------------------------------------------------

def _load(arena: Arena, space: str, row: int, case) -> None:
    for name, t in case.cache.items():
        arena.view(space, row, name)[:t.shape[0]].copy_(t)


def _run_reference(cache, case, batch: PagedBatch):
    p = case.preset
    scores = score_reference(cache, batch, case.q_index, p, case.spec.index_format)
    ids = topk_expand_reference(scores, batch, p)
    out = sparse_gqa_reference(case.q, cache, batch, ids, case.spec.kv_format, p.softmax_scale)
    return scores, ids, out


def _remap(batch: PagedBatch, mapping: dict[int, int]) -> PagedBatch:
    lut = torch.full((max(mapping) + 1,), -1, dtype=torch.int32)
    for old, new in mapping.items():
        lut[old] = new
    bt = batch.block_table
    moved = torch.where(bt >= 0, lut[bt.clamp(min=0).long()], bt)
    assert not bool(((bt >= 0) & (moved < 0)).any()), "a used page was not restored"
    return dataclasses.replace(batch, block_table=moved.to(torch.int32))


def _same(a, b) -> bool:
    """Bit-identical (NaN bits included) tensors, pairwise."""
    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(as_bytes(x), as_bytes(y))
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kv,index", FORMAT_CASES)
@pytest.mark.parametrize("strategy", ["ranges", "gather"])
def test_restored_prefix_attends_bit_identically(kv, index, strategy):
    spec = CaseSpec(SMALL_TOPK, (37, 50), (4, 1), index_format=index, kv_format=kv, seed=1)
    target = make_case(spec)
    draft = make_case(dataclasses.replace(spec, kv_format="bf16", index_format="bf16", seed=2))
    nb = max(target.num_blocks, draft.num_blocks)
    arena = Arena.for_preset(SMALL_TOPK, 3 * nb, CacheFormats(kv, index))
    _random_bytes(arena, 0)  # every other row of every page holds bytes that must move too
    assert arena.allocate(nb) == list(range(nb))  # the cases' block ids are arena blocks
    _load(arena, "qsa", 1, target)
    _load(arena, "qsa_draft", 0, draft)
    before = _run_reference(arena.layer("qsa", 1), target, target.batch)
    before_draft = _run_reference(arena.layer("qsa_draft", 0), draft, draft.batch)

    # The prefix: every page either request table uses, in page-table order (scattered ids).
    prefix = list(dict.fromkeys(b for t in (target.batch.block_table, draft.batch.block_table)
                                for b in t.flatten().tolist() if b >= 0))
    assert len(block_ranges(prefix)) > 1
    off = PageOffload(arena, strategy)
    pages = arena.pages[prefix].clone()
    stored = off.store(prefix)

    # Overwrite the prefix's blocks with other data and other scales.
    arena.pages[prefix] = torch.randint(0, 256, pages.shape, dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(9))
    _load(arena, "qsa", 1, make_case(dataclasses.replace(spec, seed=3)))
    _load(arena, "qsa_draft", 0, make_case(dataclasses.replace(draft.spec, seed=4)))
    assert not _same(_run_reference(arena.layer("qsa", 1), target, target.batch), before)

    free = arena.free_blocks()
    dst = [free[i] for i in torch.randperm(len(free), generator=torch.Generator().manual_seed(5))
           [:len(prefix)].tolist()]
    assert off.restore(stored, dst) == dst
    assert torch.equal(arena.pages[dst], pages)
    mapping = dict(zip(prefix, dst))
    batch, draft_batch = _remap(target.batch, mapping), _remap(draft.batch, mapping)
    batch.validate(arena.num_blocks)
    cache = arena.layer("qsa", 1)
    assert _same(_run_reference(cache, target, batch), before)
    assert _same(_run_reference(arena.layer("qsa_draft", 0), draft, draft_batch), before_draft)

    # The equality depends on the scale planes: spoil one restored plane at a time.
    idx = torch.tensor(dst)
    for name in ("k_scale", "v_scale", "index_compressed_scale"):
        if name not in cache:
            continue
        plane = cache[name]
        saved = plane[idx].clone()
        plane[idx] = saved + 1 if saved.dtype == torch.uint8 else saved * 2
        assert not _same(_run_reference(cache, target, batch), before), name
        plane[idx] = saved


def test_ranges_and_gather_store_the_same_bytes():
    arena = Arena.for_preset(SMALL, 12, CacheFormats("fp8", "mxfp4"))
    _random_bytes(arena, 1)
    blocks = arena.allocate(8)
    order = [5, 6, 7, 0, 1, 3]
    a = PageOffload(arena, "ranges").store(order)
    b = PageOffload(arena, "gather").store(order)
    assert torch.equal(a.data, b.data)
    assert a.count == b.count == len(order) and a.set_id != b.set_id  # every set its own id
    assert torch.equal(a.data.view(len(order), -1), arena.pages[order])
    assert a.source_blocks == tuple(order) and blocks == list(range(8))


TINY = SMALL.replace(num_layers=4, block_size=4, num_kv_heads=1, num_q_heads=1, index_dim=32,
                    rope_dims=32)


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(range(10)), n=st.integers(1, 10), seed=st.integers(0, 2**16),
       strategy=st.sampled_from(["auto", "ranges", "gather"]))
def test_any_request_order_round_trips(order, n, seed, strategy):
    arena = Arena.for_preset(TINY, 24, CacheFormats("fp8", "mxfp4"))
    _random_bytes(arena, seed)
    arena.allocate(10)
    off = PageOffload(arena, strategy)
    src = order[:n]
    pages = arena.pages[src].clone()
    stored = off.store(src)
    dst = [10 + b for b in torch.randperm(14, generator=torch.Generator().manual_seed(seed))
           [:n].tolist()]
    assert off.restore(stored, dst) == dst
    assert torch.equal(arena.pages[dst], pages)
    assert sorted(arena.free_blocks()) == sorted(set(range(10, 24)) - set(dst))


def test_one_offload_stores_sets_of_any_size_in_turn():
    """A store reuses one buffer for its digest parts (host time of a small store): sets of
    growing and shrinking size through one offload, more pages than a GPU digests that way
    included, each round-trip exactly."""
    arena = Arena.for_preset(TINY, 100, CacheFormats("fp8", "mxfp4"))
    _random_bytes(arena, 3)
    arena.allocate(50)
    off = PageOffload(arena)
    for n in (2, 2 * MIN_CHUNK_PAGES + 8, 3):
        src = list(range(50 - n, 50))
        stored = off.store(src)
        dst = off.restore(stored, list(range(50, 50 + n)))
        assert torch.equal(arena.pages[dst], arena.pages[src])
        arena.free(dst)


def test_block_ranges_coalesce_in_request_order():
    assert block_ranges([5, 6, 7, 2, 3, 9]) == [(5, 8, 0), (2, 4, 3), (9, 10, 5)]
    assert block_ranges([3]) == [(3, 4, 0)]
    assert block_ranges([4, 3]) == [(4, 5, 0), (3, 4, 1)]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 40), min_size=1, max_size=40, unique=True))
def test_short_requests_find_the_same_runs_on_integers(ids):
    """Up to SMALL_SET ids, runs are found on Python ints (host time of a small offload);
    they must be the array path's runs."""
    fast = block_ranges(ids)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(dg, "SMALL_SET", 0)
        assert block_ranges(ids) == fast
    assert [i for a, b, at in fast for i in range(a, b)] == ids


@pytest.mark.parametrize(("ids", "one_run"), [([7], True), ([3, 4, 5, 6], True),
                                               ([3, 5, 4, 6], False), ([6, 5, 4, 3], False),
                                               ([3, 4, 6, 7], False), ([9, 2], False)])
def test_auto_copies_ranges_only_for_one_run(ids, one_run):
    """"auto" copies block ranges one by one only when the request is one ascending run,
    "ranges" always, "gather" never; the runs given are the request's."""
    a = np.array(ids, dtype=np.int64)
    assert (PageOffload._ranges(a, "auto") is not None) == one_run
    assert PageOffload._ranges(a, "ranges") == block_ranges(ids)
    assert PageOffload._ranges(a, "gather") is None


# ---------------------------------------------------------------------------------------------
# Refusals: layout, truncation, digest
# ---------------------------------------------------------------------------------------------

def _stored(formats: CacheFormats, blocks: int = 3):
    arena = Arena.for_preset(SMALL, 8, formats)
    _random_bytes(arena, 2)
    off = PageOffload(arena)
    return arena, off, off.store(arena.allocate(blocks))


def test_a_bf16_page_is_refused_by_an_fp8_layout():
    _, _, stored = _stored(CacheFormats("bf16", "bf16"))
    arena, off, _ = _stored(CacheFormats("fp8", "bf16"))
    snap = _snapshot(arena)
    with pytest.raises(LayoutMismatchError,
                       match=r"layout mismatch: .*kv=bf16.*but this arena is .*kv=fp8"):
        off.restore(stored)
    _assert_unchanged(arena, snap)


def test_a_page_from_another_draft_setting_is_refused():
    _, _, stored = _stored(CacheFormats("fp8", "fp8"))
    arena = Arena.for_preset(SMALL, 8, CacheFormats("fp8", "fp8"), include_draft=False)
    with pytest.raises(LayoutMismatchError, match="layout mismatch"):
        PageOffload(arena).restore(stored)


@pytest.mark.parametrize("cut", [1, 256, "page"])
def test_a_truncated_page_is_refused(cut):
    arena, off, stored = _stored(CacheFormats("fp8", "mxfp4"))
    n = stored.page_bytes if cut == "page" else cut
    short = dataclasses.replace(stored, data=stored.data[:-n].clone())
    snap = _snapshot(arena)
    with pytest.raises(TruncatedPagesError, match=r"truncated: 3 pages of \d+ bytes need"):
        off.restore(short)
    longer = dataclasses.replace(stored, data=torch.cat((stored.data, stored.data[:8])))
    with pytest.raises(TruncatedPagesError, match="oversized"):
        off.restore(longer)
    _assert_unchanged(arena, snap)


@pytest.mark.parametrize("where", ["first", "k_scale", "draft index", "padding", "last"])
def test_a_flipped_byte_is_refused(where):
    arena, off, stored = _stored(CacheFormats("fp8", "fp8"))
    layout, p = arena.layout, stored.page_bytes
    seg = {"k_scale": lambda s: s.space == "qsa" and s.field.name == "k_scale",
           "draft index": lambda s: s.space == "qsa_draft" and s.field.name == "index_raw"}
    if where == "first":
        page, pos = 0, 0
    elif where == "last":
        page, pos = 2, p - 1
    elif where == "padding":  # after the FP8 index scale plane (64 bytes, padded to 256)
        s = next(s for s in layout.segments if s.field.name == "index_compressed_scale")
        page, pos = 1, s.end + 10
        assert layout.locate(pos) is None
    else:
        page, pos = 1, next(s for s in layout.segments if seg[where](s)).offset + 3
    bad = stored.data.clone()
    bad[page * p + pos] ^= 0x04
    snap = _snapshot(arena)
    with pytest.raises(DigestError, match=rf"digest mismatch in 1 of 3 pages \(first: page "
                                          rf"{page}, stored from block {page}\): its bytes "
                                          "changed"):
        off.restore(dataclasses.replace(stored, data=bad))
    _assert_unchanged(arena, snap)
    off.restore(stored)  # the intact copy still restores


# ---------------------------------------------------------------------------------------------
# Bad requests change nothing
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("blocks,match", [
    ([], "no blocks"),
    ([5], "block 5 is not allocated"),
    ([0, 9], "block 9 is out of range: the arena has 8 blocks"),
    ([-2], "block -2 is out of range"),
    ([1, 1], "block 1 appears more than once"),
    (["0"], "block id '0' is not an integer"),
])
def test_bad_store_requests(blocks, match):
    arena, off, _ = _stored(CacheFormats("fp8", "bf16"))
    snap = _snapshot(arena)
    with pytest.raises(ArenaError, match=match):
        off.store(blocks)
    _assert_unchanged(arena, snap)


@pytest.mark.parametrize("blocks,match", [
    ([2, 3, 4], "block 2 is busy"),
    ([3, 4], "3 stored pages need 3 blocks, got 2"),
    ([3, 4, 8], "block 8 is out of range"),
    ([3, 4, 4], "block 4 appears more than once"),
])
def test_bad_restore_requests(blocks, match):
    arena, off, stored = _stored(CacheFormats("fp8", "bf16"))
    snap = _snapshot(arena)
    with pytest.raises(ArenaError, match=match):
        off.restore(stored, blocks)
    _assert_unchanged(arena, snap)


def test_double_restore_into_a_busy_block_and_a_full_arena():
    arena, off, stored = _stored(CacheFormats("bf16", "mxfp4"))
    assert off.restore(stored, [5, 3, 4]) == [5, 3, 4]
    snap = _snapshot(arena)
    with pytest.raises(ArenaError, match="block 5 is busy"):
        off.restore(stored, [5, 6, 7])
    with pytest.raises(ArenaError, match="not enough free blocks: 3 requested, 2 free"):
        off.restore(stored)
    with pytest.raises(OffloadError, match="strategy must be one of"):
        off.restore(stored, [6, 7, 0], strategy="fast")
    _assert_unchanged(arena, snap)


def test_roundtrip_check_on_cpu():
    r = offload_roundtrip_check("cpu", preset="qwen3.8-flash-next-tp2", pages=4)
    assert r["ok"] and r["mismatched_pages"] == 0 and r["pages"] == 4
    assert set(r["restored_blocks"]).isdisjoint(r["source_blocks"])
    assert r["bytes"] == 4 * r["page_bytes"] and r["store_gbps"] > 0


# ---------------------------------------------------------------------------------------------
# Kernels (written elsewhere; run when importable): restored pages give identical kernel output
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv,index", [("fp8", "fp8"), ("bf16", "mxfp4"), ("fp8", "bf16")])
def test_kernels_on_restored_pages(kv, index):
    """The stacked scorer and sparse GQA decode read the arena's strided views; on restored
    pages (page table pointing at the new blocks) they give bit-identical output."""
    score_stacked = pytest.importorskip("qsa.kernels.score_stacked").score_stacked
    sparse_gqa_decode = pytest.importorskip("qsa.kernels.sparse_gqa").sparse_gqa_decode
    spec = CaseSpec(SMALL_TOPK, (37, 21), (4, 1), index_format=index, kv_format=kv, seed=6)
    case = make_case(spec, DEVICE)
    nb = case.num_blocks
    arena = Arena.for_preset(SMALL_TOPK, 2 * nb, CacheFormats(kv, index), device=DEVICE)
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(3)))
    arena.allocate(nb)
    _load(arena, "qsa", 0, case)
    p = case.preset
    ids = topk_expand_reference(score_reference(case.cache, case.batch, case.q_index, p, index),
                                case.batch, p)

    def run(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        cache = surrogate_cache(arena.layer("qsa", 0))
        return (score_stacked(cache, batch, case.q_index, p, index),
                sparse_gqa_decode(surrogate(case.q), cache, batch, ids, p, kv))

    before = run(case.batch)
    off = PageOffload(arena)
    prefix = [b for b in case.batch.block_table.flatten().tolist() if b >= 0]
    stored = off.store(prefix)
    arena.pages[prefix] = 0
    dst = off.restore(stored)
    assert set(dst).isdisjoint(prefix)
    after = run(_remap(case.batch.to("cpu"), dict(zip(prefix, dst))).to(DEVICE))
    assert _same(after, before)


@pytest.mark.gpu
@pytest.mark.parametrize("kv,index", [("bf16", "bf16"), ("fp8", "fp8")])
def test_roundtrip_on_the_gpu_with_pinned_pages(kv, index):
    r = offload_roundtrip_check("cuda", kv=kv, index=index, pages=64)
    assert r["ok"] and r["pinned"] and r["mismatched_pages"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ranges", "gather"])
def test_gpu_restore_refusals_change_nothing(strategy):
    arena = Arena.for_preset(get_preset(), 16, CacheFormats("fp8", "fp8"), device="cuda")
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8,
                                     device="cuda"))
    off = PageOffload(arena, strategy)
    stored = off.store(arena.allocate(4)[::-1])
    assert stored.data.is_pinned()
    bad = stored.data.clone()
    bad[12345] ^= 1
    before = arena.buffer.clone()
    with pytest.raises(DigestError):
        off.restore(dataclasses.replace(stored, data=bad))
    assert torch.equal(arena.buffer, before) and arena.num_free == 12
    dst = off.restore(stored, [15, 9, 10, 11])
    assert torch.equal(arena.pages[dst].cpu(), stored.data.view(4, -1))


def test_copy_chunks_cover_the_set_in_order():
    """The pipelined restore's chunks: every page once, in order, near-equal, and one chunk
    for small sets (a chunk costs launches)."""
    from qsa.arena.offload import COPY_CHUNKS, copy_chunks

    for n in (1, 7, 2 * MIN_CHUNK_PAGES - 1, 2 * MIN_CHUNK_PAGES, 64, 1000, 1024):
        chunks = copy_chunks(n)
        assert [a for a, _ in chunks] == [0, *[b for _, b in chunks[:-1]]] and chunks[-1][1] == n
        sizes = [b - a for a, b in chunks]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
        assert len(chunks) == max(1, min(COPY_CHUNKS, n // MIN_CHUNK_PAGES))
    assert len(copy_chunks(2 * MIN_CHUNK_PAGES - 1)) == 1
    assert len(copy_chunks(1024)) == COPY_CHUNKS


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ranges", "gather"])
@pytest.mark.parametrize("chunk", ["first", "middle", "last"])
def test_gpu_pipelined_restore_checks_every_chunk(strategy, chunk):
    """A set large enough to restore in several chunks (each digested on a second stream while
    the next copies): the stored bytes are the pages, a flipped bit in any chunk is refused
    with nothing written, and the set restores bit for bit into scattered blocks."""
    from qsa.arena.offload import copy_chunks

    n = 64
    arena = Arena.for_preset(get_preset(), 2 * n, CacheFormats("fp8", "fp8"), device="cuda")
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8,
                                     device="cuda"))
    off = PageOffload(arena, strategy)
    src = arena.allocate(n)[::-1]  # n single-page runs
    stored = off.store(src)
    assert torch.equal(stored.data.view(n, -1), arena.pages[src].cpu())
    chunks = copy_chunks(n)
    assert len(chunks) > 2
    a, b = {"first": chunks[0], "middle": chunks[len(chunks) // 2], "last": chunks[-1]}[chunk]
    page = b - 1
    bad = stored.data.clone()
    bad[page * arena.layout.page_bytes + 777] ^= 0x40
    before = arena.buffer.clone()
    with pytest.raises(DigestError, match=f"first: page {page},"):
        off.restore(dataclasses.replace(stored, data=bad))
    assert torch.equal(arena.buffer, before) and arena.num_free == n
    # a refusal of the host's share (busy targets), found while the first chunks copy
    with pytest.raises(ArenaError, match="busy"):
        off.restore(stored, src)
    assert torch.equal(arena.buffer, before) and arena.num_free == n
    # the manifest alone changed: refused before the device's gated write is issued
    with pytest.raises(ManifestError):
        off.restore(dataclasses.replace(stored, source_blocks=stored.source_blocks[::-1]))
    assert torch.equal(arena.buffer, before) and arena.num_free == n
    dst = torch.randperm(n, generator=torch.Generator().manual_seed(a))[:n] + n
    got = off.restore(stored, dst.tolist())
    assert got == dst.tolist()
    assert torch.equal(arena.pages[got].cpu(), stored.data.view(n, -1))


@pytest.mark.gpu
def test_gpu_gated_write_that_disagrees_with_the_host_is_refused(monkeypatch):
    """The device's page check decides whether a large restore writes the arena; the host
    requires its verdict on every page to equal its own. A check that wrongly refuses a
    page (forced here by a changed expected sum) writes nothing, and the restore says so
    instead of allocating blocks that were never written."""
    from qsa.kernels import page_write

    n = 2 * MIN_CHUNK_PAGES
    arena = Arena.for_preset(get_preset(), 2 * n, CacheFormats("fp8", "fp8"), device="cuda")
    arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8,
                                     device="cuda"))
    off = PageOffload(arena)
    stored = off.store(arena.allocate(n))
    real = page_write.write_if_intact

    def wrong_on_page_5(staged, pages, parts, plan):
        plan[0, 5] ^= 1
        return real(staged, pages, parts, plan)

    monkeypatch.setattr(page_write, "write_if_intact", wrong_on_page_5)
    snap = _snapshot(arena)
    with pytest.raises(OffloadError, match=r"disagrees with the host's on pages \[5\]: "
                                           "nothing was written"):
        off.restore(stored)
    _assert_unchanged(arena, snap)
    monkeypatch.setattr(page_write, "write_if_intact", real)
    got = off.restore(stored)
    assert torch.equal(arena.pages[got].cpu(), stored.data.view(n, -1))
