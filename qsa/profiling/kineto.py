"""torch.profiler (kineto) output as KernelLaunch records.

Chrome-trace facts this relies on (measured on H200, torch 2.11):
kernel events have `cat == "kernel"`; `ts`/`dur` are µs even when `displayTimeUnit` says "ms";
`pid` is the device and `tid` the stream. `record_function(...)` ranges appear on the device
as `gpu_user_annotation` events, which is how launches get their step region. ROCm kineto
keeps that event shape but its `args` differ, so only name/ts/dur/pid/tid are read.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from qsa.profiling.records import KernelLaunch, RegionIndex, as_int, us_to_ns

SOURCE_TRACE = "kineto"
SOURCE_LIVE = "torch-profiler"
_KERNEL_CAT = "kernel"
_ANNOTATION_CAT = "gpu_user_annotation"


def read_kineto_trace(path: str | Path) -> list[KernelLaunch]:
    """Read a file written by `prof.export_chrome_trace` (plain JSON or .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    try:
        return parse_kineto_trace(trace)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def parse_kineto_trace(trace: Mapping[str, Any] | list[Any]) -> list[KernelLaunch]:
    """Kernel launches of a loaded chrome trace, in start order, with their step regions.

    A launch's region is the innermost `gpu_user_annotation` on the same device that contains
    it in time; launches outside every annotation get region None.
    """
    events = trace["traceEvents"] if isinstance(trace, Mapping) else trace
    if not isinstance(events, list):
        raise ValueError("not a chrome trace: expected a traceEvents list")
    kernels = []
    ranges = []
    for event in events:
        if not isinstance(event, Mapping) or event.get("ph") != "X":
            continue
        cat = str(event.get("cat", "")).lower()
        if cat == _KERNEL_CAT:
            kernels.append(event)
        elif cat == _ANNOTATION_CAT:
            start = us_to_ns(event["ts"])
            ranges.append((as_int(event.get("pid")), start, start + us_to_ns(event["dur"]), event["name"]))
    regions = RegionIndex(ranges)
    launches = []
    for event in kernels:
        start = us_to_ns(event["ts"])
        duration = us_to_ns(event["dur"])
        device = as_int(event.get("pid"))
        launches.append(
            KernelLaunch(
                name=event["name"],
                start_ns=start,
                duration_ns=duration,
                device=device,
                stream=as_int(event.get("tid")),
                region=regions.innermost(device, start, start + duration),
                source=SOURCE_TRACE,
            )
        )
    launches.sort(key=lambda launch: launch.start_ns)
    return launches


def launches_from_profiler(prof: Any) -> list[KernelLaunch]:
    """Kernel launches straight from a finished `torch.profiler.profile`, without a file.

    Uses `prof.events()` (FunctionEvent objects): device-side events whose `activity_type` is
    "kernel" are launches, "gpu_user_annotation" ones are step ranges. Times there are µs
    relative to the trace start. Aggregates such as `key_averages()` cannot be used because
    they have no per-launch durations.
    """
    return launches_from_events(prof.events())


def launches_from_events(events: Iterable[Any]) -> list[KernelLaunch]:
    """See `launches_from_profiler`; takes the FunctionEvent list itself."""
    kernels = []
    ranges = []
    for event in events:
        if not hasattr(event, "activity_type"):
            raise ValueError(
                "profiler events have no activity_type attribute (torch too old to tell kernels "
                "from other device events); export a chrome trace and use read_kineto_trace"
            )
        if event.activity_type == _KERNEL_CAT:
            kernels.append(event)
        elif event.activity_type == _ANNOTATION_CAT:
            start = us_to_ns(event.time_range.start)
            ranges.append((event.device_index, start, us_to_ns(event.time_range.end), event.name))
    regions = RegionIndex(ranges)
    launches = []
    for event in kernels:
        start = us_to_ns(event.time_range.start)
        end = us_to_ns(event.time_range.end)
        launches.append(
            KernelLaunch(
                name=event.name,
                start_ns=start,
                duration_ns=end - start,
                device=event.device_index,
                stream=event.device_resource_id,
                region=regions.innermost(event.device_index, start, end),
                source=SOURCE_LIVE,
            )
        )
    launches.sort(key=lambda launch: launch.start_ns)
    return launches
