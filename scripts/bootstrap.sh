#!/usr/bin/env bash
# Creates .venv if missing and installs the package into it; re-installs only when
# pyproject.toml or constraints.txt changed. Sourced by scripts/run.sh and scripts/test.sh so
# each of the README's two commands sets itself up on a fresh machine.
#
# GPU hosts: the venv sees the launching python's packages (its system site-packages, or the
# environment it belongs to when that python is itself a venv), so the host's own torch/triton
# builds (CUDA or ROCm) are used as they are and never installed twice. Only when no torch is
# importable, the CPU-tested torch is installed (QSA_TORCH overrides that pip requirement), and
# only when no triton is, Triton 3.6 (QSA_TRITON overrides it).
#
# The package's dependencies install at the versions of constraints.txt (pip -c: the versions
# the CPU suite passed with; scripts/constraints.py writes it), so a fresh install does not take
# whatever is newest that day. It pins neither torch nor triton, and scripts/wheelhouse.sh
# downloads the same versions, so an offline host installs from its wheelhouse unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${QSA_VENV:-$root/.venv}"
py="${QSA_PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[qsa] creating virtual environment $venv" >&2
  "$py" -m venv --system-site-packages "$venv"
  # A launching python that is itself a virtual environment (a container's /opt/.../venv): the
  # flag above exposes its *base* interpreter's packages, not that environment's, so the host's
  # torch and triton would be missing and a second torch would be installed. A .pth file puts
  # that environment's site-packages on the new venv's path instead, as a site directory so
  # its own .pth files count too (an environment layered on another one the same way); conda
  # and system pythons are not venvs and need nothing.
  parent="$("$py" -c 'import sys, sysconfig
p = sysconfig.get_paths()
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys([p["purelib"], p["platlib"]])))')"
  if [ -n "$parent" ]; then
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    while IFS= read -r dir; do
      printf 'import site; site.addsitedir(%s)\n' "$("$py" -c 'import sys; print(repr(sys.argv[1]))' "$dir")"
    done <<< "$parent" > "$site/qsa_parent_environment.pth"
    echo "[qsa] $py is a virtual environment: its packages are used ($parent)" >&2
  fi
fi
vpy="$venv/bin/python"
stamp="$venv/.qsa-installed"
extras="${QSA_EXTRAS:-dev}"  # scripts/test.sh --full adds cluster (ray) for the Ray sweep tests
constraints="$root/constraints.txt"
want="$(cat "$root/pyproject.toml" "$constraints" | sha256sum | cut -d' ' -f1) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
    spec="${QSA_TORCH:-torch==2.13.0}"
    echo "[qsa] installing $spec" >&2
    "$vpy" -m pip install -q "$spec"
  fi
  # A CUDA or ROCm torch brings its Triton; a CPU torch does not (QSA_TRITON overrides).
  if ! "$vpy" -c "import triton" >/dev/null 2>&1; then
    spec="${QSA_TRITON:-triton>=3.6,<3.7}"
    echo "[qsa] installing $spec" >&2
    "$vpy" -m pip install -q "$spec"
  fi
  # The editable install builds with setuptools >= 68 (pyproject.toml). When the environment
  # already has what that build needs (setuptools >= 70.1, or >= 68 with the `wheel` package,
  # which older setuptools need for editable builds; a GPU host's venv or conda usually has
  # it), it builds with that instead of downloading it into an isolated build environment, so
  # a host without internet access needs no setuptools wheel; otherwise pip's isolated build
  # is used.
  isolation=()
  if "$vpy" -c 'import importlib.util, sys, setuptools
v = tuple(int(x) for x in setuptools.__version__.split(".")[:2])
sys.exit(not (v >= (70, 1) or (v >= (68, 0) and importlib.util.find_spec("wheel"))))' \
      >/dev/null 2>&1; then
    isolation=(--no-build-isolation)
  fi
  echo "[qsa] installing qsa-workbench[$extras] and its dependencies" >&2
  "$vpy" -m pip install -q ${isolation[@]+"${isolation[@]}"} -c "$constraints" \
    -e "$root[$extras]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export QSA_ROOT="$root"
