#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv) with everything it needs.
# On a machine without an NVIDIA GPU, pin the local CPU build of torch first so that the
# project's torch>= range is already met and pip never pulls a multi-GB CUDA build.
# Prints one "setup: ..." line per step while it installs and nothing else (the first run
# takes a few minutes, mostly downloading torch); nothing at all once .venv is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup: $*" >&2; }
# pip's own chatter (index warnings, setuptools' "Editable installation" notice) goes to
# a log, shown only when a step fails, so a working set-up prints its setup: lines alone.
log=.venv-setup.log
quietly() {
  if ! "$@" >"$log" 2>&1; then
    echo "setup: failed: $*" >&2
    cat "$log" >&2
    echo "setup: (this output is kept in $log)" >&2
    return 1
  fi
}
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  quietly "$PY" -m venv .venv
fi
stamp=.venv/.hybridflow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  started=$SECONDS
  step "upgrading pip"
  quietly .venv/bin/python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
      step "no NVIDIA GPU: installing the CPU build of torch 2.13.0 (about 200 MB)"
      quietly .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
  fi
  step "installing hybridflow-dask and its dependencies (dask, distributed, tensordict, ...)"
  quietly .venv/bin/python -m pip install -q -e ".[dev,bench]"
  touch "$stamp"
  rm -f "$log"
  step "done in $((SECONDS - started)) s"
fi
