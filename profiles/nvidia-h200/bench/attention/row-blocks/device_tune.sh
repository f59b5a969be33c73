#!/usr/bin/env bash
# Sparse GQA prefill with a program per block of rows (config key ROWS): the GPU tests of the
# prefill paths, then `qsa tune sparse_gqa_prefill` at the issue's shape (4,096 rows of one
# request at 16K) for BF16 and FP8 K/V, the table's entry timed next to row-block candidates,
# every candidate verified, the winner written only if it beats the entry and a fresh
# process confirms it.
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_tune.sh OUT_DIR}; mkdir -p "$R"
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_sparse_gqa.py \
  -k "prefill or row_block or pv_halves" > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; tail -2 "$R/gpu_tests.log"
BF16='[{"meta": {"ROWS": 2}, "num_warps": 4, "num_stages": 3},
 {"meta": {"ROWS": 4}, "num_warps": 4, "num_stages": 3},
 {"meta": {"ROWS": 4, "PV_HALVES": 1}, "num_warps": 4, "num_stages": 2},
 {"meta": {"ROWS": 4}, "num_warps": 8, "num_stages": 3},
 {"meta": {"ROWS": 4, "BLOCK_N": 64}, "num_warps": 8, "num_stages": 2},
 {"meta": {"ROWS": 8, "PV_HALVES": 1}, "num_warps": 8, "num_stages": 2},
 {"meta": {"ROWS": 8, "PV_HALVES": 1}, "num_warps": 8, "num_stages": 3},
 {"meta": {"ROWS": 8, "PV_HALVES": 1, "BLOCK_N": 16}, "num_warps": 8, "num_stages": 3},
 {"meta": {"ROWS": 8, "PV_HALVES": 1}, "num_warps": 4, "num_stages": 2}]'
FP8='[{"meta": {"ROWS": 2, "BLOCK_N": 64}},
 {"meta": {"ROWS": 4, "BLOCK_N": 64}},
 {"meta": {"ROWS": 4, "BLOCK_N": 32}},
 {"meta": {"ROWS": 4, "BLOCK_N": 64}, "num_warps": 8},
 {"meta": {"ROWS": 4, "BLOCK_N": 64, "PV_HALVES": 1}},
 {"meta": {"ROWS": 8, "BLOCK_N": 32, "PV_HALVES": 1}, "num_warps": 8},
 {"meta": {"ROWS": 8, "BLOCK_N": 64, "PV_HALVES": 1}, "num_warps": 8, "num_stages": 2},
 {"meta": {"ROWS": 8, "BLOCK_N": 16, "PV_HALVES": 1}, "num_warps": 8}]'
tune() { local name=$1 fmt=$2 cands=$3
  timeout 240 python3 -m qsa.cli tune sparse_gqa_prefill --batch 1 --context 16K --rows 4096 \
    --kv-format "$fmt" --write --candidates "$cands" --out "$R/store" > "$R/tune_$name.log" 2>&1
  echo "rc=$?" >> "$R/tune_$name.log"; grep -E "^│ |rc=|winner|written|kept" "$R/tune_$name.log" | tail -16; }
tune bf16_16k bf16 "$BF16"
tune fp8_16k fp8 "$FP8"
cp qsa/configs/tables/sparse_gqa_prefill.json "$R/"
