"""Page digests that can not cancel and are bound to their place, and the page file.

Each refusal here passed unnoticed under the former keyed-sum checksum: two flipped top bits
cancel in a sum mod 2^64, and nothing bound a page to its position or its set."""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qsa.arena import (Arena, CacheFormats, DigestError, LayoutMismatchError, ManifestError,
                       PageOffload, TruncatedPagesError)
from qsa.arena import digest as dg
from qsa.arena.page_file import (FIXED_BYTES, MAGIC, FilePages, PageFileError, _fixed,
                                 read_page_file, verify_page_file, write_page_file)
from qsa.cli import app
from support import DEVICE
from test_arena import SMALL
from test_offload import _assert_unchanged, _random_bytes, _snapshot

PAGE = 512  # bytes of the pages of the digest property tests


def _page(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, PAGE), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _digest(pages: torch.Tensor, position: int = 0) -> list[int]:
    sums = dg.content_sums(pages)
    return dg.bind(sums.numpy().view(np.uint64), position, "layout", 7, 4).tolist()


def test_two_sign_bits_that_cancelled_a_keyed_sum_are_seen():
    page = _page()
    ref = _digest(page)[0]
    bad = page.clone()
    bad[0, 7] ^= 0x80  # the top bit of word 0 ...
    bad[0, 15] ^= 0x80  # ... and of word 1: +2^63 + 2^63 = 0 mod 2^64 in any keyed sum
    assert _digest(bad)[0] != ref


def test_thousands_of_random_flip_patterns_of_one_to_eight_bits_are_all_seen():
    rng = np.random.default_rng(1)
    page = _page(1)
    n = 6000
    flipped = page.repeat(n, 1).numpy().copy()
    bits = flipped.reshape(n, -1)
    for row in range(n):
        k = int(rng.integers(1, 9))
        where = rng.choice(PAGE * 8, size=k, replace=False)
        np.bitwise_xor.at(bits[row], where // 8, (1 << (where % 8)).astype(np.uint8))
    ref = _digest(page)[0]
    got = _digest(torch.from_numpy(flipped))
    assert all(d != ref for d in got)


@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.integers(0, PAGE * 8 - 1), min_size=1, max_size=8, unique=True),
       seed=st.integers(0, 2**16))
