#!/usr/bin/env bash
# Top-k's bound on the k-th key (meta key BOUND): the GPU tests, then at each decode table key
# and the prefill chunk's `qsa tune topk_expand` with BOUND=1 as the only candidate next to the
# entry (BOUND=0), written when it wins beyond the noise and a fresh-process re-check; then the
# decode step with the committed code and tables (OLD) and the new ones, alternated twice.
# Usage: bash THIS_SCRIPT OLD_TREE OUT_DIR
set -u
export PYTHONUNBUFFERED=1
OLD=${1:?usage: device_run.sh OLD_TREE OUT_DIR}; R=${2:?}; mkdir -p "$R"
PYTHONPATH=$PWD timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_kernel_topk.py > "$R/gpu_tests.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests.log"
tail -2 "$R/gpu_tests.log"
tune() { local name=$1; shift
  PYTHONPATH=$PWD timeout 100 python3 -m qsa.cli tune topk_expand --write --out "$R/store_tune" \
    --candidates '[{"meta": {"BOUND": 1}}]' "$@" > "$R/tune_$name.log" 2>&1
  echo "rc=$?" >> "$R/tune_$name.log"; grep -E "^│ [0-9]" "$R/tune_$name.log" | head -4; }
tune b32_32k --batch 32 --context 32K --rows 4
tune b1_8k --batch 1 --context 8K --rows 4
tune b32_64k --batch 32 --context 64K --rows 4
tune b8_128k --batch 8 --context 128K --rows 4
tune prefill_4096_64k --batch 1 --context 64K --rows 4096
cp qsa/configs/tables/topk.json "$R/"
step() { local name=$1 tree=$2
  (cd "$tree" && PYTHONPATH=$PWD timeout 100 python3 -m qsa.cli step --batch 32 --context 32K \
    --mtp 3 --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store_$name") > "$R/step_$name.log" 2>&1
  echo "rc=$?" >> "$R/step_$name.log"; tail -1 "$R/step_$name.log"; }
step old1 "$OLD"; step new1 "$PWD"; step old2 "$OLD"; step new2 "$PWD"
