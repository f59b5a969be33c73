"""A stored page set on disk: one file, written atomically, read back memory-mapped, and
verifiable without a GPU.

Format, version 1 (all integers little-endian):

| offset | size | what |
|---|---|---|
| 0 | 8 | magic `QSAPAGES` |
| 8 | 4 | format version (uint32) |
| 12 | 4 | header length H (uint32) |
| 16 | H | header: UTF-8 JSON, see `_header` (layout digest and summary, page size, count, set id, source blocks, one digest per page, the manifest digest, the payload offset) |
| 16 + H | to the payload offset | zero padding (the payload starts on a 4 KiB boundary, so it maps page-aligned) |
| payload offset | count x page size | the pages, in set order, byte for byte as the arena holds them |

Digests are 16-digit hex strings of `qsa.arena.digest` values. A reader refuses, naming the
reason: a file that is not a page file, another format version, a header that does not parse
or lacks a field, a payload shorter or longer than the header says, and (through
`verify_page_file` or a restore) any page or manifest that does not match its digest.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qsa.arena import digest as dg
from qsa.arena.arena import PageLayout
from qsa.measure.files import atomic_writer
from qsa.arena.offload import (LayoutMismatchError, OffloadError, StoredPages,
                               TruncatedPagesError, check_digests, check_set_shape)

MAGIC = b"QSAPAGES"
VERSION = 1
ALIGN = 4096
_FIXED = struct.Struct("<8sII")  # magic, version, header length
MAX_HEADER_BYTES = 64 << 20
_FIELDS = ("layout_digest", "layout_summary", "page_bytes", "count", "set_id", "source_blocks",
           "digests", "manifest", "payload_offset")


class PageFileError(OffloadError):
    """Not a page file, another version, or a header that can not be read."""


def _hex(v: int) -> str:
    return f"{v & dg.MASK64:016x}"


def _header(stored: StoredPages, payload_offset: int) -> dict[str, Any]:
    return {"layout_digest": stored.layout_digest, "layout_summary": stored.layout_summary,
            "page_bytes": stored.page_bytes, "count": stored.count, "set_id": _hex(stored.set_id),
            "source_blocks": list(stored.source_blocks),
            "digests": [_hex(int(v)) for v in dg.as_uint64(stored.digests)],
            "manifest": _hex(stored.manifest), "payload_offset": payload_offset}


def _encode_header(stored: StoredPages) -> tuple[bytes, int]:
    """Header bytes and payload offset (the offset is inside the header, so iterate once)."""
    offset = 0
    while True:
        body = json.dumps(_header(stored, offset), separators=(",", ":")).encode()
        need = -(-(_FIXED.size + len(body)) // ALIGN) * ALIGN
        if need == offset:
            return body, offset
        offset = need


def write_page_file(path: str | Path, stored: StoredPages) -> Path:
    """Write `stored` to `path` atomically: a reader sees the old file or the whole new one,
    never a part."""
    check_set_shape(stored, stored.page_bytes)
    path = Path(path)
    body, offset = _encode_header(stored)
    with atomic_writer(path) as f:
        f.write(_FIXED.pack(MAGIC, VERSION, len(body)))
        f.write(body)
        f.write(b"\0" * (offset - _FIXED.size - len(body)))
        f.write(memoryview(stored.data.contiguous().cpu().numpy()))
    return path


def _read_header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        fixed = f.read(_FIXED.size)
        if len(fixed) < _FIXED.size or fixed[:8] != MAGIC:
            raise PageFileError(f"{path}: not a QSA page file (it does not start with {MAGIC!r})")
        _, version, length = _FIXED.unpack(fixed)
        if version != VERSION:
            raise PageFileError(f"{path}: page file format version {version}; this build reads "
                                f"version {VERSION}")
        if length > MAX_HEADER_BYTES or _FIXED.size + length > size:
            raise TruncatedPagesError(f"{path}: truncated: the header says {length} bytes, the "
                                      f"file has {size - _FIXED.size} after the fixed part")
        raw = f.read(length)
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PageFileError(f"{path}: the header does not parse ({e}): corrupt") from None
    missing = [k for k in _FIELDS if not isinstance(head, dict) or k not in head]
    if missing:
        raise PageFileError(f"{path}: the header lacks {missing}: corrupt or not written by "
                            "this format")
    return head


def read_page_file(path: str | Path) -> StoredPages:
    """The stored set of a page file, its payload memory-mapped copy-on-write (the file is
    never modified). Checks the format and sizes; digests are checked by `verify_page_file`
    or by the restore that consumes it."""
    path = Path(path)
    head = _read_header(path)
    try:
        count, page_bytes, offset = (int(head[k]) for k in ("count", "page_bytes",
                                                            "payload_offset"))
        digests = dg.as_int64(np.array([int(v, 16) for v in head["digests"]], dtype=np.uint64))
        set_id, manifest = int(head["set_id"], 16), int(head["manifest"], 16)
        blocks = tuple(int(b) for b in head["source_blocks"])
    except (TypeError, ValueError) as e:
        raise PageFileError(f"{path}: a header field has the wrong type ({e}): corrupt") from None
    if count <= 0 or page_bytes <= 0 or page_bytes % 8:
        raise PageFileError(f"{path}: {count} pages of {page_bytes} bytes: corrupt header")
    have = path.stat().st_size - offset
    want = count * page_bytes
    if have != want:
        what = "truncated" if have < want else "oversized"
        raise TruncatedPagesError(f"{path}: {what}: {count} pages of {page_bytes} bytes need "
                                  f"{want} bytes after the header, the file has {max(have, 0)}")
    data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=offset,
                                      shape=(want,)))
    return StoredPages(str(head["layout_digest"]), str(head["layout_summary"]), page_bytes,
                       data, digests, blocks, set_id, count, manifest)


def verify_page_file(path: str | Path, layout: PageLayout | None = None) -> dict[str, Any]:
    """Read a page file and check every page digest and the manifest on the CPU (and, given a
    layout, that the file was written under it). Raises an OffloadError naming the problem;
    returns a summary when the file is intact."""
    stored = read_page_file(path)
    if layout is not None and stored.layout_digest != layout.digest:
        raise LayoutMismatchError(f"{path}: layout mismatch: written under "
                                  f"[{stored.layout_summary}], expected [{layout.summary()}]")
    check_set_shape(stored, stored.page_bytes)
    n, p = stored.count, stored.page_bytes
    check_digests(stored, stored.data.view(n, p))
    return {"file": str(path), "pages": n, "page_bytes": p, "bytes": n * p,
            "set_id": _hex(stored.set_id), "layout": stored.layout_summary,
            "layout_digest": stored.layout_digest, "source_blocks": list(stored.source_blocks)}
