"""Profiler capture of one verified point, cross-checked against the timing module.

The same prepared point is timed with `qsa.measure.timing` and captured with a profiler; the
profiler's per-kernel median is compared with the timing's median, and the two are said to
agree when they differ by less than the spread either reports. On ROCm, `rocprofv3` runs this
command again in a child process (`--profiler roctx`), which marks each step with a ROCTx range
inside a `--selected-regions` window; the parent reads the rocpd database back.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from qsa.presets import get_preset
from qsa.profiling import (ProfilerUnavailableError, capture_proton, capture_torch_profiler,
                           read_rocprof_output, roctx_profiler, roctx_range,
                           roctx_unavailable_reason, rocprofv3_command, summarize)
from qsa.profiling.rocprof import rocprof_child_env, rocprofv3_capture_problem
from qsa.workbench.ops import Point, measure_prepared, prepare

PROFILERS = ("torch", "proton", "rocprofv3")


def point_args(point: Point) -> list[str]:
    """The `qsa profile` arguments that rebuild `point` in a child process."""
    return ["--op", point.op, "--preset", point.preset.name, "--batch", str(point.batch),
            "--context", str(point.context), "--rows", str(point.rows),
            "--index-format", point.index_format, "--kv-format", point.kv_format]


def profile_point(point: Point, profiler: str, out_dir: Path, steps: int = 50
                  ) -> dict[str, Any]:
    """Capture `steps` calls of a verified point; returns the comparison record and writes the
    raw trace plus `kernels.csv` (per-kernel summary) under `out_dir`."""
    if profiler not in PROFILERS:
        raise ValueError(f"profiler: {profiler!r} is not one of {', '.join(PROFILERS)}")
    if profiler == "rocprofv3":
        problem = rocprofv3_capture_problem()
        if problem is not None:
            raise ProfilerUnavailableError(problem)
    out_dir.mkdir(parents=True, exist_ok=True)
    prep = prepare(point)
    rec = measure_prepared(prep)  # verifies, then times with the workbench's method
    counter = iter(range(1 << 62))

    def one_call() -> None:
        prep.call(next(counter) % prep.n_sets, None)

    if profiler == "torch":
        launches = capture_torch_profiler(one_call, steps, out_dir)
    elif profiler == "proton":
        launches = capture_proton(one_call, steps, out_dir, data="trace")
    else:
        cmd = rocprofv3_command(out_dir, "qsa", [sys.executable, "-m", "qsa.cli", "profile",
                                                 *point_args(point), "--profiler", "roctx",
                                                 "--steps", str(steps)])
        subprocess.run(cmd, check=True, env=rocprof_child_env())
        launches = read_rocprof_output(out_dir)
        if not launches:
            raise ProfilerUnavailableError(f"rocprofv3 recorded no kernel under {out_dir}: the "
                                     "child's ROCTx ranges did not reach the profiler")
    summarize(launches).to_csv(out_dir / "kernels.csv", index=False)  # per kernel and step
    # One distribution per kernel over all captured steps for the comparison.
    return crosscheck(rec, summarize([dataclasses.replace(k, region=None) for k in launches]))


def run_roctx_steps(point: Point, steps: int) -> None:
    """Child side of a rocprofv3 capture: only the marked steps are collected, so without
    roctx (the ranges would be no-ops) it refuses instead of capturing nothing."""
    reason = roctx_unavailable_reason()
    if reason is not None:
        raise ProfilerUnavailableError(reason)
    prep = prepare(point)
    prep.check(None)
    with roctx_profiler():
        for i in range(steps):
            with roctx_range(f"step{i}"):
                prep.call(i % prep.n_sets, None)
    import torch

    torch.cuda.synchronize()


def crosscheck(rec: dict[str, Any], summary: pd.DataFrame) -> dict[str, Any]:
    """The timing module's median against the profiler's median of the op's main kernel (the
    kernel with the most device time; a split kernel's merge shows as its own row)."""
    main = summary.sort_values("total_us", ascending=False).iloc[0]
    t_med, p_med = float(rec["us"]), float(main["median_us"])
    t_spread = float(rec["p90_us"] - rec["p10_us"])
    p_spread = float(main["p90_us"] - main["p10_us"])
    noise = max(t_spread, p_spread)
    return {"op": rec["op"], "kernel_name": main["name"], "timing_us": t_med,
            "timing_method": rec["method"], "profiler_median_us": p_med,
            "profiler_count": int(main["count"]), "difference_us": p_med - t_med,
            "noise_us": noise, "agree_within_noise": abs(p_med - t_med) <= noise,
            "kernels": int(len(summary))}


def point_from_args(op: str, preset: str, batch: int, context: int, rows: int,
                    index_format: str, kv_format: str) -> Point:
    return Point(op, get_preset(preset), batch, context, rows, index_format, kv_format)

