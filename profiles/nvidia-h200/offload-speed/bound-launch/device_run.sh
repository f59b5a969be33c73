#!/usr/bin/env bash
# One device call: the offload GPU tests, the one-page store's host steps for the committed
# code (ab_old/, a copy of the committed qsa/ and scripts/) and the new code alternately, the
# offload benchmark the same way, and the digest tests under compute-sanitizer memcheck.
set -u
out="$OUT/r"; mkdir -p "$out"
here=profiles/nvidia-h200/offload-speed/bound-launch
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; lscpu | grep "Model name"
  python3 -c "import sys, torch, triton; print(torch.__version__, triton.__version__, sys.version)"; } > "$out/device.txt" 2>&1
PYTHONPATH=. timeout 300 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_page_integrity.py tests/test_offload.py tests/test_arena.py > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
for i in 1 2; do
  PYTHONPATH=ab_old timeout 120 python3 $here/store_steps.py "$out" --label old$i > /dev/null 2>"$out/err_old$i.txt"
  PYTHONPATH=. timeout 120 python3 $here/store_steps.py "$out" --label new$i 2>"$out/err_new$i.txt"
done
for i in 1 2; do
  PYTHONPATH=ab_old timeout 200 python3 ab_old/scripts/bench_offload.py --quick --out "$out/bench_old$i" > "$out/bench_old$i.log" 2>&1
  PYTHONPATH=. timeout 200 python3 scripts/bench_offload.py --quick --out "$out/bench_new$i" > "$out/bench_new$i.log" 2>&1
  grep -E "^ +(fp8|bf16) +1 |targets" "$out/bench_new$i.log"
done
PYTHONPATH=. timeout 240 /usr/local/cuda/bin/compute-sanitizer --tool memcheck python3 -m pytest \
  -m "gpu or on_gpu_too" -q -p no:cacheprovider tests/test_page_integrity.py tests/test_offload.py \
  > "$out/memcheck_offload.log" 2>&1
tail -3 "$out/memcheck_offload.log"