def test_any_one_to_eight_bit_flips_change_the_digest(flips, seed):
    page = _page(seed)
    bad = page.clone()
    for f in flips:
        bad[0, f // 8] ^= 1 << (f % 8)
    assert _digest(bad)[0] != _digest(page)[0]


def test_a_digest_is_bound_to_position_set_count_and_layout():
    c = 12345
    variants = [(2, "L", 1, 4), (3, "L", 1, 4), (2, "L", 2, 4), (2, "L", 1, 5), (2, "M", 1, 4)]
    assert len({int(dg.bind(c, *v)) for v in variants}) == 5
    words = _page(3)
    swapped = words.view(-1, 8).flip(0).reshape(1, PAGE)
    assert _digest(swapped)[0] != _digest(words)[0]


# ---------------------------------------------------------------------------------------------
# Refused restores: the page and the reason, nothing written
# ---------------------------------------------------------------------------------------------

def _stored(blocks: int = 4, seed: int = 2):
    arena = Arena.for_preset(SMALL, 12, CacheFormats("fp8", "fp8"))
    _random_bytes(arena, seed)
    off = PageOffload(arena)
    return arena, off, off.store(arena.allocate(blocks))


def _pages(stored) -> torch.Tensor:
    return stored.data.view(stored.count, stored.page_bytes)


def _with(stored, order: list[int], digests: bool, **changes):
    """The set with its pages in `order` (repeats allowed), optionally carrying their digests."""
    data = _pages(stored)[order].reshape(-1).clone()
    fields = {"data": data}
    if digests:
        fields.update(digests=stored.digests[order].clone(), count=len(order),
                      source_blocks=tuple(stored.source_blocks[i] for i in order))
    return dataclasses.replace(stored, **{**fields, **changes})


CASES = {
    "two pages swapped": (lambda s: _with(s, [1, 0, 2, 3], False), DigestError,
                          r"first: page 0, stored from block 0\): it holds the bytes of page 1"),
    "two pages swapped with their digests": (
        lambda s: _with(s, [1, 0, 2, 3], True), DigestError,
        r"first: page 0.*it and its digest belong at position 1"),
    "a page duplicated": (lambda s: _with(s, [0, 1, 1, 3], False), DigestError,
                          r"first: page 2.*it holds the bytes of page 1"),
    "the last page dropped with its digest": (
        lambda s: _with(s, [0, 1, 2], True, count=4), TruncatedPagesError,
        r"the manifest lists 4 pages but 3 page digests"),
    "the last page dropped with its digest and the count": (
        lambda s: _with(s, [0, 1, 2], True), DigestError,
        r"no page matches its digest: the set's count or id was changed"),
    "a source block changed": (
        lambda s: dataclasses.replace(s, source_blocks=(0, 1, 2, 9)), ManifestError,
        r"manifest mismatch: the set of 4 pages"),
    "the set id changed": (lambda s: dataclasses.replace(s, set_id=s.set_id ^ 1), DigestError,
                           r"no page matches its digest"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_misplaced_dropped_and_edited_sets_are_refused(case):
    arena, off, stored = _stored()
    make, error, message = CASES[case]
    snap = _snapshot(arena)
    with pytest.raises(error, match=message):
        off.restore(make(stored))
    _assert_unchanged(arena, snap)
    assert off.restore(stored) == [4, 5, 6, 7]  # the intact set still restores


def test_a_page_of_another_set_is_refused_even_at_its_own_position():
    arena, off, stored = _stored()
    arena.pages[2, 0] ^= 1
    other = off.store([0, 1, 2, 3])  # another set, whose page 2 differs by one bit
    foreign = _pages(stored).clone()
    foreign[2] = _pages(other)[2]
    snap = _snapshot(arena)
    with pytest.raises(DigestError, match=r"first: page 2.*belongs to another set"):
        off.restore(dataclasses.replace(stored, data=foreign.reshape(-1)))
    _assert_unchanged(arena, snap)


# ---------------------------------------------------------------------------------------------
# The page file
# ---------------------------------------------------------------------------------------------

def test_a_page_file_round_trips_and_verifies(tmp_path):
    arena, off, stored = _stored()
    path = write_page_file(tmp_path / "set.qsapages", stored)
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file was left behind"
    head = path.read_bytes()[:8]
    assert head == MAGIC
    back = read_page_file(path)
    assert isinstance(back.data, FilePages)  # read when consumed, never mapped
    pages = torch.empty(4, stored.page_bytes, dtype=torch.uint8)
    back.data.read_into(0, pages)
    assert torch.equal(pages, _pages(stored)) and torch.equal(back.digests, stored.digests)
    assert (back.set_id, back.count, back.manifest, back.source_blocks) == \
        (stored.set_id, stored.count, stored.manifest, stored.source_blocks)
    summary = verify_page_file(path, arena.layout)
    assert summary["pages"] == 4 and summary["layout_digest"] == arena.layout.digest
    before = path.read_bytes()
    dst = off.restore(back, [11, 10, 9, 8])
    assert torch.equal(arena.pages[dst], _pages(stored))
    assert path.read_bytes() == before, "reading a page file modified it"


def _split(path) -> tuple[bytes, int, int, bytes]:
    raw = path.read_bytes()
    magic, version, length = struct.unpack("<8sII", raw[:16])
    return magic, version, length, raw


@pytest.mark.parametrize("damage", ["flip payload", "truncate payload", "extend payload",
                                    "truncate header", "not a page file", "version 3",
                                    "header edited", "header field missing", "layout"])
def test_a_damaged_page_file_is_refused_by_name(tmp_path, damage):
    arena, off, stored = _stored()
    path = write_page_file(tmp_path / "set.qsapages", stored)
    magic, version, length, raw = _split(path)
    head = json.loads(raw[FIXED_BYTES:FIXED_BYTES + length])
    layout = arena.layout
    if damage == "flip payload":
        at = head["payload_offset"] + 2 * stored.page_bytes + 100
        raw = raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1:]
        error, message = DigestError, r"first: page 2, stored from block 2\): its bytes changed"
    elif damage == "truncate payload":
        raw = raw[:-1]
        error, message = TruncatedPagesError, r"truncated: 4 pages of \d+ bytes need"
    elif damage == "extend payload":
        raw = raw + b"\0" * 8
        error, message = TruncatedPagesError, "oversized"
    elif damage == "truncate header":
        raw = raw[:FIXED_BYTES + length // 2]
        error, message = TruncatedPagesError, "truncated: the header says"
    elif damage == "not a page file":
        raw = b"PK\x03\x04" + raw[4:]
        error, message = PageFileError, "not a QSA page file"
    elif damage == "version 3":
        raw = struct.pack("<8sII", magic, 3, length) + raw[16:]
        error, message = PageFileError, "format version 3; this build reads version 2"
    elif damage == "header edited":
        raw = raw[:FIXED_BYTES] + b"}" + raw[FIXED_BYTES + 1:]
        error, message = PageFileError, "the header does not match its digest"
    elif damage == "header field missing":  # with the header's digest made anew
        del head["manifest"]
        body = json.dumps(head).encode().ljust(length)
        raw = _fixed(body) + body + raw[FIXED_BYTES + length:]
        error, message = PageFileError, r"the header lacks \['manifest'\]"
    else:
        layout = Arena.for_preset(SMALL, 4, CacheFormats("bf16", "fp8")).layout
        error, message = LayoutMismatchError, "layout mismatch: written under"
    path.write_bytes(raw)
    with pytest.raises(error, match=message):
        verify_page_file(path, layout)
    res = CliRunner().invoke(app, ["offload-check", str(path)])
    if damage != "layout":  # the CLI checks the layout only when asked to
        assert res.exit_code == 2 and not res.stdout, res.output
        assert res.stderr.startswith(f"refused: {path}: ") and res.stderr.count("\n") == 1


def test_offload_check_cli_saves_and_verifies_a_page_file(tmp_path):
    path = tmp_path / "rt.qsapages"
    runner = CliRunner()
    res = runner.invoke(app, ["offload-check", "--pages", "2", "--save", str(path)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["offload-check", str(path)])
    assert res.exit_code == 0 and '"ok": true' in res.output and '"pages": 2' in res.output
    res = runner.invoke(app, ["offload-check", str(path), "--expect-layout", "--kv-format",
                              "bf16"])
    assert res.exit_code == 2 and "layout mismatch" in res.stderr and not res.stdout
    # both layouts are named in full, on one line (brackets are not taken for markup)
    assert re.search(r"written under \[[^\]\n]+\], expected \[[^\]\n]+\]", res.stderr), res.stderr


def test_the_manifest_sees_order_and_membership():
    d = np.arange(1, 9, dtype=np.uint64) * np.uint64(0x1234567)
    base = dg.manifest_digest("L", 3, 64, d, range(8))
    assert dg.manifest_digest("L", 3, 64, d[[1, 0, *range(2, 8)]], range(8)) != base
    assert dg.manifest_digest("L", 3, 64, d, [1, 0, *range(2, 8)]) != base
    assert dg.manifest_digest("L", 3, 64, d[:7], range(8)) != base
    assert dg.manifest_digest("L", 3, 128, d, range(8)) != base


@pytest.mark.on_gpu_too
@pytest.mark.parametrize(("pages", "page_bytes"), [(1, 8), (3, 8 * 1023), (2, 8 * 2500)])
def test_the_digest_kernel_matches_its_reference(pages, page_bytes):
    """The one-pass Triton kernel (GPU offloads use it) against the torch reference, on chunk
    counts that do and do not divide the page."""
    from qsa.kernels.page_digest import page_content_sums, page_partial_sums

    data = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(pages))
    want = dg.content_sums_reference(data, dg.word_keys(page_bytes, "cpu"))
    assert torch.equal(page_content_sums(data.to(DEVICE)).cpu(), want)
    # pages 8 bytes past a 16-byte boundary: the GPU launch is bound to its pointers' alignment
    dev = torch.device(DEVICE)
    shifted = torch.empty(pages * page_bytes + 8, dtype=torch.uint8, device=dev)[8:]
    shifted.copy_(data.view(-1).to(dev))
    assert torch.equal(page_content_sums(shifted.view(pages, page_bytes)).cpu(), want)
    # the offload's path: page groups digested in order into one pending set, the parts
    # added on the host; on a GPU the kernel writes them straight into pinned host memory
    pending = dg.PendingSums(pages, page_bytes, dev)
    pending.add(data[1:].to(dev), 1)
    pending.add(data[:1].to(dev), 0)
    got = pending.close().result()
    assert np.array_equal(got, want.numpy().view(np.uint64))
    # the kernel writes a given buffer: pinned host memory for GPU pages
    on_gpu = dev.type == "cuda"
    fresh = page_partial_sums(data.to(dev)).cpu()
    out = torch.full(fresh.shape, -1, dtype=torch.int64, pin_memory=on_gpu)
    assert page_partial_sums(data.to(dev), out) is out
    if on_gpu:
        torch.cuda.synchronize()
    assert torch.equal(out, fresh)
    with pytest.raises(ValueError, match=r"out: expected contiguous int64"):
        page_partial_sums(data.to(dev), out[:, :1] if fresh.shape[1] > 1 else out[:0])
    if on_gpu:
        with pytest.raises(ValueError, match="pinned host memory"):
            page_partial_sums(data.to(dev), torch.zeros_like(fresh))


def test_small_sets_fold_on_integers_to_the_same_digests(monkeypatch):
    """Sets of up to SMALL_SET pages are folded with Python integers (host time of a small
    offload); the digests and the manifest must equal the vector path's, on both sides of
    the threshold."""
    rng = np.random.default_rng(0)
    small = dg.SMALL_SET
    for n in (1, 2, 5, small, small + 1):
        sums = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        blocks = rng.integers(0, 1 << 40, n).tolist()
        got = dg.page_digests(sums, "L", 9)
        assert np.array_equal(got, dg.bind(sums, np.arange(n), "L", 9, n))
        man = dg.manifest_digest("L", 9, 64, got, blocks)
        assert dg.manifest_digest("L", 9, 64, got, tuple(blocks)) == man
        assert dg.manifest_digest("L", 9, 64, got, np.array(blocks)) == man
        want = dg.expected_sums(got, "L", 9)
        monkeypatch.setattr(dg, "SMALL_SET", 0)  # every size on the vector path
        assert np.array_equal(dg.page_digests(sums, "L", 9), got)
        assert dg.manifest_digest("L", 9, 64, got, blocks) == man
        assert np.array_equal(dg.expected_sums(got, "L", 9), want)
        assert np.array_equal(want, sums)
        monkeypatch.setattr(dg, "SMALL_SET", small)


def test_set_keys_fold_ahead_to_the_same_digests_and_manifest():
    """A store folds the set's identity (`SetKeys`) while its copy runs and the page bytes
    after it; the split must give exactly the digests and the manifest of the one-piece
    functions a restore checks against, on both sides of the small-set threshold."""
    rng = np.random.default_rng(5)
    for n in (1, 3, dg.SMALL_SET, dg.SMALL_SET + 1, 200):
        blocks = rng.permutation(1 << 20)[:n].tolist()
        keys = dg.SetKeys("L", 4096, blocks)
        sums = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        digests = keys.page_digests(sums)
        assert np.array_equal(digests, dg.page_digests(sums, "L", keys.set_id))
        assert keys.manifest(digests) == dg.manifest_digest("L", keys.set_id, 4096, digests,
                                                            blocks)
        assert keys.source_blocks == tuple(blocks)
        with pytest.raises(ValueError, match=f"{n + 1} content sums for a set of {n} pages"):
            keys.page_digests(np.append(sums, sums[:1]))
        with pytest.raises(ValueError, match=f"{n - 1} page digests for a set of {n} pages"):
            keys.manifest(digests[1:])
    assert dg.SetKeys("L", 4096, [1]).set_id != dg.SetKeys("L", 4096, [1]).set_id


def test_pending_sums_are_not_read_before_the_set_is_closed():
    pending = dg.PendingSums(1, 64, torch.device("cpu"))
    pending.add(_page()[:, :64], 0)
    with pytest.raises(RuntimeError, match="before close"):
        pending.result()
    assert pending.close(record=False).result().shape == (1,)
    # a reused buffer (a one-piece store's) gives the sums of a fresh one, and is checked
    buffer = dg.PartsBuffer(3, 64, torch.device("cpu"))
    buffer.parts.fill_(-1)
    pages = torch.cat([_page(i)[:, :64] for i in range(3)])
    for n in (3, 1):
        reused = dg.PendingSums(n, 64, torch.device("cpu"), buffer)
        reused.add(pages[:n], 0)
        assert np.array_equal(reused.close().result(), dg.host_sums(pages[:n]))
    for n, page_bytes, dev in ((4, 64, "cpu"), (1, 128, "cpu"), (1, 64, "cuda")):
        with pytest.raises(ValueError, match="buffer: holds 3 pages of 64 bytes for cpu, the "
                                             f"set needs {n} of {page_bytes} bytes for {dev}"):
            dg.PendingSums(n, page_bytes, torch.device(dev), buffer)
    # pages that do not fit the set are refused, not written past its parts
    pending = dg.PendingSums(2, 64, torch.device("cpu"), buffer)
    for bad, at in ((pages[:2], 1), (pages[:1], -1), (pages[:1, :56], 0), (pages[0], 0)):
        with pytest.raises(ValueError, match="this set holds 2 pages of 64 bytes"):
            pending.add(bad, at)


def test_the_unchecked_digest_launch_still_checks_shapes_and_falls_back(monkeypatch):
    """`partial_sums_into` skips only the pinned-memory query of `out`: a narrower or wider
    buffer, or another dtype, would leave page bytes unread or write past it. The bound
    launch steps aside where its key would be incomplete (ROCm's pointer-range
    specialization) or no compiled kernel comes back (a cache hook), so the normal launch
    runs."""
    from qsa.kernels import page_digest as pdk

    pages = _page()
    want = pdk.partial_count(PAGE)
    for bad in (torch.zeros(1, want + 1, dtype=torch.int64), torch.zeros(1, want, dtype=torch.int32),
                torch.zeros(2, want, dtype=torch.int64)):
        with pytest.raises(ValueError, match=rf"out: expected contiguous int64 \[1, {want}\]"):
            pdk.partial_sums_into(pages, bad)
    words = pages.view(torch.int64)
    out = torch.zeros(1, want, dtype=torch.int64)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert pdk._bound_kernel(words, out, words.shape[1], want) is None
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pdk._content_sum_kernel, "warmup", lambda *a, **k: None, raising=False)
    assert pdk._bound_kernel(words, out, words.shape[1], want) is None


def test_an_interrupted_store_leaves_the_offload_usable(monkeypatch):
    """A store that fails while its copy and digest are in flight (here: the identity folds)
    re-raises, after waiting for the device on a GPU; the next store is whole."""
    arena = Arena.for_preset(SMALL, 6, CacheFormats("fp8", "fp8"))
    _random_bytes(arena, 9)
    arena.allocate(2)
    off = PageOffload(arena)
    real = dg.SetKeys

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dg, "SetKeys", interrupted)
    with pytest.raises(KeyboardInterrupt):
        off.store([0, 1])
    monkeypatch.setattr(dg, "SetKeys", real)
    stored = off.store([0, 1])
    dst = off.restore(stored, [2, 3])
    assert torch.equal(arena.pages[dst], arena.pages[[0, 1]])


def test_expected_sums_run_the_page_digests_backwards():
    """A restore checks the device's content sums against the sums the stored digests imply;
    that inverse must give back every sum at every position and set size, and a digest
    changed in any bit must imply another sum."""
    rng = np.random.default_rng(3)
    for n in (1, 2, dg.SMALL_SET, dg.SMALL_SET + 1, 300):
        sums = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
        digests = dg.page_digests(sums, "L", 77)
        assert np.array_equal(dg.expected_sums(digests, "L", 77), sums)
        flipped = digests ^ (np.uint64(1) << rng.integers(0, 64, n).astype(np.uint64))
        assert not np.any(dg.expected_sums(flipped, "L", 77) == sums)
        assert not np.any(dg.expected_sums(digests, "L", 78) == sums)


@pytest.mark.on_gpu_too
@pytest.mark.parametrize("intact", [True, False])
def test_the_gated_arena_write_matches_its_reference(intact):
    """A large GPU restore checks and writes on the device (`qsa.kernels.page_write`): the
    pages land in their (shuffled) blocks only when every page's parts add up to its
    expected sum, the per-page verdict is written for the host, and a mismatch writes
    nothing. A parts count that is not a power of two, pages whose words do not fill the last
    write program."""
    from qsa.kernels.page_write import WRITE_WORDS, write_if_intact
    from qsa.reference.page_write import write_if_intact_reference

    dev = torch.device(DEVICE)
    gen = torch.Generator().manual_seed(11)
    n, page_bytes, blocks = 3, 8 * (WRITE_WORDS + 452), [6, 1, 4]
    staged = torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=gen)
    arena = torch.randint(0, 256, (8, page_bytes), dtype=torch.uint8, generator=gen)
    parts = torch.randint(-2**63, 2**63 - 1, (n, 300), dtype=torch.int64,
                          generator=gen)
    want = parts.sum(dim=1)  # wraps mod 2^64, as the kernel's uint64 sum
    if not intact:
        want[1] ^= 1 << 40
    expected = arena.clone()
    sums, bad = write_if_intact_reference(staged, expected, parts, want, torch.tensor(blocks))
    on_gpu = dev.type == "cuda"
    plan = torch.stack([want, torch.tensor(blocks), torch.full((n,), -1),
                        torch.full((n,), -1)]).contiguous()
    plan = plan.pin_memory() if on_gpu else plan
    got = arena.to(dev, copy=True)
    gate = write_if_intact(staged.to(dev), got, parts.pin_memory() if on_gpu else parts, plan)
    if on_gpu:
        gate.synchronize()
    assert plan[2].tolist() == bad.long().tolist() == ([0, 0, 0] if intact else [0, 1, 0])
    assert torch.equal(plan[3], sums)
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(expected, arena) != intact  # the intact case wrote, the other did not
    with pytest.raises(ValueError, match=r"plan: expected contiguous int64 \[4, 3\]"):
        write_if_intact(staged.to(dev), got, parts, plan[:3])
    with pytest.raises(ValueError, match=r"pages: .* does not take staged pages"):
        write_if_intact(staged.to(dev), got[:, 8:].contiguous(), parts, plan)
