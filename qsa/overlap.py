"""How much neighbouring query rows' selections overlap: the measure, and the correlated row
process that gives inputs a chosen overlap.

Why it matters: whether a K/V tile can be shared between the rows of a block (sparse GQA's
shared path), and so what one QSA step costs, depends on it. Independent random rows share
almost nothing; the real model's neighbouring prefill rows share 87-94 % of their groups
(public vLLM measurements, shared/notes/anchors.md section 10). Every measured point records
both the overlap it asked for and the overlap its own inputs have.

The measure: the mean Jaccard index of the selected groups of neighbouring rows of one
request (a row's complete groups, `id // 4` of its ids below `4 * visible`), and the union
ratio: the tokens a block of `per` consecutive rows reads together over one row's tokens
(1 when the rows select alike, `per` when they share nothing).

The process: a row's random draw is an AR(1) sequence along the rows of its request,
x_i = rho x_{i-1} + sqrt(1 - rho^2) e_i, so neighbours correlate by rho and distant rows
decorrelate, as a prefill chunk's rows do; rho is found by bisection on the measured Jaccard
(`calibrate`), never assumed. rho = 0 leaves the draws as they were (independent rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from qsa.paging import PagedBatch

AR_CHUNK = 128  # rows filtered at a time by one triangular matrix
CALIBRATE_TOL = 0.005  # Jaccard distance to the target at which the bisection stops
CALIBRATE_STEPS = 30
ROW_CHUNK = 512  # rows whose distinct counts are sorted at a time (bounds the temporaries)


class OverlapError(ValueError):
    """An overlap target the inputs can not reach, or one outside [0, 1)."""


@dataclass(frozen=True)
class Overlap:
    """What a selection measures: `jaccard` (mean over neighbouring row pairs of a request;
    NaN with no pair), `union_ratio` at `per` rows per block (NaN with no id)."""

    jaccard: float
    union_ratio: float
    per: int

    def as_record(self, target: float | None) -> dict[str, float | int | None]:
        return {"overlap_target": target, "overlap_measured": self.jaccard,
                "union_ratio": self.union_ratio, "union_rows": self.per}


def check_target(target: float) -> float:
    if not (isinstance(target, (int, float)) and 0.0 <= float(target) < 1.0):
        raise OverlapError(f"overlap: the target mean Jaccard must be in [0, 1), got {target!r}")
    return float(target)


def _distinct(x: torch.Tensor) -> torch.Tensor:
    """Distinct non-negative values per row of x [rows, n] (negative: padding)."""
    s = x.sort(dim=1).values
    new = s >= 0
    new[:, 1:] &= s[:, 1:] != s[:, :-1]
    return new.sum(1)


def selected_groups(ids: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """Each row's complete selected groups (`id // 4` of its ids below 4 * visible, repeats
    kept), -1 elsewhere: what the indexer's top-k chose, without the tail tokens."""
    pos = batch.positions.to(ids.device).long()
    ctx = batch.context_lens.to(ids.device).long()[batch.row_request.to(ids.device).long()]
    visible = torch.minimum((pos + 1) // 4, ctx // 4)
    ids = ids.long()
    return torch.where((ids >= 0) & (ids < 4 * visible[:, None]), ids // 4, -1)


def neighbour_jaccard(groups: torch.Tensor, batch: PagedBatch) -> float:
    """Mean Jaccard index of the groups of consecutive rows of one request (`groups`
    [rows, n], -1 padded, repeats allowed); NaN when no pair has a group."""
    req = batch.row_request.to(groups.device)
    pairs = torch.nonzero(req[1:] == req[:-1]).flatten()
    total, count = 0.0, 0
    for at in range(0, pairs.numel(), ROW_CHUNK):
        i = pairs[at:at + ROW_CHUNK]
        a, b = groups[i], groups[i + 1]
        union = _distinct(torch.cat([a, b], dim=1))
        inter = _distinct(a) + _distinct(b) - union
        keep = union > 0
        total += float((inter[keep].double() / union[keep].double()).sum())
        count += int(keep.sum())
    return total / count if count else math.nan


def union_ratio(ids: torch.Tensor, batch: PagedBatch, per: int) -> float:
    """Tokens a block of `per` consecutive rows reads together (its requests' distinct ids)
    over one row's, across the call: per x sum of block unions / sum of row id counts."""
    rows = ids.shape[0]
    req = batch.row_request.to(ids.device).long()
    block = torch.arange(rows, device=ids.device) // per
    valid = ids >= 0
    span = int(ids.max()) + 1 if bool(valid.any()) else 1
    own = torch.unique((torch.arange(rows, device=ids.device)[:, None] * span + ids)[valid])
    if own.numel() == 0:
        return math.nan
    keys = ((block * (int(req.max()) + 1) + req)[:, None] * span + ids.long())[valid]
    return per * torch.unique(keys).numel() / own.numel()


def measure(ids: torch.Tensor, batch: PagedBatch, per: int) -> Overlap:
    """Jaccard of neighbouring rows and the union ratio at `per` rows of expanded ids."""
    return Overlap(neighbour_jaccard(selected_groups(ids, batch), batch),
                   union_ratio(ids, batch, per), per)


def row_index(batch: PagedBatch) -> torch.Tensor:
    """Each row's index among its request's rows."""
    qs = batch.query_start.to(batch.positions.device).long()
    rows = torch.arange(batch.num_rows, device=qs.device)
    return rows - qs[batch.row_request.to(qs.device).long()]


def correlate_rows(noise: torch.Tensor, batch: PagedBatch, rho: float) -> torch.Tensor:
    """The AR(1) sequence along each request's rows (module docstring) from i.i.d. draws
    `noise` [rows, ...]: unit variance, neighbour correlation rho; rho 0 returns the draws."""
    if rho == 0.0:
        return noise
    dev = noise.device
    local = row_index(batch).to(dev)
    first = (local == 0).to(noise.dtype).view(-1, *[1] * (noise.dim() - 1))
    # x_i = rho x_{i-1} + b e_i (b e_0 -> e_0 at a request's first row: unit variance there)
    drive = noise * (first + (1 - first) * math.sqrt(1 - rho * rho))
    flat = drive.reshape(noise.shape[0], -1)
    out = torch.empty_like(flat)
    t = torch.arange(AR_CHUNK, device=dev, dtype=noise.dtype)
    tri = torch.tril(rho ** (t[:, None] - t[None, :]).clamp(min=0))
    carry = torch.zeros(flat.shape[1], device=dev, dtype=noise.dtype)
    starts = local == 0
    for at in range(0, flat.shape[0], AR_CHUNK):
        n = min(AR_CHUNK, flat.shape[0] - at)
        block = flat[at:at + n]
        # a request starting inside the chunk cuts the recurrence: filter segment by segment
        cuts = [0, *(torch.nonzero(starts[at + 1:at + n]).flatten() + 1).tolist(), n]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            m = hi - lo
            c = carry if not bool(starts[at + lo]) else torch.zeros_like(carry)
            seg = tri[:m, :m] @ block[lo:hi] + (rho ** (t[:m] + 1))[:, None] * c
            out[at + lo:at + hi] = seg
            carry = seg[-1]
    return out.reshape(noise.shape)


def calibrate(target: float, jaccard_at: Callable[[float], float],
              what: str = "the inputs") -> tuple[float, float]:
    """The rho whose measured Jaccard is within CALIBRATE_TOL of `target`, by bisection
    (Jaccard grows with rho), and that Jaccard. Target 0 means independent rows: rho 0,
    whatever they measure. A target below what independent rows already give is refused; one
    that few rows can not hit within the tolerance gets the closest found (callers record the
    measured value beside the target)."""
    target = check_target(target)
    if target == 0.0:
        return 0.0, jaccard_at(0.0)
    lo, hi = 0.0, 1.0
    j_lo = jaccard_at(0.0)
    if j_lo > target + CALIBRATE_TOL:
        raise OverlapError(f"overlap: {what} give a Jaccard of {j_lo:.3f} with independent rows, "
                           f"above the target {target}: use 0 for independent rows")
    best = (0.0, j_lo)
    for _ in range(CALIBRATE_STEPS):
        rho = (lo + hi) / 2
        j = jaccard_at(rho)
        if abs(j - target) < abs(best[1] - target):
            best = (rho, j)
        if abs(j - target) <= CALIBRATE_TOL:
            return rho, j
        lo, hi = (rho, hi) if j < target else (lo, rho)
    return best  # few rows measure coarsely: the closest, recorded beside the target
