#!/usr/bin/env bash
# The second device run, from the repository root on the GPU host (ab_old/ holds the committed
# qsa/): the sm90 table changes the first run pointed to, each written by `qsa tune --write`
# (every candidate verified, the winner re-timed in a fresh process against the entry), then
# the committed code and tables against the new ones, the prefill GPU tests, the prefill
# chunk roll-up and the headline suite. Usage: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_final.sh OUT_DIR}; mkdir -p "$R/store"
D=profiles/nvidia-h200/bench/scorers/prefill-dense-keys
tune() { local name=$1; shift
  python3 -m qsa.cli tune score_prefill --batch 1 --write --out "$R/store" "$@" \
    > "$R/tune_$name.log" 2>&1; echo "rc=$?" >> "$R/tune_$name.log"; }
tune bf16_16k_stages2 --context 16K --rows 16384 --index-format bf16 \
  --candidates '[{"num_stages": 2}]'
for f in fp8 mxfp4; do
  tune ${f}_8k_decode2048 --context 8K --rows 4096 --index-format $f \
    --candidates '[{"meta": {"DECODE_MIN_GROUPS": 2048}}]'
  tune ${f}_4k_decode1024 --context 4K --rows 4096 --index-format $f \
    --candidates '[{"meta": {"DECODE_MIN_GROUPS": 1024}}]'
done
cp qsa/configs/tables/score_prefill.json "$R/"
AB_QUICK=1 timeout 200 python3 $D/ab_dense_keys.py ab_old "$R/ab_final.jsonl" > "$R/ab_final.log" 2>&1
echo "ab rc=$?" >> "$R/ab_final.log"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_scorers.py -k prefill \
  > "$R/gpu_tests.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests.log"
timeout 200 python3 -m qsa.cli step --phase prefill --rows 4096 --context 64K \
  --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store" > "$R/step_prefill.log" 2>&1
echo "rc=$?" >> "$R/step_prefill.log"
timeout 150 python3 -m qsa.cli bench --suite headline --out "$R/store" > "$R/suite.log" 2>&1
echo "rc=$?" >> "$R/suite.log"
