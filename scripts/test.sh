#!/usr/bin/env bash
# The test command of the README: sets itself up, checks the code with ruff, then runs the CPU
# suite (Triton interpreter; GPU-marked tests skip without a device). Extra arguments go to
# pytest.
#
# Two lanes:
#   scripts/test.sh [PYTEST_ARGS...]         the default lane: every test not marked `slow`
#                                            (every kernel x format still runs under the
#                                            interpreter at least once)
#   scripts/test.sh --full [PYTEST_ARGS...]  every test, the slow ones too (the notebooks, the
#                                            Ray sweeps, compile checks for GPU targets, more
#                                            shapes per kernel); scripts/gpu_check.sh runs the
#                                            slow ones on a GPU host
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
full=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--full" ]; then full=1; else args+=("$arg"); fi
done
marker=()
[ "$full" = 1 ] || marker=(-m "not slow")  # a -m among the arguments wins: pytest keeps the last
# The default lane runs on every CPU core (pytest-xdist; QSA_TEST_WORKERS=0 runs in one
# process); the full lane stays in one, since scripts/gpu_check.sh runs it on a GPU that timed
# tests must not share.
workers=()
[ "$full" = 1 ] || workers=(-n "${QSA_TEST_WORKERS:-auto}")
# The Ray sweep backend is tested in the full lane; the default lane needs no Ray, so a fresh
# clone installs it only for --full (a venv that already has it keeps it).
if [ -z "${QSA_EXTRAS:-}" ]; then
  if [ "$full" = 1 ] || grep -qs cluster "${QSA_VENV:-$root/.venv}/.qsa-installed"; then
    export QSA_EXTRAS="dev,cluster"
  else
    export QSA_EXTRAS="dev"
  fi
fi
source "$root/scripts/bootstrap.sh"
cd "$QSA_ROOT"
python -m ruff check qsa scripts tests notebooks  # pyflakes rules, pyproject [tool.ruff]
exec python -m pytest -q ${marker[@]+"${marker[@]}"} ${workers[@]+"${workers[@]}"} \
  ${args[@]+"${args[@]}"}
