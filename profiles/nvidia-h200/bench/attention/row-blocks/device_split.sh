#!/usr/bin/env bash
# Where a row-block call's time goes (split_time.py at 16K), then the prefill chunk roll-up
# (4,096 rows at 64K, every QSA layer, BF16 and FP8) on the current code and tables.
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_split.sh OUT_DIR}; mkdir -p "$R"
D=profiles/nvidia-h200/bench/attention/row-blocks
timeout 200 python3 $D/split_time.py 16384 > "$R/split_time_16k.txt" 2>&1
echo "rc=$?" >> "$R/split_time_16k.txt"; grep -E "ROWS=|rc=" "$R/split_time_16k.txt"
timeout 300 python3 -m qsa.cli step --phase prefill --rows 4096 --context 64K \
  --formats bf16/bf16,fp8/fp8 --out "$R/store" > "$R/step_prefill.log" 2>&1
echo "rc=$?" >> "$R/step_prefill.log"; grep -E "step|rc=" "$R/step_prefill.log" | tail -8
