#!/usr/bin/env bash
# Build a wheelhouse for a GPU host without internet access: every dependency of the package
# (pyproject.toml [project.dependencies] and the extras scripts/test.sh installs, dev and
# cluster (ray), plus the setuptools the editable
# install builds with) downloaded as wheels for the *target's* Python version and platform.
# torch and triton are left out by default: GPU hosts bring their own CUDA/ROCm builds.
# Every other package at the version of constraints.txt, the one scripts/bootstrap.sh installs.
#
#   scripts/wheelhouse.sh [--python 3.11] [--platform manylinux_2_28_x86_64] [--out wheelhouse]
#                         [--extras dev,cluster,lab] [--with-torch] [--list]
#
# --list prints the requirements and exits (no network). See docs/offline.md for the install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pyver="3.11"
platform="manylinux_2_28_x86_64"
out="$root/wheelhouse"
extras="dev,cluster"
with_torch=0
list_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) pyver="$2"; shift 2 ;;
    --platform) platform="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --extras) extras="$2"; shift 2 ;;
    --with-torch) with_torch=1; shift ;;
    --list) list_only=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
py="${QSA_PYTHON:-python3}"
reqs="$("$py" - "$root/pyproject.toml" "$extras" "$with_torch" <<'PY'
import re, sys, tomllib
pyproject, extras, with_torch = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
data = tomllib.load(open(pyproject, "rb"))
reqs = list(data["project"]["dependencies"])
for extra in filter(None, extras.split(",")):
    reqs += data["project"].get("optional-dependencies", {}).get(extra, [])
reqs += data["build-system"]["requires"] + ["wheel"]  # the editable install builds offline
skip = set() if with_torch else {"torch", "triton"}
for r in reqs:
    if re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower() not in skip:
        print(r)
PY
)"
if [ "$list_only" = 1 ]; then
  echo "$reqs"
  exit 0
fi
mkdir -p "$out"
# manylinux_2_28 hosts also take the older manylinux tags; pure-Python wheels are "any".
case "$platform" in *x86_64) arch=x86_64 ;; *aarch64) arch=aarch64 ;; *) arch="" ;; esac
plats=(--platform "$platform")
case "$platform" in
  manylinux_2_28_*) plats+=(--platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch") ;;
  manylinux_2_17_*) plats+=(--platform "manylinux2014_$arch") ;;
esac
mapfile -t req_array <<< "$reqs"
"$py" -m pip download --dest "$out" --only-binary=:all: --implementation cp \
  --python-version "$pyver" "${plats[@]}" -c "$root/constraints.txt" "${req_array[@]}"
echo "wheelhouse: $out ($(ls "$out" | wc -l) files) for Python $pyver on $platform" >&2
