#!/usr/bin/env bash
# The third device run, on top of the tables the second wrote (`device_final.sh`): the BF16
# entry of the 4,096-row bucket at 2 stages too (the bucket every short prefill and the
# 4,096-row chunk use, and whose tiles a decoded launch of those rows takes), then the
# FP8/MXFP4 decode thresholds again, the committed code and tables against the new ones, and
# the prefill chunk roll-up. Usage: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_final2.sh OUT_DIR}; mkdir -p "$R/store"
D=profiles/nvidia-h200/bench/scorers/prefill-dense-keys
tune() { local name=$1; shift
  python3 -m qsa.cli tune score_prefill --batch 1 --write --out "$R/store" "$@" \
    > "$R/tune_$name.log" 2>&1; echo "rc=$?" >> "$R/tune_$name.log"; }
tune bf16_4k_8k_stages2 --context 8K --rows 4096 --index-format bf16 \
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
timeout 200 python3 -m qsa.cli step --phase prefill --rows 4096 --context 64K \
  --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store" > "$R/step_prefill.log" 2>&1
echo "rc=$?" >> "$R/step_prefill.log"
