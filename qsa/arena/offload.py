"""Page offload: store the pages of chosen blocks to (pinned) host memory, restore them into any
free blocks.

The unit is the page, and a page IS every declared field of every row of every row space (see
`qsa.arena.arena`). There is no field list here, so a restore can not bring back codes without
their scale planes, or the target's index rows in place of the draft's (the bug of the change
request in spec section 5). `verify_layer_binding` checks, for each layer, that what the
offload moves for it is byte for byte what the layer binds.

Safety: a stored page set carries the layout digest, a random set id, a manifest (page count,
source blocks, a digest over all of it) and one digest per page bound to the page's position in
the set (`qsa.arena.digest`: an avalanche mix per word, so no pair of bit flips cancels). A
restore checks, in this order and before any byte reaches the arena: the layout, the shape of
the set (count, digests, data size), the block request, every page's digest on the device
staging copy, then the manifest. A dropped, duplicated, swapped, truncated or foreign page and
any bit flip are refused with the page and the reason; a refused restore changes nothing.

Reads: a restore reads every stored byte once, into memory of its own (the device copy on a GPU,
a fresh host buffer on the CPU), digests that copy and writes the arena from it, never from the
stored set again: bytes that change in the set's memory or file after they were read can not
reach the arena unchecked. A set on disk is a `PageSource` (`qsa.arena.page_file`), read with
plain reads of its chunks, never mapped, so a file that shrinks or changes under the restore is
a refusal naming it, not a signal.

Copies: pages of consecutive block ids form a range that moves with one copy. Scattered pages
are gathered on the device with one index_select (store) or scattered with one index_copy_
(restore), on 8-byte words, around a single host copy; `strategy` picks, "auto" uses one copy
per range only when the request is a single range (scripts/bench_offload.py measures both). A
GPU restore of several chunks writes the arena with one gated kernel for any strategy instead
(`qsa.kernels.page_write`): it checks every page on the device behind the digests and writes
the pages, in their target blocks, only when all of them match.
`qsa.arena.page_file` writes a stored set to disk and reads it back.

Overlap, because the copy is the only part that must take time (profiles/nvidia-h200/
offload-speed/): a store issues the bulk copy, digests the pages on a second stream beside it
and folds the digests on the host while the copy runs; a restore copies in chunks, digests each
landed chunk on the second stream while the next one copies, and meanwhile runs the page
digests backwards into the content sums it expects, so the check after the copy is one
comparison, and the arena write of a multi-chunk restore is queued behind the digests on the
device, gated by the same comparison, so no host round trip separates them. A set that copies
in one piece (fewer than 2 * MIN_CHUNK_PAGES pages) is digested on the current stream instead,
behind its copy, and checked on the host: a few us of device time, where the stream, event and
launch calls it saves are host time, and the host decides a small offload. A store also takes
its new set id and folds everything but the page bytes into the digests while its copy runs.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from qsa.arena import digest as dg
from qsa.arena.arena import Arena, ArenaError, PageLayout

Strategy = Literal["auto", "ranges", "gather"]
T = TypeVar("T")
STRATEGIES: tuple[str, ...] = ("auto", "ranges", "gather")


class OffloadError(ValueError):
    """Base of the refusals below; each names what is wrong."""


class LayoutMismatchError(OffloadError):
    """Pages stored under another layout (fields, dtypes, shapes, order, spaces, formats...)."""


class TruncatedPagesError(OffloadError):
    """Stored data, digests or source blocks disagree with the set's page count."""


class DigestError(OffloadError):
    """A page's bytes, or its place in the set, do not match the digest taken when stored."""


class ManifestError(OffloadError):
    """The set as a whole (count, order, digests, source blocks) is not the one stored."""


class BindingMismatchError(OffloadError):
    """What a layer binds differs from what the offload moves for it."""


