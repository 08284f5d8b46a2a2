#!/usr/bin/env bash
# Create or update the project's virtual environment (.venv) with everything it needs.
# On a machine without an NVIDIA GPU, pin the local CPU build of torch first so that the
# project's torch>= range is already met and pip never pulls a multi-GB CUDA build.
# Prints one line per step while it installs (the first run takes a few minutes, mostly
# downloading torch); nothing once .venv is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
stamp=.venv/.hybridflow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  started=$SECONDS
  step "upgrading pip"
  .venv/bin/python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
      step "no NVIDIA GPU: installing the CPU build of torch 2.13.0 (about 200 MB)"
      .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
  fi
  step "installing hybridflow-dask and its dependencies (dask, distributed, tensordict, ...)"
  .venv/bin/python -m pip install -q -e ".[dev,bench]"
  touch "$stamp"
  step "done in $((SECONDS - started)) s"
fi
