#!/usr/bin/env bash
# The main job of the README: sets itself up, then runs the default decode scoring sweep (on a
# GPU) or its CPU smoke version (Triton interpreter; a functional run whose times mean nothing),
# and prints where the executed notebooks, the results table and the figures are.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$QSA_ROOT"
exec python -m qsa.cli run "$@"
