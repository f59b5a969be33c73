#!/usr/bin/env python3
"""Write constraints.txt: the version of every package the CPU suite ran with, for the set-up
(`scripts/bootstrap.sh`, `pip install -c`) and the offline wheelhouse (`scripts/wheelhouse.sh`).

    .venv/bin/python scripts/constraints.py    # after `bash scripts/test.sh` passed

It pins the dependency closure of qsa-workbench with the extras scripts/test.sh installs, read
from the installed distributions (the venv's own and the system packages it sees), so a fresh
install gets the versions the suite passed with instead of whatever is newest. torch and
Triton, and the packages only they need, are left out: a GPU host brings its own CUDA or ROCm
build, and the CPU set-up installs torch by itself. pyproject.toml keeps the lower bounds.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("dev", "cluster")  # scripts/test.sh's QSA_EXTRAS
HOST_BUILT = {"torch", "triton"}  # not followed: what only they need is left out too


def closure(names: list[str], extras: tuple[str, ...], skip: set[str]) -> set[str]:
    """Every installed distribution `names` need (with `extras` of the first level), not
    following `skip`."""
    seen: set[str] = set()
    stack = [(n, extras) for n in names]
    while stack:
        name, ex = stack.pop()
        key = canonicalize_name(name)
        if key in seen or key in skip:
            continue
        try:
            dist = md.distribution(key)
        except md.PackageNotFoundError:
            continue
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *ex)):
                stack.append((req.name, ()))
    return seen


def main() -> int:
    pins = sorted(closure(["qsa-workbench"], EXTRAS, HOST_BUILT) - {"qsa-workbench"})
    lines = [f"{md.distribution(n).metadata['Name']}=={md.version(n)}" for n in pins]
    head = ("# Versions the CPU suite passed with (scripts/constraints.py wrote this; see its "
            "docstring).\n# torch and Triton are not here: GPU hosts bring their own builds.\n")
    (ROOT / "constraints.txt").write_text(head + "\n".join(lines) + "\n")
    print(f"constraints.txt: {len(lines)} packages", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
