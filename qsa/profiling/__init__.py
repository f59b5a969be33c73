"""Profiler outputs (kineto, Proton, rocprofv3) normalized to one per-launch record type.

Every reader returns `KernelLaunch` lists (a Proton tree, which stores only totals, returns
`KernelAggregate`), so `summarize` is the one statistics path for all profilers. `capture`
runs a callable under a profiler on a GPU host. Importing this package loads
`triton.profiler` but not torch, which is the safe order for Proton on AMD (see `capture`).
"""

from qsa.profiling.capture import (
    ProfilerConflictError,
    ProfilerUnavailableError,
    capture_backend_available,
    capture_proton,
    capture_torch_profiler,
)
from qsa.profiling.kineto import launches_from_events, launches_from_profiler, parse_kineto_trace, read_kineto_trace
from qsa.profiling.proton import parse_proton_trace, parse_proton_tree, read_proton_trace, read_proton_tree
from qsa.profiling.records import KernelAggregate, KernelLaunch, summarize, to_frame
from qsa.profiling.rocprof import (
    IncompleteProfileWarning,
    read_kernel_trace_csv,
    read_marker_ranges,
    read_rocpd,
    read_rocprof_output,
    roctx_profiler,
    roctx_range,
    roctx_unavailable_reason,
    rocprofv3_command,
)

__all__ = [
    "IncompleteProfileWarning",
    "KernelAggregate",
    "KernelLaunch",
    "ProfilerConflictError",
    "ProfilerUnavailableError",
    "capture_backend_available",
    "capture_proton",
    "capture_torch_profiler",
    "launches_from_events",
    "launches_from_profiler",
    "parse_kineto_trace",
    "parse_proton_trace",
    "parse_proton_tree",
    "read_kernel_trace_csv",
    "read_kineto_trace",
    "read_marker_ranges",
    "read_proton_trace",
    "read_proton_tree",
    "read_rocpd",
    "read_rocprof_output",
    "rocprofv3_command",
    "roctx_profiler",
    "roctx_range",
    "roctx_unavailable_reason",
    "summarize",
    "to_frame",
]
