#!/usr/bin/env bash
# Top-k's last pass over the keys already in registers when the config's CHUNK covers the row:
# the GPU tests, then at the decode keys `qsa tune topk_expand` with CHUNK = the row as the only
# candidate next to the entry, written when it wins beyond the noise and a fresh re-check.
# Usage: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_chunk.sh OUT_DIR}; mkdir -p "$R"
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_topk.py \
  > "$R/gpu_tests_chunk.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests_chunk.log"
tail -2 "$R/gpu_tests_chunk.log"
tune() { local name=$1 chunk=$2; shift 2
  timeout 60 python3 -m qsa.cli tune topk_expand --write --out "$R/store_tune" \
    --candidates "[{\"meta\": {\"CHUNK\": $chunk}}]" "$@" > "$R/tune_chunk_$name.log" 2>&1
  echo "rc=$?" >> "$R/tune_chunk_$name.log"; grep -E "^│ [0-9]" "$R/tune_chunk_$name.log" | head -4; }
tune b32_32k 8192 --batch 32 --context 32K --rows 4
tune b1_8k 2048 --batch 1 --context 8K --rows 4
tune b32_64k 16384 --batch 32 --context 64K --rows 4
cp qsa/configs/tables/topk.json "$R/"
