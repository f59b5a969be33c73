"""How a prepared point is checked against its reference, and how its inputs are copied so that
every timed call sees a cold last-level cache: the parts every op's input builder
(`qsa.workbench.registry`) shares."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qsa.measure.timing import sets_for_cold_cache
from qsa.measure.work import Work

if TYPE_CHECKING:
    from qsa.measure.device import DeviceInfo

MAX_ROTATION_BYTES = 24 << 30  # memory allowed for one point's rotated input copies
# Share of the free device memory that the rotated copies of points held together (a whole step,
# replayed as one graph) may take between them; the rest holds references, outputs and graphs.
HELD_TOGETHER_FRACTION = 0.5
SAME_VALUES_CHUNK = 1 << 26  # elements compared at a time: 256 MiB of fp32 per side

# False while a point is prepared only to be verified: one input set, no rotated copies (a
# memory-checker run of a tiny shape would otherwise clone its inputs thousands of times).
ROTATE: ContextVar[bool] = ContextVar("qsa_rotate_inputs", default=True)


@dataclass
class RotationBudget:
    """Memory that the input sets of several points held at once share. Each point, built in
    turn, takes at most an even share of what is left, so one that needs few copies leaves its
    share to those built after it."""

    bytes_left: int
    points_left: int

    def share(self) -> int:
        return self.bytes_left // max(self.points_left, 1)

    def take(self, nbytes: int) -> None:
        self.bytes_left -= nbytes
        self.points_left -= 1


_BUDGET: ContextVar[RotationBudget | None] = ContextVar("qsa_rotation_budget", default=None)


@contextlib.contextmanager
def held_together(points: int, free_bytes: int | None = None,
                  fraction: float = HELD_TOGETHER_FRACTION) -> Iterator[RotationBudget | None]:
    """Points prepared inside share `fraction` of `free_bytes` (by default the GPU memory free
    now) for their input sets: a step at batch 32 x 32K built every op's copies up to the
    per-point cap and did not fit an 80 GB card. Without a GPU nothing is rotated and there
    is no budget."""
    if points < 1 or not 0 < fraction <= 1 or (free_bytes is not None and free_bytes < 0):
        raise ValueError(f"held_together: points must be >= 1, fraction in (0, 1] and "
                         f"free_bytes >= 0, got {points}, {fraction} and {free_bytes}")
    if free_bytes is None and torch.cuda.is_available():
        gc.collect()  # inputs of points measured before, unreachable but not yet collected
        # Blocks the caching allocator holds but no tensor uses are free to these copies too.
        free_bytes = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - \
            torch.cuda.memory_allocated()
    budget = None if free_bytes is None else RotationBudget(int(free_bytes * fraction), points)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


class VerificationError(AssertionError):
    """A kernel's output disagrees with the reference: the point is not timed."""


def interpreting(device: str) -> bool:
    return device == "cpu"


def kernel_view(t: torch.Tensor, device: str) -> torch.Tensor:
    """bf16 tensors reach interpreted kernels as fp32: the interpreter mishandles bf16."""
    return t.float() if interpreting(device) and t.dtype == torch.bfloat16 else t


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rotation_sets(base: dict[str, torch.Tensor], work: Work, dev: DeviceInfo
                  ) -> list[dict[str, torch.Tensor]]:
    """Copies of the tensors an op reads, enough that cycling through them exceeds three times
    the last-level cache (one set on the CPU, where times mean nothing, and when verifying),
    within the per-point cap and the share of a `held_together` budget. The timing's cache
    policy (`rotate_<MiB>MiB_x<sets>`) records how many there were."""
    n, budget, size = 1, _BUDGET.get(), max(nbytes(base), 1)
    if dev.is_gpu and ROTATE.get():
        cap = MAX_ROTATION_BYTES if budget is None else min(MAX_ROTATION_BYTES, budget.share())
        n = max(1, min(sets_for_cold_cache(max(work.bytes_moved, 1), dev.llc_bytes),
                       cap // size))
    if budget is not None:
        budget.take(n * size)
    return [base] + [{k: v.clone() for k, v in base.items()} for _ in range(n - 1)]


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float
                 ) -> None:
    """Same infinities, NaN (poison) exactly where the reference has it (slots the call must
    not write), and |got - want| <= atol + rtol * |want| elsewhere."""
    got, want = got.float().cpu(), want.float().cpu()
    if got.shape != want.shape:
        raise VerificationError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        raise VerificationError(f"{name}: {int((nan_g & ~nan_w).sum())} unwritten (poisoned) "
                                f"elements, {int((nan_w & ~nan_g).sum())} written where nothing "
                                "should be")
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
        raise VerificationError(f"{name}: infinite entries differ from the reference")
    fin = ~inf_w & ~nan_w
    g, w = got[fin], want[fin]
    excess = (g - w).abs() - (atol + rtol * w.abs())
    if (excess > 0).any():
        i = int(torch.argmax(excess))
        raise VerificationError(f"{name}: error {float((g[i] - w[i]).abs()):.3g} exceeds the "
                                f"tolerance at element {i} (got {float(g[i]):.6g}, want "
                                f"{float(w[i]):.6g})")


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-for-bit by value: -0 equals +0, and poison (NaN) left where the reference has it
    too, i.e. in slots the call must not write, counts as equal. Compared where the tensors
    are, a chunk at a time: a whole cache plane copied to the host as fp32 (the K/V store's
    check compares every plane of the arena) took seconds per verified candidate."""
    if got.dtype != want.dtype:  # an fp32 surrogate of a bf16 field: compare as stored
        got = got.to(want.dtype)
    if got.shape != want.shape:
        return False
    if not want.dtype.is_floating_point:
        return torch.equal(got, want.to(got.device))
    g, w = got.reshape(-1), want.to(got.device).reshape(-1)
    return all(torch.allclose(g[i:i + SAME_VALUES_CHUNK].float(),
                              w[i:i + SAME_VALUES_CHUNK].float(), rtol=0, atol=0, equal_nan=True)
               for i in range(0, g.numel(), SAME_VALUES_CHUNK))


# Under the interpreter, in-kernel fp32 -> fp8 casts drop rounding carries (a code comes out at
# half its value, triton-lang/triton #8322) for a few percent of elements.


def assert_codes_match(name: str, got: torch.Tensor, want: torch.Tensor,
                       max_fraction: float) -> None:
    """Decoded values of the written slots: NaN (poison) where the reference has it, and at
    most `max_fraction` of the elements more than one quantization step (1/8 relative) off."""
    assert_close(name, got, want, atol=float("inf"), rtol=0.0)
    fin = torch.isfinite(want)
    wrong = ((got - want).abs() > 0.13 * want.abs() + 1e-6) & fin
    if float(wrong.sum()) > max_fraction * float(fin.sum()):
        raise VerificationError(f"{name}: {int(wrong.sum())} of {int(fin.sum())} elements differ "
                                "from the reference by more than one step")
