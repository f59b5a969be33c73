#!/usr/bin/env bash
# The decode step (batch 32 x 32K, MTP 3, the three format pairs) with the committed code and
# tables (a copy in OLD) and with the stacked scorer keyed by requests x groups, in turn, twice,
# in one call; then the headline suite on the new code.
# Usage: bash THIS_SCRIPT OLD_TREE OUT_DIR
set -u
export PYTHONUNBUFFERED=1
OLD=${1:?usage: device_step.sh OLD_TREE OUT_DIR}; R=${2:?}; mkdir -p "$R"
step() { local name=$1 tree=$2
  (cd "$tree" && PYTHONPATH=$PWD timeout 150 python3 -m qsa.cli step --batch 32 --context 32K \
    --mtp 3 --formats bf16/bf16,fp8/fp8,mxfp4/fp8 --out "$R/store_$name") > "$R/step_$name.log" 2>&1
  echo "rc=$?" >> "$R/step_$name.log"; grep -E "step|rc=" "$R/step_$name.log" | tail -8; }
step old1 "$OLD"; step new1 "$PWD"; step old2 "$OLD"; step new2 "$PWD"
PYTHONPATH=$PWD timeout 250 python3 -m qsa.cli bench --suite headline --out "$R/store_suite" \
  > "$R/suite.log" 2>&1; echo "rc=$?" >> "$R/suite.log"; tail -3 "$R/suite.log"
