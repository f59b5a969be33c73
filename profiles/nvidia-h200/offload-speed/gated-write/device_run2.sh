#!/usr/bin/env bash
# Second call: host-clock traces of restores (no profiler), both layouts, consecutive and
# scattered, 64 pages.
set -u
out="$OUT/r"; mkdir -p "$out"
export PYTHONPATH=.
here=profiles/nvidia-h200/offload-speed/gated-write
for fmt in fp8 bf16; do
  timeout 60 python3 $here/restore_trace.py "$out" --layout $fmt 2>>"$out/err.txt" | head -3
  timeout 60 python3 $here/restore_trace.py "$out" --layout $fmt --scattered 2>>"$out/err.txt" | head -1
done
tar -czf "$OUT/trace.tgz" -C "$out" .
