#!/usr/bin/env bash
# Sparse GQA prefill's tables were tuned before the PV_HALVES switch existed: `qsa tune` at the
# prefill chunk's shape (4,096 rows of one request at 64K) with PV_HALVES candidates, FP8 then
# BF16, every candidate verified, a winner written only after a fresh-process re-check; then
# the chunk roll-up (every QSA layer, BF16 and FP8) on the resulting tables.
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_run.sh OUT_DIR}; mkdir -p "$R"
FP8='[{"meta": {"PV_HALVES": 1}},
 {"meta": {"PV_HALVES": 1}, "num_stages": 2},
 {"meta": {"PV_HALVES": 1}, "num_warps": 8},
 {"meta": {"PV_HALVES": 1}, "num_warps": 8, "num_stages": 2},
 {"meta": {"PV_HALVES": 1, "BLOCK_N": 64}},
 {"meta": {"PV_HALVES": 1, "BLOCK_N": 64}, "num_stages": 4}]'
BF16='[{"meta": {"PV_HALVES": 1}},
 {"meta": {"PV_HALVES": 1, "BLOCK_N": 64}, "num_warps": 4, "num_stages": 3}]'
tune() { local fmt=$1 cands=$2
  timeout 150 python3 -m qsa.cli tune sparse_gqa_prefill --batch 1 --context 64K --rows 4096 \
    --kv-format "$fmt" --write --candidates "$cands" --out /tmp/store > "$R/tune_$fmt.log" 2>&1
  echo "rc=$?" >> "$R/tune_$fmt.log"; cp qsa/configs/tables/sparse_gqa_prefill.json "$R/"
  grep -E "^│ [0-9]|rc=" "$R/tune_$fmt.log" | head -12; }
tune fp8 "$FP8"
tune bf16 "$BF16"
timeout 200 python3 -m qsa.cli step --phase prefill --rows 4096 --context 64K \
  --formats bf16/bf16,fp8/fp8 --out /tmp/store > "$R/step_prefill.log" 2>&1
echo "rc=$?" >> "$R/step_prefill.log"; grep -E "step|rc=" "$R/step_prefill.log" | tail -6
cp /tmp/store/nvidia-h200/*-step-*/results.parquet "$R/step_results.parquet" 2>/dev/null
cp /tmp/store/nvidia-h200/*-step-*/run.json "$R/step_run.json" 2>/dev/null
