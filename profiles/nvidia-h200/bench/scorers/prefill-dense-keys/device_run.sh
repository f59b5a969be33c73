#!/usr/bin/env bash
# This folder's device run, from the repository root on the GPU host (ab_old/ holds the
# committed qsa/): the prefill GPU tests, the decode-once tests under memcheck, the A/B and
# ncu profiles of the BF16 scorer and of the FP8 scorer over dense decoded keys at 16K x 64K.
# Usage: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_run.sh OUT_DIR}; mkdir -p "$R"
D=profiles/nvidia-h200/bench/scorers/prefill-dense-keys
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton, sys; print(torch.__version__, triton.__version__, sys.version)"
} > "$R/device.txt" 2>&1
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_scorers.py -k prefill \
  > "$R/gpu_tests.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests.log"
/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest \
  -m gpu -q -p no:cacheprovider tests/test_kernel_scorers.py -k decode_once \
  > "$R/memcheck_decode_once.log" 2>&1; echo "memcheck rc=$?" >> "$R/memcheck_decode_once.log"
timeout 330 python3 $D/ab_dense_keys.py ab_old "$R/ab_dense_keys.jsonl" > "$R/ab_dense_keys.log" 2>&1
echo "ab rc=$?" >> "$R/ab_dense_keys.log"
NCU=/usr/local/cuda/bin/ncu
P=profiles/nvidia-h200/bench/attention/sweep-slots/ncu_point.py
S=profiles/nvidia-h200/bench/attention/occupancy/ncu/sass_summary.py
prof() { local n=$1 k=$2; shift 2
  timeout 100 $NCU --set full -o "/tmp/$n" --launch-skip 1 --launch-count 1 -k regex:$k \
    python3 $P "$@" > "$R/${n}_run.log" 2>&1
  $NCU -i "/tmp/$n.ncu-rep" --page details > "$R/${n}_details.txt" 2>&1
  $NCU -i "/tmp/$n.ncu-rep" --page source --csv --print-source sass > "/tmp/${n}_sass.csv" 2>&1
  python3 $S "/tmp/${n}_sass.csv" "$R/${n}_sass_by_opcode.csv" > "$R/${n}_stalls.txt" 2>&1; }
prof prefill_bf16_16k_64k qsa_score_prefill_FMTbf16 score_prefill bf16 1 65536 16384
prof prefill_fp8_16k_64k qsa_score_prefill_FMTfp8 score_prefill fp8 1 65536 16384
