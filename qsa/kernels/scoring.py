"""Index scoring entry points: the decode dispatcher and the three scorers.

* `score_decode`: decode/verify-sized calls (at most 256 rows). The stacked scorer
  (`score_stacked`: a request's rows x heads in one MMA operand, keys read once per request) is
  the default; QSA_STACKED_DECODE_SCORER=0 in the environment, read at every call, selects the
  row-wise baseline (`score_rowwise`) for A/B runs and as an escape hatch.
* `score_prefill`: many rows per request, matrix-core tiles, causal tile skipping.

All three read BF16, FP8 (+FP32 row scale) and MXFP4 (E2M1 + E8M0) keys through the shared tile
helpers of `qsa.kernels.index_tiles`, whose docstring says which dtypes feed the matrix unit
and why: bf16 for BF16 keys; in decode fp16 for FP8 and MXFP4 keys (both decode into it exactly
and cheaply); in prefill bf16 tiles with the MXFP4 exponents applied, decoded once per tile.
"""

from __future__ import annotations

import torch

from qsa.configs import BlockConfig
from qsa.kernels.index_tiles import env_flag
from qsa.kernels.score_prefill import score_prefill
from qsa.kernels.score_rowwise import score_rowwise
from qsa.kernels.score_stacked import score_stacked
from qsa.paging import PagedBatch
from qsa.presets import ModelPreset

STACKED_ENV = "QSA_STACKED_DECODE_SCORER"

__all__ = ["STACKED_ENV", "score_decode", "score_prefill", "score_rowwise", "score_stacked",
           "stacked_decode_enabled"]


def stacked_decode_enabled() -> bool:
    """Whether `score_decode` runs the stacked scorer (the default)."""
    return env_flag(STACKED_ENV, True)


def score_decode(cache: dict[str, torch.Tensor], batch: PagedBatch, q_index: torch.Tensor,
                 preset: ModelPreset, index_format: str, *,
                 head_weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 max_rows_per_request: int | None = None,
                 config: BlockConfig | None = None) -> torch.Tensor:
    """Scores [rows, max_ctx // 4] FP32 of a decode-sized call by the selected decode scorer.

    `config`, if given, is for the selected kernel; `max_rows_per_request` only matters to the
    stacked scorer (the row-wise one needs no row-count hint).
    """
    if stacked_decode_enabled():
        return score_stacked(cache, batch, q_index, preset, index_format,
                             head_weights=head_weights, out=out,
                             max_rows_per_request=max_rows_per_request, config=config)
    return score_rowwise(cache, batch, q_index, preset, index_format, head_weights=head_weights,
                         out=out, config=config)
