#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine, bounded to 8 minutes.
#
#   bash scripts/gpu_check.sh            on the GPU machine, from the repository root
#   bash scripts/gpu_check.sh --dry-run  here: everything that runs without a GPU
#
# Real run (needs the wheels of scripts/gpu_wheels.sh in .whl/, carried along):
#   1. setup:  the machine (python, torch, nvidia-smi), the wheels installed with
#              pip --no-index --no-deps --target into a folder put first on PYTHONPATH (the
#              repository itself second: nothing is built), the imports checked; cuda-core
#              from .whl/fallback/ only if the image's cannot serve dask-cuda
#   2. pytest: pytest -m gpu over tests/gpu and the suite's other GPU tests
#   3. bench:  benchmarks/bench_gpu.py (table + JSON)
#   4. demo:   scripts/gpu_demo.py, the GRPO demo with the policy on the GPU
# HF_GPU_CHECK_STEPS (default "pytest,bench,demo") picks the steps after setup, and
# HF_GPU_CHECK_PYTEST_ARGS adds to pytest's arguments (e.g. "-k chain"), for a shorter
# second run of what failed. NCCL_SOCKET_IFNAME defaults to lo (one host). Each step has its own timeout and all of
# them share one budget (HF_GPU_CHECK_BUDGET_S, 465 s), so the whole run ends inside 8
# minutes whatever hangs. Everything is written
# under $OUT (the device tool's folder; default out/gpu_check), at most 8 files:
# setup.log, pytest.log, bench_gpu.json, bench_gpu.txt, demo.log, demo/metrics.json,
# demo/reward.png, summary.txt. The exit status is 0 only if every step passed.
#
# Dry run: checks .whl/ (downloading it with scripts/gpu_wheels.sh if it is missing or
# incomplete), installs the wheels into a throwaway folder for Python 3.12 on manylinux
# x86-64 (pip install --target with --python-version/--platform), runs the same pytest
# command and checks that every GPU test is skipped with its reason, and checks that the
# benchmark and the demo print their plans (--dry-run) and refuse to run without a GPU.
# Exit status 75 when the wheels could not be downloaded (no network).
set -u -o pipefail

DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${HF_GPU_WHEELS:-$ROOT/.whl}"
OUT="${OUT:-$ROOT/out/gpu_check}"
BUDGET="${HF_GPU_CHECK_BUDGET_S:-465}"
STEPS=",${HF_GPU_CHECK_STEPS:-pytest,bench,demo},"
read -r -a PYTEST_EXTRA <<<"${HF_GPU_CHECK_PYTEST_ARGS:-}"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/hf_gpu_check.XXXXXX")"
SITE="$SCRATCH/site"
SUMMARY="$OUT/summary.txt"
LAST_OUTPUT=""
PYTEST_PATHS=(tests/gpu tests/protocol/test_serialization.py tests/dask/test_cluster.py)
PLATFORM=(
  --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any
)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
trap 'rm -rf "$SCRATCH"' EXIT
: >"$SUMMARY"
failed=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME BUDGET_S LOG COMMAND...: run COMMAND under timeout, its output appended to LOG
step() {
  local name="$1" budget="$2" log="$3"; shift 3
  local left=$((BUDGET - SECONDS - 5))
  local limit=$((budget < left ? budget : left))
  if ((limit < 10)); then
    note "$name: NOT RUN (the ${BUDGET}s budget is spent)"; failed=1; return 1
  fi
  local started=$SECONDS
  echo "== $name: $* (limit ${limit}s)" >>"$log"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - started))
  if ((rc == 0)); then
    note "$name: ok (${took}s)"
  elif ((rc == 124 || rc == 137)); then
    note "$name: TIMED OUT after ${limit}s (see $(basename "$log"))"; failed=1
  else
    note "$name: FAILED, exit status $rc (${took}s; see $(basename "$log"))"; failed=1
  fi
  return $rc
}

plugin_args() {  # the project's pytest plugin, unless an installed copy already registers it
  if "$PY" - <<'EOF' 2>/dev/null; then
import importlib.metadata as m, sys
sys.exit(0 if any(e.value.startswith("hybridflow_dask.testing")
                  for e in m.entry_points(group="pytest11")) else 1)
EOF
    return 0
  fi
  echo "-p hybridflow_dask.testing"
}

expect() {  # expect NAME WANTED_STATUS PATTERN LOG COMMAND...: the status and a line matching
  local name="$1" wanted="$2" pattern="$3" log="$4"; shift 4
  echo "== $name: $*" >>"$log"
  local output rc
  output="$(timeout -k 5 60 "$@" 2>&1)"; rc=$?
  echo "$output" >>"$log"
  LAST_OUTPUT="$output"
  if ((rc == wanted)) && grep -Eq "$pattern" <<<"$output"; then
    note "$name: ok (exit status $rc, says: $(grep -Em1 "$pattern" <<<"$output"))"
  else
    note "$name: FAILED (exit status $rc, wanted $wanted and /$pattern/; see $(basename "$log"))"
    failed=1
  fi
}

# -- dry run ----------------------------------------------------------------------------------

