#!/usr/bin/env bash
# The main job: set up .venv and run the end-to-end demo on an embedded local cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/hybridflow-dask demo "$@"
