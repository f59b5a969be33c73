#!/usr/bin/env bash
# The two ncu profiles of this folder and of ../../attention/small-batch/ (sgqa_bf16_b8_*):
# one verified launch each, the full ncu set, the detail page and the per-opcode summary.
# Usage, from the repository root on the GPU host: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${1:?usage: ncu_calls.sh OUT_DIR}; mkdir -p "$O"
NCU=/usr/local/cuda/bin/ncu
P=profiles/nvidia-h200/bench/attention/sweep-slots/ncu_point.py
S=profiles/nvidia-h200/bench/attention/occupancy/ncu/sass_summary.py
prof() { local n=$1 k=$2; shift 2
  timeout 110 $NCU --set full -o "$O/$n" --launch-skip 1 --launch-count 1 -k regex:$k python3 $P "$@" > "$O/${n}_run.log" 2>&1
  $NCU -i "$O/$n.ncu-rep" --page details > "$O/${n}_details.txt" 2>&1
  $NCU -i "$O/$n.ncu-rep" --page source --csv --print-source sass > "$O/${n}_sass.csv" 2>&1
  python3 $S "$O/${n}_sass.csv" "$O/${n}_sass_by_opcode.csv" > "$O/${n}_stalls.txt" 2>&1; }
# ncu names Triton kernels by their repr (qsa_<kernel>_<constexprs>).
prof scorer_fp8_b64 qsa_score_stacked score_stacked fp8 64 131072 4
prof sgqa_bf16_b8 qsa_sparse_gqa_decode sparse_gqa_decode bf16 8 131072 4
