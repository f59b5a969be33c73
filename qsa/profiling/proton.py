"""Proton (`triton.profiler`) output as records.

Tree (`data="tree"`, `<name>.hatchet`): a JSON list `[root, device_info]`. Kernel leaves carry
`count` and `time (ns)`, the TOTAL over `count` launches; scopes carry user metrics only. The
tree therefore yields `KernelAggregate` rows, and its mean includes cold first launches (the
H200 fixture: 661,919 ns / 20 = 33.1 µs against a 31.5 µs steady state, because the first
launch took 63.4 µs). Warm up before `proton.start`, or use trace mode for the distribution.

Trace (`data="trace"`, `<name>.chrome_trace`): kernel events with `ts`/`dur` in µs relative to
the first event, `tid` = stream, and `args.call_stack` = ["ROOT", scopes..., kernel].
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qsa.profiling.records import KernelAggregate, KernelLaunch, as_int, us_to_ns

SOURCE_TREE = "proton-tree"
SOURCE_TRACE = "proton-trace"
_TIME_METRIC = "time (ns)"
_ROOT = "ROOT"


def read_proton_tree(path: str | Path) -> list[KernelAggregate]:
    """Read a `.hatchet` file written by `proton.finalize`."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        tree = json.load(f)
    try:
        return parse_proton_tree(tree)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def parse_proton_tree(tree: list[Any]) -> list[KernelAggregate]:
    """One aggregate per kernel node; region is the '/'-joined scope path below ROOT.

    A node is a kernel when it has a positive `count` and a `time (ns)` metric; scopes have
    neither. ROOT is not part of the path, so kernels directly under it get region None.
    """
    if not isinstance(tree, list) or not tree or not isinstance(tree[0], Mapping) or "frame" not in tree[0]:
        raise ValueError("not a Proton tree: expected a JSON list [root, device_info] with root['frame']")
    aggregates: list[KernelAggregate] = []
    for child in tree[0].get("children", []):
        _walk(child, (), aggregates)
    return aggregates


def _walk(node: Mapping[str, Any], path: tuple[str, ...], out: list[KernelAggregate]) -> None:
    name = node["frame"]["name"]
    metrics = node.get("metrics", {})
    count = metrics.get("count", 0)
    if count > 0 and _TIME_METRIC in metrics:
        out.append(
            KernelAggregate(
                name=name,
                region="/".join(path) or None,
                device=as_int(metrics.get("device_id")),
                count=int(count),
                total_ns=int(metrics[_TIME_METRIC]),
                source=SOURCE_TREE,
            )
        )
    for child in node.get("children", []):
        _walk(child, (*path, name), out)


def read_proton_trace(path: str | Path) -> list[KernelLaunch]:
    """Read a `.chrome_trace` file written by Proton in trace mode."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    try:
        return parse_proton_trace(trace)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def parse_proton_trace(trace: Mapping[str, Any]) -> list[KernelLaunch]:
    """Kernel launches in start order; region is the scope path from `args.call_stack`.

    The file carries no device id (`pid` is absent), so device is None unless a `pid` appears.
    """
    events = trace.get("traceEvents") if isinstance(trace, Mapping) else None
    if not isinstance(events, list):
        raise ValueError("not a Proton chrome trace: expected a traceEvents list")
    launches = []
    for event in events:
        if event.get("ph") != "X" or event.get("cat") != "kernel":
            continue
        name = event["name"]
        launches.append(
            KernelLaunch(
                name=name,
                start_ns=us_to_ns(event["ts"]),
                duration_ns=us_to_ns(event["dur"]),
                device=as_int(event.get("pid")),
                stream=as_int(event.get("tid")),
                region=_scope_path(event.get("args", {}).get("call_stack", []), name),
                source=SOURCE_TRACE,
            )
        )
    launches.sort(key=lambda launch: launch.start_ns)
    return launches


def _scope_path(call_stack: list[str], kernel: str) -> str | None:
    frames = list(call_stack)
    if frames and frames[0] == _ROOT:
        frames = frames[1:]
    if frames and frames[-1] == kernel:
        frames = frames[:-1]
    return "/".join(frames) or None
