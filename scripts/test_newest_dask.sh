#!/usr/bin/env bash
# Run the test suite against the newest dask/distributed on PyPI, past pyproject's upper pin.
#
# The Dask backend uses a few private Dask APIs (all in hybridflow_dask/backends/dask/
# internals.py, each with a canary in tests/dask/test_dask_internals.py), so pyproject.toml
# caps dask[distributed] at the releases the suite passed on. To move the cap: run this;
# if it passes, raise the cap in pyproject.toml to the next release after the one it
# printed, and commit. Extra arguments go to pytest (e.g. tests/dask/test_dask_internals.py
# for the canaries alone). Uses its own environment, .venv-newest-dask; .venv is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-newest-dask
step() { echo "newest-dask: $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  fi
  "$VENV/bin/python" -m pip install -q -e ".[dev,bench]"
fi
step "upgrading dask and distributed to the newest release, whatever the cap says"
"$VENV/bin/python" -m pip install -q --upgrade --no-deps dask distributed
version=$("$VENV/bin/python" -c "import distributed; print(distributed.__version__)")
step "distributed $version: the canaries first, then the suite"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/dask/test_dask_internals.py
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
step "passed on distributed $version: the cap in pyproject.toml may move past it"