if ((DRY_RUN)); then
  LOG="$OUT/dry_run.log"
  : >"$LOG"
  note "gpu_check --dry-run: $("$PY" --version 2>&1) at $PY; out $OUT"
  if ! bash scripts/gpu_wheels.sh --check >>"$LOG" 2>&1; then
    if ! PYTHON="$PY" bash scripts/gpu_wheels.sh >>"$LOG" 2>&1; then
      note "wheels: DOWNLOAD FAILED (scripts/gpu_wheels.sh; see dry_run.log)"
      exit 75
    fi
  fi
  step "wheels: the set, one version each, within the carry limit" 60 "$LOG" \
    bash scripts/gpu_wheels.sh --check
  step "install: into a throwaway folder for cp312 manylinux" 120 "$LOG" \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    "${PLATFORM[@]}" --target "$SITE" "$WHEELS"/*.whl
  missing=""
  for module in dask distributed dask_cuda tensordict tornado tblib zict locket partd pyvers; do
    [[ -e "$SITE/$module" || -e "$SITE/$module.py" ]] || missing+=" $module"
  done
  if [[ -z "$missing" ]]; then note "install: every module is in place"; else
    note "install: MISSING$missing"; failed=1; fi
  step "install: the fallback cuda-core" 60 "$LOG" \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    "${PLATFORM[@]}" --target "$SCRATCH/fallback" "$WHEELS"/fallback/*.whl
  # shellcheck disable=SC2046
  expect "pytest -m gpu: every GPU test skipped with its reason" 0 \
    "needs a CUDA GPU" "$LOG" "$PY" -m pytest -m gpu "${PYTEST_PATHS[@]}" -q -rs \
    -p no:cacheprovider $(plugin_args)
  if grep -Eq "[0-9]+ (passed|failed|errors?|xfailed|xpassed)" <<<"$LAST_OUTPUT"; then
    note "pytest -m gpu: FAILED (a GPU test ran or failed here)"; failed=1
  fi
  expect "bench_gpu --dry-run: the plan" 0 "bench_gpu plan: [0-9]+ cases" "$LOG" \
    "$PY" benchmarks/bench_gpu.py --dry-run --repeats 3 --out "$OUT/bench_gpu.json"
  expect "bench_gpu: refuses without a GPU" 2 "needs a CUDA GPU" "$LOG" \
    "$PY" benchmarks/bench_gpu.py --out "$OUT/bench_gpu.json"
  expect "gpu_demo --dry-run: the plan" 0 "gpu_demo plan: " "$LOG" \
    "$PY" scripts/gpu_demo.py --dry-run --out "$OUT/demo"
  expect "gpu_demo: refuses without a GPU" 2 "needs a CUDA GPU" "$LOG" \
    "$PY" scripts/gpu_demo.py --out "$OUT/demo"
  note "gpu_check --dry-run: $([[ $failed -eq 0 ]] && echo PASSED || echo FAILED) in ${SECONDS}s"
  exit $failed
fi

# -- the real run -----------------------------------------------------------------------------

SETUP="$OUT/setup.log"
: >"$SETUP"
note "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET}s, out $OUT"
{
  echo "== machine"
  "$PY" --version
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count())" || true
  "$PY" -m pip list 2>/dev/null | grep -Ei "^(cuda-|numpy|pandas|nvidia-ml|numba|pytest)" || true
} >>"$SETUP" 2>&1
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  note "setup: FAILED, no wheels in $WHEELS: run bash scripts/gpu_wheels.sh here and carry .whl"
  exit 1
fi
step "setup: install the carried wheels" 90 "$SETUP" \
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --disable-pip-version-check --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# One host: NCCL's bootstrap on loopback (the machine may have no other usable interface).
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
if ! "$PY" -c "import dask_cuda" >>"$SETUP" 2>&1; then
  step "setup: the fallback cuda-core for dask-cuda" 60 "$SETUP" \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --upgrade --target "$SITE" "$WHEELS"/fallback/*.whl
fi
step "setup: imports" 60 "$SETUP" "$PY" -c "
import dask, distributed, dask_cuda, tensordict, torch, hybridflow_dask
from hybridflow_dask.backends.dask.driver.cluster import probe_local_cluster
print('dask', dask.__version__, 'distributed', distributed.__version__,
      'dask_cuda', dask_cuda.__version__, 'tensordict', tensordict.__version__)
print('cluster choice:', probe_local_cluster())
assert torch.cuda.is_available(), 'torch sees no GPU'
" || failed=1

if [[ $STEPS == *,pytest,* ]]; then
  # shellcheck disable=SC2046
  step "pytest -m gpu" 200 "$OUT/pytest.log" "$PY" -m pytest -m gpu "${PYTEST_PATHS[@]}" \
    -rA -p no:cacheprovider $(plugin_args) "${PYTEST_EXTRA[@]}"
  tail -n 40 "$OUT/pytest.log" \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|passed|failed" >>"$SUMMARY" || true
  if grep -q "needs a CUDA GPU" "$OUT/pytest.log"; then
    note "pytest -m gpu: FAILED (GPU tests were skipped: torch saw no GPU in pytest)"; failed=1
  fi
fi

if [[ $STEPS == *,bench,* ]]; then
  step "bench_gpu" 150 "$OUT/bench_gpu.txt" \
    "$PY" benchmarks/bench_gpu.py --repeats 3 --out "$OUT/bench_gpu.json"
  grep -E "^(case|noop|dp |chain)" "$OUT/bench_gpu.txt" >>"$SUMMARY" || true
fi

if [[ $STEPS == *,demo,* ]]; then
  step "demo on the GPU" 75 "$OUT/demo.log" \
    "$PY" scripts/gpu_demo.py --steps 60 --out "$OUT/demo"
  grep -E "^reward:" "$OUT/demo.log" >>"$SUMMARY" || true
fi

nvidia-smi --query-gpu=memory.used --format=csv >>"$SETUP" 2>&1 || true
note "gpu_check: $([[ $failed -eq 0 ]] && echo PASSED || echo FAILED) in ${SECONDS}s"
cat "$SUMMARY"
exit $failed
