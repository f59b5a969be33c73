#!/usr/bin/env bash
# The test command of the README: sets itself up, checks the code with ruff, then runs the CPU
# suite (Triton interpreter; GPU-marked tests skip without a device). Extra arguments go to
# pytest.
set -euo pipefail
export QSA_EXTRAS="${QSA_EXTRAS:-dev,cluster}"  # the Ray sweep backend is tested too
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$QSA_ROOT"
python -m ruff check qsa scripts tests notebooks  # pyflakes rules, pyproject [tool.ruff]
exec python -m pytest -q "$@"
