#!/usr/bin/env bash
# Fourth call, on the committed change: offload GPU tests, the interleaved A/B against the
# code before it (ab_old/) at 64 pages (consecutive, scattered) and one page, the offload
# benchmark old and new in turn (1 and 64 pages), then the new code's full benchmark
# (1, 64, 1024 pages).
set -u
out="$OUT/r"; mkdir -p "$out"
here=profiles/nvidia-h200/offload-speed
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/device.txt" 2>&1
PYTHONPATH=. timeout 240 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_page_integrity.py tests/test_offload.py tests/test_arena.py > "$out/gpu_tests.log" 2>&1
tail -1 "$out/gpu_tests.log"
for i in 1 2; do
  PYTHONPATH=. timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab$i" --pages 64 2>>"$out/err.txt"
  PYTHONPATH=. timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab$i" --pages 64 --scattered 2>>"$out/err.txt"
done
PYTHONPATH=. timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab1" 2>>"$out/err.txt"
for i in 1 2; do
  PYTHONPATH=ab_old timeout 150 python3 ab_old/scripts/bench_offload.py --quick --out "$out/bench_old$i" > "$out/bench_old$i.log" 2>&1
  tail -1 "$out/bench_old$i.log"
  PYTHONPATH=. timeout 150 python3 scripts/bench_offload.py --quick --out "$out/bench_new$i" > "$out/bench_new$i.log" 2>&1
  tail -1 "$out/bench_new$i.log"
done
PYTHONPATH=. timeout 200 python3 scripts/bench_offload.py --out "$out/bench_full" > "$out/bench_full.log" 2>&1
tail -1 "$out/bench_full.log"
tar -czf "$OUT/gated4.tgz" -C "$out" .
