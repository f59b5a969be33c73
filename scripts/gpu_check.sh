#!/usr/bin/env bash
# Runs everything that needs a GPU: the GPU-marked tests (real bf16 / FP8 numerics at larger
# shapes), the device ceilings, and the kernel benchmarks. Usage:
#   scripts/gpu_check.sh OUT_DIR [--quick]
# Uses the python on PATH as it is (GPU hosts bring their own torch/triton builds); results land
# in OUT_DIR and, through the results store, under profiles/<device>/.
set -uo pipefail
out="${1:?usage: scripts/gpu_check.sh OUT_DIR [--quick]}"
quick="${2:-}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$out"
cd "$root"
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() {  # step NAME CMD...: run, log, remember failure, keep going
  local name="$1"; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
python3 - <<'EOF' > "$out/env.txt" 2>&1
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__)
print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
cat "$out/env.txt"
step ceilings python3 -m qsa.cli ceilings --measure
step gpu_tests python3 -m pytest -m "gpu or on_gpu_too" -q -p no:cacheprovider
# Benchmarks: the workbench's suites (results store under profiles/, targets.json and
# targets.md next to each run), then the page-offload benchmark, which is not a kernel op.
# --quick runs the headline suite only.
suites="headline"
[ -z "$quick" ] && suites="headline attention decode prefill"
for s in $suites; do
  step "suite_$s" python3 -m qsa.cli bench --suite "$s" --out profiles
done
step bench_offload python3 scripts/bench_offload.py --out "$out/bench_offload" $quick
exit $status
