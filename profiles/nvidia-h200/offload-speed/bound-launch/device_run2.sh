#!/usr/bin/env bash
# The second device call, on the final code: offload GPU tests, the one-page store's host
# steps and its traced timeline, the offload benchmark (committed code in ab_old/ and the new
# code alternately, twice), memcheck of the digest and offload tests; then top-k at the
# 64K-context decode shapes with the table's entry against more warps (not written).
set -u
out="$OUT/r"; mkdir -p "$out"
here=profiles/nvidia-h200/offload-speed/bound-launch
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; lscpu | grep "Model name"
  python3 -c "import sys, torch, triton; print(torch.__version__, triton.__version__, sys.version)"; } > "$out/device.txt" 2>&1
PYTHONPATH=. timeout 300 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_page_integrity.py tests/test_offload.py tests/test_arena.py > "$out/gpu_tests.log" 2>&1
tail -2 "$out/gpu_tests.log"
for i in 1 2; do
  PYTHONPATH=ab_old timeout 120 python3 $here/store_steps.py "$out" --label old$i > /dev/null 2>>"$out/err.txt"
  PYTHONPATH=. timeout 120 python3 $here/store_steps.py "$out" --label new$i 2>>"$out/err.txt" | head -4
done
PYTHONPATH=. timeout 120 python3 $here/store_trace.py "$out/trace" --layout fp8 2>>"$out/err.txt" | head -24
for i in 1 2; do
  PYTHONPATH=ab_old timeout 200 python3 ab_old/scripts/bench_offload.py --quick --out "$out/bench_old$i" > "$out/bench_old$i.log" 2>&1
  PYTHONPATH=. timeout 200 python3 scripts/bench_offload.py --quick --out "$out/bench_new$i" > "$out/bench_new$i.log" 2>&1
  grep -E "^ +(fp8|bf16) +1 +store|targets" "$out/bench_old$i.log" "$out/bench_new$i.log"
done
PYTHONPATH=. timeout 240 /usr/local/cuda/bin/compute-sanitizer --tool memcheck python3 -m pytest \
  -m "gpu or on_gpu_too" -q -p no:cacheprovider tests/test_page_integrity.py tests/test_offload.py \
  > "$out/memcheck_offload.log" 2>&1
tail -2 "$out/memcheck_offload.log"
for b in 32 1; do
  PYTHONPATH=. timeout 150 python3 -m qsa.cli tune topk_expand --batch $b --context 64K --rows 4 \
    --candidates '[{"num_warps": 16}, {"num_warps": 8}]' --out "$out/store" > "$out/tune_topk_b${b}_64k.log" 2>&1
  tail -6 "$out/tune_topk_b${b}_64k.log"
done
