#!/usr/bin/env bash
# The test command: set up .venv, check style and types, build the docs, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy  # settings and strictness: [tool.mypy] in pyproject.toml
# The documentation with warnings as errors, into a throwaway directory (never --quiet:
# it hides the warnings that --strict turns into a failure).
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
.venv/bin/mkdocs build --strict --site-dir "$site"
.venv/bin/python -m pytest "$@"
