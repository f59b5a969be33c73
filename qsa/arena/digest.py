"""Page digests that can not cancel, bound to the page's place in its set.

Why not a keyed sum of words (what the offload used before): flipping the top bit of two words
changes the sum by 2 * 2^63 = 0 mod 2^64, so two FP8 sign bits could flip unnoticed; and a sum
over the page alone says nothing about which page it is, so a dropped, swapped or foreign page
passed. Here each 64-bit word j of a page goes through a full avalanche mix of (word XOR a key
of j) (MurmurHash3's 64-bit finalizer: every input bit flips each output bit with probability
about 1/2) and the mixed words are summed mod 2^64. Any change inside one word, and any
reordering of words, changes the sum unless pseudo-random 64-bit values cancel, a 2^-64 event.

The content sum is then folded with the page's identity: the layout digest, the set's random id,
the number of pages in the set and the page's position in it. A page moved to another position,
a page of another set or a set with a page dropped or added gives another digest. The manifest
digest folds the count and every page digest in order, so the set itself can not be edited
consistently by accident.

This guards against corruption and misplacement, not against an adversary: the functions are
public and unkeyed. The content sums run on the pages' device (one pass of
`qsa.kernels.page_digest` on a GPU, the torch reference of `qsa.reference.page_digest`
elsewhere); the folds run on the host, vectorised over the pages of a set.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Sequence

import numpy as np
import torch

from qsa.reference.page_digest import (C1, C2, GOLDEN, MASK64, SEED, content_sums_reference,
                                       word_keys)

__all__ = ["MASK64", "PartsBuffer", "PendingSums", "SetKeys", "as_int64", "as_uint64", "bind",
           "bytes_word", "content_parts", "content_sums", "content_sums_reference", "expected_sums",
           "fmix64_array", "fold", "host_sums", "layout_word", "manifest_digest", "new_set_id",
           "page_digests", "parts_per_page", "word_keys"]


def content_sums(pages: torch.Tensor) -> torch.Tensor:
    """sum_j fmix64(w_j XOR k_j) mod 2^64 of pages [n, page_bytes] uint8 (rows contiguous):
    int64 [n] on the pages' device. Integer sums wrap, so the reduction order does not matter."""
    return content_parts(pages).sum(dim=1)


