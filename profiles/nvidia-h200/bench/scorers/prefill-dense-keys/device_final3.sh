#!/usr/bin/env bash
# The fourth device run: the FP8/MXFP4 decode thresholds through `qsa tune --write`, now that
# a candidate's decoded launch takes the BF16 entry's tiles as the tables' launch does (the
# third run timed them on the candidates' own tiles), the prefill GPU tests, the committed code
# and tables against the new ones, top-k at the prefill chunk's shape (4,096 rows x 16K
# candidates, until now served by the verify call's 8K entry) and the chunk roll-up.
# Usage: bash THIS_SCRIPT OUT_DIR
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=${1:?usage: device_final3.sh OUT_DIR}; mkdir -p "$R/store"
D=profiles/nvidia-h200/bench/scorers/prefill-dense-keys
tune() { local name=$1 op=$2; shift 2
  timeout 150 python3 -m qsa.cli tune $op --batch 1 --write --out "$R/store" "$@" \
    > "$R/tune_$name.log" 2>&1; echo "rc=$?" >> "$R/tune_$name.log"; }
for f in fp8 mxfp4; do
  tune ${f}_8k_decode2048 score_prefill --context 8K --rows 4096 --index-format $f \
    --candidates '[{"meta": {"DECODE_MIN_GROUPS": 2048}}]'
  tune ${f}_4k_decode1024 score_prefill --context 4K --rows 4096 --index-format $f \
    --candidates '[{"meta": {"DECODE_MIN_GROUPS": 1024}}]'
done
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernel_scorers.py -k prefill \
  > "$R/gpu_tests.log" 2>&1; echo "rc=$?" >> "$R/gpu_tests.log"
AB_QUICK=1 timeout 200 python3 $D/ab_dense_keys.py ab_old "$R/ab_final.jsonl" > "$R/ab_final.log" 2>&1
echo "ab rc=$?" >> "$R/ab_final.log"
tune topk_prefill_4k_64k topk_expand --context 64K --rows 4096 --max-candidates 16
cp qsa/configs/tables/score_prefill.json qsa/configs/tables/topk.json "$R/"
timeout 200 python3 -m qsa.cli step --phase prefill --rows 4096 --context 64K \
  --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store" > "$R/step_prefill.log" 2>&1
echo "rc=$?" >> "$R/step_prefill.log"
