"""The page file against a file that changes under it and a header written by hand: a restore
writes exactly the bytes it checked, a file that shrinks or changes is a refusal naming it
(never a signal), every header byte is covered by the header's digest, and every header
value is read with bounds; `qsa offload-check` answers each such file with one line on
stderr and exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from qsa.arena import Arena, CacheFormats, DigestError, OffloadError, PageOffload
from qsa.arena import page_file as pf
from qsa.arena.offload import MIN_CHUNK_PAGES
from qsa.cli import app
from test_arena import SMALL
from test_offload import _assert_unchanged, _random_bytes, _snapshot

ROOT = Path(__file__).resolve().parents[1]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _saved(tmp_path: Path, pages: int = 4, device: str = "cpu"):
    """An arena with `pages` random pages stored and written to a page file; the arena has as
    many free blocks again for restores."""
    arena = Arena.for_preset(SMALL, 2 * pages, CacheFormats("fp8", "fp8"), device=device)
    _random_bytes(arena, 5)
    off = PageOffload(arena)
    stored = off.store(arena.allocate(pages))
    return arena, off, stored, pf.write_page_file(tmp_path / "set.qsapages", stored)


def _pages(stored) -> torch.Tensor:
    return stored.data.view(stored.count, stored.page_bytes)


def _one_line_refusal(path: Path) -> str:
    """`qsa offload-check PATH` in this process: one line on stderr naming the file, nothing
    on stdout, exit 2; the line."""
    res = CliRunner().invoke(app, ["offload-check", str(path)])
    assert res.exit_code == 2 and not res.stdout, res.output
    assert res.stderr.startswith(f"refused: {path}: ") and res.stderr.count("\n") == 1, \
        res.stderr
    return res.stderr


def _payload_offset(path: Path) -> int:
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<I", raw, 12)
    return json.loads(raw[pf.FIXED_BYTES:pf.FIXED_BYTES + length])["payload_offset"]


# ---------------------------------------------------------------------------------------------
# A restore reads each byte once and writes what it checked
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_a_file_changed_right_after_the_restore_read_it_is_not_read_again(
        tmp_path, monkeypatch, device):
    """The file's byte flips as soon as the restore has read its copy: the restore writes the
    checked copy (the stored set, bit for bit), and the next restore, which reads the flipped
    byte, is refused naming the file. A restore that digested the file and then copied from
    it again would write the flipped byte unchecked."""
    n = 2 * MIN_CHUNK_PAGES + 3  # several chunks on a GPU: its gated write
    arena, off, stored, path = _saved(tmp_path, n, device)
    back = pf.read_page_file(path)
    page = n // 2
    at = _payload_offset(path) + page * stored.page_bytes + 99
    real = pf.FilePages.read_into

    def read_then_flip(self, first, out):
        real(self, first, out)
        if first <= page < first + out.shape[0]:  # the chunk holding the byte was read
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ 0x20]))

    monkeypatch.setattr(pf.FilePages, "read_into", read_then_flip)
    dst = off.restore(back)
    assert torch.equal(arena.pages[dst].cpu(), _pages(stored).cpu())
    monkeypatch.setattr(pf.FilePages, "read_into", real)
    arena.free(dst)
    snap = _snapshot(arena)
    with pytest.raises(DigestError, match=f"^{re.escape(str(path))}: digest mismatch in 1 of "
                                          f"{n} pages"):
        off.restore(back)
    _assert_unchanged(arena, snap)


TOGGLER = """
import os, sys, time
path, at, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fd = os.open(path, os.O_RDWR)
print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_restores_while_another_process_toggles_a_byte_are_exact_or_refused(tmp_path, device):
    """A second process flips one payload byte back and forth as fast as it can while this
    one restores the file over and over (about 2 s): every restore either gives the stored
    set bit for bit or is refused, and a refusal changes nothing."""
    n = 2 * MIN_CHUNK_PAGES + 3
    arena, off, stored, path = _saved(tmp_path, n, device)
    want = _pages(stored).cpu().clone()
    back = pf.read_page_file(path)
    at = _payload_offset(path) + (n // 2) * stored.page_bytes + 4321
    toggler = subprocess.Popen([sys.executable, "-c", TOGGLER, str(path), str(at), "30"],
                               stdout=subprocess.PIPE, text=True)
    outcomes = {"exact": 0, "refused": 0}
    try:
        assert toggler.stdout.readline().strip() == "ready"
        end = time.monotonic() + 2.0
        while time.monotonic() < end or sum(outcomes.values()) < 5:
            snap = _snapshot(arena)
            try:
                dst = off.restore(back)
            except OffloadError as e:
                assert str(e).startswith(f"{path}: "), e
                _assert_unchanged(arena, snap)
                outcomes["refused"] += 1
                continue
            assert torch.equal(arena.pages[dst].cpu(), want), \
                f"a restore wrote bytes that are not the stored set ({outcomes})"
            outcomes["exact"] += 1
            arena.free(dst)
    finally:
        toggler.kill()
        toggler.wait(timeout=10)
    print(f"restores while the file changed: {outcomes}")


RESTORE_TRUNCATED = """
import os, sys
import torch
sys.path.insert(0, "tests")
from test_arena import SMALL
from qsa.arena import Arena, CacheFormats, PageOffload
from qsa.arena.page_file import PageFileError, read_page_file, verify_page_file, write_page_file
device, path = sys.argv[1], sys.argv[2]
arena = Arena.for_preset(SMALL, 8, CacheFormats("fp8", "fp8"), device=device)
arena.buffer.copy_(torch.randint(0, 256, arena.buffer.shape, dtype=torch.uint8))
off = PageOffload(arena)
write_page_file(path, off.store(arena.allocate(4)))
stored = read_page_file(path)
os.truncate(path, os.path.getsize(path) - 3 * stored.page_bytes // 2)  # after the read
before = arena.buffer.clone()
for what, call in (("restore", lambda: off.restore(stored)),
                   ("verify", lambda: verify_page_file(path))):
    try:
        call()
    except PageFileError as e:
        print(what, "refused:", e)
    else:
        print(what, "accepted a truncated file")
print("arena unchanged:", torch.equal(arena.buffer, before) and arena.num_free == 4)
"""


@pytest.mark.parametrize("device", DEVICES)
def test_a_file_truncated_between_read_and_restore_is_refused_not_a_signal(tmp_path, device):
    """The payload is read, never mapped: a file cut short after `read_page_file` is a
    PageFileError naming it in the restore (and in a verify), where a mapped read past the
    new end raised SIGBUS and killed the process. Run in a subprocess, so a signal fails this
    test instead of killing pytest."""
    path = tmp_path / "set.qsapages"
    res = subprocess.run([sys.executable, "-c", RESTORE_TRUNCATED, device, str(path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode} (a signal is negative): {res.stderr}"
    lines = res.stdout.splitlines()
    assert lines[0].startswith(f"restore refused: {path}: "), res.stdout
    assert "changed under the read" in lines[0] or "shrank" in lines[0], res.stdout
    assert lines[1].startswith(f"verify refused: {path}: truncated:"), res.stdout
    assert lines[2] == "arena unchanged: True"


def test_a_file_replaced_or_grown_since_it_was_opened_is_refused(tmp_path):
    arena, off, stored, path = _saved(tmp_path)
    back = pf.read_page_file(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    where = re.escape(str(path))
    with pytest.raises(pf.TruncatedPageFileError, match=f"^{where}: .* changed under the read"):
        off.restore(back)
    pf.write_page_file(path, stored)  # the same set, atomically: another file (inode)
    with pytest.raises(pf.PageFileError, match=f"^{where}: replaced by another file since it "
                                               "was opened"):
        off.restore(back)
    assert arena.num_free == 4
    dst = off.restore(pf.read_page_file(path))
    assert torch.equal(arena.pages[dst], _pages(stored))


def test_verify_reads_in_chunks_and_a_set_read_from_a_file_writes_a_file(tmp_path,
                                                                         monkeypatch):
    arena, off, stored, path = _saved(tmp_path, 5)
    monkeypatch.setattr(pf, "CHUNK_BYTES", 2 * stored.page_bytes)  # chunks of 2, 2 and 1
    assert pf.verify_page_file(path, arena.layout)["pages"] == 5
    copy = pf.write_page_file(tmp_path / "copy.qsapages", pf.read_page_file(path))
    assert copy.read_bytes() == path.read_bytes()
    raw = bytearray(path.read_bytes())
    raw[_payload_offset(path) + 4 * stored.page_bytes + 7] ^= 4
    path.write_bytes(bytes(raw))
    with pytest.raises(DigestError, match=f"^{re.escape(str(path))}: digest mismatch in 1 "
                                          r"of 5 pages \(first: page 4,"):
        pf.verify_page_file(path)


# ---------------------------------------------------------------------------------------------
# The header: covered by its digest, read with bounds
# ---------------------------------------------------------------------------------------------

def test_every_header_byte_and_the_padding_are_covered(tmp_path):
    """One bit flipped in any byte before the payload (the fixed part, the header with its
    layout summary, the padding) is a PageFileError: nothing a reader reports or reads from
    can change unseen. A forged layout summary is refused by the CLI too."""
    _, _, stored, path = _saved(tmp_path)
    good = path.read_bytes()
    where = re.escape(str(path))
    with open(path, "r+b", buffering=0) as f:
        for i in range(_payload_offset(path)):
            f.seek(i)
            f.write(bytes([good[i] ^ (1 << (i % 8))]))
            with pytest.raises(pf.PageFileError, match=f"^{where}: "):
                pf.read_page_file(path)
            f.seek(i)
            f.write(good[i:i + 1])
    assert path.read_bytes() == good
    (length,) = struct.unpack_from("<I", good, 12)
    at = good.index(b'"layout_summary":"', pf.FIXED_BYTES) + 20
    assert at < pf.FIXED_BYTES + length
    forged = bytearray(good)
    forged[at] ^= 0x02
    path.write_bytes(bytes(forged))
    assert "the header does not match its digest" in _one_line_refusal(path)


def _reseal(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Edit the header's bytes and give them a matching digest (as a careful forger would),
    so the checks after the digest are what is tested; the payload moves to where the new
    header's length puts it."""
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<I", raw, 12)
    body = raw[pf.FIXED_BYTES:pf.FIXED_BYTES + length]
    offset = json.loads(body)["payload_offset"]
    body = edit(body)
    start = pf._payload_offset(len(body))
    path.write_bytes(pf._fixed(body) + body + bytes(start - pf.FIXED_BYTES - len(body))
                     + raw[offset:])


def _field(name: str, value) -> Callable[[bytes], bytes]:
    """An edit setting one header field to `value`, or to `value(old value)`."""
    def edit(body: bytes) -> bytes:
        head = json.loads(body)
        head[name] = value(head.get(name)) if callable(value) else value
        return json.dumps(head, separators=(",", ":")).encode()
    return edit


def _text(old: str, new: str) -> Callable[[bytes], bytes]:
    """An edit of the header's JSON text: what `json.dumps` does not write (NaN, Infinity,
    a field twice)."""
    def edit(body: bytes) -> bytes:
        assert old.encode() in body
        return body.replace(old.encode(), new.encode(), 1)
    return edit


HEADERS = {
    "a digest with a leading -": (_field("digests", lambda d: ["-" + d[0][1:], *d[1:]]),
                                  r"digests\[0\] is '-.*not 16 lowercase hex digits"),
    "a 17-digit digest": (_field("digests", lambda d: [d[0], d[1] + "0", *d[2:]]),
                          r"digests\[1\] is '[0-9a-f]{17}', not 16 lowercase hex digits"),
    "an upper-case manifest": (_field("manifest", lambda m: "F" + m[1:]),
                               "manifest is '.*', not 16 lowercase hex digits"),
    "a set id as a number": (_field("set_id", 5), "set_id is 5, not 16 lowercase hex"),
    "count Infinity": (_text('"count":4,', '"count":Infinity,'),
                       r"does not parse \(Infinity is not a JSON number"),
    "count -Infinity": (_text('"count":4,', '"count":-Infinity,'),
                        "-Infinity is not a JSON number"),
    "count NaN": (_text('"count":4,', '"count":NaN,'), "NaN is not a JSON number"),
    "count 1e400": (_text('"count":4,', '"count":1e400,'),
                    r"count is inf, not an integer in \[1, "),
    "count 4.0": (_field("count", 4.0), r"count is 4.0, not an integer"),
    "count true": (_field("count", True), r"count is True, not an integer"),
    "count huge": (_field("count", 10**30), r"count is 1000000000000000000000000000000, not"),
    "count negative": (_field("count", -4), r"count is -4, not an integer in \[1, "),
    "count 5 of 4 pages": (_field("count", 5), "the header lists 5 pages, 4 page digests and 4 "
                                               "source blocks"),
    "a source block Infinity": (_text('"source_blocks":[0,', '"source_blocks":[Infinity,'),
                                "Infinity is not a JSON number"),
    "a negative source block": (_field("source_blocks", lambda b: [b[0], -1, *b[2:]]),
                                r"source_blocks\[1\] is -1, not an integer in \[0, "),
    "a source block past int64": (_field("source_blocks", lambda b: [2**63, *b[1:]]),
                                  r"source_blocks\[0\] is 9223372036854775808, not"),
    "a 5000-digit source block": (_text('"source_blocks":[0,',
                                        '"source_blocks":[' + "9" * 5000 + ","),
                                  "does not parse"),
    "page size 0": (_field("page_bytes", 0), r"page_bytes is 0, not an integer in \[8, "),
    "page size not whole words": (_field("page_bytes", lambda p: p + 4),
                                  r"page_bytes is \d+, not a multiple of 8"),
    "payload offset moved": (_field("payload_offset", lambda o: o + 4096),
                             r"payload_offset is 8192, not 4096, where a header of \d+ bytes"),
    "digests not a list": (_field("digests", "0" * 16), "digests is '0+', not a list"),
    "a layout summary that is not text": (_field("layout_summary", 7),
                                          "layout_summary is 7, not a string"),
    "a field twice": (_text("{", '{"count":4,'), r"repeated fields \['count'\]"),
    "an unknown field": (_field("note", "forged"), r"has unknown fields \['note'\]"),
    "not an object": (lambda b: b"[1,2]", "the header is not a JSON object"),
    "not UTF-8": (_text("}", "\xff}"), "does not parse"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_crafted_header_values_are_page_file_errors(tmp_path, case):
    """Values no writer produces, behind a valid header digest: each a PageFileError naming
    the file and the field (never an OverflowError or a wrapped value), one line and exit 2
    in the CLI."""
    _, _, _, path = _saved(tmp_path)
    edit, message = HEADERS[case]
    _reseal(path, edit)
    with pytest.raises(pf.PageFileError, match=f"^{re.escape(str(path))}: .*{message}"):
        pf.read_page_file(path)
    line = _one_line_refusal(path)
    assert "Traceback" not in line


def test_a_version_1_file_is_refused_by_its_version(tmp_path):
    _, _, _, path = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 1)
    path.write_bytes(bytes(raw))
    with pytest.raises(pf.PageFileError, match=f"^{re.escape(str(path))}: page file format "
                                               "version 1, whose "
                                               "header no digest covers; this build reads "
                                               "version 2 only"):
        pf.read_page_file(path)
    _one_line_refusal(path)


# ---------------------------------------------------------------------------------------------
# `qsa offload-check` on a file it may not read
# ---------------------------------------------------------------------------------------------

def _offload_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qsa.cli", "offload-check", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})  # no interpreter notice


@pytest.mark.parametrize("what", ["a directory", "a missing file", "a file without read "
                                  "permission", "a header forged with Infinity"])
def test_offload_check_answers_an_unreadable_or_damaged_file_with_one_line(tmp_path, what):
    if what == "a directory":
        path, reason = tmp_path, "a directory, not a page file"
    elif what == "a missing file":
        path, reason = tmp_path / "none.qsapages", "can not be read: No such file or directory"
    elif what == "a file without read permission":
        if os.geteuid() == 0:
            pytest.skip("root reads a file whatever its mode (the directory case fails for "
                        "root too)")
        _, _, _, path = _saved(tmp_path)
        path.chmod(0)
        reason = "can not be read: Permission denied"
    else:
        _, _, _, path = _saved(tmp_path)
        _reseal(path, _text('"count":4,', '"count":Infinity,'))
        reason = "the header does not parse (Infinity is not a JSON number"
    res = _offload_check(path)
    assert res.returncode == 2 and not res.stdout, (res.stdout, res.stderr)
    assert res.stderr.startswith(f"refused: {path}: {reason}"), res.stderr
    assert res.stderr.count("\n") == 1, res.stderr


def test_the_digest_fields_round_trip_through_their_bounds(tmp_path):
    """The bounds admit every value a writer produces: digests with the top bit set (negative
    as int64) and zero, the largest block id."""
    arena, off, stored, path = _saved(tmp_path)
    digests = stored.digests.clone()
    digests[0], digests[1] = -1, 0
    edge = pf.write_page_file(tmp_path / "edge.qsapages", dataclasses.replace(
        stored, digests=digests, source_blocks=(pf.MAX_BLOCK, 0, 1, 2),
        set_id=stored.set_id | (1 << 63)))
    back = pf.read_page_file(edge)
    assert back.digests[:2].tolist() == [-1, 0] and back.source_blocks[0] == pf.MAX_BLOCK
    assert back.set_id == stored.set_id | (1 << 63)
    assert np.array_equal(back.digests[2:].numpy(), stored.digests[2:].numpy())
