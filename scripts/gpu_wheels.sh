#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, for scripts/gpu_check.sh to install there.
#
#   bash scripts/gpu_wheels.sh          download what is missing into .whl/ (git ignores it)
#   bash scripts/gpu_wheels.sh --check  only check .whl/ (the set, one version each, the size)
#
# That machine (the device tool's nvidia-h200) has Python 3.12, CUDA torch 2.11 (cu130),
# nvidia-ml-py, numpy, pandas, click, cloudpickle, fsspec, jinja2, msgpack, packaging,
# psutil, pyyaml, sortedcontainers, toolz and cuda-core/cuda-bindings (KINDS.md's list),
# and no network. It lacks Dask, dask-cuda and tensordict, and these of their needs:
# tornado, tblib, zict, locket, partd, pyvers. Each is pinned below for Python 3.12 on
# manylinux x86-64 (pip download --only-binary=:all: --python-version 3.12 --platform ...):
# dask/distributed 2026.7.1, the release dask-cuda 26.10 pins (this package allows
# >=2026.7.1,<2026.9); dask-cuda 26.10 for CUDA 13 (its cu13 extra adds only cuda-core,
# which the image has); tensordict 0.15.3, pure Python, for torch>=2.11.
# fallback/ holds cuda-core, installed there only if the image's cannot give dask-cuda
# `from cuda.core import Device`.
#
# Not carried: distributed-ucxx-cu13 for protocol="ucx" (with ucxx, libucxx, libucx, rmm
# and librmm it is about 55 MiB: it does not fit in one run beside this set and the tree).
#
# pip's cache and the files already in .whl/ make a second run a check without downloads.
# The set and the tree must stay under the device tool's 64 MiB per run, with room left.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${HF_GPU_WHEELS:-$ROOT/.whl}"
LIMIT_MIB="${HF_GPU_CARRY_LIMIT_MIB:-64}"  # the device tool's limit for one run
ROOM_MIB="${HF_GPU_CARRY_ROOM_MIB:-8}"     # left for the tree growing after the download
PIP=("${PYTHON:-python3}" -m pip)

BASE=(
  "dask==2026.7.1"
  "distributed==2026.7.1"
  "dask-cuda==26.10.0"
  "tensordict==0.15.3"
  "pyvers==0.2.3"
  "tornado==6.6.1"
  "tblib==3.2.2"
  "zict==3.0.0"
  "locket==1.0.0"
  "partd==1.4.2"
)
FALLBACK=(
  "cuda-core==1.2.2"
)
PLATFORM=(
  --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312
  --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any
)

check_only=0
case "${1:-}" in
  --check) check_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

# The distribution name as a wheel file starts with it (PEP 427: '-' and '.' become '_').
wheel_prefix() { local spec="$1"; local name="${spec%%==*}"; local version="${spec#*==}"
  echo "${name//-/_}-${version}-"; }

download() {  # folder, specs...; pip's notes about unusable index locations are dropped
  local folder="$1"; shift
  "${PIP[@]}" download -q "${PLATFORM[@]}" -d "$folder" "$@" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  return "${PIPESTATUS[0]}"
}
if [[ $check_only -eq 0 ]]; then
  mkdir -p "$DEST/fallback"
  download "$DEST" "${BASE[@]}"
  download "$DEST/fallback" "${FALLBACK[@]}"
fi

status=0
check_set() {  # folder, specs...: exactly one wheel per spec, nothing else
  local folder="$1"; shift
  local expected=0
  for spec in "$@"; do
    local prefix; prefix="$(wheel_prefix "$spec")"
    local found; found=$(find "$folder" -maxdepth 1 -type f -name "${prefix}*.whl" | wc -l)
    if [[ $found -ne 1 ]]; then
      echo "gpu_wheels: $folder has $found wheel(s) of $spec (want 1)" >&2; status=1
    fi
    expected=$((expected + 1))
  done
  local total; total=$(find "$folder" -maxdepth 1 -type f -name '*.whl' | wc -l)
  if [[ $total -ne $expected ]]; then
    echo "gpu_wheels: $folder has $total wheels, the set is $expected: remove the others" >&2
    status=1
  fi
}
if [[ ! -d "$DEST" ]]; then
  echo "gpu_wheels: no $DEST; run bash scripts/gpu_wheels.sh" >&2
  exit 1
fi
check_set "$DEST" "${BASE[@]}"
check_set "$DEST/fallback" "${FALLBACK[@]}"

wheels_bytes=$(find "$DEST" -type f -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
tree_bytes=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 -r stat -c '%s' 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
budget=$(( (LIMIT_MIB - ROOM_MIB) * 1048576 ))
echo "gpu_wheels: $(find "$DEST" -type f -name '*.whl' | wc -l) wheels, $(mib "$wheels_bytes") MiB" \
  "(fallback/ $(mib "$(find "$DEST/fallback" -type f -name '*.whl' -printf '%s\n' \
  | awk '{s += $1} END {print s + 0}')") MiB); the tree $(mib "$tree_bytes") MiB;" \
  "together $(mib $((wheels_bytes + tree_bytes))) of ${LIMIT_MIB} MiB (${ROOM_MIB} MiB kept free)"
if (( wheels_bytes + tree_bytes > budget )); then
  echo "gpu_wheels: wheels and tree exceed $((LIMIT_MIB - ROOM_MIB)) MiB" >&2
  status=1
fi
exit $status
