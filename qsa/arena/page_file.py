"""A stored page set on disk: one file, written atomically, read back with plain reads, and
verifiable without a GPU.

Format, version 2 (all integers little-endian):

| offset | size | what |
|---|---|---|
| 0 | 8 | magic `QSAPAGES` |
| 8 | 4 | format version (uint32) |
| 12 | 4 | header length H (uint32) |
| 16 | 8 | header digest (uint64): `qsa.arena.digest.bytes_word` of bytes 0..16 followed by the header |
| 24 | H | header: a UTF-8 JSON object, see `_header` (layout digest and summary, page size, count, set id, source blocks, one digest per page, the manifest digest, the payload offset) |
| 24 + H | to the payload offset | zero padding (the payload starts on the first 4 KiB boundary after the header) |
| payload offset | count x page size | the pages, in set order, byte for byte as the arena holds them |

Every byte is covered: the header by its digest (so the layout summary a reader reports and the
payload offset it reads from are the ones written), the padding by being zeros, each page by its
page digest and the set by its manifest (`qsa.arena.offload`). Version 1 had no header digest,
so its layout summary and payload offset could change unseen: a version 1 file is refused with
its version named (store the set again and write it with this build), never read.

Header values are checked by type and bounds before use: digests, the set id and the manifest
are exactly 16 lowercase hex digits; page size, count, source blocks and payload offset are JSON
integers in range (never floats, NaN or Infinity); the page size is a multiple of 8 and the
payload offset the one the header's length gives; a field missing, unknown or repeated is
refused.

Reads: `read_page_file` reads and checks the header and notes which file it opened (device,
inode) and its size. The payload is never mapped (a mapped file that shrinks kills its reader
with SIGBUS): the restore or `verify_page_file` that consumes the set reads it chunk by chunk
with plain reads into memory of its own (`qsa.arena.offload.PageSource`), and digests and
writes only that copy. A file replaced or resized since it was opened, or that ends early
under a read, is refused as a `PageFileError` naming it.

A reader refuses, naming the file and the reason: a path that can not be read or is not a
regular file, a file that is not a page file, another format version, a header that does not
match its digest, does not parse, or has a field missing, unknown, repeated or out of bounds,
padding that is not zeros, a payload shorter or longer than the header says, and (through
`verify_page_file` or a restore) any page or manifest that does not match its digest.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import numpy as np
import torch

from qsa.arena import digest as dg
from qsa.arena.arena import PageLayout
from qsa.arena.offload import (LayoutMismatchError, OffloadError, PageSource, StoredPages,
                               TruncatedPagesError, check_set_shape, check_sums)
from qsa.measure.files import atomic_writer

MAGIC = b"QSAPAGES"
VERSION = 2
ALIGN = 4096
_PREFIX = struct.Struct("<8sII")  # magic, version, header length: digested with the header
_DIGEST = struct.Struct("<Q")
FIXED_BYTES = _PREFIX.size + _DIGEST.size
MAX_HEADER_BYTES = 64 << 20
MAX_PAGE_BYTES = 1 << 40
MAX_COUNT = 1 << 40
MAX_BLOCK = (1 << 63) - 1  # block ids are int64
CHUNK_BYTES = 64 << 20  # what `verify_page_file` reads at a time
_FIELDS = ("layout_digest", "layout_summary", "page_bytes", "count", "set_id", "source_blocks",
           "digests", "manifest", "payload_offset")
_HEX16 = re.compile(r"[0-9a-f]{16}")


class PageFileError(OffloadError):
    """A page file that can not be read or trusted as written: unreadable, not a page file,
    another version, a header that does not match its digest or holds a bad field, or a file
    that changed since it was opened."""


class TruncatedPageFileError(PageFileError, TruncatedPagesError):
    """A page file shorter or longer than its header says, or one that ends under a read."""


def _hex(v: int) -> str:
    return f"{v & dg.MASK64:016x}"


def _header(stored: StoredPages, payload_offset: int) -> dict[str, Any]:
    return {"layout_digest": stored.layout_digest, "layout_summary": stored.layout_summary,
            "page_bytes": stored.page_bytes, "count": stored.count, "set_id": _hex(stored.set_id),
            "source_blocks": list(stored.source_blocks),
            "digests": [_hex(int(v)) for v in dg.as_uint64(stored.digests)],
            "manifest": _hex(stored.manifest), "payload_offset": payload_offset}


def _payload_offset(header_bytes: int) -> int:
    """Where the payload of a file with a header of `header_bytes` starts."""
    return -(-(FIXED_BYTES + header_bytes) // ALIGN) * ALIGN


def _fixed(body: bytes) -> bytes:
    """The bytes before a header: magic, version, its length, and the digest over those and
    the header."""
    prefix = _PREFIX.pack(MAGIC, VERSION, len(body))
    return prefix + _DIGEST.pack(dg.bytes_word(prefix + body))


def _encode_header(stored: StoredPages) -> tuple[bytes, int]:
    """Header bytes and payload offset (the offset is inside the header, so iterate once)."""
    offset = 0
    while True:
        body = json.dumps(_header(stored, offset), separators=(",", ":")).encode()
        need = _payload_offset(len(body))
        if need == offset:
            return body, offset
        offset = need


def _chunks(stored: StoredPages) -> Iterator[tuple[int, torch.Tensor]]:
    """The set's pages in order, about CHUNK_BYTES at a time, as (first page, host uint8
    [k, page_bytes]); a source's are read once each into one reused buffer."""
    n, p, data = stored.count, stored.page_bytes, stored.data
    k = max(1, CHUNK_BYTES // p)
    buf = torch.empty((min(k, n), p), dtype=torch.uint8) if isinstance(data, PageSource) else None
    for a in range(0, n, k):
        b = min(n, a + k)
        if buf is None:
            yield a, data.view(n, p)[a:b].cpu()
        else:
            data.read_into(a, buf[:b - a])
            yield a, buf[:b - a]


def write_page_file(path: str | Path, stored: StoredPages) -> Path:
    """Write `stored` to `path` atomically: a reader sees the old file or the whole new one,
    never a part."""
    check_set_shape(stored, stored.page_bytes)
    path = Path(path)
    body, offset = _encode_header(stored)
    with atomic_writer(path) as f:
        f.write(_fixed(body))
        f.write(body)
        f.write(b"\0" * (offset - FIXED_BYTES - len(body)))
        for _, pages in _chunks(stored):
            f.write(memoryview(pages.numpy()))
    return path


def _read_full(f: BinaryIO, into: memoryview, path: Path) -> None:
    """Fill `into` from the file's position: a file that ends first shrank under the read."""
    at = 0
    while at < len(into):
        got = f.readinto(into[at:])
        if not got:
            raise TruncatedPageFileError(
                f"{path}: shrank while being read: it ended {len(into) - at} bytes short of "
                "what its size promised when opened")
        at += got


def _read_bytes(f: BinaryIO, n: int, path: Path) -> bytes:
    buf = bytearray(n)
    _read_full(f, memoryview(buf), path)
    return bytes(buf)


def _not_a_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"repeated fields {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def _read_header(f: BinaryIO, path: Path, size: int) -> tuple[dict[str, Any], int]:
    """The checked header object of an open page file of `size` bytes and where it ends."""
    fixed = _read_bytes(f, min(size, FIXED_BYTES), path)
    if fixed[:len(MAGIC)] != MAGIC:
        raise PageFileError(f"{path}: not a QSA page file (it does not start with {MAGIC!r})")
    if len(fixed) < FIXED_BYTES:
        raise TruncatedPageFileError(f"{path}: truncated: {size} bytes end inside the "
                                     f"{FIXED_BYTES}-byte fixed part")
    _, version, length = _PREFIX.unpack_from(fixed)
    if version == 1:
        raise PageFileError(f"{path}: page file format version 1, whose header no digest "
                            f"covers; this build reads version {VERSION} only (store the set "
                            "again and write it with this build)")
    if version != VERSION:
        raise PageFileError(f"{path}: page file format version {version}; this build reads "
                            f"version {VERSION}")
    if length > MAX_HEADER_BYTES:
        raise PageFileError(f"{path}: the header says it is {length} bytes, more than "
                            f"{MAX_HEADER_BYTES}: corrupt")
    if FIXED_BYTES + length > size:
        raise TruncatedPageFileError(f"{path}: truncated: the header says {length} bytes, the "
                                     f"file has {size - FIXED_BYTES} after the fixed part")
    body = _read_bytes(f, length, path)
    if dg.bytes_word(fixed[:_PREFIX.size] + body) != _DIGEST.unpack_from(fixed, _PREFIX.size)[0]:
        raise PageFileError(f"{path}: the header does not match its digest: damaged or edited")
    try:
        head = json.loads(body, parse_constant=_not_a_constant, object_pairs_hook=_no_repeats)
    except ValueError as e:  # also bad UTF-8 and integers too long to convert
        raise PageFileError(f"{path}: the header does not parse ({e}): corrupt") from None
    if not isinstance(head, dict):
        raise PageFileError(f"{path}: the header is not a JSON object: corrupt")
    missing = [k for k in _FIELDS if k not in head]
    unknown = sorted(set(head) - set(_FIELDS))
    problems = []
    if missing:
        problems.append(f"lacks {missing}")
    if unknown:
        problems.append(f"has unknown fields {unknown}")
    if problems:
        raise PageFileError(f"{path}: the header {' and '.join(problems)}: corrupt or not "
                            "written by this format")
    return head, FIXED_BYTES + length


def _bad(path: Path, field: str, value: Any, want: str) -> PageFileError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return PageFileError(f"{path}: header field {field} is {shown}, not {want}: corrupt")


def _int(path: Path, field: str, value: Any, lo: int, hi: int) -> int:
    """A JSON integer in [lo, hi] (not a bool, float, NaN or Infinity)."""
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(path, field, value, f"an integer in [{lo}, {hi}]")
    return value


def _hex16(path: Path, field: str, value: Any) -> int:
    """A digest written by `_hex`: exactly 16 lowercase hex digits, so never negative or wider
    than 64 bits."""
    if not isinstance(value, str) or not _HEX16.fullmatch(value):
        raise _bad(path, field, value, "16 lowercase hex digits")
    return int(value, 16)


def _list(path: Path, head: dict[str, Any], field: str) -> list[Any]:
    value = head[field]
    if not isinstance(value, list):
        raise _bad(path, field, value, "a list")
    return value


def _text(path: Path, head: dict[str, Any], field: str) -> str:
    value = head[field]
    if not isinstance(value, str):
        raise _bad(path, field, value, "a string")
    return value


class FilePages(PageSource):
    """The payload of a page file as `read_page_file` opened it, read with plain reads into
    the caller's memory and only from that file (device and inode) at that size."""

    def __init__(self, path: Path, offset: int, nbytes: int, identity: tuple[int, int]) -> None:
        self.path, self.name, self.offset, self.nbytes = path, str(path), offset, nbytes
        self._identity = identity

    def read_into(self, first: int, out: torch.Tensor) -> None:
        """See `PageSource.read_into`."""
        size = self.offset + self.nbytes
        try:
            with open(self.path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._identity:
                    raise PageFileError(f"{self.path}: replaced by another file since it was "
                                        "opened; refusing to read it")
                if st.st_size != size:
                    raise TruncatedPageFileError(
                        f"{self.path}: {st.st_size} bytes, {size} when it was opened: changed "
                        "under the read; refusing it")
                f.seek(self.offset + first * out.shape[1])
                _read_full(f, memoryview(out.numpy()).cast("B"), self.path)
        except OSError as e:
            raise PageFileError(f"{self.path}: can not be read: {e.strerror or e}") from e


def read_page_file(path: str | Path) -> StoredPages:
    """The stored set of a page file: its header read and checked, its payload a `FilePages`
    read by whatever consumes the set (nothing is mapped, and the file is never modified).
    Checks the format, the header and the sizes; digests are checked by `verify_page_file` or
    by the restore that consumes it."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise PageFileError(f"{path}: {what}, not a page file")
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            head, header_end = _read_header(f, path, st.st_size)
            page_bytes = _int(path, "page_bytes", head["page_bytes"], 8, MAX_PAGE_BYTES)
            if page_bytes % 8:
                raise _bad(path, "page_bytes", page_bytes, "a multiple of 8")
            count = _int(path, "count", head["count"], 1, MAX_COUNT)
            offset = _payload_offset(header_end - FIXED_BYTES)
            if head["payload_offset"] != offset or type(head["payload_offset"]) is not int:
                raise _bad(path, "payload_offset", head["payload_offset"],
                           f"{offset}, where a header of {header_end - FIXED_BYTES} bytes "
                           "puts the payload")
            digests = [_hex16(path, f"digests[{i}]", v)
                       for i, v in enumerate(_list(path, head, "digests"))]
            blocks = tuple(_int(path, f"source_blocks[{i}]", v, 0, MAX_BLOCK)
                           for i, v in enumerate(_list(path, head, "source_blocks")))
            set_id = _hex16(path, "set_id", head["set_id"])
            manifest = _hex16(path, "manifest", head["manifest"])
            layout_digest, summary = (_text(path, head, k)
                                      for k in ("layout_digest", "layout_summary"))
            if len(digests) != count or len(blocks) != count:
                raise PageFileError(f"{path}: the header lists {count} pages, {len(digests)} "
                                    f"page digests and {len(blocks)} source blocks: corrupt")
            have, want = st.st_size - offset, count * page_bytes
            if have != want:
                what = "truncated" if have < want else "oversized"
                raise TruncatedPageFileError(
                    f"{path}: {what}: {count} pages of {page_bytes} bytes need {want} bytes "
                    f"after the header, the file has {max(have, 0)}")
            if any(_read_bytes(f, offset - header_end, path)):
                raise PageFileError(f"{path}: the padding after the header is not zeros: "
                                    "damaged")
    except OSError as e:
        raise PageFileError(f"{path}: can not be read: {e.strerror or e}") from e
    data = FilePages(path, offset, want, (st.st_dev, st.st_ino))
    return StoredPages(layout_digest, summary, page_bytes, data,
                       dg.as_int64(np.array(digests, dtype=np.uint64)), blocks, set_id, count,
                       manifest)


def verify_page_file(path: str | Path, layout: PageLayout | None = None) -> dict[str, Any]:
    """Read a page file and check every page digest and the manifest on the CPU (and, given a
    layout, that the file was written under it), reading the pages once, a chunk at a time.
    Raises an OffloadError naming the file and the problem; returns a summary when the file
    is intact."""
    stored = read_page_file(path)
    if layout is not None and stored.layout_digest != layout.digest:
        raise LayoutMismatchError(f"{path}: layout mismatch: written under "
                                  f"[{stored.layout_summary}], expected [{layout.summary()}]")
    check_set_shape(stored, stored.page_bytes)
    sums = np.empty(stored.count, dtype=np.uint64)
    for a, pages in _chunks(stored):
        sums[a:a + pages.shape[0]] = dg.host_sums(pages)
    check_sums(stored, sums)
    n, p = stored.count, stored.page_bytes
    return {"file": str(path), "pages": n, "page_bytes": p, "bytes": n * p,
            "set_id": _hex(stored.set_id), "layout": stored.layout_summary,
            "layout_digest": stored.layout_digest, "source_blocks": list(stored.source_blocks)}