def content_parts(pages: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The content sums in parts, int64 [n, `parts_per_page`] (their sum mod 2^64 along the
    parts is `content_sums`), issued without waiting, into `out` when given (on a GPU it may
    be pinned host memory) or on the pages' device. On a GPU, one pass of the Triton kernel in
    `qsa.kernels.page_digest` (keys made in the kernel); elsewhere `content_sums_reference`
    with the keys of that page size."""
    if pages.is_cuda:
        from qsa.kernels.page_digest import page_partial_sums

        return page_partial_sums(pages, out)
    sums = content_sums_reference(pages, _keys(pages.shape[1], str(pages.device)))[:, None]
    return sums if out is None else out.copy_(sums)


def parts_per_page(page_bytes: int, device: torch.device) -> int:
    """Width of `content_parts` for pages of `page_bytes` on `device`."""
    if device.type == "cuda":
        from qsa.kernels.page_digest import partial_count

        return partial_count(page_bytes)
    return 1


class PendingSums:
    """Content sums of a page set on their way to the host. `add` digests a group of the set's
    pages on the current stream once they are ready there; on a GPU the kernel writes its parts
    straight into pinned host memory, so no copy call is issued and nothing queues behind a
    bulk copy on the copy engine. `close` marks the end of the digests on the current stream,
    and `result` waits for that alone; wait for it (or for the stream) before dropping the
    object, whose pinned buffer the kernel writes. An offload digests its pages beside the
    bulk copy and folds the digests on the host while the bulk copy still runs, so the folds
    cost no wall time (profiles/nvidia-h200/offload-speed/)."""

    def __init__(self, num_pages: int, page_bytes: int, device: torch.device,
                 buffer: PartsBuffer | None = None) -> None:
        """`buffer`: where to write the parts, for a caller that reuses one across sets and
        waits for each set's digests before the next (a pinned allocation costs 4-11 us of
        host time, and a one-page store is host-bound)."""
        self._device, self._page_bytes = device, page_bytes
        shape = (num_pages, parts_per_page(page_bytes, device))
        if buffer is None:
            self._host = torch.empty(shape, dtype=torch.int64,
                                     pin_memory=device.type == "cuda")
        elif (buffer.device.type, buffer.page_bytes) != (device.type, page_bytes) \
                or buffer.num_pages < num_pages:
            raise ValueError(f"buffer: holds {buffer.num_pages} pages of {buffer.page_bytes} "
                             f"bytes for {buffer.device.type}, the set needs {num_pages} of "
                             f"{page_bytes} bytes for {device.type}")
        else:
            self._host = buffer.parts[:shape[0] * shape[1]].view(shape)
        self._done: torch.cuda.Event | None = None
        self._closed = False

    @property
    def parts(self) -> torch.Tensor:
        """The set's digest parts, int64 [num_pages, parts per page], as the digests write
        them (pinned host memory on a GPU): for a device-side check queued behind them."""
        return self._host

    def add(self, pages: torch.Tensor, at: int) -> None:
        """Digest `pages` [k, page_bytes], the set's pages at..at+k-1."""
        out = self._host[at:at + pages.shape[0]]
        if pages.dim() != 2 or at < 0 or out.shape[0] != pages.shape[0] \
                or pages.shape[1] != self._page_bytes:
            raise ValueError(f"pages {tuple(pages.shape)} at {at}: this set holds "
                             f"{self._host.shape[0]} pages of {self._page_bytes} bytes")
        # A GPU set's buffer is pinned (made here or by `PartsBuffer`) and made for these
        # pages: the launch skips the checks of it (a pinned-memory query is a driver call).
        if pages.is_cuda and self._device.type == "cuda":
            from qsa.kernels.page_digest import partial_sums_into

            partial_sums_into(pages, out)
        else:
            content_parts(pages, out)

    def close(self, record: bool = True) -> PendingSums:
        """Mark the digests issued so far on the device's current stream as the whole set.
        `record=False` when the caller waits for that stream itself before `result`: the
        event costs about 8 us of host time, and a one-page store is host-bound."""
        if record and self._device.type == "cuda":
            self._done = torch.cuda.current_stream(self._device).record_event()
        self._closed = True
        return self

    def result(self) -> np.ndarray:
        """The sums, uint64 in page order (the parts added mod 2^64)."""
        if not self._closed:
            raise RuntimeError("PendingSums.result before close: the digests may still run")
        if self._done is not None:
            self._done.synchronize()
        return self._host.numpy().view(np.uint64).sum(axis=1, dtype=np.uint64)


class PartsBuffer:
    """Host memory for the digest parts of sets of up to `num_pages` pages of `page_bytes`,
    pinned for a GPU, which writes it directly: made only here, so a `PendingSums` given one
    trusts it without a pinned-memory query per set."""

    def __init__(self, num_pages: int, page_bytes: int, device: torch.device) -> None:
        self.num_pages, self.page_bytes, self.device = num_pages, page_bytes, device
        self.parts = torch.empty(num_pages * parts_per_page(page_bytes, device),
                                 dtype=torch.int64, pin_memory=device.type == "cuda")


def host_sums(pages: torch.Tensor) -> np.ndarray:
    """The content sums (uint64, in order) of pages [n, page_bytes] on any device: waits for
    the device work issued before."""
    pending = PendingSums(pages.shape[0], pages.shape[1], pages.device)
    pending.add(pages, 0)
    return pending.close().result()


@functools.lru_cache(maxsize=8)
def _keys(page_bytes: int, device: str) -> torch.Tensor:
    """The per-word keys of a page size, made once (a page's worth of int64 per size)."""
    return word_keys(page_bytes, device)


def _shift_multiply_int(x: int, first: int, second: int) -> int:
    """`_shift_multiply` on one Python int."""
    x ^= x >> 33
    x = (x * first) & MASK64
    x ^= x >> 33
    x = (x * second) & MASK64
    return x ^ (x >> 33)


def _fmix64(x: int) -> int:
    """fmix64 of one value with Python ints: the folds below hash a handful of scalars per
    set, where numpy's per-call overhead (about 1 us a call, 8 calls a mix) would dominate."""
    return _shift_multiply_int(x, C1, C2)


# Up to this many values, the folds below run on Python integers: numpy's per-call overhead
# (a dozen calls of about 1 us per fold) would cost more than the arithmetic, and a one-page
# offload is host-bound (profiles/nvidia-h200/offload-speed/).
SMALL_SET = 16


