#!/usr/bin/env bash
# Creates .venv if missing and installs the package into it; re-installs only when
# pyproject.toml changed. Sourced by scripts/run.sh and scripts/test.sh so each of the
# README's two commands sets itself up on a fresh machine.
#
# GPU hosts: the venv sees the system site-packages, so the host's own torch/triton builds
# (CUDA or ROCm) are used as they are. Without a GPU and without torch, the CPU-tested torch
# is installed; QSA_TORCH overrides that pip requirement.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${QSA_VENV:-$root/.venv}"
py="${QSA_PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[qsa] creating virtual environment $venv" >&2
  "$py" -m venv --system-site-packages "$venv"
fi
vpy="$venv/bin/python"
stamp="$venv/.qsa-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
    spec="${QSA_TORCH:-torch==2.13.0}"
    echo "[qsa] installing $spec" >&2
    "$vpy" -m pip install -q "$spec"
  fi
  echo "[qsa] installing qsa-workbench and its dependencies" >&2
  "$vpy" -m pip install -q -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export QSA_ROOT="$root"
