"""Model presets: the dimensions every kernel, test and benchmark reads.

Presets are frozen, validated data. Kernels never hard-code a dimension; they take it from a
preset (or from tensor shapes that a preset produced), so other head counts, index heads 1-8,
rows per request 1-8 and head dims 64-256 are ordinary parameters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class ShapeError(ValueError):
    """A preset or shape is invalid; the message names the offending field."""


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ShapeError(f"{field}: {message}")


@dataclass(frozen=True)
class ModelPreset:
    """Dimensions of one QSA model at one tensor-parallel degree (spec section 1)."""

    name: str
    num_layers: int = 48
    qsa_layer_period: int = 4
    num_q_heads: int = 24
    num_kv_heads: int = 2
    head_dim: int = 256
    index_heads: int = 4
    index_dim: int = 128
    compress_ratio: int = 4
    topk_groups: int = 512
    block_size: int = 64
    max_context: int = 262_144
    mtp_draft_tokens: int = 3
    draft_layers: int = 1
    rope_dims: int = 64
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int):
                _require(isinstance(v, int) and not isinstance(v, bool), f.name,
                         f"must be an integer, got {v!r}")
        _require(bool(self.name), "name", "must not be empty")
        _require(self.num_layers >= 1, "num_layers", f"must be >= 1, got {self.num_layers}")
        _require(1 <= self.qsa_layer_period <= self.num_layers, "qsa_layer_period",
                 f"must be in 1..num_layers, got {self.qsa_layer_period}")
        _require(self.num_kv_heads >= 1, "num_kv_heads", f"must be >= 1, got {self.num_kv_heads}")
        _require(self.num_q_heads >= 1 and self.num_q_heads % self.num_kv_heads == 0,
                 "num_q_heads", f"{self.num_q_heads} is not divisible by num_kv_heads "
                 f"{self.num_kv_heads}")
        _require(64 <= self.head_dim <= 256 and _pow2(self.head_dim), "head_dim",
                 f"must be a power of two in 64..256, got {self.head_dim}")
        _require(1 <= self.index_heads <= 8, "index_heads", f"must be in 1..8, got {self.index_heads}")
        _require(self.index_dim >= 32 and self.index_dim % 32 == 0 and _pow2(self.index_dim),
                 "index_dim", f"must be a power of two and a multiple of 32 (one MXFP4 "
                 f"scale group), got {self.index_dim}")
        _require(self.compress_ratio == 4, "compress_ratio",
                 f"QSA groups are 4 tokens; got {self.compress_ratio}")
        _require(self.topk_groups >= 1, "topk_groups", f"must be >= 1, got {self.topk_groups}")
        _require(self.block_size >= self.compress_ratio
                 and self.block_size % self.compress_ratio == 0, "block_size",
                 f"must be a positive multiple of {self.compress_ratio}, got {self.block_size}")
        _require(self.max_context >= self.block_size, "max_context",
                 f"must be >= block_size, got {self.max_context}")
        _require(0 <= self.mtp_draft_tokens <= 7, "mtp_draft_tokens",
                 f"must be in 0..7 (rows per request 1..8), got {self.mtp_draft_tokens}")
        _require(self.draft_layers >= 0, "draft_layers", f"must be >= 0, got {self.draft_layers}")
        _require(0 < self.rope_dims <= self.index_dim and self.rope_dims % 2 == 0, "rope_dims",
                 f"must be even and in 2..index_dim, got {self.rope_dims}")
        _require(math.isfinite(self.rope_theta) and self.rope_theta > 1, "rope_theta",
                 f"must be a finite number > 1, got {self.rope_theta}")
        _require(math.isfinite(self.rms_eps) and self.rms_eps > 0, "rms_eps",
                 f"must be a finite number > 0, got {self.rms_eps}")
        _require(self.tensor_parallel >= 1, "tensor_parallel",
                 f"must be >= 1, got {self.tensor_parallel}")

    # Derived quantities: computed, never stored, so they can not disagree with the fields.
    @property
    def qsa_layers(self) -> tuple[int, ...]:
        """Layer indices of the QSA layers (3, 7, ..., 47 for the default preset)."""
        p = self.qsa_layer_period
        return tuple(range(p - 1, self.num_layers, p))

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def rows_per_verify(self) -> int:
        """Query rows per request in a target verify step (the token plus its drafts)."""
        return self.mtp_draft_tokens + 1

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def index_scale(self) -> float:
        return self.index_dim ** -0.5

    @property
    def token_budget(self) -> int:
        return self.topk_groups * self.compress_ratio

    @property
    def expand_width(self) -> int:
        """Width of an expanded selection: the budget plus the longest incomplete tail."""
        return self.token_budget + self.compress_ratio - 1

    @property
    def groups_per_block(self) -> int:
        return self.block_size // self.compress_ratio

    def replace(self, **changes: Any) -> "ModelPreset":
        """A validated copy with some fields changed (unknown names are an error)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ShapeError(f"{unknown[0]}: not a preset field (known: {', '.join(sorted(known))})")
        return dataclasses.replace(self, **changes)

    def tensor_parallel_shard(self, degree: int) -> "ModelPreset":
        """The per-GPU preset at `degree`-way tensor parallel: attention heads split,
        the small indexer (one shared index key) replicated."""
        _require(isinstance(degree, int) and degree >= 1, "tensor_parallel",
                 f"must be a positive integer, got {degree!r}")
        _require(self.num_kv_heads % degree == 0, "tensor_parallel",
                 f"num_kv_heads {self.num_kv_heads} is not divisible by {degree}")
        return self.replace(
            name=f"{self.name}-tp{degree * self.tensor_parallel}",
            num_q_heads=self.num_q_heads // degree,
            num_kv_heads=self.num_kv_heads // degree,
            tensor_parallel=self.tensor_parallel * degree,
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


QWEN38_FLASH_NEXT = ModelPreset(name="qwen3.8-flash-next")

PRESETS: dict[str, ModelPreset] = {
    p.name: p for p in (QWEN38_FLASH_NEXT, QWEN38_FLASH_NEXT.tensor_parallel_shard(2))
}
DEFAULT_PRESET = QWEN38_FLASH_NEXT.name


def get_preset(name: str = DEFAULT_PRESET, **overrides: Any) -> ModelPreset:
    """Look up a preset by name, optionally with validated field overrides."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise ShapeError(f"preset: unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
    return preset.replace(**overrides) if overrides else preset


def as_preset(preset: "str | ModelPreset") -> ModelPreset:
    """A preset given by name or as an object (tests and notebooks pass custom ones)."""
    return preset if isinstance(preset, ModelPreset) else get_preset(preset)
