#!/usr/bin/env bash
# The committed numbers after top-k's earlier score request: the headline suite and the decode
# step (batch 32 x 32K, MTP 3, the three format pairs) on the final code, then one verified
# top-k launch at the step's verify shape under ncu (full set, detail page, per-opcode summary).
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_final.sh OUT_DIR}; mkdir -p "$R"
timeout 300 python3 -m qsa.cli bench --suite headline --out "$R/store" > "$R/suite.log" 2>&1
echo "rc=$?" >> "$R/suite.log"; tail -3 "$R/suite.log"
timeout 150 python3 -m qsa.cli step --batch 32 --context 32K --mtp 3 \
  --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store" > "$R/step.log" 2>&1
echo "rc=$?" >> "$R/step.log"; grep -E "step|rc=" "$R/step.log" | tail -8
NCU=/usr/local/cuda/bin/ncu
P=profiles/nvidia-h200/bench/attention/sweep-slots/ncu_point.py
S=profiles/nvidia-h200/bench/attention/occupancy/ncu/sass_summary.py
n=topk_b32_32k
timeout 120 $NCU --set full -o "$R/$n" --launch-skip 1 --launch-count 1 -k regex:qsa_topk \
  python3 $P topk_expand bf16 32 32768 4 > "$R/${n}_run.log" 2>&1
$NCU -i "$R/$n.ncu-rep" --page details > "$R/${n}_details.txt" 2>&1
$NCU -i "$R/$n.ncu-rep" --page source --csv --print-source sass > "$R/${n}_sass.csv" 2>&1
python3 $S "$R/${n}_sass.csv" "$R/${n}_sass_by_opcode.csv" > "$R/${n}_stalls.txt" 2>&1
rm -f "$R/${n}_sass.csv" "$R/$n.ncu-rep"
grep -E "Duration|Registers Per|Achieved Occ|Executed Ipc A|Issue Slots Busy" "$R/${n}_details.txt"
