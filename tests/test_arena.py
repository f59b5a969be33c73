"""The arena's page layout, its typed views and its free-block bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa.arena import (ALIGNMENT, Arena, ArenaError, CacheFormats, PageLayout,
                       declare_row_spaces)
from qsa.arena import arena as arena_module
from qsa.presets import get_preset

# The five cache-format cases of the issue: (KV, index).
FORMAT_CASES = [("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8"), ("fp8", "mxfp4"),
                ("bf16", "mxfp4")]
SMALL = get_preset().replace(num_layers=8, block_size=16, num_q_heads=4, num_kv_heads=2,
                             head_dim=64, index_heads=2, index_dim=64, rope_dims=32)


def expected_placement(spaces, alignment: int = ALIGNMENT):
    """The placement rule of spec section 5, re-derived here from the declaration alone:
    every field of every row of every space, in declared order, each aligned."""
    at, out = 0, []
    for s in spaces:
        for row in range(s.rows):
            for f in s.fields:
                at = -(-at // alignment) * alignment
                out.append((s.name, row, f, at))
                at += f.nbytes
    return out, -(-at // alignment) * alignment


@pytest.mark.parametrize("kv,index", FORMAT_CASES)
@pytest.mark.parametrize("multimodal", [False, True])
def test_layout_places_every_declared_field_of_every_row(kv, index, multimodal):
    spaces = declare_row_spaces(get_preset(), CacheFormats(kv, index, multimodal=multimodal))
    assert [s.name for s in spaces] == ["qsa", "qsa_draft"]
    layout = PageLayout.build(spaces, 64)
    want, page = expected_placement(spaces)
    got = [(s.space, s.row, s.field, s.offset) for s in layout.segments]
    assert got == want
    assert layout.page_bytes == page and page % ALIGNMENT == 0
    ends = [s.end for s in layout.segments]
    assert all(a <= b.offset for a, b in zip(ends, layout.segments[1:]))  # disjoint, in order
    assert all(s.offset % ALIGNMENT == 0 for s in layout.segments)
    scales = {s.field.name for s in layout.segments if s.space == "qsa"} & {
        "k_scale", "v_scale", "index_compressed_scale"}
    assert ("k_scale" in scales) == (kv == "fp8") and ("v_scale" in scales) == (kv == "fp8")
    assert ("index_compressed_scale" in scales) == (index != "bf16")
    draft = {s.field.name for s in layout.segments if s.space == "qsa_draft"}
    assert draft == {"k", "v", "index_raw", "index_compressed"} | (
        {"rope_positions"} if multimodal else set())


def test_page_bytes_of_the_default_preset():
    """Hand-computed: 12 target rows (FP8 K/V + 2x512 B scales, BF16 index) + 1 BF16 draft."""
    fp8_row = 2 * 64 * 2 * 256 + 2 * 512 + 64 * 128 * 2 + 16 * 128 * 2
    bf16_row = 2 * 64 * 2 * 256 * 2 + 64 * 128 * 2 + 16 * 128 * 2
    layout = PageLayout.for_preset(get_preset(), CacheFormats("fp8", "bf16"))
    assert layout.page_bytes == 12 * fp8_row + bf16_row == 1_196_032
    # FP8 index: its 64-byte scale plane is padded to 256 bytes.
    layout = PageLayout.for_preset(get_preset(), CacheFormats("fp8", "fp8"))
    assert layout.packed_page_bytes + 12 * (256 - 64) == layout.page_bytes


def test_digest_covers_everything_that_shapes_the_bytes():
    p = get_preset()
    base = PageLayout.for_preset(p, CacheFormats("fp8", "fp8"))
    same = PageLayout.for_preset(p, CacheFormats("fp8", "fp8"))
    assert base.digest == same.digest and len(base.digest) == 64
    variants = [
        PageLayout.for_preset(p, CacheFormats("bf16", "fp8")),
        PageLayout.for_preset(p, CacheFormats("fp8", "mxfp4")),
        PageLayout.for_preset(p, CacheFormats("fp8", "fp8", torch.float8_e4m3fnuz)),
        PageLayout.for_preset(p, CacheFormats("fp8", "fp8", multimodal=True)),
        PageLayout.for_preset(p, CacheFormats("fp8", "fp8"), include_draft=False),
        PageLayout.for_preset(p, CacheFormats("fp8", "fp8"), draft=CacheFormats("fp8", "fp8")),
        PageLayout.for_preset(p.replace(block_size=32), CacheFormats("fp8", "fp8")),
        PageLayout.for_preset(p.tensor_parallel_shard(2), CacheFormats("fp8", "fp8")),
        PageLayout.for_preset(p.replace(num_layers=44), CacheFormats("fp8", "fp8")),
        PageLayout.for_preset(p, CacheFormats("fp8", "fp8"), alignment=512),
        PageLayout.build(tuple(reversed(declare_row_spaces(p, CacheFormats("fp8", "fp8")))),
                         64),
    ]
    digests = {v.digest for v in variants}
    assert base.digest not in digests and len(digests) == len(variants)


@pytest.mark.parametrize("kv,index", FORMAT_CASES)
def test_views_are_windows_of_one_allocation(kv, index):
    """Writing through every view, in turn, sets exactly its own bytes of every page."""
    arena = Arena.for_preset(SMALL, 3, CacheFormats(kv, index, multimodal=True))
    arena.buffer.zero_()
    layout = arena.layout
    base = arena.buffer.data_ptr()
    for i, seg in enumerate(layout.segments):
        view = arena.view(seg.space, seg.row, seg.field.name)
        item = view.element_size()
        assert view.dtype == seg.field.dtype
        assert tuple(view.shape) == (3, *seg.field.shape)
        assert view.stride(0) * item == layout.page_bytes and view[0].is_contiguous()
        assert view.data_ptr() - base == seg.offset
        assert view[2].data_ptr() - base == 2 * layout.page_bytes + seg.offset
        view.view(torch.uint8).fill_(i + 1)  # bytes of this field in every block
    expect = torch.zeros(layout.page_bytes, dtype=torch.uint8)
    for i, seg in enumerate(layout.segments):
        expect[seg.offset:seg.end] = i + 1
    assert torch.equal(arena.pages, expect.expand(3, -1))


def test_layer_binds_exactly_the_declared_fields_in_order():
    arena = Arena.for_preset(SMALL, 2, CacheFormats("fp8", "mxfp4"))
    for space in arena.layout.spaces:
        for row in range(space.rows):
            cache = arena.layer(space.name, row)
            assert list(cache) == [f.name for f in space.fields]
    # A returned dict is a copy: mutating it does not rebind the arena.
    cache = arena.layer("qsa", 0)
    cache["k"] = cache["v"]
    assert arena.layer("qsa", 0)["k"].data_ptr() != arena.layer("qsa", 0)["v"].data_ptr()


def test_unknown_space_row_or_field_is_named():
    arena = Arena.for_preset(SMALL, 2, CacheFormats("fp8", "bf16"))
    with pytest.raises(ArenaError, match="unknown row space 'qsa_mtp'.*qsa, qsa_draft"):
        arena.layer("qsa_mtp", 0)
    with pytest.raises(ArenaError, match="row 2 is outside row space 'qsa'"):
        arena.layer("qsa", 2)
    with pytest.raises(ArenaError, match="row 1 is outside row space 'qsa_draft'"):
        arena.layer("qsa_draft", 1)
    with pytest.raises(ArenaError, match="declares no field 'k_scale'"):
        arena.view("qsa_draft", 0, "k_scale")


def test_sized_arena_holds_whole_pages():
    layout = PageLayout.for_preset(SMALL, CacheFormats("fp8", "fp8"))
    arena = Arena.sized(layout, 5 * layout.page_bytes + layout.page_bytes - 1)
    assert arena.num_blocks == 5
    assert arena.buffer.numel() == 5 * layout.page_bytes
    with pytest.raises(ArenaError, match="hold no page"):
        Arena.sized(layout, layout.page_bytes - 1)
    with pytest.raises(ArenaError, match="num_blocks must be a positive integer"):
        Arena(layout, 0)


def test_layout_refuses_inconsistent_declarations():
    spaces = declare_row_spaces(SMALL, CacheFormats())
    with pytest.raises(ArenaError, match="block size 32"):
        PageLayout.build(spaces, 32)
    with pytest.raises(ArenaError, match="distinct"):
        PageLayout.build(spaces + spaces[:1], 16)
    with pytest.raises(ArenaError, match="power of two"):
        PageLayout.build(spaces, 16, alignment=100)


def _state(arena: Arena) -> list[int]:
    return arena.free_blocks()


def test_allocate_and_free_lowest_first():
    arena = Arena.for_preset(SMALL, 6, CacheFormats())
    assert arena.allocate(2) == [0, 1]
    assert arena.claim([4]) == [4]
    assert arena.allocate(2) == [2, 3]
    arena.free([1, 3])
    assert arena.allocate(1) == [1]
    assert arena.free_blocks() == [3, 5] and arena.num_free == 2
    assert not arena.is_free(4) and arena.is_free(5)
    assert arena.claim(torch.tensor([3, 5])) == [3, 5]
    assert arena.num_free == 0


def test_claim_free_of_checked_ids_rechecks_their_state():
    """A large restore validates its target blocks while its copy runs and claims them after
    with their state checked once more: a block taken meanwhile is refused, nothing claimed."""
    arena = Arena.for_preset(SMALL, 6, CacheFormats())
    ids = arena.check_blocks([5, 2, 3], state="free")
    arena.claim([3])
    with pytest.raises(ArenaError, match="block 3 is busy"):
        arena.claim_free(ids)
    assert arena.free_blocks() == [0, 1, 2, 4, 5]
    arena.free([3])
    assert arena.claim_free(ids) == [5, 2, 3] and arena.free_blocks() == [0, 1, 4]


@pytest.mark.parametrize("call,args,match", [
    ("allocate", (7,), "not enough free blocks: 7 requested, 4 free"),
    ("allocate", (-1,), "non-negative integer"),
    ("claim", ([2, 1],), "block 1 is busy"),
    ("claim", ([2, 2],), "block 2 appears more than once"),
    ("claim", ([6],), "block 6 is out of range: the arena has 6 blocks"),
    ("claim", ([-1],), "block -1 is out of range"),
    ("claim", ([2.0],), "block id 2.0 is not an integer"),
    ("claim", ([True],), "block id True is not an integer"),
    ("claim", (torch.tensor([2.0]),), "must be integers"),
    ("free", ([0, 3],), "block 3 is not allocated"),
    ("free", ([0, 0],), "appears more than once"),
    ("free", ([9],), "out of range"),
    ("claim", ([2**70],), f"block {2**70} is out of range"),
    ("claim", ([1, -2**64],), f"block {-2**64} is out of range"),
    ("claim", (np.array([2**64 - 1], dtype=np.uint64),), f"block {2**64 - 1} is out of range"),
    ("claim", (np.arange(40, dtype=np.uint64) + 2**63,), f"block {2**63} is out of range"),
])
def test_bad_block_requests_are_named_and_change_nothing(call, args, match):
    arena = Arena.for_preset(SMALL, 6, CacheFormats())
    arena.allocate(2)
    before = _state(arena)
    with pytest.raises(ArenaError, match=match):
        getattr(arena, call)(*args)
    assert _state(arena) == before


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(-2, 9) | st.integers(-2**63, 2**63 - 1), max_size=20),
       state=st.sampled_from([None, "free", "allocated", "busy"]))
def test_short_id_lists_are_checked_like_arrays(ids, state):
    """Short lists of ids take a Python-int fast path (host time of a one-page offload); it
    must accept exactly what the array path accepts, and leave refusals to it."""
    arena = Arena.for_preset(SMALL, 8, CacheFormats())
    arena.claim([1, 2, 5])

    def outcome(blocks):
        try:
            return arena.check_blocks(blocks, state=state).tolist()
        except ArenaError as exc:
            return str(exc)

    fast = [outcome(ids), outcome(tuple(ids)), outcome(np.array(ids, dtype=np.int64))]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(arena_module, "SMALL_SET", 0)  # every request on the array path
        assert fast == [outcome(ids)] * 3


def test_check_blocks_returns_int64_ids():
    arena = Arena.for_preset(SMALL, 4, CacheFormats())
    ids = arena.check_blocks([np.int32(3), 1])
    assert ids.dtype == np.int64 and ids.tolist() == [3, 1]
