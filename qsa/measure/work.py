"""What a kernel call must do: the bytes that cross device memory and the useful FLOPs. Every
kernel module declares its `work(...)`; this leaf module lets it do so without importing the
measurement stack (timing, device model, pandas) that the rooflines need.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Work:
    """Bytes a kernel must move to or from device memory, and the FLOPs it must do."""

    bytes_moved: int
    flops: int

    def __post_init__(self) -> None:
        for name in ("bytes_moved", "flops"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Work.{name} must be an integer >= 0, got {value!r}")

    def __add__(self, other: Work) -> Work:
        """Work of two calls, e.g. the kernels of one decode step."""
        return Work(self.bytes_moved + other.bytes_moved, self.flops + other.flops)

    def __mul__(self, times: int) -> Work:
        """Work of `times` identical calls, e.g. one call per QSA layer."""
        return Work(self.bytes_moved * times, self.flops * times)

    @property
    def intensity(self) -> float:
        """FLOP per byte: compare with the ridge point rate / bandwidth."""
        return self.flops / self.bytes_moved if self.bytes_moved else float("inf")