class PageSource(ABC):
    """Stored pages that are read, not held (a page file): a restore reads each chunk once
    into memory of its own, so the source is never trusted to hold still."""

    name: str  # names the source in every refusal of its set
    nbytes: int  # the size the source had when it was opened

    @abstractmethod
    def read_into(self, first: int, out: torch.Tensor) -> None:
        """Pages first..first+k-1 into `out` (uint8 [k, page_bytes], contiguous host memory);
        raises an OffloadError naming the source when they can not all be read as opened."""


@dataclass(frozen=True)
class StoredPages:
    """Pages in host memory or a `PageSource`: flat bytes (page after page), one digest per
    page, and the manifest of the set (layout, set id, count, source blocks, manifest
    digest)."""

    layout_digest: str
    layout_summary: str
    page_bytes: int
    # uint8 [num_pages * page_bytes], host (pinned when CUDA is available), or read from a source
    data: torch.Tensor | PageSource
    digests: torch.Tensor  # int64 [num_pages] bit patterns of the page digests, host
    source_blocks: tuple[int, ...]
    set_id: int
    count: int
    manifest: int  # digest of the set (`qsa.arena.digest.manifest_digest`)

    @property
    def num_pages(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def origin(self) -> str:
        """The prefix of this set's refusals: its source's name, or nothing for one in memory."""
        return f"{self.data.name}: " if isinstance(self.data, PageSource) else ""


def seal(keys: dg.SetKeys, layout_summary: str, data: torch.Tensor,
         sums: np.ndarray) -> StoredPages:
    """A stored set from its keys (`dg.SetKeys`: layout, new set id, page size, source
    blocks), its bytes and the pages' content sums (uint64, in set order): the page digests
    bound to their positions, the manifest."""
    digests = keys.page_digests(sums)
    return StoredPages(keys.layout_digest, layout_summary, keys.page_bytes, data,
                       dg.as_int64(digests), keys.source_blocks, keys.set_id, len(digests),
                       keys.manifest(digests))


def check_set_shape(stored: StoredPages, page_bytes: int) -> None:
    """Count, digests, source blocks and data size agree; raises TruncatedPagesError."""
    data, at = stored.data, stored.origin
    if isinstance(data, PageSource):
        have = data.nbytes
    elif data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise TruncatedPagesError(f"stored data must be a flat contiguous uint8 tensor, got "
                                  f"{data.dtype} of shape {tuple(data.shape)}")
    else:
        have = data.numel()
    if stored.digests.dtype != torch.int64 or stored.digests.dim() != 1:
        raise TruncatedPagesError(f"{at}stored digests must be a flat int64 tensor, got "
                                  f"{stored.digests.dtype} {tuple(stored.digests.shape)}")
    n = stored.count
    if n <= 0:
        raise TruncatedPagesError(f"{at}truncated: the stored set has no pages")
    if stored.digests.numel() != n:
        raise TruncatedPagesError(f"{at}the manifest lists {n} pages but "
                                  f"{stored.digests.numel()} page digests are present: pages "
                                  "were dropped or added")
    if len(stored.source_blocks) != n:
        raise TruncatedPagesError(f"{at}the manifest lists {n} pages but "
                                  f"{len(stored.source_blocks)} source blocks: pages were "
                                  "dropped or added")
    want = n * page_bytes
    if have != want:
        what = "truncated" if have < want else "oversized"
        raise TruncatedPagesError(f"{at}{what}: {n} pages of {page_bytes} bytes need {want} "
                                  f"bytes, the stored data has {have}")


def manifest_holds(stored: StoredPages) -> bool:
    """Whether the manifest matches the set's id, page size, digests and source blocks: host
    work only, so a restore runs it while its copy is in flight."""
    return dg.manifest_digest(stored.layout_digest, stored.set_id, stored.page_bytes,
                              dg.as_uint64(stored.digests),
                              stored.source_blocks) == stored.manifest


def check_sums(stored: StoredPages, sums: np.ndarray, manifest_ok: bool | None = None) -> None:
    """Every page's content sum (uint64, in set order) against its digest, then the manifest
    (`manifest_ok` when the caller checked it already). Names the first bad page and why:
    bytes of another position of the set (moved, duplicated), or bytes that match no page of
    this set (corrupt, or from another set)."""
    n = stored.count
    want = dg.as_uint64(stored.digests)
    got = dg.page_digests(sums, stored.layout_digest, stored.set_id)
    bad = np.flatnonzero(got != want).tolist()
    if bad:
        i = bad[0]
        at = dg.bind(sums[i], np.arange(n), stored.layout_digest, stored.set_id, n)
        others = np.arange(n) != i
        moved = np.flatnonzero(others & (at == want)).tolist()
        carried = np.flatnonzero(others & (at == want[i])).tolist()
        if moved:
            why = f"it holds the bytes of page {moved[0]} (a moved or duplicated page)"
        elif carried:
            why = (f"it and its digest belong at position {carried[0]} (pages reordered with "
                   "their digests)")
        elif len(bad) == n:
            why = ("no page matches its digest: the set's count or id was changed, or the "
                   "digests are not this set's")
        else:
            why = "its bytes changed, or it belongs to another set"
        raise DigestError(f"{stored.origin}digest mismatch in {len(bad)} of {n} pages (first: "
                          f"page {i}, stored from block {stored.source_blocks[i]}): {why}; "
                          "refusing to decode the set")
    if not (manifest_holds(stored) if manifest_ok is None else manifest_ok):
        raise ManifestError(f"{stored.origin}manifest mismatch: the set of {n} pages (id "
                            f"{stored.set_id:016x}) is not the one stored (its id, page size, "
                            "digests or source blocks were changed); refusing to decode it")


def _run_starts(ids: np.ndarray) -> list[int]:
    """Positions where a run of consecutive ids starts. Up to `SMALL_SET` ids on Python ints:
    the array passes cost about 15 us of host time, more than a one-page copy's share."""
    if ids.size <= dg.SMALL_SET:
        v = ids.tolist()
        return [i for i in range(len(v)) if i == 0 or v[i] != v[i - 1] + 1]
    return np.flatnonzero(np.diff(ids, prepend=ids[:1] - 2) != 1).tolist()


def block_ranges(blocks: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in request order: (first block, end block, position in request).

    [5, 6, 7, 2, 3] -> [(5, 8, 0), (2, 4, 3)].
    """
    ids = np.asarray(blocks, dtype=np.int64)
    starts = _run_starts(ids)
    return [(int(ids[s]), int(ids[e - 1]) + 1, s)
            for s, e in zip(starts, [*starts[1:], ids.size])]


class PageOffload:
    """Stores and restores whole pages of one arena.

    Construction checks every layer's binding against the pages (`verify_layer_binding`), so
    an arena whose views drifted from its layout can not be offloaded at all. Not for use from
    several threads at once: small stores share one buffer for their digest parts.
    """

    def __init__(self, arena: Arena, strategy: Strategy = "auto") -> None:
        _check_strategy(strategy)
        self.arena = arena
        self.layout: PageLayout = arena.layout
        self.strategy = strategy
        self._pin = torch.cuda.is_available() and arena.device.type == "cuda"
        self._side: torch.cuda.Stream | None = None  # the digest's stream (`_streams`)
        self._parts: dg.PartsBuffer | None = None  # a one-piece store's digest parts (reused)
        for space, row in self.layout.layers():
            verify_layer_binding(self, space, row)

    # -- what moves -------------------------------------------------------------------------

    def layer_tensors(self, space: str, row: int) -> tuple[tuple[str, torch.Tensor], ...]:
        """The bytes the offload moves for one layer: per declared field, in stored order, a
        uint8 view [num_blocks, field bytes] of the pages (block stride = page size)."""
        pages = self.arena.pages
        return tuple((s.field.name, pages[:, s.offset:s.end])
                     for s in self.layout.layer_segments(space, row))

    # -- store ------------------------------------------------------------------------------

    def store(self, blocks: Iterable[int] | torch.Tensor,
              strategy: Strategy | None = None) -> StoredPages:
        """Copy the pages of allocated `blocks` to host memory, in request order; the bytes
        are in host memory when this returns."""
        with self._on_arena_device():
            return self._store(blocks, strategy)

    def _on_arena_device(self) -> contextlib.AbstractContextManager[Any]:
        """The arena's GPU made current where another one is: the digest launches on the
        current device's stream, and the offload waits on the arena's."""
        dev = self.arena.device
        if dev.type != "cuda" or dev.index == torch.cuda.current_device():
            return contextlib.nullcontext()
        return torch.cuda.device(dev)

    def _store(self, blocks: Iterable[int] | torch.Tensor,
               strategy: Strategy | None) -> StoredPages:
        strategy = _check_strategy(self.strategy if strategy is None else strategy)
        ids = self.arena.check_blocks(blocks, state="allocated")
        if ids.size == 0:
            raise ArenaError("store: no blocks requested")
        p = self.layout.page_bytes
        host = torch.empty((ids.size, p), dtype=torch.uint8, pin_memory=self._pin)
        on_gpu = self.arena.device.type == "cuda"
        one_piece = not on_gpu or len(copy_chunks(ids.size)) == 1
        try:  # the copy and digest, then the host's share of the digests while they run
            pending = self._copy_out(self._sources(ids, self._ranges(ids, strategy)), host,
                                     one_piece)
            keys, summary = dg.SetKeys(self.layout.digest, p, ids.tolist()), self.layout.summary()
        except BaseException:  # also an interrupt: a digest may still write a buffer that is
            if on_gpu:  # dropped now, or that the next set reuses; either stream
                torch.cuda.synchronize(self.arena.device)
            raise
        stream = torch.cuda.current_stream(self.arena.device) if on_gpu else None
        if stream is not None and one_piece:  # digested behind the copy: one wait for both
            stream.synchronize()
        # a larger set's result waits for its digests alone: the folds run while the copy does
        stored = seal(keys, summary, host.view(-1), pending.result())
        if stream is not None and not one_piece:
            stream.synchronize()  # the copy is the last work issued on the stream
        return stored

    def _sources(self, ids: np.ndarray,
                 runs: list[tuple[int, int, int]] | None) -> list[tuple[torch.Tensor, int]]:
        """What a store copies out, with the set position of its first page: one view per
        block range (`runs`), or the pages gathered on the device in request order."""
        pages = self.arena.pages
        if runs is not None:
            return [(pages[a:b], at) for a, b, at in runs]
        idx = torch.from_numpy(ids).to(self.arena.device, non_blocking=True)
        return [(_words(pages).index_select(0, idx).view(torch.uint8), 0)]

    def _copy_out(self, sources: list[tuple[torch.Tensor, int]], host: torch.Tensor,
                  one_piece: bool) -> dg.PendingSums:
        """Issue a store: the copies of `sources` to `host` (pinned on a GPU) on the current
        stream, and their digest (both only read), whose sums a GPU writes into pinned host
        memory. A set that copies in one piece (`copy_chunks`), and any set off the GPU, is
        digested behind its copy on the current stream, closed without an event (the caller
        waits for the stream): a few us of device time, against the stream and event calls
        of host time, which decide a small store. A larger one is digested on a second
        stream beside the copies, waiting for the work issued before them (page writes, the
        gather), not for the copies."""
        n, p, dev = host.shape[0], host.shape[1], self.arena.device
        if one_piece:  # the store waits for the stream before its next set: reuse the parts
            _copy(sources, host)  # first: the host work below runs while it does
            if self._parts is None or self._parts.num_pages < n:  # any size off the GPU
                self._parts = dg.PartsBuffer(max(n, 2 * MIN_CHUNK_PAGES), p, dev)
            pending = dg.PendingSums(n, p, dev, self._parts)
            _digest(sources, pending)
            return pending.close(record=False)
        main, side = self._streams()
        ready = main.record_event()
        _copy(sources, host)
        pending = dg.PendingSums(n, p, dev)  # a pinned allocation: after the copy's issue
        side.wait_event(ready)
        with torch.cuda.stream(side):
            _digest(sources, pending)
            pending.close()
        main.wait_stream(side)  # a gathered staging copy is released after its digest
        return pending

    def _streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The current stream and this offload's second stream (made once)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.arena.device)
        return torch.cuda.current_stream(self.arena.device), self._side

    # -- restore ----------------------------------------------------------------------------

    def check_stored(self, stored: StoredPages) -> None:
        """Layout, then the set's shape; raises LayoutMismatchError or TruncatedPagesError."""
        if stored.layout_digest != self.layout.digest:
            raise LayoutMismatchError(
                f"{stored.origin}layout mismatch: pages were stored under "
                f"[{stored.layout_summary}] but this arena is [{self.layout.summary()}]; "
                "refusing to decode them")
        check_set_shape(stored, self.layout.page_bytes)

    def restore(self, stored: StoredPages, blocks: Iterable[int] | torch.Tensor | None = None,
                strategy: Strategy | None = None) -> list[int]:
        """Write stored pages into free blocks (the lowest free ones when `blocks` is None) and
        allocate them; returns the block of each page, in stored order.

        Everything is checked before the arena is touched; a refusal changes nothing.
        """
        with self._on_arena_device():
            return self._restore(stored, blocks, strategy)

    def _restore(self, stored: StoredPages, blocks: Iterable[int] | torch.Tensor | None,
                 strategy: Strategy | None) -> list[int]:
        strategy = _check_strategy(self.strategy if strategy is None else strategy)
        self.check_stored(stored)
        n = stored.num_pages
        gated = self.arena.device.type == "cuda" and len(copy_chunks(n)) > 1

        def plan() -> tuple[np.ndarray, list[tuple[int, int, int]] | None, bool, np.ndarray,
                            torch.Tensor | None]:
            """The host's share, run while the first chunks copy: the target blocks, how
            they are written, the manifest, the content sums the digests imply and, for a
            gated write, those sums and blocks in pinned memory for the device's check."""
            if blocks is None:
                ids = self.arena.pick_free(n)
            else:
                ids = self.arena.check_blocks(blocks, state="free")
                if ids.size != n:
                    raise ArenaError(f"restore: {n} stored pages need {n} blocks, got "
                                     f"{ids.size}")
            want = dg.expected_sums(dg.as_uint64(stored.digests), stored.layout_digest,
                                    stored.set_id)
            ok = manifest_holds(stored)
            if not gated:
                return ids, self._ranges(ids, strategy), ok, want, None
            order = torch.empty((4, n), dtype=torch.int64, pin_memory=True)
            rows = order.numpy()
            rows[0], rows[1], rows[2:] = want.view(np.int64), ids, -1
            return ids, None, ok, want, order

        staged, pending, (ids, runs, manifest_ok, want, order) = self._stage(stored, plan)
        if order is not None and manifest_ok:
            return self._write_gated(stored, staged, pending, ids, want, order)
        sums = pending.result()
        if not (manifest_ok and np.array_equal(sums, want)):
            check_sums(stored, sums, manifest_ok)  # raises, naming the page and the reason
        pages = self.arena.pages
        if runs:
            for a, b, at in runs:
                pages[a:b].copy_(staged[at:at + b - a])
        else:
            # non_blocking: a pageable copy of the ids, not a wait for the work before it
            idx = torch.from_numpy(ids).to(self.arena.device, non_blocking=True)
            _words(pages).index_copy_(0, idx, _words(staged))
        return self.arena.claim(ids)

    def _write_gated(self, stored: StoredPages, staged: torch.Tensor, pending: dg.PendingSums,
                     ids: np.ndarray, want: np.ndarray, order: torch.Tensor) -> list[int]:
        """A large GPU restore's arena write: checked and written on the device behind the
        digests (`qsa.kernels.page_write`), so no host round trip sits between the last digest
        and the write. The host then compares the sums the check added up with the expected
        ones itself and requires the device's verdict on every page to equal its own before
        the blocks are allocated."""
        from qsa.kernels.page_write import write_if_intact

        try:
            write_if_intact(staged, self.arena.pages, pending.parts, order).synchronize()
        except BaseException:  # the check writes `order` and reads the parts, dropped now
            torch.cuda.synchronize(self.arena.device)
            raise
        rows = order.numpy()
        sums = rows[3].view(np.uint64)
        host_bad, device_bad = sums != want, rows[2] != 0
        if not np.array_equal(host_bad, device_bad):
            where = np.flatnonzero(host_bad != device_bad).tolist()
            raise OffloadError(
                f"the device's page check disagrees with the host's on pages {where[:8]}: "
                + ("nothing was written and no block allocated" if device_bad.any() else
                   "the pages were written into the free target blocks, none allocated"))
        if host_bad.any():
            check_sums(stored, sums.copy(), True)  # raises, naming the page and the reason
        return self.arena.claim_free(ids)

    def _stage(self, stored: StoredPages,
               between: Callable[[], T]) -> tuple[torch.Tensor, dg.PendingSums, T]:
        """The stored pages [n, page_bytes] read once into memory of the restore's own on the
        arena's device (what is digested and written: a change of the set after its read can
        not reach the arena), their content sums on the way back to the host, and what
        `between` returned. On a GPU the host copy goes in chunks, each digested on a second
        stream as soon as it has landed, so of the digest only the last chunk's share follows
        the copy; `between` runs once half the chunks are issued (with one chunk queued, the
        copy engine ran dry behind the host's work in a profile on the H200), so the host's
        own work hides behind their copy. A set of one chunk is digested on the current stream
        behind its copy, where it would run anyway, without the stream calls. A `PageSource`'s
        chunks are read into a pinned buffer first, each just before its copy."""
        n, p, dev, data = stored.count, self.layout.page_bytes, self.arena.device, stored.data
        source = data if isinstance(data, PageSource) else None
        if dev.type != "cuda":
            staged = torch.empty((n, p), dtype=torch.uint8)
            if source is None:
                staged.copy_(data.view(n, p))
            else:
                source.read_into(0, staged)
            pending = dg.PendingSums(n, p, dev)
            pending.add(staged, 0)
            return staged, pending.close(), between()
        host = data.view(n, p) if source is None else torch.empty(
            (n, p), dtype=torch.uint8, pin_memory=True)

        def copy(a: int, b: int) -> None:
            if source is not None:
                source.read_into(a, host[a:b])
            staged[a:b].copy_(host[a:b], non_blocking=True)

        chunks = copy_chunks(n)
        staged = torch.empty((n, p), dtype=torch.uint8, device=dev)
        copy(*chunks[0])  # first: the rest is host work
        main, side = self._streams()
        beside = len(chunks) > 1  # digest on the second stream
        on_digests = torch.cuda.stream(side) if beside else contextlib.nullcontext()
        pending = dg.PendingSums(n, p, dev)  # a pinned allocation
        planned = None
        try:
            for i, (a, b) in enumerate(chunks):
                if i:
                    copy(a, b)
                if beside:
                    side.wait_event(main.record_event())
                with on_digests:
                    pending.add(staged[a:b], a)
                if i == (len(chunks) - 1) // 2:  # half the copy queued: the host work hides in it
                    planned = between()
        except BaseException:
            # a refusal of the host's share or of the source's read: the digests write pinned
            # memory that is freed with `pending`, so let them finish before it propagates
            (side if beside else main).synchronize()
            raise
        with on_digests:
            pending.close()
        if beside:
            main.wait_stream(side)  # the arena copies, and any reuse of `staged`, come after
        return staged, pending, planned

    @staticmethod
    def _ranges(ids: np.ndarray, strategy: str) -> list[tuple[int, int, int]] | None:
        """The block ranges to copy one by one, or None to gather or scatter: "auto" copies
        ranges only when the blocks are one run (checked without building the runs, which
        costs about 1 us a range on the host)."""
        if strategy == "ranges":
            return block_ranges(ids)
        if strategy == "auto" and len(_run_starts(ids)) == 1:
            return [(int(ids[0]), int(ids[-1]) + 1, 0)]
        return None


# A GPU restore of at least 2 * MIN_CHUNK_PAGES pages copies in up to COPY_CHUNKS chunks, so
# the digest of one chunk runs while the next one copies; smaller sets copy in one piece (a
# chunk costs a copy and a digest launch of host time, 50-80 us on the H200's host).
COPY_CHUNKS = 8
MIN_CHUNK_PAGES = 16


def copy_chunks(n: int) -> list[tuple[int, int]]:
    """Page ranges [a, b) covering 0..n in order, in near-equal chunks."""
    k = max(1, min(COPY_CHUNKS, n // MIN_CHUNK_PAGES))
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _copy(sources: list[tuple[torch.Tensor, int]], host: torch.Tensor) -> None:
    """Issue the copies of a store's `sources` into their places in pinned `host`."""
    for v, at in sources:
        host[at:at + v.shape[0]].copy_(v, non_blocking=True)


def _digest(sources: list[tuple[torch.Tensor, int]], pending: dg.PendingSums) -> None:
    """Digest a store's `sources` on the current stream."""
    for v, at in sources:
        pending.add(v, at)


def _words(pages: torch.Tensor) -> torch.Tensor:
    """Pages [n, page_bytes] uint8 as int64 words when the page size allows: a gather or
    scatter of 8-byte elements moves pages at copy speed, one of bytes does not."""
    return pages.view(torch.int64) if pages.shape[-1] % 8 == 0 else pages


def _check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise OffloadError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    return strategy


def verify_layer_binding(offload: PageOffload, space: str, row: int,
                         bound: dict[str, torch.Tensor] | None = None) -> None:
    """Raise BindingMismatchError unless the tensors the offload moves for layer (space, row)
    are exactly that layer's own rows of each declared field, in stored order, and the set of
    tensors the layer binds (`bound`, default `arena.layer(space, row)`) is the same set,
    compared by data pointer, bytes per block, block stride and block count."""
    arena, layout = offload.arena, offload.layout
    where = f"{space}[{row}]"
    declared = [s.field.name for s in layout.layer_segments(space, row)]
    moved = offload.layer_tensors(space, row)
    if [name for name, _ in moved] != declared:
        raise BindingMismatchError(f"{where}: the offload moves fields "
                                   f"{[n for n, _ in moved]}, the declaration is {declared}")
    bound = arena.layer(space, row) if bound is None else bound
    if set(bound) != set(declared):
        missing, extra = sorted(set(declared) - set(bound)), sorted(set(bound) - set(declared))
        raise BindingMismatchError(f"{where}: the layer binds {sorted(bound)}; not bound: "
                                   f"{missing}, bound but not declared: {extra}")
    base = arena.buffer.data_ptr()
    p = layout.page_bytes
    for seg, (name, m) in zip(layout.layer_segments(space, row), moved):
        if m.data_ptr() - base != seg.offset or m.shape != (arena.num_blocks, seg.nbytes) \
                or m.stride() != (p, 1):
            raise BindingMismatchError(f"{where}.{name}: the offload's view is not bytes "
                                       f"{seg.offset}..{seg.end} of every page")
        t = bound[name]
        el = t.element_size()
        off = t.data_ptr() - base
        if off != seg.offset:
            other = layout.locate(off) if 0 <= off < p else None
            really = other.label() if other is not None else f"byte {off} of the arena"
            raise BindingMismatchError(
                f"{where}.{name}: the layer binds {really} (page byte {off}), the offload moves "
                f"page bytes {seg.offset}..{seg.end} for it")
        if t.dtype != seg.field.dtype or tuple(t.shape) != (arena.num_blocks, *seg.field.shape):
            raise BindingMismatchError(
                f"{where}.{name}: bound as {t.dtype} {tuple(t.shape)}, declared "
                f"{seg.field.dtype} {(arena.num_blocks, *seg.field.shape)}")
        if t.stride(0) * el != p or t[0].numel() * el != seg.nbytes \
                or not t[0].is_contiguous():
            raise BindingMismatchError(
                f"{where}.{name}: bound block stride {t.stride(0) * el} B / {t[0].numel() * el} "
                f"B per block, the offload moves {seg.nbytes} B per page of {p} B")
