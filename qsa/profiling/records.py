"""One record type for every profiler, so kineto, Proton and rocprofv3 output all feed the
same summary code.

Per-launch sources (kineto, Proton trace, rocpd, rocprofv3 CSV) give `KernelLaunch` rows.
A Proton tree only keeps a count and a total per kernel and scope, so it gives
`KernelAggregate` rows; `summarize` accepts either kind (not both at once).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal

import numpy as np
import pandas as pd

SUMMARY_COLUMNS = ["name", "region", "count", "total_us", "mean_us", "median_us", "p10_us", "p90_us"]


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One kernel execution on the device.

    Times are integer ns so that sources in µs (kineto, Proton) and ns (rocprof) compare exactly.
    `start_ns` is on the source's own clock (absolute for kineto and rocprof, relative to the
    first event for Proton); only differences within one source are meaningful.
    `region` is the enclosing step marker (record_function, Proton scope path, ROCTx range),
    or None when the launch ran outside any marker. `device`/`stream` are None when the source
    does not record them.
    """

    name: str
    start_ns: int
    duration_ns: int
    device: int | None
    stream: int | None
    region: str | None
    source: str

    @property
    def end_ns(self) -> int:
        return self.start_ns + self.duration_ns


@dataclass(frozen=True, slots=True)
class KernelAggregate:
    """Count and total time of one kernel in one region, as a Proton tree stores it.

    The total includes every launch inside the session, cold first launches too, so the mean
    can sit well above the steady state: warm up before starting the profiler, or use a
    per-launch source to see the distribution.
    """

    name: str
    region: str | None
    device: int | None
    count: int
    total_ns: int
    source: str

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count


def us_to_ns(value: float | int | str | Decimal) -> int:
    """Convert a µs timestamp to integer ns without float rounding error.

    Kineto timestamps are absolute µs around 5e12 with three decimals; `value * 1000` in float
    can land one ns off, so go through the decimal text instead.
    """
    return int((Decimal(str(value)) * 1000).to_integral_value())


def as_int(value: object) -> int | None:
    """Integer id from a trace field that may be an int, a numeric string, or a label."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return None


class RegionIndex:
    """Time ranges per lane (a device or a thread) for attributing launches to step markers."""

    def __init__(self, ranges: Iterable[tuple[object, int, int, str]]) -> None:
        """`ranges` holds (lane, start_ns, end_ns, name) tuples."""
        lanes: dict[object, list[tuple[int, int, str]]] = {}
        for lane, start, end, name in ranges:
            lanes.setdefault(lane, []).append((start, end, name))
        # Sort by start, longer first at equal start, so a backward scan meets the innermost
        # (latest-starting, then shortest) enclosing range first.
        self._lanes = {lane: sorted(rs, key=lambda r: (r[0], -r[1])) for lane, rs in lanes.items()}
        self._starts = {lane: [r[0] for r in rs] for lane, rs in self._lanes.items()}

    def __len__(self) -> int:
        return sum(len(rs) for rs in self._lanes.values())

    def innermost(self, lane: object, start_ns: int, end_ns: int) -> str | None:
        """Name of the innermost range on `lane` that fully contains [start_ns, end_ns]."""
        ranges = self._lanes.get(lane)
        if not ranges:
            return None
        i = bisect.bisect_right(self._starts[lane], start_ns)
        for r_start, r_end, name in reversed(ranges[:i]):
            if r_start <= start_ns and end_ns <= r_end:
                return name
        return None


def to_frame(records: Sequence[KernelLaunch] | Sequence[KernelAggregate]) -> pd.DataFrame:
    """Records as a DataFrame, one row each, for ad-hoc analysis in notebooks."""
    if not records:
        return pd.DataFrame()
    return _frame([dataclasses.asdict(r) for r in records], [f.name for f in dataclasses.fields(records[0])])


def _frame(rows: list[dict[str, object]], columns: list[str]) -> pd.DataFrame:
    """DataFrame whose text columns stay object dtype, so a missing region reads as None.

    pandas >= 3 would otherwise infer its string dtype and turn None into NaN.
    """
    data = {}
    for column in columns:
        values = [row[column] for row in rows]
        is_text = any(isinstance(v, str) for v in values)
        data[column] = pd.Series(values, dtype=object if is_text else None)
    return pd.DataFrame(data, columns=columns)


def summarize(records: Sequence[KernelLaunch] | Sequence[KernelAggregate]) -> pd.DataFrame:
    """Per (kernel name, region) statistics in µs, sorted by total time, largest first.

    Columns: name, region (None outside markers), count, total_us, mean_us, median_us, p10_us,
    p90_us. For `KernelAggregate` input the distribution is unknown, so median/p10/p90 are NaN.
    """
    launches = [r for r in records if isinstance(r, KernelLaunch)]
    aggregates = [r for r in records if isinstance(r, KernelAggregate)]
    if len(launches) + len(aggregates) != len(records):
        bad = next(r for r in records if not isinstance(r, KernelLaunch | KernelAggregate))
        raise TypeError(f"summarize expects KernelLaunch or KernelAggregate records, got {type(bad).__name__}")
    if launches and aggregates:
        raise ValueError(
            "summarize got both per-launch records and Proton tree aggregates; they come from "
            "different profiler runs and would double-count, so summarize them separately"
        )
    rows = _summarize_launches(launches) if launches else _summarize_aggregates(aggregates)
    frame = _frame(rows, SUMMARY_COLUMNS)
    frame = frame.sort_values(["total_us", "name"], ascending=[False, True], kind="stable")
    return frame.reset_index(drop=True)


def _summarize_launches(launches: Sequence[KernelLaunch]) -> list[dict[str, object]]:
    groups: dict[tuple[str, str | None], list[int]] = {}
    for launch in launches:
        groups.setdefault((launch.name, launch.region), []).append(launch.duration_ns)
    rows = []
    for (name, region), durations in groups.items():
        us = np.asarray(durations, dtype=np.float64) / 1e3
        p10, median, p90 = np.percentile(us, [10, 50, 90])
        rows.append(
            {
                "name": name,
                "region": region,
                "count": len(us),
                "total_us": float(us.sum()),
                "mean_us": float(us.mean()),
                "median_us": float(median),
                "p10_us": float(p10),
                "p90_us": float(p90),
            }
        )
    return rows


def _summarize_aggregates(aggregates: Sequence[KernelAggregate]) -> list[dict[str, object]]:
    groups: dict[tuple[str, str | None], list[int]] = {}
    for agg in aggregates:
        count_total = groups.setdefault((agg.name, agg.region), [0, 0])
        count_total[0] += agg.count
        count_total[1] += agg.total_ns
    return [
        {
            "name": name,
            "region": region,
            "count": count,
            "total_us": total_ns / 1e3,
            "mean_us": total_ns / 1e3 / count,
            "median_us": float("nan"),
            "p10_us": float("nan"),
            "p90_us": float("nan"),
        }
        for (name, region), (count, total_ns) in groups.items()
    ]
