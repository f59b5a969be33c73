#!/usr/bin/env bash
# Fewer dependent loads before the first data load (sparse GQA's page-table read no longer
# waits for the request's context; top-k requests a row's scores once its position is known):
# the GPU tests of both kernels, then the latency-bound calls with the committed code (a copy
# in OLD) and the new code in turn, twice, in one call.
# Usage: bash THIS_SCRIPT OLD_TREE OUT_DIR
set -u
export PYTHONUNBUFFERED=1
OLD=${1:?usage: device_ab.sh OLD_TREE OUT_DIR}; R=${2:?}; mkdir -p "$R"
PYTHONPATH=$PWD timeout 300 python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider \
  tests/test_kernel_topk.py tests/test_kernel_sparse_gqa.py > "$R/gpu_tests.log" 2>&1
echo "rc=$?" >> "$R/gpu_tests.log"; tail -2 "$R/gpu_tests.log"
bench() { local name=$1 tree=$2
  (cd "$tree" && PYTHONPATH=$PWD timeout 120 python3 -m qsa.cli bench --op sparse_gqa_decode \
     --batch 1,8 --context 128K --rows 4 --kv-format bf16,fp8 --selection random \
     --out "$R/store_$name" && PYTHONPATH=$PWD timeout 120 python3 -m qsa.cli bench \
     --op topk_expand --batch 1,32 --context 8K,32K --rows 4 --out "$R/store_$name") \
    > "$R/bench_$name.log" 2>&1
  echo "rc=$?" >> "$R/bench_$name.log"; tail -1 "$R/bench_$name.log"; }
bench old1 "$OLD"; bench new1 "$PWD"; bench old2 "$OLD"; bench new2 "$PWD"
PYTHONPATH=$PWD python3 - "$R" <<'PY' > "$R/summary.txt" 2>&1
import sys, glob, pandas as pd
R = sys.argv[1]
rows = []
for name in ("old1", "new1", "old2", "new2"):
    for f in glob.glob(f"{R}/store_{name}/**/results.parquet", recursive=True):
        d = pd.read_parquet(f)
        d["tree"] = name
        rows.append(d)
d = pd.concat(rows)
keys = ["op", "kv_format", "batch", "context"]
t = d.pivot_table(index=keys, columns="tree", values="median_us", aggfunc="first")
t["new/old"] = (t["new1"] + t["new2"]) / (t["old1"] + t["old2"])
print(t.round(3).to_string())
print("verified:", d["verified"].all() if "verified" in d else "n/a")
PY
cat "$R/summary.txt"
