#!/usr/bin/env bash
# Top-k with its own table key for many rows: the GPU tests, then the decode key's 16K bucket
# re-tuned at the 64K-context verify call (batch 32 x 4 rows) with --write, the batch-1 call
# and the prefill chunk's shape timed against their entries (not written), then the one-page
# store A/B of ../../../offload-speed/bound-launch/ (interleaved in one process).
set -u
out="$OUT/r"; mkdir -p "$out"
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print(torch.__version__, triton.__version__, sys.version)"; } > "$out/device.txt" 2>&1
PYTHONPATH=. timeout 200 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_kernel_topk.py > "$out/gpu_tests_topk.log" 2>&1; tail -1 "$out/gpu_tests_topk.log"
tune() { local name=$1; shift
  PYTHONPATH=. timeout 200 python3 -m qsa.cli tune topk_expand --out "$out/store" "$@" \
    > "$out/tune_$name.log" 2>&1; echo "rc=$?" >> "$out/tune_$name.log"
  grep -E "^│ [0-9]|entry|wrote|rc=" "$out/tune_$name.log" | head -12; }
tune b32_64k_write --batch 32 --context 64K --rows 4 --write
cp qsa/configs/tables/topk.json "$out/"
tune b1_64k --batch 1 --context 64K --rows 4 --candidates '[{"num_warps": 16}, {"num_warps": 4}]'
tune prefill_4096_64k --batch 1 --context 64K --rows 4096 --candidates '[{"num_warps": 8}]'
tune b32_32k_verify --batch 32 --context 32K --rows 4 --candidates '[{"num_warps": 8}]'
PYTHONPATH=. timeout 200 python3 profiles/nvidia-h200/offload-speed/bound-launch/ab_store.py ab_old "$out/ab1"
PYTHONPATH=. timeout 200 python3 profiles/nvidia-h200/offload-speed/bound-launch/ab_store.py ab_old "$out/ab2"
