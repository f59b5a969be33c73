#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=$OUT/c11; mkdir -p $O
pk() { (cd $OUT && tar czf c11.tgz c11); }
NCU=/usr/local/cuda/bin/ncu
P=profiles/nvidia-h200/bench/attention/sweep-slots/ncu_point.py
S=profiles/nvidia-h200/bench/attention/occupancy/ncu/sass_summary.py
prof() { local n=$1 k=$2; shift 2; local t0=$SECONDS
  timeout 110 $NCU --set full -o $O/$n --launch-skip 1 --launch-count 1 -k regex:$k python3 $P "$@" > $O/${n}_run.log 2>&1
  echo "ncu $n rc=$? $((SECONDS-t0)) s" | tee -a $O/steps.txt
  $NCU -i $O/$n.ncu-rep --page details > $O/${n}_details.txt 2>&1
  $NCU -i $O/$n.ncu-rep --page source --csv --print-source sass > $O/${n}_sass.csv 2>&1
  python3 $S $O/${n}_sass.csv $O/${n}_sass_by_opcode.csv > $O/${n}_stalls.txt 2>&1
  rm -f $O/$n.ncu-rep $O/${n}_sass.csv; pk; }
prof scorer_fp8_b64 qsa_score_stacked score_stacked fp8 64 131072 4
prof sgqa_bf16_b8 qsa_sparse_gqa_decode sparse_gqa_decode bf16 8 131072 4
grep -E "Duration|Registers Per|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|DRAM Throughput|Memory Throughput|Executed Instructions  |Theoretical Occupancy|Block Limit" $O/*_details.txt
