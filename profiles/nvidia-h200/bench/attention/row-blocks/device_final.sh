#!/usr/bin/env bash
# The final code (row-block bits and the merge's counters share one argument): every GPU test
# of sparse GQA, then the headline suite's sparse GQA decode points, to compare with the
# headline run made before this change (20261204-154726-suite-3fdbc5).
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_final.sh OUT_DIR}; mkdir -p "$R"
timeout 300 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_kernel_sparse_gqa.py > "$R/gpu_tests_final.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests_final.log"; tail -2 "$R/gpu_tests_final.log"
timeout 150 python3 -m qsa.cli bench --op sparse_gqa_decode --batch 1,8,64 --context 128K \
  --rows 4 --kv-format bf16,fp8 --selection random --out "$R/store" > "$R/bench_decode.log" 2>&1
echo "rc=$?" >> "$R/bench_decode.log"; grep -E "sparse_gqa_decode b|rc=" "$R/bench_decode.log"
