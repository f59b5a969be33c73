#!/usr/bin/env python3
"""Run a notebook sweep from a YAML spec: one papermill process per point, spread over the
visible GPUs (or 1-2 CPU workers), resumable. `qsa sweep` calls the same `run_sweep`.

    python scripts/sweep.py sweeps/decode_scoring_cpu.yaml            # CPU smoke (interpreter)
    python scripts/sweep.py sweeps/decode_scoring_gpu.yaml --out profiles

Exit status: 0 when every point (and the report) passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys

from qsa.workbench.sweep import run_sweep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="sweep spec (YAML), e.g. sweeps/decode_scoring_cpu.yaml")
    ap.add_argument("--out", default="profiles",
                    help="results root; the sweep goes to <out>/<device>/sweeps/<name>")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes in all (default: one per GPU, 1-2 on CPU)")
    ap.add_argument("--no-resume", action="store_true",
                    help="re-run points that already passed with the same code and parameters")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    summary = run_sweep(args.spec, args.out, jobs=args.jobs, resume=not args.no_resume,
                        progress=not args.no_progress)
    print(summary)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
