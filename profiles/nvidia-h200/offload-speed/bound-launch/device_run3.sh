#!/usr/bin/env bash
# The last device call: offload GPU tests on the final code, then the interleaved A/B of the
# committed code (ab_old/) and the new one at 64 pages (store and restore) and at one page.
set -u
out="$OUT/r"; mkdir -p "$out"
here=profiles/nvidia-h200/offload-speed/bound-launch
PYTHONPATH=. timeout 200 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_page_integrity.py tests/test_offload.py tests/test_arena.py > "$out/gpu_tests.log" 2>&1
tail -1 "$out/gpu_tests.log"
for i in 1 2; do
  PYTHONPATH=. timeout 150 python3 $here/ab_store.py ab_old "$out/ab$i" --pages 64 2>>"$out/err.txt"
done
PYTHONPATH=. timeout 150 python3 $here/ab_store.py ab_old "$out/ab1" 2>>"$out/err.txt"
