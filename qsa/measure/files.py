"""Durable file writes shared by the results store, the device ceilings cache, the sweeps and
the page file, and the YAML reading of the sweep specs and suites:
a leaf module, so none of them needs to import another to write or read a file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import yaml


@contextlib.contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that replaces `path` when the block ends without error, so readers see the
    old file or the whole new one, never a part (a temporary file in the same folder, fsync,
    rename, fsync of the folder). Streams: large payloads need not fit in memory twice."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # makes the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (see `atomic_writer`)."""
    with atomic_writer(path) as f:
        f.write(data)


def load_yaml(text: str, source: str | Path) -> Any:
    """`text` parsed as YAML; a syntax error is a ValueError naming `source`, the line and the
    column (PyYAML's own message names a "<unicode string>" over several lines)."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ValueError(f"{source}: not valid YAML: {where}{what}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