def _step(h: int, v: int) -> int:
    """One fold step on Python integers; `_fold_array` is the same on arrays."""
    return _fmix64(((h ^ (v & MASK64)) * GOLDEN) & MASK64)


def fold(values: Sequence[int], h: int = SEED) -> int:
    """An order-sensitive 64-bit hash of a short sequence of 64-bit values; `h` continues a
    fold whose earlier values gave that state."""
    for v in values:
        h = _step(h, v)
    return h


def _u64(x: int) -> np.ndarray:
    return np.array(x & MASK64, dtype=np.uint64)


_C1, _C2, _GOLDEN, _SHIFT = _u64(C1), _u64(C2), _u64(GOLDEN), np.uint64(33)


def _shift_multiply(x: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """x ^= x >> 33, times `first`, again, times `second`, again: fmix64's shape on uint64
    arrays (numpy array arithmetic wraps mod 2^64, without warnings); `x` is not modified."""
    x = x ^ (x >> _SHIFT)
    x *= first
    x ^= x >> _SHIFT
    x *= second
    x ^= x >> _SHIFT
    return x


def fmix64_array(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's fmix64 on uint64 arrays; `x` is not modified."""
    return _shift_multiply(x, _C1, _C2)


def _fold_array(h: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One step of `fold` for many sequences at once."""
    return fmix64_array((h ^ v) * _GOLDEN)


def _mix_sum(values: np.ndarray | Sequence[int], tag: int) -> int:
    """sum_i fmix64(v_i XOR key(i, tag)) mod 2^64 of uint64 patterns: an order-sensitive
    digest of a long sequence in a few vector passes (a sequential fold over thousands of
    pages costs ms). Short sequences, as arrays or Python ints, go through Python ints."""
    n = len(values)
    if n <= SMALL_SET:
        ints = values.tolist() if isinstance(values, np.ndarray) else values
        return sum(_fmix64((v & MASK64) ^ k) for v, k in zip(ints, _mix_keys_ints(n, tag))) \
            & MASK64
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.int64)
    return int(fmix64_array(arr.astype(np.uint64) ^ _mix_keys(n, tag)).sum(dtype=np.uint64))


@functools.lru_cache(maxsize=32)
def _mix_keys(n: int, tag: int) -> np.ndarray:
    """The keys of `_mix_sum` for a length and tag (page sets repeat their sizes)."""
    keys = fmix64_array(np.arange(n, dtype=np.uint64) * _GOLDEN + _u64(SEED ^ tag))
    keys.flags.writeable = False
    return keys


@functools.lru_cache(maxsize=32)
def _mix_keys_ints(n: int, tag: int) -> tuple[int, ...]:
    """`_mix_keys` as Python ints, for the short sequences `_mix_sum` folds without numpy."""
    return tuple(_mix_keys(n, tag).tolist())


def bytes_word(data: bytes) -> int:
    """64 bits standing for a byte string (BLAKE2b): a layout digest in the folds, a page
    file's header."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=64)
def layout_word(layout_digest: str) -> int:
    """64 bits standing for a layout digest (any string) in the folds."""
    return bytes_word(layout_digest.encode())


def new_set_id() -> int:
    """A random 64-bit id per stored set: a page of another set never matches this one."""
    return secrets.randbits(64)


def bind(contents: np.ndarray | int, positions: np.ndarray | int, layout_digest: str,
         set_id: int, count: int) -> np.ndarray:
    """Digests (uint64) of pages with content sums `contents` at `positions` of a set of
    `count` pages: fold(layout, set id, count, position, content), broadcast over the arrays."""
    return _bind_from(fold((layout_word(layout_digest), set_id, count)), contents, positions)


def _bind_from(head: int, contents: np.ndarray | int, positions: np.ndarray | int) -> np.ndarray:
    """`bind` from the fold of the set's identity (`head`)."""
    h = _fold_array(_u64(head), np.asarray(positions).astype(np.uint64))
    return _fold_array(h, np.asarray(contents).astype(np.uint64))


def page_digests(sums: np.ndarray, layout_digest: str, set_id: int) -> np.ndarray:
    """Digests (uint64) of every page of a set from its content sums (uint64, in set order):
    `bind` of each sum at its own position."""
    return _bind_in_order(sums, fold((layout_word(layout_digest), set_id, sums.size)))


def _bind_in_order(sums: np.ndarray, head: int) -> np.ndarray:
    """`page_digests` from the fold of the set's identity (`head`)."""
    n = sums.size
    if n > SMALL_SET:
        return _bind_from(head, sums, np.arange(n))
    return np.array([_step(_step(head, i), c) for i, c in enumerate(sums.tolist())],
                    dtype=np.uint64)


C1_INV, C2_INV, GOLDEN_INV = (pow(c, -1, 1 << 64) for c in (C1, C2, GOLDEN))
_C1_INV, _C2_INV, _GOLDEN_INV = (_u64(c) for c in (C1_INV, C2_INV, GOLDEN_INV))


def _unmix_array(x: np.ndarray) -> np.ndarray:
    """The inverse of `fmix64_array`: x ^ (x >> 33) undoes itself (33 >= 64 / 2) and the
    multipliers are odd, so invertible mod 2^64: the same steps, inverse multipliers in
    reverse order."""
    return _shift_multiply(x, _C2_INV, _C1_INV)


def expected_sums(digests: np.ndarray, layout_digest: str, set_id: int) -> np.ndarray:
    """The content sums (uint64) that give `digests` at their own positions: `page_digests`
    run backwards (every fold step is a bijection of its last input). A restore computes
    these while its copy is in flight, so once the device's sums arrive the check is one
    comparison."""
    n = digests.size
    h0 = fold((layout_word(layout_digest), set_id, n))
    if n <= SMALL_SET:
        return np.array([((_shift_multiply_int(d, C2_INV, C1_INV) * GOLDEN_INV) & MASK64)
                         ^ _step(h0, i) for i, d in enumerate(digests.tolist())],
                        dtype=np.uint64)
    h = _fold_array(_u64(h0), np.arange(n, dtype=np.uint64))
    return (_unmix_array(digests.astype(np.uint64)) * _GOLDEN_INV) ^ h


def manifest_digest(layout_digest: str, set_id: int, page_bytes: int, digests: np.ndarray,
                    source_blocks: Sequence[int]) -> int:
    """The set as a whole: layout, id, page size, count, every page digest and source block,
    in order."""
    head = fold((layout_word(layout_digest), set_id, page_bytes, digests.size))
    return fold((_mix_sum(digests, 1), len(source_blocks), _mix_sum(source_blocks, 2)), head)


class SetKeys:
    """What the digests of a new set fold in besides its pages' bytes: the layout, a new set
    id, the page size and the source blocks. A store computes this while its copy is in
    flight, so once the content sums land only `page_digests` and `manifest` remain, a few
    folds per page (a one-page store is host-bound: profiles/nvidia-h200/offload-speed/)."""

    def __init__(self, layout_digest: str, page_bytes: int, source_blocks: Sequence[int]) -> None:
        self.layout_digest = layout_digest
        self.page_bytes = page_bytes
        self.source_blocks = tuple(int(b) for b in source_blocks)
        self.set_id = new_set_id()
        n, word = len(self.source_blocks), layout_word(layout_digest)
        self._page_head = fold((word, self.set_id, n))
        self._manifest_head = fold((word, self.set_id, page_bytes, n))
        self._blocks_part = (n, _mix_sum(self.source_blocks, 2))

    def page_digests(self, sums: np.ndarray) -> np.ndarray:
        """`page_digests` of this set's content sums (one per source block, in order)."""
        if sums.size != len(self.source_blocks):
            raise ValueError(f"{sums.size} content sums for a set of "
                             f"{len(self.source_blocks)} pages")
        return _bind_in_order(sums, self._page_head)

    def manifest(self, digests: np.ndarray) -> int:
        """`manifest_digest` of this set with these page digests."""
        if digests.size != len(self.source_blocks):
            raise ValueError(f"{digests.size} page digests for a set of "
                             f"{len(self.source_blocks)} pages")
        return fold((_mix_sum(digests, 1), *self._blocks_part), self._manifest_head)


def as_int64(digests: np.ndarray) -> torch.Tensor:
    """uint64 digests as the int64 tensor that travels next to the data."""
    return torch.from_numpy(np.ascontiguousarray(digests, dtype=np.uint64).view(np.int64).copy())


def as_uint64(t: torch.Tensor) -> np.ndarray:
    """An int64 digest tensor back to uint64 patterns."""
    return t.cpu().numpy().view(np.uint64)
