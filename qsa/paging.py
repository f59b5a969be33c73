"""Paged-batch metadata shared by the reference and the kernels.

A batch is ragged twice: every request has its own context length and its own number of query
rows. Rows are stored request-major (`query_start` is the CSR offset array), and every logical
page of a request maps to a physical block through `block_table`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class BatchError(ValueError):
    """Inconsistent batch metadata; the message names the field."""


@dataclass(frozen=True)
class PagedBatch:
    block_table: torch.Tensor  # [batch, max_blocks] int32, -1 where unused
    context_lens: torch.Tensor  # [batch] int32, tokens including this pass
    query_start: torch.Tensor  # [batch + 1] int32, CSR offsets of query rows
    positions: torch.Tensor  # [rows] int32, 0-based position of each query row
    block_size: int

    @property
    def batch(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def row_request(self) -> torch.Tensor:
        """Request index of each query row, [rows] int32."""
        counts = (self.query_start[1:] - self.query_start[:-1]).long()
        return torch.repeat_interleave(
            torch.arange(self.batch, device=counts.device), counts).to(torch.int32)

    @property
    def rows_per_request(self) -> torch.Tensor:
        return (self.query_start[1:] - self.query_start[:-1]).to(torch.int32)

    @property
    def max_context(self) -> int:
        return int(self.context_lens.max().item()) if self.batch else 0

    def validate(self, num_blocks: int) -> "PagedBatch":
        """Check every invariant the kernels rely on; raise BatchError naming the field."""
        bt, cl, qs, pos = self.block_table, self.context_lens, self.query_start, self.positions
        for name, t, nd in (("block_table", bt, 2), ("context_lens", cl, 1),
                            ("query_start", qs, 1), ("positions", pos, 1)):
            if t.dtype != torch.int32:
                raise BatchError(f"{name}: dtype must be int32, got {t.dtype}")
            if t.dim() != nd:
                raise BatchError(f"{name}: must have {nd} dims, got shape {tuple(t.shape)}")
        if bt.shape[0] != cl.shape[0]:
            raise BatchError(f"block_table: {bt.shape[0]} rows for {cl.shape[0]} requests")
        if qs.shape[0] != cl.shape[0] + 1:
            raise BatchError(f"query_start: needs batch + 1 = {cl.shape[0] + 1} entries, "
                             f"got {qs.shape[0]}")
        if self.block_size % 4 or self.block_size <= 0:
            raise BatchError(f"block_size: must be a positive multiple of 4, got {self.block_size}")
        if int(qs[0]) != 0 or int(qs[-1]) != pos.shape[0] or bool((qs[1:] < qs[:-1]).any()):
            raise BatchError("query_start: must start at 0, be non-decreasing and end at the "
                             f"row count {pos.shape[0]}")
        if bool((cl < 0).any()):
            raise BatchError("context_lens: negative length")
        need = (cl.long() + self.block_size - 1) // self.block_size
        if bool((need > bt.shape[1]).any()):
            raise BatchError(f"block_table: {bt.shape[1]} columns, a context needs "
                             f"{int(need.max())} pages")
        cols = torch.arange(bt.shape[1], device=bt.device)
        used = cols[None, :] < need[:, None]
        ids = bt[used]
        if bool(((ids < 0) | (ids >= num_blocks)).any()):
            bad = int(ids[(ids < 0) | (ids >= num_blocks)][0])
            raise BatchError(f"block_table: block id {bad} is outside the pool of {num_blocks} "
                             "blocks")
        if ids.numel() != torch.unique(ids).numel():
            raise BatchError("block_table: a physical block is used twice")
        rr = self.row_request.long()
        if bool((pos < 0).any()) or bool((pos >= cl[rr]).any()):
            raise BatchError("positions: a query row's position is outside its request's context")
        return self

    def slots(self, request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Physical token slot (block * block_size + offset) of (request, position) pairs."""
        b = self.block_table[request.long(), (position // self.block_size).long()].long()
        return b * self.block_size + (position % self.block_size).long()

    def to(self, device: torch.device | str) -> "PagedBatch":
        return PagedBatch(self.block_table.to(device), self.context_lens.to(device),
                          self.query_start.to(device), self.positions.to(device), self.block_size)
