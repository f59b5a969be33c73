#!/usr/bin/env bash
# The stacked scorer keyed by requests x groups: the step's batch-32 x 32K call (4 rows a
# request) tuned at its own coordinate for the three index formats (--write; each tune times
# the entry the call used until now, the batch-8 one, next to the candidates in one process,
# and re-checks a winner in a fresh one), then the stacked scorer's GPU tests.
# Usage: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_tune.sh OUT_DIR}; mkdir -p "$R/store"
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print(torch.__version__, triton.__version__, sys.version)"; } > "$R/device.txt" 2>&1
for f in fp8 bf16 mxfp4; do
  timeout 170 python3 -m qsa.cli tune score_stacked --batch 32 --context 32K --rows 4 \
    --index-format $f --max-candidates 24 --write --out "$R/store" > "$R/tune_$f.log" 2>&1
  echo "rc=$?" >> "$R/tune_$f.log"; tail -4 "$R/tune_$f.log"
done
cp qsa/configs/tables/score_stacked.json "$R/"
timeout 120 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_kernel_scorers.py -k stacked > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; tail -2 "$R/gpu_tests.log"
