#!/usr/bin/env bash
# Runs everything that needs a GPU: the GPU-marked tests (real bf16 / FP8 numerics at larger
# shapes), the device ceilings, the kernel benchmarks and, where compute-sanitizer is found,
# the kernels under its memory checker; without --quick also the slow tests that the default
# CPU lane leaves to `scripts/test.sh --full`. Usage:
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
# The slow lane (`scripts/test.sh --full` less what the default lane runs), with this python.
[ -z "$quick" ] && step slow_tests python3 -m pytest -m "slow and not gpu" -q -p no:cacheprovider
# Benchmarks: the workbench's suites (results store under profiles/, targets.json and
# targets.md next to each run), then the page-offload benchmark, which is not a kernel op.
# --quick runs the headline suite only.
suites="headline"
[ -z "$quick" ] && suites="headline attention decode prefill"
for s in $suites; do
  step "suite_$s" python3 -m qsa.cli bench --suite "$s" --out profiles
done
step bench_offload python3 scripts/bench_offload.py --out "$out/bench_offload" $quick
# Memory checker (full run only): every op of the smoke suite once, verified, no timing, and
# the GPU tests of what a smoke shape does not reach (sparse GQA's slot pre-pass, PV by
# head-dim halves, programmatic dependent launch and the Gluon kernel, the K/V store's exponent
# range), under compute-sanitizer memcheck when the host has it.
sanitizer="$(command -v compute-sanitizer || true)"
for dir in "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -z "$sanitizer" ] && [ -n "$dir" ] && [ -x "$dir/bin/compute-sanitizer" ] \
    && sanitizer="$dir/bin/compute-sanitizer"
done
if [ -n "$quick" ]; then
  :
elif [ -z "$sanitizer" ]; then
  echo "=== memcheck: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin): skipped"
else
  memcheck=("$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20)
  step memcheck_smoke "${memcheck[@]}" python3 -m qsa.cli bench --suite smoke --verify-only \
    --out "$out/memcheck_store"
  step memcheck_tests "${memcheck[@]}" python3 -m pytest -m "gpu or on_gpu_too" -q \
    -p no:cacheprovider tests/test_kernel_sparse_gqa.py tests/test_kernel_kv_quant.py \
    -k "(test_gpu_decode and flash-next-8) or test_gpu_decode_pdl or gluon_graph or exponent_range"
fi
exit $status
