"""Roofline arithmetic: how close a measured time is to the device's measured limits.

Kernels declare `work(shape) -> Work` (bytes that must cross HBM, useful FLOPs); this module turns
a time plus that work into achieved rates and fractions of the ceilings of `measure_ceilings`.
Fractions are taken against *measured* ceilings, so 100% means "as fast as this device streams
or multiplies in practice", not the datasheet.
"""

from __future__ import annotations

from typing import Any, Literal

from qsa.measure.device import Ceilings
from qsa.measure.timing import Timing
from qsa.measure.work import Work


def roofline_fractions(time_us: float, work: Work, ceilings: Ceilings, *,
                       matrix: Literal["bf16", "fp8"] = "bf16",
                       bandwidth: Literal["copy", "read"] = "copy") -> dict[str, Any]:
    """Achieved GB/s and TFLOP/s, their percentages of the ceilings, and the roofline bound.

    bound_us = max(bytes / bandwidth, flops / matrix rate): the shortest time the work allows.
    pct_of_bound = 100 * bound_us / time_us, i.e. how close the kernel is to its roofline.
    """
    if not time_us > 0:
        raise ValueError(f"time_us must be > 0, got {time_us}")
    if bandwidth not in ("copy", "read") or matrix not in ("bf16", "fp8"):
        raise ValueError(f"bandwidth must be 'copy' or 'read' and matrix 'bf16' or 'fp8', "
                         f"got {bandwidth!r}, {matrix!r}")
    gbps = {"copy": ceilings.copy_gbps, "read": ceilings.read_gbps}[bandwidth]
    tflops = {"bf16": ceilings.bf16_tflops, "fp8": ceilings.fp8_tflops}[matrix]
    if tflops is None:
        raise ValueError(f"no {matrix} rate for {ceilings.device_slug}: {ceilings.fp8_note}")
    achieved_gbps = work.bytes_moved / time_us / 1e3
    achieved_tflops = work.flops / time_us / 1e6
    memory_us = work.bytes_moved / gbps / 1e3
    compute_us = work.flops / tflops / 1e6
    bound_us = max(memory_us, compute_us)
    return {"achieved_gbps": achieved_gbps, "achieved_tflops": achieved_tflops,
            "bandwidth_ceiling": bandwidth, "pct_bandwidth": 100 * achieved_gbps / gbps,
            "matrix_ceiling": matrix, "pct_matrix": 100 * achieved_tflops / tflops,
            "bound_us": bound_us, "bound_by": "memory" if memory_us >= compute_us else "compute",
            "pct_of_bound": 100 * bound_us / time_us}


def work_record(work: Work) -> dict[str, Any]:
    """The work columns of a results row."""
    return {"bytes_moved": work.bytes_moved, "flops": work.flops,
            "intensity_flop_per_byte": work.intensity}


_FRACTION_KEYS = ("achieved_gbps", "achieved_tflops", "bandwidth_ceiling", "pct_bandwidth",
                  "matrix_ceiling", "pct_matrix", "bound_us", "bound_by", "pct_of_bound")


def roofline_record(timing: Timing, work: Work, ceilings: Ceilings | None, *,
                    matrix: Literal["bf16", "fp8"] = "bf16",
                    bandwidth: Literal["copy", "read"] = "copy") -> dict[str, Any]:
    """Work plus roofline columns for a results row, against the timing's median.

    Without ceilings (CPU) or for a functional-only timing the fraction columns are None, so
    rows of every device share one schema and no interpreter time passes for a GPU figure.
    """
    row = work_record(work)
    if ceilings is None or timing.functional_only:
        return {**row, **dict.fromkeys(_FRACTION_KEYS)}
    return {**row, **roofline_fractions(timing.median_us, work, ceilings, matrix=matrix,
                                        bandwidth=bandwidth)}
