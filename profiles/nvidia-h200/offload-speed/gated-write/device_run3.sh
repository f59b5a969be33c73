#!/usr/bin/env bash
# Third call, on the final code: offload GPU tests, the gated write under memcheck, the
# interleaved A/B against the committed code (ab_old/) at 64 pages, consecutive and
# scattered, the host-clock restore trace, and the offload benchmark, old and new in turn.
set -u
out="$OUT/r"; mkdir -p "$out"
here=profiles/nvidia-h200/offload-speed
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/device.txt" 2>&1
python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, triton.__version__)" >> "$out/device.txt" 2>&1
PYTHONPATH=. timeout 240 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_page_integrity.py tests/test_offload.py tests/test_arena.py > "$out/gpu_tests.log" 2>&1
tail -1 "$out/gpu_tests.log"
PYTHONPATH=. timeout 150 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q -p no:cacheprovider -m "gpu or on_gpu_too" \
  -k "gated or pipelined_restore or roundtrip_on_the_gpu" tests/test_page_integrity.py tests/test_offload.py \
  > "$out/memcheck_gated.log" 2>&1; echo "memcheck rc $?" >> "$out/memcheck_gated.log"
tail -2 "$out/memcheck_gated.log"
for i in 1 2; do
  PYTHONPATH=. timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab$i" --pages 64 2>>"$out/err.txt"
  PYTHONPATH=. timeout 100 python3 $here/bound-launch/ab_store.py ab_old "$out/ab$i" --pages 64 --scattered 2>>"$out/err.txt"
done
PYTHONPATH=. timeout 60 python3 $here/gated-write/restore_trace.py "$out/trace" 2>>"$out/err.txt" | head -1
for i in 1 2; do
  PYTHONPATH=ab_old timeout 150 python3 ab_old/scripts/bench_offload.py --quick --out "$out/bench_old$i" > "$out/bench_old$i.log" 2>&1
  tail -1 "$out/bench_old$i.log"
  PYTHONPATH=. timeout 150 python3 scripts/bench_offload.py --quick --out "$out/bench_new$i" > "$out/bench_new$i.log" 2>&1
  tail -1 "$out/bench_new$i.log"
done
tar -czf "$OUT/gated3.tgz" -C "$out" .
