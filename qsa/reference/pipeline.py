"""One QSA layer pass, end to end, in float32 reference code (spec section 2).

The new tokens of a pass are the query rows: a prefill chunk or a verify step writes its tokens,
then every row scores, selects and attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qsa.paging import PagedBatch
from qsa.presets import ModelPreset
from qsa.reference.attention import sparse_gqa_reference
from qsa.reference.compress import compress_reference, write_raw_keys_reference
from qsa.reference.kv import store_kv_reference
from qsa.reference.score import score_reference
from qsa.reference.topk import topk_expand_reference


@dataclass(frozen=True)
class LayerPassOutput:
    scores: torch.Tensor  # [rows, max_ctx//4]
    token_ids: torch.Tensor  # [rows, expand_width]
    out: torch.Tensor  # [rows, Hq, D] FP32


def row_slots(batch: PagedBatch) -> torch.Tensor:
    """Token slot of every query row (each row is a new token of this pass)."""
    return batch.slots(batch.row_request, batch.positions)


def pass_start_positions(batch: PagedBatch) -> torch.Tensor:
    """First position each request writes in this pass (its context if it has no rows)."""
    start = batch.context_lens.clone()
    rows = batch.rows_per_request
    has = rows > 0
    start[has] = batch.positions[batch.query_start[:-1][has].long()]
    return start


def qsa_layer_reference(cache: dict[str, torch.Tensor], batch: PagedBatch, preset: ModelPreset,
                        *, raw_keys: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q: torch.Tensor, q_index: torch.Tensor, rms_weight: torch.Tensor,
                        index_format: str, kv_format: str,
                        fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> LayerPassOutput:
    slots = row_slots(batch)
    write_raw_keys_reference(cache, slots, raw_keys)
    compress_reference(cache, batch, pass_start_positions(batch), rms_weight, preset,
                       index_format, fp8_dtype)
    store_kv_reference(cache, slots, k, v, kv_format, fp8_dtype)
    scores = score_reference(cache, batch, q_index, preset, index_format)
    ids = topk_expand_reference(scores, batch, preset)
    out = sparse_gqa_reference(q, cache, batch, ids, kv_format, preset.softmax_scale)
    return LayerPassOutput(scores, ids, out)
