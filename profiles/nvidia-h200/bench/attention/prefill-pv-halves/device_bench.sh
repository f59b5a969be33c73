#!/usr/bin/env bash
# Sparse GQA prefill on the tables after the PV_HALVES tune: BF16 and FP8 K/V side by side in
# one run, 4,096 rows of one request at 16K (the shape) and 64K (the chunk's).
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_bench.sh OUT_DIR}; mkdir -p "$R"
timeout 150 python3 -m qsa.cli bench --op sparse_gqa_prefill --batch 1 --context 16K,64K \
  --rows 4096 --kv-format bf16,fp8 --out /tmp/store > "$R/bench_prefill.log" 2>&1
echo "rc=$?" >> "$R/bench_prefill.log"; grep -E "sparse_gqa_prefill b|rc=" "$R/bench_prefill.log"
cp /tmp/store/nvidia-h200/*-bench-*/results.parquet "$R/bench_results.parquet" 2>/dev/null
cp /tmp/store/nvidia-h200/*-bench-*/run.json "$R/bench_run.json" 2>/dev/null
