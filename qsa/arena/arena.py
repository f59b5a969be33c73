"""The paged arena: one device allocation, laid out block-major from the field declaration.

A block (page) holds every declared field of every row of every row space, in declared order,
each field starting on a 256-byte boundary. Why block-major: one page is then one contiguous byte
range, so offload moves a page range with one copy and can not leave a field behind (the
scale-plane bug of spec section 5 was a per-field list that forgot fields). Every field view is a
strided window into that one allocation, with block stride = page size; kernels take any block
stride.

Nothing here lists fields by hand: the layout is computed from `declare_row_spaces`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from qsa.arena.digest import SMALL_SET
from qsa.arena.fields import CacheFormats, FieldSpec, RowSpace, declare_row_spaces
from qsa.presets import ModelPreset

ALIGNMENT = 256  # bytes: every field of every row starts on this boundary inside a page
LAYOUT_VERSION = 1  # bump when the placement rule below changes (it is part of the digest)


class ArenaError(ValueError):
    """A request the arena can not honour (unknown row space or row, bad or busy block ids)."""


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Segment:
    """One declared field of one row, at a byte offset inside every page."""

    space: str
    row: int
    field: FieldSpec
    offset: int

    @property
    def nbytes(self) -> int:
        return self.field.nbytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def label(self) -> str:
        return f"{self.space}[{self.row}].{self.field.name}"


@dataclass(frozen=True)
class PageLayout:
    """Where every (row space, row, field) lives inside a page, and a digest of it all."""

    spaces: tuple[RowSpace, ...]
    block_size: int
    alignment: int
    segments: tuple[Segment, ...]
    page_bytes: int

    @classmethod
    def build(cls, spaces: Sequence[RowSpace], block_size: int,
              alignment: int = ALIGNMENT) -> "PageLayout":
        """Place the fields of each space's rows in declared order, each `alignment`-aligned."""
        spaces = tuple(spaces)
        if not spaces:
            raise ArenaError("a page layout needs at least one row space")
        if alignment < 8 or alignment & (alignment - 1):
            raise ArenaError(f"alignment must be a power of two >= 8 (the widest element), "
                             f"got {alignment}")
        names = [s.name for s in spaces]
        if len(set(names)) != len(names):
            raise ArenaError(f"row space names must be distinct, got {names}")
        segments: list[Segment] = []
        at = 0
        for space in spaces:
            if space.rows < 1:
                raise ArenaError(f"row space {space.name!r} has {space.rows} rows; need >= 1")
            for f in space.fields:
                if f.shape[0] not in (block_size, block_size // 4):
                    raise ArenaError(f"field {space.name}.{f.name} has {f.shape[0]} entries per "
                                     f"block; block size {block_size} needs {block_size} or "
                                     f"{block_size // 4}")
            for row in range(space.rows):
                for f in space.fields:
                    at = align_up(at, alignment)
                    segments.append(Segment(space.name, row, f, at))
                    at += f.nbytes
        return cls(spaces, block_size, alignment, tuple(segments), align_up(at, alignment))

    @classmethod
    def for_preset(cls, preset: ModelPreset, target: CacheFormats | None = None,
                   draft: CacheFormats | None = None, include_draft: bool = True,
                   alignment: int = ALIGNMENT) -> "PageLayout":
        spaces = declare_row_spaces(preset, target or CacheFormats(), draft, include_draft)
        return cls.build(spaces, preset.block_size, alignment)

    @property
    def packed_page_bytes(self) -> int:
        """Page bytes without alignment padding (what the fields alone need)."""
        return sum(s.nbytes for s in self.segments)

    def space(self, name: str) -> RowSpace:
        for s in self.spaces:
            if s.name == name:
                return s
        raise ArenaError(f"unknown row space {name!r} (known: "
                         f"{', '.join(s.name for s in self.spaces)})")

    def layers(self) -> Iterator[tuple[str, int]]:
        """Every (row space, row) in stored order."""
        for s in self.spaces:
            for row in range(s.rows):
                yield s.name, row

    def layer_segments(self, space: str, row: int) -> tuple[Segment, ...]:
        """The segments of one layer row, in stored (= declared) order."""
        rows = self.space(space).rows
        if not isinstance(row, int) or isinstance(row, bool) or not 0 <= row < rows:
            raise ArenaError(f"row {row!r} is outside row space {space!r} (rows 0..{rows - 1})")
        return tuple(s for s in self.segments if s.space == space and s.row == row)

    def locate(self, offset: int) -> Segment | None:
        """The segment holding byte `offset` of a page (None for padding): names what a
        misbound tensor really points at."""
        for s in self.segments:
            if s.offset <= offset < s.end:
                return s
        return None

    def describe(self) -> dict[str, Any]:
        """Everything that shapes a page's bytes, as plain data (what the digest hashes)."""
        return {
            "layout_version": LAYOUT_VERSION,
            "block_size": self.block_size,
            "alignment": self.alignment,
            "page_bytes": self.page_bytes,
            "spaces": [{
                "name": s.name,
                "rows": s.rows,
                "formats": {"kv": s.formats.kv, "index": s.formats.index,
                            "fp8_dtype": str(s.formats.fp8_dtype),
                            "multimodal": s.formats.multimodal},
                "fields": [{"name": f.name, "shape": list(f.shape), "dtype": str(f.dtype)}
                           for f in s.fields],
            } for s in self.spaces],
        }

    @cached_property
    def digest(self) -> str:
        """sha256 of `describe()`: pages stored under one layout are refused under another."""
        text = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def summary(self) -> str:
        """One line for error messages: formats per space and page size."""
        parts = [f"{s.name} x{s.rows}: kv={s.formats.kv} index={s.formats.index}"
                 f"{' +rope' if s.formats.multimodal else ''}" for s in self.spaces]
        return (f"{'; '.join(parts)}; block {self.block_size}, page {self.page_bytes} B, "
                f"digest {self.digest[:12]}")


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def blocks_in(layout: PageLayout, nbytes: int) -> int:
    """How many whole pages fit in `nbytes`."""
    return int(nbytes) // layout.page_bytes


class Arena:
    """One uint8 allocation of `num_blocks` pages, typed views per layer, and free blocks.

    `layer(space, row)` is exactly the cache dict the reference and the kernels take.
    Blocks are allocated lowest id first, so neighbouring allocations form page ranges that
    offload moves with one copy.
    """

    def __init__(self, layout: PageLayout, num_blocks: int,
                 device: torch.device | str = "cpu") -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ArenaError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.buffer = torch.empty(num_blocks * layout.page_bytes, dtype=torch.uint8,
                                  device=device)
        self.device = self.buffer.device
        self.pages = self.buffer.view(num_blocks, layout.page_bytes)
        self._views: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        for space, row in layout.layers():
            self._views[space, row] = {s.field.name: self._typed_view(s)
                                       for s in layout.layer_segments(space, row)}
        self._free = np.ones(num_blocks, dtype=bool)

    @classmethod
    def for_preset(cls, preset: ModelPreset, num_blocks: int,
                   target: CacheFormats | None = None, *, draft: CacheFormats | None = None,
                   include_draft: bool = True, device: torch.device | str = "cpu") -> "Arena":
        return cls(PageLayout.for_preset(preset, target, draft, include_draft), num_blocks,
                   device)

    @classmethod
    def sized(cls, layout: PageLayout, nbytes: int,
              device: torch.device | str = "cpu") -> "Arena":
        """As many pages as fit in `nbytes` (the pool is sized in bytes, not tokens)."""
        n = blocks_in(layout, nbytes)
        if n < 1:
            raise ArenaError(f"{nbytes} bytes hold no page of {layout.page_bytes} bytes")
        return cls(layout, n, device)

    def _typed_view(self, seg: Segment) -> torch.Tensor:
        f = seg.field
        item = torch.empty((), dtype=f.dtype).element_size()
        # page_bytes and offsets are multiples of the alignment, hence of every item size.
        return self.buffer.view(f.dtype).as_strided(
            (self.num_blocks, *f.shape), (self.layout.page_bytes // item,
                                          *_contiguous_strides(f.shape)), seg.offset // item)

    # -- views ----------------------------------------------------------------------------------

    def layer(self, space: str, row: int) -> dict[str, torch.Tensor]:
        """Views [num_blocks, *field.shape] of one layer row, keyed by declared field name."""
        self.layout.layer_segments(space, row)  # names an unknown space or row
        return dict(self._views[space, row])

    def view(self, space: str, row: int, field: str) -> torch.Tensor:
        views = self.layer(space, row)
        if field not in views:
            raise ArenaError(f"row space {space!r} declares no field {field!r} (declared: "
                             f"{', '.join(views)})")
        return views[field]

    # -- free-block bookkeeping -----------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return int(self._free.sum())

    def is_free(self, block: int) -> bool:
        return bool(self._free[self.check_blocks([block])[0]])

    def free_blocks(self) -> list[int]:
        return np.flatnonzero(self._free).tolist()

    def check_blocks(self, blocks: Iterable[int] | torch.Tensor, *,
                     state: str | None = None) -> np.ndarray:
        """Validate block ids (integers, in range, distinct, optionally all 'free' or all
        'allocated'); return them as int64. Raises ArenaError naming the first bad id."""
        few = (blocks.tolist() if isinstance(blocks, np.ndarray) and blocks.ndim == 1
               and blocks.dtype.kind in "iu" and blocks.size <= SMALL_SET else blocks)
        if isinstance(few, (list, tuple)) and self._few_ids_ok(few, state):
            return np.array(few, dtype=np.int64)
        if isinstance(blocks, torch.Tensor):
            if blocks.dtype.is_floating_point or blocks.dtype.is_complex \
                    or blocks.dtype == torch.bool:
                raise ArenaError(f"block ids must be integers, got a {blocks.dtype} tensor")
            ids = blocks.detach().flatten().cpu().numpy().astype(np.int64)
        elif isinstance(blocks, np.ndarray) and blocks.dtype.kind in "iu":
            flat = blocks.ravel()
            if flat.dtype.kind == "u" and flat.size and flat.max() >= self.num_blocks:
                raise self._out_of_range(int(flat[flat >= self.num_blocks][0]))  # before int64
            ids = flat.astype(np.int64)
        else:
            items = list(blocks)
            if not all(type(b) is int for b in items):  # the fast check; the loop names the bad id
                for b in items:
                    if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
                        raise ArenaError(f"block id {b!r} is not an integer")
            try:
                ids = np.asarray(items, dtype=np.int64)
            except OverflowError:  # beyond int64: name it rather than fail in numpy
                raise self._out_of_range(next(int(b) for b in items
                                              if not -2**63 <= int(b) < 2**63)) from None
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise self._out_of_range(int(bad[0]))
        if ids.size > 1:
            ordered = np.sort(ids)
            twice = ordered[1:][ordered[1:] == ordered[:-1]]
            if twice.size:
                raise ArenaError(f"block {int(twice[0])} appears more than once")
        if state == "free":
            self._require_free(ids)
        elif state == "allocated":
            idle = ids[self._free[ids]]
            if idle.size:
                raise ArenaError(f"block {int(idle[0])} is not allocated: it holds no page")
        elif state is not None:
            raise ArenaError(f"state must be 'free', 'allocated' or None, got {state!r}")
        return ids

    def _out_of_range(self, block: int) -> ArenaError:
        return ArenaError(f"block {block} is out of range: the arena has {self.num_blocks} "
                          f"blocks (0..{self.num_blocks - 1})")

    def _few_ids_ok(self, items: Sequence[Any], state: str | None) -> bool:
        """Whether a short list of ids passes every check of `check_blocks`, on Python ints:
        its array passes cost about 10 us of host time, a third of a one-page copy. Only
        accepts; anything else goes the array way, which names the first bad id."""
        if len(items) > SMALL_SET or not all(type(b) is int for b in items):
            return False
        n, free = self.num_blocks, self._free
        if not all(0 <= b < n for b in items) or len(set(items)) != len(items):
            return False
        if state is None:
            return True
        want = state == "free"
        return state in ("free", "allocated") and all(free.item(b) is want for b in items)

    def pick_free(self, n: int) -> np.ndarray:
        """The `n` lowest free block ids, without allocating them."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ArenaError(f"block count must be a non-negative integer, got {n!r}")
        free = np.flatnonzero(self._free)
        if free.size < n:
            raise ArenaError(f"not enough free blocks: {n} requested, {free.size} free of "
                             f"{self.num_blocks}")
        return free[:n].astype(np.int64)

    def allocate(self, n: int) -> list[int]:
        """Allocate the `n` lowest free blocks."""
        ids = self.pick_free(n)
        self._free[ids] = False
        return ids.tolist()

    def claim(self, blocks: Iterable[int] | torch.Tensor) -> list[int]:
        """Allocate exactly these blocks; all must be free (nothing changes otherwise)."""
        ids = self.check_blocks(blocks, state="free")
        self._free[ids] = False
        return ids.tolist()

    def claim_free(self, ids: np.ndarray) -> list[int]:
        """`claim` of ids that `check_blocks(..., state="free")` returned, with only their
        state checked again: a large restore validates its targets while its copy runs, and
        the full check again after it costs 20 us of host time on the H200's host."""
        self._require_free(ids)
        self._free[ids] = False
        return ids.tolist()

    def _require_free(self, ids: np.ndarray) -> None:
        """Raise ArenaError naming the first of `ids` (valid block ids) that is allocated."""
        busy = ids[~self._free[ids]]
        if busy.size:
            raise ArenaError(f"block {int(busy[0])} is busy (allocated); only free blocks "
                             "can be written")

    def free(self, blocks: Iterable[int] | torch.Tensor) -> None:
        """Return allocated blocks; freeing a free block is an error (nothing changes)."""
        ids = self.check_blocks(blocks, state="allocated")
        self._free[ids] = True
