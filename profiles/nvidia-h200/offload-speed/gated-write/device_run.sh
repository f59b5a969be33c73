#!/usr/bin/env bash
# One device call: the offload GPU tests on this tree, the gated write under memcheck, the
# interleaved A/B of the committed code (ab_old/) and this tree at 64 and 256 pages, and the
# device timeline of this tree's restores at 64 pages.
set -u
out="$OUT/r"; mkdir -p "$out"
here=profiles/nvidia-h200/offload-speed
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/device.txt" 2>&1
python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, triton.__version__)" >> "$out/device.txt" 2>&1
timeout 240 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_page_integrity.py tests/test_offload.py tests/test_arena.py > "$out/gpu_tests.log" 2>&1
tail -1 "$out/gpu_tests.log"
timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q -p no:cacheprovider -m "gpu or on_gpu_too" \
  -k "gated or pipelined_restore" tests/test_page_integrity.py tests/test_offload.py \
  > "$out/memcheck_gated.log" 2>&1; echo "memcheck rc $?" >> "$out/memcheck_gated.log"
tail -2 "$out/memcheck_gated.log"
for i in 1 2; do
  timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab$i" --pages 64 2>>"$out/err.txt"
done
timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab1" --pages 64 --scattered 2>>"$out/err.txt"
timeout 120 python3 $here/bound-launch/ab_store.py ab_old "$out/ab1" --pages 256 2>>"$out/err.txt"
timeout 100 python3 $here/mapped-sums/timeline.py "$out/timeline" 64 > /dev/null 2>>"$out/err.txt"
rm -f "$out"/timeline/trace_bf16*.json
tar -czf "$OUT/gated.tgz" -C "$out" .
