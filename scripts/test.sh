#!/usr/bin/env bash
# The test command of the README: sets itself up, then runs the CPU suite (Triton
# interpreter; GPU-marked tests skip without a device). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$QSA_ROOT"
exec python -m pytest -q "$@"
