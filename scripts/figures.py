#!/usr/bin/env python3
"""Regenerate every figure of stored runs (PNG + SVG), without a GPU.

    python scripts/figures.py profiles/nvidia-h200/<run id>            # one run -> <run>/figures
    python scripts/figures.py profiles/nvidia-h200/sweeps/decode-scoring   # every run of a sweep

The figures a run gets depend on its kind (see qsa.workbench.plots.RECIPES).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from qsa.measure.results import RUN_FILE  # noqa: E402
from qsa.workbench.plots import figures_for_run  # noqa: E402

__all__ = ["figures_for_run", "main"]


def run_dirs(path: Path) -> list[Path]:
    """`path` itself when it is a run, else every run directory below it."""
    if (path / RUN_FILE).is_file():
        return [path]
    return sorted(p.parent for p in path.rglob(RUN_FILE))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="run directories or folders of runs")
    ap.add_argument("--out", type=Path, default=None,
                    help="write here instead of <run>/figures (only with a single run)")
    args = ap.parse_args(argv)
    runs = [r for p in args.paths for r in run_dirs(p)]
    if not runs:
        print("no runs found under " + ", ".join(map(str, args.paths)), file=sys.stderr)
        return 1
    if args.out is not None and len(runs) > 1:
        ap.error("--out needs exactly one run")
    for run in runs:
        paths = figures_for_run(run, args.out)
        print(f"{run}: {len(paths)} files" + (f" in {paths[0].parent}" if paths else
                                              " (no figures for this kind)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
