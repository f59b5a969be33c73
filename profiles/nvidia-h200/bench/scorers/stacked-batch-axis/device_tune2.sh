#!/usr/bin/env bash
# Second pass at the step's batch-32 x 32K call: the FP8 and MXFP4 winners of the first pass
# were seeds (the batch-64 entries), so their own neighbours were never timed; tune again from
# them (--write), then the step with the tables before (OLD) and after, alternated twice.
# Usage: bash THIS_SCRIPT OLD_TREE OUT_DIR
set -u
export PYTHONUNBUFFERED=1
OLD=${1:?usage: device_tune2.sh OLD_TREE OUT_DIR}; R=${2:?}; mkdir -p "$R"
for f in fp8 mxfp4 bf16; do
  PYTHONPATH=$PWD timeout 150 python3 -m qsa.cli tune score_stacked --batch 32 --context 32K \
    --rows 4 --index-format $f --max-candidates 24 --write --out "$R/store_tune" \
    > "$R/tune2_$f.log" 2>&1
  echo "rc=$?" >> "$R/tune2_$f.log"; tail -2 "$R/tune2_$f.log"
done
cp qsa/configs/tables/score_stacked.json "$R/"
step() { local name=$1 tree=$2
  (cd "$tree" && PYTHONPATH=$PWD timeout 150 python3 -m qsa.cli step --batch 32 --context 32K \
    --mtp 3 --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store_$name") > "$R/step_$name.log" 2>&1
  echo "rc=$?" >> "$R/step_$name.log"; tail -1 "$R/step_$name.log"; }
if ! cmp -s qsa/configs/tables/score_stacked.json "$OLD/qsa/configs/tables/score_stacked.json"; then
  step old1 "$OLD"; step new1 "$PWD"; step old2 "$OLD"; step new2 "$PWD"
fi
