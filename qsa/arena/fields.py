"""Field declarations of the paged cache: the single source of truth (spec section 5).

Binding a layer's views, sizing the pool, building test caches and offloading pages all read
`declare_fields` / `declare_row_spaces`. There is no second list: a hand-kept copy of this list
that forgot the scale planes and the draft rows is the bug this module exists to prevent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from qsa.formats import (FP8_DTYPES, FormatError, check_index_format, check_kv_format,
                         index_layout, kv_layout)
from qsa.presets import ModelPreset


@dataclass(frozen=True)
class FieldSpec:
    """One per-block field: `shape` is per block (leading dim tokens or groups of the block)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class CacheFormats:
    """Storage formats of one row space's caches."""

    kv: str = "bf16"
    index: str = "bf16"
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    multimodal: bool = False

    def __post_init__(self) -> None:
        check_kv_format(self.kv)
        check_index_format(self.index)
        if self.fp8_dtype not in FP8_DTYPES:
            raise FormatError(f"fp8_dtype: {self.fp8_dtype} is not an FP8 E4M3 dtype")


KV_CODE_FIELDS: tuple[str, ...] = ("k", "v")  # FP8 adds "<name>_scale" for each


def kv_field_names(fields: "Iterable[FieldSpec] | Mapping[str, object]") -> tuple[str, ...]:
    """The K/V fields (codes and their scale planes) among declared fields or a bound cache."""
    names = [f if isinstance(f, str) else f.name for f in fields]
    return tuple(n for n in names if n.removesuffix("_scale") in KV_CODE_FIELDS)


def declare_fields(preset: ModelPreset, formats: CacheFormats) -> tuple[FieldSpec, ...]:
    """Fields of one QSA layer row, in stored order."""
    b, g = preset.block_size, preset.groups_per_block
    hkv = preset.num_kv_heads
    kvl = kv_layout(formats.kv, preset.head_dim, formats.fp8_dtype)
    idx = index_layout(formats.index, preset.index_dim, formats.fp8_dtype)
    fields = [FieldSpec(n, (b, hkv, *kvl.code_shape), kvl.code_dtype) for n in KV_CODE_FIELDS]
    if kvl.scale_dtype is not None:
        fields += [FieldSpec(f"{n}_scale", (b, hkv, *kvl.scale_shape), kvl.scale_dtype)
                   for n in KV_CODE_FIELDS]
    fields.append(FieldSpec("index_raw", (b, 1, preset.index_dim), torch.bfloat16))
    fields.append(FieldSpec("index_compressed", (g, 1, *idx.code_shape), idx.code_dtype))
    if idx.scale_dtype is not None:
        fields.append(FieldSpec("index_compressed_scale", (g, 1, *idx.scale_shape),
                                idx.scale_dtype))
    if formats.multimodal:
        fields.append(FieldSpec("rope_positions", (b, 1, 3), torch.int64))
    return tuple(fields)


@dataclass(frozen=True)
class RowSpace:
    """A named set of rows (one per layer) sharing one field declaration."""

    name: str
    rows: int
    formats: CacheFormats
    fields: tuple[FieldSpec, ...]

    @property
    def bytes_per_row(self) -> int:
        return sum(f.nbytes for f in self.fields)


def declare_row_spaces(preset: ModelPreset, target: CacheFormats,
                       draft: CacheFormats | None = None,
                       include_draft: bool = True) -> tuple[RowSpace, ...]:
    """Row spaces `qsa` (one row per target QSA layer) and `qsa_draft` (the MTP draft layer).

    The draft keeps BF16 caches by default even when the target is quantized: an FP8 draft KV
    lowers the speculative acceptance length, a BF16 one does not.
    """
    spaces = [RowSpace("qsa", len(preset.qsa_layers), target, declare_fields(preset, target))]
    if include_draft and preset.draft_layers > 0:
        d = draft if draft is not None else CacheFormats(
            kv="bf16", index="bf16", fp8_dtype=target.fp8_dtype, multimodal=target.multimodal)
        spaces.append(RowSpace("qsa_draft", preset.draft_layers, d, declare_fields(preset, d)))
    return tuple(spaces)


def allocate_layer(fields: tuple[FieldSpec, ...], num_blocks: int,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Standalone tensors [num_blocks, *shape] for one layer row (tests, cases, references).

    The arena binds views of one allocation instead; both follow the same declaration.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return {f.name: torch.empty((num_blocks, *f.shape), dtype=f.dtype, device=device)
            for f in fields}
