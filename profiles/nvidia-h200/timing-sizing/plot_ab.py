"""Figure of `ab_sizing.jsonl`: each point's per-call time with graph samples sized by host
launch time (before) and by device time (after), and the empty kernel's per-call time against
calls per graph. Usage: PYTHONPATH=. python3 plot_ab.py [FOLDER] (default: this file's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from qsa.workbench.plots import PALETTE, STYLE, save_figure

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
rows = [json.loads(line) for line in (folder / "ab_sizing.jsonl").read_text().splitlines()]
empty = [r for r in rows if r["point"] == "empty kernel"]
points = list(dict.fromkeys(r["point"] for r in rows if r["point"] != "empty kernel"))
with matplotlib.rc_context(STYLE):
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, width_ratios=(3, 1))
    y = np.arange(len(points))

    def mean_us(point: str, rule: str) -> float:
        return float(np.mean([r["median_us"] for r in rows
                              if r["point"] == point and r["rule"] == rule]))

    after = [mean_us(p, "after") for p in points]
    ratio = [mean_us(p, "before") / a for p, a in zip(points, after)]
    ax.barh(y, ratio, height=0.6, color=PALETTE[1])
    for yi, r, a in zip(y, ratio, after):
        ax.text(r + 0.03, yi, f"{r:.2f}x (device-sized: {a:.2f} µs)", va="center", fontsize=7)
    ax.axvline(1.0, color="0.3", linewidth=0.8)
    ax.set_yticks(y, [p.replace("/bf16", "").replace("bf16/", "") for p in points])
    ax.invert_yaxis()
    ax.set_xlim(0, max(ratio) * 1.45)
    ax.set_xlabel("per-call time sized by host launch time / sized by device time")
    ax.set_title("the same calls in one process (mean of two timings each)")
    calls = [r["calls_per_sample"] for r in empty]
    ax2.plot(calls, [r["median_us"] for r in empty], "o-", color=PALETTE[2])
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("calls per graph")
    ax2.set_ylabel("µs per call")
    ax2.set_title("empty kernel: the replay's own cost")
    fig.suptitle("Graph replay on the H200: what sizing samples by host launch time added")
    save_figure(fig, folder, "ab_sizing")
